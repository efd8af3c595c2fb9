"""End to end in a real ComfyUI (CPU): schema, backend selection per model, validation, reports, results."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

NODES = ("SetAttentionBackend", "SetClipAttentionBackend", "AttentionChecks", "SparseAttentionOptions",
         "TrustRemoteKernels")
_prefix = itertools.count()


def _cond(seed, dim=4096, length=8):
    return {"class_type": "TestRandomConditioning", "inputs": {"seed": seed, "length": length, "dim": dim,
                                                                 "pooled_dim": 768}}


def wan_prompt(backends, *, policy="fallback", steps=2, window=(0.0, 1.0), checks=None, seed=7):
    """UNETLoader -> one Set Attention Backend + KSampler + SaveLatent per entry of `backends`."""
    p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan21.safetensors", "weight_dtype": "default"}},
         "2": _cond(1), "3": _cond(2),
         "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1, "batch_size": 1}}}
    prefixes = []
    for i, backend in enumerate(backends):
        s, k, o = f"1{i}0", f"1{i}1", f"1{i}2"
        model = ["1", 0]
        if backend is not None:
            p[s] = {"class_type": "SetAttentionBackend", "inputs": {
                "model": model, "backend": backend, "policy": policy, "start_percent": window[0],
                "end_percent": window[1]}}
            model = [s, 0]
        if checks:
            p[f"1{i}3"] = {"class_type": "AttentionChecks", "inputs": {"model": model, **checks}}
            model = [f"1{i}3", 0]
        p[k] = {"class_type": "KSampler", "inputs": {
            "model": model, "seed": seed, "steps": steps, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
            "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
        prefix = f"latents/t{next(_prefix)}_{i}"
        p[o] = {"class_type": "SaveLatent", "inputs": {"samples": [k, 0], "filename_prefix": prefix}}
        prefixes.append((o, prefix))
    return p, prefixes


def sd15_prompt(backend, seed=3):
    p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_sd15.safetensors", "weight_dtype": "default"}},
         "2": _cond(1, dim=768, length=77), "3": _cond(2, dim=768, length=77),
         "4": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
         "10": {"class_type": "SetAttentionBackend", "inputs": {"model": ["1", 0], "backend": backend,
                                                                 "policy": "fallback", "start_percent": 0.0,
                                                                 "end_percent": 1.0}},
         "11": {"class_type": "KSampler", "inputs": {
             "model": ["10", 0], "seed": seed, "steps": 2, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
             "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}},
         "12": {"class_type": "SaveLatent", "inputs": {"samples": ["11", 0], "filename_prefix": f"latents/sd{next(_prefix)}"}}}
    return p


def latent(comfy, entry, node_id):
    from safetensors.torch import load_file
    info = entry["outputs"][node_id]["latents"][0]
    path = Path(comfy.base) / "output" / info["subfolder"] / info["filename"]
    return load_file(str(path))["latent_tensor"]


def model_report(comfy, entry, node_id):
    found = [r for r in comfy.reports(entry["prompt_id"]) if r["kind"] == "model" and r["node"] == node_id]
    assert found, f"no report for node {node_id}: {comfy.get('/attention_dispatch/report')}"
    return found[-1]


def kind(site: str) -> str:
    """A call site without its block: the override names each block ("self #1", "input.self #0.0")."""
    return site.split(" #")[0]


def served(report) -> dict:
    out = {}
    for row in report["recorder"]["rows"]:
        out[row["served"]] = out.get(row["served"], 0) + row["calls"]
    return out


@pytest.fixture(scope="module")
def baseline(comfy):
    """The same WAN run with ComfyUI's own attention ('comfy default')."""
    prompt, [(out, _)] = wan_prompt(["comfy default"])
    entry = comfy.run(prompt)
    report = model_report(comfy, entry, "100")
    assert set(served(report)) == {"comfy:attention_sub_quad"}, report
    assert not any(row["fell_back"] for row in report["recorder"]["rows"])
    return latent(comfy, entry, out)


def test_object_info_has_every_node_with_tooltips_and_backends(comfy):
    info = comfy.get("/object_info")
    for name in NODES:
        assert name in info, name
        node = info[name]
        assert node["category"] == "advanced/attention"
        for section in ("required", "optional"):
            for input_name, spec in node["input"].get(section, {}).items():
                assert spec[1].get("tooltip"), f"{name}.{input_name} has no tooltip"
    options = info["SetAttentionBackend"]["input"]["required"]["backend"][1]["options"]
    assert options[:3] == ["auto_exact", "auto_fast", "comfy default"] and "auto" not in options
    for backend in ("native", "flex", "flash", "sage", "xformers"):
        assert backend in options
    assert info["SetAttentionBackend"]["input"]["optional"]["trust"][0] == "ATTN_TRUST"
    assert info["TrustRemoteKernels"]["output"] == ["ATTN_TRUST"]


