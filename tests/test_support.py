"""dispatcher/support.py: the one answer to "why can't backend X run (this call)", and everyone who asks it agreeing.

Real registry, real specs, real SDPA on the CPU; machines other than this one are simulated (`Machine`), as the
registry and install-plan tests do.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dispatcher
from dispatcher import BackendNotSupportedError, HubKernel, dispatch_attention_fn, registry, support
from dispatcher.auto import Tuner
from dispatcher.inputs import describe_call
from dispatcher.requirements import Package
from dispatcher.tools import install_plan
from helpers import node_stub
from helpers.pack import load_pack

MISSING = Package("attention-dispatch-no-such-package", "1.0", module="attention_dispatch_no_such_module")


def sdpa_bshd(q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          scale=scale).transpose(1, 2)


@pytest.fixture
def custom():
    """Register custom backends for one test; removed after it."""
    names = []

    def add(name, fn=sdpa_bshd, **fields):
        dispatcher.register_backend(name, fn, **{"devices": ("cpu",), **fields})
        names.append(name)
        return name
    yield add
    for name in names:
        dispatcher.unregister_backend(name)


@pytest.fixture
def untrusted_env(monkeypatch):
    for var in ("DIFFUSERS_DISABLE_REMOTE_CODE", "DIFFUSERS_TRUST_REMOTE_KERNELS"):
        monkeypatch.delenv(var, raising=False)


def describe(q, k, v, **flags):
    return describe_call(q, k, v, None, 0.0, flags.get("is_causal", False), None, False, False, "BSHD")


def qkv(b=2, bk=None, dtype=torch.float16):
    bk = b if bk is None else bk
    return (torch.randn(b, 8, 2, 16, dtype=dtype), torch.randn(bk, 8, 2, 16, dtype=dtype),
            torch.randn(bk, 8, 2, 16, dtype=dtype))


# ------------------------------------------------------------------------------------- the owner's answer

def test_every_kind_of_reason_in_one_fixed_order(custom, untrusted_env):
    """machine, trust, input limits, semantics, attention_kwargs: one backend that fails each, in that order."""
    def windowed(q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, softcap=None):
        return sdpa_bshd(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa, return_lse=return_lse)
    name = custom("t_everything", windowed, dtypes=(torch.float32,), requires=(MISSING,),
                  hub_kernel=HubKernel("untrusted-publisher/attention", "attn"))
    q, k, v = qkv(bk=1, dtype=torch.float16)
    why = support.why_not(name, describe(q, k, v), attention_kwargs={"window_size": (4, 4), "softcap": 1.0})

    assert why.machine == tuple(registry.requirement_reasons(name)) and "is not installed" in why.machine[0]
    (untrusted,) = why.trust
    assert "untrusted-publisher" in untrusted and "DIFFUSERS_TRUST_REMOTE_KERNELS" in untrusted
    assert why.inputs == ("dtype float16 is not supported (supported: float32)",)
    (semantic,) = why.semantics
    assert semantic.startswith("key/value batch 1 broadcast over query batch 2 is not supported")
    assert "native" in semantic  # names the backends that do broadcast
    (kwarg,) = why.attention_kwargs  # softcap is in its signature: honoured
    assert kwarg.startswith("attention_kwargs key 'window_size' is honoured by ") and "flash" in kwarg
    assert why.rules == () and not why.runs
    assert why.reasons == [*why.machine, *why.trust, *why.inputs, *why.semantics, *why.attention_kwargs]
    assert support.reasons(name, describe(q, k, v), attention_kwargs={"window_size": 1}) == why.reasons


def test_without_inputs_it_answers_for_the_machine_alone(custom, untrusted_env):
    name = custom("t_machine_only", requires=(MISSING,), hub_kernel=HubKernel("untrusted-publisher/x", "attn"))
    why = support.why_not(name)
    assert why.machine and why.trust and not (why.inputs or why.semantics or why.attention_kwargs)
    assert support.availability_reasons(name) == why.reasons == dispatcher.availability_reasons(name)
    with dispatcher.trusted_publishers(["untrusted-publisher"]):
        assert support.why_not(name).trust == ()
    assert support.why_not("native").runs and support.availability_reasons("native") == []


def test_what_rules_the_machine_out_is_said_alone(untrusted_env):
    """A kernel this machine's device rules out: its one reason, not also that the call's device and dtype are
    beyond its limits, nor trust, nor a key (issue #48: "needs an NVIDIA CUDA GPU; this machine has a CPU; device
    cpu is not supported (supported: cuda); dtype float32 is not supported (...)")."""
    q, k, v = qkv(dtype=torch.float32)
    why = support.why_not("flash", describe(q, k, v), attention_kwargs={"window_size": (4, 4)})
    assert why.reasons == ["needs an NVIDIA CUDA GPU; this machine has a CPU"], why
    assert why.reasons == support.availability_reasons("flash")
    hub = support.why_not("sage_hub", describe(q, k, v))  # a Hub kernel from a publisher not trusted by default
    assert hub.reasons == ["needs an NVIDIA CUDA GPU; this machine has a CPU"], hub


def test_a_recorded_fallback_names_each_backend_once():
    """The Recorder's text after "asked for sage": the reasons, without "sage: " again (issue #48: "(asked for sage:
    sage: needs an NVIDIA CUDA GPU; this machine has a CPU; sage: device cpu is not supported ...)")."""
    q, k, v = qkv(dtype=torch.float32)
    recorder = dispatcher.Recorder(label="test")
    dispatch_attention_fn(q, k, v, backend="sage", recorder=recorder)
    (line,) = [x for x in recorder.summary().splitlines() if "asked for" in x]
    assert line.endswith("(asked for sage: needs an NVIDIA CUDA GPU; this machine has a CPU)"), line
    fallback_text = dispatcher.report.fallback_text
    assert fallback_text("sage", ["sage: a; b", "sage: c", "sage_hub: d", "sage_hub: e", "native: d"]) == \
        "a; b; c; sage_hub: d; e; native: d"
    assert fallback_text("sage", ["sage_hub: d", "sage: c"]) == "sage_hub: d; sage: c"  # named where it is not first


def test_a_simulated_machine_is_answered_for_that_machine():
    h200 = install_plan.simulated("h200")
    assert support.why_not("flash", machine=h200).machine == tuple(registry.requirement_reasons("flash", h200))
    assert any("flash-attn" in r for r in support.availability_reasons("flash", h200))
    assert support.availability_reasons("_native_cudnn", h200) == []


def test_a_raising_check_refuses_that_backend_only(custom):
    def broken(inputs):
        raise RuntimeError("limit table missing")
    name = custom("t_broken_check")
    registry.add(__import__("dataclasses").replace(registry.get(name), extra_reasons=broken), replace=True)
    q, k, v = qkv()
    assert support.reasons(name, describe(q, k, v)) == [
        "its input check failed (RuntimeError: limit table missing)"]
    assert support.why_not("native", describe(q, k, v)).runs
    assert support.why_not(name).runs  # the machine alone never reads the inputs


def test_a_key_that_repeats_an_argument_is_refused_by_every_backend():
    q, k, v = qkv()
    for name in ("native", "flex"):
        assert support.why_not(name, describe(q, k, v), attention_kwargs={"scale": 0.5}).attention_kwargs == (
            "attention_kwargs key 'scale' repeats an argument of dispatch_attention_fn: pass scale=... as an "
            "argument",)


def test_unknown_backend_raises():
    with pytest.raises(dispatcher.UnknownBackendError, match="Did you mean 'native'"):
        support.why_not("nativ")


# ------------------------------------------------------------------------------- everyone agrees with it

def test_a_semantic_refusal_is_the_same_for_the_decision_and_auto(custom):
    """A backend whose only problem is semantic (no broadcasting of a key/value batch of 1): the strict decision
    refuses it, `auto`'s candidates skip it, both with the owner's reason, and auto never times it."""
    name = custom("t_no_broadcast")
    q, k, v = qkv(bk=1, dtype=torch.float32)
    inputs = describe(q, k, v)
    why = support.why_not(name, inputs)
    assert why.semantics and not (why.machine or why.trust or why.inputs or why.attention_kwargs)
    with pytest.raises(BackendNotSupportedError) as refused:
        dispatch_attention_fn(q, k, v, backend=name, policy="strict")
    assert refused.value.skipped == [(name, why.reasons)]
    tuner = Tuner(cache_path=None, backends=[name, "native"])
    names, skipped, _ = tuner.candidates(inputs, exact=True)
    assert names == ["native"] and dict(skipped)[name] == why.reasons
    record = tuner.tune(q, k, v, exact=True)
    assert [c.name for c in record.candidates] == ["native"] and dict(record.skipped)[name] == why.reasons


def test_a_machine_refusal_reads_the_same_everywhere(custom, monkeypatch):
    """One backend this machine cannot run: the install plan, the listing (the dropdown's reasons, GET /backends),
    the queue-time check of the nodes, validate_backend, the decision and auto all give the owner's text."""
    name = custom("t_needs_package", requires=(MISSING,))
    reasons = support.availability_reasons(name)
    assert reasons and reasons == list(support.why_not(name).machine)

    plan = install_plan.build(lock={})
    assert plan.get(name).reasons == reasons
    assert {s.name: s.reasons for s in dispatcher.list_backends()}[name] == reasons

    # The nodes run on the pack's own copy of the library (imported as ComfyUI imports it): the same backend there.
    nodes = node_stub.install(monkeypatch)
    _, pack, _ = load_pack()
    pack.register_backend(name, sdpa_bshd, devices=("cpu",), requires=(MISSING,))
    try:
        assert pack.support.availability_reasons(name) == reasons
        options = nodes.backend_options()
        runs_here = [n for n in options[3:] if not pack.availability_reasons(n)]
        assert name in options[3 + len(runs_here):]  # listed among those that cannot run here
        message = nodes.unavailable_message(name, "strict")
        assert message.startswith(f"attention backend '{name}' cannot run on this machine (policy strict): "
                                  + "; ".join(reasons))
    finally:
        pack.unregister_backend(name)

    with pytest.raises(dispatcher.BackendUnavailableError) as unavailable:
        dispatcher.validate_backend(name)
    assert unavailable.value.reasons == reasons

    q, k, v = qkv(dtype=torch.float32)
    with pytest.raises(BackendNotSupportedError) as refused:
        dispatch_attention_fn(q, k, v, backend=name, policy="strict")
    assert refused.value.skipped == [(name, reasons)]
    _, skipped, _ = Tuner(cache_path=None, backends=[name, "native"]).candidates(describe(q, k, v))
    assert dict(skipped)[name] == reasons


def test_auto_honours_the_calls_attention_kwargs_as_the_decision_does(custom):
    """A call with attention_kwargs: a backend that would drop a key is never timed by auto (the decision would
    not run it), and one whose signature takes it is."""
    def windowed(q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, window=None):
        return sdpa_bshd(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa, return_lse=return_lse)
    honours = custom("t_windowed", windowed)
    q, k, v = qkv(dtype=torch.float32)
    inputs = describe(q, k, v)
    tuner = Tuner(cache_path=None, backends=[honours, "native"])
    names, skipped, _ = tuner.candidates(inputs, attention_kwargs=("window",))
    assert names == [honours]
    assert dict(skipped)["native"] == support.reasons("native", inputs, attention_kwargs=("window",))
    kept = support.candidates_for_attention_kwargs(
        "native", "fallback", [(n, registry.get(n), None) for n in ("native", honours)], {"window": 1})
    assert [c[0] for c in kept] == [honours]  # the decision's per-call filter: the same answer
    assert tuner.candidates(inputs)[0] == ["native", honours]  # without the key both compete
    with dispatcher.auto.using(tuner):
        out = dispatch_attention_fn(q, k, v, backend="auto_exact", attention_kwargs={"window": 1})
    assert torch.allclose(out, sdpa_bshd(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                         enable_gqa=False, return_lse=False))
    (record,) = tuner.records()
    assert record.attention_kwargs == ("window",) and record.chosen == honours


def test_auto_decides_again_when_the_same_signature_comes_with_attention_kwargs(custom):
    """One signature called first without attention_kwargs, then with a key only one kernel honours: the second
    call is auto's own decision among the kernels that honour the key (not the first call's pick, filtered)."""
    def windowed(q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, window=None):
        return sdpa_bshd(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                         enable_gqa=enable_gqa, return_lse=return_lse)
    honours = custom("t_windowed_later", windowed)
    q, k, v = qkv(dtype=torch.float32)
    tuner = Tuner(cache_path=None, backends=["native", honours])
    rec = dispatcher.Recorder()
    with dispatcher.auto.using(tuner), dispatcher.recording(rec):
        dispatch_attention_fn(q, k, v, backend="auto_exact", policy="strict")
        out = dispatch_attention_fn(q, k, v, backend="auto_exact", policy="strict", attention_kwargs={"window": 1})
    assert torch.allclose(out, sdpa_bshd(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                         enable_gqa=False, return_lse=False))
    assert [r.attention_kwargs for r in tuner.records()] == [(), ("window",)]
    assert tuner.records()[1].chosen == honours and rec.served_by(honours) >= 1


def test_autos_own_rules_sit_on_top_of_the_owner(custom):
    """auto_exact times exact kernels only, and auto never downloads: both are `rules` reasons after the owner's."""
    quantised = custom("t_quantised", quantised=True)
    q, k, v = qkv(dtype=torch.float32)
    inputs = describe(q, k, v)
    why = support.for_auto(quantised, inputs, exact_only=True)
    assert why.rules == ("a quantised kernel: auto_exact runs exact kernels only",)
    assert why.reasons == support.reasons(quantised, inputs) + list(why.rules)
    assert support.for_auto(quantised, inputs, exact_only=False).runs
    hub_kernel = HubKernel("kernels-community/attention-dispatch-test", "attn")
    with dispatcher.trusted_publishers(["kernels-community"]):
        fetchable = custom("t_hub", hub_kernel=hub_kernel)
        why = support.for_auto(fetchable, inputs, exact_only=True)
        assert why.reasons == [why.rules[0]] and "auto never downloads code" in why.rules[0]
        assert support.for_auto(fetchable, inputs, exact_only=True, fetched={hub_kernel.repo_id}).runs
        assert support.trust_decides(fetchable, why, exact_only=True)
    assert not support.trust_decides(quantised, why, exact_only=True)  # not a Hub kernel


# ------------------------------------------------------------------------------------------ the hot path

def test_repeat_calls_never_ask_the_owner(monkeypatch):
    """Decisions are cached: the owner answers a signature's first call, never its repeats."""
    asked = []
    original = support.why_not

    def counting(*args, **kwargs):
        asked.append(args[0])
        return original(*args, **kwargs)
    monkeypatch.setattr(support, "why_not", counting)
    dispatcher.caches.forget()
    q, k, v = (torch.randn(1, 8, 2, 16) for _ in range(3))
    dispatch_attention_fn(q, k, v, backend="native")
    first = len(asked)
    assert first >= 1
    for _ in range(3):
        dispatch_attention_fn(q, k, v, backend="native")
    assert len(asked) == first
