"""The tuner's parts: a candidate-set rule declared on the spec and read for any backend (candidates.py), one key
for everything the tuner remembers with the disk's key made from it (store.py, record.py), and the exact pick
without a verdict made by `decisions.exact_stand_in` alone."""

from __future__ import annotations

import torch

from dispatcher import AttentionInputs, decisions, registry, spec
from dispatcher.auto import TuneKey, Tuner
from dispatcher.auto import cache as disk_cache
from helpers import fake_clock
from helpers.tensors import sdpa

SIG = AttentionInputs.of(1, 2, 32, 16, dtype=torch.float32, device="cpu")


def _add(name, **fields):
    registry.add(spec.BackendSpec(name=name, family="test", description="test", fn=sdpa, devices=frozenset({"cpu"}),
                                  dtypes=spec.FLOATS, head_dims=spec.HeadDims(1, 256), custom=True, **fields))
    return name


def test_a_last_resort_is_declared_on_the_spec_and_read_for_any_backend():
    """No family is named in auto: a backend whose spec says so is left out on those device kinds, with its own
    reason, wherever another candidate can run the call, and stays where it is the only one (flex on a CPU)."""
    rule = spec.LastResort(frozenset({"cpu"}), "t_lr_eager is slow on a CPU")
    last, other = _add("t_lr_eager", auto_last_resort=rule), _add("t_lr_other")
    names, skipped, _ = Tuner(cache_path=None, backends=(last, other)).candidates(SIG)
    assert names == [other] and dict(skipped)[last] == [rule.reason]
    assert Tuner(cache_path=None, backends=(last,)).candidates(SIG)[0] == [last]
    on_gpu = _add("t_lr_gpu_only", auto_last_resort=spec.LastResort(frozenset({"cuda"}), "not here"))
    assert Tuner(cache_path=None, backends=(on_gpu, other)).candidates(SIG)[0] == [other, on_gpu]
    assert registry.get("flex").auto_last_resort.devices == {"cpu"}  # the one built-in that declares it


def test_everything_the_tuner_remembers_is_under_one_key_and_the_disk_key_is_made_from_it(tmp_path, monkeypatch):
    fake_clock.use(monkeypatch)
    names = _add("t_key_a"), _add("t_key_b")
    path = tmp_path / "tune.sqlite3"
    t = Tuner(cache_path=path, backends=names)
    q, k, v = (torch.randn(1, 32, 2, 16) for _ in range(3))
    record = t.tune(q, k, v, model="m")
    assert record.source == "timed"
    store = t.store
    tables = (store.choices, store.records, store.timings, store.verdicts, store.spent)
    assert all(table for table in tables) and all(isinstance(key, TuneKey) for table in tables for key in table)
    (choice,) = store.choices
    assert choice.tuning() == record.key and store.records[record.key] is record
    assert record.key.disk() == record.key.shared().disk() == choice.disk()
    assert disk_cache.lookup(path, choice.disk())["candidates"] == list(names)
    again = Tuner(cache_path=path, backends=names).tune(q, k, v, model="m")
    assert again.source == "disk" and again.chosen == record.chosen


def test_without_a_verdict_the_exact_pick_is_exact_stand_ins(monkeypatch):
    """No time to judge (a zero budget): the first exact candidate in priority order serves, as
    `decisions.exact_stand_in` walks auto's candidates; the quantised first one's own chain would say another."""
    quantised = _add("t_pref_q", quantised=True, fallback=("t_pref_exact_2", "native"))
    first, second = _add("t_pref_exact_1"), _add("t_pref_exact_2")
    asked = []
    real = decisions.exact_stand_in
    monkeypatch.setattr(decisions, "exact_stand_in", lambda *a, **kw: asked.append((a, kw)) or real(*a, **kw))
    record = Tuner(cache_path=None, backends=(quantised, first, second), time_budget_s=0).tune(SIG)
    assert record.source == "preference" and record.chosen == first
    assert asked and asked[0][1]["among"] == [quantised, first, second]
    assert real(quantised) == second  # its fallback chain: not auto's order
