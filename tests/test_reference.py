"""Every CPU backend against an exact float64 reference computed here (never by a backend under test).

Inputs are drawn fresh by hypothesis (head dims, batch, heads, GQA, cross-attention lengths, every
ComfyUI mask shape in bool and additive form, custom scale, layouts, dtypes). Calls use
policy="strict" and a Recorder, so a silent fallback to another backend cannot hide a bug.
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher import Recorder, dispatch_attention_fn, get_backend_spec, recording
from dispatcher.reference import exact_attention, sample_rows

CPU_BACKENDS = ("native", "_native_math", "_native_flash", "flex")
LSE_BACKENDS = tuple(b for b in CPU_BACKENDS if get_backend_spec(b).lse)
HEAD_DIMS = (40, 64, 72, 80, 88, 96, 120, 128, 160, 256)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# ||out - ref|| / ||ref|| bounds; float16 rounds 8x finer than bfloat16.
REL_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
LSE_TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 4e-3}
LAYOUTS = ("BSHD", "BHSD", "BHSD_view")  # BHSD_view: a transposed (non-contiguous) view of a BSHD tensor
# Every mask shape, read as SDPA reads it (2-D (Lq, Lk), 3-D (H, Lq, Lk), 4-D (B, H, Lq, Lk)), and diffusers'
# 2-D (B, Lk) key padding.
MASK_SHAPES = ("Lq,Lk", "B,Lk", "H,1,Lk", "1,1,Lk", "H,Lq,Lk", "B,1,1,Lk", "B,1,Lq,Lk", "B,H,Lq,Lk")

# DISPATCHER_TEST_EXAMPLES=300 searches harder (the default keeps the suite fast on 2 cores).
SCALE = float(os.environ.get("DISPATCHER_TEST_EXAMPLES", "30")) / 30
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile", "ignore:return_lse is deprecated")
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def mask_shape(kind: str, b: int, h: int, lq: int, lk: int) -> tuple[int, ...]:
    sizes = {"B": b, "H": h, "Lq": lq, "Lk": lk, "1": 1}
    return tuple(sizes[part] for part in kind.split(","))


def make_mask(shape, mask_type: str, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A bool (True = attend) or additive mask with at least one kept key in every row (no fully masked row)."""
    keep = torch.rand(shape, generator=gen) < 0.7
    forced = torch.randint(0, shape[-1], shape[:-1] + (1,), generator=gen)
    keep.scatter_(-1, forced, True)
    if mask_type == "bool":
        return keep
    bias = torch.randn(shape, generator=gen, dtype=torch.float64) * 2
    return bias.masked_fill(~keep, float("-inf")).to(dtype)


def mask_4d(mask: torch.Tensor, batch: int, len_q: int) -> torch.Tensor:
    """SDPA's reading (right-aligned) and diffusers' (B, Lk) key padding, written out independently of the
    dispatcher."""
    if mask.dim() == 2 and mask.shape[0] == batch and batch not in (1, len_q):
        return mask.reshape(batch, 1, 1, mask.shape[1])
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def reference(q, k, v, mask=None, scale=None, is_causal=False):
    """Exact attention in float64 on BHSD tensors: softmax(Q K^T * scale + mask) V and its log-sum-exp."""
    q, k, v = q.double(), k.double(), v.double()
    hq, hk = q.shape[1], k.shape[1]
    if hq != hk:
        k = k.repeat_interleave(hq // hk, dim=1)
        v = v.repeat_interleave(hq // hk, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bhqd,bhkd->bhqk", q, k) * scale
    if is_causal:
        lq, lk = q.shape[2], k.shape[2]
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
    if mask is not None:
        m = mask_4d(mask, q.shape[0], q.shape[2])
        scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.double()
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None])
    return torch.einsum("bhqk,bhkd->bhqd", probs, v), lse


