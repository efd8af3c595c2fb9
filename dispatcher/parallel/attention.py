"""Context-parallel attention: Ulysses (all-to-all over heads), ring (key/value blocks around the
ranks, partial outputs merged by their log-sum-exp) and both (Ulysses inside each ring position).

Every rank holds a contiguous shard of the sequence, q (B, Sq_local, H, D) and k/v (B, Sk_local, Hk, D),
in CP-rank order (see `ContextParallelConfig`). The steps, for a rank at ring index r, Ulysses index u:

1. Ulysses (ulysses_degree U > 1): one ``all_to_all_single`` inside the Ulysses group: every rank sends
   each peer that peer's heads of its shard and receives its own heads of every peer's shard, so it
   holds the U shards of ring block r (contiguous in the sequence) for ~H/U heads. Head counts that U
   does not divide are split unevenly (ceil/floor), shard lengths that differ are sent as they are
   (split sizes per peer); nothing is padded. Under GQA each rank receives the key/value heads its
   query heads read: whole groups when its query heads are whole groups, else the key/value heads
   repeated as far as needed (a divisor of the group size), so the local call stays exact.
2. Local attention over the whole sequence (ring_degree R == 1) through the dispatcher with any
   backend, or the ring (R > 1): R steps; at step s the rank attends its query block to key/value
   block (r - s) mod R with ``return_lse=True`` and merges in float32 (float64 for float64 inputs):
   ``lse = logaddexp(lse_a, lse_b)``, ``out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)``.
   Blocks travel by ``batch_isend_irecv`` to the next ring rank while the current block is computed
   (``ring_method="p2p"``), or all at once by ``all_gather`` (``"allgather"``). Blocks of different
   lengths are sent at their own length; an empty block (a rank with no tokens) and a block that a
   causal mask hides entirely are skipped: their LSE is -inf. Rows that a mask empties inside one
   block get LSE -inf there whatever the kernel returned (SDPA's CPU flash kernel returns 0).
3. The inverse all-to-all gives every rank its own shard back with all heads (and the LSE).

Masks: bool (True = attend) or additive, any rank rule the dispatcher takes, with the key axis over
the *whole* key sequence (or 1) and the query axis 1, this rank's queries, or all queries (sliced
here); the head axis 1 or H. Under Ulysses the query rows travel with the queries in the same
all-to-all. ``is_causal`` means causal over the global positions. A FlexAttention BlockMask is refused
(it cannot be cut per block here), and so is a mask with ``is_causal`` (support.context_parallel_reasons words
both). Forward only: no backward through the collectives.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .. import dispatch, registry, state, support
from ..call import AttentionCall
from ..checks import AttentionInputError
from ..inputs import describe_call
from ..masks import to_4d
from ..report import recording
from . import comm
from .config import ContextParallelConfig, ContextParallelError, split_sizes

ULYSSES, RING, ULYSSES_RING = "ulysses", "ring", "ulysses_ring"


# --- which backend runs which mode --------------------------------------------------------------

def supported_modes(name: str) -> set[str]:
    """The context-parallel modes backend `name` can be the local kernel of: every backend runs under
    Ulysses (it sees an ordinary full-sequence call); ring and Ulysses+ring need its LSE (spec lse=True)."""
    return set(registry.get(name).context_parallel_modes)


def backends_for(mode: str) -> list[str]:
    """Registered backends that can run `mode`, in registry order."""
    if mode not in (ULYSSES, RING, ULYSSES_RING):
        raise ContextParallelError(f"unknown context-parallel mode {mode!r}; valid modes: {ULYSSES}, {RING}, "
                                   f"{ULYSSES_RING}")
    return [n for n in registry.names() if mode in supported_modes(n)]


def check_backend(name: str, config: ContextParallelConfig) -> None:
    """Raise ContextParallelError when `name` cannot be the local kernel of `config`'s mode (`support.why_not`'s
    context-parallel rule: the ring modes need its LSE)."""
    refused = support.why_not(name, rules=support.Rules(context_parallel=config.mode)).rules
    if not refused:
        return
    able = backends_for(config.mode)
    here = [n for n in able if not support.availability_reasons(n)]
    raise ContextParallelError(
        f"backend '{name}' cannot be the local kernel of context-parallel mode '{config.mode}' "
        f"(ring_degree={config.ring_degree}): {'; '.join(refused)}. Backends that can be the ring's local kernel: "
        f"{', '.join(able)} (available on this machine: {', '.join(here) or 'none'}).")


# --- the context manager and the dispatcher hook ------------------------------------------------

@dataclass(frozen=True)
class _Scope:
    config: ContextParallelConfig
    kv_sharded: Any  # bool, or call_site -> bool
    q_lens: tuple | None
    kv_lens: tuple | None
    runner: Any = None  # set by dispatcher.parallel.replicated: it takes the call instead (replicated inputs)


_scope: contextvars.ContextVar[_Scope | None] = contextvars.ContextVar("attention_dispatch_cp", default=None)
_hook_lock = threading.Lock()
_hook_users = 0


def active_config() -> ContextParallelConfig | None:
    """The config of the innermost `context_parallel` block of this context, or None."""
    scope = _scope.get()
    return None if scope is None or scope.runner is not None else scope.config


@contextmanager
def context_parallel(config: ContextParallelConfig | None, *, kv_sharded: bool | Callable[[str], bool] = True,
                     q_lens: Sequence[int] | None = None, kv_lens: Sequence[int] | None = None):
    """Inside the block, every `dispatch_attention_fn` call of this context (thread / task) runs
    context-parallel with `config` (None: plain local attention again, e.g. around one call).

    kv_sharded: True when key/value are sharded along the sequence like the queries (self-attention);
    False when every rank holds all of them (cross-attention to a text encoding: local attention, no
    communication); or a function of the call's `call_site` saying which. q_lens / kv_lens: every CP
    rank's shard lengths, when known (saves one tiny all-gather per call).
    """
    if config is not None and not isinstance(config, ContextParallelConfig):
        raise TypeError(f"context_parallel takes a ContextParallelConfig or None; got {type(config).__name__}")
    if config is not None:
        config.setup()
    token = _scope.set(None if config is None else _Scope(config, kv_sharded, _tuple(q_lens), _tuple(kv_lens)))
    _hook(+1)
    try:
        yield config
    finally:
        _scope.reset(token)
        _hook(-1)


def _tuple(values):
    return None if values is None else tuple(int(v) for v in values)


def _hook(delta: int) -> None:
    """The dispatcher checks one module global per call; it is set only while some block is open."""
    global _hook_users
    with _hook_lock:
        _hook_users += delta
        dispatch.install_router(_routed())  # the same function every time: installed once, only the flag changes
        dispatch.route_calls(_hook_users > 0)


def _route(call: AttentionCall):
    """The dispatcher's hook: the described call (an AttentionCall), split over the active block's ranks."""
    scope = _scope.get()
    if scope is None:
        return NotImplemented
    if scope.runner is not None:
        return scope.runner(call)
    kv_sharded = scope.kv_sharded(call.call_site) if callable(scope.kv_sharded) else scope.kv_sharded
    return _run(scope.config, call, bool(kv_sharded), scope.q_lens, scope.kv_lens)


_routed_fns: list = []


def _routed():
    """`_route` behind torch.compiler.disable: collectives and contextvars are not traced, so a compiled
    caller takes a graph break here and runs the context-parallel call eagerly."""
    if not _routed_fns:
        _routed_fns.append(torch.compiler.disable(_route))
    return _routed_fns[0]


# --- the call -------------------------------------------------------------------------------------

def context_parallel_attention(call: AttentionCall, *, config: ContextParallelConfig | None = None,
                               kv_sharded: bool = True, q_lens: Sequence[int] | None = None,
                               kv_lens: Sequence[int] | None = None):
    """`dispatch_call(call)` over the sequence shards of every CP rank; returns this rank's shard.

    call: the described call (`AttentionCall`, every field of `dispatch_attention_fn` with this rank's shards as
    query/key/value; its recorder, model and guard reach the local calls as they would a plain call). Returns what
    `dispatch_attention_fn` returns (out, or (out, lse) with return_lse). Plus ``config`` (default: the active
    `context_parallel` block's; none: plain local attention), ``kv_sharded`` (False: k/v are whole on every rank,
    e.g. cross-attention) and the per-CP-rank shard lengths ``q_lens`` / ``kv_lens`` (learnt with one small
    all-gather when not given). Every CP rank must make the same calls in the same order (they are collective).

    The local kernel is `call.backend` (default: the active backend). Under Ulysses it runs with `call.policy`
    like any call; as the ring's kernel it is called with ``return_lse=True`` and policy 'strict' unless
    `call.policy` is given, and it must declare lse=True (`supported_modes`).
    """
    if not isinstance(call, AttentionCall):
        raise TypeError(f"context_parallel_attention takes an AttentionCall (dispatcher.AttentionCall(query, key, "
                        f"value, ...)); got {type(call).__name__}")
    if config is None:
        config = active_config()
    # the local calls count in the call's recorder, as a routed call's do (dispatch.dispatch_call)
    with recording(call.recorder) if call.recorder is not None else contextlib.nullcontext():
        return _run(config, call, kv_sharded, q_lens, kv_lens)


def _run(config, call: AttentionCall, kv_sharded, q_lens, kv_lens):
    token = _scope.set(None)  # the local calls below are plain dispatcher calls
    try:
        if config is None or config.world_size == 1:
            return dispatch.dispatch_call(call)
        return _Call(config, call, kv_sharded, q_lens, kv_lens).run()
    finally:
        _scope.reset(token)


@dataclass(frozen=True)
class _Heads:
    """One Ulysses rank's query heads [start, stop) and the key/value heads it receives for them."""

    start: int
    stop: int
    kv: tuple[int, ...]
    group: int  # query heads per received key/value head (local GQA ratio)

    @property
    def count(self) -> int:
        return self.stop - self.start


