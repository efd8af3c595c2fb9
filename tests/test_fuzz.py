"""Bad input never costs a run: hypothesis over `dispatch_attention_fn`, the ComfyUI adapter and the node inputs.

The property, for every generated call:
- a valid call returns the float64 reference (within the dtype's rounding; never NaN), and under the
  fallback policy it always succeeds, recording who served it and why when that is not the backend asked for;
- anything else raises a documented error (AttentionInputError, UnknownBackendError, BackendNotSupportedError,
  BackendUnavailableError, or TypeError/ValueError) whose message names the bad argument; never
  AttributeError/IndexError/RuntimeError from deep inside a kernel, never a silent wrong result;
- a bad call changes nothing for good ones: the same valid call afterwards is served by the same backend
  with the same result (a kernel rejecting a bad argument must not get demoted), and the active backend,
  policy and checks are as before.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

import dispatcher
from dispatcher import (AttentionInputError, BackendNotSupportedError, BackendUnavailableError, Recorder,
                        UnknownBackendError, dispatch_attention_fn, recording, state)
from dispatcher import auto as tuner

from helpers import node_stub
from helpers.pack import comfy_func, load_pack

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# ATTN_FUZZ_EXAMPLES=5000 ATTN_FUZZ_RANDOM=1 searches harder (new inputs each run); CI replays a fixed set.
FUZZ = settings(max_examples=int(os.environ.get("ATTN_FUZZ_EXAMPLES", "150")), deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture],
                derandomize=not os.environ.get("ATTN_FUZZ_RANDOM"), database=None)
DOCUMENTED = (AttentionInputError, UnknownBackendError, BackendNotSupportedError, BackendUnavailableError, TypeError,
              ValueError)
BACKENDS = ["native", "flex", "_native_math", "_native_flash", "_native_efficient", "_native_cudnn", "flash", "sage",
            "xformers", "flash_hub", "auto", None]
TOL = {torch.float64: 1e-9, torch.float32: 5e-5, torch.float16: 1.5e-2, torch.bfloat16: 6e-2}
FLOAT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]



@pytest.fixture(autouse=True)
def fast_auto():
    """`auto` decides by declared preference (no timing, no disk cache) so a fuzz run stays fast."""
    with tuner.using(tuner.Tuner(cache_path=None, max_signatures=0)):
        yield


# ------------------------------------------------------------------------------------------------ reference

def to_4d(mask, batch, len_q):
    """SDPA's reading (right-aligned), and diffusers' 2-D (B, Lk) key padding where SDPA's cannot apply."""
    if mask.dim() == 2 and mask.shape[0] == batch and batch not in (1, len_q):
        return mask[:, None, None, :]
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def reference(q, k, v, mask=None, is_causal=False, scale=None, layout="BSHD"):
    """Exact attention in float64 (BHSD inside), the output in `layout`, and the log-sum-exp."""
    if layout == "BSHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.double() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ k.transpose(-1, -2) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2], s.shape[-1], dtype=torch.bool).tril(), float("-inf"))
    if mask is not None:
        m = to_4d(mask, q.shape[0], q.shape[2])
        s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    lse = torch.logsumexp(s, -1)
    out = torch.exp(s - lse[..., None]) @ v
    if layout == "BSHD":
        return out.transpose(1, 2), lse.transpose(1, 2)
    return out, lse


# ------------------------------------------------------------------------------------------------ valid calls

@st.composite
def tensor_of(draw, shape, dtype, gen_seed):
    """A tensor of `shape`, sometimes a non-contiguous view (a transpose of another layout, or every other element)."""
    g = torch.Generator().manual_seed(gen_seed)
    kind = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    if kind == "transposed":
        base = torch.randn(shape[0], shape[2], shape[1], shape[3], generator=g).to(dtype)
        return base.transpose(1, 2)
    if kind == "strided":
        return torch.randn(*shape[:-1], shape[-1] * 2, generator=g).to(dtype)[..., ::2]
    return torch.randn(*shape, generator=g).to(dtype)


