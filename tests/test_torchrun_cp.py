"""Context parallelism launched by real torchrun (gloo ranks on this machine), without ComfyUI.

- dispatcher.parallel.example under `torchrun --nproc-per-node 2` and under two node groups (two torchrun
  invocations with --nnodes 2, static rendezvous on 127.0.0.1): exact against single-process attention.
- nodes/cp_runtime.py (what ComfyUI's ranks run when the pack loads) under the same two launches, with
  stand-ins for the few ComfyUI objects it touches (PromptServer's queue, model_management's interrupt flag,
  folder_paths, cli args): prompts reach every rank in rank 0's order, a Cancel on rank 0 stops every rank
  at the same check, a rank that ends a prompt early stops the others at their next check, the queue goes on,
  and a rank killed at the end stops every other rank within seconds, naming it.

This file is also the driver the ranks run (`python tests/test_torchrun_cp.py --driver OUT`).
"""

from __future__ import annotations

import heapq
import json
import os
import socket
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]

# Each prompt: how many interrupt checks it makes (one per "step", each followed by an attention collective),
# when rank 0 gets a Cancel, which rank fails alone (right after the collective of step `fail_after`).
PROMPTS = [
    {"steps": 4},
    {"steps": 8, "cancel_before": 3},
    {"steps": 4},
    {"steps": 8, "fail_rank": "last", "fail_after": 2},
    {"steps": 3},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), ATTN_DISPATCH_CP_TIMEOUT="30", OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def _launch(per_node: int, nodes: int, tail: list[str], timeout: float = 240,
            monitor: float = 0.5) -> list[subprocess.CompletedProcess]:
    """`nodes` torchrun invocations of `per_node` ranks each; returns their completed processes (node 0 first).
    monitor: how often torchrun's agent looks at its ranks (it stops a node's other ranks when one dies)."""
    torchrun = TORCHRUN + ["--monitor-interval", str(monitor)]
    if nodes == 1:
        common = ["--nproc-per-node", str(per_node), "--master-addr", "127.0.0.1", "--master-port", str(_free_port())]
        groups = [torchrun + common + tail]
    else:
        rdzv = f"127.0.0.1:{_free_port()}"
        groups = [torchrun + ["--nnodes", str(nodes), "--node-rank", str(r), "--nproc-per-node", str(per_node),
                              "--rdzv-endpoint", rdzv] + tail for r in range(nodes)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for cmd in groups]
    done = []
    deadline = time.time() + timeout
    for cmd, proc in zip(groups, procs):
        try:
            out, _ = proc.communicate(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            out, _ = proc.communicate()
            raise AssertionError(f"{' '.join(cmd)} did not end in {timeout}s:\n{out[-4000:]}")
        done.append(subprocess.CompletedProcess(cmd, proc.returncode, out))
    return done


# --- the example: exact context-parallel attention under torchrun --------------------------------------

import pytest  # noqa: E402


@pytest.mark.parametrize("per_node,nodes,degrees", [(2, 1, ["--ring", "2"]), (2, 2, ["--ulysses", "2", "--ring", "2"])],
                         ids=["one_node_2_ranks", "two_node_groups_4_ranks"])
def test_example_under_torchrun_matches_one_process(per_node, nodes, degrees):
    runs = _launch(per_node, nodes, ["-m", "dispatcher.parallel.example", "--seq", "77", "--heads", "4",
                                     "--head-dim", "16", "--causal", "--repeat", "1", *degrees])
    for run in runs:
        assert run.returncode == 0, run.stdout[-4000:]
    line = [s for s in runs[0].stdout.splitlines() if "max rel err" in s]
    assert line and f"on {per_node * nodes} x cpu" in line[0], runs[0].stdout[-3000:]


# --- the ComfyUI runtime under torchrun ------------------------------------------------------------------

def _runtime(per_node: int, nodes: int, tmp_path) -> tuple[list[dict], list[subprocess.CompletedProcess], float]:
    start = time.time()
    # torchrun's agent stops a node's other ranks when one dies; looking every 3 s, it leaves rank 0's own
    # watcher (which sees the dead peer at once) the time to say which rank is gone: that is what is tested.
    runs = _launch(per_node, nodes, [str(Path(__file__)), "--driver", str(tmp_path)], monitor=3)
    world = per_node * nodes
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)
               if (tmp_path / f"rank{r}.json").exists()]
    assert len(results) == world, "\n".join(r.stdout[-3000:] for r in runs)
    return results, runs, time.time() - start


@pytest.mark.parametrize("per_node,nodes", [(2, 1), (2, 2)], ids=["one_node_2_ranks", "two_node_groups_4_ranks"])
def test_runtime_keeps_ranks_in_step_relays_cancel_and_stops_on_a_dead_rank(per_node, nodes, tmp_path):
    results, runs, took = _runtime(per_node, nodes, tmp_path)
    world = per_node * nodes
    last = world - 1
    for rank, found in enumerate(results):
        assert found["rank"] == rank and found["world"] == world
        assert found["headless"] == (rank > 0)  # ranks > 0 bind no port and write to a folder of their own
        assert [p["prompt"] for p in found["prompts"]] == [f"p{i}" for i in range(len(PROMPTS))]  # rank 0's order
        outcomes = [(p["outcome"], p["checks"]) for p in found["prompts"]]
        assert outcomes[0] == ("done", 4) and outcomes[2] == ("done", 4) and outcomes[4] == ("done", 3)
        assert outcomes[1] == ("interrupted", 3)  # every rank, at rank 0's third check
        if rank == last:
            assert outcomes[3] == ("failed alone", 2)
        else:  # stopped at the first check after the failing rank gave up, naming it
            assert outcomes[3][1] == 3 and f"rank(s) [{last}] ended this prompt early" in outcomes[3][0]
    # The last rank then kills itself: every other rank stops at once (not after the 30 s timeout), naming it.
    everything = "\n".join(r.stdout for r in runs)
    assert all(r.returncode != 0 for r in runs), everything[-4000:]
    assert f"context-parallel rank {last} is gone" in runs[0].stdout, runs[0].stdout[-4000:]
    assert took < 90, took


