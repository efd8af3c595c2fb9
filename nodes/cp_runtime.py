"""The ComfyUI side of context parallelism: ComfyUI started by torchrun, every rank in lockstep with rank 0.

    torchrun --nproc-per-node 2 main.py --listen 127.0.0.1 --port 8188        # from the ComfyUI folder

torchrun starts one whole ComfyUI per rank and sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT. When ComfyUI loads the pack, `setup_from_env()` (every rank, once) sees that environment and:

- joins the default process group (env://; NCCL on GPUs, each rank on GPU LOCAL_RANK; gloo with --cpu or
  without CUDA) and three gloo groups: "control" (prompts, long timeout: workers wait there between
  prompts), "sync" (interrupt checks and prompt ends) and "health" (dead-rank detection);
- rank 0 serves HTTP as usual. Its PromptQueue's `get` broadcasts each prompt the moment its prompt
  worker takes it (a prompt deleted before it runs never reaches the others), `get_flags` the /free
  flags it hands out (they clear the executor's cache: the caches must stay alike);
- ranks > 0 serve nothing (their server's `start_multi_address` binds no port, so every rank can get
  the same --port), write outputs and temp files to a folder of their own (removed at exit) and a
  database of their own there; their PromptQueue's `get` waits for rank 0's next broadcast;
- every rank's `comfy.model_management.throw_exception_if_processing_interrupted` (ComfyUI checks it
  before each node and at each sampler step) becomes one tiny all-gather of (interrupted?, prompt
  ended?) during a prompt. A Cancel on rank 0 is so seen by every rank at the same check, where every
  rank raises ComfyUI's InterruptProcessingException. A rank whose prompt ends early (an error only it
  hit, outside an attention call) makes the others stop the prompt at their next check. The queue's
  `task_done` waits there until every rank has ended the prompt;
- a rank that dies (its gloo connections close) stops the others at once, with a message naming it:
  rank 0 watches every rank, every rank watches rank 0 (torchrun then stops the rest of its node).

Nothing here imports ComfyUI or torch.distributed at import time.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
import threading
from datetime import timedelta

from ..dispatcher import log

ENV_TIMEOUT = "ATTN_DISPATCH_CP_TIMEOUT"   # seconds a collective between ranks may wait (600)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
CONTROL_TIMEOUT = timedelta(days=365)      # workers wait this long for the next prompt
LAUNCH_HINT = ("torchrun --nproc-per-node {n} main.py <your usual main.py arguments>   "
               "(from the ComfyUI folder; add --cpu for CPU ranks over gloo)")

_lock = threading.Lock()
_state: dict = {"ready": False, "error": None, "control": None, "sync": None, "health": None, "rank": 0,
                "world": 1, "prompt_thread": None, "checks": 0, "workdir": None}


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's environment, or None when it is not there."""
    if not all(os.environ.get(name) for name in TORCHRUN_ENV):
        return None
    try:
        rank, world, local = (int(os.environ[name]) for name in TORCHRUN_ENV)
    except ValueError:
        return None
    return rank, world, local


def launched() -> bool:
    """Started by torchrun (or another launcher setting its variables) with more than one rank."""
    env = torchrun_env()
    return env is not None and env[1] > 1


