"""How FP8 attention's error depends on its quantisation scheme, emulated in float64 on the CPU (no GPU needed).

    python bench/fp8_schemes.py [--shapes flux,wan] [--inputs noise,local,outlier,offset] [--heads 4] [--rows 256]
                                [--json bench/results/DATE-cpu-fp8-schemes.json]

For each shape (side_by_side's: Flux (1, 24, 4608, 128), Wan (1, 40, 32760, 128); `--heads` of its heads are drawn,
every head being drawn alike) and each input kind (bench/side_by_side.py's), q, k and v are drawn in bfloat16 as
side_by_side draws them, quantised by each scheme below, and attention is computed in float64 from the dequantised
values with P rounded to e4m3 as FlashAttention-3's FP8 forward rounds it (`quantise.round_p`), its output rounded to
bfloat16 as the kernel's is. Two errors against float64 exact attention on `--rows` sampled query rows: the pack's
relative error (`rel_error_vs_float64`), and that of the part of the output that varies between the sampled queries
(`varying_part_error`: what the output tells the model beyond V's mean, which a relative error over the whole output
does not see where V's offsets dominate it). The pack's own scheme runs through the pack's code (`quantise.quantise`,
then `quantise.fa3_fp8_forward`, the kernel's emulation), the others through the same arithmetic written here:

- `per head`: one scale per (batch, head), nothing smoothed;
- `per head, K smoothed`: K's mean over tokens subtracted first (exact: a per-query shift softmax ignores);
- `..., V smoothed in every channel`: V's mean too, added back to the output;
- `..., V smoothed in its offset channels` (**the pack's**, `flash_3_fp8`): V's mean where it is past 1/16 of the
  channel's range;
- `... + V per channel`: V also scaled per channel, the scale folded into the output after (exact through FA3);
- `Q, K per block of 128 tokens` and `Q, K per token`: finer scales FA3's descale cannot take (one float per
  batch and key/value head), to show what they would buy; the rest as the pack's;
- `Q.K exact` and `P.V exact`: one half of the kernel in e4m3, the other exact: where the error comes from;
- `Sage-like`: INT8 Q (per 16 tokens) and K (per 128 tokens) with e4m3 P and V: SageAttention 2's
  granularity, emulated here (not its kernel; its own error on the GPU is side_by_side's `sage_sm90_per_warp`);
- `exact, bf16 output`: exact attention rounded to bfloat16, the floor of any kernel with a bfloat16 output.
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dispatcher import quantise, quantise_kernel  # noqa: E402
from dispatcher.reference import exact_attention, relative_error, sample_rows  # noqa: E402
from output import emit  # noqa: E402
from side_by_side import inputs  # noqa: E402  (the kinds of input the GPU bench measures)

SHAPES = {"flux": (1, 24, 4608, 128), "wan": (1, 40, 32760, 128)}
E4M3 = torch.float8_e4m3fn


def e4m3(x: torch.Tensor, dims=None, block: int | None = None) -> torch.Tensor:
    """x (B, L, H, D) float64 rounded to e4m3 with one scale per `dims`-reduced group, or per block of tokens."""
    if block is not None:
        blocks = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, -x.shape[1] % block)).unflatten(1, (-1, block))
        scale = (blocks.abs().amax(dim=(2, 4), keepdim=True) / 448).clamp_min(1e-30)
        return ((blocks / scale).to(E4M3).double() * scale).flatten(1, 2)[:, :x.shape[1]]
    scale = (x.abs().amax(dim=dims, keepdim=True) / 448).clamp_min(1e-30)
    return (x / scale).to(E4M3).double() * scale


def int8(x: torch.Tensor, block: int) -> torch.Tensor:
    blocks = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, -x.shape[1] % block)).unflatten(1, (-1, block))
    scale = (blocks.abs().amax(dim=(2, 4), keepdim=True) / 127).clamp_min(1e-30)
    return ((blocks / scale).round().clamp(-127, 127) * scale).flatten(1, 2)[:, :x.shape[1]]


def attend(q, k, v, rows, round_p=True) -> torch.Tensor:
    """Attention of query rows `rows` in float64, P rounded as FA3's FP8 forward rounds it: (B, H, R, Dv)."""
    scores = torch.einsum("brhd,bmhd->bhrm", q[:, rows], k) * q.shape[-1] ** -0.5
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    total = p.sum(dim=-1, keepdim=True)
    return torch.einsum("bhrm,bmhd->bhrd", (quantise.round_p(p) if round_p else p) / total, v)


