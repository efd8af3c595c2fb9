"""FlashAttention 2/3/4 and AMD's CK build: pip packages and Hub kernels, dense and varlen.

All take (B, S, H, D) and return the log-sum-exp as (B, H, S); we hand back (B, S, H) like every
other BSHD backend. Varlen packs keys by the indices of the key-padding mask (correct for left
padding and gaps) and passes Lk as max_seqlen, an upper bound, so no host sync is needed.
"""

from __future__ import annotations

import torch

from .. import quantise
from ..inputs import AttentionInputs
from ..registry import add, kernels_requirement
from ..requirements import CudaCapability, OneOf, OnDevice, Package, Probe, RocmArch, import_error
from ..spec import BF16, HALF, BackendSpec, HeadDims, HubKernel

CUDA = frozenset({"cuda"})
ON_CUDA = OnDevice(CUDA)
SM80 = CudaCapability(minimum=(8, 0))
HOPPER_AMPERE = CudaCapability(exact=((8, 0), (8, 6), (8, 7), (8, 9), (9, 0)))
HOPPER_BLACKWELL = CudaCapability(exact=((9, 0), (10, 0), (10, 3)))
FA2 = Package("flash-attn", "2.6.3", module="flash_attn.flash_attn_interface",
              pip="pip install 'flash-attn>=2.6.3' --no-build-isolation")
FA3_SOURCE = Package("flash-attn-3", module="flash_attn_interface",
                     pip="build FlashAttention-3 from source (the hopper/ folder of flash-attention: python setup.py install)")
# A prebuilt wheel of FlashAttention-3's forward kernels (torch's stable ABI: it loads on newer torch too),
# built without float16 and backward. Measured on the H200: bench/results/README.md. Its metadata names no
# author or project page, so install.py names it first but never installs it on its own.
FA3_FORWARD_WHEEL = Package("fa3-fwd", module="fa3_fwd_interface", torch="2.10", vetted=False,
                            pip="pip install fa3-fwd (a community build of FlashAttention-3's forward kernels whose "
                                "metadata names no author: install it yourself if you trust it)")
FA3 = OneOf((FA3_FORWARD_WHEEL, FA3_SOURCE))
# FlashAttention-3's FP8 forward runs on sm_90 only (its FP8 kernels are Hopper's WGMMA; flash_api.cpp dispatches
# e4m3 to its sm_90 instances); fa3-fwd 0.0.3 is built with it (fa3_fwd_config: FLASHATTENTION_DISABLE_FP8 False).
SM90_ONLY = CudaCapability(exact=((9, 0),))
# FlashAttention-4 (CuTe DSL, JIT-compiled on first use of each shape family; needs nvidia-cutlass-dsl, which pip
# brings). It installs `flash_attn/cute` into the `flash_attn` namespace, so FlashAttention-2 is detected by
# `flash_attn.flash_attn_interface`, never by `import flash_attn`. On CUDA 13 its README asks for the [cu13] extra.
# Since 4.6 the DSL's Python package (`cutlass`, `cutlass.cute`) comes in nvidia-cutlass-dsl-libs-core, a requirement
# of nvidia-cutlass-dsl-libs-base; -libs-base itself carries only `cutlass/_mlir`, so without -libs-core `cutlass`
# still imports (a namespace package) and `cutlass.cute` does not: what the H200's wheel set (installed --no-deps)
# lacked on 2026-12-05. pip with dependencies brings it.
FA4 = Package("flash-attn-4", "4.0.0b40", module="flash_attn.cute",
              pip="pip install 'flash-attn-4>=4.0.0b40' (on CUDA 13: 'flash-attn-4[cu13]>=4.0.0b40')",
              carriers=(("cutlass", "nvidia-cutlass-dsl-libs-core", "nvidia-cutlass-dsl"),))
