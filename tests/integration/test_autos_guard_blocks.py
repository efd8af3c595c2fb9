"""Issue #14 in a real ComfyUI 0.3.64 (CPU), through its HTTP API: the two autos, the quality guard and the block
range of Set Attention Backend, refused at queue time when wrong, and what each node's report says.

This module starts its own ComfyUI (the shared fixture's, plus one test-only custom node): the guard test needs a
kernel that goes wrong in the middle of a run, and a backend can only be registered from inside the server. The node
`TestFlakyKernel` registers the quantised custom backend `test_flaky_int8` with the pack's dispatcher (found through
the Set Attention Backend class ComfyUI loaded, whatever module name it got) and, when it runs, re-arms it: exact
for `good_calls` calls, then noisy; or, with `bad_block` >= 0, wrong only on that transformer block's
self-attention (from its `block_good`-th call on): the node hooks the model's blocks to know which one is running,
as a kernel wrong on one layer's activations would be. Each wrong output it returns is logged to a file, so a test
counts them: one the guard caught is recomputed, any other reached the latent.
"""

from __future__ import annotations

import json
import itertools
from pathlib import Path

import pytest

from .conftest import main_py, require_comfyui, serve_comfyui, write_test_node
from .test_comfyui import _cond, latent, model_report, served
from .test_node_inputs import refused

pytestmark = pytest.mark.integration
SET = "SetAttentionBackend"
FLAKY = "test_flaky_int8"
NO_POSITION = ("this model tells attention no block position (ComfyUI 0.3.64's WAN and Flux do not; newer ComfyUI "
               "does): the block range cannot apply")
_seed = itertools.count(1400)

FLAKY_NODE = r'''
import os

import torch
import torch.nn.functional as F

NAME = "test_flaky_int8"
STATE = {"calls": 0, "good": 10 ** 9, "block": None, "bad_block": -1, "block_good": 0, "block_calls": 0,
         "log": None, "hooks": []}
BLOCK_CLASSES = ("WanAttentionBlock", "BasicTransformerBlock")  # WAN's blocks; the UNet's transformer blocks


def kernel(q, k, v, *, attn_mask=None, scale=None, **_):
    """(B, H, L, D): exact for STATE['good'] calls, then exact + noise (an int8 kernel going wrong mid-run); with a
    bad block, wrong on that block's self-attention only, from its STATE['block_good']-th call on."""
    STATE["calls"] += 1
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
    if STATE["bad_block"] >= 0:
        if STATE["block"] != STATE["bad_block"] or q.shape[2] != k.shape[2]:
            return out
        STATE["block_calls"] += 1
        wrong = STATE["block_calls"] > STATE["block_good"]
    else:
        wrong = STATE["calls"] > STATE["good"]
    if not wrong:
        return out
    if STATE["log"]:
        with open(STATE["log"], "a") as log:
            log.write(f"block {STATE['block']} call {STATE['block_calls']}\n")
    return out + torch.randn_like(out)


def hook_blocks(model):
    """Know which transformer block runs: a pre-hook per block sets STATE['block'] (its place in module order)."""
    for handle in STATE["hooks"]:
        handle.remove()
    blocks = [m for m in model.model.diffusion_model.modules() if type(m).__name__ in BLOCK_CLASSES]

    def enter(index):
        def hook(module, args):
            STATE["block"] = index
        return hook
    STATE["hooks"] = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(blocks)]


def register():
    d = _dispatcher()
    if d is not None and NAME not in d.backend_names():
        d.register_backend(NAME, kernel, layout="BHSD", devices=("cpu",), quantised=True, fallback=("native",),
                           description="test: a quantised kernel that goes wrong after some calls")


class TestFlakyKernel:
    @classmethod
    def INPUT_TYPES(cls):
        register()  # GET /object_info/TestFlakyKernel, and validation of any prompt that has this node
        return {"required": {"model": ("MODEL",), "good_calls": ("INT", {"default": 6, "min": 0, "max": 10 ** 6}),
                             "seed": ("INT", {"default": 0, "min": 0, "max": 2 ** 31})},
                "optional": {"bad_block": ("INT", {"default": -1, "min": -1, "max": 1000}),
                             "block_good": ("INT", {"default": 0, "min": 0, "max": 10 ** 6})}}
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "arm"
    CATEGORY = "testing"

    def arm(self, model, good_calls, seed, bad_block=-1, block_good=0):
        import folder_paths
        register()
        output = folder_paths.get_output_directory()
        os.makedirs(output, exist_ok=True)  # a fresh server makes it at its first save: this test may come first
        STATE.update(calls=0, good=good_calls, bad_block=bad_block, block_good=block_good, block_calls=0,
                     log=os.path.join(output, f"flaky_{seed}.log"))
        if bad_block >= 0:
            hook_blocks(model)
        return (model,)


NODE_CLASS_MAPPINGS = {"TestFlakyKernel": TestFlakyKernel}
'''