def v_shift(v: torch.Tensor, where: str):
    """V's mean over tokens in every channel, in its offset channels only (the pack's rule), or none."""
    if where == "none":
        return torch.zeros_like(v[:, :1])
    mean = v.mean(dim=1, keepdim=True)
    if where == "offsets":
        spread = v.amax(dim=1, keepdim=True) - v.amin(dim=1, keepdim=True)
        mean = torch.where(mean.abs() * quantise_kernel.OFFSET_SHARE > spread, mean, 0.0)
    return mean


def bf16_out(out: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The kernel's bfloat16 output (B, H, R, Dv) with V's shift (B, 1, H, Dv) added back as `quantise.restore`
    adds it: in float32, rounded once to bfloat16."""
    out = out.to(torch.bfloat16).float() + shift.transpose(1, 2).float()
    return out.to(torch.bfloat16).double()


def scheme(name, q, k, v, rows):
    """(B, H, R, Dv) float64 output of scheme `name` on bf16 (B, L, H, D) inputs."""
    if name == PACK:  # the pack's own code: the quantisation and the kernel's emulation
        prepared = quantise.quantise(q, k, v)
        out = quantise.fa3_fp8_forward(prepared.q[:, rows], prepared.k, prepared.v, q_descale=prepared.q_descale,
                                       k_descale=prepared.k_descale, v_descale=prepared.v_descale)
        return quantise.restore(out, prepared).double().transpose(1, 2)
    q, k, v = q.double(), k.double(), v.double()
    if name == FLOOR:
        return attend(q, k, v, rows, round_p=False).to(torch.bfloat16).double()
    if name != "per head":
        k = k - k.mean(dim=1, keepdim=True)
    shift = v_shift(v, "all" if "every channel" in name else "none" if name in SCHEMES[:2] else "offsets")
    v = v - shift
    per_head = (1, 3)
    if "per block" in name:
        qx, kx = e4m3(q, block=128), e4m3(k, block=128)
    elif "per token" in name:
        qx, kx = e4m3(q, dims=(3,)), e4m3(k, dims=(3,))
    elif name.startswith("Sage-like"):
        qx, kx = int8(q, 16), int8(k, 128)
    elif name.startswith("Q.K exact"):
        qx, kx = q, k
    else:
        qx, kx = e4m3(q, per_head), e4m3(k, per_head)
    if name.startswith("P.V exact"):
        return bf16_out(attend(qx, kx, v, rows, round_p=False), shift)
    vx = e4m3(v, dims=(1,)) if "V per channel" in name else e4m3(v, per_head)
    return bf16_out(attend(qx, kx, vx, rows), shift)


PACK = "per head, K smoothed, V smoothed in its offset channels"
FLOOR = "exact, bf16 output"
SCHEMES = ("per head", "per head, K smoothed", "per head, K smoothed, V smoothed in every channel", PACK,
           PACK + " + V per channel",
           "Q, K per block of 128 tokens (not through FA3), else the pack's",
           "Q, K per token (not through FA3), else the pack's",
           "Q.K exact, P and V e4m3, else the pack's", "P.V exact, Q and K e4m3, else the pack's",
           "Sage-like: INT8 Q per 16 and K per 128 tokens, e4m3 P and V, else the pack's", FLOOR)


def varying_part_error(out: torch.Tensor, reference: torch.Tensor) -> float:
    """The error of what varies between the sampled queries (each output less their mean), relative to that part
    of the exact output."""
    off, signal = out - reference, reference - reference.mean(dim=2, keepdim=True)
    return float((off - off.mean(dim=2, keepdim=True)).norm() / signal.norm())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="flux,wan")
    parser.add_argument("--inputs", default="noise,local,outlier,offset")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    results = []
    for shape_name in args.shapes.split(","):
        b, heads, length, d = SHAPES[shape_name]
        rows = sample_rows(length, args.rows)
        for kind in args.inputs.split(","):
            q, k, v = inputs(kind, b, min(heads, args.heads), length, d, torch.device("cpu"), torch.bfloat16)
            reference, _ = exact_attention(q, k, v, rows=rows, with_lse=False)
            outs = {name: scheme(name, q, k, v, rows) for name in SCHEMES}
            results.append({"shape": shape_name, "shape_bhld": [b, heads, length, d], "inputs": kind,
                            "rel_error_vs_float64": {name: float(f"{relative_error(out, reference):.3e}")
                                                     for name, out in outs.items()},
                            "varying_part_error": {name: float(f"{varying_part_error(out, reference):.3e}")
                                                   for name, out in outs.items()}})
            print(shape_name, kind, results[-1]["rel_error_vs_float64"][PACK], file=sys.stderr, flush=True)
            del outs
    emit({"what": "FP8 attention's error per quantisation scheme, float64 emulation of FlashAttention-3's FP8 forward",
          "date": datetime.date.today().isoformat(), "device": "cpu", "torch": torch.__version__,
          "heads_drawn": args.heads, "rows": args.rows, "pack_scheme": PACK, "results": results}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