@pytest.mark.parametrize("backend", ["native", "flex"])
def test_backend_serves_wan_and_matches_comfy_default(comfy, baseline, backend):
    prompt, [(out, _)] = wan_prompt([backend])
    entry = comfy.run(prompt)
    report = model_report(comfy, entry, "100")
    counts = served(report)
    assert counts == {backend: report["recorder"]["calls"]} and counts[backend] >= 8, report  # 2 steps x 4 calls
    sites = {row["site"] for row in report["recorder"]["rows"]}
    assert sites == {"self #0", "self #1", "cross #0", "cross #1"}  # the tiny WAN's 2 blocks, by their place
    result = latent(comfy, entry, out)
    assert result.shape == baseline.shape
    assert (result - baseline).abs().max() <= 1e-3 * max(1.0, float(baseline.abs().max())), \
        float((result - baseline).abs().max())


def test_two_samplers_each_get_their_backend(comfy):
    # A seed no other test uses: ComfyUI caches a KSampler whose inputs match an earlier prompt's.
    prompt, outs = wan_prompt(["native", "flex", "comfy default"], seed=8)
    entry = comfy.run(prompt)
    assert set(served(model_report(comfy, entry, "100"))) == {"native"}
    assert set(served(model_report(comfy, entry, "110"))) == {"flex"}
    assert set(served(model_report(comfy, entry, "120"))) == {"comfy:attention_sub_quad"}
    reference = latent(comfy, entry, outs[2][0])
    for out, _ in outs[:2]:
        assert (latent(comfy, entry, out) - reference).abs().max() <= 1e-3 * max(1.0, float(reference.abs().max()))


def test_unavailable_backend_strict_fails_validation_with_the_reason(comfy):
    prompt, _ = wan_prompt(["flash"], policy="strict")
    status, body = comfy.post_prompt(prompt)
    assert status == 400, body
    errors = json.dumps(body["node_errors"])
    assert "100" in body["node_errors"] and "needs an NVIDIA CUDA GPU" in errors and "flash" in errors, errors
    assert "pip install" not in errors, errors  # installing flash-attn would not make it run on this CPU


def test_unavailable_backend_fallback_runs_and_reports_why(comfy):
    prompt, _ = wan_prompt(["flash"], policy="fallback")
    entry = comfy.run(prompt)
    report = model_report(comfy, entry, "100")
    assert "flash" not in served(report)
    row = report["recorder"]["rows"][0]
    assert row["requested"] == "flash" and row["fell_back"] and any("needs an NVIDIA CUDA GPU" in r
                                                                    for r in row["reasons"])


def test_step_window_uses_comfy_attention_outside(comfy):
    prompt, _ = wan_prompt(["flex"], steps=4, window=(0.5, 1.0))
    entry = comfy.run(prompt)
    report = model_report(comfy, entry, "100")
    counts = served(report)
    assert counts.get("flex") == 8 and counts.get("comfy:attention_sub_quad") == 8, report  # steps 2,3 vs 0,1


def _with_other_override(prompt, kind, before_set: bool):
    """Insert TestOtherOverride between the loader and Set Attention Backend (before_set) or between Set Attention
    Backend and the sampler (node 101 feeds on node 100)."""
    if before_set:
        prompt["90"] = {"class_type": "TestOtherOverride", "inputs": {"model": ["1", 0], "kind": kind}}
        prompt["100"]["inputs"]["model"] = ["90", 0]
    else:
        prompt["90"] = {"class_type": "TestOtherOverride", "inputs": {"model": ["100", 0], "kind": kind}}
        prompt["101"]["inputs"]["model"] = ["90", 0]
    return prompt


def test_another_packs_override_after_the_node_passes_calls_on_to_it(comfy):
    """Another pack's override installed after Set Attention Backend: it runs self-attention itself and passes
    cross-attention on; the node serves those, and its report says the other override sees each call first."""
    prompt, _ = wan_prompt(["flex"], steps=2)
    entry = comfy.run(_with_other_override(prompt, "other pack", before_set=False))
    report = model_report(comfy, entry, "100")
    assert served(report) == {"flex": 4}, report  # the cross-attention calls: 2 blocks x 2 steps
    assert any("gets each attention call first" in n for n in report["notes"]), report["notes"]


