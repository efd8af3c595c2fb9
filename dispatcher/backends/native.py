"""PyTorch's own kernels: SDPA (any backend or one pinned), its math reference, Ascend NPU and XLA."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..inputs import AttentionInputs
from ..process_locks import shared_lock
from ..registry import add
from ..requirements import CudaCapability, OnDevice, Package, TorchVersion
from ..spec import ANY_DEVICE, FLOATS, HALF, BackendSpec, HeadDims

ALL_MASKS = frozenset({"bool", "key_padding", "additive"})
SM80 = CudaCapability(minimum=(8, 0))


def _like_query(q, k, v, enable_gqa):
    """(key, value, enable_gqa) for SDPA's fused kernels, which take neither of SDPA's broadcasts (BHSD): a
    key/value batch of 1 is expanded to the query's batch (copied on GPUs, where a stride-0 batch is not
    what the kernels are tested with), and one key/value head without enable_gqa becomes GQA with one group,
    which computes the same."""
    q_shape, k_shape = q.shape, k.shape  # read once: each read builds a torch.Size (this runs on every GPU call)
    if k_shape[0] != q_shape[0]:
        # Two calls, not a generator over (k, v): one would make a cell of q_shape on every call of this function.
        k, v = k.expand(q_shape[0], *k_shape[1:]), v.expand(q_shape[0], *v.shape[1:])
        if q.device.type != "cpu":
            k, v = k.contiguous(), v.contiguous()
    return k, v, bool(enable_gqa or k_shape[1] != q_shape[1])


def _gqa_expand(q, k, v, enable_gqa):
    """Key/value with the query's batch and heads, for kernels that take equal counts (BHSD)."""
    k, v, enable_gqa = _like_query(q, k, v, enable_gqa)
    groups = q.shape[1] // k.shape[1]
    if groups > 1 and k.shape[1] == 1:
        return k.expand(-1, q.shape[1], -1, -1), v.expand(-1, q.shape[1], -1, -1)
    if enable_gqa and groups > 1:
        return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return k, v


def _causal_as_mask(q, k, attn_mask, is_causal, scale):
    """(attn_mask, is_causal) for SDPA and its kernels. With a mask, is_causal=True is folded into it: the pack's
    meaning of the pair on every torch (docs/python.md), what torch up to 2.13's CPU flash kernel computes, bit for
    bit; its math kernel raises on the pair, and so does SDPA on the CPU from torch 2.14. SDPA's CPU flash kernel
    returns NaN for is_causal=True with a scale <= 0 or one that is 0 in float32 (it scales the -inf it masks
    with): pass the same top-left causal mask as a bool mask then, which it computes right."""
    if not is_causal:
        return attn_mask, False
    if attn_mask is not None:
        return _with_causal(q, k, attn_mask), False
    if scale is not None and scale < 1e-30 and q.device.type == "cpu":
        return _top_left(q, k), False
    return attn_mask, True


def _top_left(q, k):
    """SDPA's causal diagonal: query i attends to keys 0..i (BHSD)."""
    return torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()


def _with_causal(q, k, attn_mask):
    """attn_mask with SDPA's top-left causal diagonal applied too (a bool mask and-ed, an additive one -inf
    above the diagonal)."""
    keep = _top_left(q, k)
    if attn_mask.dtype == torch.bool:
        return attn_mask & keep
    return attn_mask.masked_fill(~keep, float("-inf"))


# sdpa_kernel() sets process-wide flags (not per thread) and restores, on exit, the ones it found on entry:
# two threads interleaving their enter/exit leave SDPA's flash, efficient and cuDNN kernels off for the whole
# process (seen: _native_math and _native_flash from two threads). So every flag change here is made by one
# thread at a time (of every copy of the pack in the process: `process_locks`), and the CPU kernels are called
# directly, changing no flag at all.
_FLAGS = shared_lock("sdpa flags", reentrant=True)


try:  # flag name -> SDPBackend member name, as torch's own sdpa_kernel uses them
    from torch.nn.attention import _backend_names as _SDPA_FLAGS
