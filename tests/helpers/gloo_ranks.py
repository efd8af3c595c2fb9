"""Spawning gloo ranks on this machine for the context-parallel tests: join, run, collect per-rank JSON."""

from __future__ import annotations

import json
import os
import warnings
from datetime import timedelta


def join_gloo(rank: int, world: int, init_file: str) -> None:
    """Inside a spawned rank: one thread, quiet warnings, gloo over loopback only."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")  # flex on the CPU warns it runs unfused
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo's pairs on 127.0.0.1, never another interface
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))


def leave_gloo() -> None:
    """Inside a spawned rank, at its end: destroy_process_group, then fail the rank (a Python error naming the
    holders) if anything still references one of its groups. A group alive at interpreter exit keeps gloo's worker
    threads, and one of them dropping a finished collective's tensors while the interpreter finalizes aborts the
    rank now and then ("terminate called without an active exception", SIGABRT after correct results); this
    check makes that pin fail every time, at its holder, instead of once in a while at exit."""
    import gc
    import weakref

    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    groups = [weakref.ref(group) for group in distributed_c10d._world.pg_map]  # the default group and new_group's
    dist.destroy_process_group()
    gc.collect()
    pinned = [group for group in (ref() for ref in groups) if group is not None]
    if pinned:
        holders = sorted({type(holder).__name__ for group in pinned for holder in gc.get_referrers(group)
                          if holder is not pinned})
        raise RuntimeError(f"{len(pinned)} of this rank's {len(groups)} process groups outlive "
                           f"destroy_process_group, referenced by {', '.join(holders) or 'no Python object'}: drop "
                           "what holds them (a cache of configs) before leave_gloo()")


def spawn_ranks(worker, world: int, tmp_path_factory, prefix: str) -> list[dict]:
    """Run `worker(rank, world, init_file, out_dir)` on `world` processes; each writes out_dir/rank<r>.json.

    Any rank that fails, by a Python error or a signal, fails the tests: a rank aborting in gloo's teardown
    ("terminate called without an active exception") is a group pinned past interpreter exit, to be fixed at its
    cause (dispatcher/parallel/__init__.py; the workers' config caches), not retried: each worker ends with
    leave_gloo(), which fails the rank whenever a group would outlive the interpreter."""
    import torch.multiprocessing as mp

    where = tmp_path_factory.mktemp(f"{prefix}{world}")
    mp.spawn(worker, args=(world, str(where / "rendezvous"), str(where)), nprocs=world, join=True)
    return [json.loads((where / f"rank{r}.json").read_text()) for r in range(world)]
