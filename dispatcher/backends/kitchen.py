"""comfy-kitchen: the kernel library ComfyUI 0.38 imports (PyPI `comfy-kitchen`), its INT8 attention and its
block-sparse Sol-Attn, under the names ComfyUI uses.

- `comfy_kitchen_int8`: `comfy_kitchen.int8_attention` (ComfyUI's `--use-ck-attention`, "comfy kitchen attention" in
  its Model Attention Backend node, and its registry name). Signed INT8 Q/K/V and unsigned INT8 P with a
  block-Hadamard rotation of Q and K; (B, H, S, D); float16/bfloat16/float32 (float32 is computed through bfloat16);
  head dims up to 256 (padded to 64/128/256 and sliced back); grouped-query attention; bool or float masks
  broadcastable to (B, H, Lq, Lk); no causal flag, LSE, dropout or backward. Native on sm_75 and newer. Quantised:
  measured on the H200 (issue 31, bf16): 1.7e-2 against float64 on N(0,1) inputs, 0.14 on outlier keys.
- `sol_attn`: `comfy_kitchen.sol_attn` (ComfyUI's "Model Sparse Attention" node, method "sol-attn"). Each 64-token
  query block attends a routed subset of key blocks exactly (INT8) and the rest through one pooled term per block:
  approximate by design, as close to exact attention as the model's attention is local. (B, T, H, 128) self-attention
  only (q, k and v of one shape), bfloat16/float16, sm_80 and newer, no mask, causal flag, LSE or backward. Its
  error is 0.76 on unstructured N(0,1) inputs (issue 31): noise says nothing about it; `auto_fast` admits it only
  within its declared bound on the model's own activations, and the guard holds it to twice that.

ComfyUI's HIP (ROCm) builds of both kernels are not declared here: neither has been run by this pack's tests.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import re
from dataclasses import dataclass

import torch

from ..backend_options import BackendOptions, Option
from ..inputs import AttentionInputs
from ..log import echo
from ..registry import add
from ..requirements import CudaCapability, OnDevice, Package, Probe
from ..spec import HALF, BackendSpec, HeadDims

# The floor is the version ComfyUI pins (its requirements.txt: comfy-kitchen==0.2.36, a hard import since 0.38), so
# the pack's advice never fights ComfyUI's pin. 0.2.36 has the two calls the pack makes with the same signatures as
# 0.2.40, `int8_attention` (comfy_kitchen/sage_attention.py) and the eager Sol-Attn are the same files, and the
# CUDA sol_attn differs only in its top-k path (topk_ratio > 0), which the pack never asks for. 0.2.35 (ComfyUI
# 0.37.4's pin) has both calls too but is not tested here; 0.2.31 has no sol_attn.
# Tested: tests/test_kitchen_and_fa4.py in a venv with comfy-kitchen==0.2.36 (docs/install.md says how CI runs it).
COMFYUI_PIN = "0.2.36"
KITCHEN = Package("comfy-kitchen", COMFYUI_PIN, module="comfy_kitchen", pip=f"pip install 'comfy-kitchen>={COMFYUI_PIN}'")
ON_CUDA = OnDevice(frozenset({"cuda"}))
SM75 = CudaCapability(minimum=(7, 5))  # comfy_kitchen.sage_attention._NATIVE_MINIMUM_CAPABILITY
SM80 = CudaCapability(minimum=(8, 0))  # comfy_kitchen.sol_attn_is_available: "the CUDA backend on sm_80+"

# Sol-Attn's routing threshold, in standard deviations of the proxy scores: higher routes fewer key blocks exactly
# (faster, less accurate). 1.0 is comfy_kitchen.sol_attn's own default (ComfyUI's node defaults to 1.3); issue 31
# measured it on the H200. ComfyUI's node takes 0..4.
DEFAULT_TAU = 1.0
TAU_RANGE = (0.0, 4.0)
# ComfyUI's node keeps sequences shorter than this dense: "below roughly 12k tokens dense or a fused attention is
# usually faster" (comfy_kitchen.sol_attn's docstring; issue 31: Flux's 4608 tokens, 0.549 ms against cuDNN's 0.436).
DEFAULT_MIN_TOKENS = 12288
MAX_MIN_TOKENS = 1 << 20
# The declared bound: how far from exact attention (relative error on sampled query rows, float64) `auto_fast`
# lets the block-sparse kernel be on the model's own activations. A policy, not a measurement: twice the quantised
# kernels' 5e-2, since leaving out blocks costs more than rounding does, and well under the 0.3-1.0 of a kernel
# that spoils the picture (docs/auto.md). comfy-kitchen's own eager reference (the algorithm in full precision, on a
# CPU) measured 1.5e-3 at tau 1.0 on video-like local activations and 0.73 on noise (tests/test_kitchen_and_fa4.py);
# the INT8 kernel on WAN's own activations is still to be measured on the H200 (bench/side_by_side.py).
SOL_ATTN_BOUND = 1e-1
# The kernel's name in comfy_kitchen (`sol_attn`) and the paper's (Sol-Attn); ComfyUI's node calls the method
# "sol-attn", a spelling backend names here never use.
SOL_ATTN_NAME = "sol_attn"


_kitchen: list = []  # the module, once imported: a call then imports nothing


def _module():
    if not _kitchen:
        import comfy_kitchen
        _kitchen.append(comfy_kitchen)
    return _kitchen[0]


def int8_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    """(B, H, S, D) in and out; the mask is the dispatcher's 4-D view (bool, or float32 for an additive one)."""
    return _module().int8_attention(q, k, v, scale=scale, attn_mask=attn_mask)


