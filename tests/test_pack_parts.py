"""Pack pieces that run without ComfyUI: text-encoder patch discovery, reports, the backends route payload,
the package entry points, and the example workflows' shape."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import torch

from helpers.pack import PACK, comfy_func, load_pack

load_pack()
clip_patch = importlib.import_module(f"{PACK}.nodes.clip_patch")
reports = importlib.import_module(f"{PACK}.nodes.reports")
routes = importlib.import_module(f"{PACK}.nodes.routes")
adapter = importlib.import_module(f"{PACK}.nodes.adapter")
dispatcher = importlib.import_module(f"{PACK}.dispatcher")
ROOT = Path(__file__).resolve().parent.parent
OUR_NODES = {"SetAttentionBackend", "SetClipAttentionBackend", "AttentionChecks", "SparseAttentionOptions",
             "TrustRemoteKernels", "ContextParallelAttention"}


class Attention(torch.nn.Module):  # shaped like comfy.clip_model.CLIPAttention
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(64, 64)

    def forward(self, x, mask=None, optimized_attention=None):
        return self.proj(optimized_attention(x, x, x, 2, mask))


class Layer(torch.nn.Module):  # passes the function down, like CLIPLayer
    def __init__(self):
        super().__init__()
        self.self_attn = Attention()

    def forward(self, x, mask=None, optimized_attention=None):
        return self.self_attn(x, mask, optimized_attention)


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([Layer(), Layer()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x, None, comfy_func)
        return x


def test_clip_patch_finds_innermost_attention_and_redirects_it():
    enc = Encoder()
    assert clip_patch.attention_module_paths(enc) == ["layers.0.self_attn", "layers.1.self_attn"]
    x = torch.randn(1, 5, 64)
    expected = enc(x)
    rec = dispatcher.Recorder()
    override = adapter.make_override("native", recorder=rec)
    paths = clip_patch.attention_module_paths(enc)
    for index, path in enumerate(paths):
        module = dict(enc.named_modules())[path]
        # what add_object_patch does on a clone (patch_clip), each layer named by its place
        module.forward = clip_patch.patched_forward(module, override, index, len(paths))
    torch.testing.assert_close(enc(x), expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(enc(x), expected, atol=1e-5, rtol=1e-4)  # a second encode: the same blocks
    rows = {(r["site"], r["served"]): r["calls"] for r in rec.snapshot()["rows"]}
    assert rows == {("text_encoder.self #0", "native"): 2, ("text_encoder.self #1", "native"): 2}


def test_reports_store_outside_comfyui():
    reports.clear()
    report = reports.publish("model", 7, {"backend": "native"})
    assert report["node"] == "7" and report["prompt_id"] is None
    rec = dispatcher.Recorder()
    reports.track_live("clip:1", rec)
    latest = reports.latest()
    assert latest["reports"][-1]["backend"] == "native" and latest["live"][0]["key"] == "clip:1"
    json.dumps(latest)


def test_backends_payload_is_json_and_has_no_paths():
    payload = routes.backends_payload()
    names = [b["name"] for b in payload["backends"]]
    assert names == dispatcher.backend_names()
    assert all("reasons" in b and "available" in b for b in payload["backends"])
    text = json.dumps(payload, default=str)
    assert '"path"' not in text and payload["machine"]["device_type"]


def test_package_entry_points():
    pack = importlib.import_module(PACK)
    assert pack.WEB_DIRECTORY == "./web" and (ROOT / "web").is_dir()
    import inspect
    assert inspect.iscoroutinefunction(pack.comfy_entrypoint)
    assert not hasattr(pack, "NODE_CLASS_MAPPINGS")  # it would make ComfyUI ignore comfy_entrypoint


def test_example_workflows_are_ui_format_and_cover_every_node():
    seen = set()
    for path in sorted((ROOT / "example_workflows").glob("*.json")):
        wf = json.loads(path.read_text())
        ids = {n["id"] for n in wf["nodes"]}
        for link in wf["links"]:
            assert link[1] in ids and link[3] in ids, path.name
        seen |= {n["type"] for n in wf["nodes"]} & OUR_NODES
    assert seen == OUR_NODES