def test_another_packs_override_before_the_node_serves_what_it_passes_on(comfy):
    prompt, _ = wan_prompt(["flex"], steps=4, window=(0.5, 1.0))
    entry = comfy.run(_with_other_override(prompt, "other pack", before_set=True))
    report = model_report(comfy, entry, "100")
    counts = served(report)
    (label,) = [name for name in counts if name != "flex"]
    assert counts["flex"] == 8 and counts[label] == 8, report
    assert label.startswith("previous override: ") and "other_pack_override" in label
    assert report["previous_override"] == label[len("previous override: "):]


def test_a_core_backend_override_after_the_node_is_reported_as_replacing_it(comfy):
    prompt, _ = wan_prompt(["flex"], steps=2)
    entry = comfy.run(_with_other_override(prompt, "core backend", before_set=False))
    report = model_report(comfy, entry, "100")
    assert report["recorder"]["calls"] == 0
    assert report["overridden_by"]["short"] == "Model Attention Backend"
    assert any(n.startswith("Overridden: ComfyUI Model Attention Backend (attention_pytorch)") for n in report["notes"])


def test_comfy_names_at_queue_time(comfy):
    """ComfyUI's own attention names: an alias runs the pack's kernel, a name of ComfyUI's own attention is refused
    with what it is."""
    prompt, _ = wan_prompt(["pytorch"], steps=1)
    report = model_report(comfy, comfy.run(prompt), "100")
    assert served(report) == {"native": 4} and "ComfyUI's name for torch" in report["notes"][0]
    prompt, _ = wan_prompt(["sub_quad"], steps=1)
    status, body = comfy.post_prompt(prompt)
    assert status == 400 and "ComfyUI's own sub-quadratic chunked attention" in json.dumps(body), body


def test_sd15_unet_with_flex(comfy):
    base = comfy.run(sd15_prompt("comfy default"))
    run = comfy.run(sd15_prompt("flex"))
    report = model_report(comfy, run, "10")
    assert set(served(report)) == {"flex"} and report["recorder"]["calls"] == 16, report
    assert {row["site"] for row in report["recorder"]["rows"]} >= {"input.self #0.0", "input.cross #0.0"}
    a, b = latent(comfy, base, "12"), latent(comfy, run, "12")
    assert (a - b).abs().max() <= 1e-3 * max(1.0, float(a.abs().max()))


def test_attention_checks_compare_reports_error(comfy):
    prompt, _ = wan_prompt(["flex"], checks={"mode": "raise", "compare": True, "compare_every": 2}, seed=11)
    entry = comfy.run(prompt)
    checks = [r for r in comfy.reports(entry["prompt_id"]) if r["kind"] == "checks"]
    assert checks and checks[-1]["compare"]["samples"] >= 4, checks
    assert checks[-1]["compare"]["max_rel_error"] < 1e-3
    assert set(served(model_report(comfy, entry, "100"))) == {"flex"}


def test_clip_attention_backend_patches_only_the_clone(comfy):
    def prompt(backend):
        p = {"1": {"class_type": "TestTinyClip", "inputs": {"seed": 5}},
             "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": f"a cat {backend}"}},
             "4": {"class_type": "TestConditioningStats", "inputs": {"conditioning": ["3", 0]}}}
        if backend:
            p["2"] = {"class_type": "SetClipAttentionBackend", "inputs": {"clip": ["1", 0], "backend": backend,
                                                                          "policy": "fallback"}}
            p["3"]["inputs"]["clip"] = ["2", 0]
            p["3"]["inputs"]["text"] = "a cat"
        else:
            p["3"]["inputs"]["text"] = "a cat"
        return p

    plain = comfy.run(prompt(None))
    patched = comfy.run(prompt("native"))
    live = {r["key"]: r["recorder"] for r in comfy.get("/attention_dispatch/report")["live"]}
    rec = live.get("clip:2")
    assert rec and rec["calls"] == 2 and {row["served"] for row in rec["rows"]} == {"native"}, live
    assert patched["outputs"]["2"]["text"][0].startswith("native: patched 2")
    a = json.loads(plain["outputs"]["4"]["text"][0])
    b = json.loads(patched["outputs"]["4"]["text"][0])
    assert a == pytest.approx(b, rel=1e-4)


def test_backends_route(comfy):
    # Trust Remote Kernels is covered through a Set node in test_node_inputs.py (it is no output node any more).
    data = comfy.get("/attention_dispatch/backends")
    names = {b["name"]: b for b in data["backends"]}
    assert names["native"]["available"] and not names["flash"]["available"] and names["flash"]["reasons"]
    assert data["machine"]["device_type"] == "cpu"
    assert '"path"' not in json.dumps(data)
    assert "/extensions/attention_dispatch/attention_dispatch.js" in comfy.get("/extensions")  # WEB_DIRECTORY


