"""The browser tests run once per frontend and node mode: ComfyUI's own frontend (what its interpreter has installed,
1.27.10 for ComfyUI 0.3.64) and each frontend in ATTN_DISPATCH_FRONTENDS (folders made with
`pip install --target DIR comfyui-frontend-package==X`, .ci/comfyui-env makes one with the newest), each on the
classic LiteGraph canvas and, where the frontend offers it to users, in "Modern Node Design (Nodes 2.0)".

The interpreter's frontend is served by the integration suite's session ComfyUI (`comfy`); another frontend gets a
ComfyUI of its own started with `--front-end-root` (ComfyUI's flag for a frontend in a folder), once per session.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import comfyui

# tests/ is on sys.path through pyproject.toml's `pythonpath`.
from integration.conftest import comfy, main_py, require_comfyui, serve_comfyui  # noqa: F401  (comfy: a fixture)

CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _missing(message: str):
    """A browser test asked for (COMFYUI_PATH set) that cannot run is a failure, not a pass by skipping."""
    pytest.fail(f"COMFYUI_PATH is set, so the browser tests must run, but {message}", pytrace=False)


def playwright_for(frontend):
    """Playwright's sync API for a page of `frontend`: a failure when Playwright or Chromium is missing, a skip when
    no ComfyUI was given (`frontend` None)."""
    try:
        from playwright import sync_api
    except ImportError:
        _missing("the playwright Python package is not installed (pip install playwright; never its browsers)")
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        _missing(f"no Chromium at {CHROMIUM} (apt-get install chromium, or set CHROMIUM)")
    if frontend is None:
        pytest.skip(comfyui.SKIP_REASON)
    return sync_api


# The user-visible switch of the Vue node mode; 1.27's setting of that id is hidden (a keybinding toggles it).
NODES2_NAME = "Modern Node Design (Nodes 2.0)"


class Frontend:
    """One frontend package: its version, its static folder (None: the one ComfyUI's interpreter has), its modes."""

    def __init__(self, version: str, static: str | None, modes: tuple[str, ...]):
        self.version, self.static, self.modes = version, static, modes

    def __repr__(self):
        return f"Frontend({self.version})"


def _modes(static: str) -> tuple[str, ...]:
    assets = glob.glob(os.path.join(static, "assets", "*.js"))
    offered = any(NODES2_NAME in Path(f).read_text(errors="replace") for f in assets)
    return ("classic", "nodes2") if offered else ("classic",)


def _version_of(package_dir: str) -> str:
    infos = glob.glob(os.path.join(package_dir, "..", "comfyui_frontend_package-*.dist-info"))
    match = re.search(r"comfyui_frontend_package-([^/]+)\.dist-info$", infos[0]) if infos else None
    return match.group(1) if match else "unknown"


def _bundled() -> Frontend:
    """The frontend package of COMFYUI_PYTHON (ComfyUI serves it by default)."""
    out = subprocess.run([comfyui.COMFYUI_PYTHON, "-c", "import comfyui_frontend_package as p, os; "
                          "print(os.path.dirname(p.__file__))"], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        return Frontend("bundled", None, ("classic",))
    package = out.stdout.strip().splitlines()[-1]
    return Frontend(_version_of(package), None, _modes(os.path.join(package, "static")))


def _extra() -> list[Frontend]:
    found = []
    for folder in os.environ.get("ATTN_DISPATCH_FRONTENDS", "").split(os.pathsep):
        package = os.path.join(folder, "comfyui_frontend_package")
        if folder and os.path.isdir(os.path.join(package, "static")):
            found.append(Frontend(_version_of(package), os.path.join(package, "static"),
                                  _modes(os.path.join(package, "static"))))
        elif folder:
            found.append(Frontend(f"missing:{folder}", folder, ("classic",)))
    return found


def frontend_params() -> list:
    """(frontend, mode) pairs for the `ui` fixture; without COMFYUI_PATH one placeholder (the tests skip)."""
    if not comfyui.requested() or comfyui.broken():
        return [pytest.param((None, "classic"), id="no-comfyui")]
    return [pytest.param((fe, mode), id=f"fe{fe.version}-{mode}")
            for fe in [_bundled(), *_extra()] for mode in fe.modes]


@pytest.fixture(scope="session")
def frontend_servers(request):
    """A ComfyUI per extra frontend, started on first use and kept for the session."""
    servers, stack = {}, contextlib.ExitStack()

    def get(frontend: Frontend):
        if frontend.static is None:
            return request.getfixturevalue("comfy")
        if frontend.version.startswith("missing:"):
            pytest.fail(f"ATTN_DISPATCH_FRONTENDS names {frontend.static}, which holds no comfyui_frontend_package "
                        "(make it with: pip install --target DIR comfyui-frontend-package==X)", pytrace=False)
        if frontend.static not in servers:
            require_comfyui()
            command = lambda base, port: main_py(base, port) + ["--front-end-root", frontend.static]  # noqa: E731
            servers[frontend.static] = stack.enter_context(serve_comfyui(
                f"attn-dispatch-fe{frontend.version}-", command,
                lambda server: server.get("/object_info/SetAttentionBackend") is not None))
        return servers[frontend.static]

    with stack:
        yield get
