"""ComfyUI's own TorchCompileModel (inductor, CPU) with Set Attention Backend(flex): flex serves every call inside
the compiled model (issue #15). It used to raise "Cannot access storage of BatchedTensorImpl" in the graph with
symbolic sizes and fall back to native, with only the server log saying so, and the graph with static sizes
failed to compile (inductor's C++ flex template: "LoweringException: ValueError: not enough values to unpack")."""

from __future__ import annotations

import pytest

from .test_comfyui import kind, latent, model_report, served, wan_prompt

pytestmark = pytest.mark.integration


def plain_wan_prompt(backend, *, seed):
    """UNETLoader -> Set Attention Backend -> KSampler -> SaveLatent, with a negative prompt of 77 tokens against
    the positive's 8: too far apart for ComfyUI to batch them (it pads to their lcm only up to 4x), so each step
    runs the model twice with two cross-attention lengths. The compiled model is traced with static sizes first,
    then recompiled with symbolic ones, where every attention call is the dispatcher's op run by the graph."""
    prompt, [(out, _)] = wan_prompt([backend], seed=seed)
    prompt["3"]["inputs"]["length"] = 77
    return prompt, out


def compiled_wan_prompt(backend, *, seed):
    """The same with TorchCompileModel (inductor) between Set Attention Backend and the KSampler."""
    prompt, out = plain_wan_prompt(backend, seed=seed)
    prompt["105"] = {"class_type": "TorchCompileModel", "inputs": {"model": ["100", 0], "backend": "inductor"}}
    prompt["101"]["inputs"]["model"] = ["105", 0]
    return prompt, out


def test_flex_serves_every_call_inside_torch_compile_model(comfy):
    # A seed no other test uses: ComfyUI caches a KSampler whose inputs match an earlier prompt's.
    plain, plain_out = plain_wan_prompt("flex", seed=21)
    reference = latent(comfy, comfy.run(plain), plain_out)
    prompt, out = compiled_wan_prompt("flex", seed=21)
    entry = comfy.run(prompt, timeout=600)  # inductor compiles the model twice (static sizes, then symbolic)
    report = model_report(comfy, entry, "100")
    recorder = report["recorder"]
    assert served(report) == {"flex": recorder["calls"]} and recorder["calls"] >= 8, report
    assert not any(row["fell_back"] or row["reasons"] for row in recorder["rows"]), report
    assert not recorder["errors"], report
    assert {kind(row["site"]) for row in recorder["rows"]} == {"self", "cross"}, report
    assert "BatchedTensorImpl" not in comfy.tail(200_000)
    result = latent(comfy, entry, out)
    assert (result - reference).abs().max() <= 1e-3 * max(1.0, float(reference.abs().max())), \
        float((result - reference).abs().max())


def test_compiled_calls_count_on_every_prompt(comfy):
    """The graph TorchCompileModel compiled for one prompt runs the next without a trace: its calls still count
    (they once counted only when traced, and the second prompt's report said "no attention calls recorded")."""
    prompt, _ = compiled_wan_prompt("flex", seed=23)
    first = model_report(comfy, comfy.run(prompt, timeout=600), "100")["recorder"]
    prompt["101"]["inputs"]["seed"] = 24  # only the sampler runs again: Set Attention Backend and the compile are cached
    second = model_report(comfy, comfy.run(prompt, timeout=600), "100")["recorder"]
    for recorder in (first, second):
        assert served({"recorder": recorder}) == {"flex": recorder["calls"]} and recorder["calls"] >= 8, recorder
    assert second["calls"] == first["calls"], (first, second)