def make_qkv(b, hq, hk, lq, lk, d, dtype, layout, gen):
    """(q, k, v) in `layout` plus the same values as BHSD tensors for the reference."""
    shapes = ((b, lq, hq, d), (b, lk, hk, d), (b, lk, hk, d))
    bshd = [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in shapes]
    bhsd = [t.transpose(1, 2) for t in bshd]
    if layout == "BSHD":
        given_ = bshd
    elif layout == "BHSD":
        given_ = [t.contiguous() for t in bhsd]
    else:
        given_ = bhsd  # non-contiguous views
        assert not given_[0].is_contiguous() or (lq == 1 or hq == 1)
    return given_, bhsd


def to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t.transpose(1, 2) if layout == "BSHD" else t


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def run_strict(backend, q, k, v, **kwargs):
    recorder = Recorder()
    with recording(recorder):
        result = dispatch_attention_fn(q, k, v, backend=backend, policy="strict", **kwargs)
    assert recorder.served_by(backend) == 1 and recorder.total_calls == 1, recorder.summary()
    return result


def check_against_reference(backend, *, b, hq, hk, lq, lk, d, dtype, layout, mask_kind, mask_type, scale,
                            return_lse, seed, is_causal=False):
    gen = torch.Generator().manual_seed(seed)
    (q, k, v), (rq, rk, rv) = make_qkv(b, hq, hk, lq, lk, d, dtype, layout, gen)
    mask = None
    if mask_kind is not None:
        mask_dtype = dtype if mask_type == "additive" else torch.bool
        # A 2-D mask with B == Lq > 1 is refused as ambiguous ((Lq, Lk) in SDPA, (B, Lk) in diffusers): say which.
        kind = {"Lq,Lk": "1,1,Lq,Lk", "B,Lk": "B,1,1,Lk"}[mask_kind] if mask_kind in ("Lq,Lk", "B,Lk") and b == lq > 1 \
            else mask_kind
        mask = make_mask(mask_shape(kind, b, hq, lq, lk), mask_type, mask_dtype, gen)
    api_layout = "BSHD" if layout == "BSHD" else "BHSD"
    result = run_strict(backend, q, k, v, attn_mask=mask, scale=scale, enable_gqa=hq != hk, layout=api_layout,
                        return_lse=return_lse, is_causal=is_causal)
    ref_out, ref_lse = reference(rq, rk, rv, mask, scale, is_causal)
    out, lse = result if return_lse else (result, None)

    assert out.shape == q.shape and out.dtype == dtype
    assert not torch.isnan(out).any(), f"{backend} returned NaN"
    err = rel_err(to_bhsd(out, api_layout), ref_out)
    assert err < REL_TOL[dtype], f"{backend} {dtype} {layout} mask={mask_kind}/{mask_type}: relative error {err:.2e}"
    if return_lse:
        want_shape = (b, lq, hq) if api_layout == "BSHD" else (b, hq, lq)
        assert tuple(lse.shape) == want_shape, f"lse shape {tuple(lse.shape)}, expected {want_shape} for {api_layout}"
        got = lse.transpose(1, 2) if api_layout == "BSHD" else lse
        assert not torch.isnan(got).any()
        lse_err = float(((got.double() - ref_lse).abs() / (1 + ref_lse.abs())).max())
        assert lse_err < LSE_TOL[dtype], f"{backend} lse error {lse_err:.2e}"