@st.composite
def valid_calls(draw):
    b, lq, lk = draw(st.integers(1, 2)), draw(st.integers(1, 9)), draw(st.integers(1, 9))
    hk, groups = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    hq, d = hk * groups, draw(st.sampled_from([1, 3, 8, 16]))
    dtype = draw(st.sampled_from(FLOAT_DTYPES))
    layout = draw(st.sampled_from(["BSHD", "BHSD"]))
    seed = draw(st.integers(0, 2**16))

    def shape(s, h):
        return (b, s, h, d) if layout == "BSHD" else (b, h, s, d)

    q = draw(tensor_of(shape(lq, hq), dtype, seed))
    k = draw(tensor_of(shape(lk, hk), dtype, seed + 1))
    v = draw(tensor_of(shape(lk, hk), dtype, seed + 2))
    mask_kind = draw(st.sampled_from(["none", "none", "bool", "key_padding", "additive", "additive_other"]))
    mask = None
    g = torch.Generator().manual_seed(seed + 3)
    if mask_kind != "none":
        rank = draw(st.sampled_from([2, 4])) if mask_kind == "key_padding" else draw(st.integers(2, 4))
        full = {2: (lq, lk), 3: (hq, lq, lk), 4: (b, hq, lq, lk)}[rank]
        if mask_kind == "key_padding":
            full = (b, 1, 1, lk) if rank == 4 else (b, lk)  # 2-D: diffusers' (B, Lk) key padding
        # any axis but the key axis may broadcast
        mshape = tuple(1 if (i < len(full) - 1 and draw(st.booleans())) else n for i, n in enumerate(full))
        keep = torch.rand(mshape, generator=g) > 0.4
        keep[..., 0] = True  # every query row attends to something (a fully masked row has no exact answer)
        if mask_kind in ("bool", "key_padding"):
            mask = keep
        else:
            bias = torch.randn(mshape, generator=g).masked_fill(~keep, float("-inf"))
            other = draw(st.sampled_from([t for t in FLOAT_DTYPES if t != dtype]))
            mask = bias.to(dtype if mask_kind == "additive" else other)
        if mask.dim() == 2 and mask.shape[0] == b == lq > 1:  # refused as ambiguous ((Lq, Lk) or (B, Lk)): say which
            mask = mask[:, None, None, :] if mask_kind == "key_padding" else mask[None, None]
    is_causal = draw(st.booleans())  # with a mask too: key 0 stays visible, so no row is hidden entirely
    scale = draw(st.one_of(st.none(), st.floats(-2, 2, allow_nan=False), st.integers(-2, 2)))
    return dict(query=q, key=k, value=v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=groups > 1,
                layout=layout, return_lse=draw(st.booleans()))


def describe(call) -> str:
    parts = []
    for name, value in call.items():
        if isinstance(value, torch.Tensor):
            parts.append(f"{name}={tuple(value.shape)}:{str(value.dtype)[6:]}{'' if value.is_contiguous() else ' view'}")
        else:
            parts.append(f"{name}={value!r}")
    return ", ".join(parts)


def state_now():
    return (state.active_backend(), state.active_policy(), state.active_checks())


def check_result(result, call, backend):
    expected, expected_lse = reference(call["query"], call["key"], call["value"], call["attn_mask"],
                                       call["is_causal"], call["scale"], call["layout"])
    out, lse = result if call["return_lse"] else (result, None)
    q, v = call["query"], call["value"]
    assert out.shape == expected.shape and out.dtype == q.dtype, (out.shape, expected.shape, out.dtype)
    assert torch.isfinite(out).all(), f"{backend}: non-finite output for valid inputs"
    tol = TOL[q.dtype] * max(1.0, float(v.double().abs().max()))
    err = float((out.double() - expected).abs().max())
    assert err <= tol, f"{backend}: max error {err:.3g} > {tol:.3g}"
    if lse is not None:
        assert lse.shape == expected_lse.shape, (lse.shape, expected_lse.shape)
        lse_err = float((lse.double() - expected_lse).abs().max())
        assert lse_err <= max(TOL[q.dtype] * 10, 1e-4) * max(1.0, float(expected_lse.abs().max())), lse_err


def run(call, backend, policy, checks_mode="off", via_context=False):
    """(result, recorder snapshot): the call through `backend` given as argument or through attention_backend()."""
    recorder = Recorder()
    kwargs = {k: v for k, v in call.items()}
    with recording(recorder), dispatcher.attention_checks(checks_mode):
        if via_context and backend is not None:
            with dispatcher.attention_backend(backend, policy=policy):
                result = dispatch_attention_fn(**kwargs)
        else:
            result = dispatch_attention_fn(**kwargs, backend=backend, policy=policy)
    return result, recorder.snapshot()


def served_of(snapshot) -> str:
    (row,) = snapshot["rows"]
    assert row["calls"] == 1
    return row["served"]


@FUZZ
@given(call=valid_calls(), backend=st.sampled_from(BACKENDS), policy=st.sampled_from(["fallback", "strict"]),
       checks_mode=st.sampled_from(["off", "raise"]), via_context=st.booleans())
def test_valid_calls_are_exact_or_refused_with_the_reason(call, backend, policy, checks_mode, via_context):
    note(describe(call))
    before = state_now()
    try:
        result, snap = run(call, backend, policy, checks_mode, via_context)
    except (BackendNotSupportedError, BackendUnavailableError) as exc:
        # Only a backend that cannot run these inputs, named with its reasons; never under fallback for an
        # inputs-level reason (native and its math kernel run every valid call), except an unavailable
        # backend entered through attention_backend(), which validates eagerly.
        assert policy == "strict" or isinstance(exc, BackendUnavailableError), str(exc)
        assert str(backend if backend is not None else before[0]) in str(exc)
        assert state_now() == before
        return
    assert state_now() == before
    check_result(result, call, backend)
    served = served_of(snap)
    row = snap["rows"][0]
    requested = backend if backend is not None else before[0]
    if policy == "strict" and requested != "auto":
        assert served == requested
    if served != requested:
        assert requested == "auto" or row["fell_back"] and row["reasons"], row
    # The same call again: the same backend, the same numbers (the decision is cached, not changed).
    again, snap2 = run(call, backend, policy, checks_mode, via_context)
    assert served_of(snap2) == served
    torch.testing.assert_close(again, result, rtol=0, atol=0) if not call["return_lse"] else None


# ------------------------------------------------------------------------------------------------ odd calls

NAN = float("nan")