def head_plan(heads_q: int, heads_kv: int, parts: int) -> list[_Heads]:
    """Split query heads into `parts` contiguous runs (ceil/floor) and give each the key/value heads it reads."""
    g = heads_q // heads_kv
    plan, start = [], 0
    for n in split_sizes(heads_q, parts):
        # The largest t dividing g, start and n: runs of t query heads then share one key/value head.
        t = max(d for d in range(1, g + 1) if g % d == 0 and start % d == 0 and n % d == 0) if n else 1
        plan.append(_Heads(start, start + n, tuple((start + c * t) // g for c in range(n // t)), t))
        start += n
    return plan


def _take_heads(t: torch.Tensor, heads: Sequence[int], axis: int = 2) -> torch.Tensor:
    if not heads:
        return t.narrow(axis, 0, 0)
    first = heads[0]
    if list(heads) == list(range(first, first + len(heads))):
        return t.narrow(axis, first, len(heads))
    return t.index_select(axis, torch.tensor(heads, dtype=torch.long, device=t.device))


def _fail(message: str):
    raise AttentionInputError(message)


class _Call:
    def __init__(self, config, call: AttentionCall, kv_sharded, q_lens, kv_lens):
        query, key, value, attn_mask, layout = call.query, call.key, call.value, call.attn_mask, call.layout
        self.call = call
        requested = call.backend if call.backend is not None else state.active_backend()
        # A pseudo-backend (`auto`) picks per call, among the backends that return the LSE for a ring.
        auto = registry.resolver(requested) is not None
        if not auto and requested not in registry.names():
            raise registry.UnknownBackendError(registry.unknown_message(requested))
        if kv_sharded and not auto:
            check_backend(requested, config)
        from ..checks import check_shapes
        check_shapes(query, key, value, layout)
        refused = support.context_parallel_reasons(describe_call(
            query, key, value, attn_mask, call.dropout_p, call.is_causal, call.scale, call.enable_gqa, call.return_lse,
            layout))
        if refused:
            raise ContextParallelError("; ".join(refused))
        config.setup()
        self.config, self.requested, self.layout = config, requested, layout
        self.dropout_p, self.is_causal, self.scale = call.dropout_p, bool(call.is_causal), call.scale
        self.extra, self.policy, self.return_lse = call.attention_kwargs, call.policy, call.return_lse
        self.call_site = call.call_site
        self.kv_sharded = kv_sharded
        bshd = (lambda t: t.transpose(1, 2)) if layout == "BHSD" else (lambda t: t)
        self.q, self.k, self.v = bshd(query), bshd(key), bshd(value)
        self.B, self.Sq, self.Hq, self.D = self.q.shape
        self.Sk, self.Hk, self.Dv = self.k.shape[1], self.k.shape[2], self.v.shape[3]
        for name, t in (("key", self.k), ("value", self.v)):
            if t.dtype != self.q.dtype or t.device != self.q.device:
                _fail(f"{name} is {t.dtype} on {t.device} but query is {self.q.dtype} on {self.q.device}: "
                      "give query, key and value one dtype and device")
        if self.Hk != self.Hq:
            if self.Hq % self.Hk:
                _fail(f"query has {self.Hq} heads, not a multiple of the {self.Hk} key/value heads")
            if not call.enable_gqa:
                _fail(f"key/value have {self.Hk} heads but query has {self.Hq}: pass enable_gqa=True for "
                      "grouped-query attention")
        self.attn_mask = attn_mask
        self.q_lens, self.kv_lens = q_lens, kv_lens
        self.acc = torch.float64 if self.q.dtype == torch.float64 else torch.float32

    # --- helpers ----------------------------------------------------------------------------------

    def _kernel(self, q, k, v, mask, is_causal, group, lse, policy):
        return dispatch.dispatch_call(self.call._replace(
            query=q, key=k, value=v, attn_mask=mask, is_causal=is_causal, enable_gqa=group > 1,
            backend=self.requested, layout="BSHD", policy=policy, return_lse=lse, recorder=None))

    def _lengths(self):
        world, rank = self.config.world_size, self.config.rank
        q_lens, kv_lens = self.q_lens, self.kv_lens
        if q_lens is None or (kv_lens is None and self.kv_sharded):
            rows = self.config.gather_ints([self.Sq, self.Sk], self.q.device)
            q_lens = q_lens if q_lens is not None else [r[0] for r in rows]
            kv_lens = kv_lens if kv_lens is not None else [r[1] for r in rows]
        q_lens = [int(n) for n in q_lens]
        kv_lens = None if kv_lens is None else [int(n) for n in kv_lens]
        checked = (("q_lens", q_lens, self.Sq), ("kv_lens", kv_lens if self.kv_sharded else None, self.Sk))
        for name, lens, mine in checked:
            if lens is None:
                continue
            if len(lens) != world or lens[rank] != mine:
                raise ContextParallelError(f"{name} {lens} does not describe this rank's shard: {world} CP ranks, "
                                           f"CP rank {rank} holds {mine}")
        return q_lens, kv_lens

    def _local_mask(self, q_off: int, len_q_total: int, len_k_total: int, rows: bool | None = None):
        """(mask as (B|1, H|1, Sq|1, Lk_total|1) with this rank's query rows, whether the rows travel with
        the queries) or (None, False). rows: decided for all ranks (None: a query axis of 1 broadcasts)."""
        if self.attn_mask is None:
            return None, False
        m = self.attn_mask
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"attn_mask must be a torch.Tensor or None; got {type(m).__name__}")
        if m.dtype != torch.bool and not m.is_floating_point():
            _fail("attn_mask has an integer dtype; pass a bool mask (True = attend) or an additive float mask "
                  "(0 = keep, -inf = drop)")
        m = to_4d(m)
        bm, hm, qm, km = m.shape
        if bm not in (1, self.B) or hm not in (1, self.Hq):
            _fail(f"attn_mask of shape {tuple(self.attn_mask.shape)} does not broadcast to batch {self.B} and "
                  f"{self.Hq} heads")
        if km not in (1, len_k_total):
            hint = (" It covers this rank's keys only: pass it over all keys (config.gather(mask, dim=-1))."
                    if km == self.Sk else "")
            _fail(f"attn_mask key axis is {km}; under context parallelism it must be 1 or the whole key length "
                  f"{len_k_total}.{hint}")
        if rows is None:
            rows = qm != 1
        if not rows:
            return m, False
        if qm == 1:  # rows travel on other ranks: this rank's broadcast row, once per query
            return m.expand(bm, hm, self.Sq, km), True
        if qm == self.Sq:
            return m, True
        if qm == len_q_total:
            return m.narrow(2, q_off, self.Sq), True
        _fail(f"attn_mask query axis is {qm}; under context parallelism it must be 1, this rank's query length "
              f"{self.Sq} or the whole query length {len_q_total}")

    # --- the three steps --------------------------------------------------------------------------

    def run(self):
        if not self.kv_sharded:
            out, lse = self._replicated_kv()
        else:
            out, lse = self._sharded()
        if self.layout == "BHSD":
            out = out.transpose(1, 2)
            lse = None if lse is None else lse.transpose(1, 2)
        return (out, lse) if self.return_lse else out

    def _empty(self, rows: int, heads: int):
        out = self.q.new_empty(self.B, rows, heads, self.Dv)
        return out, (torch.empty(self.B, rows, heads, dtype=self.acc, device=self.q.device)
                     if self.return_lse else None)

    def _replicated_kv(self):
        """Cross-attention to keys every rank holds: local attention, no communication."""
        q_off, q_total = 0, self.Sq
        if self.is_causal or self.q_lens is not None:
            q_lens, _ = self._lengths()
            q_off, q_total = sum(q_lens[:self.config.rank]), sum(q_lens)
        mask, _ = self._local_mask(q_off, q_total, self.Sk)
        if self.Sq == 0:
            return self._empty(0, self.Hq)
        causal = False
        if self.is_causal:  # global query positions against the keys, SDPA's top-left alignment
            keep = (torch.arange(self.Sq, device=self.q.device) + q_off)[:, None] >= \
                torch.arange(self.Sk, device=self.q.device)[None, :]
            mask, causal = (keep[None, None], False) if q_off else (None, True)
        result = self._kernel(self.q, self.k, self.v, mask, causal, self.Hq // self.Hk, self.return_lse, self.policy)
        return result if self.return_lse else (result, None)

    def _sharded(self):
        cfg = self.config
        u_deg, r_deg = cfg.ulysses_degree, cfg.ring_degree
        ring_idx, uly_idx = divmod(cfg.rank, u_deg)
        q_lens, kv_lens = self._lengths()
        q_total, k_total = sum(q_lens), sum(kv_lens)
        q_off = sum(q_lens[:cfg.rank])
        rows = None
        if self.attn_mask is not None and u_deg > 1 and any(n <= 1 for n in q_lens):
            # A rank holding one query (or none) cannot tell its mask rows from a broadcast row, and whether
            # rows travel in the all-to-all must agree everywhere: ask every rank (one tiny all-gather).
            # Rows travel if any rank passes rows, or if no rank passes a row for several queries.
            qm = to_4d(self.attn_mask).shape[2] if isinstance(self.attn_mask, torch.Tensor) else 1
            seen = cfg.gather_ints([qm, self.Sq], self.q.device)
            rows = any(a != 1 for a, _ in seen) or not any(a == 1 and n > 1 for a, n in seen)
        mask, rows = self._local_mask(q_off, q_total, k_total, rows)
        peers = range(ring_idx * u_deg, (ring_idx + 1) * u_deg)
        q_peer, k_peer = [q_lens[c] for c in peers], [kv_lens[c] for c in peers]

        # 1. Ulysses: scatter heads, gather the ring block's sequence.
        plan = head_plan(self.Hq, self.Hk, u_deg)
        me = plan[uly_idx]
        if u_deg > 1:
            q, k, v, mask = self._ulysses_in(plan, me, q_peer, k_peer, mask, rows)
        else:
            q, k, v = self.q, self.k, self.v
        if mask is not None and not rows and mask.shape[1] > 1:
            mask = mask.narrow(1, me.start, me.count)

        # 2. Local attention over the whole sequence, or the ring over its blocks.
        block_q_off = sum(q_lens[:ring_idx * u_deg])
        if q.shape[1] == 0 or me.count == 0:
            out, lse = self._empty(q.shape[1], me.count)
            if r_deg > 1:
                self._ring(q, k, v, mask, me, kv_lens, block_q_off, compute=False)
        elif r_deg == 1:
            result = self._kernel(q, k, v, mask, self.is_causal, me.group, self.return_lse, self.policy)
            out, lse = (result[0], result[1].to(self.acc)) if self.return_lse else (result, None)
        else:
            out, lse = self._ring(q, k, v, mask, me, kv_lens, block_q_off, compute=True)
            out = out.to(self.q.dtype)

        # 3. Inverse Ulysses: scatter the sequence back, gather the heads.
        if u_deg > 1:
            out, lse = self._ulysses_out(plan, q_peer, out, lse)
        return out, lse

    def _ulysses_in(self, plan, me, q_peer, k_peer, mask, rows):
        B, D, Dv = self.B, self.D, self.Dv
        send, shapes = [], []
        kv_me = len(me.kv)
        for j, heads in enumerate(plan):
            piece = [self.q.narrow(2, heads.start, heads.count), _take_heads(self.k, heads.kv),
                     _take_heads(self.v, heads.kv)]
            shape = [(B, q_peer[j], me.count, D), (B, k_peer[j], kv_me, D), (B, k_peer[j], kv_me, Dv)]
            if rows:
                per_head = mask.shape[1] > 1
                piece.append(mask.narrow(1, heads.start, heads.count) if per_head else mask)
                shape.append((mask.shape[0], me.count if per_head else 1, q_peer[j], mask.shape[3]))
            send.append(piece)
            shapes.append(shape)
        dtypes = [self.q.dtype, self.k.dtype, self.v.dtype] + ([mask.dtype] if rows else [])
        recv = comm.all_to_all(send, shapes, dtypes, self.config._ulysses_group, self.q.device)
        q = torch.cat([r[0] for r in recv], dim=1)
        k = torch.cat([r[1] for r in recv], dim=1)
        v = torch.cat([r[2] for r in recv], dim=1)
        if rows:
            mask = torch.cat([r[3] for r in recv], dim=2)
        return q, k, v, mask

    def _ulysses_out(self, plan, q_peer, out, lse):
        B, Sq, Dv = self.B, self.Sq, self.Dv
        want_lse = self.return_lse
        send, shapes, offset = [], [], 0
        for i, n in enumerate(q_peer):
            send.append([out.narrow(1, offset, n)] + ([lse.narrow(1, offset, n)] if want_lse else []))
            offset += n
        for heads in plan:
            shapes.append([(B, Sq, heads.count, Dv)] + ([(B, Sq, heads.count)] if want_lse else []))
        dtypes = [out.dtype] + ([lse.dtype] if want_lse else [])
        recv = comm.all_to_all(send, shapes, dtypes, self.config._ulysses_group, self.q.device)
        out = torch.cat([r[0] for r in recv], dim=2)
        lse = torch.cat([r[1] for r in recv], dim=2) if want_lse else None
        return out, lse

    def _ring(self, q, k, v, mask, me, kv_lens, q_off, compute: bool):
        cfg = self.config
        u_deg, r_deg = cfg.ulysses_degree, cfg.ring_degree
        ring_idx = cfg.rank // u_deg
        B, D, Dv, hk = self.B, self.D, self.Dv, len(me.kv)
        block_len = [sum(kv_lens[r * u_deg:(r + 1) * u_deg]) for r in range(r_deg)]
        block_off = [sum(block_len[:r]) for r in range(r_deg)]
        numel = [B * n * hk * (D + Dv) for n in block_len]
        rows = q.shape[1]
        out = torch.zeros(B, rows, me.count, Dv, dtype=self.acc, device=q.device)
        lse = torch.full((B, rows, me.count), float("-inf"), dtype=self.acc, device=q.device)
        policy = self.policy if self.policy is not None else "strict"

        def attend(index: int, flat: torch.Tensor) -> None:
            n = block_len[index]
            if not compute or n == 0:
                return
            split = B * n * hk * D
            kb, vb = flat[:split].view(B, n, hk, D), flat[split:].view(B, n, hk, Dv)
            k_off = block_off[index]
            block_mask = mask
            if block_mask is not None and block_mask.shape[3] > 1:
                block_mask = block_mask.narrow(3, k_off, n)
            causal = False
            if self.is_causal:
                if k_off > q_off + rows - 1:
                    return  # every key comes after every query: the block adds nothing
                if k_off + n - 1 > q_off:  # some keys are hidden
                    if k_off == q_off and n == rows and block_mask is None:
                        causal = True
                    else:
                        keep = (torch.arange(rows, device=q.device) + q_off)[:, None] >= \
                            (torch.arange(n, device=q.device) + k_off)[None, :]
                        block_mask = _and(block_mask, keep)
            o, l = self._kernel(q, kb, vb, block_mask, causal, me.group, True, policy)
            if block_mask is not None:
                l = _empty_rows_to_neg_inf(l, block_mask)
            _merge(out, lse, o, l)

        mine = torch.cat([k.reshape(-1), v.reshape(-1)])
        if cfg.ring_method == "allgather":
            blocks = comm.ring_all_gather(mine, numel, cfg._ring_group)
            for step in range(r_deg):
                index = (ring_idx - step) % r_deg
                attend(index, blocks[index])
        else:
            exchange = comm.RingExchange(cfg._ring_group, cfg._ring_ranks, ring_idx)
            current, index = mine, ring_idx
            for step in range(r_deg):
                last = step == r_deg - 1
                if not last:
                    incoming = (ring_idx - step - 1) % r_deg
                    exchange.start(current, numel[incoming])
                attend(index, current)
                if not last:
                    current, index = exchange.wait(), incoming
        return out, lse


def _and(mask, keep: torch.Tensor):
    """A block mask that also drops what `keep` (Lq, Lk) drops."""
    if mask is None:
        return keep[None, None]
    if mask.dtype == torch.bool:
        return mask & keep
    return torch.where(keep, mask, torch.tensor(float("-inf"), dtype=mask.dtype, device=mask.device))


def _empty_rows_to_neg_inf(lse: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Rows with no key left in this block have LSE -inf, whatever the kernel said."""
    keep = mask if mask.dtype == torch.bool else ~torch.isneginf(mask)
    alive = keep.any(dim=-1).transpose(1, 2)  # (B|1, Lq|1, H|1), like lse (B, Lq, H)
    return lse.masked_fill(~alive, float("-inf"))


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, l: torch.Tensor) -> None:
    """Fold the block result (o, l) into the running (out, lse), in place, in out's dtype.

    lse' = logaddexp(lse, l); out' = out * exp(lse - lse') + o * exp(l - lse'); rows where both are
    -inf (nothing attended yet) stay 0 / -inf, and a block row with l = -inf adds exactly nothing
    (its o may be NaN).
    """
    o, l = o.to(out.dtype), l.to(lse.dtype)
    new = torch.logaddexp(lse, l)
    base = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    dead = torch.isneginf(l).unsqueeze(-1)
    o = torch.where(dead, torch.zeros((), dtype=o.dtype, device=o.device), o)
    out.mul_(torch.exp(lse - base).unsqueeze(-1)).add_(o * torch.exp(l - base).unsqueeze(-1))
    lse.copy_(new)
