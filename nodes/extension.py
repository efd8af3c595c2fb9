"""The V3 extension ComfyUI loads through `comfy_entrypoint` (ComfyUI only)."""

from __future__ import annotations

from comfy_api.latest import ComfyExtension

from . import routes
from .model_nodes import NODES


class AttentionDispatchExtension(ComfyExtension):
    async def get_node_list(self):
        # Routes here rather than at import: the server exists by now (main.py creates it before
        # loading custom nodes), and importing the pack outside ComfyUI stays side-effect free.
        routes.register()
        return list(NODES)
