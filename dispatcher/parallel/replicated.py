"""Context parallelism on replicated inputs: every rank holds the whole q/k/v and splits only the attention work.

This is the case of ComfyUI under torchrun: every rank runs the same model on the same
inputs, so there is no sequence shard to exchange. What can be split exactly is the attention itself:

- ``"heads"`` (Ulysses-style): rank r attends its contiguous share of the query heads (ceil/floor split,
  `head_plan`; under GQA with the key/value heads those queries read) over the whole sequence;
- ``"sequence"`` (ring-style): rank r attends its contiguous share of the query rows (`split_sizes`)
  against all keys (a causal call gets the global row offsets).

Then one ``all_gather_single`` (``all_gather_into_tensor``) over the group hands every rank every piece
and the full output is put back together. No log-sum-exp merge is needed, so any registry backend can
be the local kernel in both modes, and each rank does 1/world of the attention FLOPs (and holds 1/world
of the score memory). Every rank gets the same bytes, so the replicated activations stay identical
across ranks; against one process the result is the same attention computed in pieces (within
floating-point reordering of the kernel, typically bitwise on the same backend).

Each rank's piece travels as bytes with one status byte: when the local kernel fails on one rank, every
rank raises (`ContextParallelError`) instead of the others waiting in the next collective.

    cfg = ReplicatedConfig(mode="heads").setup()      # after torch.distributed.init_process_group
    with replicated_parallel(cfg):                     # every dispatch_attention_fn call inside is split
        out = dispatch_attention_fn(q, k, v)           # the full output, on every rank
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import checks, dispatch, registry
from ..call import AttentionCall
from ..inputs import describe_call
from ..masks import to_4d
from . import attention
from .attention import _take_heads, head_plan
from .config import ContextParallelConfig, ContextParallelError, split_sizes

HEADS, SEQUENCE = "heads", "sequence"
REPLICATED_MODES = (HEADS, SEQUENCE)


def _dist():
    import torch.distributed as dist
    return dist


@dataclass(eq=False)
class ReplicatedConfig:
    """How replicated-input attention is split: ``mode`` ('heads' or 'sequence') over ``degree`` ranks.

    degree 0 (default) means every rank of ``group`` (default: the default process group). A smaller
    degree must divide the group size: the group is cut into runs of ``degree`` consecutive ranks, each
    splitting its attention on its own (every run computes the same thing). With one rank (degree 1,
    or no process group at all and degree 0) every call is plain local attention.

    `setup()` resolves ranks; with 1 < degree < group size it creates the subgroups (a collective: call
    it at the same point on every rank). `calls` counts the calls that were split.
    """

    mode: str = HEADS
    degree: int = 0
    group: Any = None
    calls: int = field(default=0, init=False)
    _cp: ContextParallelConfig | None = field(default=None, init=False, repr=False)

    def __post_init__(self):
        if self.mode not in REPLICATED_MODES:
            raise ContextParallelError(f"unknown replicated context-parallel mode {self.mode!r}; valid modes: "
                                       f"{', '.join(REPLICATED_MODES)}")
        if not isinstance(self.degree, int) or isinstance(self.degree, bool) or self.degree < 0:
            raise ContextParallelError(f"degree must be an integer >= 0 (0 = every rank); got {self.degree!r}")

    def setup(self) -> "ReplicatedConfig":
        if self._cp is not None:
            return self
        dist = _dist()
        initialized = dist.is_available() and dist.is_initialized()
        group = self.group if self.group is not None or not initialized else dist.group.WORLD
        world = dist.get_world_size(group) if initialized else 1
        degree = self.degree or world
        if degree == 1:
            self._cp = ContextParallelConfig().setup()
            return self
        if not initialized:
            raise ContextParallelError(
                f"replicated context parallelism over {degree} ranks needs torch.distributed: call "
                "torch.distributed.init_process_group(...) first (in ComfyUI: start it with torchrun --nproc-per-node N main.py)")
        if world % degree:
            raise ContextParallelError(f"degree {degree} does not divide the {world} ranks of the process group; "
                                       f"use 0 (all ranks) or a divisor of {world}")
        sub = group
        if degree != world:
            ranks = dist.get_process_group_ranks(group)
            me = dist.get_rank()
            for start in range(0, world, degree):  # every rank creates every subgroup, in the same order
                members = ranks[start:start + degree]
                made = dist.new_group(members)
                if me in members:
                    sub = made
        self._cp = ContextParallelConfig(ulysses_degree=degree, group=sub).setup()
        return self

    @property
    def world_size(self) -> int:
        return self.setup()._cp.world_size

    @property
    def rank(self) -> int:
        return self.setup()._cp.rank

    @property
    def process_group(self):
        return self.setup()._cp._cp_group

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "degree": self.world_size, "rank": self.rank, "calls": self.calls}


def active_replicated_config() -> ReplicatedConfig | None:
    """The config of the innermost `replicated_parallel` block of this context, or None."""
    scope = attention._scope.get()
    return scope.config if scope is not None and scope.runner is not None else None


@contextmanager
def replicated_parallel(config: ReplicatedConfig | None):
    """Inside the block, every `dispatch_attention_fn` call of this context (thread / task) is split over
    the ranks of `config` and returns the full output on every rank (None: plain local attention).

    Every rank must make the same calls in the same order (each call is one collective)."""
    if config is not None and not isinstance(config, ReplicatedConfig):
        raise TypeError(f"replicated_parallel takes a ReplicatedConfig or None; got {type(config).__name__}")
    if config is not None:
        config.setup()
    runner = None if config is None else _runner(config)
    scope = None if config is None else attention._Scope(config, False, None, None, runner=runner)
    token = attention._scope.set(scope)
    attention._hook(+1)
    try:
        yield config
    finally:
        attention._scope.reset(token)
        attention._hook(-1)


def _runner(config: ReplicatedConfig):
    def run(call: AttentionCall):  # the dispatcher's described call
        return replicated_attention(call.query, call.key, call.value, call.attn_mask, call.dropout_p, call.is_causal,
                                    call.scale, call.enable_gqa, call.attention_kwargs, config=config,
                                    backend=call.backend, layout=call.layout, policy=call.policy,
                                    return_lse=call.return_lse, call_site=call.call_site, model=call.model,
                                    guard=call.guard)
    return run


def replicated_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                         dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                         enable_gqa: bool = False, attention_kwargs: dict | None = None, *,
                         config: ReplicatedConfig | None = None, backend: str | None = None, layout: str = "BSHD",
                         policy: str | None = None, return_lse: bool = False, call_site: str = "attention",
                         model: str | None = None, guard=None):
    """`dispatch_attention_fn` on inputs every rank holds whole, its work split over `config`'s ranks.

    Same arguments and result as `dispatch_attention_fn` (the full output, or (out, lse)); ``config``
    defaults to the active `replicated_parallel` block's. The local kernel is `backend` through the
    dispatcher (any backend, with `policy`). A FlexAttention BlockMask cannot be cut: that call runs
    whole on every rank (no communication).
    """
    if config is None:
        config = active_replicated_config()
    token = attention._scope.set(None)  # the local call below is a plain dispatcher call
    try:
        args = (query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs)
        local = dict(backend=backend, layout=layout, policy=policy, return_lse=return_lse, call_site=call_site,
                     model=model, guard=guard)
        if config is None or config.world_size == 1 or type(attn_mask).__name__ == "BlockMask":
            return dispatch.dispatch_attention_fn(*args, **local)
        _validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs, backend,
                  layout, return_lse)
        if config.mode == HEADS:
            result = _by_heads(config, *args, **local)
        else:
            result = _by_sequence(config, *args, **local)
        config.calls += 1
        return result
    finally:
        attention._scope.reset(token)


def _validate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs, backend,
              layout, return_lse) -> None:
    """What the dispatcher would refuse, refused on every rank alike before any rank computes its piece
    (the inputs are the same everywhere, so every rank raises the same error)."""
    checks.check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                           attention_kwargs)
    checks.check_shapes(query, key, value, layout, attn_mask)
    checks.check_structure(describe_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                                         return_lse, layout))
    if backend is not None and not registry.is_known(backend):
        raise registry.UnknownBackendError(registry.unknown_message(backend))


def _axes(layout: str) -> tuple[int, int]:
    """(sequence axis, head axis) of q/k/v/out; the LSE has the same two axes (it lacks only the last)."""
    return (1, 2) if layout == "BSHD" else (2, 1)


def _by_heads(config, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs, *,
              backend, layout, policy, return_lse, call_site, model, guard):
    seq_axis, head_axis = _axes(layout)
    n, rank = config.world_size, config.rank
    heads_q, heads_kv = query.shape[head_axis], key.shape[head_axis]
    plan = head_plan(heads_q, heads_kv, n)
    me = plan[rank]

    def shapes(h):
        out = list(query.shape)
        out[head_axis], out[-1] = h.count, value.shape[-1]
        lse = out[:-1]
        return [tuple(out)] + ([tuple(lse)] if return_lse else [])

    def compute():
        if me.count == 0:
            return []
        mask = attn_mask
        if mask is not None:
            mask = to_4d(mask)
            if mask.shape[1] > 1:
                mask = mask.narrow(1, me.start, me.count)
        q = query.narrow(head_axis, me.start, me.count)
        k, v = _take_heads(key, me.kv, head_axis), _take_heads(value, me.kv, head_axis)
        result = dispatch.dispatch_attention_fn(q, k, v, mask, dropout_p, is_causal, scale, me.group > 1,
                                                attention_kwargs, backend=backend, layout=layout, policy=policy,
                                                return_lse=return_lse, call_site=call_site, model=model, guard=guard)
        return list(result) if return_lse else [result]

    pieces = _gather(config, compute, [shapes(h) for h in plan], query)
    return _assemble(pieces, head_axis, return_lse)


def _by_sequence(config, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, attention_kwargs, *,
                 backend, layout, policy, return_lse, call_site, model, guard):
    seq_axis, _ = _axes(layout)
    n, rank = config.world_size, config.rank
    len_q, len_k = query.shape[seq_axis], key.shape[seq_axis]
    sizes = split_sizes(len_q, n)
    offset, rows = sum(sizes[:rank]), sizes[rank]

    def shapes(count):
        out = list(query.shape)
        out[seq_axis], out[-1] = count, value.shape[-1]
        return [tuple(out)] + ([tuple(out[:-1])] if return_lse else [])

    def compute():
        if rows == 0:
            return []
        mask, causal = attn_mask, is_causal
        if mask is not None:
            mask = to_4d(mask)
            if mask.shape[2] > 1:
                mask = mask.narrow(2, offset, rows)
        if is_causal and offset:  # causal over the global rows (SDPA's top-left alignment): an explicit mask
            keep = (torch.arange(rows, device=query.device) + offset)[:, None] >= \
                torch.arange(len_k, device=query.device)[None, :]
            mask, causal = keep[None, None], False
        q = query.narrow(seq_axis, offset, rows)
        result = dispatch.dispatch_attention_fn(q, key, value, mask, dropout_p, causal, scale, enable_gqa,
                                                attention_kwargs, backend=backend, layout=layout, policy=policy,
                                                return_lse=return_lse, call_site=call_site, model=model, guard=guard)
        return list(result) if return_lse else [result]

    pieces = _gather(config, compute, [shapes(c) for c in sizes], query)
    return _assemble(pieces, seq_axis, return_lse)


def _assemble(pieces: list[list[torch.Tensor]], axis: int, return_lse: bool):
    out = torch.cat([p[0] for p in pieces], dim=axis)
    if not return_lse:
        return out
    return out, torch.cat([p[1] for p in pieces], dim=axis)


def _all_gather_single(output: torch.Tensor, tensor: torch.Tensor, group) -> None:
    dist = _dist()
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, tensor, group=group)


def _gather(config, compute, shapes: list[list[tuple]], like: torch.Tensor) -> list[list[torch.Tensor]]:
    """Every rank's piece of the result, in rank order: [rank][out, (lse)].

    shapes[j] are rank j's piece shapes (the same list on every rank); the output travels in the query's
    dtype, the LSE in float32. The pieces go as bytes, padded to the largest, plus one status byte, in one
    all_gather_single; a rank whose kernel raised sends status 0 and every rank then raises."""
    dtypes = [like.dtype, torch.float32][:len(shapes[0])]
    nbytes = [[math.prod(s) * torch.empty((), dtype=d).element_size() for s, d in zip(row, dtypes)] for row in shapes]
    starts = [[sum(_up(n) for n in row[:t]) for t in range(len(row))] for row in nbytes]  # 16-byte aligned parts
    width = max(sum(_up(n) for n in row) for row in nbytes) + _ALIGN  # the last byte is the status
    flat = torch.zeros(width, dtype=torch.uint8, device=like.device)
    error = None
    try:
        mine = compute()
        for t, d, n, start in zip(mine, dtypes, nbytes[config.rank], starts[config.rank]):
            flat[start:start + n] = t.to(d).contiguous().reshape(-1).view(torch.uint8)
        flat[-1] = 1
    except Exception as exc:  # noqa: BLE001 - re-raised below, after the collective every rank takes part in
        error = exc
        flat.zero_()
    gathered = torch.empty(config.world_size * width, dtype=torch.uint8, device=like.device)
    _all_gather_single(gathered, flat, config.process_group)
    gathered = gathered.view(config.world_size, width)
    failed = [j for j, ok in enumerate(gathered[:, -1].tolist()) if not ok]
    if error is not None:
        raise error
    if failed:
        raise ContextParallelError(f"the local attention kernel failed on rank(s) {failed} of this replicated "
                                   "context-parallel group (see that rank's log); every rank stops this call")
    pieces = []
    for j, row in enumerate(shapes):
        pieces.append([gathered[j, start:start + n].view(d).view(shape)
                       for shape, d, n, start in zip(row, dtypes, nbytes[j], starts[j])])
    return pieces


_ALIGN = 16


def _up(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN
