"""The quality guard's check (dispatcher/guard_check.py): its own accuracy against the float64 reference, the
NaN/Inf test of the whole output, the rotation of the sampled rows, and the Triton kernel against the torch path
(run by Triton's CPU interpreter where triton is installed; on the GPU: tests/gpu/test_gpu_guard.py)."""

from __future__ import annotations

import math

import pytest
import torch

from dispatcher import guard, guard_check
from dispatcher.reference import exact_attention
from helpers import triton_interpreter

# The smallest bound the guard judges: twice an exact kernel's error_bound (native's 1e-2); quantised ones 1e-1.
SMALLEST_BOUND = 2e-2
# The check's own error must be far below it: measured at most 1.1e-6 on the cases below (bf16 and fp16 inputs,
# outlier keys, 32768 keys, causal, grouped heads, masks).
CHECK_ERROR = 5e-6


def inputs(dtype, lq=64, lk=256, h=2, hk=2, d=64, dv=64, outlier=0.0, seed=0, layout="BSHD"):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, lq, h, d, generator=gen)
    k = torch.randn(1, lk, hk, d, generator=gen) * 2
    v = torch.randn(1, lk, hk, dv, generator=gen)
    if outlier:  # a large random-sign key channel the queries ignore (what turns Sage's int8 keys to noise)
        q[..., 0] = 0
        k[..., 0] = (torch.randint(0, 2, k.shape[:3], generator=gen) * 2 - 1) * outlier
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if layout == "BHSD":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return q, k, v


CASES = {
    "plain": dict(),
    "outlier keys": dict(outlier=100.0, lk=4096),
    "long": dict(lk=32768, h=1, hk=1),
    "causal": dict(lq=512, lk=512, causal=True),
    "grouped heads": dict(h=4, hk=2, dv=32),
    "bool mask": dict(mask="bool"),
    "additive mask": dict(mask="additive"),
    "BHSD": dict(layout="BHSD"),
}


def _mask(kind, lq, lk):
    gen = torch.Generator().manual_seed(5)
    if kind == "bool":
        keep = torch.rand(1, 1, lq, lk, generator=gen) > 0.3
        keep[..., 0] = True
        return keep
    return torch.randn(1, 1, lq, lk, generator=gen)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_the_checks_own_error_is_far_below_the_smallest_bound_it_judges(dtype, case):
    """float32 accumulation over chunks of keys against dispatcher/reference.py's float64 attention on the same
    low-precision inputs: at most CHECK_ERROR (measured ~1e-6), 4000 times below the smallest bound."""
    options = dict(CASES[case])
    causal, mask_kind, layout = options.pop("causal", False), options.pop("mask", None), options.get("layout", "BSHD")
    q, k, v = inputs(dtype, **options)
    lq, lk = q.shape[1 if layout == "BSHD" else 2], k.shape[1 if layout == "BSHD" else 2]
    mask = _mask(mask_kind, lq, lk) if mask_kind else None
    offset, stride = guard_check.rotating_rows(lq, guard.ROWS, "self #1", 3)
    ref, _ = exact_attention(q, k, v, mask, causal, layout=layout, rows=torch.arange(offset, lq, stride))
    mine = guard_check.exact_rows(q, k, v, offset=offset, stride=stride, attn_mask=mask, is_causal=causal,
                                  layout=layout, chunk_bytes=1 << 16)  # several chunks even on short calls
    assert mine.dtype == torch.float32
    error = float((mine.double() - ref).norm() / ref.norm())
    assert error <= CHECK_ERROR <= SMALLEST_BOUND / 4000, error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_error_the_check_reports_is_the_error_against_float64(dtype):
    """The relative error from the check's terms is the kernel's error measured against float64 attention, to
    within the check's own error: for a kernel 3% off and for an exact one."""
    q, k, v = inputs(dtype, lq=100, lk=3000, outlier=30.0)
    ref, _ = exact_attention(q, k, v)  # (B, H, L, Dv)
    offset, stride = guard_check.rotating_rows(100, guard.ROWS, "self", 0)
    for off_by in (0.03, 0.0):
        noise = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        out = (ref + off_by * ref.norm() / noise.norm() * noise).transpose(1, 2).to(dtype)
        d2, r2, non_finite = guard_check.torch_terms(q, k, v, out, offset=offset, stride=stride).tolist()
        picked = ref[:, :, offset::stride]
        truth = float((out.transpose(1, 2)[:, :, offset::stride].double() - picked).norm() / picked.norm())
        assert non_finite == 0 and abs(math.sqrt(d2 / r2) - truth) <= CHECK_ERROR, (math.sqrt(d2 / r2), truth)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_value_anywhere_in_the_output_is_seen(bad):
    """Outside the sampled rows too; and large finite values are not taken for one."""
    q, k, v = inputs(torch.bfloat16, lq=300)
    out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    offset, stride = guard_check.rotating_rows(300, guard.ROWS, "self", 0)
    unsampled = next(r for r in range(300) if (r - offset) % stride)
    spoiled = out.clone()
    spoiled[0, unsampled, 1, 7] = bad
    assert guard_check.torch_terms(q, k, v, spoiled, offset=offset, stride=stride)[2] != 0
    loud = out.clone()
    loud[0, unsampled] = 3e38  # near bfloat16's largest: finite
    assert guard_check.torch_terms(q, k, v, loud, offset=offset, stride=stride)[2] == 0
    assert guard_check.non_finite_term(spoiled.transpose(1, 2)) != 0 and guard_check.non_finite_term(loud) == 0


@pytest.mark.parametrize("len_q", [1, 15, 16, 17, 100, 1024, 4099, 32760])
def test_rows_rotate_over_every_query_row_within_ceil_l_over_rows_checks(len_q):
    rows = guard.ROWS
    checks = -(-len_q // rows)
    for site in ("self #0", "self #7", "attention"):
        seen = set()
        for check in range(5, 5 + checks):  # any run of that many consecutive checks
            offset, stride = guard_check.rotating_rows(len_q, rows, site, check)
            picked = range(offset, len_q, stride)
            assert 1 <= len(picked) <= rows
            seen.update(picked)
        assert seen == set(range(len_q)), (site, len_q)
    # deterministic per block and check; blocks start at different rows
    assert guard_check.rotating_rows(4099, rows, "self #3", 9) == guard_check.rotating_rows(4099, rows, "self #3", 9)
    assert len({guard_check.rotating_rows(4099, rows, f"self #{i}", 0)[0] for i in range(30)}) > 20


TRITON_SCRIPT = r"""
import sys, torch
sys.path.insert(0, sys.argv[1])
from dispatcher import guard_check as gc
cases = [(torch.bfloat16, 1, 2, 2, 100, 130, 64, 64, False, "BSHD"), (torch.float16, 2, 4, 2, 40, 300, 32, 48, True, "BHSD"),
         (torch.bfloat16, 1, 2, 1, 10, 70, 8, 8, False, "BSHD"), (torch.float16, 1, 1, 1, 300, 200, 128, 128, False, "BSHD"),
         (torch.bfloat16, 3, 2, 2, 50, 90, 32, 32, False, "BSHD")]  # the last: K and V of batch 1, broadcast
worst = 0.0
for dt, b, h, hk, lq, lk, d, dv, causal, layout in cases:
    g = torch.Generator().manual_seed(lq)
    shape = (lambda L, H, D: (b, L, H, D)) if layout == "BSHD" else (lambda L, H, D: (b, H, L, D))
    q = torch.randn(shape(lq, h, d), generator=g).to(dt)
    k, v = (torch.randn(shape(*s), generator=g).to(dt) for s in ((lk, hk, d), (lk, hk, dv)))
    if b == 3:
        k, v = k[:1], v[:1]
    out = torch.randn(shape(lq, h, dv), generator=g).to(dt) * 0.01
    for check in range(3):
        off, st = gc.rotating_rows(lq, 16, "self #3", check)
        a = gc.kernel_terms(q, k, v, out, offset=off, stride=st, is_causal=causal, layout=layout, block_n=32)
        t = gc.torch_terms(q, k, v, out, offset=off, stride=st, is_causal=causal, layout=layout)
        assert a[2] == 0 and t[2] == 0
        worst = max(worst, float(((a[:2] - t[:2]).abs() / t[:2]).max()))
    bad = out.clone()
    bad.view(-1)[-1] = float("nan")
    assert gc.kernel_terms(q, k, v, bad, offset=off, stride=st, is_causal=causal, layout=layout)[2] != 0
print(worst)
"""


def test_the_triton_kernel_agrees_with_the_torch_path_under_the_interpreter():
    """The Triton kernel, run on the CPU by Triton's interpreter (TRITON_INTERPRET=1; in a process of its own, since
    the switch is read when the kernel is defined): the same error terms as the torch path on bf16/fp16, causal,
    grouped heads, BHSD, head dims 8-128, several key splits; a NaN in the last element of the output is seen."""
    stdout = triton_interpreter.run(TRITON_SCRIPT, "the kernel's range() over tensor bounds; the kernel itself runs "
                                    "there on a GPU (tests/gpu/test_gpu_guard.py, H200, torch 2.11 + Triton 3.6)")
    assert float(stdout.strip().splitlines()[-1]) < 1e-5, stdout


@pytest.mark.parametrize("dtype, causal", [("bf16", False), ("fp16", True)])
def test_the_triton_kernel_compiles_for_the_h100_and_h200(dtype, causal):
    """Ahead of time, without a GPU: both launches compile for sm_90 (Hopper) at the head dims of video models (128),
    as they would on the first checked call there (the interpreter runs the Python, not this compilation)."""
    triton = pytest.importorskip("triton")
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def signature(fn, types, constants):
        return {n: "constexpr" if n in constants else types.get(n, "i32") for n in inspect.signature(fn.fn).parameters}

    floats = {n: "*fp32" for n in ("m_ptr", "l_ptr", "acc_ptr", "bad_ptr", "terms_ptr")}
    tensors = {**floats, **{n: f"*{dtype}" for n in ("q_ptr", "k_ptr", "v_ptr", "o_ptr")}, "scale": "fp32"}
    partial = {"IS_CAUSAL": causal, "UPCAST_QK": False, "BLOCK_R": 16, "BLOCK_N": 64, "BLOCK_D": 128, "BLOCK_DV": 128}
    combine = {"BLOCK_R": 16, "BLOCK_DV": 128}
    for fn, constants in ((guard_check._partial, partial), (guard_check._combine, combine)):
        source = ASTSource(fn=fn, signature=signature(fn, tensors, constants), constexprs=constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert compiled.asm.get("cubin"), fn


def test_a_kernel_that_cannot_run_here_leaves_the_checks_to_the_torch_path(monkeypatch, caplog):
    """A triton that imports but cannot build or launch the kernel (no compiler for this GPU): the check it was
    making is made by the torch path, one warning says why, and later checks go there directly."""
    q, k, v = inputs(torch.bfloat16, lq=40)
    out = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    tried = []

    def fails(*args, **kwargs):
        tried.append(1)
        raise RuntimeError("PTX .version 9.4 does not support .target sm_120")

    monkeypatch.setattr(guard_check, "triton", object())
    monkeypatch.setattr(guard_check, "broken", "")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # a CUDA call, as far as the check sees
    monkeypatch.setattr(guard_check, "kernel_terms", fails)
    expected = guard_check.torch_terms(q, k, v, out, offset=3, stride=3)
    with caplog.at_level("WARNING"):
        first = guard_check.check_terms(q, k, v, out, offset=3, stride=3)
        second = guard_check.check_terms(q, k, v, out, offset=3, stride=3)
    torch.testing.assert_close(first, expected)
    torch.testing.assert_close(second, expected)
    assert tried == [1] and "sm_120" in guard_check.broken
    assert sum("Triton check kernel failed" in r.getMessage() for r in caplog.records) == 1
