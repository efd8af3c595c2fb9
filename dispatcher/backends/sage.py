"""SageAttention: INT8 QK with FP16/FP8 PV, from pip (`sageattention`) or the Hub.

Quantised, so its error against exact attention is larger: `error_bound` says how much on N(0,1) inputs
(measured on the H200 against float64: 1.1e-2 with FP16 PV, 3.4e-2 to 3.9e-2 with FP8 PV). `auto_fast` admits a
quantised kernel only by its error on the model's own activations (docs/auto.md), never on noise.
"""

from __future__ import annotations

from ..inputs import AttentionInputs
from ..registry import add, kernels_requirement
from ..requirements import CudaCapability, OnDevice, Package, RocmArch
from ..spec import HALF, BackendSpec, HeadDims, HubKernel
from ..versions import at_least

SAGE = Package("sageattention", "1.0.6", module="sageattention", pip="pip install sageattention")
# PyPI stops at 1.0.6 (Triton only); the CUDA kernels of 2.x are built from source.
SAGE2 = Package("sageattention", "2.1.1", module="sageattention",
                pip="build SageAttention 2 from source (its repository: pip install . --no-build-isolation); "
                    "PyPI only has 1.0.6")
ON_CUDA = OnDevice(frozenset({"cuda"}))
SM80, SM89, SM90 = (CudaCapability(minimum=c) for c in ((8, 0), (8, 9), (9, 0)))
SAGE_HUB_CAPS = CudaCapability(exact=((8, 0), (8, 6), (8, 9), (9, 0), (10, 0)))
BLACKWELL = CudaCapability(exact=((10, 0), (12, 0)))

# Repo, function and version as in diffusers' _HUB_KERNELS_REGISTRY (0.42.1; tests/test_diffusers_parity.py
# compares them). The SageAttention org is not a trusted kernel publisher: these need
# DIFFUSERS_TRUST_REMOTE_KERNELS=true.
SAGE_HUB = HubKernel("SageAttention/sage-attention", "sageattn", version=3)
SAGE_BLACKWELL_HUB = HubKernel("SageAttention/sage-blackwell", "sageattn3_blackwell", version=1)
# diffusers 0.42.1 has no AITER SageAttention backend: this entry is the pack's own (kernels-community's repo).
AITER_SAGE_HUB = HubKernel("kernels-community/aiter-sage-attention", "sageattn", version=1)


def _v1_limits(inputs: AttentionInputs) -> list[str]:
    """sageattention 1.x (Triton) takes only head dims 64, 96 and 128, and mishandles the padding of keys
    to its 128-key blocks: measured on the H200 (bench/results/2026-12-02-h200-sage-probe.json), the
    relative error is 2.8e-1 at Lk=77 (SD1.5's text tokens), 8.5e-2 at 333, 4.0e-2 at 300, 1.9e-2 at 1000,
    and the usual 1.3e-2 when the padding is a negligible share (Lk=4095, 32760) or absent."""
    from ..machine import current_machine
    version = current_machine().package_version("sageattention")
    if not version or at_least(version, "2"):
        return []
    reasons = []
    if inputs.head_dim not in (64, 96, 128):
        reasons.append(f"head dim {inputs.head_dim} is not supported by sageattention {version} (supported: 64, 96, "
                       "128; sageattention>=2.1.1 takes more)")
    padding = -inputs.len_kv % 128
    if padding / (inputs.len_kv + padding) > 0.01:
        reasons.append(f"key length {inputs.len_kv} is not a multiple of 128: sageattention {version} pads it and "
                       "loses accuracy (measured error up to 2.8e-1); sageattention>=2.1.1 does not")
    return reasons


def _pip_function(name: str):
    import sageattention
    return getattr(sageattention, name)


def sage_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *, kernel=None, function="sageattn",
              options=None):
    """options: keywords of the kernel's own that a backend fixes (e.g. the QK quantisation granularity)."""
    kernel = kernel or _pip_function(function)
    kwargs = {"tensor_layout": "NHD", "is_causal": is_causal, **(options or {})}
    if scale is not None:
        kwargs["sm_scale"] = scale
    if return_lse:
        kwargs["return_lse"] = True
    result = kernel(q, k, v, **kwargs)
    if not return_lse:
        return result[0] if isinstance(result, (tuple, list)) else result
    out, lse = result[0], result[1]
    return out, lse.transpose(1, 2).float()  # (B, H, S) -> (B, S, H)


def sage_blackwell_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, *, kernel):
    """SageAttention 3 for Blackwell (`sageattn3_blackwell`), called as diffusers calls it: (B, H, S, D) copies,
    since the kernel takes HND and subtracts the key's per-token mean in place (the copies keep the caller's
    tensors intact), and only is_causal: it derives the scale from the head dim and returns no LSE (the spec
    refuses a custom scale and return_lse rather than drop them)."""
    q, k, v = (x.transpose(1, 2).contiguous() for x in (q, k, v))
    return kernel(q, k, v, is_causal=is_causal).transpose(1, 2)