def _mutations():
    """name -> (mutate(call) -> call, words the error must contain (any of), what is allowed to happen).

    allowed: "raise" (a documented error), "run" (a valid call in disguise: it must run), "either"
    (NaN inputs with checks off: a result of the right shape or a documented error).
    """
    def set_(**changes):
        return lambda c: {**c, **changes}

    def tensor(name, fn):
        return lambda c: {**c, name: fn(c[name], c)}

    def q_of(c):
        return c["query"]

    return {
        "query None": (set_(query=None), ["query"], "raise"),
        "key list": (set_(key=[[1.0]]), ["key"], "raise"),
        "value int": (set_(value=3), ["value"], "raise"),
        "query numpy": (tensor("query", lambda t, c: t.numpy() if t.dtype != torch.bfloat16 else "x"), ["query"],
                        "raise"),
        "scale str": (set_(scale="0.5"), ["scale"], "raise"),
        "scale nan": (set_(scale=NAN), ["scale"], "raise"),
        "scale inf": (set_(scale=float("inf")), ["scale"], "raise"),
        "scale list": (set_(scale=[0.5]), ["scale"], "raise"),
        "scale 0-d tensor": (set_(scale=torch.tensor(0.5)), [], "run"),  # read as its value, as SDPA reads it
        "scale 1-D tensor": (set_(scale=torch.tensor([0.5])), ["scale", "SDPA refuses"], "raise"),
        "scale bool": (set_(scale=True), ["scale"], "raise"),
        "dropout negative": (set_(dropout_p=-0.1), ["dropout_p"], "raise"),
        "dropout nan": (set_(dropout_p=NAN), ["dropout_p"], "raise"),
        "dropout > 1": (set_(dropout_p=1.5), ["dropout_p"], "raise"),
        "dropout str": (set_(dropout_p="0.1"), ["dropout_p"], "raise"),
        "dropout None": (set_(dropout_p=None), ["dropout_p"], "raise"),
        "is_causal str": (set_(is_causal="no"), ["is_causal"], "raise"),
        "is_causal int": (set_(is_causal=1), ["is_causal"], "raise"),
        "is_causal None": (set_(is_causal=None), ["is_causal"], "raise"),
        "enable_gqa str": (set_(enable_gqa="yes"), ["enable_gqa"], "raise"),
        "return_lse tensor": (set_(return_lse=torch.tensor(True)), ["return_lse"], "raise"),
        "attention_kwargs list": (set_(attention_kwargs=["x"]), ["attention_kwargs"], "raise"),
        "attention_kwargs unknown key": (set_(attention_kwargs={"bogus_arg": 1}), ["bogus_arg"], "raise"),
        "backend unknown": (set_(backend="flash_attn_99"), ["flash_attn_99", "Valid backends"], "raise"),
        "backend int": (set_(backend=3), ["3", "Valid backends"], "raise"),
        "backend list": (set_(backend=["native"]), ["native", "Valid backends"], "raise"),
        "backend empty": (set_(backend=""), ["Valid backends"], "raise"),
        "policy unknown": (set_(policy="lenient"), ["lenient", "policy"], "raise"),
        "policy int": (set_(policy=0), ["policy"], "raise"),
        "layout unknown": (set_(layout="SBHD"), ["layout"], "raise"),
        "layout lowercase": (set_(layout="bshd"), ["layout"], "raise"),
        "mask list": (set_(attn_mask=[[True]]), ["attn_mask"], "raise"),
        "mask long": (tensor("query", lambda t, c: t) , [], "run"),  # placeholder replaced below
        "mask 1-D": (lambda c: {**c, "attn_mask": torch.ones(c["key"].shape[1 if c["layout"] == "BSHD" else 2],
                                                              dtype=torch.bool)}, ["attn_mask"], "raise"),
        "mask 5-D": (lambda c: {**c, "attn_mask": torch.ones(1, 1, 1, 1, 1, dtype=torch.bool)}, ["attn_mask"], "raise"),
        "mask 0-D": (set_(attn_mask=torch.tensor(0.0)), ["attn_mask"], "raise"),
        "mask meta device": (lambda c: {**c, "attn_mask": torch.zeros(1, 1, device="meta")}, ["attn_mask"], "raise"),
        "mask nan with checks": (lambda c: {**c, "attn_mask": torch.full((1, 1), NAN), "_checks": "raise"},
                                 ["attn_mask", "NaN"], "raise"),
        "mask with is_causal": (lambda c: {**c, "attn_mask": torch.ones(1, 1, dtype=torch.bool), "is_causal": True},
                                [], "run"),  # both apply, as in SDPA
        "query NaN, checks on": (lambda c: {**c, "query": q_of(c) * NAN, "_checks": "raise"}, ["query", "NaN"],
                                 "raise"),
        "value Inf, checks on": (lambda c: {**c, "value": c["value"] * float("inf"), "_checks": "raise"},
                                 ["value", "Inf"], "raise"),
        "query NaN, checks off": (lambda c: {**c, "query": q_of(c) * NAN}, [], "either"),
        "key dtype": (lambda c: {**c, "key": c["key"].to(torch.float64 if c["key"].dtype != torch.float64
                                                          else torch.float32)}, ["dtype"], "raise"),
        "query int dtype": (lambda c: {**c, **{n: c[n].to(torch.int64) for n in ("query", "key", "value")}},
                            ["dtype", "floating"], "raise"),
        "query bool dtype": (lambda c: {**c, **{n: c[n] > 0 for n in ("query", "key", "value")}},
                             ["dtype", "floating"], "raise"),
        "query complex": (lambda c: {**c, **{n: c[n].double().to(torch.complex64) for n in ("query", "key", "value")}},
                          ["dtype", "floating"], "raise"),
        "query 3-D": (lambda c: {**c, "query": c["query"][0]}, ["4-D"], "raise"),
        "all 5-D": (lambda c: {**c, **{n: c[n][None] for n in ("query", "key", "value")}}, ["4-D"], "raise"),
        # empty inputs give SDPA's result (masks of the base call may not broadcast to them: dropped)
        "empty query sequence": (lambda c: {**c, "attn_mask": None, "query": _narrow_seq(c, "query", 0)}, [], "run"),
        "empty key sequence": (lambda c: {**c, "attn_mask": None, **{n: _narrow_seq(c, n, 0) for n in ("key", "value")}},
                               [], "run"),
        "head dim 0": (lambda c: {**c, **{n: c[n][..., :0] for n in ("query", "key", "value")}}, ["head dim"], "raise"),
        "batch 0": (lambda c: {**c, "attn_mask": None, **{n: c[n][:0] for n in ("query", "key", "value")}}, [], "run"),
        "key head dim": (lambda c: {**c, "key": torch.cat([c["key"], c["key"][..., :1]], -1)}, ["head dim"], "raise"),
        "value length": (lambda c: {**c, "value": _narrow_seq(c, "value", 1) if _seq(c, "value") > 1
                                    else torch.cat([c["value"]] * 2, 1 if c["layout"] == "BSHD" else 2)},
                         ["sequence length"], "raise"),
        "batch mismatch": (lambda c: {**c, "key": torch.cat([c["key"]] * 2, 0)}, ["batch"], "raise"),
        # Key/value keep >= 2 heads: one key/value head without enable_gqa broadcasts, as in SDPA, and runs.
        "gqa without enable_gqa": (lambda c: {**c, "enable_gqa": False, "query": _repeat_heads(c, "query", 4),
                                              **{n: _repeat_heads(c, n, 2) for n in ("key", "value")}},
                                   ["enable_gqa", "heads"], "raise"),
        "heads not a multiple": (lambda c: {**c, "enable_gqa": True, **{n: _repeat_heads(c, n, 2) for n in
                                                                        ("key", "value")},
                                            "query": _odd_heads(c)}, ["heads"], "raise"),
        "meta tensors": (lambda c: {**c, "attn_mask": None, **{n: c[n].to("meta") for n in ("query", "key", "value")}},
                         ["meta"], "raise"),
        "backend None": (set_(backend=None), [], "run"),
        "dropout 0 as int": (set_(dropout_p=0), [], "run"),
        "scale numpy": (set_(scale=__import__("numpy").float32(0.25)), [], "run"),
    }


