"""The dispatcher's hooks into a real ComfyUI 0.3.64 (CPU): `auto`'s tuning cache in ComfyUI's user directory,
every line the pack logs while tuning with the one prefix, tuning's progress as progress text on the sampler node
(read from ComfyUI's websocket), and Cancel (POST /interrupt) stopping tuning.

This module starts its own ComfyUI with a test-only node, `TestSlowKernel`, that registers the exact custom backend
`test_slow_exact` and, when it runs, arms it to sleep in its next call (and to touch a marker file when it starts):
a kernel that is slow to load, tried while `auto_exact` tunes. The budget is raised (ATTN_DISPATCH_TUNE_BUDGET=30)
so that tuning reaches it.
"""

from __future__ import annotations

import json
import subprocess
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest

from .conftest import COMFYUI_PYTHON, main_py, require_comfyui, serve_comfyui, write_test_node
from .test_comfyui import _cond, model_report

pytestmark = pytest.mark.integration
SET = "SetAttentionBackend"

SLOW_NODE = r'''
import time

import torch
import torch.nn.functional as F

NAME = "test_slow_exact"
STATE = {"sleep": 0.0, "marker": ""}


def kernel(q, k, v, *, attn_mask=None, scale=None, **_):
    """(B, H, L, D), exact; the call after arming sleeps (a kernel loading) and touches the marker first."""
    if STATE["sleep"] > 0:
        sleep, STATE["sleep"] = STATE["sleep"], 0.0
        if STATE["marker"]:
            open(STATE["marker"], "w").close()
        time.sleep(sleep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def nan_kernel(q, k, v, **_):
    """(B, H, L, D): a custom kernel gone wrong, NaN everywhere."""
    return torch.full_like(q, float("nan"))


def register():
    d = _dispatcher()
    if d is not None and NAME not in d.backend_names():
        d.register_backend(NAME, kernel, layout="BHSD", devices=("cpu",), fallback=("native",),
                           description="test: an exact kernel whose next call after arming is slow")
        d.register_backend("test_nan", nan_kernel, layout="BHSD", devices=("cpu",), fallback=("native",),
                           description="test: a kernel whose every output is NaN")


class TestSlowKernel:
    @classmethod
    def INPUT_TYPES(cls):
        register()
        return {"required": {"model": ("MODEL",), "sleep": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 600.0}),
                             "marker": ("STRING", {"default": ""}), "seed": ("INT", {"default": 0, "min": 0})}}
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "arm"
    CATEGORY = "testing"

    def arm(self, model, sleep, marker, seed):
        register()
        STATE["sleep"], STATE["marker"] = sleep, marker
        return (model,)


NODE_CLASS_MAPPINGS = {"TestSlowKernel": TestSlowKernel}
'''

# Run with ComfyUI's Python (it has aiohttp): writes each progress text (binary event 3) as a JSON line.
LISTENER = r'''
import asyncio, json, struct, sys

import aiohttp


async def main(url, out):
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(url.replace("http", "ws", 1) + "/ws?clientId=attn-test") as ws:
            open(out + ".ready", "w").close()
            with open(out, "w") as f:
                async for msg in ws:
                    if msg.type == aiohttp.WSMsgType.BINARY and struct.unpack(">I", msg.data[:4])[0] == 3:
                        (n,) = struct.unpack(">I", msg.data[4:8])
                        f.write(json.dumps({"node": msg.data[8:8 + n].decode(), "text": msg.data[8 + n:].decode()})
                                + "\n")
                        f.flush()


asyncio.run(main(sys.argv[1], sys.argv[2]))
'''


@pytest.fixture(scope="module")
def comfy():
    require_comfyui()

    def command(base, port):
        write_test_node(base, "attn_dispatch_test_slow", SLOW_NODE)
        return ["env", "ATTN_DISPATCH_TUNE_BUDGET=30", *main_py(base, port)]

    def ready(server):
        return server.get(f"/object_info/{SET}") is not None and server.get("/object_info/TestSlowKernel") is not None

    with serve_comfyui("attn-dispatch-hooks-", command, ready) as server:
        yield server


