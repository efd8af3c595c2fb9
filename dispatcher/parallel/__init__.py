"""Context parallelism: one attention call over the sequence shards of several ranks (torch.distributed).

Modes (diffusers' ``ContextParallelConfig``): Ulysses (``ulysses_degree``: an all-to-all trades a
sequence shard for a share of the heads; any backend), ring (``ring_degree``: key/value blocks go
around the ranks, partial outputs merge by their log-sum-exp; backends with ``lse=True``) and both
(``ring_degree x ulysses_degree`` ranks, Ulysses inside each ring position). `supported_modes(name)`
says which a backend can run; ``get_backend_spec(name).constraints()["context_parallel"]`` too.

Launch one process per GPU (or CPU rank) with torchrun; every rank runs the same script::

    # torchrun --nproc-per-node 4 my_script.py
    import torch, torch.distributed as dist
    from dispatcher import dispatch_attention_fn
    from dispatcher.parallel import ContextParallelConfig, context_parallel

    dist.init_process_group("nccl")                      # "gloo" on CPUs; torchrun sets the env
    torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    cp = ContextParallelConfig(ulysses_degree=2, ring_degree=2).setup()   # 2 x 2 = 4 ranks
    q, k, v = (cp.shard(t, dim=1) for t in (q_full, k_full, v_full))     # (B, S_local, H, D) each
    with context_parallel(cp):                          # every dispatcher call inside is context-parallel
        out = dispatch_attention_fn(q, k, v, backend="_native_cudnn")   # this rank's (B, S_local, H, D)
    full = cp.gather(out, dim=1)                        # if every rank needs the whole output

Or call `context_parallel_attention(AttentionCall(q, k, v, ...), config=cp)` directly.

When every rank holds the *whole* q/k/v (ComfyUI under torchrun), `replicated_parallel(
ReplicatedConfig(mode="heads" | "sequence"))` splits the attention work itself (see `replicated`). ``python -m
dispatcher.parallel.example`` under torchrun runs a self-check against single-process attention.
"""

import torch.distributed

# torch.distributed.nn binds `group=group.WORLD` as its functions' defaults when first imported. torch._dynamo
# imports it, and `context_parallel` first imports torch._dynamo (torch.compiler.disable) after
# init_process_group: those defaults would then pin the default group, destroy_process_group could not free
# it, and its gloo worker threads would outlive the interpreter; one dropping a finished collective's tensors
# during interpreter finalization aborts the rank (std::terminate). So import it here, before any group exists.
if torch.distributed.is_available():
    import torch.distributed.nn  # noqa: F401

from .attention import (active_config, backends_for, check_backend, context_parallel, context_parallel_attention,
                        head_plan, supported_modes)
from .config import MODES, RING_METHODS, ContextParallelConfig, ContextParallelError, split_sizes
from .replicated import (REPLICATED_MODES, ReplicatedConfig, active_replicated_config, replicated_attention,
                         replicated_parallel)

__all__ = [
    "MODES", "REPLICATED_MODES", "RING_METHODS", "ContextParallelConfig", "ContextParallelError", "ReplicatedConfig",
    "active_config", "active_replicated_config", "backends_for", "check_backend", "context_parallel",
    "context_parallel_attention", "head_plan", "replicated_attention", "replicated_parallel", "split_sizes",
    "supported_modes",
]