@pytest.fixture(scope="module")
def comfy():
    require_comfyui()

    def command(base, port):
        write_test_node(base, "attn_dispatch_test_flaky", FLAKY_NODE)
        return main_py(base, port)

    def ready(server):  # listing the flaky node registers its backend, before any prompt is queued
        return (server.get(f"/object_info/{SET}") is not None
                and server.get("/object_info/TestFlakyKernel") is not None)

    with serve_comfyui("attn-dispatch-issue14-", command, ready) as server:
        yield server


def set_inputs(**kw):
    return {"backend": "native", "policy": "fallback", "start_percent": 0.0, "end_percent": 1.0, **kw}


def wan(set_kw=None, *, steps=2, flaky=None, seed=None):
    """UNETLoader (tiny WAN 2.1) -> [TestFlakyKernel "5"] -> [Set Attention Backend "10"] -> KSampler "11" ->
    SaveLatent "12"."""
    seed = next(_seed) if seed is None else seed
    p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan21.safetensors", "weight_dtype": "default"}},
         "2": _cond(1), "3": _cond(2),
         "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                  "batch_size": 1}}}
    model = ["1", 0]
    if flaky is not None:
        arm = flaky if isinstance(flaky, dict) else {"good_calls": flaky}
        p["5"] = {"class_type": "TestFlakyKernel", "inputs": {"model": model, "good_calls": 10 ** 6, "seed": seed,
                                                             **arm}}
        model = ["5", 0]
    if set_kw is not None:
        p["10"] = {"class_type": SET, "inputs": {"model": model, **set_inputs(**set_kw)}}
        model = ["10", 0]
    p["11"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": steps, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
    p["12"] = {"class_type": "SaveLatent", "inputs": {"samples": ["11", 0], "filename_prefix": f"latents/i14_{seed}"}}
    return p


def sd15(set_kw, seed=None, flaky=None):
    seed = next(_seed) if seed is None else seed
    model = ["1", 0]
    extra = {}
    if flaky is not None:
        extra["5"] = {"class_type": "TestFlakyKernel", "inputs": {"model": model, "good_calls": 10 ** 6, "seed": seed,
                                                                 **flaky}}
        model = ["5", 0]
    return {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_sd15.safetensors", "weight_dtype": "default"}},
            "2": _cond(1, dim=768, length=77), "3": _cond(2, dim=768, length=77),
            "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}, **extra,
            "10": {"class_type": SET, "inputs": {"model": model, **set_inputs(**set_kw)}},
            "11": {"class_type": "KSampler", "inputs": {
                "model": ["10", 0], "seed": seed, "steps": 2, "cfg": 2.0, "sampler_name": "euler",
                "scheduler": "simple", "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0],
                "denoise": 1.0}},
            "12": {"class_type": "SaveLatent", "inputs": {"samples": ["11", 0],
                                                          "filename_prefix": f"latents/i14sd_{seed}"}}}


def _close(a, b, rtol=1e-3):
    assert a.shape == b.shape
    err = float((a - b).abs().max())
    assert err <= rtol * max(1.0, float(b.abs().max())), err


def test_schema_lists_the_autos_first_and_the_new_inputs(comfy):
    info = comfy.get(f"/object_info/{SET}")[SET]
    options = info["input"]["required"]["backend"][1]["options"]
    assert options[:3] == ["auto_exact", "auto_fast", "comfy default"] and "auto" not in options
    assert info["input"]["required"]["backend"][1]["default"] == "auto_exact"
    optional = info["input"]["optional"]
    assert optional["quality_guard"][1]["options"] == ["quantised kernels", "every kernel", "off"]
    assert optional["quality_guard"][1]["default"] == "quantised kernels"
    assert optional["guard_every"][1]["default"] == 0 and optional["guard_every"][1]["min"] == 0  # 0: sized on the machine
    assert optional["block_start"][1]["default"] == 0 and optional["block_end"][1]["default"] == -1
    for name in ("quality_guard", "guard_every", "block_start", "block_end"):
        assert optional[name][1]["tooltip"], name
    assert "recomputed" in optional["quality_guard"][1]["tooltip"]
    clip = comfy.get("/object_info/SetClipAttentionBackend")["SetClipAttentionBackend"]
    assert clip["input"]["required"]["backend"][1]["options"][:3] == options[:3]


@pytest.mark.parametrize("backend", ["auto_exact", "auto_fast", "auto"])
def test_the_autos_run_a_prompt(comfy, backend):
    """auto_exact and auto_fast run and match exact attention; `auto` (older workflows) is still accepted."""
    seed = next(_seed)
    ref = comfy.run(wan({"backend": "native"}, seed=seed))
    entry = comfy.run(wan({"backend": backend, "quality_guard": "quantised kernels", "guard_every": 20}, seed=seed))
    report = model_report(comfy, entry, "10")
    rows = report["recorder"]["rows"]
    assert rows and {r["requested"] for r in rows} == {backend}, rows
    assert not any(r["fell_back"] for r in rows) and report["recorder"]["calls"] >= 8, rows
    assert report["model"].startswith("WanModel:"), report["model"]
    assert report["quality_guard"] == {"mode": "quantised", "every": 20}
    assert report["fallback_every_call"] == [] and "blocks" not in report
    _close(latent(comfy, entry, "12"), latent(comfy, ref, "12"))


@pytest.mark.parametrize("inputs, expected", [
    ({"quality_guard": "sometimes"}, "quality_guard: unknown quality guard mode 'sometimes'"),
    ({"quality_guard": "Every Kernel"}, "Did you mean 'every kernel'?"),
    ({"guard_every": -1}, "guard_every: -1 is below the minimum 0"),
    ({"block_start": 5, "block_end": 2}, "block_start 5 is after block_end 2"),
    ({"block_start": "one"}, "block_start: 'one' is not a whole number"),
])
def test_bad_guard_or_block_inputs_are_refused_at_queue_time(comfy, inputs, expected):
    errors = refused(comfy, wan(inputs), "10")
    assert expected in errors, errors


def test_old_prompts_without_the_new_inputs_still_run(comfy):
    prompt = wan({"backend": "auto"})  # an older API prompt: no guard or block inputs, the old auto
    for name in ("quality_guard", "guard_every", "block_start", "block_end"):
        prompt["10"]["inputs"].pop(name, None)
    report = model_report(comfy, comfy.run(prompt), "10")
    assert report["quality_guard"] == {"mode": "quantised", "every": 0} and report["recorder"]["calls"] >= 8


def test_block_range_on_the_sd15_unet_sends_other_blocks_to_comfy(comfy):
    """The tiny UNet has 4 spatial transformers (transformer_index 0..3: input, middle, 2 output); blocks 1..2 use
    flex, 0 and 3 ComfyUI's attention, each with the reason."""
    seed = next(_seed)
    entry = comfy.run(sd15({"backend": "flex", "block_start": 1, "block_end": 2}, seed=seed))
    report = model_report(comfy, entry, "10")
    counts = served(report)
    assert counts == {"flex": 8, "comfy:attention_sub_quad": 8}, report["recorder"]
    outside = [r for r in report["recorder"]["rows"] if r["served"].startswith("comfy:")]
    assert {reason for r in outside for reason in r["reasons"]} == {"outside the block range 1..2"}
    assert report["blocks"]["range"] == [1, 2] and report["blocks"]["unapplied"] == []
    assert report["fallback_every_call"] == []  # handing calls on is no kernel fallback
    base = comfy.run(sd15({"backend": "comfy default"}, seed=seed))
    _close(latent(comfy, entry, "12"), latent(comfy, base, "12"))
    # a bound counted from the end cannot resolve without a block count: said, and every block uses flex
    report = model_report(comfy, comfy.run(sd15({"backend": "flex", "block_start": -2, "block_end": -1})), "10")
    assert served(report) == {"flex": 16}
    assert "not the number of blocks" in report["blocks"]["unapplied"][0]["reason"]


def test_block_range_on_wan_says_it_cannot_apply(comfy):
    report = model_report(comfy, comfy.run(wan({"backend": "native", "block_start": 1, "block_end": -1})), "10")
    assert served(report) == {"native": report["recorder"]["calls"]}  # every block used the backend
    (unapplied,) = report["blocks"]["unapplied"]
    assert unapplied["reason"] == NO_POSITION and set(unapplied["sites"]) == {"self", "cross"}, unapplied
    assert unapplied["text"].startswith("block range 1..-1 not applied at cross, self: this model tells attention")


def test_a_fallback_on_every_call_is_in_the_report(comfy):
    report = model_report(comfy, comfy.run(wan({"backend": "flash"})), "10")
    (every,) = report["fallback_every_call"]
    assert every["requested"] == "flash" and every["every_site"] and set(every["sites"]) == {"self", "cross"}
    assert every["text"].startswith(f"flash fell back to {every['served'][0]} on every call: "), every
    # the machine's reason, no install hint: installing flash-attn would not make it run on a CPU (issue #41)
    assert "needs an NVIDIA CUDA GPU" in every["text"] and "pip install" not in every["text"], every
    route = comfy.get("/attention_dispatch/report")  # the route carries the same
    assert any(r.get("fallback_every_call") for r in route["reports"])


def test_guard_catches_a_kernel_that_goes_wrong_mid_run(comfy):
    """test_flaky_int8 is exact for its first 6 calls (WAN: 4 per step), then noisy. With the guard checking every
    call, the first bad call is recomputed exactly and the kernel demoted for this model: the latent matches exact
    attention, and the report names the kernel, why, and what replaced it."""
    assert FLAKY in {b["name"] for b in comfy.get("/attention_dispatch/backends")["backends"]}
    seed = next(_seed)
    entry = comfy.run(wan({"backend": FLAKY, "quality_guard": "quantised kernels", "guard_every": 1}, steps=3,
                          flaky=6, seed=seed))
    report = model_report(comfy, entry, "10")
    guard = {(g["site"], g["backend"]): g for g in report["guard"]}
    failures = [f for g in report["guard"] for f in g["failures"]]
    assert failures, report["guard"]
    assert all(f["replacement"] and f["replacement"] != FLAKY for f in failures), failures
    assert all("exceeds its guard bound" in f["reason"] or "NaN" in f["reason"] for f in failures), failures
    assert sum(g["checks"] for g in guard.values()) >= 7, guard
    counts = served(report)
    assert counts.get(FLAKY, 0) >= 6 and sum(v for k, v in counts.items() if k != FLAKY) >= 2, counts
    assert "guard" in json.dumps(comfy.get("/attention_dispatch/report"))
    ref = comfy.run(wan({"backend": "native"}, steps=3, seed=seed))
    _close(latent(comfy, entry, "12"), latent(comfy, ref, "12"))


def wrong_outputs(comfy, seed) -> list[str]:
    """The wrong outputs test_flaky_int8 returned in the prompt armed with `seed` (one line each)."""
    log = Path(comfy.base) / "output" / f"flaky_{seed}.log"
    return log.read_text().splitlines() if log.exists() else []


def failures_by_site(report) -> dict:
    return {g["site"]: g["failures"] for g in report["guard"] if g["failures"]}


@pytest.mark.parametrize("model", ["wan", "sd15"])
def test_a_kernel_wrong_on_one_block_is_caught_at_that_blocks_first_call(comfy, model):
    """The quantised kernel is wrong on one block's self-attention only, at the default guard settings (interval
    sized on this machine; the first call of every block is checked whatever it is). ComfyUI 0.3.64's WAN passes no block position (the block is the
    call's place in the forward: "self #1"); the UNet passes transformer_index ("middle.self #1.0"). That block's
    first call is compared and recomputed: the kernel's one wrong output never reaches the latent, which equals
    the exact run's; the kernel keeps serving the other blocks; the report and its text name the block."""
    seed = next(_seed)
    if model == "wan":
        site, prompt = "self #1", wan({"backend": FLAKY}, steps=3, flaky={"bad_block": 1}, seed=seed)
        exact = wan({"backend": "native"}, steps=3, seed=seed)
    else:
        site, prompt = "middle.self #1.0", sd15({"backend": FLAKY}, seed=seed, flaky={"bad_block": 1})
        exact = sd15({"backend": "native"}, seed=seed)
    entry = comfy.run(prompt)
    report = model_report(comfy, entry, "10")
    assert report["quality_guard"] == {"mode": "quantised", "every": 0}
    failures = failures_by_site(report)
    assert list(failures) == [site], report["guard"]
    assert len(failures[site]) == 1 and failures[site][0]["replacement"] not in ("", FLAKY), failures
    assert len(wrong_outputs(comfy, seed)) == 1  # the one the guard caught (and recomputed): 0 spoiled calls
    rows = {(r["site"], r["served"]): r["calls"] for r in report["recorder"]["rows"]}
    assert {s for s, served in rows if served == FLAKY} and (site, FLAKY) not in rows, rows
    (caught,) = [g for g in report["guard"] if g["failures"]]
    assert site in caught["text"] and "demoted for this block" in caught["text"]
    _close(latent(comfy, entry, "12"), latent(comfy, comfy.run(exact), "12"))


def test_a_block_that_turns_bad_mid_run_is_caught_within_the_rotation_bound(comfy):
    """Block 1's self-attention goes wrong from its second call; with guard_every 2 each block is compared again
    within 2 of its calls: at most one wrong output reaches the latent before the check catches the block."""
    seed = next(_seed)
    every = 2
    entry = comfy.run(wan({"backend": FLAKY, "guard_every": every}, steps=6,
                          flaky={"bad_block": 1, "block_good": 1}, seed=seed))
    report = model_report(comfy, entry, "10")
    assert list(failures_by_site(report)) == ["self #1"], report["guard"]
    wrong = wrong_outputs(comfy, seed)
    assert 1 <= len(wrong) <= every, wrong  # the spoiled ones (at most every - 1) and the caught one
    rows = {(r["site"], r["served"]): r["calls"] for r in report["recorder"]["rows"]}
    assert rows[("self #1", FLAKY)] <= every + 1 and rows[("self #0", FLAKY)] == 6, rows
    passed = [g for g in report["guard"] if not g["failures"] and g["site"] == "self"]  # the blocks that stayed good
    assert passed and all(g["text"].endswith(f"each block checked again within {every} of its calls")
                          for g in passed), passed
