"""`ContextParallelConfig`: how many ranks split the sequence, in which mode, over which process groups.

The context-parallel (CP) ranks form a 2-D grid ``ring_degree x ulysses_degree`` (diffusers' mesh dims
``("ring", "ulysses")``). CP rank ``c`` (its rank in the CP group) sits at ring index ``c // ulysses_degree``
and Ulysses index ``c % ulysses_degree``: the Ulysses groups are runs of consecutive ranks (on a GPU
host: the all-to-all stays on the fastest links), the ring groups stride over them.

The global sequence is cut into one contiguous shard per CP rank, in CP-rank order. `split_sizes`
and `shard` give the balanced convention (the first ``S % world`` ranks hold one token more), but any
cut works as long as every rank passes its own piece in CP-rank order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

MODES = ("ulysses", "ring", "ulysses_ring")
RING_METHODS = ("p2p", "allgather")


class ContextParallelError(RuntimeError):
    """A context-parallel call or configuration that cannot run (wrong degrees, backend without LSE, ...)."""


def split_sizes(total: int, parts: int) -> list[int]:
    """The balanced cut of `total` items into `parts` contiguous pieces: the first `total % parts` get one more."""
    if parts <= 0:
        raise ValueError(f"parts must be positive; got {parts}")
    base, extra = divmod(int(total), parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def _dist():
    import torch.distributed as dist
    return dist


@dataclass(eq=False)
class ContextParallelConfig:
    """Context parallelism for attention: ``ulysses_degree x ring_degree`` ranks share one sequence.

    - ``ulysses_degree``: ranks that exchange heads for sequence with an all-to-all (DeepSpeed-Ulysses);
      any backend can be the local kernel.
    - ``ring_degree``: ranks that pass key/value blocks around a ring and merge partial outputs by
      their log-sum-exp; the local kernel must return its LSE (see `supported_modes`).
    - ``group``: the process group of the CP ranks (default: the default group). Its size must be
      ``ulysses_degree * ring_degree``.
    - ``mesh``: instead of ``group``, a 2-D ``DeviceMesh`` with dims ``("ring", "ulysses")``.
    - ``ring_method``: ``"p2p"`` (default: each step sends the current key/value block to the next
      rank and receives the previous rank's with ``batch_isend_irecv``, overlapped with the block's
      attention; memory for two blocks) or ``"allgather"`` (one ``all_gather`` of every block, then
      local attention over each; memory for the whole sequence, one collective).

    Call `setup()` on every rank of the default group after ``torch.distributed.init_process_group``
    (it creates the ring/Ulysses subgroups when both degrees are > 1; a collective call); the first
    context-parallel attention call does it otherwise. With both degrees 1 it needs no process group
    and every call is plain local attention.
    """

    ulysses_degree: int = 1
    ring_degree: int = 1
    group: Any = None
    mesh: Any = None
    ring_method: str = "p2p"
    # Filled by setup().
    _ready: bool = field(default=False, init=False, repr=False)
    _world: int = field(default=1, init=False, repr=False)
    _rank: int = field(default=0, init=False, repr=False)
    _cp_group: Any = field(default=None, init=False, repr=False)
    _ring_group: Any = field(default=None, init=False, repr=False)
    _ring_ranks: list = field(default_factory=list, init=False, repr=False)
    _ulysses_group: Any = field(default=None, init=False, repr=False)

    def __post_init__(self):
        for name in ("ulysses_degree", "ring_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ContextParallelError(f"{name} must be an integer >= 1; got {value!r}")
        if self.ring_method not in RING_METHODS:
            raise ContextParallelError(f"ring_method must be one of {', '.join(RING_METHODS)}; "
                                       f"got {self.ring_method!r}")
        if self.group is not None and self.mesh is not None:
            raise ContextParallelError("pass either group or mesh, not both")

    @classmethod
    def for_world(cls, mode: str, world_size: int | None = None, ulysses_degree: int | None = None,
                  **kwargs) -> "ContextParallelConfig":
        """A config using every rank of the group: mode 'ulysses', 'ring' or 'ulysses_ring'.

        For 'ulysses_ring', ``ulysses_degree`` defaults to 2 when the world size is even and larger than 2
        (the ring takes the rest).
        """
        if mode not in MODES:
            raise ContextParallelError(f"unknown context-parallel mode {mode!r}; valid modes: {', '.join(MODES)}")
        if world_size is None:
            dist = _dist()
            group = kwargs.get("group")
            world_size = dist.get_world_size(group) if dist.is_available() and dist.is_initialized() else 1
        if mode == "ulysses":
            return cls(ulysses_degree=world_size, **kwargs)
        if mode == "ring":
            return cls(ring_degree=world_size, **kwargs)
        u = ulysses_degree or (2 if world_size % 2 == 0 and world_size > 2 else 1)
        if world_size % u:
            raise ContextParallelError(f"ulysses_degree {u} does not divide the world size {world_size}")
        return cls(ulysses_degree=u, ring_degree=world_size // u, **kwargs)

    # --- shape of the grid ------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.ulysses_degree * self.ring_degree

    @property
    def mode(self) -> str:
        """'none', 'ulysses', 'ring' or 'ulysses_ring'."""
        if self.ulysses_degree > 1 and self.ring_degree > 1:
            return "ulysses_ring"
        if self.ring_degree > 1:
            return "ring"
        return "ulysses" if self.ulysses_degree > 1 else "none"

    @property
    def rank(self) -> int:
        """This process's CP rank (its position in the sequence order)."""
        self.setup()
        return self._rank

    @property
    def ring_rank(self) -> int:
        return self.rank // self.ulysses_degree

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses_degree

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "ulysses_degree": self.ulysses_degree, "ring_degree": self.ring_degree,
                "world_size": self.world_size, "ring_method": self.ring_method}

    # --- process groups ---------------------------------------------------------------------------

    def setup(self) -> "ContextParallelConfig":
        """Resolve ranks and create the subgroups (idempotent; collective the first time on a 2-D grid)."""
        if self._ready:
            return self
        world = self.world_size
        if world == 1:
            self._ready = True
            return self
        dist = _dist()
        if not (dist.is_available() and dist.is_initialized()):
            raise ContextParallelError(
                f"context parallelism over {world} ranks needs torch.distributed: call "
                "torch.distributed.init_process_group(...) first (torchrun sets RANK/WORLD_SIZE/MASTER_ADDR)")
        if self.mesh is not None:
            self._setup_mesh()
        else:
            self._setup_group(dist)
        self._ready = True
        return self

    def _setup_group(self, dist) -> None:
        group = self.group if self.group is not None else dist.group.WORLD
        size = dist.get_world_size(group)
        if size != self.world_size:
            raise ContextParallelError(
                f"ulysses_degree {self.ulysses_degree} x ring_degree {self.ring_degree} = {self.world_size}, "
                f"but the process group has {size} ranks; the product must equal the group size")
        ranks = dist.get_process_group_ranks(group)
        self._rank = dist.get_rank(group)
        self._cp_group = group
        u_deg, r_deg = self.ulysses_degree, self.ring_degree
        ring_idx, uly_idx = divmod(self._rank, u_deg)
        if r_deg == 1:
            self._ulysses_group = group
        elif u_deg == 1:
            self._ring_group, self._ring_ranks = group, list(ranks)
        else:
            # Every rank creates every subgroup, in the same order (torch.distributed's rule for new_group).
            for r in range(r_deg):
                members = [ranks[r * u_deg + u] for u in range(u_deg)]
                made = dist.new_group(members)
                if r == ring_idx:
                    self._ulysses_group = made
            for u in range(u_deg):
                members = [ranks[r * u_deg + u] for r in range(r_deg)]
                made = dist.new_group(members)
                if u == uly_idx:
                    self._ring_group, self._ring_ranks = made, members

    def _setup_mesh(self) -> None:
        dist = _dist()
        mesh = self.mesh
        names = tuple(getattr(mesh, "mesh_dim_names", None) or ())
        if names != ("ring", "ulysses"):
            raise ContextParallelError(f"mesh must be a 2-D DeviceMesh with mesh_dim_names ('ring', 'ulysses'); "
                                       f"got {names or 'no names'}")
        r_size, u_size = mesh.size(0), mesh.size(1)
        if (r_size, u_size) != (self.ring_degree, self.ulysses_degree):
            raise ContextParallelError(f"mesh shape {(r_size, u_size)} does not match (ring_degree, ulysses_degree) "
                                       f"= {(self.ring_degree, self.ulysses_degree)}")
        ring_idx, uly_idx = mesh.get_local_rank("ring"), mesh.get_local_rank("ulysses")
        self._rank = ring_idx * self.ulysses_degree + uly_idx
        self._cp_group = None  # gathers over the CP ranks go ulysses-then-ring
        if self.ulysses_degree > 1:
            self._ulysses_group = mesh.get_group("ulysses")
        if self.ring_degree > 1:
            self._ring_group = mesh.get_group("ring")
            self._ring_ranks = dist.get_process_group_ranks(self._ring_group)

    # --- sequence sharding ------------------------------------------------------------------------

    def split_sizes(self, total: int) -> list[int]:
        """Per-CP-rank shard lengths of a sequence of `total` tokens (the balanced convention)."""
        return split_sizes(total, self.world_size)

    def shard(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's piece of a full-sequence tensor (every rank holds the full tensor): a view."""
        sizes = self.split_sizes(tensor.shape[dim])
        rank = self.rank
        return tensor.narrow(dim, sum(sizes[:rank]), sizes[rank])

    def gather(self, tensor: torch.Tensor, dim: int = 1, sizes: Sequence[int] | None = None) -> torch.Tensor:
        """The full sequence from every rank's piece along `dim` (all-gather; pieces may differ in length).

        `sizes` (per CP rank) saves one small collective that otherwise learns them.
        """
        self.setup()
        if self.world_size == 1:
            return tensor
        from . import comm
        dim = dim % tensor.dim()
        if sizes is None:
            sizes = [row[0] for row in self.gather_ints([tensor.shape[dim]], tensor.device)]
        return comm.gather_cp(self, tensor, dim, list(sizes))

    def gather_ints(self, values: Sequence[int], device) -> list[list[int]]:
        """`values` of every CP rank, in CP-rank order (one tiny all-gather; two with a mesh)."""
        from . import comm
        return comm.gather_ints(self, list(values), device)