# flash_attn/cute/interface.py 4.0.0b40 has kernels for sm_90 (Hopper), sm_100/sm_103/sm_110 (Blackwell datacenter,
# Thor) and sm_120/sm_121 (Blackwell GeForce, DGX Spark); its sm_80 path is left out (FA2 and FA3 serve Ampere).
FA4_ARCHS = CudaCapability(exact=((9, 0), (10, 0), (10, 3), (11, 0), (12, 0), (12, 1)))

FLASH_2_HUB = HubKernel("kernels-community/flash-attn2", "flash_attn_func", version=3)
FLASH_2_VARLEN_HUB = HubKernel("kernels-community/flash-attn2", "flash_attn_varlen_func", version=3)
FLASH_3_HUB = HubKernel("kernels-community/flash-attn3", "flash_attn_func", version=1)
FLASH_3_VARLEN_HUB = HubKernel("kernels-community/flash-attn3", "flash_attn_varlen_func", version=1)
FLASH_4_HUB = HubKernel("kernels-community/flash-attn4", "flash_attn_func", version=0, min_kernels="0.12.3")
AITER_FA2_HUB = HubKernel("kernels-community/aiter-flash-attn-ck", "flash_attn_func", version=1)


def _out_and_lse(result, return_lse: bool):
    """Kernels return a tensor, (out, lse) or (out, lse, probs) depending on version: normalise."""
    out, lse = (result[0], result[1] if len(result) > 1 else None) if isinstance(result, (tuple, list)) else (result, None)
    if not return_lse:
        return out
    if lse is None:
        raise RuntimeError("the kernel returned no log-sum-exp")
    return out, lse.transpose(1, 2).float()


def _fa2_pip():
    from flash_attn.flash_attn_interface import flash_attn_func
    return flash_attn_func


def _fa2_varlen_pip():
    from flash_attn.flash_attn_interface import flash_attn_varlen_func
    return flash_attn_varlen_func


_fa3: list = []  # the module, once imported: a call (traced by torch.compile too) then imports nothing


def _fa3_module():
    """FlashAttention-3's interface: the full source build when it imports, else the forward-only wheel."""
    if not _fa3:
        import importlib
        _fa3.append(importlib.import_module(FA3_SOURCE.module if import_error(FA3_SOURCE.module) is None
                                            else FA3_FORWARD_WHEEL.module))
    return _fa3[0]


def _fa3_pip():
    return _fa3_module().flash_attn_func


def _fa3_varlen_pip():
    return _fa3_module().flash_attn_varlen_func


def _fa4_pip():
    from flash_attn.cute import flash_attn_func
    return flash_attn_func


def _fa3_fp8_probe():
    """A tiny FP8 call: a FlashAttention-3 build without FP8 (FLASHATTENTION_DISABLE_FP8) imports and runs bf16."""
    x = torch.randn(1, 128, 1, 128, device="cuda").to(torch.float8_e4m3fn)
    one = torch.ones(1, 1, device="cuda")
    _fa3_module().flash_attn_func(x, x, x, q_descale=one, k_descale=one, v_descale=one)
    torch.cuda.synchronize()


def fp8_forward(prepared: quantise.Fp8Inputs, scale, is_causal: bool, return_lse: bool, kernel=None):
    """FlashAttention-3's FP8 forward on `quantise.quantise`'s inputs: (its bfloat16 output, V's mean not yet added
    back; its (B, L, H) log-sum-exp of the smoothed keys' scores, or None)."""
    kernel = kernel or _fa3_pip()
    result = kernel(prepared.q, prepared.k, prepared.v, softmax_scale=scale, causal=is_causal,
                    q_descale=prepared.q_descale, k_descale=prepared.k_descale, v_descale=prepared.v_descale,
                    return_attn_probs=return_lse)
    return _out_and_lse(result, True) if return_lse else (_out_and_lse(result, False), None)


def fp8_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *, kernel=None):
    """FlashAttention-3's FP8 forward on `quantise.quantise`'s inputs (per-head e4m3 scales, K smoothed, V's offsets
    smoothed; fused in Triton on the GPU); the bfloat16 output gets V's offsets back and the caller's dtype, the
    log-sum-exp the smoothing's shift."""
    prepared = quantise.quantise(q, k, v)
    out, lse = fp8_forward(prepared, scale, is_causal, return_lse, kernel)
    out = quantise.restore(out, prepared).to(q.dtype)
    if not return_lse:
        return out
    shift = quantise.lse_shift(q, prepared, scale if scale is not None else q.shape[-1] ** -0.5)
    return out, lse if shift is None else lse + shift


def _fa4_head_dims(inputs: AttentionInputs) -> list[str]:
    """FlashAttention-4's head dims per GPU generation (its `_validate_head_dims`): up to 256 on sm_90; on the
    Blackwell datacenter parts up to 128, or exactly 256; its sm_120 kernel sizes tiles by shared memory and is
    declared up to 128 only (larger ones are not verified)."""
    from ..machine import capability_of
    capability = capability_of(inputs.device) if inputs.device_kind == "cuda" else None
    if capability is None or capability[0] == 9 or inputs.head_dim <= 128:
        return []
    if capability[0] in (10, 11) and inputs.head_dim == 256:
        return []
    allowed = "8..128 or 256" if capability[0] in (10, 11) else "8..128"
    return [f"head dim {inputs.head_dim} is not supported by FlashAttention-4 on sm_{capability[0]}{capability[1]} "
            f"(supported there: {allowed}, multiple of 8)"]


def _fa3_wheel_limits(inputs: AttentionInputs) -> list[str]:
    """What the forward-only wheel lacks, when it is the FlashAttention-3 in use."""
    if import_error(FA3_SOURCE.module) is None or import_error(FA3_FORWARD_WHEEL.module) is not None:
        return []
    reasons = []
    if inputs.dtype == torch.float16:
        reasons.append("fa3-fwd is built without float16 kernels (bfloat16 only); build flash-attn-3 from source "
                       "for float16")
    if inputs.requires_grad:
        reasons.append("fa3-fwd is built without the backward pass; build flash-attn-3 from source to train")
    return reasons


def _window(kwargs: dict, window_size) -> None:
    """FlashAttention's sliding window, (left, right) keys (-1 = unbounded), passed on only when given (an
    attention_kwargs key of FlashAttention-2/3 backends, as in diffusers)."""
    if window_size is not None:
        kwargs["window_size"] = tuple(int(w) for w in window_size)


def dense(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *, kernel=None, style="fa2",
          window_size=None):
    kernel = kernel or {"fa2": _fa2_pip, "fa3": _fa3_pip, "fa4": _fa4_pip}[style]()
    kwargs = {"softmax_scale": scale, "causal": is_causal}
    _window(kwargs, window_size)
    if style in ("fa2", "aiter"):
        kwargs["dropout_p"] = dropout_p
    if return_lse:  # FlashAttention-4's flash_attn_func names it return_lse, as AITER's does
        kwargs["return_lse" if style in ("aiter", "fa4") else "return_attn_probs"] = True
    return _out_and_lse(kernel(q, k, v, **kwargs), return_lse)


