"""A long session in a real ComfyUI (CPU, tiny WAN 2.1): many prompts switching backends, checks, windows and
policies. Every prompt finishes, each configuration gives the same latent every time it runs (and all agree
with ComfyUI's own attention), and the server's memory does not grow once warmed up.

Each prompt gets its own Set Attention Backend node id: the node is not idempotent, so a new id makes
ComfyUI run it and the sampler again (an identical prompt would be answered from ComfyUI's cache), while
the loaded model (node "1") stays cached across prompts as it does for a user.
"""

from __future__ import annotations

import itertools
import json
import os
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SEED = 21
BACKENDS = ["native", "flex", "_native_math", "_native_flash", "comfy default"]
ROUNDS = 5  # 100 prompts; round 1 warms up (first calls, flex, lazy imports); then memory must not grow
RSS_GROWTH_MIB = 32  # allowed growth of the server's resident memory from round 2 to the last round
COMFY_FN = "comfy:attention_sub_quad"


def configs() -> list[dict]:
    """20 configurations: every backend, with and without checks, full and half windows, both policies."""
    out = []
    for i, (backend, checks, window) in enumerate(itertools.product(BACKENDS, (None, "raise"), ((0.0, 1.0), (0.5, 1.0)))):
        out.append({"backend": backend, "checks": checks, "window": window,
                    "policy": ("fallback", "strict")[i % 2], "compare": checks is not None and i % 4 == 1})
    return out


def prompt(n: int, cfg: dict) -> tuple[dict, str, str]:
    """(prompt, Set Attention Backend node id, SaveLatent node id)."""
    s, c, k, o = f"{n}0", f"{n}1", f"{n}2", f"{n}3"
    p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan21.safetensors", "weight_dtype": "default"}},
         "2": {"class_type": "TestRandomConditioning", "inputs": {"seed": 1, "length": 8, "dim": 4096, "pooled_dim": 768}},
         "3": {"class_type": "TestRandomConditioning", "inputs": {"seed": 2, "length": 8, "dim": 4096, "pooled_dim": 768}},
         "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                  "batch_size": 1}},
         s: {"class_type": "SetAttentionBackend", "inputs": {
             "model": ["1", 0], "backend": cfg["backend"], "policy": cfg["policy"], "start_percent": cfg["window"][0],
             "end_percent": cfg["window"][1]}}}
    model = [s, 0]
    if cfg["checks"]:
        p[c] = {"class_type": "AttentionChecks", "inputs": {"model": model, "mode": cfg["checks"],
                                                             "compare": cfg["compare"], "compare_every": 3}}
        model = [c, 0]
    p[k] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": SEED, "steps": 4, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
    p[o] = {"class_type": "SaveLatent", "inputs": {"samples": [k, 0], "filename_prefix": f"load/p{n}"}}
    return p, s, o


def server_pid(comfy) -> int:
    """The ComfyUI server process the session fixture started (its command line names our base directory)."""
    base = str(comfy.base)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"main.py" in args and base.encode() in args:
            return int(entry.name)
    pytest.skip("the ComfyUI server process was not found in /proc")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def latent(comfy, entry, node_id):
    from safetensors.torch import load_file
    info = entry["outputs"][node_id]["latents"][0]
    return load_file(str(Path(comfy.base) / "output" / info["subfolder"] / info["filename"]))["latent_tensor"]


def served(comfy, entry, node_id) -> dict:
    found = [r for r in comfy.reports(entry["prompt_id"]) if r["kind"] == "model" and r["node"] == node_id]
    assert found, f"no report for node {node_id}"
    counts = {}
    for row in found[-1]["recorder"]["rows"]:
        counts[row["served"]] = counts.get(row["served"], 0) + row["calls"]
    return counts


def get_raw(comfy, path: str) -> bytes:
    with urllib.request.urlopen(comfy.url + path, timeout=60) as r:
        return r.read()


