"""Shared fixtures: a clean dispatcher state for every test, and the `gpu` marker."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dispatcher  # from the repository root: pyproject.toml's `pythonpath` puts it (and tests/) on sys.path
from dispatcher import registry
from helpers.dispatcher_state import remove_custom_backends, reset

ROOT = Path(__file__).resolve().parent.parent

# Env vars the dispatcher reads; a developer's shell must not change what the suite sees.
_DISPATCHER_ENV = ("DIFFUSERS_ATTN_BACKEND", "DIFFUSERS_ATTN_CHECKS", "DIFFUSERS_DISABLE_REMOTE_CODE",
                   "DIFFUSERS_TRUST_REMOTE_KERNELS")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (tests under tests/gpu/); skipped without one")
    config.addinivalue_line("markers", "slow: slow but run by default (torch.compile on the CPU)")


def pytest_collection_modifyitems(config, items):
    gpu_dir = ROOT / "tests" / "gpu"
    for item in items:
        if Path(str(item.fspath)).resolve().is_relative_to(gpu_dir):
            item.add_marker(pytest.mark.gpu)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
