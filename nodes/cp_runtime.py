"""The ComfyUI side of a context-parallel launch (cp_launch.py): process group, and prompts in lockstep.

Under the launcher every rank is a whole ComfyUI with the same arguments: rank 0 serves HTTP as usual;
ranks > 0 are headless workers (cp_launch.py starts ComfyUI's own `main.start_comfyui()` without the
server). Every attention call that Context Parallel Attention splits is a collective, so every rank
must execute the same prompts in the same order. `setup_from_env()` (run once when ComfyUI loads the
pack, on every rank) makes that so, with ComfyUI's own prompt worker and executor on every rank:

- it joins the default process group (env:// from the launcher; NCCL on GPUs, gloo on CPUs) and a
  gloo "control" group with a long timeout (workers wait there between prompts);
- rank 0: its PromptQueue's `get` broadcasts each prompt the moment its prompt worker takes it (so a
  prompt deleted from the queue before it runs never reaches the workers), and `get_flags` broadcasts
  the /free flags it hands out (they clear the executor's cache: the caches must stay alike);
- ranks > 0: their PromptQueue's `get` waits for the next broadcast and hands the prompt (renumbered,
  so the heap keeps the broadcast order) or the flags to their own prompt worker.

Every prompt runs on every rank (ones without the node too: it cannot know in advance which nodes
run). Workers write their outputs to a temporary folder of their own (the launcher sets it).
Nothing here imports ComfyUI at import time.
"""

from __future__ import annotations

import logging
import os
import threading
from datetime import timedelta
from pathlib import Path

logger = logging.getLogger("attention_dispatch")

ENV_LAUNCH = "ATTN_DISPATCH_CP"            # "1": started by cp_launch.py
ENV_BACKEND = "ATTN_DISPATCH_CP_BACKEND"   # nccl | gloo
ENV_TIMEOUT = "ATTN_DISPATCH_CP_TIMEOUT"   # seconds a collective of the attention group may wait (600)
CONTROL_TIMEOUT = timedelta(days=365)      # workers wait this long for the next prompt
_HERE = Path(__file__).resolve().parent
# The pack root's cp_launch.py (what users run); a copy of the pack without it still has this one.
LAUNCHER = _HERE.parent / "cp_launch.py" if (_HERE.parent / "cp_launch.py").exists() else _HERE / "cp_launch.py"

_lock = threading.Lock()
_state: dict = {"ready": False, "control": None, "error": None}


def launched() -> bool:
    return os.environ.get(ENV_LAUNCH) == "1"


def distributed() -> tuple[bool, int, int]:
    """(torch.distributed initialized, world size, rank)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_world_size(), dist.get_rank()
    return False, 1, 0


def launch_command(nproc: int = 2) -> str:
    """The command that starts this ComfyUI context-parallel, as run from the ComfyUI folder."""
    try:
        launcher = os.path.relpath(LAUNCHER, os.getcwd())
    except ValueError:  # another drive on Windows
        launcher = str(LAUNCHER)
    return f"python {launcher} --nproc {nproc} -- <your usual main.py arguments>"


def validation_message(mode: str, degree: int) -> bool | str:
    """Queue-time check of Context Parallel Attention: True, or what is wrong and how to launch."""
    if mode == "off":
        return True
    up, world, _ = distributed()
    if not up or world == 1:
        why = (_state["error"] or "torch.distributed is not initialized in this ComfyUI") if not up else \
            "this launch has a single rank"
        return (f"Context Parallel Attention (mode '{mode}') needs one ComfyUI process per GPU, started by the "
                f"context-parallel launcher: from the ComfyUI folder run `{launch_command()}` (one rank per "
                f"GPU; add --backend gloo with --cpu for CPU ranks). Here: {why}. Set mode to 'off' to run "
                "without it.")
    if degree and (degree > world or world % degree):
        return f"degree {degree} must be 0 (all {world} ranks) or a divisor of the world size {world}"
    return True


def setup_from_env() -> bool:
    """Join the launch's process groups and put the prompt queue in lockstep (once; no-op when not launched)."""
    if not launched():
        return False
    with _lock:
        if _state["ready"]:
            return True
        try:
            _init()
        except Exception as exc:  # noqa: BLE001 - ComfyUI keeps loading; the node explains at queue time
            _state["error"] = f"joining the context-parallel launch failed: {type(exc).__name__}: {exc}"
            logger.error("attention_dispatch: %s", _state["error"])
            return False
        _state["ready"] = True
    return True


def _init() -> None:
    import torch.distributed as dist
    backend = os.environ.get(ENV_BACKEND, "gloo")
    timeout = timedelta(seconds=float(os.environ.get(ENV_TIMEOUT, "600")))
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    _state["control"] = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    rank, world = dist.get_rank(), dist.get_world_size()
    logger.info("attention_dispatch: context-parallel rank %d of %d (%s)", rank, world, backend)
    from server import PromptServer  # ComfyUI's; the server object exists before custom nodes load
    queue = PromptServer.instance.prompt_queue
    if rank == 0:
        _lead(queue)
    else:
        _follow(queue)


def _send(message) -> None:
    import torch.distributed as dist
    dist.broadcast_object_list([message], src=0, group=_state["control"])


def _receive():
    import torch.distributed as dist
    box = [None]
    dist.broadcast_object_list(box, src=0, group=_state["control"])
    return box[0]


def _lead(queue) -> None:
    """Rank 0: every prompt its prompt worker takes, and every flag set it reads, go to the workers first."""
    get, get_flags = queue.get, queue.get_flags

    def lead_get(timeout=None):
        got = get(timeout=timeout)
        if got is not None:
            _send(("prompt", got[0]))
        return got

    def lead_get_flags(reset=True):
        flags = get_flags(reset=reset)
        if flags and reset:
            _send(("flags", dict(flags)))
        return flags

    queue.get, queue.get_flags = lead_get, lead_get_flags


def _follow(queue) -> None:
    """Ranks > 0: the prompt worker's `get` returns rank 0's prompts and flags, in rank 0's order."""
    get, put = queue.get, queue.put
    counter = iter(range(1, 1 << 62))

    def follow_get(timeout=None):  # the prompt worker's timeout only paces its garbage collection
        kind, payload = _receive()
        if kind == "prompt":
            put((next(counter),) + tuple(payload[1:]))
            return get(timeout=0)
        if kind == "flags":
            for name, value in payload.items():
                queue.set_flag(name, value)
            return None
        raise RuntimeError(f"unknown context-parallel control message {kind!r}")

    queue.get = follow_get
