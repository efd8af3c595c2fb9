"""Launch example and self-check: context-parallel attention against single-process attention.

    torchrun --nproc-per-node 4 -m dispatcher.parallel.example --ulysses 2 --ring 2 --backend _native_flash
    torchrun --nproc-per-node 2 -m dispatcher.parallel.example --ring 2 --seq 4099 --heads 24 --kv-heads 8

Every rank builds the same full q/k/v (same seed), keeps its shard, runs the context-parallel call and
compares its output shard with the float64 reference of the whole sequence; rank 0 prints the worst
relative error over all ranks and the time per call. GPUs (one per rank, NCCL) when CUDA is there,
else CPU ranks over gloo. Exit status 1 when the error exceeds --tolerance.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dispatcher.parallel.example", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ulysses", type=int, default=1, help="ulysses_degree")
    parser.add_argument("--ring", type=int, default=None, help="ring_degree (default: world size / ulysses)")
    parser.add_argument("--ring-method", default="p2p", choices=("p2p", "allgather"))
    parser.add_argument("--backend", default="_native_math")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=1031)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=None, help="max relative error (default by dtype)")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    import importlib
    dispatcher = importlib.import_module(__package__.rsplit(".", 1)[0])  # `dispatcher`, or `attention_dispatch`
    from . import ContextParallelConfig, context_parallel

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count()) if cuda \
        else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    ring = args.ring if args.ring is not None else world // args.ulysses
    cp = ContextParallelConfig(ulysses_degree=args.ulysses, ring_degree=ring, ring_method=args.ring_method).setup()
    dtype = getattr(torch, args.dtype)
    hk = args.kv_heads or args.heads
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.seq)
    q_full = torch.randn(*shape, args.heads, args.head_dim, generator=gen)
    k_full = torch.randn(*shape, hk, args.head_dim, generator=gen)
    v_full = torch.randn(*shape, hk, args.head_dim, generator=gen)
    q, k, v = (cp.shard(t).to(device, dtype).contiguous() for t in (q_full, k_full, v_full))
    lens = cp.split_sizes(args.seq)

    with context_parallel(cp, q_lens=lens, kv_lens=lens):
        out = dispatcher.dispatch_attention_fn(q, k, v, is_causal=args.causal, enable_gqa=hk != args.heads,
                                               backend=args.backend)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(args.repeat):
            dispatcher.dispatch_attention_fn(q, k, v, is_causal=args.causal, enable_gqa=hk != args.heads,
                                             backend=args.backend)
        if cuda:
            torch.cuda.synchronize()
        per_call = (time.perf_counter() - start) / max(args.repeat, 1)

    ref = dispatcher.dispatch_attention_fn(*(t.double().transpose(1, 2) for t in (q_full, k_full, v_full)),
                                           is_causal=args.causal, enable_gqa=hk != args.heads,
                                           backend="_native_math", layout="BHSD").transpose(1, 2)
    ref_mine = cp.shard(ref)
    err = torch.tensor([(out.double().cpu() - ref_mine).abs().max().item() / ref.abs().max().item()
                        if out.numel() else 0.0], device=device)
    dist.all_reduce(err, op=dist.ReduceOp.MAX)
    tolerance = args.tolerance or (1e-5 if dtype == torch.float32 else 2e-2)
    if rank == 0:
        print(f"context parallel {cp.mode} (ulysses {cp.ulysses_degree} x ring {cp.ring_degree}, "
              f"{args.ring_method}) backend {args.backend}: B={args.batch} S={args.seq} H={args.heads} Hk={hk} "
              f"D={args.head_dim} {args.dtype} on {world} x {device.type}: max rel err {err.item():.2e} "
              f"(tolerance {tolerance:g}), {per_call * 1e3:.2f} ms/call", flush=True)
    # Every rank leaves together (NCCL's teardown is collective). The group is freed when `cp` goes, before
    # interpreter exit: nothing else pins it (see dispatcher/parallel/__init__.py on torch.distributed.nn).
    dist.barrier()
    dist.destroy_process_group()
    return 0 if err.item() <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