def sol_attn_call(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    """(B, T, H, 128) in and out, with the routing threshold of the active `sol_attn_options`."""
    return _module().sol_attn(q, k, v, tau=_options.get().tau, scale=scale)


# --- sol_attn's options: ComfyUI's "Model Sparse Attention" parameters -----------------------------------------

def tau_problem(tau) -> str | None:
    """Why `tau` is not a routing threshold sol_attn takes, or None."""
    low, high = TAU_RANGE
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or not low <= tau <= high:
        return f"tau must be a number from {low:g} to {high:g} (higher is sparser); got {tau!r}"
    return None


_BLOCK_ITEM = re.compile(r"^(\d+)(?:\s*-\s*(\d+))?$")
# A model has tens of blocks (WAN 14B 40, Flux 57, HunyuanVideo 60): these caps are far above any of them and far
# below what costs the server anything. They are checked on the text and on each range's arithmetic length before
# a single block is expanded: 300 ranges of 100,000 blocks once held the server 3-14 s and took 2.4 GB.
MAX_DENSE_TEXT = 4096  # characters of dense_blocks
MAX_DENSE_ITEMS = 256  # block numbers and ranges
MAX_DENSE_BLOCKS = 4096  # blocks named in all, counted before they are expanded
MAX_BLOCK = 99_999  # the highest block number
_FORM = "write block numbers from 0 and ranges a-b, separated by commas, e.g. '0, 1, 47-49'"


def parse_dense_blocks(text) -> tuple[frozenset[int], str | None]:
    """'0, 1, 47-49' -> ({0, 1, 47, 48, 49}, None); anything else -> (empty, why). ComfyUI's node skips what it
    cannot read (a typo silently makes every block sparse); this names the item and the form instead. Sizes are
    capped (MAX_DENSE_*) before anything is expanded: the answer takes microseconds whatever the text."""
    if not isinstance(text, str):
        return frozenset(), f"dense_blocks must be text such as '0, 1, 47-49'; got {type(text).__name__}"
    if len(text) > MAX_DENSE_TEXT:
        return frozenset(), (f"dense_blocks is {len(text)} characters long, at most {MAX_DENSE_TEXT} are accepted "
                             f"(a model has tens of blocks); {_FORM}")
    items = [part.strip() for part in text.replace(";", ",").split(",")]
    items = [item for item in items if item]
    if len(items) > MAX_DENSE_ITEMS:
        return frozenset(), (f"dense_blocks names {len(items)} numbers and ranges, at most {MAX_DENSE_ITEMS} are "
                             f"accepted; join neighbouring blocks into ranges a-b")
    ranges, total = [], 0
    for item in items:
        match = _BLOCK_ITEM.match(item)
        if match is None:
            return frozenset(), f"dense_blocks: {echo(item)} is not a block number or a range; {_FORM}"
        first, last = int(match.group(1)), int(match.group(2) or match.group(1))
        if last < first:
            return frozenset(), f"dense_blocks: the range {echo(item)} runs backwards; write it {last}-{first}"
        if last > MAX_BLOCK:
            return frozenset(), (f"dense_blocks: block {last} is past the highest block number accepted, "
                                 f"{MAX_BLOCK} (a model has tens of blocks, numbered from 0); name the model's blocks")
        total += last - first + 1
        ranges.append((first, last))
    if total > MAX_DENSE_BLOCKS:
        return frozenset(), (f"dense_blocks names {total} blocks, at most {MAX_DENSE_BLOCKS} are accepted (a model "
                             f"has tens of blocks); name only the model's blocks, e.g. '0, 1, 47-49'")
    return frozenset(b for first, last in ranges for b in range(first, last + 1)), None


@dataclass(frozen=True)
class SolAttnOptions:
    """The knobs of ComfyUI's Model Sparse Attention node (method sol-attn): `tau`, the routing threshold; calls of
    fewer than `min_tokens` tokens and blocks in `dense_blocks` run dense (the node decides those before a call
    reaches the dispatcher; `tau` reaches the kernel through `sol_attn_options`)."""

    tau: float = DEFAULT_TAU
    min_tokens: int = DEFAULT_MIN_TOKENS
    dense_blocks: frozenset[int] = frozenset()

    def problems(self) -> list[str]:
        found = []
        why = tau_problem(self.tau)
        if why:
            found.append(why)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= MAX_MIN_TOKENS:
            found.append(f"min_tokens must be a whole number from 0 to {MAX_MIN_TOKENS}; got {self.min_tokens!r}")
        return found

    def dense_reason(self, tokens: int, block: int | None) -> str | None:
        """Why a call of `tokens` tokens in block `block` (None: the model does not say) stays dense, or None."""
        if tokens < self.min_tokens:
            return f"{tokens} tokens < min_tokens {self.min_tokens}: short sequences run faster dense"
        if block is not None and block in self.dense_blocks:
            return f"block {block} is in dense_blocks"
        return None

    def applied(self):
        """Around a call: its tau reaches the kernel (`sol_attn_options`)."""
        return sol_attn_options(self.tau)

    def as_dict(self) -> dict:
        return {"tau": self.tau, "min_tokens": self.min_tokens, "dense_blocks": sorted(self.dense_blocks)}


_options: contextvars.ContextVar[SolAttnOptions] = contextvars.ContextVar("sol_attn_options", default=SolAttnOptions())


@contextlib.contextmanager
def sol_attn_options(tau: float = DEFAULT_TAU):
    """sol_attn's routing threshold for the calls inside the block (checked here: a clear error, never a kernel
    failure that would look like a fallback). Note that `auto_fast`'s verdicts on sol_attn are per model and
    signature, not per tau: choose sol_attn by name to use another tau."""
    options = SolAttnOptions(tau=tau)
    problems = options.problems()
    if problems:
        raise ValueError("sol_attn: " + "; ".join(problems))
    token = _options.set(options)
    try:
        yield options
    finally:
        _options.reset(token)


def build_options(tau=DEFAULT_TAU, dense_blocks="", min_tokens=DEFAULT_MIN_TOKENS):
    """The options from their fields' values (dense_blocks as text): (options, []) or (None, every problem)."""
    blocks, why = parse_dense_blocks(dense_blocks)
    options = SolAttnOptions(tau=tau, min_tokens=min_tokens, dense_blocks=blocks)
    problems = ([why] if why else []) + options.problems()
    return (None, problems) if problems else (options, [])


# The fields ComfyUI's Model Sparse Attention node shows, declared with the backend (hosts build inputs from them).
SOL_ATTN_OPTIONS = BackendOptions(fields=(
    Option("tau", "float", DEFAULT_TAU, minimum=TAU_RANGE[0], maximum=TAU_RANGE[1], step=0.05,
           tooltip="sol_attn's routing threshold, in standard deviations of each query block's proxy scores: higher "
                   "is sparser, faster and further from exact attention (ComfyUI: 1.0 keeps ~16% of key blocks "
                   "exact, 1.5 ~7%, 2.0 ~2.7%). The quality guard compares sampled calls with exact attention."),
    Option("dense_blocks", "string", "",
           tooltip="Transformer blocks that always run dense, e.g. '0, 1, 47-49' (block numbers from 0, ranges a-b, "
                   "separated by commas). Needs a model that tells attention its block position."),
    Option("min_tokens", "int", DEFAULT_MIN_TOKENS, minimum=0, maximum=MAX_MIN_TOKENS,
           tooltip="Sequences shorter than this run dense (below roughly 12k tokens dense attention is usually "
                   "faster)."),
), build=build_options, default=SolAttnOptions())


def _probe(function: str):
    """A tiny real call: the package imports without its CUDA extension (a wheel for another CUDA or Python loads
    as a stub whose every call fails), so importing proves nothing."""
    def run():
        kitchen = _module()
        if function == "int8_attention":
            if not kitchen.int8_attention_is_available(torch.device("cuda")):
                raise RuntimeError("comfy_kitchen.int8_attention_is_available() is False on this GPU")
            q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.float16)
            kitchen.int8_attention(q, q, q)
        else:
            if not kitchen.sol_attn_is_available(torch.device("cuda")):
                raise RuntimeError("comfy_kitchen.sol_attn_is_available() is False on this GPU")
            q = torch.randn(1, 128, 1, 128, device="cuda", dtype=torch.bfloat16)
            kitchen.sol_attn(q, q, q)
        torch.cuda.synchronize()
    return run