def _seq(c, name):
    return c[name].shape[1 if c["layout"] == "BSHD" else 2]


def _narrow_seq(c, name, length):
    return c[name].narrow(1 if c["layout"] == "BSHD" else 2, 0, length)


def _odd_heads(c):
    """The query with 2 * Hk + 1 heads: never a multiple of the 2 * Hk key/value heads of the mutation."""
    axis = 2 if c["layout"] == "BSHD" else 1
    heads = 2 * c["key"].shape[axis] + 1
    return torch.cat([c["query"]] * heads, axis).narrow(axis, 0, heads)


def _repeat_heads(c, name, times):
    return c[name].repeat_interleave(times, dim=2 if c["layout"] == "BSHD" else 1)


MUTATIONS = _mutations()
MUTATIONS["mask long"] = (lambda c: {**c, "attn_mask": torch.ones(1, 1, dtype=torch.long), "is_causal": False},
                          ["attn_mask", "integer"], "raise")
MUTATIONS["mask uint8"] = (lambda c: {**c, "attn_mask": torch.ones(1, 1, dtype=torch.uint8), "is_causal": False},
                           ["attn_mask", "integer"], "raise")
MUTATIONS["mask does not broadcast"] = (
    lambda c: {**c, "is_causal": False, "attn_mask": torch.ones(3, _seq(c, "query") + 1, _seq(c, "key"),
                                                                dtype=torch.bool)}, ["attn_mask", "broadcast"], "raise")
MUTATIONS["mask other float dtype"] = (
    lambda c: {**c, "is_causal": False, "attn_mask": torch.zeros(1, _seq(c, "key"), dtype=torch.float64
                                                                 if c["query"].dtype != torch.float64 else torch.float16)},
    [], "run")


@FUZZ
@given(call=valid_calls(), mutation=st.sampled_from(sorted(MUTATIONS)),
       backend=st.sampled_from(["native", "flex", "_native_math", "_native_flash", "flash", "auto"]),
       policy=st.sampled_from(["fallback", "strict"]))
