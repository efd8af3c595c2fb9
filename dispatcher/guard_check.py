"""The quality guard's check: exact attention on a few query rows of a call, against the kernel's output rows, and
the NaN/Inf test of the kernel's whole output, in one pass over the call's own tensors.

`check_terms` returns, on the call's device, three figures: ‖out_rows − ref_rows‖², ‖ref_rows‖² (over the sampled
rows of every batch and head) and a non-finite term that is 0 exactly when the whole output is finite. The guard
reads them with one transfer (guard_rules.Comparison). Two implementations, compared by the tests:

- a Triton kernel (CUDA, bf16/fp16 inputs, no mask): it reads K and V once in their own dtype, split over the keys
  so that the whole GPU streams them (`_partial`: online softmax over key blocks, q·k products exact in float32
  from bf16/fp16, P·V in true float32, the `ieee` dot, not tf32), scans the output for NaN/Inf in the same
  programs, and merges the splits and takes the error terms in a second launch (`_combine`). Extra memory: the
  splits' partial results, a few MB (B·H·splits·rows·Dv floats). Used where triton imports (Linux wheels of torch
  ship it; on Windows without triton-windows the torch path serves).
- the torch path, the reference and the CPU path (and any call the kernel does not take: a mask, float32 inputs):
  the same online softmax over chunks of keys, each chunk cast to float32 (float64 for float64 inputs), never a
  float64 copy of K or V: its extra memory is a chunk, at most CHUNK_BYTES.

Rows: `rotating_rows` picks, for the n-th check of a block, every stride-th query row from an offset that moves by
one at each check (starting at a point fixed by the block's name), so ceil(L / rows) checks of a block cover every
query row: a kernel wrong on a few rows only is caught within that many checks.

Accuracy (tests/test_guard_check.py, against dispatcher/reference.py's float64 attention on bf16 and fp16 inputs:
outlier keys, 32768 keys, causal, grouped heads, masks): the check's own relative error measured at most 1.1e-6
(held under 5e-6), four orders below the smallest bound it judges (2e-2: twice an exact kernel's error_bound;
quantised kernels 1e-1).
"""

from __future__ import annotations

import math
import os
import zlib

import torch

from . import masks
from .log import logger
from .reference import to_bhsd

ROWS = 16  # query rows a check samples (of every batch and head): the guard's sample, priced by guard_sizing
CHUNK_BYTES = 8 << 20  # the torch path's extra memory per key chunk (its float32 K and V slices and scores)
ROW_BLOCK = 16  # the Triton kernel's row tile: at least `rows` (tl.dot's smallest tile)

try:  # import-guarded: triton ships with torch's Linux wheels, not with every platform's
    import triton
    import triton.language as tl
except Exception:  # noqa: BLE001 (any failure to import means: the torch path serves)
    triton = None


