"""Cache keys: each cache's key is one named, frozen value built by one function, and the machine in every key is
`Machine.key` (its fingerprint's hash, worked out once per Machine): equal machines share their decisions and
availability, and `auto`'s choices no longer hash the machine's description on every call."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import torch

from dispatcher import decisions, hub, registry
from dispatcher.auto import TuneKey, Tuner
from dispatcher.guard import settings as guard_settings
from dispatcher.inputs import describe_call
from dispatcher.machine import Machine, current_machine, use_machine
from dispatcher.spec import HubKernel


def _inputs():
    q = torch.randn(1, 8, 2, 16)
    return q, describe_call(q, q, q, None, 0.0, False, None, False, False, "BSHD")


def test_the_machine_key_is_the_disk_caches_fingerprint_hash_worked_out_once():
    machine = current_machine()
    # the disk cache has always keyed a machine so: its saved decisions stay this machine's
    expected = hashlib.sha256(json.dumps(machine.fingerprint(), sort_keys=True).encode()).hexdigest()[:16]
    assert machine.key == expected and "key" in vars(machine)  # kept on the Machine after the first use
    assert dataclasses.replace(machine).key == machine.key  # the same description, another object: one identity
    assert machine.with_packages(**{"my-kernel": "1.0"}).key != machine.key
    assert dataclasses.replace(machine, simulated=True).key != machine.key  # never a real machine's decisions


def test_equal_machines_share_their_decisions_and_availability():
    _, inputs = _inputs()
    guard = guard_settings("off", None)
    first = decisions.decision_for("native", "fallback", inputs, "BSHD", "m", guard)
    with use_machine(dataclasses.replace(current_machine())):  # a new object describing this machine
        again = decisions.decision_for("native", "fallback", inputs, "BSHD", "m", guard)
        available = registry.requirement_check("native")
    assert again is first
    assert registry.requirement_check("native") is available
    key = decisions.decision_key("native", "fallback", inputs, "BSHD", "m", guard)
    assert decisions._decisions[key] is first and key.machine == current_machine().key


def test_autos_choice_key_reads_the_machine_key_not_its_description(monkeypatch):
    _, inputs = _inputs()
    tuner = Tuner(cache_path=None, backends=("_native_math",))
    tuner.decide(inputs, model="m")
    described = []
    original = Machine.fingerprint
    monkeypatch.setattr(Machine, "fingerprint", lambda self: described.append(1) or original(self))
    for _ in range(3):
        assert tuner.decide(inputs, model="m")[0] == "_native_math"
    assert described == []  # a hit hashed the machine's description on every call before
    (key,) = tuner.store.choices
    assert isinstance(key, TuneKey) and key.machine == current_machine().key
    (record,) = tuner.records()
    assert key.tuning() == record.key and tuner.store.records[record.key] is record


def test_a_hub_load_is_keyed_by_the_build_it_gets():
    kernel = HubKernel("org/kernel", "attn", version=1)
    assert hub.LoadKey.of(kernel, None) == ("org/kernel", 1, None, "attn")
    assert hub.LoadKey.of(kernel, "abc123") == ("org/kernel", None, "abc123", "attn")  # a pin names the build