def test_odd_calls_raise_a_documented_error_naming_the_argument(call, mutation, backend, policy):
    mutate, words, allowed = MUTATIONS[mutation]
    base = {**call, "backend": backend, "policy": "fallback"}
    base.pop("return_lse")
    base_recorder = Recorder()
    with recording(base_recorder):
        expected = dispatch_attention_fn(**base)
    served = served_of(base_recorder.snapshot())
    odd = mutate({**base, "policy": policy})
    checks_mode = odd.pop("_checks", "off")
    note(f"{mutation}: {describe(odd)}")
    before = state_now()
    try:
        with dispatcher.attention_checks(checks_mode):
            out = dispatch_attention_fn(**odd)
    except DOCUMENTED as exc:
        message = str(exc)
        if allowed == "run" and not (policy == "strict" and isinstance(exc, BackendNotSupportedError)):
            raise AssertionError(f"{mutation}: a valid call raised {type(exc).__name__}: {message}") from exc
        # strict refuses a backend that cannot run the shapes before any value is read (NaN checks come later)
        refused_first = policy == "strict" and isinstance(exc, BackendNotSupportedError) and (
            allowed != "raise" or "NaN" in words or "Inf" in words or _refused_strict(base))
        if not refused_first:
            assert not words or any(w in message for w in words), f"{mutation}: {type(exc).__name__}: {message}"
    except Exception as exc:  # an undocumented error type: the bug this test is for
        raise AssertionError(f"{mutation}: undocumented {type(exc).__name__}: {exc}") from exc
    else:
        assert allowed in ("run", "either"), f"{mutation}: no error for an invalid call"
        q = odd["query"]
        assert isinstance(out, torch.Tensor) and out.shape[:-1] == q.shape[:-1]
    assert state_now() == before
    # Nothing changed for the good call: the same backend serves it with the same result.
    again_recorder = Recorder()
    with recording(again_recorder):
        again = dispatch_attention_fn(**base)
    assert served_of(again_recorder.snapshot()) == served, f"{mutation} changed who serves the valid call"
    torch.testing.assert_close(again, expected, rtol=0, atol=0)


def _refused_strict(call) -> bool:
    """Whether strict refuses the valid call itself (its backend cannot run its shapes): then it may refuse a
    mutation of it for that before it reads the argument the mutation changed (attention_kwargs, say)."""
    try:
        dispatch_attention_fn(**{**call, "policy": "strict"})
    except BackendNotSupportedError:
        return True
    return False


# ------------------------------------------------------------------------------------------------ the adapter

adapter, pack_dispatcher, _ = load_pack()


@pytest.fixture
def pack_state():
    """The pack's own copy of the dispatcher (ComfyUI imports it under the pack's name): clean before and after."""
    def reset():
        pack_dispatcher.state.reset_default_backend()
        pack_dispatcher.caches.forget()
        pack_dispatcher.registry.forget_availability()
        pack_dispatcher.set_checks(None)
        pack_dispatcher.set_fallback_policy("fallback")
    reset()
    with pack_dispatcher.auto.using(pack_dispatcher.auto.Tuner(cache_path=None, max_signatures=0)):
        yield
    reset()


@st.composite
def comfy_calls(draw):
    """ComfyUI's optimized_attention convention: (B, L, H*D) with heads, or (B, H, L, D) with skip_reshape."""
    b, lq, lk, h = draw(st.integers(1, 2)), draw(st.integers(1, 7)), draw(st.integers(1, 7)), draw(st.integers(1, 3))
    d = draw(st.sampled_from([4, 8, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 1000)))
    skip_reshape = draw(st.booleans())
    if skip_reshape:
        q, k, v = (torch.randn(b, s, h, d, generator=g).to(dtype).transpose(1, 2) for s in (lq, lk, lk))
    else:
        q, k, v = (torch.randn(b, s, h * d, generator=g).to(dtype) for s in (lq, lk, lk))
    mask = None
    kind = draw(st.sampled_from(["none", "none", "bool", "additive", "additive_fp32", "int"]))
    if kind != "none":
        rank = draw(st.integers(2, 4))
        full = {2: (lq, lk), 3: (b, lq, lk), 4: (b, h, lq, lk)}[rank]
        keep = torch.rand(full, generator=g) > 0.4
        keep[..., 0] = True
        if kind == "bool":
            mask = keep
        elif kind == "int":
            mask = keep.to(torch.int32)
        else:
            mask = torch.zeros(full).masked_fill(~keep, float("-inf")).to(dtype if kind == "additive" else torch.float32)
    return dict(q=q, k=k, v=v, heads=h, mask=mask, skip_reshape=skip_reshape,
                skip_output_reshape=draw(st.booleans()),
                attn_precision=draw(st.sampled_from([None, torch.float32])),
                scale=draw(st.sampled_from([None, 0.3])))


