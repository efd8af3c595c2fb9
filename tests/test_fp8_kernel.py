"""The fused FP8 quantisation (dispatcher/quantise_kernel.py) against its float64 reference (`quantise.reference`):
run by Triton's CPU interpreter where triton is installed (the kernel on the GPU: tests/gpu/test_gpu_fp8.py),
compiled ahead of time for sm_90, and the torch path taking over when the kernel cannot run."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from dispatcher import quantise, quantise_kernel
from helpers import triton_interpreter

INTERPRETER_SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from dispatcher import quantise, quantise_kernel

def case(name, b, length, h, hk, d, dtype, seed, layout="BSHD"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, length, h, d, generator=g)
    k = torch.randn(b, length, hk, d, generator=g) * 3 + torch.randn(1, 1, hk, d, generator=g) * 5
    v = torch.randn(b, length, hk, d, generator=g) + torch.randn(1, 1, hk, d, generator=g) * 4
    if name == "outlier keys":
        q[..., 0] = 0
        k[..., 0] = (torch.randint(0, 2, k.shape[:3], generator=g) * 2 - 1) * 100.0
    if name == "a zero head":
        k[:, :, 0] = 0
        q[:, :, 0] = 0
    if name == "tiny and huge heads":
        q[:, :, 0] *= 1e-3
        v[:, :, -1] *= 1e3
    q, k, v = (t.to(dtype) for t in (q, k, v))
    if layout == "BHSD":  # (B, L, H, D) views of (B, H, L, D) storage: strided over tokens and heads
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    return q, k, v

CASES = [("noise", 2, 300, 4, 2, 64, torch.bfloat16, 1), ("outlier keys", 1, 600, 2, 2, 128, torch.bfloat16, 2),
         ("offsets", 1, 77, 3, 1, 80, torch.float16, 3), ("a zero head", 1, 200, 2, 2, 32, torch.float32, 4),
         ("tiny and huge heads", 1, 129, 2, 1, 256, torch.bfloat16, 5),
         ("strided", 2, 100, 2, 2, 64, torch.bfloat16, 6, "BHSD")]
rows = []
for name, *shape in CASES:
    q, k, v = case(name, *shape)
    modes = ((q, "none"), (k, "mean"), (v, "offsets"))
    got = tuple(quantise_kernel.quantise_one(x, k.shape[2], smooth) for x, smooth in modes)
    ref = tuple(quantise.reference_one(x, k.shape[2], smooth) for x, smooth in modes)
    row = {"case": name, "values": 0, "differ": 0, "most_steps": 0.0, "descale_rel": 0.0, "mean_abs": 0.0,
           "contiguous": True, "finite": True}
    for (x8, descale, mean), (r8, rdescale, rmean) in zip(got, ref):
        a, r = x8.float(), r8.float()
        step = torch.where(r.abs() >= 2 ** -6, 2.0 ** (torch.floor(torch.log2(r.abs().clamp_min(2 ** -6))) - 3),
                           2.0 ** -9)  # e4m3's spacing at r
        row["values"] += a.numel()
        row["differ"] += int((a != r).sum())
        row["most_steps"] = max(row["most_steps"], float(((a - r).abs() / step).max()))
        row["descale_rel"] = max(row["descale_rel"], float(((descale.double() - rdescale.double()).abs()
                                                            / rdescale.double()).max()))
        if mean is not None:
            row["mean_abs"] = max(row["mean_abs"], float((mean.double() - rmean.double()).abs().max()))
        row["contiguous"] &= x8.is_contiguous() and x8.shape == r8.shape and x8.dtype == torch.float8_e4m3fn
        row["finite"] &= bool(torch.isfinite(a).all() and torch.isfinite(descale).all())
    rows.append(row)
# and through `quantise`, which picks the kernel here
prepared = quantise.quantise(*case("noise", 1, 64, 2, 1, 32, torch.bfloat16, 7))
rows.append({"case": "quantise picks the kernel", "broken": quantise.broken, "k_mean": list(prepared.k_mean.shape),
             "v_mean": list(prepared.v_mean.shape)})
print(json.dumps(rows))
"""


