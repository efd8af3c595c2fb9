"""Import the pack's V3 node classes without ComfyUI: a stand-in `comfy_api.latest.io` and `comfy.patcher_extension`.

Only what the node modules touch at import and in `execute`/`validate_inputs` exists (schemas are never
built here: the real ones are checked inside ComfyUI by tests/integration). `FakeModel` behaves like a
ModelPatcher where it matters: `clone()` deep-copies `model_options`, and wrappers go into
`model_options["transformer_options"]["wrappers"]` like `add_wrapper_with_key` does.
"""

from __future__ import annotations

import copy
import importlib
import sys
import types

from helpers.pack import PACK, load_pack

STUB_NAMES = ("comfy_api", "comfy_api.latest", "comfy", "comfy.patcher_extension")


class _Anything:
    """Any attribute, any call: the schema helpers (io.Combo.Input(...), io.Custom(...).Output(...))."""

    def __getattr__(self, name):
        return _Anything()

    def __call__(self, *args, **kwargs):
        return _Anything()


class NodeOutput:
    def __init__(self, *result, ui=None, **kwargs):
        self.result, self.ui = result, ui


class ComfyNode:
    hidden = types.SimpleNamespace(unique_id="7")


class _Io(_Anything):
    ComfyNode = ComfyNode
    NodeOutput = NodeOutput


def stub_modules() -> dict[str, types.ModuleType]:
    comfy_api, latest = types.ModuleType("comfy_api"), types.ModuleType("comfy_api.latest")
    latest.io = _Io()
    latest.ComfyExtension = type("ComfyExtension", (), {})
    comfy_api.latest = latest
    comfy, patcher = types.ModuleType("comfy"), types.ModuleType("comfy.patcher_extension")
    patcher.WrappersMP = types.SimpleNamespace(OUTER_SAMPLE="outer_sample", APPLY_MODEL="apply_model")
    comfy.patcher_extension = patcher
    return {"comfy_api": comfy_api, "comfy_api.latest": latest, "comfy": comfy, "comfy.patcher_extension": patcher}


_model_nodes = None


def install(monkeypatch):
    """Put the stand-ins into sys.modules for one test (monkeypatch undoes it); the node module, imported once."""
    global _model_nodes
    for name, module in stub_modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    if _model_nodes is None:
        load_pack()
        _model_nodes = importlib.import_module(f"{PACK}.nodes.model_nodes")
    return _model_nodes


class FakeModel:
    def __init__(self, model_options=None):
        self.model_options = {"transformer_options": {}} if model_options is None else model_options

    def clone(self):
        return FakeModel(copy.deepcopy(self.model_options))

    def add_wrapper_with_key(self, kind, key, fn):
        wrappers = self.model_options.setdefault("transformer_options", {}).setdefault("wrappers", {})
        wrappers.setdefault(kind, {}).setdefault(key, []).append(fn)

    @property
    def override(self):
        return self.model_options["transformer_options"].get("optimized_attention_override")

    def outer_wrappers(self):
        return self.model_options["transformer_options"].get("wrappers", {}).get("outer_sample", {}).get(
            "attention_dispatch", [])