@st.composite
def heads(draw):
    hq = draw(st.integers(1, 4))
    hk = draw(st.sampled_from([h for h in range(1, hq + 1) if hq % h == 0]))
    return hq, hk


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=max(1, int(30 * SCALE)), **SETTINGS)
@given(data=st.data())
def test_backend_matches_reference(backend, data):
    hq, hk = data.draw(heads(), label="heads")
    mask_kind = data.draw(st.sampled_from((None,) + MASK_SHAPES), label="mask_kind")
    check_against_reference(
        backend,
        b=data.draw(st.integers(1, 2), label="batch"),
        hq=hq, hk=hk,
        lq=data.draw(st.integers(1, 70), label="lq"),
        lk=data.draw(st.integers(1, 70), label="lk"),
        d=data.draw(st.sampled_from(HEAD_DIMS), label="head_dim"),
        dtype=data.draw(st.sampled_from(DTYPES), label="dtype"),
        layout=data.draw(st.sampled_from(LAYOUTS), label="layout"),
        mask_kind=mask_kind,
        mask_type=data.draw(st.sampled_from(("bool", "additive")), label="mask_type"),
        scale=data.draw(st.one_of(st.none(), st.floats(0.02, 0.5)), label="scale"),
        return_lse=backend in LSE_BACKENDS and data.draw(st.booleans(), label="return_lse"),
        seed=data.draw(st.integers(0, 2**31 - 1), label="seed"),
    )


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=max(1, int(15 * SCALE)), **SETTINGS)
@given(data=st.data())
def test_causal_matches_reference(backend, data):
    hq, hk = data.draw(heads(), label="heads")
    length = data.draw(st.integers(1, 70), label="length")
    check_against_reference(
        backend, b=data.draw(st.integers(1, 2), label="batch"), hq=hq, hk=hk, lq=length, lk=length,
        d=data.draw(st.sampled_from(HEAD_DIMS), label="head_dim"),
        dtype=data.draw(st.sampled_from(DTYPES), label="dtype"),
        layout=data.draw(st.sampled_from(LAYOUTS), label="layout"), mask_kind=None, mask_type="bool",
        scale=data.draw(st.one_of(st.none(), st.floats(0.02, 0.5)), label="scale"),
        return_lse=backend in LSE_BACKENDS and data.draw(st.booleans(), label="return_lse"),
        seed=data.draw(st.integers(0, 2**31 - 1), label="seed"), is_causal=True)


@pytest.mark.parametrize("backend", LSE_BACKENDS)
@settings(max_examples=max(1, int(15 * SCALE)), **SETTINGS)
@given(data=st.data())
def test_lse_matches_reference(backend, data):
    hq, hk = data.draw(heads(), label="heads")
    check_against_reference(
        backend, b=data.draw(st.integers(1, 2), label="batch"), hq=hq, hk=hk,
        lq=data.draw(st.integers(1, 70), label="lq"), lk=data.draw(st.integers(1, 70), label="lk"),
        d=data.draw(st.sampled_from(HEAD_DIMS), label="head_dim"),
        dtype=data.draw(st.sampled_from(DTYPES), label="dtype"),
        layout=data.draw(st.sampled_from(LAYOUTS), label="layout"),
        mask_kind=data.draw(st.sampled_from((None,) + MASK_SHAPES), label="mask_kind"),
        mask_type=data.draw(st.sampled_from(("bool", "additive")), label="mask_type"),
        scale=data.draw(st.one_of(st.none(), st.floats(0.02, 0.5)), label="scale"),
        return_lse=True, seed=data.draw(st.integers(0, 2**31 - 1), label="seed"))


# A fixed grid on top of the random search, so every mask shape, mask type, layout and dtype is
# covered for every backend on every run (hypothesis might not draw each combination).
@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mask_type", ("bool", "additive"))
@pytest.mark.parametrize("mask_kind", MASK_SHAPES)
def test_every_mask_shape(backend, mask_kind, mask_type):
    check_against_reference(backend, b=2, hq=4, hk=2, lq=9, lk=13, d=64, dtype=torch.float32, layout="BSHD",
                            mask_kind=mask_kind, mask_type=mask_type, scale=None,
                            return_lse=backend in LSE_BACKENDS, seed=zlib.crc32(f"{backend}/{mask_kind}/{mask_type}".encode()))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_layout_and_dtype(backend, layout, dtype):
    check_against_reference(backend, b=2, hq=2, hk=1, lq=17, lk=5, d=80, dtype=dtype, layout=layout,
                            mask_kind="B,1,Lq,Lk", mask_type="additive", scale=0.3,
                            return_lse=backend in LSE_BACKENDS, seed=7)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_additive_float32_mask_with_half_query(backend):
    """ComfyUI often builds masks in float32 while the model runs in half precision."""
    gen = torch.Generator().manual_seed(3)
    (q, k, v), (rq, rk, rv) = make_qkv(1, 2, 2, 6, 11, 64, torch.bfloat16, "BSHD", gen)
    mask = make_mask((1, 1, 6, 11), "additive", torch.float32, gen)
    out = run_strict(backend, q, k, v, attn_mask=mask)
    assert rel_err(out.transpose(1, 2), reference(rq, rk, rv, mask)[0]) < REL_TOL[torch.bfloat16]
    if backend in LSE_BACKENDS:
        out, lse = run_strict(backend, q, k, v, attn_mask=mask, return_lse=True)
        ref_out, ref_lse = reference(rq, rk, rv, mask)
        assert rel_err(out.transpose(1, 2), ref_out) < REL_TOL[torch.bfloat16]
        assert float(((lse.transpose(1, 2).double() - ref_lse).abs() / (1 + ref_lse.abs())).max()) < LSE_TOL[torch.bfloat16]