def varlen(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *, kernel=None, style="fa2",
           window_size=None):
    kernel = kernel or {"fa2": _fa2_varlen_pip, "fa3": _fa3_varlen_pip}[style]()
    b, lq, h, d = q.shape
    lk, hk = k.shape[1], k.shape[2]
    arange = torch.arange(0, (b + 1) * lq, lq, dtype=torch.int32, device=q.device)
    if attn_mask is None:
        keys, values, cu_k = k.reshape(b * lk, hk, d), v.reshape(b * lk, hk, v.shape[-1]), \
            torch.arange(0, (b + 1) * lk, lk, dtype=torch.int32, device=q.device)
    else:
        keep = attn_mask.expand(b, lk)
        index = keep.reshape(-1).nonzero().squeeze(-1)
        keys, values = k.reshape(b * lk, hk, d).index_select(0, index), v.reshape(b * lk, hk, -1).index_select(0, index)
        cu_k = torch.nn.functional.pad(keep.sum(-1, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    kwargs = {"softmax_scale": scale, "causal": is_causal}
    _window(kwargs, window_size)
    if style == "fa2":
        kwargs["dropout_p"] = dropout_p
    if return_lse:
        kwargs["return_attn_probs"] = True
    result = kernel(q.reshape(b * lq, h, d), keys, values, arange, cu_k, lq, lk, **kwargs)
    out, lse = (result[0], result[1]) if isinstance(result, (tuple, list)) else (result, None)
    out = out.reshape(b, lq, h, -1)
    if not return_lse:
        return out
    if lse is None:
        raise RuntimeError("the kernel returned no log-sum-exp")
    return out, lse.reshape(h, b, lq).permute(1, 2, 0).float() if lse.shape[0] == h else lse.reshape(b, h, lq).transpose(1, 2).float()


# The attention_kwargs FlashAttention-2 and -3 pass on to their kernel (diffusers passes window_size to both).
WINDOW = frozenset({"window_size"})


def _style(fn, **fixed):
    # The standard arguments by position (registry.prepare's protocol: the dispatcher passes them so).
    def run(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, **kwargs):
        return fn(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, **kwargs, **fixed)
    run.__name__ = f"{fn.__name__}_{fixed.get('style', '')}"
    return run


COMMON = dict(layout="BSHD", devices=CUDA, dtypes=HALF, head_dims=HeadDims(8, 256, 8), gqa=True,
              causal_alignment="bottom_right", lse=True, fallback=("_native_flash", "native"))
WINDOWED = {**COMMON, "attention_kwargs": WINDOW}  # FlashAttention-2 and -3
KEY_PADDING = frozenset({"key_padding"})

add(BackendSpec(name="flash", family="flash2", description="FlashAttention-2 (pip flash-attn)",
                fn=_style(dense, style="fa2"), dropout=True, capability=SM80,
                requires=(FA2, ON_CUDA), **WINDOWED))
add(BackendSpec(name="flash_hub", family="flash2", description="FlashAttention-2 from the Hub (kernels-community)",
                fn=_style(dense, style="fa2"), dropout=True, capability=SM80, hub=FLASH_2_HUB,
                requires=(kernels_requirement(FLASH_2_HUB), ON_CUDA), **WINDOWED))
add(BackendSpec(name="flash_varlen", family="flash2", description="FlashAttention-2 varlen: bool key-padding masks",
                fn=_style(varlen, style="fa2"), dropout=True, capability=SM80, masks=KEY_PADDING,
                mask_format="key_padding", requires=(FA2, ON_CUDA), **WINDOWED))
add(BackendSpec(name="flash_varlen_hub", family="flash2", description="FlashAttention-2 varlen from the Hub",
                fn=_style(varlen, style="fa2"), dropout=True, capability=SM80, masks=KEY_PADDING,
                mask_format="key_padding", hub=FLASH_2_VARLEN_HUB,
                requires=(kernels_requirement(FLASH_2_VARLEN_HUB), ON_CUDA), **WINDOWED))
add(BackendSpec(name="_flash_3", family="flash3",
                description="FlashAttention-3 (Hopper; a source build, or the forward-only fa3-fwd wheel)",
                fn=_style(dense, style="fa3"), capability=HOPPER_AMPERE, requires=(FA3, ON_CUDA),
                backward=True, extra_reasons=_fa3_wheel_limits, **WINDOWED))
# Quantised: never auto_exact's; auto_fast admits it per block on the model's own activations, the guard watches it.
# error_bound: its error on N(0,1) noise and on outlier keys, emulated in float64 (quantise.fa3_fp8_forward on the
# pack's e4m3 inputs): 5.3e-2 at Flux's shape, 5.4e-2 at Wan's 32760 tokens (bench/fp8_schemes.py,
# bench/results/2026-12-06-cpu-fp8-schemes.json), plus the kernel's gap to its emulation (about 2% on the H100 with
# the earlier quantisation: bench/results/README.md). Not yet measured with the fused quantisation on a GPU:
# tests/gpu/test_gpu_fp8.py holds it to this bound. No scale FA3 takes brings it to Sage's (3.9e-2): its e4m3 Q.K
# is the difference (quantise.py).
add(BackendSpec(name="flash_3_fp8", family="flash3",
                description="FlashAttention-3's FP8 forward (Hopper): e4m3 q/k/v, per-head scales, K smoothed, "
                            "V's offsets smoothed",
                fn=fp8_call, capability=SM90_ONLY, backward=False, quantised=True, error_bound=6e-2,
                # sm_90 before the probe: a tiny FP8 call is only tried where FP8 kernels can exist
                requires=(FA3, ON_CUDA, SM90_ONLY, Probe("FlashAttention-3 FP8 forward", _fa3_fp8_probe)),
                **{**COMMON, "head_dims": HeadDims(16, 256, 16)}))
add(BackendSpec(name="_flash_varlen_3", family="flash3", description="FlashAttention-3 varlen (Hopper)",
                fn=_style(varlen, style="fa3"), capability=HOPPER_AMPERE, masks=KEY_PADDING,
                mask_format="key_padding", requires=(FA3, ON_CUDA), extra_reasons=_fa3_wheel_limits,
                **WINDOWED))
add(BackendSpec(name="_flash_3_hub", family="flash3", description="FlashAttention-3 from the Hub (sm_80, sm_90)",
                fn=_style(dense, style="fa3"), capability=HOPPER_AMPERE, hub=FLASH_3_HUB,
                requires=(kernels_requirement(FLASH_3_HUB), ON_CUDA), **WINDOWED))
add(BackendSpec(name="_flash_3_varlen_hub", family="flash3", description="FlashAttention-3 varlen from the Hub",
                fn=_style(varlen, style="fa3"), capability=HOPPER_AMPERE, masks=KEY_PADDING,
                mask_format="key_padding", hub=FLASH_3_VARLEN_HUB,
                requires=(kernels_requirement(FLASH_3_VARLEN_HUB), ON_CUDA), **WINDOWED))
add(BackendSpec(name="flash_4_hub", family="flash4", description="FlashAttention-4 (CuTe DSL) from the Hub, sm_90/sm_100",
                fn=_style(dense, style="fa4"), capability=HOPPER_BLACKWELL, hub=FLASH_4_HUB,
                backward=False, requires=(kernels_requirement(FLASH_4_HUB), ON_CUDA),
                **{**COMMON, "head_dims": HeadDims(8, 128, 8)}))
add(BackendSpec(name="flash_4", family="flash4",
                description="FlashAttention-4 (pip flash-attn-4, CuTe DSL): sm_90, sm_100, sm_120",
                # backward=False: FlashAttention-4 has a backward pass, but no test of this pack has run it yet
                fn=_style(dense, style="fa4"), capability=FA4_ARCHS, backward=False, extra_reasons=_fa4_head_dims,
                requires=(FA4, ON_CUDA), **COMMON))
add(BackendSpec(name="aiter_fa2_hub", family="aiter", description="AMD AITER CK FlashAttention-2 from the Hub (bf16)",
                fn=_style(dense, style="aiter"), devices=frozenset({"rocm"}), dtypes=BF16, dropout=True,
                rocm=RocmArch(("gfx942", "gfx950")), hub=AITER_FA2_HUB,
                requires=(kernels_requirement(AITER_FA2_HUB), OnDevice(frozenset({"rocm"}))),
                **{k: v for k, v in COMMON.items() if k not in ("devices", "dtypes")}))
