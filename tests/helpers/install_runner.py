"""Run the real `install.py` in a fresh interpreter, after registering test backends.

    python tests/helpers/install_runner.py CONFIG.json

CONFIG: {"backends": [{"name", "repo_id", "version", "revision"?}],
         "steps": [{"id", "argv": [...], "env": {var: value}}]}
HF_ENDPOINT / HF_HUB_CACHE / HF_HUB_OFFLINE are read when huggingface_hub is imported, so the test
sets them for the whole process; the dispatcher's own variables (trust, lock path) are read per call
and may differ per step. Before each step the runner requests `<HF_ENDPOINT>/_mark/<id>` so the fake
Hub's request log can be split per step. After each step it records the lock file's text and the
cache's top-level entries. Prints one line: RESULTS {json}.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root
STEP_VARS = ("DIFFUSERS_DISABLE_REMOTE_CODE", "DIFFUSERS_TRUST_REMOTE_KERNELS", "ATTN_DISPATCH_KERNEL_LOCK",
             "LOCAL_KERNELS")


def _mark(step_id: str) -> None:
    endpoint = os.environ.get("HF_ENDPOINT")
    if not endpoint or os.environ.get("INSTALL_RUNNER_NO_MARKS"):
        return
    import urllib.request
    with contextlib.suppress(Exception):
        urllib.request.urlopen(f"{endpoint}/_mark/{step_id}", timeout=5).read()


def main(argv: list[str]) -> int:
    config = json.loads(Path(argv[1]).read_text())
    sys.path.insert(0, str(ROOT))
    import dispatcher
    from dispatcher import registry

    flash_hub_fn = registry.get("flash_hub").fn
    for b in config.get("backends", []):
        dispatcher.register_backend(
            b["name"], flash_hub_fn, devices=("cpu",), causal=True, lse=True, dropout=True, gqa=True,
            hub_kernel=dispatcher.HubKernel(b["repo_id"], b.get("function", "flash_attn_func"),
                                            version=b.get("version"), revision=b.get("revision")))
    base_env = {var: os.environ[var] for var in STEP_VARS if var in os.environ}
    results = []
    for step in config["steps"]:
        for var in STEP_VARS:
            os.environ.pop(var, None)
        os.environ.update(base_env)
        os.environ.update(step.get("env", {}))
        registry.forget_availability()
        _mark(step["id"])
        stdout, stderr = io.StringIO(), io.StringIO()
        sys.argv = [str(ROOT / "install.py"), *step["argv"]]
        code = None
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            try:
                runpy.run_path(str(ROOT / "install.py"), run_name="__main__")
            except SystemExit as exc:
                code = exc.code
        lock = os.environ.get("ATTN_DISPATCH_KERNEL_LOCK")
        cache = os.environ.get("HF_HUB_CACHE")
        results.append({"id": step["id"], "rc": code, "stdout": stdout.getvalue(), "stderr": stderr.getvalue(),
                        "lock": Path(lock).read_text() if lock and Path(lock).is_file() else None,
                        "cache": sorted(p.name for p in Path(cache).iterdir()) if cache and Path(cache).is_dir()
                        else []})
    _mark("end")
    print("RESULTS " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