def test_long_session_switching_backends(comfy):
    pid = server_pid(comfy)
    cfgs = configs()
    results: dict[int, list] = {i: [] for i in range(len(cfgs))}
    rss = {r: [] for r in range(1, ROUNDS + 1)}
    n = rejected = fell_back = 0
    started = time.time()
    for round_ in range(1, ROUNDS + 1):
        for i, cfg in enumerate(cfgs):
            n += 1
            p, set_id, save_id = prompt(9000 + n, cfg)
            entry = comfy.run(p)  # raises unless history says success
            assert entry["status"]["status_str"] == "success"
            counts = served(comfy, entry, set_id)
            want = COMFY_FN if cfg["backend"] == "comfy default" else cfg["backend"]
            if cfg["window"] == (0.0, 1.0):
                assert counts == {want: 16}, (cfg, counts)  # 4 steps x 2 blocks x (self + cross)
            else:  # steps 2, 3 in the window; steps 0, 1 run ComfyUI's attention
                assert counts.get(want, 0) >= 8 and set(counts) <= {want, COMFY_FN} and sum(counts.values()) == 16, \
                    (cfg, counts)
            results[i].append(latent(comfy, entry, save_id))
            rss[round_].append(rss_mib(pid))
            if n % 10 == 0:  # bad prompts in between: refused at queue time, or run on the next backend
                bad, bad_set, _ = prompt(9000 + n + 500, {**cfg, "backend": "flash", "policy": "strict"})
                status, body = comfy.post_prompt(bad)
                assert status == 400 and bad_set in body.get("node_errors", {}), body
                rejected += 1
                other, other_set, _ = prompt(9000 + n + 700, {**cfg, "backend": "_native_cudnn", "policy": "fallback"})
                counts = served(comfy, comfy.run(other), other_set)
                assert "_native_cudnn" not in counts and sum(counts.values()) == 16, counts
                fell_back += 1
    elapsed = time.time() - started
    # Every configuration gives the same latent each time it runs...
    for i, latents in results.items():
        assert len(latents) == ROUNDS
        for other in latents[1:]:
            assert (other - latents[0]).abs().max() == 0, (cfgs[i], float((other - latents[0]).abs().max()))
    # ...checks and the policy change nothing for the same backend and window, and all agree with ComfyUI.
    baseline = results[[i for i, c in enumerate(cfgs) if c["backend"] == "comfy default" and not c["checks"]
                        and c["window"] == (0.0, 1.0)][0]][0]
    scale = max(1.0, float(baseline.abs().max()))
    for i, cfg in enumerate(cfgs):
        same = [j for j, c in enumerate(cfgs) if c["backend"] == cfg["backend"] and c["window"] == cfg["window"]]
        for j in same:
            assert (results[j][0] - results[i][0]).abs().max() == 0, (cfg, cfgs[j])
        assert (results[i][0] - baseline).abs().max() <= 1e-3 * scale, (cfg, float((results[i][0] - baseline).abs().max()))
    growth = max(rss[ROUNDS]) - max(rss[2])
    summary = {"prompts": n, "rejected": rejected, "fell_back": fell_back, "seconds": round(elapsed, 1), "rss_mib": {r: [round(min(v)), round(max(v))]
                                                                          for r, v in rss.items()},
               "growth_mib": round(growth, 1)}
    print("\nload:", json.dumps(summary))
    assert growth <= RSS_GROWTH_MIB, summary


def test_routes_under_load_ignore_queries_and_show_no_paths(comfy):
    for path in ("/attention_dispatch/backends", "/attention_dispatch/report"):
        plain = json.loads(get_raw(comfy, path))
        for query in ("?path=/etc/passwd", "?file=..%2F..%2Fetc%2Fshadow", "?cmd=%24(id)", "?backend=%3Bls"):
            assert json.loads(get_raw(comfy, path + query)).keys() == plain.keys()
        text = json.dumps(plain)
        assert '"path"' not in text and str(comfy.base) not in text and os.path.expanduser("~") + "/" not in text
    backends = json.loads(get_raw(comfy, "/attention_dispatch/backends"))
    assert backends == json.loads(get_raw(comfy, "/attention_dispatch/backends?path=/etc/passwd"))
    assert len(json.loads(get_raw(comfy, "/attention_dispatch/report"))["reports"]) <= 64