def distributed() -> tuple[bool, int, int]:
    """(torch.distributed initialized, world size, rank)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_world_size(), dist.get_rank()
    return False, 1, 0


def launch_command(nproc: int = 2) -> str:
    """The command that starts this ComfyUI context-parallel, as run from the ComfyUI folder."""
    return LAUNCH_HINT.format(n=nproc)


def validation_message(mode: str, degree: int) -> bool | str:
    """Queue-time check of Context Parallel Attention: True, or what is wrong and how to launch."""
    if mode == "off":
        return True
    up, world, _ = distributed()
    if not up or world == 1:
        why = (_state["error"] or "torch.distributed is not initialized in this ComfyUI") if not up else \
            "this launch has a single rank"
        return (f"Context Parallel Attention (mode '{mode}') needs one ComfyUI process per GPU, started by torchrun: "
                f"{launch_command()}. Here: {why}. Set mode to 'off' to run without it.")
    if degree and (degree > world or world % degree):
        return f"degree {degree} must be 0 (all {world} ranks) or a divisor of the world size {world}"
    return True


def setup_from_env() -> bool:
    """Join the torchrun launch and put this ComfyUI in lockstep with rank 0 (once; no-op without torchrun)."""
    if not launched():
        return False
    with _lock:
        if _state["ready"]:
            return True
        try:
            _init()
        except Exception as exc:  # noqa: BLE001 - a rank that cannot join must not run on alone
            rank = os.environ.get("RANK", "?")
            _state["error"] = f"joining the context-parallel launch failed on rank {rank}: {type(exc).__name__}: {exc}"
            _fatal(f"{_state['error']}. The other ranks cannot go on without this one; fix the cause and "
                   "start the launch again.")
        _state["ready"] = True
    return True


def _fatal(message: str) -> None:
    log.logger.critical("%s", message)
    print(f"{log.PREFIX} {message}", file=sys.stderr, flush=True)  # the process exits next: said even without logging
    sys.stdout.flush()
    os._exit(1)


def _init() -> None:
    import torch
    import torch.distributed as dist
    from comfy.cli_args import args  # ComfyUI's parsed arguments (the same on every rank)

    rank, world, local = torchrun_env()
    timeout = timedelta(seconds=float(os.environ.get(ENV_TIMEOUT, "600")))
    cuda = not args.cpu and torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if cuda:
        count = torch.cuda.device_count()
        if local >= count:
            raise RuntimeError(f"local rank {local} needs GPU {local}, but {count} GPU(s) are visible here; start "
                               f"at most {count} ranks per machine (--nproc-per-node), give every rank its GPU "
                               "(no --cuda-device; CUDA_VISIBLE_DEVICES lists them all), or pass --cpu (gloo)")
        torch.cuda.set_device(local)  # ComfyUI's device is torch.cuda.current_device()
    elif os.environ.get("MASTER_ADDR", "127.0.0.1") in ("127.0.0.1", "localhost") and \
            os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # one machine: gloo's pairs on 127.0.0.1 only
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    _state.update(rank=dist.get_rank(), world=dist.get_world_size(),
                  control=dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT),
                  sync=dist.new_group(backend="gloo", timeout=timeout),
                  health=dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT))
    from server import PromptServer  # ComfyUI's; the server object exists before custom nodes load
    server = PromptServer.instance
    queue = server.prompt_queue
    if rank == 0:
        _lead(queue)
    else:
        _headless(server, args, rank)
        _follow(queue)
    _lockstep(queue)
    _relay_interrupts()
    _watch()
    where = "serves HTTP" if rank == 0 else "headless, follows rank 0's prompts"
    log.logger.info("context-parallel rank %d of %d ready (%s, pid %d, %s on %s)", rank, world,
                backend, os.getpid(), where, f"cuda:{local}" if cuda else "cpu")


# --- ranks > 0: no HTTP server, private outputs ----------------------------------------------------

def _headless(server, args, rank: int) -> None:
    import folder_paths
    workdir = tempfile.mkdtemp(prefix=f"comfyui-cp-rank{rank}-")
    _state["workdir"] = workdir
    atexit.register(shutil.rmtree, workdir, True)
    folder_paths.set_output_directory(os.path.join(workdir, "output"))  # SaveImage & co. must not race rank 0's
    folder_paths.set_temp_directory(os.path.join(workdir, "temp"))      # ComfyUI empties its temp folder at exit
    if hasattr(args, "database_url"):
        args.database_url = f"sqlite:///{os.path.join(workdir, 'comfyui.db')}"  # the user database stays rank 0's
    args.auto_launch = False

    async def no_server(addresses, call_on_start=None, verbose=True):  # noqa: ARG001 - ComfyUI's signature
        log.logger.info("rank %d serves no HTTP (rank 0 does); outputs in %s", rank, workdir)

    server.start_multi_address = no_server  # main.py's run() still runs publish_loop (no clients: drained)


# --- prompts: rank 0 leads, the others follow -------------------------------------------------------

def _send(message) -> None:
    import torch.distributed as dist
    try:
        dist.broadcast_object_list([message], src=0, group=_state["control"])
    except Exception as exc:  # noqa: BLE001
        _fatal(f"rank 0 could not hand a prompt to the other ranks ({type(exc).__name__}: {exc}); a rank is gone, "
               "so the launch stops. Start it again.")


def _receive():
    import torch.distributed as dist
    box = [None]
    try:
        dist.broadcast_object_list(box, src=0, group=_state["control"])
    except Exception as exc:  # noqa: BLE001
        _fatal(f"rank {_state['rank']} lost rank 0 while waiting for its next prompt ({type(exc).__name__}: "
               f"{exc}); stopping. Start the launch again.")
    return box[0]


def _started() -> None:
    _state["prompt_thread"], _state["checks"] = threading.get_ident(), 0


def _lead(queue) -> None:
    """Rank 0: every prompt its prompt worker takes, and every flag set it reads, go to the workers first."""
    get, get_flags = queue.get, queue.get_flags

    def lead_get(timeout=None):
        got = get(timeout=timeout)
        if got is not None:
            _send(("prompt", got[0]))
            _started()
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
            got = get(timeout=0)
            _started()
            return got
        if kind == "flags":
            for name, value in payload.items():
                queue.set_flag(name, value)
            return None
        raise RuntimeError(f"unknown context-parallel control message {kind!r}")

    queue.get = follow_get


# --- one decision at every interrupt check; prompts end together --------------------------------------

def _exchange(interrupted: bool, ended: bool) -> list[tuple[int, int]]:
    """Every rank's (interrupted, ended), by one all-gather on the sync group."""
    import torch
    import torch.distributed as dist
    mine = torch.tensor([int(interrupted), int(ended)], dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(_state["world"])]
    dist.all_gather(every, mine, group=_state["sync"])
    return [tuple(t.tolist()) for t in every]


