"""Read-only HTTP routes: the latest reports and every backend with why it can or cannot run here.

They take no input (no query string is read) and return no file paths (Hub kernel cache paths are
dropped, paths quoted in reasons and errors become '<path>'), so they reach nothing on disk.
"""

from __future__ import annotations

from dataclasses import asdict

from ..dispatcher import current_machine, list_backends, loaded_kernels
from . import comfy_versions, raw_prompt, reports

_registered = False


def _without_path(kernel: dict) -> dict:
    return {k: v for k, v in kernel.items() if k != "path"}


def backends_payload() -> dict:
    rows = []
    for status in list_backends():
        row = status.as_dict()
        row["loaded"] = [_without_path(k) for k in row.get("loaded", [])]
        rows.append(row)
    machine = asdict(current_machine())
    # reasons quote import errors and lock files, which name paths: scrubbed like the reports
    # ComfyUI's own attention names: the backend each one runs here, or why it is refused
    names = {name: {"backend": comfy_versions.resolve(name) if comfy_versions.not_offered(name) is None else None,
                    "what": what, "refused": comfy_versions.not_offered(name)}
             for name, (_, what) in comfy_versions.COMFY_NAMES.items()}
    return reports.scrub({"backends": rows, "loaded_kernels": [_without_path(k.as_dict()) for k in loaded_kernels()],
                          "machine": machine, "comfy_names": names})


def register() -> None:
    """Add the routes to ComfyUI's server (once); called when the extension loads."""
    global _registered
    if _registered:
        return
    from aiohttp import web
    from server import PromptServer

    routes = PromptServer.instance.routes
    # raw BOOLEAN values for the queue-time checks (ComfyUI turns "no" into True before they run)
    PromptServer.instance.add_on_prompt_handler(raw_prompt.remember)

    @routes.get("/attention_dispatch/report")
    async def _report(request):
        return web.json_response(reports.latest())

    @routes.get("/attention_dispatch/backends")
    async def _backends(request):
        return web.json_response(backends_payload(), dumps=_dumps)

    _registered = True


def _dumps(obj) -> str:
    import json
    return json.dumps(obj, default=str)
