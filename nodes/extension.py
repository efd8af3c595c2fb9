"""The V3 extension ComfyUI loads through `comfy_entrypoint` (ComfyUI only)."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension

from . import cp_runtime, error_names, host_hooks, routes
from .model_nodes import NODES
from .parallel_node import NODES as PARALLEL_NODES


class AttentionDispatchExtension(ComfyExtension):
    async def get_node_list(self):
        # Routes here rather than at import: the server exists by now (main.py creates it before
        # loading custom nodes), and importing the pack outside ComfyUI stays side-effect free.
        routes.register()
        error_names.name_for_comfyui()  # the error dialog names no server path (error_names says why)
        ranks = cp_runtime.setup_from_env()  # under torchrun only: join the ranks, prompts in lockstep
        host_hooks.register(cancel=not ranks)  # tuning's progress text, Cancel, its cache in ComfyUI's user dir
        return list(NODES) + list(PARALLEL_NODES)