def rotating_rows(len_q: int, rows: int, site: str, check: int) -> tuple[int, int]:
    """(offset, stride): the query rows offset, offset + stride, ... (below len_q; at most `rows` of them) that the
    `check`-th check of block `site` samples. Deterministic per block and check; consecutive checks shift by one
    row, so any ceil(len_q / rows) consecutive checks of a block sample every row once."""
    if len_q <= rows:
        return 0, 1
    stride = -(-len_q // rows)
    return (zlib.crc32(site.encode()) + check) % stride, stride


def sampled_count(len_q: int, offset: int, stride: int) -> int:
    return len(range(offset, len_q, stride))


# Why the Triton kernel no longer serves checks in this process ("" while it does): a triton that imports but cannot
# build or launch the kernel here (no compiler for this GPU, a driver it does not know) must not fail the calls the
# guard checks; the torch path gives the same verdicts.
broken = ""


def uses_kernel(query, key, value, attn_mask) -> bool:
    """Whether the Triton kernel takes this call (else the torch path does)."""
    return (triton is not None and not broken and query.is_cuda and attn_mask is None and query.dtype in (torch.bfloat16,
            torch.float16) and key.dtype == value.dtype == query.dtype and query.shape[-1] <= 256
            and value.shape[-1] <= 256 and query.numel() > 0 and key.numel() > 0)


def check_terms(query, key, value, out, *, offset: int, stride: int, attn_mask=None, is_causal=False, scale=None,
                layout="BSHD") -> torch.Tensor:
    """(‖out_rows − ref_rows‖², ‖ref_rows‖², non-finite term) on the call's device: the relative error is
    sqrt(first / second); the output has a NaN/Inf exactly when the third is not 0. Rows: offset::stride."""
    if uses_kernel(query, key, value, attn_mask):
        try:
            return kernel_terms(query, key, value, out, offset=offset, stride=stride, is_causal=is_causal,
                                scale=scale, layout=layout)
        except Exception as exc:  # noqa: BLE001 (whatever stops the kernel, the torch path checks the call)
            global broken
            broken = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
            logger.warning("the quality guard's Triton check kernel failed (%s); its checks use the torch path "
                           "for the rest of the process", broken)
    return torch_terms(query, key, value, out, offset=offset, stride=stride, attn_mask=attn_mask,
                       is_causal=is_causal, scale=scale, layout=layout)


# ------------------------------------------------------------------------------------------------ the torch path


def exact_rows(query, key, value, *, offset: int, stride: int, attn_mask=None, is_causal=False, scale=None,
               layout="BSHD", chunk_bytes: int = CHUNK_BYTES) -> torch.Tensor:
    """Exact attention for query rows offset::stride, (B, H, R, Dv), in float32 (float64 for float64 inputs):
    an online softmax over chunks of keys, each cast on its own (no copy of K or V in a wider dtype)."""
    q, k, v = to_bhsd(query, layout), to_bhsd(key, layout), to_bhsd(value, layout)
    b, h, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    groups = h // hk
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    rows = slice(offset, lq, stride)
    n = sampled_count(lq, offset, stride)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    # grouped-query heads: the G query heads of one K/V head are G·R rows against that head's keys
    qr = (q[:, :, rows].to(acc) * scale).reshape(b, hk, groups * n, d)
    mask4 = None if attn_mask is None else masks.to_4d(attn_mask).expand(b, h, lq, lk)[:, :, rows]
    positions = torch.arange(offset, lq, stride, device=q.device).repeat(groups)[:, None] if is_causal else None
    per_key = b * hk * (d + dv) * 4 + b * h * n * 4 * 3
    chunk = max(1, min(lk, chunk_bytes // per_key))
    m = qr.new_full((b, hk, groups * n, 1), float("-inf"))
    total = qr.new_zeros((b, hk, groups * n, 1))
    o = qr.new_zeros((b, hk, groups * n, dv))
    for c0 in range(0, lk, chunk):
        c1 = min(lk, c0 + chunk)
        s = torch.matmul(qr, k[:, :, c0:c1].to(acc).transpose(-2, -1))
        if positions is not None:
            s.masked_fill_(torch.arange(c0, c1, device=q.device)[None, :] > positions, float("-inf"))
        if mask4 is not None:
            mc = mask4[..., c0:c1].reshape(b, hk, groups * n, c1 - c0)
            s = s.masked_fill(~mc, float("-inf")) if mc.dtype == torch.bool else s + mc.to(acc)
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)  # a row with no key yet: nothing to rescale
        p = torch.exp(s - m_safe)
        alpha = torch.exp(m - m_safe)
        total = total * alpha + p.sum(-1, keepdim=True)
        o = o * alpha + torch.matmul(p, v[:, :, c0:c1].to(acc))
        m = m_new
    return (o / total).reshape(b, h, n, dv)


def torch_terms(query, key, value, out, *, offset: int, stride: int, attn_mask=None, is_causal=False, scale=None,
                layout="BSHD") -> torch.Tensor:
    ref = exact_rows(query, key, value, offset=offset, stride=stride, attn_mask=attn_mask, is_causal=is_causal,
                     scale=scale, layout=layout)
    got = to_bhsd(out, layout)[:, :, offset::stride].to(ref.dtype)
    return torch.stack(((got - ref).square().sum().double(), ref.square().sum().double(), non_finite_term(out)))


def non_finite_term(out: torch.Tensor) -> torch.Tensor:
    """A float64 scalar on out's device: 0 when every value of `out` is finite, NaN otherwise. One reduction in out's
    own dtype (its min and max: NaN propagates, an Inf is one of them), no copy: a sum with dtype=float64 would
    first copy a bf16 output to float64 (4x its size: 1.3 GB on Wan 14B's shape)."""
    return (torch.stack(torch.aminmax(out)).double() * 0).sum()


# ------------------------------------------------------------------------------------------------ the Triton kernel

_SM_COUNTS: dict = {}


def _splits(device, heads: int, len_kv: int, block_n: int) -> int:
    """Key splits per (batch, head): enough programs (4 per SM) for the whole GPU to stream K and V."""
    sms = _SM_COUNTS.get(device)
    if sms is None:
        sms = _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count \
            if device.type == "cuda" else 4
    return max(1, min(-(-len_kv // block_n), -(-4 * sms // heads)))


def kernel_terms(query, key, value, out, *, offset: int, stride: int, is_causal=False, scale=None,
                 layout="BSHD", block_n: int = 64) -> torch.Tensor:
    """check_terms by the Triton kernel (two launches and one small sum)."""
    q, k, v, o = (to_bhsd(t, layout) for t in (query, key, value, out))
    b, h, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    n = sampled_count(lq, offset, stride)
    if n > 4 * ROW_BLOCK:  # the rows are one register tile
        raise ValueError(f"the check kernel samples at most {4 * ROW_BLOCK} query rows; got {n} "
                         f"(offset {offset}, stride {stride}): use rotating_rows")
    block_r = max(ROW_BLOCK, triton.next_power_of_2(n))
    block_d, block_dv = max(16, triton.next_power_of_2(d)), max(16, triton.next_power_of_2(dv))  # tl.dot's least
    splits = _splits(q.device, b * h, lk, block_n)
    per_split = -(-lk // splits)
    per_split = -(-per_split // block_n) * block_n
    splits = -(-lk // per_split)
    out_rows = -(-lq // splits)
    f32 = dict(device=q.device, dtype=torch.float32)
    m = torch.empty((b * h, splits, block_r), **f32)
    total = torch.empty((b * h, splits, block_r), **f32)
    acc = torch.empty((b * h, splits, block_r, block_dv), **f32)
    bad = torch.empty((b * h, splits), **f32)
    terms = torch.empty((b * h, 3), **f32)
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)  # an int scale would make an int argument
    # Triton's CPU interpreter (TRITON_INTERPRET=1, how the tests run this kernel without a GPU) computes bf16 dots
    # wrongly (triton 3.9: numpy has no bfloat16); there the q·k tiles go through float32, which gives the same
    # products and sums.
    upcast = q.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    _partial[(b * h, splits)](
        q, k, v, o, m, total, acc, bad,
        *q.stride(), *_batch_strides(k, b), *_batch_strides(v, b), *o.stride(),
        h, h // hk, lq, lk, d, dv, offset, stride, n, per_split, out_rows, scale,
        IS_CAUSAL=bool(is_causal), UPCAST_QK=upcast, BLOCK_R=block_r, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv)
    _combine[(b * h,)](
        o, m, total, acc, bad, terms, *o.stride(), h, dv, offset, stride, n, splits,
        BLOCK_R=block_r, BLOCK_DV=block_dv)
    return terms.sum(0, dtype=torch.float64)


def _batch_strides(t: torch.Tensor, batch: int) -> tuple:
    """A key/value batch of 1 broadcasts over the query's batch (as SDPA's does): stride 0 there."""
    strides = t.stride()
    return (0, *strides[1:]) if t.shape[0] == 1 and batch > 1 else strides


if triton is not None:
    # The row offset, stride and count change from check to check: specialising on them (Triton's default for ints
    # equal to 1 or divisible by 16) would compile new variants of the kernels during sampling.
    @triton.jit(do_not_specialize=["OFFSET", "STRIDE", "N_ROWS"])
    def _partial(q_ptr, k_ptr, v_ptr, o_ptr, m_ptr, l_ptr, acc_ptr, bad_ptr,
                 sqb, sqh, sql, sqd, skb, skh, skl, skd, svb, svh, svl, svd, sob, soh, sol, sod,
                 H, GROUPS, LQ, LK, D, DV, OFFSET, STRIDE, N_ROWS, PER_SPLIT, OUT_ROWS, scale,
                 IS_CAUSAL: tl.constexpr, UPCAST_QK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr):
        """One (batch·head, key split): the sampled rows' online softmax over the split's keys, and the NaN/Inf
        count of the split's share of the output's rows of that head."""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        b = (bh // H).to(tl.int64)  # offsets past 2**31 elements (long videos, large batches)
        h = (bh % H).to(tl.int64)
        hk = h // GROUPS
        r = tl.arange(0, BLOCK_R)
        dd = tl.arange(0, BLOCK_D)
        dv = tl.arange(0, BLOCK_DV)
        nn = tl.arange(0, BLOCK_N)
        row = OFFSET + r * STRIDE
        row_ok = r < N_ROWS
        q = tl.load(q_ptr + b * sqb + h * sqh + row[:, None] * sql + dd[None, :] * sqd,
                    mask=row_ok[:, None] & (dd[None, :] < D), other=0.0)
        m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_R,), tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_DV), tl.float32)
        start = split * PER_SPLIT
        end = tl.minimum(start + PER_SPLIT, LK)
        for n0 in range(start, end, BLOCK_N):
            cols = n0 + nn
            col_ok = cols < end
            k = tl.load(k_ptr + b * skb + hk * skh + cols[:, None] * skl + dd[None, :] * skd,
                        mask=col_ok[:, None] & (dd[None, :] < D), other=0.0)
            # bf16/fp16 products are exact in float32; accumulated in float32
            if UPCAST_QK:  # the same sums, on float32 copies of the tiles (see kernel_terms)
                s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee") * scale
            else:
                s = tl.dot(q, tl.trans(k), out_dtype=tl.float32) * scale
            keep = col_ok[None, :]
            if IS_CAUSAL:
                keep = keep & (cols[None, :] <= row[:, None])
            s = tl.where(keep, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m - m_safe)
            total = total * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + b * svb + hk * svh + cols[:, None] * svl + dv[None, :] * svd,
                        mask=col_ok[:, None] & (dv[None, :] < DV), other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")  # true float32, not tf32
            m = m_new
        at = bh * splits + split
        tl.store(m_ptr + at * BLOCK_R + r, m)
        tl.store(l_ptr + at * BLOCK_R + r, total)
        tl.store(acc_ptr + (at * BLOCK_R + r[:, None]) * BLOCK_DV + dv[None, :], acc)
        # The NaN/Inf test: this program's share of the head's output rows, read once.
        bad = tl.zeros((BLOCK_N,), tl.float32)
        o0 = split * OUT_ROWS
        o1 = tl.minimum(o0 + OUT_ROWS, LQ)
        for l0 in range(o0, o1, BLOCK_N):
            rows = l0 + nn
            x = tl.load(o_ptr + b * sob + h * soh + rows[:, None] * sol + dv[None, :] * sod,
                        mask=(rows[:, None] < o1) & (dv[None, :] < DV), other=0.0).to(tl.float32)
            bad += tl.sum(tl.where((x == x) & (tl.abs(x) < float("inf")), 0.0, 1.0), 1)
        tl.store(bad_ptr + at, tl.sum(bad, 0))

    @triton.jit(do_not_specialize=["OFFSET", "STRIDE", "N_ROWS"])
    def _combine(o_ptr, m_ptr, l_ptr, acc_ptr, bad_ptr, terms_ptr, sob, soh, sol, sod, H, DV, OFFSET, STRIDE,
                 N_ROWS, SPLITS, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr):
        """One (batch·head): the splits merged into the exact rows, the error terms against the output's rows."""
        bh = tl.program_id(0)
        b = (bh // H).to(tl.int64)
        h = (bh % H).to(tl.int64)
        r = tl.arange(0, BLOCK_R)
        dv = tl.arange(0, BLOCK_DV)
        m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
        for s in range(0, SPLITS):
            m = tl.maximum(m, tl.load(m_ptr + (bh * SPLITS + s) * BLOCK_R + r))
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros((BLOCK_R,), tl.float32)
        acc = tl.zeros((BLOCK_R, BLOCK_DV), tl.float32)
        bad = tl.sum(tl.zeros((BLOCK_R,), tl.float32), 0)
        for s in range(0, SPLITS):
            at = bh * SPLITS + s
            w = tl.exp(tl.load(m_ptr + at * BLOCK_R + r) - m_safe)
            total += w * tl.load(l_ptr + at * BLOCK_R + r)
            acc += w[:, None] * tl.load(acc_ptr + (at * BLOCK_R + r[:, None]) * BLOCK_DV + dv[None, :])
            bad += tl.load(bad_ptr + at)
        ok = (r[:, None] < N_ROWS) & (dv[None, :] < DV)
        ref = tl.where(ok, acc / total[:, None], 0.0)
        row = OFFSET + r * STRIDE
        got = tl.load(o_ptr + b * sob + h * soh + row[:, None] * sol + dv[None, :] * sod, mask=ok,
                      other=0.0).to(tl.float32)
        diff = got - ref
        tl.store(terms_ptr + bh * 3, tl.sum(tl.sum(diff * diff, 1), 0))
        tl.store(terms_ptr + bh * 3 + 1, tl.sum(tl.sum(ref * ref, 1), 0))
        tl.store(terms_ptr + bh * 3 + 2, bad)
