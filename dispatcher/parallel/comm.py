"""The collectives of context parallelism, all torch.distributed: all_to_all_single (Ulysses),
batch_isend_irecv or all_gather (ring), all_gather (lengths, gathers). Pieces of different sizes are
sent as they are (all_to_all_single takes split sizes); all_gather pads to the largest piece and trims.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

# Collectives move bytes of these dtypes everywhere (gloo has no bool); masks travel as uint8.
_WIRE = {torch.bool: torch.uint8}


def _to_wire(t: torch.Tensor) -> torch.Tensor:
    wire = _WIRE.get(t.dtype)
    return t if wire is None else t.to(wire)


def _from_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def all_gather_var(tensor: torch.Tensor, dim: int, sizes: Sequence[int], group) -> torch.Tensor:
    """Concatenate along `dim` every group member's piece (piece i has sizes[i] entries along dim)."""
    dtype = tensor.dtype
    wire = _to_wire(tensor).contiguous()
    biggest = max(max(sizes), 1)
    if wire.shape[dim] < biggest:
        pad = list(wire.shape)
        pad[dim] = biggest - wire.shape[dim]
        wire = torch.cat([wire, wire.new_zeros(pad)], dim=dim)
    pieces = [torch.empty_like(wire) for _ in sizes]
    dist.all_gather(pieces, wire, group=group)
    return _from_wire(torch.cat([p.narrow(dim, 0, n) for p, n in zip(pieces, sizes)], dim=dim), dtype)


def gather_ints(config, values: list[int], device) -> list[list[int]]:
    """Every CP rank's `values` (same count everywhere), in CP-rank order."""
    if config.world_size == 1:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.int64, device=device)
    if config._cp_group is not None:
        out = [torch.empty_like(mine) for _ in range(config.world_size)]
        dist.all_gather(out, mine, group=config._cp_group)
        return [t.tolist() for t in out]
    # A mesh: gather within the Ulysses group, then those rows around the ring.
    rows = mine[None]
    if config.ulysses_degree > 1:
        parts = [torch.empty_like(mine) for _ in range(config.ulysses_degree)]
        dist.all_gather(parts, mine, group=config._ulysses_group)
        rows = torch.stack(parts)
    if config.ring_degree > 1:
        parts = [torch.empty_like(rows) for _ in range(config.ring_degree)]
        dist.all_gather(parts, rows.contiguous(), group=config._ring_group)
        rows = torch.cat(parts)
    return rows.tolist()


def gather_cp(config, tensor: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
    """All-gather a sequence-sharded tensor over the CP ranks (sizes per CP rank)."""
    if config._cp_group is not None:
        return all_gather_var(tensor, dim, sizes, config._cp_group)
    u_deg = config.ulysses_degree
    ring_idx = config.rank // u_deg
    block = tensor
    if u_deg > 1:
        block = all_gather_var(tensor, dim, sizes[ring_idx * u_deg:(ring_idx + 1) * u_deg], config._ulysses_group)
    if config.ring_degree > 1:
        blocks = [sum(sizes[r * u_deg:(r + 1) * u_deg]) for r in range(config.ring_degree)]
        block = all_gather_var(block, dim, blocks, config._ring_group)
    return block


def all_to_all(send: list[list[torch.Tensor]], recv_shapes: list[list[tuple]], dtypes: list[torch.dtype],
               group, device) -> list[list[torch.Tensor]]:
    """Personalised exchange of several tensors: send[j][t] goes to group rank j; returns recv[i][t],
    tensor t from rank i, of shape recv_shapes[i][t]. One all_to_all_single per distinct wire dtype."""
    peers = len(send)
    count = len(dtypes)
    recv: list[list] = [[None] * count for _ in range(peers)]
    wires: dict[torch.dtype, list[int]] = {}
    for t, dtype in enumerate(dtypes):
        wires.setdefault(_WIRE.get(dtype, dtype), []).append(t)
    for wire, members in wires.items():
        flat = [_to_wire(send[j][t]).reshape(-1) for j in range(peers) for t in members]
        in_splits = [sum(send[j][t].numel() for t in members) for j in range(peers)]
        out_sizes = [[math.prod(recv_shapes[i][t]) for t in members] for i in range(peers)]
        out_splits = [sum(row) for row in out_sizes]
        buffer = torch.cat(flat) if flat else torch.empty(0, dtype=wire, device=device)
        result = torch.empty(sum(out_splits), dtype=wire, device=device)
        dist.all_to_all_single(result, buffer, out_splits, in_splits, group=group)
        offset = 0
        for i in range(peers):
            for t, n in zip(members, out_sizes[i]):
                recv[i][t] = _from_wire(result[offset:offset + n].view(recv_shapes[i][t]), dtypes[t])
                offset += n
    return recv


class RingExchange:
    """Passes one flat buffer per step to the next ring rank and receives the previous rank's
    (batch_isend_irecv), started before the current block's attention and waited for after it."""

    def __init__(self, group, ranks: list[int], index: int):
        self.group, self.ranks, self.index = group, ranks, index
        size = len(ranks)
        self.next_rank, self.prev_rank = ranks[(index + 1) % size], ranks[(index - 1) % size]
        self._pending = None

    def start(self, buffer: torch.Tensor, incoming_numel: int) -> None:
        # Empty blocks still travel as one element, so every rank posts the same number of messages.
        send = buffer if buffer.numel() else buffer.new_zeros(1)
        self._incoming = torch.empty(max(incoming_numel, 1), dtype=buffer.dtype, device=buffer.device)
        self._numel = incoming_numel
        ops = [dist.P2POp(dist.isend, send.contiguous(), self.next_rank, self.group),
               dist.P2POp(dist.irecv, self._incoming, self.prev_rank, self.group)]
        self._pending = dist.batch_isend_irecv(ops)

    def wait(self) -> torch.Tensor:
        for request in self._pending:
            request.wait()
        self._pending = None
        return self._incoming[:self._numel]


def ring_all_gather(buffer: torch.Tensor, numels: list[int], group) -> list[torch.Tensor]:
    """Every ring rank's flat buffer (numels per ring index), by one all_gather padded to the largest."""
    biggest = max(max(numels), 1)
    padded = buffer if buffer.numel() == biggest else torch.cat([buffer, buffer.new_zeros(biggest - buffer.numel())])
    pieces = [torch.empty_like(padded) for _ in numels]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    return [p[:n] for p, n in zip(pieces, numels)]
