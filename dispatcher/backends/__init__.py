"""Built-in backends: importing this package registers every one of them (one declaration each, in its
family file), then sets the one priority list.

PRIORITY orders the built-in backends, best first: listings (the dropdown, the doctor) and `auto`'s order
before it measures (and its tie rule) follow it. A backend it does not name ranks after those it names, so a
new backend needs only its declaration; name it here to rank it. Fallback chains are per backend (`fallback`
in its spec), each ending at SDPA and its math kernel.
"""

from .. import registry
from . import native, flex, flash, sage, xformers, kitchen  # noqa: F401  (registration side effects)

# FlashAttention-3 before 4: FA3 runs on Hopper only, where it is the faster (H100, Wan 14B self-attention: 31.25
# against 31.65 ms) and FA4's first call JIT-compiles for about 3 s, which spent `auto`'s 2 s budget before FA3 was
# timed (bench/results/2026-12-05-h100-wan14b-fp8-noise.json); elsewhere FA3 cannot run and FA4 leads.
PRIORITY = (
    "_flash_3", "_flash_3_hub", "_flash_varlen_3", "flash_4", "flash_4_hub", "sage_blackwell_hub",
    "_flash_3_varlen_hub", "_native_cudnn", "native", "sage_sm90_per_warp", "sage", "flash_3_fp8", "sage_hub", "comfy_kitchen_int8",
    "sol_attn", "_sage_qk_int8_pv_fp8_cuda_sm90", "_sage_qk_int8_pv_fp8_cuda", "_sage_qk_int8_pv_fp16_cuda",
    "aiter_sage_hub", "_sage_qk_int8_pv_fp16_triton", "flash", "aiter_fa2_hub", "flash_hub", "flash_varlen",
    "flash_varlen_hub", "sage_varlen", "xformers", "_native_flash", "flex", "_native_efficient", "_native_math",
    "_native_npu", "_native_xla",
)
registry.set_priority(PRIORITY)
