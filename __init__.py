"""ComfyUI Attention Dispatch: a ComfyUI custom-node pack (clone it into ComfyUI/custom_nodes/).

ComfyUI registers this folder under its file path as the module name, so everything inside uses
relative imports only. The V3 extension (which imports comfy_api) loads lazily, so this package
also imports outside ComfyUI (the CI tests do that).
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes.extension import AttentionDispatchExtension  # only under ComfyUI: imports comfy_api

    return AttentionDispatchExtension()
