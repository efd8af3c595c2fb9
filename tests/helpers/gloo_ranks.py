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


def spawn_ranks(worker, world: int, tmp_path_factory, prefix: str) -> list[dict]:
    """Run `worker(rank, world, init_file, out_dir)` on `world` processes; each writes out_dir/rank<r>.json.

    Any rank that fails, by a Python error or a signal, fails the tests: a rank aborting in gloo's teardown
    ("terminate called without an active exception") is a group pinned past interpreter exit, to be fixed at its
    cause (dispatcher/parallel/__init__.py; test_cp_node's config cache), not retried."""
    import torch.multiprocessing as mp

    where = tmp_path_factory.mktemp(f"{prefix}{world}")
    mp.spawn(worker, args=(world, str(where / "rendezvous"), str(where)), nprocs=world, join=True)
    return [json.loads((where / f"rank{r}.json").read_text()) for r in range(world)]