def _driver(out_dir: str) -> None:
    """One rank: stand-ins for ComfyUI's modules, the real cp_runtime, a prompt worker loop."""
    import asyncio
    import importlib
    import signal

    rank = int(os.environ["RANK"])
    record: dict = {"rank": rank, "headless": False, "prompts": []}

    class Queue:  # ComfyUI's PromptQueue, the parts the prompt worker and cp_runtime use
        def __init__(self):
            self.mutex = threading.RLock()
            self.not_empty = threading.Condition(self.mutex)
            self.queue, self.flags, self.running, self.counter = [], {}, {}, 0

        def put(self, item):
            with self.mutex:
                heapq.heappush(self.queue, item)
                self.not_empty.notify()

        def get(self, timeout=None):
            with self.not_empty:
                while not self.queue:
                    self.not_empty.wait(timeout=timeout)
                    if timeout is not None and not self.queue:
                        return None
                item = heapq.heappop(self.queue)
                self.counter += 1
                self.running[self.counter] = item
                return item, self.counter

        def task_done(self, item_id, history_result, status):
            self.running.pop(item_id)

        def get_flags(self, reset=True):
            with self.mutex:
                flags, self.flags = self.flags, ({} if reset else self.flags)
                return flags

        def set_flag(self, name, value):
            with self.mutex:
                self.flags[name] = value
                self.not_empty.notify()

    class Interrupted(Exception):
        pass

    mm = types.ModuleType("comfy.model_management")
    mm.InterruptProcessingException = Interrupted
    mm.interrupt_processing_mutex = threading.RLock()
    mm.interrupt_processing = False

    def interrupt_current_processing(value=True):
        with mm.interrupt_processing_mutex:
            mm.interrupt_processing = value

    def throw_exception_if_processing_interrupted():
        with mm.interrupt_processing_mutex:
            if mm.interrupt_processing:
                mm.interrupt_processing = False
                raise Interrupted()

    mm.interrupt_current_processing = interrupt_current_processing
    mm.throw_exception_if_processing_interrupted = throw_exception_if_processing_interrupted
    comfy = types.ModuleType("comfy")
    cli_args = types.ModuleType("comfy.cli_args")
    cli_args.args = types.SimpleNamespace(cpu=True, auto_launch=False, database_url="sqlite:///user.db")
    comfy.model_management, comfy.cli_args = mm, cli_args
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.set_output_directory = lambda path: record.__setitem__("output", path)
    folder_paths.set_temp_directory = lambda path: record.__setitem__("temp", path)
    server = types.ModuleType("server")

    class PromptServer:
        instance = None

        async def start_multi_address(self, addresses, call_on_start=None, verbose=True):
            raise AssertionError("bound a port")

    PromptServer.instance = PromptServer()
    PromptServer.instance.prompt_queue = Queue()
    server.PromptServer = PromptServer
    sys.modules.update({"comfy": comfy, "comfy.model_management": mm, "comfy.cli_args": cli_args,
                        "folder_paths": folder_paths, "server": server})

    from helpers.pack import PACK, load_pack
    load_pack()  # cp_runtime logs through the pack's dispatcher (one logger, one prefix)
    cp_runtime = importlib.import_module(f"{PACK}.nodes.cp_runtime")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    assert cp_runtime.setup_from_env() is True
    world = dist.get_world_size()
    record["world"] = world
    if rank > 0:
        asyncio.run(PromptServer.instance.start_multi_address([("127.0.0.1", 8188)]))  # binds nothing
        workdir = os.path.dirname(record.get("output", ""))
        record["headless"] = "comfyui-cp-rank" in workdir and record["temp"].startswith(workdir) and \
            cli_args.args.database_url.startswith(f"sqlite:///{workdir}")

    queue = PromptServer.instance.prompt_queue
    if rank == 0:
        for i, prompt in enumerate(PROMPTS):
            queue.put((i, f"p{i}", prompt, {}, []))
    attention = torch.zeros(1)
    for _ in PROMPTS:  # the prompt worker
        got = queue.get(timeout=1000.0)
        while got is None:
            got = queue.get(timeout=1000.0)
        (_, name, prompt, _, _), item_id = got
        fail_rank = world - 1 if prompt.get("fail_rank") == "last" else None
        checks, outcome = 0, "done"
        try:
            for step in range(1, prompt["steps"] + 1):
                if rank == 0 and step == prompt.get("cancel_before"):
                    mm.interrupt_current_processing(True)  # what /interrupt does on rank 0
                checks += 1
                mm.throw_exception_if_processing_interrupted()  # what ComfyUI calls at each step
                dist.all_reduce(attention)  # an attention collective of the step
                if rank == fail_rank and step == prompt["fail_after"]:
                    raise OSError("disk full")  # e.g. a save only this rank could not do
        except Interrupted:
            outcome = "interrupted"
        except OSError:
            outcome = "failed alone"
        except RuntimeError as exc:
            outcome = str(exc)
        queue.task_done(item_id, {}, None)
        record["prompts"].append({"prompt": name, "outcome": outcome, "checks": checks})
        queue.get_flags()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(record, handle)
    dist.barrier()
    if rank == world - 1:
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # the watchers end this process long before
    sys.exit(0)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--driver"]:
        _driver(sys.argv[2])
