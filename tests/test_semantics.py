"""Dispatcher semantics (issue #15): mask precision, Dv != D, SDPA's broadcasting, attention_kwargs, flex under
inductor with every mask shape, strict reasons, and the (B, Lk) / (Lq, Lk) mask ambiguity."""

from __future__ import annotations

import functools
import types

import pytest
import torch
import torch.nn.functional as F

import dispatcher
from dispatcher import AttentionInputError, BackendNotSupportedError, dispatch_attention_fn, masks, registry, support
from helpers import tensors

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile",
                                        "ignore:return_lse is deprecated")

CPU_BACKENDS = ("native", "_native_math", "_native_flash", "flex")


qkv = functools.partial(tensors.qkv, b=2, lq=32, lk=32, h=4, d=32)


def sdpa(q, k, v, **kwargs):
    """Torch's own SDPA on BSHD tensors (the reference users compare against)."""
    if q.shape[2] == 0:  # no heads: nothing to compute, and torch 2.11's CPU SDPA dies of SIGFPE on it
        return q.new_empty(*q.shape[:-1], v.shape[-1])
    return F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), **kwargs).transpose(1, 2)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ------------------------------------------------------------------------------------------- mask precision

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend, return_lse", [(b, lse) for b in CPU_BACKENDS for lse in (False, True)
                                                 if not lse or registry.get(b).lse])  # lse only where it exists
def test_float32_mask_keeps_its_precision_with_half_inputs(backend, dtype, return_lse):
    """A float32 additive mask with half inputs was cast to half first: ~5x SDPA's error (bf16, std 10:
    1.29e-2 against SDPA's 2.38e-3). Every CPU backend must now be as accurate as SDPA on the same call."""
    q, k, v = qkv(lq=64, lk=64, d=64)
    mask = torch.randn(2, 1, 64, 64, generator=torch.Generator().manual_seed(1)) * 10
    exact = sdpa(q.double(), k.double(), v.double(), attn_mask=mask.double())
    low = tuple(x.to(dtype) for x in (q, k, v))
    sdpa_error = rel(sdpa(*low, attn_mask=mask), exact)
    out = dispatch_attention_fn(*low, attn_mask=mask, backend=backend, policy="strict", return_lse=return_lse)
    out = out[0] if return_lse else out
    assert out.dtype == dtype
    assert rel(out, exact) <= 1.5 * sdpa_error, (rel(out, exact), sdpa_error)


def test_mask_formats_keep_float32_where_the_kernel_adds_in_float32():
    f32 = torch.randn(1, 1, 4, 4)
    assert masks.convert(f32, "native", torch.bfloat16).dtype == torch.float32  # on the CPU, SDPA takes it
    assert masks.convert(f32, "precise", torch.bfloat16).dtype == torch.float32
    assert masks.convert(f32.double(), "native", torch.float16).dtype == torch.float32
    assert masks.convert(f32.half(), "precise", torch.bfloat16).dtype == torch.float32  # lossless, not bf16
    assert masks.convert(f32, "native", torch.float64).dtype == torch.float64
    assert masks.convert(f32, "additive", torch.bfloat16).dtype == torch.bfloat16  # xFormers demands the query's
    keep = torch.rand(1, 1, 4, 4) > 0.5
    assert masks.convert(keep, "precise", torch.bfloat16) is not None and masks.convert(keep, "precise",
                                                                                        torch.bfloat16).dtype == torch.bool


# ------------------------------------------------------------------------------------------ Dv != D

def test_every_backend_declares_different_value_dim():
    """Declared per backend; the SDPA reference and the math kernel take it (as SDPA and diffusers do)."""
    declared = {name: registry.get(name).different_value_dim for name in registry.names()}
    assert declared["native"] and declared["_native_math"] and declared["flex"]
    assert not declared["_native_flash"]  # the CPU flash kernel raises "Q/K/V should have the same head size"


