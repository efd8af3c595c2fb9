"""One way to forget: every cache that holds decisions, or things made from them, subscribes to `caches.on_forget`,
and whatever changes what decisions depend on (the registry, `auto`'s tuning) calls `caches.forget()`.

The caches: the decisions themselves, the eager path's fast keys (and its shapes-only set), the traced plans'
candidates (a compiled graph re-plans once they are gone) and `auto`'s in-memory choices. That the fast key tells
apart every call the decision's key does is a property (tests/test_lanes.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dispatcher
from dispatcher import HubKernel, auto, caches, compiled, decisions, eager, env, hub, registry
from dispatcher.auto import Tuner
from helpers import kernel_repos, tensors


def _sdpa_plus(offset: float):
    """A custom backend: SDPA's result plus `offset`, so a test can tell which registration served a call."""
    def attention(query, key, value, *, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                  enable_gqa=False, return_lse=False):
        out = F.scaled_dot_product_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                                             is_causal=is_causal, scale=scale).transpose(1, 2)
        return out + offset
    return attention


def _fill_every_cache(q, k, v):
    """One eager call, one traced call and one `auto` call: every cache built on decisions holds something."""
    dispatcher.dispatch_attention_fn(q, k, v, backend="native")
    torch.compile(lambda q, k, v: dispatcher.dispatch_attention_fn(q, k, v, backend="native"),
                  backend="eager", fullgraph=True)(q, k, v)
    dispatcher.dispatch_attention_fn(q, k, v, backend="auto_exact")
    held = {"decisions": dict(decisions._decisions), "fast keys": dict(eager._fast),
            "shapes-only backends": set(eager._shapes_only), "traced candidates": dict(compiled._traced_candidates),
            "auto's choices": dict(auto.default_tuner().store.choices)}
    assert all(held.values()), {name: len(cache) for name, cache in held.items()}


def _held():
    return {"decisions": len(decisions._decisions), "fast keys": len(eager._fast),
            "shapes-only backends": len(eager._shapes_only), "traced candidates": len(compiled._traced_candidates),
            "auto's choices": len(auto.default_tuner().store.choices)}


TRIGGERS = {
    "register a backend": lambda q: dispatcher.register_backend("forgetful", _sdpa_plus(0.0)),
    "replace a backend": lambda q: dispatcher.register_backend("kept", _sdpa_plus(1.0), replace=True),
    "remove a backend": lambda q: dispatcher.unregister_backend("kept"),
    "set the priority": lambda q: registry.set_priority(registry.priority()),
    "clear auto's cache": lambda q: auto.clear_cache(disk=False),
    "tune again": lambda q: auto.tune(q, force=True),
    "install a tuner": lambda q: auto.set_default_tuner(Tuner(cache_path=None, backends=("native", "flex"))),
}


@pytest.mark.slow
@pytest.mark.parametrize("trigger", list(TRIGGERS))
def test_every_change_decisions_depend_on_empties_every_cache_built_on_them(trigger):
    dispatcher.register_backend("kept", _sdpa_plus(0.0))
    with auto.using(Tuner(cache_path=None, backends=("native", "flex"))):
        q, k, v = tensors.qkv(b=1, lq=16, h=2, d=16)
        _fill_every_cache(q, k, v)
        TRIGGERS[trigger](q)
        held = _held()
        if trigger == "tune again":  # it forgets, then keeps the choice it just made
            assert held.pop("auto's choices") == 1
        assert set(held.values()) == {0}, held


def test_one_mechanism_forgets():
    """The old second hook list (decisions._forget_hooks) is gone; the eager path and the traced plans subscribe."""
    assert not hasattr(decisions, "_forget_hooks")
    subscribed = caches._subscribers
    assert decisions.forget in subscribed and auto.forget_choices in subscribed
    for cache in (eager._fast, eager._shapes_only, compiled._traced_candidates):
        assert any(getattr(callback, "__self__", None) is cache for callback in subscribed)


def test_a_replaced_or_removed_backend_is_never_served_again_eagerly_or_compiled():
    """The served function changes with the registration at the next call, eager and compiled (the compiled graph
    re-plans: its candidate is gone), and a removed backend raises as an unknown one."""
    q, k, v = tensors.qkv(b=1, lq=16, h=2, d=16)
    expected = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    def model(q, k, v):  # the guard is off: a guarded custom kernel would run as the opaque op, not a traced plan
        return dispatcher.dispatch_attention_fn(q, k, v, backend="mine", guard="off")
    traced = torch.compile(model, backend="eager")
    for offset in (0.0, 100.0):
        dispatcher.register_backend("mine", _sdpa_plus(offset), replace=True)
        for _ in range(2):  # the first call decides, the second takes the fast key
            torch.testing.assert_close(model(q, k, v), expected + offset)
            torch.testing.assert_close(traced(q, k, v), expected + offset)
    dispatcher.unregister_backend("mine")
    for run in (model, traced):
        with pytest.raises(dispatcher.UnknownBackendError, match="'mine'"):
            run(q, k, v)


def test_a_trust_change_reaches_the_next_call_through_the_keys(monkeypatch, tmp_path):
    """Trust is not forgotten but keyed (trust.scope_key() in the decision's key and, for a decision that depends on
    it, beside the fast key): a decision made under one trust setting is never served under another."""
    pytest.importorskip("kernels")
    monkeypatch.delenv(env.TRUST_REMOTE_KERNELS, raising=False)
    repo = kernel_repos.make_local_repo(tmp_path, "someorg/attn-trust-keys")
    monkeypatch.setenv("LOCAL_KERNELS", kernel_repos.local_kernels_value(repo))
    hub.forget_loaded()
    dispatcher.register_backend("remote", registry.get("flash_hub").fn, devices=("cpu",), hub_kernel=HubKernel(
        repo.repo_id, "flash_attn_func", version=1))
    q, k, v = tensors.qkv(b=1, lq=16, h=2, d=16)
    recorder = dispatcher.Recorder()
    with dispatcher.recording(recorder):
        for trusted in (False, True, False, True):
            if trusted:
                monkeypatch.setenv(env.TRUST_REMOTE_KERNELS, "true")
            else:
                monkeypatch.delenv(env.TRUST_REMOTE_KERNELS, raising=False)
            for _ in range(2):  # the first call of each setting decides, the second takes the fast key
                dispatcher.dispatch_attention_fn(q, k, v, backend="remote")
    rows = {row["served"]: row["calls"] for row in recorder.snapshot()["rows"]}
    assert rows == {"native": 4, "remote": 4}
    hub.forget_loaded()