@pytest.fixture
def progress_texts(comfy, tmp_path):
    """The progress texts ComfyUI sends over its websocket while the test runs: a function returning them."""
    out = tmp_path / "texts.jsonl"
    script = tmp_path / "listen.py"
    script.write_text(LISTENER)
    listener = subprocess.Popen([COMFYUI_PYTHON, str(script), comfy.url, str(out)])
    try:
        deadline = time.time() + 60
        while not Path(str(out) + ".ready").exists():
            assert listener.poll() is None and time.time() < deadline, "the websocket listener did not connect"
            time.sleep(0.1)
        yield lambda: [json.loads(l) for l in out.read_text().splitlines() if l.strip()]
    finally:
        listener.terminate()
        listener.wait(timeout=10)


def prompt(unet, cond_dim, cond_len, latent, *, sleep=0.0, marker="", seed=1):
    return {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet, "weight_dtype": "default"}},
            "2": _cond(1, dim=cond_dim, length=cond_len), "3": _cond(2, dim=cond_dim, length=cond_len), "4": latent,
            "5": {"class_type": "TestSlowKernel", "inputs": {"model": ["1", 0], "sleep": sleep, "marker": marker,
                                                             "seed": seed}},
            "10": {"class_type": SET, "inputs": {"model": ["5", 0], "backend": "auto_exact", "policy": "fallback",
                                                 "start_percent": 0.0, "end_percent": 1.0}},
            "11": {"class_type": "KSampler", "inputs": {
                "model": ["10", 0], "seed": seed, "steps": 2, "cfg": 2.0, "sampler_name": "euler",
                "scheduler": "simple", "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
                "denoise": 1.0}},
            "12": {"class_type": "SaveLatent", "inputs": {"samples": ["11", 0], "filename_prefix": f"latents/h{seed}"}}}


def wan(**kw):
    latent = {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                 "batch_size": 1}}
    return prompt("tiny_wan21.safetensors", 4096, 8, latent, **kw)