def test_reference_is_exact_attention():
    """The reference itself: uniform keys give the mean of the values; a one-hot mask picks one value."""
    v = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    q = torch.zeros(1, 1, 3, 8, dtype=torch.float64)
    out, lse = reference(q, torch.randn(1, 1, 5, 8, dtype=torch.float64), v)
    torch.testing.assert_close(out, v.mean(dim=2, keepdim=True).expand(1, 1, 3, 8))
    torch.testing.assert_close(lse, torch.full((1, 1, 3), math.log(5), dtype=torch.float64))
    only = torch.zeros(3, 5, dtype=torch.bool)
    only[:, 2] = True
    out, _ = reference(q, torch.randn(1, 1, 5, 8, dtype=torch.float64), v, mask=only)
    torch.testing.assert_close(out, v[:, :, 2:3].expand(1, 1, 3, 8))


@pytest.mark.parametrize("case", ["plain", "gqa", "bool mask", "causal", "cross"])
def test_the_lean_reference_without_lse_is_the_same_exact_attention(case):
    """with_lse=False (the quality guard's: one softmax, no logsumexp) against the full reference."""
    gen = torch.Generator().manual_seed(5)
    lk = 40 if case == "cross" else 64
    hk = 2 if case == "gqa" else 4
    q = torch.randn(2, 64, 4, 16, generator=gen)
    k, v = (torch.randn(2, lk, hk, 16, generator=gen) for _ in range(2))
    mask = torch.rand(2, 1, 64, lk, generator=gen) > 0.3 if case == "bool mask" else None
    if mask is not None:
        mask[..., 0] = True
    rows = sample_rows(64, 16)
    full, _ = exact_attention(q, k, v, mask, is_causal=case == "causal", rows=rows)
    lean, lse = exact_attention(q, k, v, mask, is_causal=case == "causal", rows=rows, with_lse=False)
    assert lse is None
    torch.testing.assert_close(lean, full, rtol=0, atol=1e-12)


def test_the_reference_runs_whatever_sdpa_backends_are_switched_off():
    """It is plain matmuls and a softmax: a process that switched SDPA's math kernel off still gets it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v = (torch.randn(1, 32, 2, 16, generator=torch.Generator().manual_seed(6)) for _ in range(3))
    full, _ = exact_attention(q, k, v)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # no math kernel, no float64 kernel through SDPA
        lean, _ = exact_attention(q, k, v, with_lse=False)
    torch.testing.assert_close(lean, full, rtol=0, atol=1e-12)


@pytest.mark.parametrize("case", ["plain", "gqa", "bool mask", "causal"])
def test_slice_rows_pick_the_same_rows_as_their_index_tensor(case):
    """Rows given as a slice (a view, no gather kernel): the reference on them is the one on their indices."""
    gen = torch.Generator().manual_seed(7)
    hk = 2 if case == "gqa" else 4
    q = torch.randn(2, 100, 4, 16, generator=gen)
    k, v = (torch.randn(2, 100, hk, 16, generator=gen) for _ in range(2))
    mask = torch.rand(2, 1, 100, 100, generator=gen) > 0.3 if case == "bool mask" else None
    if mask is not None:
        mask[..., 0] = True
    rows = slice(3, 100, 7)  # what the guard's check samples (guard_check.rotating_rows)
    index = torch.arange(100)[rows]
    by_slice, _ = exact_attention(q, k, v, mask, is_causal=case == "causal", rows=rows, with_lse=False)
    by_index, _ = exact_attention(q, k, v, mask, is_causal=case == "causal", rows=index)
    torch.testing.assert_close(by_slice, by_index, rtol=0, atol=1e-12)
