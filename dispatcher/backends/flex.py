"""FlexAttention: masks become score/block masks, causal becomes a BlockMask (never dropped)."""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import NamedTuple, Optional

import torch

from ..checks import broadcast_kv
from ..custom_ops import define_once
from ..process_locks import shared_lock
from ..registry import add
from ..requirements import TorchVersion
from ..spec import FLOATS, BackendSpec, HeadDims, LastResort


def _index(bias: torch.Tensor):
    """An indexer into a broadcastable 4-D tensor that maps size-1 axes to 0.

    A literal 0, not a captured 0-dim tensor: under torch.compile with inductor on the CPU, a score_mod that
    indexes with a captured tensor fails to lower (NoValidChoicesError) for any mask with a size-1 axis."""
    pick = [(lambda i: i) if size > 1 else (lambda i: 0) for size in bias.shape]

    def at(b, h, q, kv):
        return bias[pick[0](b), pick[1](h), pick[2](q), pick[3](kv)]
    return at


def score_mod_for(mask: torch.Tensor):
    at = _index(mask)
    if mask.dtype == torch.bool:
        def keep_or_drop(score, b, h, q, kv):
            return torch.where(at(b, h, q, kv), score, -float("inf"))
        return keep_or_drop

    def add_bias(score, b, h, q, kv):
        # The bias stays float32 (mask format "precise"): eager flex hands half scores, and casting the bias to
        # them first rounded it to 8 bits (5x the error of SDPA with the same float32 mask).
        return score + at(b, h, q, kv)
    return add_bias


try:
    from torch.nn.attention.flex_attention import AuxRequest as _AuxRequest
except ImportError:
    _AuxRequest = None


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@functools.lru_cache(maxsize=64)
def causal_block_mask(len_q: int, len_kv: int, device: str):
    from torch.nn.attention.flex_attention import create_block_mask
    if torch.compiler.is_dynamo_compiling():
        return create_block_mask(_causal, None, None, len_q, len_kv, device=device)
    with _eager_lock:  # made eagerly, it mutates the same dict eager flex does (`_eager_lock`)
        return create_block_mask(_causal, None, None, len_q, len_kv, device=device)


_compiled: dict["FlexSignature", object] = {}


def _axis_order(t: torch.Tensor) -> tuple[int, ...]:
    """The tensor's axes from the largest stride to the smallest: its memory layout, whatever its sizes."""
    return tuple(sorted(range(t.dim()), key=lambda axis: -t.stride(axis)))


class FlexSignature(NamedTuple):
    """The key of one compiled flex_attention (`compiled_flex`): what dynamo specialises its graph on."""
    head_dim: int
    head_dim_v: int
    dtype: torch.dtype
    device: torch.device
    q_order: tuple
    k_order: tuple
    v_order: tuple
    masked: bool
    blocked: bool
    enable_gqa: bool
    lse: bool


def compiled_flex(q, k, v, *, masked: bool, blocked: bool, enable_gqa: bool, lse: bool):
    """The compiled flex_attention for one static signature (head dims, dtype, device, memory layout of
    q/k/v, mask use, GQA, LSE).

    Dynamo keeps compiled entries, and its recompile limit (8), per code object; past the limit it silently
    runs flex unfused, which materialises the scores (48 and 160 GiB asked for at Wan's 32k tokens on the
    H200 after the bench's other models had used up the shared entries). So each signature compiles its
    own copy of a small wrapper, with its own entries; lengths, batch and heads become dynamic within it.
    The layout is part of the signature rather than copied away: on the H200 flex ran ComfyUI's strided
    views as fast as contiguous inputs, and the copies cost 14-16% at SDXL/Flux/Qwen sizes."""
    key = FlexSignature(q.shape[-1], v.shape[-1], q.dtype, q.device, _axis_order(q), _axis_order(k), _axis_order(v),
                        masked, blocked, enable_gqa, lse)
    run = _compiled.get(key)
    if run is None:
        from torch.nn.attention.flex_attention import flex_attention

        def flex(q, k, v, score_mod, block_mask, scale, enable_gqa, **aux):
            return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                  enable_gqa=enable_gqa, **aux)
        flex.__code__ = flex.__code__.replace(co_name=f"flex_attention_{len(_compiled)}")
        run = _compiled.setdefault(key, torch.compile(flex))
    return run