def test_the_kernel_gives_the_float64_references_numbers_under_the_interpreter():
    """Triton's CPU interpreter (TRITON_INTERPRET=1, in a process of its own: the switch is read when the kernels
    are defined) runs the kernels on bf16/fp16/fp32, grouped query heads, head dims 32-256, lengths that are not a
    multiple of the tile, strided inputs, outlier keys, an all-zero head and heads 10^6 apart: every e4m3 value is
    the reference's but where a float32 value lies within rounding of an e4m3 midpoint (one step, in about 1 value
    in 10^5: 3 of 307,200 on noise with Triton 3.9), the descales within float32 rounding, the means within float32
    summation."""
    stdout = triton_interpreter.run(INTERPRETER_SCRIPT, "the kernels' range() over their integer arguments; the "
                                    "kernels themselves run there on a GPU (tests/gpu/test_gpu_fp8.py)")
    rows = json.loads(stdout.strip().splitlines()[-1])
    for row in rows[:-1]:
        assert row["contiguous"] and row["finite"], row
        assert row["differ"] <= max(4, row["values"] // 20_000) and row["most_steps"] <= 1.0, row
        assert row["descale_rel"] < 1e-6 and row["mean_abs"] < 1e-4, row
    assert rows[-1] == {"case": "quantise picks the kernel", "broken": "", "k_mean": [1, 1, 32],
                        "v_mean": [1, 1, 1, 32]}, rows[-1]


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_the_kernels_compile_for_the_h100_and_h200(dtype):
    """Ahead of time, without a GPU: the three launches compile for sm_90 at head dims 128 and 256, specialised as
    Triton specialises them for a contiguous head dim (stride 1, the other strides and the pointers multiples of
    16): the reads are 16-byte vector loads, and the cast to e4m3 is the hardware's round-to-nearest conversion of
    values already on the e4m3 grid."""
    triton = pytest.importorskip("triton")
    import inspect

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = {"x_ptr", "out_ptr", "sum_ptr", "max_ptr", "min_ptr", "shift_ptr", "sxb", "sxl", "sxh", "sob", "sol",
               "soh", "dim"}

    def source(fn, constants):
        types = {"x_ptr": f"*{dtype}", "out_ptr": "*fp8e4nv",
                 **{n: "*fp32" for n in ("sum_ptr", "max_ptr", "min_ptr", "descale_ptr", "shift_ptr")}}
        names = list(inspect.signature(fn.fn).parameters)
        constants = {**constants, **({"sxd": 1} if "sxd" in names else {})}
        signature = {n: "constexpr" if n in constants else types.get(n, "i32") for n in names}
        attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned if n in names}
        return ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)

    for fn, constants, warps in ((quantise_kernel._stats, {"BLOCK_L": 32, "BLOCK_D": 128}, 8),
                                 (quantise_kernel._finish, {"SMOOTH": 2, "BLOCK_S": 32, "BLOCK_D": 128}, 4),
                                 (quantise_kernel._finish, {"SMOOTH": 0, "BLOCK_S": 32, "BLOCK_D": 256}, 8),
                                 (quantise_kernel._cast, {"SHIFT": True, "BLOCK_L": 64, "BLOCK_D": 128}, 4),
                                 (quantise_kernel._cast, {"SHIFT": False, "BLOCK_L": 64, "BLOCK_D": 256}, 8)):
        compiled = triton.compile(source(fn, constants), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps})
        ptx = compiled.asm["ptx"]
        assert compiled.asm.get("cubin"), fn
        if fn is not quantise_kernel._finish:
            assert "ld.global.v4" in ptx, fn
        if fn is quantise_kernel._cast:
            assert "cvt.rn.satfinite.e4m3x2.f32" in ptx
        # Triton's `/` is the approximate div.full.f32 (up to 2 ulp): every division is the correctly rounded one
        assert "div.full" not in ptx and "div.approx" not in ptx, fn
        assert fn is quantise_kernel._stats or "div.rn.f32" in ptx, fn