@pytest.mark.parametrize("policy", ["strict", "fallback"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_value_head_dim_different_from_query(backend, policy):
    q, k, v = qkv(d=64, dv=32)
    ref = sdpa(q, k, v)
    if policy == "strict" and not registry.get(backend).different_value_dim:
        with pytest.raises(BackendNotSupportedError, match="value head dim 32 differs from query head dim 64"):
            dispatch_attention_fn(q, k, v, backend=backend, policy=policy)
        return
    rec = dispatcher.Recorder()
    with dispatcher.recording(rec):
        out = dispatch_attention_fn(q, k, v, backend=backend, policy=policy)
    assert out.shape == (2, 32, 4, 32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if policy == "fallback" and not registry.get(backend).different_value_dim:
        assert rec.served_by("native") == 1


# --------------------------------------------------------------------------------- SDPA's broadcasting

BROADCASTS = {"kv_batch_1": dict(bk=1), "one_kv_head": dict(hk=1), "both": dict(bk=1, hk=1)}


@pytest.mark.parametrize("case", sorted(BROADCASTS))
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_sdpa_broadcasting_is_accepted(backend, case):
    q, k, v = qkv(**BROADCASTS[case])
    ref = sdpa(q, k, v)  # SDPA broadcasts both without enable_gqa
    for layout in ("BSHD", "BHSD"):
        args = (q, k, v) if layout == "BSHD" else tuple(x.transpose(1, 2) for x in (q, k, v))
        out = dispatch_attention_fn(*args, backend=backend, policy="strict", layout=layout)
        out = out if layout == "BSHD" else out.transpose(1, 2)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    if registry.get(backend).lse:
        out, lse = dispatch_attention_fn(q, k, v, backend=backend, policy="strict", return_lse=True)
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
        assert lse.shape == (2, 32, 4)


def test_broadcasting_that_sdpa_refuses_is_still_refused():
    q, k, v = qkv()
    with pytest.raises(AttentionInputError, match="batch sizes differ"):
        dispatch_attention_fn(q, k[:1], v, backend="native")  # key and value disagree
    q3, k3, v3 = qkv(b=3, bk=2)
    with pytest.raises(AttentionInputError, match="batch sizes differ"):
        dispatch_attention_fn(q3, k3, v3, backend="native")
    q, k, v = qkv(hk=2)
    with pytest.raises(AttentionInputError, match="enable_gqa=True"):
        dispatch_attention_fn(q, k, v, backend="native")  # 2 of 4 heads is GQA, not a broadcast


def test_backends_that_cannot_broadcast_the_batch_say_why():
    inputs = types.SimpleNamespace(batch=2, batch_kv=1)
    can = {name for name in registry.names() if not support.semantic_reasons(registry.get(name), inputs)}
    assert {"native", "_native_math", "_native_flash", "_native_efficient", "_native_cudnn", "flex"} <= can
    for name in ("flash", "flash_hub", "sage", "xformers", "_flash_3", "sage_hub"):
        (reason,) = support.semantic_reasons(registry.get(name), inputs)
        assert "key/value batch 1 broadcast over query batch 2 is not supported" in reason and "native" in reason
    assert support.semantic_reasons(registry.get("flash"), types.SimpleNamespace(batch=2, batch_kv=2)) == []


def test_batch_broadcast_is_part_of_the_decision():
    """Needs AttentionInputs.batch_kv: a decision for key/value batch 2 must not be reused for batch 1."""
    q, k, v = qkv(bk=1)
    inputs = dispatcher.inputs.describe_call(q, k, v, None, 0.0, False, None, False, False, "BSHD")
    assert inputs.batch_kv == 1


# -------------------------------------------------------------------------------------- attention_kwargs

def test_every_builtin_backend_declares_its_attention_kwargs():
    for name in registry.builtin_names():  # a fixed set on the spec, never "any key"
        assert isinstance(registry.get(name).attention_kwargs, frozenset), name
    honour = {name for name in registry.names() if "window_size" in registry.get(name).attention_kwargs}
    assert honour == {"flash", "flash_hub", "flash_varlen", "flash_varlen_hub", "_flash_3", "_flash_varlen_3",
                      "_flash_3_hub", "_flash_3_varlen_hub"}


def _candidates(*names):
    """What a decision holds: [(name, spec, runner)], best first."""
    return [(name, registry.get(name), registry.get(name).fn) for name in names]


def test_unknown_attention_kwargs_name_the_key_and_who_honours_it():
    candidates = _candidates("native", "_native_math")  # what "flash" falls back to on a CPU
    with pytest.raises(support.AttentionKwargsError) as info:
        support.candidates_for_attention_kwargs("flash", "fallback", candidates, {"window_size": (8, 8)})
    text = str(info.value)
    honoured_line = next(line for line in text.splitlines() if "'window_size' is honoured by" in line)
    assert all(name in honoured_line for name in ("flash", "flash_hub", "_flash_3", "_flash_3_hub"))
    assert "select one of them (backend='" in honoured_line and "or drop the key" in honoured_line
    assert "unexpected keyword" not in text and "math_attention" not in text
    assert isinstance(info.value, TypeError)
    with pytest.raises(support.AttentionKwargsError, match="'no_such_key' is honoured by no attention backend"):
        support.candidates_for_attention_kwargs("native", "fallback", candidates, {"no_such_key": 1})
    with pytest.raises(support.AttentionKwargsError, match=r"repeats an argument of dispatch_attention_fn: pass scale"):
        support.candidates_for_attention_kwargs("native", "fallback", candidates, {"scale": 0.5})
    assert support.candidates_for_attention_kwargs("native", "fallback", candidates, {}) is candidates


def test_custom_backend_attention_kwargs_come_from_its_signature():
    def windowed(q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, softcap=None):
        return sdpa(q, k, v)

    def anything(q, k, v, **kwargs):
        return sdpa(q, k, v)
    dispatcher.register_backend("windowed_test", windowed, devices=("cpu",))
    dispatcher.register_backend("anything_test", anything, devices=("cpu",))
    assert registry.get("windowed_test").attention_kwargs == {"softcap"}
    assert registry.get("anything_test").attention_kwargs is None
    assert support.attention_kwargs_reasons(registry.get("windowed_test"), {"softcap"}) == []
    assert support.attention_kwargs_reasons(registry.get("windowed_test"), {"window_size"})


def test_unknown_attention_kwargs_fail_before_any_backend_runs():
    q, k, v = qkv()
    with pytest.raises(support.AttentionKwargsError, match=r"'window_size' is honoured by [^\n]*\bflash\b"):
        dispatch_attention_fn(q, k, v, backend="flash", attention_kwargs={"window_size": (8, 8)})


# ------------------------------------------------------------------- every mask shape under inductor

@pytest.mark.slow
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_inductor_compiles_every_mask_shape(backend):
    """One inductor compile per backend (CPU inductor is slow) covering every mask rank and size-1 axis: flex
    failed with NoValidChoicesError on any mask with a size-1 axis (its indexer captured a 0-dim tensor).
    Sizes of 16 (not 8): CPU inductor's flex computes garbage at Lq = 8, D = 16 in torch 2.13."""
    torch._dynamo.reset()
    b, s, h, d = 2, 16, 2, 16
    q, k, v = qkv(b=b, lq=s, lk=s, h=h, d=d)
    gen = torch.Generator().manual_seed(3)
    shapes = [(s, s), (1, s, s), (b, s, s), (1, 1, s, s), (b, 1, s, s), (1, h, s, s), (b, h, s, s), (b, 1, 1, s)]
    mask_list = [torch.randn(*shape, generator=gen) for shape in shapes]
    mask_list.append(torch.rand(b, 1, 1, s, generator=gen) > 0.3)  # bool key padding
    mask_list[-1][..., 0] = True
    if backend == "flex":  # each mask is one more flex kernel (~8 s each): one of each size-1 pattern
        mask_list = [mask_list[i] for i in (0, 4, 5, 8)]

    def block(q, k, v):
        return [dispatch_attention_fn(q, k, v, attn_mask=m, backend=backend, policy="strict") for m in mask_list]
    compiled = torch.compile(block, fullgraph=True)(q, k, v)
    for out, mask in zip(compiled, mask_list):
        ref = sdpa(q, k, v, attn_mask=masks.to_4d(mask))
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------- strict reasons

def test_strict_error_lists_availability_and_input_reasons():
    q, k, v = qkv(d=300, dtype=torch.float64)
    with pytest.raises(BackendNotSupportedError) as info:
        dispatch_attention_fn(q, k, v, backend="flash", policy="strict")
    text = str(info.value)
    # the machine's reason alone: no install hint (installing flash-attn would not help a CPU, #41), and not the
    # call's limits either (#48: one reason that rules the machine out is enough)
    assert "needs an NVIDIA CUDA GPU" in text and "pip install" not in text, text
    assert "dtype float64" not in text and "head dim 300" not in text, text
    # a backend this machine can run: the call's limits, each
    dispatcher.register_backend("limited_test", lambda q, k, v, **kw: q, devices=("cpu",), dtypes=(torch.float32,),
                                head_dims=dispatcher.HeadDims(maximum=256))
    try:
        with pytest.raises(BackendNotSupportedError) as info:
            dispatch_attention_fn(q, k, v, backend="limited_test", policy="strict")
        text = str(info.value)
        assert "dtype float64 is not supported" in text and "head dim 300 is not supported" in text, text
    finally:
        dispatcher.unregister_backend("limited_test")


# ---------------------------------------------------------------------- (B, Lk) against (Lq, Lk)

def test_two_d_mask_is_lq_lk_and_the_ambiguous_case_is_refused():
    q, k, v = qkv(b=2, lq=2, lk=16)  # B == Lq: (2, 16) is (Lq, Lk) here, (B, Lk) key padding in diffusers
    mask = torch.rand(2, 16, generator=torch.Generator().manual_seed(0)) > 0.3
    mask[:, 0] = True
    with pytest.raises(AttentionInputError, match=r"ambiguous.*attn_mask\[:, None, None, :\]"):
        dispatch_attention_fn(q, k, v, attn_mask=mask, backend="native")
    # saying which: 4-D
    padded = dispatch_attention_fn(q, k, v, attn_mask=mask[:, None, None, :], backend="native")
    torch.testing.assert_close(padded, sdpa(q, k, v, attn_mask=mask[:, None, None, :]))
    rows = dispatch_attention_fn(q, k, v, attn_mask=mask[None, None], backend="native")
    torch.testing.assert_close(rows, sdpa(q, k, v, attn_mask=mask))


def test_two_d_mask_shapes_that_are_not_ambiguous():
    q, k, v = qkv(b=2, lq=8, lk=16)
    rows = torch.randn(8, 16)  # (Lq, Lk): B != Lq
    torch.testing.assert_close(dispatch_attention_fn(q, k, v, attn_mask=rows, backend="native"),
                               sdpa(q, k, v, attn_mask=rows))
    one = torch.randn(1, 16)  # (1, Lk): both readings agree
    torch.testing.assert_close(dispatch_attention_fn(q, k, v, attn_mask=one, backend="native"),
                               sdpa(q, k, v, attn_mask=one))


# ------------------------------------------------------------ SDPA's and diffusers' conventions (issue #33)

def _padding(b, lk, seed=0):
    keep = torch.rand(b, lk, generator=torch.Generator().manual_seed(seed)) > 0.4
    keep[:, 0] = True
    return keep


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", ["BSHD", "BHSD"])
@pytest.mark.parametrize("additive", [False, True])
def test_two_d_batch_by_key_mask_is_key_padding(backend, layout, additive):
    """(B, Lk) with B != Lq: key padding per batch element, as diffusers' native reads it (SDPA cannot broadcast
    it), on every backend, in both layouts, bool or additive."""
    q, k, v = qkv(b=3, lq=8, lk=16)
    keep = _padding(3, 16)
    mask = torch.zeros(3, 16).masked_fill_(~keep, float("-inf")) if additive else keep
    expected = sdpa(q, k, v, attn_mask=mask[:, None, None, :])
    views = (lambda x: x) if layout == "BSHD" else (lambda x: x.transpose(1, 2))
    got = dispatch_attention_fn(views(q), views(k), views(v), attn_mask=mask, backend=backend, layout=layout,
                                policy="strict")
    torch.testing.assert_close(views(got), expected, atol=2e-5, rtol=1e-4)
    prepared = dispatcher.PreparedAttention(backend=backend, layout=layout, policy="strict")
    torch.testing.assert_close(views(prepared(views(q), views(k), views(v), mask)), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("batch", [2, 3])  # B == H: read the other way before, silently; B != H
def test_three_d_mask_is_heads_by_query_by_key(backend, batch):
    q, k, v = qkv(b=batch, lq=8, lk=12, h=2)
    bias = torch.randn(2, 8, 12, generator=torch.Generator().manual_seed(1)) * 3  # (H, Lq, Lk)
    expected = sdpa(q, k, v, attn_mask=bias)
    got = dispatch_attention_fn(q, k, v, attn_mask=bias, backend=backend, policy="strict")
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    if batch == 2:  # the (B, Lq, Lk) reading gives another result: this is SDPA's
        assert not torch.allclose(got, sdpa(q, k, v, attn_mask=bias[:, None]), atol=1e-3)
    keep = torch.rand(2, 8, 12, generator=torch.Generator().manual_seed(2)) > 0.3
    keep[..., 0] = True
    torch.testing.assert_close(dispatch_attention_fn(q, k, v, attn_mask=keep, backend=backend, policy="strict"),
                               sdpa(q, k, v, attn_mask=keep), atol=2e-5, rtol=1e-4)


def test_three_d_mask_of_the_batch_is_refused_with_the_fix():
    q, k, v = qkv(b=3, lq=8, lk=8, h=2)
    with pytest.raises(AttentionInputError, match=r"\(H, Lq, Lk\), as SDPA reads it.*attn_mask\[:, None\]"):
        dispatch_attention_fn(q, k, v, attn_mask=torch.zeros(3, 8, 8))


def test_one_head_three_d_key_row_is_key_padding_and_a_per_head_one_is_not():
    assert masks.mask_kind(torch.ones(1, 1, 8, dtype=torch.bool)) == "key_padding"
    assert masks.mask_kind(torch.ones(2, 1, 8, dtype=torch.bool)) == "bool"  # (H, 1, Lk): one row per head
    assert masks.mask_kind(torch.ones(2, 1, 1, 8, dtype=torch.bool)) == "key_padding"
    assert masks.mask_kind(torch.ones(2, 2, 1, 8, dtype=torch.bool)) == "bool"


MASK_WITH_CAUSAL_CASES = [(backend, case) for backend in ("native", "_native_math")
                          for case in ("bool", "additive", "key_padding", "cross_longer_keys", "cross_longer_queries",
                                       "gqa", "half", "return_lse")
                          if case != "return_lse" or registry.get(backend).lse]  # an LSE only where it has one


def causal_reference(q, k, v, mask, **kwargs):
    """attn_mask with is_causal=True, the convention (docs/python.md): the mask and SDPA's top-left diagonal, run
    by SDPA as one explicit mask, which every torch the pack claims accepts (2.14 and later refuse the pair)."""
    return sdpa(q, k, v, attn_mask=tensors.causal_folded(mask, q.shape[1], k.shape[1]), **kwargs)


@pytest.mark.parametrize("backend, case", MASK_WITH_CAUSAL_CASES)
def test_mask_with_causal_applies_both(backend, case):
    lq, lk = {"cross_longer_keys": (8, 20), "cross_longer_queries": (20, 8)}.get(case, (16, 16))
    q, k, v = qkv(b=2, lq=lq, lk=lk, h=4, hk=2 if case == "gqa" else None,
                  dtype=torch.bfloat16 if case == "half" else torch.float32)
    gen = torch.Generator().manual_seed(3)
    if case == "additive":
        mask = torch.randn(lq, lk, generator=gen)
    elif case == "key_padding":
        mask = _padding(2, lk)[:, None, None, :]
    else:
        mask = torch.rand(2, 1, lq, lk, generator=gen) > 0.3
    gqa = case == "gqa"
    expected = causal_reference(q, k, v, mask, enable_gqa=gqa)
    got = dispatch_attention_fn(q, k, v, attn_mask=mask, is_causal=True, enable_gqa=gqa, backend=backend,
                                policy="strict", return_lse=case == "return_lse")
    if case == "return_lse":
        got = got[0]
    tolerance = 2e-2 if case == "half" else 2e-5
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance, equal_nan=True)


@pytest.mark.parametrize("additive", [False, True])
def test_sdpa_on_this_torch_applies_mask_and_causal_as_the_pack_does_or_refuses_the_pair(additive):
    """The convention's origin, checked on whichever torch runs the suite: SDPA up to 2.13 runs the pair on the
    CPU (its flash kernel) with exactly this meaning; 2.14 and later refuse it. Should a torch give the pair
    another meaning, this fails and the convention needs a look."""
    q, k, v = qkv(b=2, lq=12, lk=16, h=4)
    gen = torch.Generator().manual_seed(6)
    mask = torch.randn(12, 16, generator=gen) if additive else torch.rand(2, 1, 12, 16, generator=gen) > 0.3
    try:
        theirs = sdpa(q, k, v, attn_mask=mask, is_causal=True)
    except RuntimeError as refusal:
        assert "attn_mask should not be set when is_causal=True" in str(refusal)
    else:
        torch.testing.assert_close(theirs, causal_reference(q, k, v, mask), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(dispatch_attention_fn(q, k, v, attn_mask=mask, is_causal=True),
                               causal_reference(q, k, v, mask), atol=2e-5, rtol=1e-4)


def test_mask_with_causal_where_sdpa_picks_its_math_kernel():
    """SDPA raises on both where it picks its math kernel (a strided view on the CPU; on every call from 2.14);
    the library folds the diagonal into the mask and runs it."""
    q, k, v = qkv(b=2, lq=16, lk=16, h=4, d=64)
    strided = [x[..., ::2] for x in (q, k, v)]
    mask = torch.rand(16, 16, generator=torch.Generator().manual_seed(4)) > 0.3
    with pytest.raises(RuntimeError, match="attn_mask should not be set when is_causal=True"):
        sdpa(*strided, attn_mask=mask, is_causal=True)
    got = dispatch_attention_fn(*strided, attn_mask=mask, is_causal=True)
    torch.testing.assert_close(got, causal_reference(*(x.contiguous() for x in strided), mask), atol=2e-5, rtol=1e-4)


def test_mask_with_causal_skips_backends_that_do_not_declare_it_and_says_so():
    q, k, v = qkv(b=2, lq=16, lk=16, h=4)
    mask = torch.rand(16, 16, generator=torch.Generator().manual_seed(5)) > 0.3
    with pytest.raises(BackendNotSupportedError, match=r"attn_mask with is_causal=True is not supported \(the pair "
                                                       r"means both.*'native' applies them\)"):
        dispatch_attention_fn(q, k, v, attn_mask=mask, is_causal=True, backend="flex", policy="strict")
    rec = dispatcher.Recorder()
    with dispatcher.recording(rec):
        out = dispatch_attention_fn(q, k, v, attn_mask=mask, is_causal=True, backend="flex")
    assert rec.served_by("native") == 1
    torch.testing.assert_close(out, causal_reference(q, k, v, mask), atol=2e-5, rtol=1e-4)
    assert registry.get("native").constraints()["supports"]["mask_with_causal"] is True
    assert registry.get("flex").constraints()["supports"]["mask_with_causal"] is False


EMPTY_CASES = {"no queries": dict(lq=0), "no keys": dict(lk=0), "no batch": dict(b=0), "no heads": dict(h=0)}


@pytest.mark.parametrize("case", sorted(EMPTY_CASES))
@pytest.mark.parametrize("backend", ["native", "_native_math", "_native_flash", "flex", "flash", "auto_exact"])
@pytest.mark.parametrize("layout", ["BSHD", "BHSD"])
def test_empty_inputs_give_sdpas_result(case, backend, layout):
    shape = dict(b=2, lq=8, lk=12, h=4) | EMPTY_CASES[case]
    q, k, v = qkv(**shape)
    views = (lambda x: x) if layout == "BSHD" else (lambda x: x.transpose(1, 2))
    expected = sdpa(q, k, v)
    rec = dispatcher.Recorder()
    with dispatcher.recording(rec):
        got = dispatch_attention_fn(views(q), views(k), views(v), backend=backend, layout=layout, policy="strict")
        again = dispatch_attention_fn(views(q), views(k), views(v), backend=backend, layout=layout, policy="strict")
    assert views(got).shape == expected.shape and got.dtype == expected.dtype
    assert torch.equal(views(got), expected) and torch.equal(again, got)
    assert rec.served_by(dispatcher.decisions.EMPTY) == 2  # no kernel ran, whichever was asked for


@pytest.mark.parametrize("case", sorted(EMPTY_CASES))
def test_empty_inputs_with_mask_causal_lse_and_gradients(case):
    shape = dict(b=2, lq=8, lk=12, h=4) | EMPTY_CASES[case]
    q, k, v = (x.requires_grad_() for x in qkv(**shape))
    mask = torch.ones(shape["lq"], shape["lk"], dtype=torch.bool)
    out, lse = dispatch_attention_fn(q, k, v, attn_mask=mask, is_causal=True, return_lse=True, scale=0.5)
    expected = causal_reference(q, k, v, mask, scale=0.5)
    assert torch.equal(out, expected)
    assert lse.shape == q.shape[:-1] and lse.dtype == torch.float32 and bool((lse == float("-inf")).all())
    out.sum().backward()  # SDPA's result carries the inputs' graph: so does ours
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and not x.grad.any()


def test_empty_inputs_still_have_their_shapes_checked():
    q, k, v = qkv(b=2, lq=0, lk=12, h=4)
    with pytest.raises(AttentionInputError, match="does not broadcast"):
        dispatch_attention_fn(q, k, v, attn_mask=torch.ones(3, 12, dtype=torch.bool)[None])
    with pytest.raises(AttentionInputError, match="key has dtype"):
        dispatch_attention_fn(q, k.half(), v)


@pytest.mark.parametrize("value", [torch.tensor(0.3), torch.tensor(0.3, dtype=torch.float64), torch.tensor(2)])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_zero_d_tensor_scale_is_its_value(value, backend):
    q, k, v = qkv()
    expected = dispatch_attention_fn(q, k, v, scale=float(value), backend=backend, policy="strict")
    assert torch.equal(dispatch_attention_fn(q, k, v, scale=value, backend=backend, policy="strict"), expected)
    prepared = dispatcher.PreparedAttention(scale=value, backend=backend, policy="strict")
    assert torch.equal(prepared(q, k, v), expected)
    torch.testing.assert_close(expected, sdpa(q, k, v, scale=value), atol=2e-5, rtol=1e-4)  # SDPA takes it so


@pytest.mark.parametrize("value", [torch.tensor([0.3]), torch.tensor(0.3, requires_grad=True)])
def test_tensor_scale_that_sdpa_refuses_is_refused_naming_it(value):
    q, k, v = qkv()
    with pytest.raises(TypeError):
        sdpa(q, k, v, scale=value)
    with pytest.raises(TypeError, match=r"SDPA refuses this one too: pass float\(scale\)"):
        dispatch_attention_fn(q, k, v, scale=value)


@pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS if registry.get(b).lse])
def test_a_row_the_mask_hides_entirely_is_zero_as_in_sdpa_with_its_lse_too(backend):
    q, k, v = qkv(b=2, lq=8, lk=8, h=2)
    keep = torch.ones(8, 8, dtype=torch.bool)
    keep[3] = False
    out, lse = dispatch_attention_fn(q, k, v, attn_mask=keep, backend=backend, policy="strict", return_lse=True)
    torch.testing.assert_close(out, sdpa(q, k, v, attn_mask=keep), atol=2e-5, rtol=1e-4)  # row 3 is 0, not NaN
    assert not out[:, 3].any() and not lse.isnan().any() and lse[:, :3].isfinite().all()
    if backend != "_native_flash":  # torch's CPU flash op says 0 for the hidden row's LSE
        assert bool((lse[:, 3] == float("-inf")).all())