def test_example_workflows_match_the_node_schemas(comfy):
    info = comfy.get("/object_info")
    root = Path(__file__).resolve().parents[2] / "example_workflows"
    widget_types = {"COMBO", "FLOAT", "INT", "BOOLEAN", "STRING"}
    for path in sorted(root.glob("*.json")):
        for node in json.loads(path.read_text())["nodes"]:
            if node["type"] in ("Note", "MarkdownNote"):  # the frontend's own notes: never sent to the server
                continue
            assert node["type"] in info, f"{path.name}: unknown node {node['type']}"
            if node["type"] not in NODES + ("ContextParallelAttention",):
                continue
            spec = info[node["type"]]["input"]
            widgets = [name for section in ("required", "optional") for name, s in spec.get(section, {}).items()
                       if s[0] in widget_types or isinstance(s[0], list)]
            assert len(node["widgets_values"]) == len(widgets), (path.name, node["type"], widgets)
            sockets = {i["name"] for i in node["inputs"] if "widget" not in i}  # the frontend lists widgets too
            assert sockets == {name for section in ("required", "optional") for name, s in spec.get(section, {}).items()
                               if name not in widgets}, (path.name, node["type"])


def _combo_options(spec) -> dict[str, list]:
    """{input name: its options} for every combo input of a node's /object_info entry (V3: "COMBO" and its options;
    V1: the list itself)."""
    found = {}
    for section in ("required", "optional"):
        for name, s in spec.get("input", {}).get(section, {}).items():
            if isinstance(s[0], list):
                found[name] = s[0]
            elif s[0] == "COMBO" and len(s) > 1 and isinstance(s[1].get("options"), list):
                found[name] = s[1]["options"]
    return found


def test_example_notes_name_real_options(comfy):
    """What an example's note tells a user to pick exists: "set <input> to a, b or c" names options of that input
    (issue #48: the Context Parallel note offered "heads, ring or sequence"; the node offers off, heads, sequence),
    and every backend-like name in a note (a word with an underscore) is an input or an option of a node there."""
    import re
    info = comfy.get("/object_info")
    root = Path(__file__).resolve().parents[2] / "example_workflows"
    for path in sorted(root.glob("*.json")):
        nodes = json.loads(path.read_text())["nodes"]
        options: dict[str, set] = {}
        names = set()
        for node in nodes:
            if node["type"] in info:
                spec = info[node["type"]]
                names |= {n for section in ("required", "optional") for n in spec["input"].get(section, {})}
                for name, values in _combo_options(spec).items():
                    options.setdefault(name, set()).update(v for v in values if isinstance(v, str))
        notes = [n["widgets_values"][0] for n in nodes if n["type"] in ("Note", "MarkdownNote")]
        assert notes, path.name
        item = r"'?[\w.-]+'?"
        for note in notes:
            for name, values in options.items():
                for match in re.finditer(rf"\b{re.escape(name)}(?: to| =|:) ({item}(?:(?:, or |, | or | and ){item})*)",
                                         note):
                    said = [w.rstrip(".").strip("'") for w in re.split(r", or |, | or | and ", match.group(1))]
                    assert not [w for w in said if w not in values], (path.name, name, said, sorted(values))
            every = set().union(*options.values()) | names
            unknown = [w for w in re.findall(r"\b[a-z][a-z0-9]*_[a-z0-9_]+\b", note) if w not in every]
            assert not unknown, (path.name, unknown)


def test_context_parallel_is_off_by_default_outside_torchrun(comfy):
    """Dropped into an ordinary workflow (ComfyUI not started by torchrun) with its defaults, Context Parallel
    Attention changes nothing and the prompt runs (it used to default to 'heads' and be refused with HTTP 400)."""
    info = comfy.get("/object_info/ContextParallelAttention")["ContextParallelAttention"]
    assert info["input"]["required"]["mode"][1]["default"] == "off"
    prompt, _ = wan_prompt(["native"], seed=31)
    prompt["105"] = {"class_type": "ContextParallelAttention", "inputs": {"model": ["100", 0], "mode": "off",
                                                                         "degree": 0}}
    prompt["101"]["inputs"]["model"] = ["105", 0]
    comfy.run(prompt)
    prompt["105"]["inputs"]["mode"] = "heads"  # asked for explicitly: refused once, with the launch command
    status, body = comfy.post_prompt(prompt)
    assert status == 400 and len(body["node_errors"]["105"]["errors"]) == 1, body
    assert "torchrun --nproc-per-node" in body["node_errors"]["105"]["errors"][0]["details"], body
