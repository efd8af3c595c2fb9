"""A real ComfyUI with this pack installed, started once per session on 127.0.0.1 (CPU).

Needs COMFYUI_PATH (a ComfyUI checkout you have); COMFYUI_PYTHON is its interpreter (default: this one).
`bash .ci/comfyui-env` prepares that interpreter for the checkout and prints the exports (docs/testing.md).
Without COMFYUI_PATH these tests skip, each saying it wants ComfyUI; with it, a ComfyUI that cannot start fails
them (helpers/comfyui.py).
"""

from __future__ import annotations

import json
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from helpers import comfyui

from . import helper_pack

ROOT = Path(__file__).resolve().parents[2]
COMFYUI_PATH, COMFYUI_PYTHON = comfyui.COMFYUI_PATH, comfyui.COMFYUI_PYTHON

pytestmark = pytest.mark.integration


def require_comfyui() -> None:
    """Skip without COMFYUI_PATH (tests/conftest.py has already marked the tests so); fail when COMFYUI_PATH
    names a ComfyUI that cannot start: asking for the ComfyUI suite never passes by skipping it."""
    if not comfyui.requested():
        pytest.skip(comfyui.SKIP_REASON)
    why = comfyui.broken()
    if why is not None:
        pytest.fail(f"{why}. Set it up with: {comfyui.SETUP_HINT}", pytrace=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _copy_pack(dest: Path) -> None:
    # Only what a user's clone needs at run time (no .venv, tests, .git).
    dest.mkdir(parents=True)
    shutil.copy2(ROOT / "__init__.py", dest / "__init__.py")
    # the examples and locales: the Templates browser's workflows and its title for them
    for folder in ("dispatcher", "nodes", "web", "example_workflows", "locales"):
        shutil.copytree(ROOT / folder, dest / folder, ignore=shutil.ignore_patterns("__pycache__"))
    if (ROOT / "pyproject.toml").exists():
        shutil.copy2(ROOT / "pyproject.toml", dest / "pyproject.toml")


class Comfy:
    def __init__(self, url: str, base: Path, log: Path):
        self.url, self.base, self.log = url, base, log

    def get(self, path: str):
        with urllib.request.urlopen(self.url + path, timeout=60) as r:
            return json.loads(r.read())

    def post_prompt(self, prompt: dict) -> tuple[int, dict]:
        body = json.dumps({"prompt": prompt, "client_id": "attention-dispatch-tests"}).encode()
        req = urllib.request.Request(self.url + "/prompt", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def run(self, prompt: dict, timeout: float = 180) -> dict:
        """Queue a prompt and wait for its history entry; fails with ComfyUI's messages on error."""
        status, body = self.post_prompt(prompt)
        assert status == 200, f"/prompt answered {status}: {body}"
        entry = self.wait(body["prompt_id"], timeout)
        if entry["status"].get("status_str") != "success":
            raise AssertionError(f"prompt failed: {json.dumps(entry['status'])[:4000]}\n{self.tail()}")
        return entry

    def wait(self, pid: str, timeout: float = 180) -> dict:
        """The history entry of a queued prompt once it has finished, successful or not."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            hist = self.get(f"/history/{pid}")
            if pid in hist and hist[pid].get("status", {}).get("completed") is not None:
                entry = hist[pid]
                entry["prompt_id"] = pid
                return entry
            time.sleep(0.2)
        raise AssertionError(f"prompt {pid} did not finish in {timeout}s\n{self.tail()}")

    def reports(self, prompt_id: str) -> list[dict]:
        return [r for r in self.get("/attention_dispatch/report")["reports"] if r.get("prompt_id") == prompt_id]

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


@contextlib.contextmanager
def serve_comfyui(prefix: str, command, ready, start_timeout: float = 120, stop_timeout: float = 20):
    """A temp base dir with the pack, the test helpers and tiny models; `command(base, port)` started there
    (cwd = COMFYUI_PATH) until `ready(server)`; stopped and removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        custom = base / "custom_nodes"
        _copy_pack(custom / "attention_dispatch")
        (custom / "attn_dispatch_test_helpers").mkdir(parents=True)
        (custom / "attn_dispatch_test_helpers" / "__init__.py").write_text(helper_pack.SOURCE)
        models = base / "models" / "diffusion_models"
        models.mkdir(parents=True)
        script = base / "make_models.py"
        script.write_text(helper_pack.MAKE_MODELS)
        made = subprocess.run([COMFYUI_PYTHON, str(script), str(models)], cwd=COMFYUI_PATH, capture_output=True,
                              text=True, timeout=300)
        assert made.returncode == 0, f"making tiny models failed:\n{made.stdout[-2000:]}\n{made.stderr[-4000:]}"
        port = _free_port()
        log = base / "comfyui.log"
        with open(log, "wb") as log_file:
            proc = subprocess.Popen(command(base, port), cwd=COMFYUI_PATH, stdout=log_file, stderr=subprocess.STDOUT)
        server = Comfy(f"http://127.0.0.1:{port}", base, log)
        server.proc = proc
        try:
            deadline = time.time() + start_timeout
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"ComfyUI exited with {proc.returncode}\n{server.tail()}")
                try:
                    if ready(server):
                        break
                except (urllib.error.URLError, ConnectionError, OSError):
                    pass
                if time.time() > deadline:
                    raise AssertionError(f"ComfyUI did not start in {start_timeout:g} s\n{server.tail()}")
                time.sleep(0.5)
            yield server
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(base, ignore_errors=True)


# How a test-only custom node reaches the pack's dispatcher inside the server (a backend can only be registered
# from there): through the Set Attention Backend class ComfyUI loaded, whatever module name the pack got.
_FIND_DISPATCHER = r'''import importlib


def _dispatcher():
    import nodes
    cls = nodes.NODE_CLASS_MAPPINGS.get("SetAttentionBackend")
    if cls is None:  # the pack is not loaded yet
        return None
    return importlib.import_module(cls.__module__.rsplit(".nodes.", 1)[0] + ".dispatcher")
'''


def write_test_node(base: Path, folder: str, source: str) -> None:
    """Custom node `folder` in the server's base directory: `_dispatcher()` (the pack's dispatcher, or None before
    the pack is loaded), then `source`."""
    node = base / "custom_nodes" / folder
    node.mkdir(parents=True, exist_ok=True)
    (node / "__init__.py").write_text(_FIND_DISPATCHER + source)


def main_py(base: Path, port: int) -> list[str]:
    return [COMFYUI_PYTHON, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
            "--base-directory", str(base)]


@pytest.fixture(scope="session")
def comfy():
    require_comfyui()
    with serve_comfyui("attn-dispatch-comfy-", main_py,
                       lambda server: server.get("/object_info/SetAttentionBackend") is not None) as server:
        yield server