def sage_varlen_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    from .flash import varlen
    return varlen(q, k, v, attn_mask=attn_mask, dropout_p=0.0, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                  return_lse=False, kernel=_sage_varlen_adapter, style="sage")


def _sage_varlen_adapter(q, k, v, cu_q, cu_k, max_q, max_k, *, softmax_scale, causal):
    kwargs = {"is_causal": causal}
    if softmax_scale is not None:
        kwargs["sm_scale"] = softmax_scale
    return _pip_function("sageattn_varlen")(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def _named(function: str, **options):
    # The standard arguments by position (registry.prepare's protocol: the dispatcher passes them so).
    def run(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, **kwargs):
        return sage_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse, function=function,
                         options=options, **kwargs)
    run.__name__ = function
    return run


COMMON = dict(layout="BSHD", devices=frozenset({"cuda"}), dtypes=HALF, head_dims=HeadDims(64, 128, 32), gqa=True,
              backward=False, error_bound=3e-2, quantised=True, fallback=("_native_flash", "native"))
# The FP8-PV kernels (sm89 and sm90, and `sage`, which picks one of them there): 3.4e-2 to 3.9e-2 on N(0,1)
# inputs, measured on the H200 by tests/gpu/test_gpu_backends.py (bench/results, 2026-12-03, 21:22-22:00 UTC).
FP8_PV = {**COMMON, "error_bound": 5e-2}

add(BackendSpec(name="sage", family="sage", description="SageAttention (pip sageattention; picks its kernel per GPU)",
                fn=_named("sageattn"), capability=SM80, extra_reasons=_v1_limits, lse=False,
                requires=(SAGE, ON_CUDA), **FP8_PV))
add(BackendSpec(name="sage_varlen", family="sage", description="SageAttention varlen: bool key-padding masks",
                fn=sage_varlen_call, capability=SM80, masks=frozenset({"key_padding"}),
                mask_format="key_padding", requires=(SAGE2, ON_CUDA), **COMMON))
for name, function, capability, common in (
        ("_sage_qk_int8_pv_fp8_cuda", "sageattn_qk_int8_pv_fp8_cuda", SM89, FP8_PV),
        ("_sage_qk_int8_pv_fp8_cuda_sm90", "sageattn_qk_int8_pv_fp8_cuda_sm90", SM90, FP8_PV),
        ("_sage_qk_int8_pv_fp16_cuda", "sageattn_qk_int8_pv_fp16_cuda", SM80, COMMON),
        ("_sage_qk_int8_pv_fp16_triton", "sageattn_qk_int8_pv_fp16_triton", SM80, COMMON)):
    add(BackendSpec(name=name, family="sage", description=f"SageAttention kernel {function}", fn=_named(function),
                    capability=capability, lse=True,
                    requires=(SAGE2, ON_CUDA), **common))
# The pack's own (diffusers has no such entry): the sm90 kernel with Q and K quantised per warp of 16 rows instead
# of per thread. Measured on the H200 (bench/results/README.md, 2026-12-03, 21:22-22:00 UTC): 4-5% faster on WAN's
# 32760-token calls and 25% on Flux's, with the same error against float64 (3.9e-2 on N(0,1) inputs); `auto_fast`
# judges it on the model's own activations like any quantised kernel.
add(BackendSpec(name="sage_sm90_per_warp", family="sage",
                description="SageAttention 2's sm90 kernel, Q and K quantised per warp (faster than per thread)",
                fn=_named("sageattn_qk_int8_pv_fp8_cuda_sm90", qk_quant_gran="per_warp"), capability=SM90, lse=True,
                requires=(SAGE2, ON_CUDA), **FP8_PV))
add(BackendSpec(name="sage_hub", family="sage", description="SageAttention 2 from the Hub (SageAttention org; opt-in)",
                fn=sage_call, capability=SAGE_HUB_CAPS, hub=SAGE_HUB, lse=True,
                requires=(kernels_requirement(SAGE_HUB), ON_CUDA), **FP8_PV))
add(BackendSpec(name="sage_blackwell_hub", family="sage", description="SageAttention 3 for Blackwell from the Hub (opt-in)",
                fn=sage_blackwell_call, capability=BLACKWELL, scale=False, hub=SAGE_BLACKWELL_HUB,
                requires=(kernels_requirement(SAGE_BLACKWELL_HUB), ON_CUDA),
                **{**COMMON, "head_dims": HeadDims(allowed=(64, 128))}))
add(BackendSpec(name="aiter_sage_hub", family="sage", description="AMD AITER SageAttention from the Hub (RDNA4 gfx1201)",
                fn=sage_call, devices=frozenset({"rocm"}), rocm=RocmArch(("gfx1201",)), hub=AITER_SAGE_HUB,
                requires=(kernels_requirement(AITER_SAGE_HUB), OnDevice(frozenset({"rocm"}))),
                **{k: v for k, v in COMMON.items() if k != "devices"}))