def test_a_kernel_that_cannot_run_leaves_the_quantisation_to_the_torch_path(monkeypatch, caplog):
    """A triton that imports but cannot build or launch the kernels: the call is quantised by the torch path (the
    same numbers), one warning says why, and later calls go there directly."""
    calls = []

    def fails(*args):
        calls.append(args)
        raise RuntimeError("no compiler for this GPU")

    monkeypatch.setattr(quantise, "broken", "")
    monkeypatch.setattr(quantise_kernel, "usable", lambda *tensors: True)
    monkeypatch.setattr(quantise_kernel, "quantise_one", fails)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 64, 2, 32, generator=gen).to(torch.bfloat16) for _ in range(3))
    with caplog.at_level(logging.WARNING):
        got = quantise.quantise(q, k, v)
        quantise.quantise(q, k, v)
    assert len(calls) == 1 and quantise.broken == "RuntimeError: no compiler for this GPU"
    assert sum("fused FP8 quantisation kernel failed" in r.getMessage() for r in caplog.records) == 1
    ref = quantise.reference(q, k, v)
    for name in ("q", "k", "v"):
        assert torch.equal(getattr(got, name).float(), getattr(ref, name).float())
    torch.testing.assert_close(got.k_descale, ref.k_descale, rtol=0, atol=0)


def test_the_kernel_is_not_offered_what_it_does_not_take():
    """No GPU and no interpreter, an empty tensor, a head dim over 256: the torch path quantises those."""
    x = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert not quantise_kernel.usable(x)  # a CPU tensor
    for bad in (torch.zeros(1, 0, 2, 64), torch.zeros(1, 8, 2, 320), torch.zeros(1, 8, 2, 64, dtype=torch.float64)):
        assert not quantise_kernel.usable(bad)


def _kernel_arithmetic(x, descale, shift, heads_kv, reciprocal=False):
    """The kernel's `_cast` in float32 torch ops, with the reference's float32 descale and shift: (x - shift) divided
    by the descale (correctly rounded, as `div_rn`), or times its reciprocal (what the kernel did before), then
    rounded to e4m3 with ties to even."""
    g = quantise._groups(x.float(), heads_kv)
    centred = g if shift is None else g - shift[:, None, :, None]
    d = descale[:, None, :, None, None]
    y = centred * (1.0 / d) if reciprocal else centred / d
    return y.to(torch.float8_e4m3fn).flatten(2, 3).float()


def test_the_kernels_float32_arithmetic_gives_the_float64_references_numbers():
    """On the GPU test's inputs (bf16 queries, outlier keys shifted by 3, values with offsets; Flux's head dim, a CPU
    generator): dividing in float32 by the float32 descale after subtracting the float32 shift gives every e4m3 value
    of the float64 reference, which rounds its quotient to float32 before e4m3. Multiplying by the reciprocal
    instead moves the queries' exact e4m3 midpoints (bf16 value / (bf16 maximum / 448)) an ulp off: 3,398 of
    3,538,944 values here (0.1%), what an H100 showed on 2026-12-06 before the kernel divided."""
    gen = torch.Generator().manual_seed(1)
    b, length, h, d = 1, 4608, 6, 128
    q, k, v = (torch.randn(b, length, h, d, generator=gen).to(torch.bfloat16) for _ in range(3))
    q[..., 0] = 0
    k[..., 0] = (torch.randint(0, 2, k.shape[:3], generator=gen) * 2 - 1).to(k.dtype) * 100
    k, v = k + 3.0, (v.float() * 2 + 5).to(torch.bfloat16)
    for x, smooth in ((q, "none"), (k, "mean"), (v, "offsets")):
        r8, descale, shift = quantise.reference_one(x, h, smooth)
        assert torch.equal(_kernel_arithmetic(x, descale, shift, h), r8.float()), smooth
    r8, descale, _ = quantise.reference_one(q, h, "none")
    assert int((_kernel_arithmetic(q, descale, None, h, reciprocal=True) != r8.float()).sum()) == 3398