def sd15(**kw):
    latent = {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
    return prompt("tiny_sd15.safetensors", 768, 77, latent, **kw)


def decisions(comfy) -> set:
    from dispatcher.auto import cache as disk_cache
    path = Path(comfy.base) / "user" / "attention_dispatch" / "tune.sqlite3"
    if not path.exists():
        return set()
    return {key for machine in disk_cache.dump(path)["machines"].values() for key in machine["decisions"]}


def test_tuning_shows_progress_and_saves_into_comfyuis_user_directory(comfy, progress_texts):
    entry = comfy.run(wan(seed=3))
    report = model_report(comfy, entry, "10")
    assert report["recorder"]["rows"], report
    assert decisions(comfy), f"no decision in <user directory>/attention_dispatch/tune.sqlite3\n{comfy.tail(6000)}"
    texts = [t["text"] for t in progress_texts() if t["node"] == "11"]  # on the sampler, where attention runs
    assert any(t.startswith("auto_exact: tuning attention for q ") and "trying native (1 of " in t for t in texts), texts
    assert any("trying test_slow_exact" in t for t in texts), texts
    assert any(t.startswith("auto_exact: ") and " for q " in t and t.endswith(" s)") for t in texts), texts
    lines = comfy.log.read_text(errors="replace").splitlines()
    tuned = [l for l in lines if "auto: " in l and "->" in l]
    assert tuned and all("[attention-dispatch] auto: " in l for l in tuned), tuned


def test_cancel_stops_tuning(comfy, tmp_path):
    """Cancel while a candidate's slow first call runs: the prompt ends as interrupted once that call returns (the
    check runs between steps), and nothing of the interrupted tuning is saved."""
    before = decisions(comfy)
    marker = tmp_path / "slow-call-started"
    status, body = comfy.post_prompt(sd15(sleep=4.0, marker=str(marker), seed=4))
    assert status == 200, body
    pid = body["prompt_id"]
    deadline = time.time() + 120
    while not marker.exists():
        assert time.time() < deadline, f"the slow kernel was never tried\n{comfy.tail()}"
        time.sleep(0.05)
    asked = time.time()
    urllib.request.urlopen(urllib.request.Request(comfy.url + "/interrupt", data=b"{}", method="POST",
                                                  headers={"Content-Type": "application/json"}), timeout=30)
    while True:
        hist = comfy.get(f"/history/{pid}")
        if pid in hist and hist[pid].get("status", {}).get("completed") is not None:
            break
        assert time.time() < asked + 60, f"the prompt did not stop\n{comfy.tail()}"
        time.sleep(0.1)
    stopped = time.time() - asked
    status = hist[pid]["status"]
    assert status["status_str"] == "error", status
    assert any(m[0] == "execution_interrupted" for m in status["messages"]), status
    assert stopped < 4.0 + 10, stopped  # the slow call's rest, then no other candidate, no sampling step
    assert decisions(comfy) == before


def test_tuning_cache_files_that_are_not_caches_are_set_aside_once_and_auto_goes_on(comfy):
    """A tuning cache of the wrong shape once broke every `auto` prompt until deleted (issue #41): now the file is
    renamed `.bad` (kept for the user) with one warning, and the prompts run. An earlier version's tune.json beside
    it is that version's file: one of the wrong shape is not imported, and left as it is (issue #47)."""
    folder = Path(comfy.base) / "user" / "attention_dispatch"
    folder.mkdir(parents=True, exist_ok=True)
    legacy = '{"format": 4, "machines": {"x": {"decisions": []}}}'
    (folder / "tune.json").write_text(legacy)  # an earlier version's file, of the wrong shape
    (folder / "tune.sqlite3").unlink(missing_ok=True)
    (folder / "tune.sqlite3").write_text("this is not a database, but long enough to have a header")
    offset = comfy.log.stat().st_size
    for seed, size in ((31, 48), (32, 80)):  # new signatures: tuned now, so the cache is read and written
        entry = comfy.run(prompt("tiny_wan21.safetensors", 4096, 8, {"class_type": "EmptyHunyuanLatentVideo", "inputs": {
            "width": size, "height": size, "length": 1, "batch_size": 1}}, seed=seed))
        assert model_report(comfy, entry, "10")["recorder"]["rows"]
    assert (folder / "tune.json").read_text() == legacy and not (folder / "tune.json.bad").exists()
    assert (folder / "tune.sqlite3.bad").read_text().startswith("this is not a database")
    assert decisions(comfy), "no decision saved in the new cache"
    log = comfy.log.read_bytes()[offset:].decode("utf-8", errors="replace")
    set_aside = [line for line in log.splitlines() if "is not a tuning cache" in line]
    assert len(set_aside) == 1, set_aside  # once, not once per prompt or lookup
    passed_over = [line for line in log.splitlines() if "is not imported" in line]
    assert len(passed_over) == 1, passed_over
    assert "Traceback" not in log, log[-3000:]


def test_checks_raise_fail_a_prompt_whose_kernel_returned_nan_under_the_default_guard(comfy):
    """Attention Checks `raise` after a custom kernel that returns NaN, policy fallback, default quality guard:
    the prompt once succeeded with "all finite" (the guard had replaced the NaN before the checks saw it)."""
    p = prompt("tiny_wan21.safetensors", 4096, 8, {"class_type": "EmptyHunyuanLatentVideo", "inputs": {
        "width": 64, "height": 64, "length": 1, "batch_size": 1}}, seed=33)
    p["10"]["inputs"]["backend"] = "test_nan"
    p["13"] = {"class_type": "AttentionChecks", "inputs": {"model": ["10", 0], "mode": "raise", "compare": False,
                                                          "compare_every": 10}}
    p["11"]["inputs"]["model"] = ["13", 0]
    status, body = comfy.post_prompt(p)
    assert status == 200, body
    entry = comfy.wait(body["prompt_id"])
    assert entry["status"]["status_str"] == "error", entry["status"]
    checks = [r for r in comfy.reports(entry["prompt_id"]) if r["kind"] == "checks"]
    assert checks and checks[-1]["checked"]["non_finite"] >= 1, checks
    assert checks[-1]["summary"].startswith("NaN/Inf found, the prompt failed (checks: raise)"), checks[-1]
    assert "output of attention backend 'test_nan'" in checks[-1]["summary"], checks[-1]
