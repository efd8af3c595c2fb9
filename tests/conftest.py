"""Shared fixtures: a clean dispatcher state for every test, and the `gpu` marker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import dispatcher  # from the repository root: pyproject.toml's `pythonpath` puts it (and tests/) on sys.path
from dispatcher import registry
from helpers import comfyui
from helpers.dispatcher_state import remove_custom_backends, reset

ROOT = Path(__file__).resolve().parent.parent

# Env vars the dispatcher reads; a developer's shell must not change what the suite sees.
_DISPATCHER_ENV = ("DIFFUSERS_ATTN_BACKEND", "DIFFUSERS_ATTN_CHECKS", "DIFFUSERS_DISABLE_REMOTE_CODE",
                   "DIFFUSERS_TRUST_REMOTE_KERNELS")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (tests under tests/gpu/); skipped without one")
    config.addinivalue_line("markers", "slow: slow but run by default (torch.compile on the CPU)")
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")  # under pytest-xdist (-n): the cores shared out
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def pytest_collection_modifyitems(config, items):
    gpu_dir = ROOT / "tests" / "gpu"
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(gpu_dir):
            item.add_marker(pytest.mark.gpu)
    if not comfyui.requested():  # the integration and browser tests: one reason each (helpers/comfyui.py)
        for item in items:
            if "integration" in item.keywords:
                item.add_marker(pytest.mark.skip(reason=comfyui.SKIP_REASON))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """How many tests ran, and how many were skipped for want of ComfyUI (CI has none; docs/testing.md)."""
    stats = terminalreporter.stats
    ran = sum(len([r for r in stats.get(key, []) if r.when == "call"]) for key in ("passed", "failed"))
    skipped = [r for r in stats.get("skipped", [])]
    wants_comfyui = sum(1 for r in skipped if comfyui.SKIP_PREFIX in str(r.longrepr))
    where = f"ComfyUI at {comfyui.COMFYUI_PATH}" if comfyui.requested() else "no ComfyUI (COMFYUI_PATH unset)"
    terminalreporter.write_line(f"attention-dispatch: {ran} tests ran, {len(skipped)} skipped, of which "
                                f"{wants_comfyui} for want of ComfyUI; {where}")


@pytest.fixture(autouse=True)
def clean_dispatcher(monkeypatch):
    """Every test starts from defaults, with no dispatcher env var set, and leaves no custom backend behind."""
    for var in _DISPATCHER_ENV:
        monkeypatch.delenv(var, raising=False)
    # `auto` decisions stay in memory: no test writes the user's tuning cache in ~/.cache.
    monkeypatch.setenv("ATTN_DISPATCH_TUNE_CACHE", "off")
    before = set(registry.names())
    reset(dispatcher)
    yield
    remove_custom_backends(dispatcher, before)
    reset(dispatcher)
