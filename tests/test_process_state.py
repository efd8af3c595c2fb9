"""Importing the library changes nothing process-wide (warning filters, logging handlers), and every line it logs
goes through its one logger with its one prefix."""

from __future__ import annotations

import ast
import logging
import subprocess
import sys
import warnings
from pathlib import Path

import torch

import dispatcher
from dispatcher import dispatch_attention_fn
from dispatcher.log import PREFIX

ROOT = Path(__file__).resolve().parent.parent

IMPORT_ALL = """
import importlib, logging, pkgutil, sys, warnings
import numpy, torch  # their own filters, set at their import
filters, handlers = list(warnings.filters), list(logging.getLogger().handlers)
import dispatcher
for m in pkgutil.walk_packages(dispatcher.__path__, "dispatcher."):
    if m.name != "dispatcher.parallel.example":  # a script: it starts torch.distributed ranks
        importlib.import_module(m.name)
assert warnings.filters == filters, [f for f in warnings.filters if f not in filters]
assert logging.getLogger().handlers == handlers
print("unchanged")
"""


def test_importing_every_module_leaves_warning_filters_and_logging_alone():
    run = subprocess.run([sys.executable, "-c", IMPORT_ALL], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "unchanged" in run.stdout, run.stderr[-3000:]


def test_eager_flex_is_quiet_without_a_filter_left_behind():
    q = torch.randn(1, 16, 2, 16)
    before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dispatch_attention_fn(q, q, q, backend="flex")
        inside = list(warnings.filters)
    assert not [w for w in caught if "without torch.compile" in str(w.message)]
    assert list(warnings.filters) == before and inside[0][0] == "always"


def test_runtime_lines_carry_the_prefix(caplog):
    q = torch.randn(1, 16, 2, 16)
    v = q.clone()
    v[0, 0, 0, 0] = float("nan")
    with caplog.at_level(logging.WARNING, logger="attention_dispatch"), dispatcher.attention_checks("warn"):
        dispatch_attention_fn(q, q, v, backend="native")
    messages = [r.getMessage() for r in caplog.records if r.name == "attention_dispatch"]
    assert len(messages) >= 2 and all(m.startswith(PREFIX + " ") for m in messages), messages


def test_one_logger_for_the_library_and_the_nodes():
    """No module makes a logger of its own or prints at run time (the CLI tools print their output)."""
    for path in [*(ROOT / "dispatcher").rglob("*.py"), *(ROOT / "nodes").rglob("*.py")]:
        if path.name == "log.py" or "tools" in path.parts or path.name == "example.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "getLogger":
                raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} makes its own logger")