def _self_attention_only(inputs: AttentionInputs) -> list[str]:
    if inputs.len_q != inputs.len_kv:
        return [f"cross-attention (Lq={inputs.len_q} != Lk={inputs.len_kv}) is not supported: sol_attn routes "
                "self-attention only (query, key and value of one shape)"]
    return []


add(BackendSpec(
    name="comfy_kitchen_int8", family="kitchen",
    description="comfy-kitchen INT8 attention (ComfyUI's --use-ck-attention; quantised)",
    fn=int8_call, layout="BHSD", devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32}), head_dims=HeadDims(1, 256),
    masks=frozenset({"bool", "key_padding", "additive"}), mask_format="precise", causal=False, gqa=True,
    backward=False, capability=SM75, quantised=True, error_bound=3e-2, fallback=("native",),
    requires=(KITCHEN, ON_CUDA, Probe("comfy-kitchen INT8 attention", _probe("int8_attention")))))
add(BackendSpec(
    name=SOL_ATTN_NAME, family="kitchen",
    description="comfy-kitchen Sol-Attn block-sparse attention (ComfyUI's Model Sparse Attention; approximate)",
    fn=sol_attn_call, layout="BSHD", devices=frozenset({"cuda"}), dtypes=HALF,
    head_dims=HeadDims(allowed=(128,)), causal=False, backward=False, capability=SM80, quantised=True,
    approximate=True, error_bound=SOL_ATTN_BOUND, extra_reasons=_self_attention_only, options=SOL_ATTN_OPTIONS,
    fallback=("_native_flash", "native"),
    requires=(KITCHEN, ON_CUDA, Probe("comfy-kitchen sol_attn", _probe("sol_attn")))))