def comfy_reference(c):
    q, k, v, heads, mask = c["q"], c["k"], c["v"], c["heads"], c["mask"]
    if not c["skip_reshape"]:
        q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))
    if mask is not None and not (mask.dtype == torch.bool or mask.is_floating_point()):
        mask = mask.bool()  # what ComfyUI's own function does with an integer mask
    if mask is not None and mask.dim() < 4:  # ComfyUI's rank rule: 2-D (Lq, Lk), 3-D (B, Lq, Lk)
        mask = mask[None, None] if mask.dim() == 2 else mask[:, None]
    out, _ = reference(q, k, v, mask, scale=c["scale"], layout="BHSD")
    return out if c["skip_output_reshape"] else out.transpose(1, 2).flatten(2)


def call_override(override, c, **extra):
    kwargs = {"transformer_options": {"optimized_attention_override": override}, **extra}
    if c["scale"] is not None:
        kwargs["scale"] = c["scale"]
    return override(comfy_func, c["q"], c["k"], c["v"], c["heads"], mask=c["mask"],
                    attn_precision=c["attn_precision"], skip_reshape=c["skip_reshape"],
                    skip_output_reshape=c["skip_output_reshape"], **kwargs)


ADAPTER_BACKENDS = ["native", "flex", "_native_math", "_native_flash", "flash", "sage", "auto", "comfy default"]
ADAPTER_MUTATIONS = {  # mutate(call) -> call, or None where it does not apply; words the error must contain
    "heads does not divide": (lambda c: None if c["skip_reshape"] else {**c, "heads": c["q"].shape[-1] + 1}, ["heads"]),
    "heads negative": (lambda c: None if c["skip_reshape"] else {**c, "heads": -2}, ["heads"]),
    "heads float": (lambda c: None if c["skip_reshape"] else {**c, "heads": 2.0}, ["heads"]),
    "k heads do not split": (lambda c: None if c["skip_reshape"] or c["q"].shape[-1] // c["heads"] == 1 else
                             {**c, "k": c["k"][..., :-1], "v": c["v"][..., :-1]}, ["key", "head dim"]),
    "q None": (lambda c: {**c, "q": None}, ["q"]),
    "k list": (lambda c: {**c, "k": [1.0]}, ["k"]),
    "v wrong rank": (lambda c: {**c, "v": c["v"][0]}, ["v"]),
    "mask list": (lambda c: {**c, "mask": [[1.0]]}, ["mask"]),
    "mask does not broadcast": (lambda c: {**c, "mask": torch.ones(5, 3, 2, dtype=torch.bool)}, ["attn_mask"]),
    "q NaN with checks": (lambda c: {**c, "q": c["q"] * NAN, "_checks": "raise"}, ["NaN"]),
}


@FUZZ
@given(c=comfy_calls(), backend=st.sampled_from(ADAPTER_BACKENDS), policy=st.sampled_from(["fallback", "strict"]),
       mutation=st.sampled_from([None] * 8 + sorted(ADAPTER_MUTATIONS)),
       checks=st.sampled_from([None, "raise"]))