except ImportError:  # pragma: no cover - older torch
    _SDPA_FLAGS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "mem_efficient": "EFFICIENT_ATTENTION",
                   "math": "MATH"}
_FLAG_ACCESS = [(getattr(SDPBackend, member), getattr(torch._C, f"_get_{flag}_sdp_enabled"),
                 getattr(torch._C, f"_set_sdp_use_{flag}")) for flag, member in _SDPA_FLAGS.items()]


# (backends, order in force, the order to set) of the last flip: the next call finds it by identity and one
# list comparison (hashing SDPBackend members, pybind11 enums, costs ~0.2 us each).
_last_flip: tuple = (None, None, None)
# (backends, the flag values they pin) of the last pin, found the same way; the pinned backends pass these tuples.
_last_pin: tuple = (None, None)
FLASH_ONLY, EFFICIENT_ONLY, CUDNN_ONLY = ((SDPBackend.FLASH_ATTENTION,), (SDPBackend.EFFICIENT_ATTENTION,),
                                          (SDPBackend.CUDNN_ATTENTION,))
# Bound once: the priority branch runs on every SDPA call on a GPU, and attribute chains there add up.
_get_order, _set_order = torch._C._get_sdp_priority_order, torch._C._set_sdp_priority_order
_dynamo_compiling = torch.compiler.is_dynamo_compiling


def _backends_first(backends, order: list[int]) -> list[int]:
    first = [int(b) for b in backends]
    return first + [p for p in order if p not in first]


