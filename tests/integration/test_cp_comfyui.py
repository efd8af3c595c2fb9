"""Context Parallel Attention in real ComfyUIs (CPU, gloo), started by torchrun as a user would, against the
single-process ComfyUI of the session fixture.

- `cp_comfy`: one node group, `torchrun --nproc-per-node 2 main.py ...` (2 ranks). Rank 0 serves HTTP; rank 1
  serves nothing and executes each prompt with it.
- `cp_nodes`: two node groups on this machine, two `torchrun --nnodes 2 --node-rank R --nproc-per-node 2
  --rdzv-endpoint 127.0.0.1:PORT main.py ...` (4 ranks, static rendezvous), every ComfyUI on the same --port.

Both use ComfyUI's interpreter's torchrun (`python -m torch.distributed.run`, the module behind `torchrun`).
ATTN_DISPATCH_CP_TIMEOUT is 60 s here, so a rank left waiting would fail a test, not hang it for 10 minutes.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import COMFYUI_PATH, COMFYUI_PYTHON, main_py, require_comfyui, serve_comfyui
from .test_comfyui import latent

pytestmark = pytest.mark.integration
_prefix = itertools.count()
TORCHRUN = [COMFYUI_PYTHON, "-m", "torch.distributed.run", "--monitor-interval", "0.5"]


def cp_prompt(mode: str | None, *, backend: str | None = "native", seed: int = 7, steps: int = 2, size: int = 64):
    """UNETLoader -> [Set Attention Backend] -> [Context Parallel Attention] -> KSampler -> SaveLatent."""
    cond = lambda s: {"class_type": "TestRandomConditioning",  # noqa: E731
                      "inputs": {"seed": s, "length": 8, "dim": 4096, "pooled_dim": 768}}
    p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan21.safetensors", "weight_dtype": "default"}},
         "2": cond(1), "3": cond(2),
         "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": size, "height": size, "length": 1,
                                                                    "batch_size": 1}}}
    model = ["1", 0]
    if backend is not None:
        p["5"] = {"class_type": "SetAttentionBackend", "inputs": {"model": model, "backend": backend,
                                                                   "policy": "fallback", "start_percent": 0.0,
                                                                   "end_percent": 1.0}}
        model = ["5", 0]
    if mode is not None:
        p["6"] = {"class_type": "ContextParallelAttention", "inputs": {"model": model, "mode": mode, "degree": 0}}
        model = ["6", 0]
    p["7"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": steps, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
    p["8"] = {"class_type": "SaveLatent", "inputs": {"samples": ["7", 0],
                                                     "filename_prefix": f"latents/cp{next(_prefix)}"}}
    return p


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return dict(os.environ, ATTN_DISPATCH_CP_TIMEOUT="60")


def _ready(world: int, other: dict | None = None):
    """Rank 0 answers HTTP and every rank logged that it joined (node group 1's ranks in its own log)."""
    def ready(server):
        log = server.tail(10 ** 7)
        if other and other.get("log") and other["log"].exists():
            log += other["log"].read_text(errors="replace")
        return server.get("/object_info/ContextParallelAttention") is not None and \
            all(f"rank {r} of {world} ready" in log for r in range(world))
    return ready


@pytest.fixture(scope="module")
def cp_comfy():
    """One node group of 2 ranks: torchrun --nproc-per-node 2 main.py --cpu ... (every rank the same --port)."""
    require_comfyui()

    def launch(base, port):
        return TORCHRUN + ["--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port",
                           str(_free_port())] + main_py(base, port)[1:]

    os.environ["ATTN_DISPATCH_CP_TIMEOUT"] = "60"  # inherited by torchrun's ranks (serve_comfyui's Popen)
    try:
        with serve_comfyui("attn-dispatch-cp-", launch, _ready(2), start_timeout=240, stop_timeout=40) as server:
            yield server
    finally:
        os.environ.pop("ATTN_DISPATCH_CP_TIMEOUT", None)


@pytest.fixture(scope="module")
def cp_nodes():
    """Two node groups of 2 ranks each on this machine (static rendezvous on 127.0.0.1): 4 gloo ranks."""
    require_comfyui()
    rdzv = f"127.0.0.1:{_free_port()}"
    other: dict = {}

    def group(node_rank, base, port):
        return TORCHRUN + ["--nnodes", "2", "--node-rank", str(node_rank), "--nproc-per-node", "2",
                           "--rdzv-endpoint", rdzv] + main_py(base, port)[1:]

    def launch(base, port):  # node group 1 first (it waits for group 0's rendezvous), its log beside rank 0's
        other["log"] = base / "node1.log"
        with open(other["log"], "wb") as log:
            other["proc"] = subprocess.Popen(group(1, base, port), cwd=COMFYUI_PATH, env=_env(), stdout=log,
                                             stderr=subprocess.STDOUT)
        return group(0, base, port)

    os.environ["ATTN_DISPATCH_CP_TIMEOUT"] = "60"
    try:
        with serve_comfyui("attn-dispatch-cp2-", launch, _ready(4, other), start_timeout=300, stop_timeout=40) as server:
            server.other = other
            yield server
    finally:
        os.environ.pop("ATTN_DISPATCH_CP_TIMEOUT", None)
        proc = other.get("proc")
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _report(server, entry):
    found = [r for r in server.reports(entry["prompt_id"]) if r["kind"] == "context_parallel"]
    assert found, server.get("/attention_dispatch/report")
    return found[-1]


def _relative_error(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _single(comfy, backend="native", **kw):
    return latent(comfy, comfy.run(cp_prompt(None, backend=backend, **kw)), "8")


def test_single_process_comfyui_refuses_the_node_with_the_launch_command(comfy):
    status, body = comfy.post_prompt(cp_prompt("heads"))
    assert status == 400, body
    errors = [e for node in body["node_errors"].values() for e in node["errors"]]
    text = " ".join(e.get("details", "") + e.get("message", "") for e in errors)
    assert "torchrun --nproc-per-node 2 main.py" in text and "mode to 'off'" in text, text
    assert comfy.run(cp_prompt("off"))  # off runs anywhere


def test_schema_and_one_http_server_for_every_rank(cp_comfy):
    info = cp_comfy.get("/object_info/ContextParallelAttention")["ContextParallelAttention"]
    assert info["category"] == "advanced/attention" and info["display_name"] == "Context Parallel Attention"
    inputs = info["input"]["required"]
    assert set(inputs) == {"model", "mode", "degree"} and all(spec[1].get("tooltip") for spec in inputs.values())
    # Rank 1 says so when its own start-up reaches the server step, which may come after rank 0 serves HTTP.
    deadline = time.time() + 60
    while "rank 1 serves no HTTP" not in (log := cp_comfy.tail(10 ** 7)) and time.time() < deadline:
        time.sleep(0.5)
    # Counted as ComfyUI's own handler prints it ("%(message)s"): under torchrun a rank's root logger sometimes also
    # has Python's default handler, which repeats every line as "INFO:root:..." (seen with ComfyUI 0.3.64).
    servers = [line for line in log.splitlines() if line.startswith("To see the GUI go to")]
    assert len(servers) == 1, f"a rank > 0 started an HTTP server: {servers}"
    assert "rank 1 serves no HTTP (rank 0 does)" in log and "address already in use" not in log.lower()


@pytest.mark.parametrize("mode,backend", [("heads", "native"), ("sequence", None)])
def test_two_ranks_give_the_single_process_latent(cp_comfy, comfy, mode, backend):
    reference = _single(comfy, backend or "native")
    entry = cp_comfy.run(cp_prompt(mode, backend=backend))
    result = latent(cp_comfy, entry, "8")
    assert result.shape == reference.shape
    assert _relative_error(result, reference) < 1e-5
    report = _report(cp_comfy, entry)
    assert report["world_size"] == 2 and report["mode"] == mode and report["rank"] == 0
    assert report["split_calls"] > 0 and report["unsplit_calls"] == 0, report  # 2 layers x self/cross x steps
    assert report["previous_override"] == (backend is not None)


def _post(server, path: str, body: dict) -> None:
    req = urllib.request.Request(server.url + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()


def _wait_history(server, prompt_id: str, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        hist = server.get(f"/history/{prompt_id}")
        if prompt_id in hist and hist[prompt_id].get("status", {}).get("completed") is not None:
            return hist[prompt_id]
        time.sleep(0.2)
    raise AssertionError(f"prompt {prompt_id} did not end in {timeout}s\n{server.tail()}")


def test_cancel_on_rank_0_stops_every_rank_at_the_same_check_and_the_queue_goes_on(cp_comfy, comfy):
    status, body = cp_comfy.post_prompt(cp_prompt("heads", steps=400, seed=11))
    assert status == 200, body
    prompt_id = body["prompt_id"]
    deadline = time.time() + 120
    while not cp_comfy.get("/queue")["queue_running"]:
        assert time.time() < deadline, cp_comfy.tail()
        time.sleep(0.1)
    time.sleep(1.0)  # well into the sampler (a few steps)
    _post(cp_comfy, "/interrupt", {})
    entry = _wait_history(cp_comfy, prompt_id, timeout=60)  # not the 60 s collective timeout either
    assert entry["status"]["status_str"] == "error"
    assert any(m[0] == "execution_interrupted" for m in entry["status"]["messages"]), entry["status"]
    log = cp_comfy.tail(10 ** 7)
    checks = {int(r): int(c) for r, c in re.findall(r"rank (\d) interrupted at check (\d+)", log)}
    assert set(checks) == {0, 1} and checks[0] == checks[1] > 2, checks  # the same point, inside the sampler
    # The queue goes on: the next prompt runs on both ranks and still matches one process.
    entry = cp_comfy.run(cp_prompt("sequence", seed=12), timeout=120)
    assert _relative_error(latent(cp_comfy, entry, "8"), _single(comfy, seed=12)) < 1e-5


def test_prompts_without_the_node_and_free_memory_keep_the_ranks_in_step(cp_comfy):
    plain = cp_comfy.run(cp_prompt(None))  # runs on both ranks, no attention collective
    assert plain["status"]["status_str"] == "success"
    _post(cp_comfy, "/free", {"free_memory": True, "unload_models": True})
    time.sleep(1.5)  # rank 0's prompt worker hands the flags out (and to rank 1) within its wait
    again = cp_comfy.run(cp_prompt("sequence"))  # rank 1 cleared its cache too: both run the sampler again
    assert _report(cp_comfy, again)["split_calls"] > 0
    outputs = list((Path(cp_comfy.base) / "output" / "latents").glob("*.latent"))
    prefixes = {p.name.rsplit("_", 2)[0] for p in outputs}
    assert len(outputs) == len(prefixes), "rank 1 wrote into rank 0's output folder"


def _pid_of(log: str, rank: int, world: int) -> int:
    found = re.findall(rf"rank {rank} of {world} ready \(gloo, pid (\d+)", log)
    assert found, log[-3000:]
    return int(found[-1])


def _wait_exit(proc, timeout: float) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def test_killed_rank_stops_the_launch_with_a_clear_error(cp_comfy):
    """Last test of this launch: kill rank 1; torchrun and rank 0 stop within seconds, saying which rank."""
    os.kill(_pid_of(cp_comfy.tail(10 ** 7), 1, 2), signal.SIGKILL)
    code = _wait_exit(cp_comfy.proc, 30)
    assert code not in (None, 0), cp_comfy.tail()
    log = cp_comfy.tail(10 ** 7)
    assert "context-parallel rank 1 is gone" in log or "Signal 9 (SIGKILL) received" in log, log[-3000:]


def test_two_node_groups_give_the_single_process_latent(cp_nodes, comfy):
    reference = _single(comfy)
    entry = cp_nodes.run(cp_prompt("heads"))
    assert _relative_error(latent(cp_nodes, entry, "8"), reference) < 1e-5
    report = _report(cp_nodes, entry)
    assert report["world_size"] == 4 and report["split_calls"] > 0 and report["unsplit_calls"] == 0, report
    entry = cp_nodes.run(cp_prompt("sequence", seed=3))
    assert _relative_error(latent(cp_nodes, entry, "8"), _single(comfy, seed=3)) < 1e-5


def test_a_rank_killed_in_the_other_node_group_stops_rank_0_with_its_number(cp_nodes):
    other = cp_nodes.other
    os.kill(_pid_of(other["log"].read_text(errors="replace"), 3, 4), signal.SIGKILL)
    assert _wait_exit(cp_nodes.proc, 30) not in (None, 0), cp_nodes.tail()  # node group 0's torchrun
    assert _wait_exit(other["proc"], 30) not in (None, 0), other["log"].read_text(errors="replace")[-3000:]
    assert "context-parallel rank 3 is gone" in cp_nodes.tail(10 ** 7), cp_nodes.tail()