def test_adapter_is_exact_or_raises_a_documented_error(pack_state, c, backend, policy, mutation, checks):
    pd = pack_dispatcher
    if mutation is not None:
        mutated = ADAPTER_MUTATIONS[mutation][0](c)
        assume(mutated is not None)
        c = mutated
        checks = c.pop("_checks", checks)
    recorder = pd.Recorder()
    override = adapter.make_override(backend, policy, recorder, checks=checks)
    options = {"transformer_options": {"optimized_attention_override": override, "block_type": "double"}}
    snapshot = copy.copy(options["transformer_options"])
    config = {f.name: getattr(override.config, f.name) for f in dataclasses.fields(override.config)}
    note(f"{backend} {policy} {mutation} checks={checks}: " + ", ".join(
        f"{k}={tuple(v.shape) if isinstance(v, torch.Tensor) else v}" for k, v in c.items()))
    before = (pd.state.active_backend(), pd.state.active_policy(), pd.state.active_checks())
    delegated = backend == "comfy default" or (c["mask"] is not None and isinstance(c["mask"], torch.Tensor)
                                                and not (c["mask"].dtype == torch.bool or c["mask"].is_floating_point()))
    try:
        out = call_override(override, c)
    except DOCUMENTED + (pd.BackendNotSupportedError, pd.BackendUnavailableError) as exc:
        if mutation is None:  # a valid ComfyUI call: only strict with a backend that cannot run it may refuse
            assert policy == "strict" and isinstance(exc, pd.BackendNotSupportedError), f"{type(exc).__name__}: {exc}"
        elif policy == "strict" and isinstance(exc, pd.BackendNotSupportedError):
            pass  # strict refuses a backend that cannot run the shapes before it looks at the values
        elif not (delegated and not isinstance(exc, pd.AttentionInputError)):  # else ComfyUI's own function raised
            assert any(w in str(exc) for w in ADAPTER_MUTATIONS[mutation][1]), f"{mutation}: {type(exc).__name__}: {exc}"
    except Exception as exc:
        if not (delegated and mutation is not None):  # handed to ComfyUI's own function unchanged: its error
            raise AssertionError(f"{mutation}: undocumented {type(exc).__name__}: {exc}") from exc
    else:
        assert mutation is None or delegated, f"{mutation}: no error"
        if mutation is None:
            expected = comfy_reference({**c, "scale": None} if delegated else c)  # the stand-in ignores scale
            assert out.shape == expected.shape and out.dtype == c["q"].dtype
            tol = TOL[c["q"].dtype] * 2 * max(1.0, float(c["v"].double().abs().max()))
            assert float((out.double() - expected).abs().max()) <= tol
            (row,) = recorder.snapshot()["rows"]
            assert row["calls"] == 1 and (row["served"] == row["requested"] or row["reasons"] or backend == "auto")
    assert (pd.state.active_backend(), pd.state.active_policy(), pd.state.active_checks()) == before
    # The model's options are untouched by any call, good or bad (the override is a pure closure).
    assert options["transformer_options"] == snapshot
    kept = options["transformer_options"]["optimized_attention_override"].config
    assert config == {f.name: getattr(kept, f.name) for f in dataclasses.fields(kept)}


# ------------------------------------------------------------------------------------------------ node inputs

ANY_JSON = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=20)),
                        lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                st.dictionaries(st.text(max_size=5), inner, max_size=3)), max_leaves=5)


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(backend=st.one_of(st.sampled_from(["auto", "comfy default", "native", "flash", "flash_hub", "sage_hub"]), ANY_JSON),
       policy=st.one_of(st.sampled_from(["fallback", "strict"]), ANY_JSON),
       start=st.floats(allow_nan=True, allow_infinity=True), end=st.floats(allow_nan=True, allow_infinity=True))
def test_node_validate_inputs_answer_true_or_a_message(monkeypatch, backend, policy, start, end):
    """ComfyUI hands validate_inputs the raw prompt JSON for the inputs it declares (it skips its own
    range and option checks for those); FLOAT inputs are already float(). Never an exception."""
    nodes = node_stub.install(monkeypatch)
    for result in (nodes.SetAttentionBackend.check_inputs(backend, policy, start, end),
                   nodes.SetClipAttentionBackend.check_inputs(backend, policy)):
        assert result is True or (isinstance(result, str) and result), result
    ok = nodes.SetAttentionBackend.check_inputs(backend, policy, start, end)
    if policy not in ("fallback", "strict"):
        assert ok is not True and "policy" in ok
    elif not (0.0 <= start <= end <= 1.0):
        assert ok is not True and "start_percent" in ok
    if ok is True:
        assert backend in ("auto", "comfy default") or backend in pack_dispatcher.backend_names()


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(publishers=st.text(max_size=60), disable=st.sampled_from([None, "1", "true", "no"]))
def test_trust_node_parses_any_text(monkeypatch, publishers, disable):
    nodes = node_stub.install(monkeypatch)
    if disable is None:
        monkeypatch.delenv("DIFFUSERS_DISABLE_REMOTE_CODE", raising=False)
    else:
        monkeypatch.setenv("DIFFUSERS_DISABLE_REMOTE_CODE", disable)
    out = nodes.TrustRemoteKernels.execute(publishers)
    (names,) = out.result
    assert isinstance(names, tuple) and names == tuple(sorted(set(names)))
    assert all(n and n == n.strip() and "," not in n and "\n" not in n for n in names)
    text = out.ui["text"][0]
    if disable in ("1", "true"):
        assert "DIFFUSERS_DISABLE_REMOTE_CODE=true wins" in text
    with pack_dispatcher.trusted_publishers(names) as scoped:
        assert scoped == frozenset(names)