# functorch's dispatch keys: what torch.vmap needs enabled to batch a tensor.
_FUNCTORCH_KEYS = tuple(getattr(torch._C.DispatchKey, name) for name in (
    "FuncTorchDynamicLayerFrontMode", "FuncTorchDynamicLayerBackMode", "FuncTorchBatched", "FuncTorchVmapMode",
    "FuncTorchGradWrapper", "FuncTorchBatchedDecomposition") if hasattr(torch._C.DispatchKey, name))
_FUNCTORCH_FRONT = torch._C.DispatchKey.FuncTorchDynamicLayerFrontMode  # excluded with the others
_functorch_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded


def vmap_enabled():
    """A context in which torch.vmap works, when this thread's dispatch keys have turned functorch off.

    Eager flex_attention uses torch.vmap: it builds every block mask (even the empty one it makes when there is
    none) and evaluates score/mask mods through it. Code that runs inside a TorchDispatchMode's handler has every
    dispatch key above Python excluded, functorch's among them, so vmap's batched tensors reach the CPU kernels
    unwrapped: "NotImplementedError: Cannot access storage of BatchedTensorImpl". That is where flex runs inside a
    model compiled by inductor (ComfyUI's TorchCompileModel) as an op of the graph: the dispatcher's own op (with
    symbolic sizes, once a size changes) or this module's CPU op: AOT autograd runs the first call of each
    compiled graph under its custom-op aliasing check (torch._functorch.config.check_custom_op_aliasing, on by
    default), a TorchDispatchMode that runs each op's body from its handler. flex raised there and fell back to
    native for that signature from then on. Outside any functorch transform those keys are excluded only by
    such a handler, so they are turned back on for flex's own vmap; inside a transform (a real vmap or grad
    level) nothing changes."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    if not any(exclude.has(key) for key in _FUNCTORCH_KEYS) or torch._C._functorch.maybe_current_level() is not None:
        return contextlib.nullcontext()
    for key in _FUNCTORCH_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def flex_attention_backend(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
    if not torch.compiler.is_dynamo_compiling():
        if _functorch_excluded(_FUNCTORCH_FRONT):  # inside a dispatch mode's handler (0.1 us to ask)
            with vmap_enabled():
                return _flex(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                             enable_gqa=enable_gqa, return_lse=return_lse)
        return _flex(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                     return_lse=return_lse)
    if (q.device.type == "cpu" and not (q.requires_grad or k.requires_grad or v.requires_grad)
            and (attn_mask is None or isinstance(attn_mask, torch.Tensor))):
        out, lse = _cpu_op()(q, k, v, attn_mask, is_causal, scale, enable_gqa, return_lse)
        return (out, lse) if return_lse else out
    # Traced into the caller's graph, whose compiler compiles flex with it: PyTorch's documented use of
    # flex_attention inside torch.compile (no torch.compile of flex nested in it). A BlockMask (it holds a
    # Python mask_mod, which an op cannot take) and gradients take this route on the CPU too.
    return _flex(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                 return_lse=return_lse)


def _cpu_op():
    """Eager flex as one op, for flex inside a graph compiled for the CPU (ComfyUI's TorchCompileModel).

    Traced into the graph, flex is compiled by inductor's C++ flex template, which fails or is wrong on
    torch 2.13 and 2.14.1 for what ComfyUI hands it (each reproduced with flex_attention alone):
    - any pointwise op that reads the output in its own layout (`flex_attention(q, k, v) + r`) is fused into
      the template, which refuses it: "NotImplementedError: Unsupported for `epilogue_nodes` in
      CppFlexAttentionTemplate";
    - q/k/v that are 4-D views of a tensor of another rank (ComfyUI's (B, L, H*D) projections; after RoPE,
      5-D): "LoweringException: ValueError: not enough values to unpack (expected 4, got 2)", since the
      template reads four sizes from the storage under each;
    - a mask computed in the graph (as ComfyUI's are), read by the score_mod: "All the buffers in the score
      and mask subgraph should be in kernel_group.args.input_buffers";
    - query/key head dims 8 and 16: NaN, or errors near 1, at some lengths (8, 16/24, 64/8).
    Each failure made the prompt fail. The op runs the flex the pack runs on the CPU outside torch.compile
    (eager; compiling it there costs tens of seconds per shape): the same numbers, every call counted by the
    dispatcher as flex."""
    global _op
    if _op is None:
        _op = define_once("flex_cpu", __name__, _define_cpu_op)
    return _op


_op = None


def _define_cpu_op(name: str):
    @torch.library.custom_op(name, mutates_args=())
    def flex_cpu(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
                 is_causal: bool, scale: Optional[float], enable_gqa: bool,
                 return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
        with vmap_enabled():  # the graph's first run calls this from AOT autograd's dispatch mode
            result = _flex(query, key, value, attn_mask=mask, is_causal=is_causal, scale=scale,
                           enable_gqa=enable_gqa, return_lse=return_lse)
        out, lse = result if return_lse else (result, query.new_empty(0, dtype=torch.float32))
        return out.contiguous(), lse.contiguous()  # what the fake below promises the compiler

    @flex_cpu.register_fake
    def _(query, key, value, mask, is_causal, scale, enable_gqa, return_lse):
        out = query.new_empty((*query.shape[:-1], value.shape[-1]))
        return out, query.new_empty(query.shape[:-1] if return_lse else (0,), dtype=torch.float32)
    return flex_cpu


_cpu_op()  # registered on import: registering while dynamo traces would break the graph


# Eager flex_attention is not safe in two threads at once. It runs itself through torch.compile(fullgraph=True,
# backend="eager"), where one thread could fail with "torch.compile with fullgraph=True found no compiled frames"
# (1 run in 8 of tests/test_concurrency.py); and each call (its block masks: _dense_to_ordered) enters
# torch.fx.traceback.annotate, which adds a key to a module-level dict and deletes it on exit: one thread then
# raised KeyError: 'custom', or the key stayed in the dict for good (4 threads, two copies of the pack: in 10
# runs of 10). Either demoted flex to native for that signature. Eager flex calls, and the block masks made
# eagerly, take turns under one lock for every copy of the pack in the process (`process_locks`).
_eager_lock = shared_lock("eager flex")


def _eager(fn, *args, **kwargs):
    """Eager flex, one call at a time. Eager flex makes torch print a 9-line "called without torch.compile()"
    warning the user can do nothing about (the pack compiles flex where that pays, GPUs, and chose eager on the
    CPU): silenced for this call only, never in the process's warning filters."""
    with _eager_lock, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile", category=UserWarning)
        return fn(*args, **kwargs)


def _flex(q, k, v, *, attn_mask, is_causal, scale, enable_gqa, return_lse):
    from torch.nn.attention.flex_attention import flex_attention

    k, v = broadcast_kv(q, k, v, enable_gqa)  # flex wants equal batches and heads; SDPA broadcasts them
    block_mask, score_mod = None, None
    if type(attn_mask).__name__ == "BlockMask":
        block_mask = attn_mask
    elif attn_mask is not None:
        score_mod = score_mod_for(attn_mask)
    if is_causal:
        block_mask = causal_block_mask(q.shape[-2], k.shape[-2], str(q.device))
    # Flex is only fast compiled; eager on the CPU (compiling there costs tens of seconds per shape).
    if torch.compiler.is_dynamo_compiling():
        run = flex_attention
    elif q.device.type == "cpu":
        run = functools.partial(_eager, flex_attention)
    else:
        run = compiled_flex(q, k, v, masked=score_mod is not None, blocked=block_mask is not None,
                            enable_gqa=enable_gqa, lse=return_lse)
    if not return_lse:
        return run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    if _AuxRequest is not None:  # torch >= 2.9 deprecates return_lse for return_aux
        out, aux = run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                       return_aux=_AuxRequest(lse=True))
        return out, aux.lse.float()
    out, lse = run(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa,
                   return_lse=True)
    return out, lse.float()


# On a CPU flex_attention runs eagerly through torch.compile's tracer: its first call of each signature took 4.4 s
# and its calls 640 ms against SDPA's 24 ms (tiny SD1.5's self-attention, 2 x 256 x 8 x 40, torch 2.13 on a CI
# runner's CPU): it never wins there, and its first call alone was 9x a CPU's whole tuning budget. `auto` leaves
# it out there wherever another kernel can run the call (a BlockMask still gets it).
CPU_LAST_RESORT = LastResort(frozenset({"cpu"}), "auto leaves flex out on a CPU: it runs eagerly there, its first call "
                             "per signature traces for seconds and its calls were 25x SDPA's; select 'flex' by name "
                             "to run it")

add(BackendSpec(
    name="flex", family="flex", description="torch FlexAttention (compiled on GPUs): bool/additive/BlockMask masks",
    fn=flex_attention_backend, broadcast_kv=True, layout="BHSD", devices=frozenset({"cpu", "cuda", "rocm", "xpu"}),
    dtypes=FLOATS, head_dims=HeadDims(8), masks=frozenset({"bool", "key_padding", "additive", "blockmask"}),
    mask_format="precise", gqa=True, lse=True, different_value_dim=True, requires=(TorchVersion("2.5"),),
    auto_last_resort=CPU_LAST_RESORT))