def _select(backends, priority: bool, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` with only `backends` enabled (priority=False) or with them tried first (priority=True).

    torch's `sdpa_kernel` context manager costs ~37 us of CPU time per call, more than a small attention
    kernel takes on an H200 (SDXL's 32x32 level ran at 0.38x ComfyUI's speed through it); flipping the
    same process-wide flags directly costs ~2 us, under the same lock. Under torch.compile the context
    manager is what dynamo understands, so it is used there. (fn and its arguments, not a closure: a closure
    makes a cell of each captured variable on every call.)"""
    if _dynamo_compiling():
        with sdpa_kernel(list(backends), set_priority=priority):
            return fn(*args, **kwargs)
    if priority:
        return _tried_first(backends, fn, *args, **kwargs)
    global _last_pin
    pinned, wants = _last_pin
    if pinned is not backends:  # found by identity: comparing SDPBackend members (pybind11 enums) costs ~0.1 us each
        wants = tuple(member in backends for member, _, _ in _FLAG_ACCESS)
        _last_pin = (backends, wants)
    with _FLAGS:
        # Only the flags that differ from the pin are written, and only those put back: with every kernel enabled
        # (the default) all but the pinned one are written once and put back once, the pinned one not at all.
        restore = []
        for (_, get, set_flag), want in zip(_FLAG_ACCESS, wants):
            was = get()
            if was != want:
                set_flag(want)
                restore.append((set_flag, was))
        try:
            return fn(*args, **kwargs)
        finally:
            for set_flag, was in restore:
                set_flag(was)


def _tried_first(backends, fn, *args, **kwargs):
    """`fn(*args, **kwargs)` with `backends` first in SDPA's priority order (eager only). Writes the order only when
    another is in force, and puts it back; where it is in force already (ComfyUI's own priority block, or a
    process that set it) a call costs the lock, one read of the order and one list comparison."""
    global _last_flip
    with _FLAGS:
        previous = _get_order()
        last_backends, last_previous, wanted = _last_flip
        if last_backends is not backends or last_previous != previous:
            wanted = _backends_first(backends, previous)
            _last_flip = (backends, previous, wanted)
        if wanted == previous:
            return fn(*args, **kwargs)
        _set_order(wanted)
        try:
            return fn(*args, **kwargs)
        finally:
            _set_order(previous)


def _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *, pinned=None):
    attn_mask, is_causal = _causal_as_mask(q, k, attn_mask, is_causal, scale)
    kwargs = {"attn_mask": attn_mask, "dropout_p": dropout_p, "is_causal": is_causal, "scale": scale}
    if enable_gqa:
        kwargs["enable_gqa"] = True
    if pinned is None:
        return F.scaled_dot_product_attention(q, k, v, **kwargs)
    return _select(pinned, False, F.scaled_dot_product_attention, q, k, v, **kwargs)


def _math(q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """SDPA's math kernel called directly (what SDPA runs for it, without pinning flags). It adds a bool mask
    as 0/1 instead of dropping the False entries, so a bool mask becomes the -inf bias SDPA would pass it."""
    attn_mask, is_causal = _causal_as_mask(q, k, attn_mask, is_causal, scale)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros(attn_mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                                                             enable_gqa=bool(enable_gqa))[0]


# SDPA's own order on NVIDIA GPUs picks its flash kernel for the strided (B, H, L, D) views that
# ComfyUI's (B, L, H*D) tensors become, where cuDNN is ~1.4x faster on Hopper (measured: WAN 1.3B
# step 788 ms vs 576 ms). ComfyUI sets this same priority for its own SDPA path.
CUDA_PRIORITY = (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                 SDPBackend.MATH)


_scaled_dot_product_attention = F.scaled_dot_product_attention


def sdpa_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    # No closure in here (nor in _sdpa_cuda): a function with one makes a cell of every argument it captures on
    # every call (~0.5 us on the CPU).
    if q.is_cuda:
        return _sdpa_cuda(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    if not (is_causal or enable_gqa):  # the common call: positional arguments parse fastest (~0.6 us a call)
        if scale is None:
            return _scaled_dot_product_attention(q, k, v, attn_mask, dropout_p)
        return _scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, scale=scale)
    return _sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, False)


def _sdpa_cuda(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa):
    """SDPA with cuDNN tried first. A repeat call costs two shape reads, the priority order read under the flags'
    lock and SDPA itself: no context manager, no torch.cuda query, no flag or order written while the order is in
    force (tests/test_cuda_host_path.py counts it)."""
    q_shape, k_shape = q.shape, k.shape  # each read builds a torch.Size: read once
    if k_shape[0] != q_shape[0] or k_shape[1] != q_shape[1]:  # a broadcast the fused kernels do not take
        k, v, enable_gqa = _like_query(q, k, v, enable_gqa)
    if is_causal and attn_mask is not None:  # math (and so SDPA, when it picks math) refuses both: fold them
        attn_mask, is_causal = _with_causal(q, k, attn_mask), False
    if enable_gqa or scale is not None or _dynamo_compiling():
        return _select(CUDA_PRIORITY, True, _sdpa, q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, False)
    # the common call, positional (as on the CPU above)
    return _tried_first(CUDA_PRIORITY, _scaled_dot_product_attention, q, k, v, attn_mask, dropout_p, is_causal)


def math_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    if not return_lse:
        return _math(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    # The reference with its log-sum-exp, computed in float32 (float64 stays float64).
    k, v = _gqa_expand(q, k, v, enable_gqa)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * (scale if scale is not None else 1 / math.sqrt(q.shape[-1]))
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = (scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool
                  else scores + attn_mask.to(acc))
    lse = torch.logsumexp(scores, dim=-1)
    # A row the masks hide entirely has lse -inf: its output is 0, as SDPA's (not exp(-inf - -inf) = NaN).
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0)[..., None])
    if dropout_p > 0:
        probs = F.dropout(probs, dropout_p)
    return torch.matmul(probs, v.to(acc)).to(q.dtype), lse.to(acc)


def flash_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    q, k, v = _unit_stride(q, k, v)  # pinned to one fused kernel: SDPA cannot pick math for a strided view
    if not return_lse and q.device.type != "cpu":
        k, v, enable_gqa = _like_query(q, k, v, enable_gqa)
        return _sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa, return_lse=False, pinned=FLASH_ONLY)
    k, v = _gqa_expand(q, k, v, enable_gqa)
    if q.device.type == "cpu":  # the op SDPA's flash backend runs on the CPU, called directly (no flags)
        attn_mask, is_causal = _causal_as_mask(q, k, attn_mask, is_causal, scale)
        # The CPU op takes only an additive mask in the query's dtype (a bool one raises).
        bias = None if attn_mask is None else _as_bias(attn_mask, q)
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=bias, scale=scale)
        if not return_lse:
            return out
    else:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)[:2]
    return out, lse.float()


def efficient_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    k, v = _gqa_expand(q, k, v, enable_gqa)
    q, k, v = _unit_stride(q, k, v)  # pinned to one fused kernel: SDPA cannot pick math for a strided view
    if not return_lse:
        return _sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=False, return_lse=False, pinned=EFFICIENT_ONLY)
    bias = None if attn_mask is None else _as_bias(attn_mask, q)
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, bias, True, dropout_p, is_causal, scale=scale)[:2]
    return out, lse[..., : q.shape[-2]].float()


def cudnn_sdpa(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    k, v = _gqa_expand(q, k, v, enable_gqa)
    q, k, v = _unit_stride(q, k, v)  # pinned to one fused kernel: SDPA cannot pick math for a strided view
    if not return_lse:
        return _sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=False, return_lse=False, pinned=CUDNN_ONLY)
    bias = None if attn_mask is None else _as_bias(attn_mask, q)
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, bias, True, dropout_p, is_causal, False, scale=scale)[:2]
    return out, (lse.squeeze(-1) if lse.dim() == 4 else lse).float()


def _unit_stride(*tensors):
    """The aten attention ops called directly (for the LSE) assume a last-dim stride of 1 and, on the CPU,
    silently compute garbage for a strided view (x[..., ::2]); the public SDPA checks this, they do not."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def _as_bias(mask, q):
    """The additive mask the aten ops take: the query's dtype on GPUs (the efficient kernel refuses another), but
    a float32 one kept on the CPU, whose flash kernel adds it in float32 (rounding it to bfloat16 first cost
    ~5x the accuracy)."""
    bias = mask if mask.dtype != torch.bool else torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
        ~mask, float("-inf"))
    keep = q.device.type == "cpu" and q.dtype in HALF and bias.dtype == torch.float32
    return (bias if keep else bias.to(q.dtype)).expand(q.shape[0], q.shape[1], q.shape[2], bias.shape[-1])


def _cuda_flash_limits(inputs: AttentionInputs) -> list[str]:
    """SDPA's CUDA flash kernel is narrower than its CPU one: no masks, half precision, Ampere or newer."""
    if inputs.device_kind not in ("cuda", "rocm"):
        return []
    reasons = []
    if inputs.mask_kind != "none":
        reasons.append("attn_mask is not supported by SDPA's flash kernel on GPUs (it would raise)")
    if inputs.dtype not in HALF:
        reasons.append(f"dtype {str(inputs.dtype).replace('torch.', '')} is not supported by SDPA's flash kernel "
                       "on GPUs (supported: bfloat16, float16)")
    if inputs.head_dim > 256 or inputs.head_dim % 8:
        reasons.append(f"head dim {inputs.head_dim} is not supported by SDPA's flash kernel on GPUs "
                       "(supported: up to 256, multiple of 8)")
    if inputs.device_kind == "cuda":
        problem = SM80.check(_capability(inputs))
        if problem:
            reasons.append(problem)
    return reasons


def _capability(inputs):
    from ..machine import capability_of
    return capability_of(inputs.device)


def _not_dropout_with_lse(inputs: AttentionInputs) -> list[str]:
    return ["dropout_p > 0 with return_lse=True is not supported"] if inputs.dropout and inputs.return_lse else []


def npu_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    import torch_npu

    heads, head_dim = q.shape[2], q.shape[3]
    if is_causal:  # the NPU kernel has no causal flag: pass the mask it means, instead of dropping it
        keep = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        attn_mask = keep[None, None]
    drop = None if attn_mask is None else ~attn_mask.expand(q.shape[0], 1, q.shape[1], k.shape[1])
    return torch_npu.npu_fusion_attention(
        q, k, v, heads, input_layout="BSND", atten_mask=drop,
        scale=scale if scale is not None else 1.0 / math.sqrt(head_dim),
        keep_prob=1.0 - dropout_p, pre_tockens=65536, next_tockens=65536)[0]


def xla_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    from torch_xla.experimental.custom_kernel import flash_attention

    return flash_attention(q, k, v, causal=is_causal, sm_scale=scale if scale is not None else 1.0 / math.sqrt(q.shape[-1]))


add(BackendSpec(
    name="native", family="sdpa", description="torch SDPA: PyTorch picks its best kernel (cuDNN/flash/efficient/math)",
    fn=sdpa_attention, broadcast_kv=True, layout="BHSD", devices=ANY_DEVICE, dtypes=FLOATS,
    head_dims=HeadDims(), masks=ALL_MASKS, mask_format="native", mask_with_causal=True, gqa=True, dropout=True,
    different_value_dim=True, error_bound=1e-2, fallback=("_native_math",),
    requires=(TorchVersion("2.5"),)))
add(BackendSpec(
    name="_native_math", family="sdpa", description="torch SDPA math kernel: the exact reference, slow",
    fn=math_attention, broadcast_kv=True, layout="BHSD", devices=ANY_DEVICE, dtypes=FLOATS,
    head_dims=HeadDims(), masks=ALL_MASKS, mask_format="precise", mask_with_causal=True, gqa=True, dropout=True,
    lse=True, different_value_dim=True, error_bound=1e-2, fallback=(), quadratic_memory=True,
    requires=(TorchVersion("2.5"),)))
add(BackendSpec(
    name="_native_flash", family="sdpa", description="torch SDPA flash kernel (CPU flash kernel on CPUs)",
    fn=flash_sdpa, broadcast_kv=True, layout="BHSD", devices=frozenset({"cpu", "cuda", "rocm"}), dtypes=FLOATS,
    head_dims=HeadDims(),
    masks=ALL_MASKS, mask_format="native", gqa=True, dropout=True, lse=True,
    extra_reasons=lambda i: _cuda_flash_limits(i) + _not_dropout_with_lse(i) +
    (["dropout_p > 0 is not supported by SDPA's flash kernel on the CPU"] if i.dropout and i.device_kind == "cpu" else []),
    requires=(TorchVersion("2.5"),)))
add(BackendSpec(
    name="_native_efficient", family="sdpa", description="torch SDPA memory-efficient kernel (GPUs)",
    fn=efficient_sdpa, broadcast_kv=True, layout="BHSD", devices=frozenset({"cuda", "rocm"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}), head_dims=HeadDims(1, 512), masks=ALL_MASKS,
    mask_format="native", gqa=True, dropout=True, lse=True, different_value_dim=True,
    extra_reasons=_not_dropout_with_lse,
    requires=(TorchVersion("2.5"), OnDevice(frozenset({"cuda", "rocm"})))))
add(BackendSpec(
    name="_native_cudnn", family="sdpa", description="torch SDPA cuDNN kernel (NVIDIA, sm_80+)",
    fn=cudnn_sdpa, broadcast_kv=True, layout="BHSD", devices=frozenset({"cuda"}), dtypes=HALF,
    head_dims=HeadDims(8, 256, 8),
    masks=ALL_MASKS, mask_format="native", gqa=True, dropout=True, lse=True, capability=SM80,
    extra_reasons=_not_dropout_with_lse,
    requires=(TorchVersion("2.5"), OnDevice(frozenset({"cuda"})))))
add(BackendSpec(
    name="_native_npu", family="npu", description="Ascend NPU fused attention (torch_npu.npu_fusion_attention)",
    fn=npu_attention, layout="BSHD", devices=frozenset({"npu"}), dtypes=HALF, head_dims=HeadDims(1, 512),
    masks=frozenset({"bool", "key_padding"}), mask_format="bool", dropout=True, backward=False,
    requires=(Package("torch-npu", module="torch_npu", device="an Ascend NPU"),)))
add(BackendSpec(
    name="_native_xla", family="xla", description="XLA flash attention (torch_xla Pallas kernel)",
    fn=xla_attention, layout="BHSD", devices=frozenset({"xla"}), dtypes=FLOATS - {torch.float64},
    head_dims=HeadDims(), backward=False,
    requires=(Package("torch-xla", "2.2", module="torch_xla.experimental.custom_kernel", device="an XLA device (TPU)"),)))