def _in_prompt() -> bool:
    return _state["prompt_thread"] == threading.get_ident()


def _relay_interrupts() -> None:
    import comfy.model_management as mm
    local_check = mm.throw_exception_if_processing_interrupted

    def check():
        if not _in_prompt():  # another thread, or outside a prompt: no collective
            return local_check()
        with mm.interrupt_processing_mutex:
            interrupted = bool(mm.interrupt_processing)
        states = _exchange(interrupted, False)
        _state["checks"] += 1
        ended = [r for r, (_, e) in enumerate(states) if e]
        if ended:
            raise RuntimeError(
                f"context-parallel rank(s) {ended} ended this prompt early (an error there: see that rank's log); "
                f"rank {_state['rank']} stops it at the same point (check {_state['checks']})")
        asked = [r for r, (i, _) in enumerate(states) if i]
        if asked:
            mm.interrupt_current_processing(False)
            log.logger.info("rank %d interrupted at check %d (Cancel on rank(s) %s)", _state["rank"],
                        _state["checks"], asked)
            raise mm.InterruptProcessingException()

    mm.throw_exception_if_processing_interrupted = check


def _lockstep(queue) -> None:
    """`task_done` (the prompt worker, after each prompt) returns once every rank has ended the prompt."""
    task_done = queue.task_done

    def finish(*args, **kwargs):
        if _in_prompt():
            _state["prompt_thread"] = None
            while not all(e for _, e in _exchange(False, True)):
                pass  # one round per check the slower ranks still make; they stop at it
        return task_done(*args, **kwargs)

    queue.task_done = finish


# --- a dead rank stops every rank -------------------------------------------------------------------

def _watch() -> None:
    """Rank 0 waits on a receive from every rank, every rank on one from rank 0, on the health group.
    Nothing is ever sent: the receive only ends when the peer's process is gone (gloo closes its pair)."""
    me = _state["rank"]
    for peer in (range(1, _state["world"]) if me == 0 else [0]):
        threading.Thread(target=_watch_peer, args=(peer,), name=f"attention_dispatch-cp-watch-{peer}",
                         daemon=True).start()


def _watch_peer(peer: int) -> None:
    import torch
    import torch.distributed as dist
    try:
        dist.recv(torch.zeros(1), src=peer, group=_state["health"])
        why = "it sent an unexpected message"
    except Exception as exc:  # noqa: BLE001
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
    _fatal(f"context-parallel rank {peer} is gone ({why}); stopping rank {_state['rank']} too: every rank runs "
           "every prompt, so the launch cannot go on without it. Start it again (torchrun --max-restarts N "
           "restarts it by itself).")
