"""Context Parallel Attention in real ComfyUIs (CPU): two gloo ranks started by the pack's cp_launch.py,
against the single-process ComfyUI of the session fixture.

The launch uses the pack root's cp_launch.py exactly as a user would (from the ComfyUI folder, ComfyUI's
arguments after --). Rank 0 serves HTTP; rank 1 is headless and executes each prompt with it.
"""

from __future__ import annotations

import itertools
import os
import time
from pathlib import Path

import pytest

from .conftest import COMFYUI_PATH, COMFYUI_PYTHON, main_py, serve_comfyui
from .test_comfyui import latent

pytestmark = pytest.mark.integration
_prefix = itertools.count()


def cp_prompt(mode: str | None, *, backend: str | None = "native", seed: int = 7, steps: int = 2):
    """UNETLoader -> [Set Attention Backend] -> [Context Parallel Attention] -> KSampler -> SaveLatent."""
    cond = lambda s: {"class_type": "TestRandomConditioning",  # noqa: E731
                      "inputs": {"seed": s, "length": 8, "dim": 4096, "pooled_dim": 768}}
    p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan21.safetensors", "weight_dtype": "default"}},
         "2": cond(1), "3": cond(2),
         "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
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


@pytest.fixture(scope="module")
def cp_comfy():
    """Two ranks of ComfyUI (gloo, CPU) from cp_launch.py, with the pack and the test helpers."""
    if not COMFYUI_PATH:
        pytest.skip("COMFYUI_PATH is not set")

    def launch(base, port):
        launcher = os.path.relpath(base / "custom_nodes" / "attention_dispatch" / "cp_launch.py", COMFYUI_PATH)
        return [COMFYUI_PYTHON, launcher, "--nproc", "2", "--"] + main_py(base, port)[2:]

    def ready(server):
        return server.get("/object_info/ContextParallelAttention") is not None and "rank 1 ready" in server.tail(200000)

    # The launcher stops every rank and removes the workers' folders when it is terminated.
    with serve_comfyui("attn-dispatch-cp-", launch, ready, start_timeout=180, stop_timeout=40) as server:
        yield server


def _report(server, entry):
    found = [r for r in server.reports(entry["prompt_id"]) if r["kind"] == "context_parallel"]
    assert found, server.get("/attention_dispatch/report")
    return found[-1]


def test_schema_has_tooltips_on_every_input(cp_comfy):
    info = cp_comfy.get("/object_info/ContextParallelAttention")["ContextParallelAttention"]
    assert info["category"] == "advanced/attention" and info["display_name"] == "Context Parallel Attention"
    inputs = info["input"]["required"]
    assert set(inputs) == {"model", "mode", "degree"}
    assert all(spec[1].get("tooltip") for spec in inputs.values())
    assert inputs["mode"][1]["options"] == ["off", "heads", "sequence"]


def test_single_process_comfyui_refuses_the_node_with_the_launch_command(comfy):
    status, body = comfy.post_prompt(cp_prompt("heads"))
    assert status == 400, body
    errors = [e for node in body["node_errors"].values() for e in node["errors"]]
    text = " ".join(e.get("details", "") + e.get("message", "") for e in errors)
    assert "cp_launch.py --nproc 2 --" in text and "mode to 'off'" in text, text
    assert comfy.run(cp_prompt("off"))  # off runs anywhere


@pytest.mark.parametrize("mode,backend", [("heads", "native"), ("sequence", "native"), ("heads", None)])
def test_two_ranks_give_the_single_process_latent(cp_comfy, comfy, mode, backend):
    single = comfy.run(cp_prompt(None, backend=backend or "native"))
    reference = latent(comfy, single, "8")
    entry = cp_comfy.run(cp_prompt(mode, backend=backend))
    result = latent(cp_comfy, entry, "8")
    assert result.shape == reference.shape
    error = ((result.double() - reference.double()).abs().max() / reference.double().abs().max()).item()
    assert error < 1e-5, error
    report = _report(cp_comfy, entry)
    assert report["world_size"] == 2 and report["mode"] == mode and report["rank"] == 0
    assert report["split_calls"] > 0 and report["unsplit_calls"] == 0, report  # 2 layers x self/cross x steps
    assert report["previous_override"] == (backend is not None)


def test_prompts_without_the_node_and_free_memory_keep_the_ranks_in_step(cp_comfy):
    plain = cp_comfy.run(cp_prompt(None))  # runs on both ranks, no collective
    assert plain["status"]["status_str"] == "success"
    import json
    import urllib.request
    req = urllib.request.Request(cp_comfy.url + "/free", data=json.dumps({"free_memory": True,
                                                                         "unload_models": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    urllib.request.urlopen(req, timeout=30).read()
    time.sleep(1.5)  # rank 0's prompt worker hands the flags out (and to rank 1) within its wait
    again = cp_comfy.run(cp_prompt("sequence"))  # rank 1 cleared its cache too: both run the sampler again
    assert _report(cp_comfy, again)["split_calls"] > 0
    assert cp_comfy.proc.poll() is None
    outputs = list((Path(cp_comfy.base) / "output" / "latents").glob("*.latent"))
    prefixes = {p.name.rsplit("_", 2)[0] for p in outputs}
    assert len(outputs) == len(prefixes), "rank 1 wrote into rank 0's output folder"
