"""Importing the library changes nothing process-wide (warning filters, logging handlers), and every line it logs
goes through its one logger with its one prefix."""

from __future__ import annotations

import ast
import json
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

# Prints what importing every module of the pack changed (warning filters added, root logging handlers) and the
# modules it brought in besides its own (torch's lazy submodules, sympy, ...). With those names as its argument it
# imports them first: what they set at their own import (torch 2.14's inductor adds a sympy warning filter) is then
# in place before the snapshot, and what is left is what the pack's own modules add.
IMPORT_ALL = """
import importlib, json, logging, pkgutil, sys, warnings
import numpy, torch  # their own filters, set at their import
for name in json.loads(sys.argv[1]) if len(sys.argv) > 1 else []:
    try:
        importlib.import_module(name)
    except Exception:  # a module that imports only as part of its package: it comes with the pack's imports
        pass
before = set(sys.modules)
filters, handlers = list(warnings.filters), list(logging.getLogger().handlers)
import dispatcher
for m in pkgutil.walk_packages(dispatcher.__path__, "dispatcher."):
    if m.name != "dispatcher.parallel.example":  # a script: it starts torch.distributed ranks
        importlib.import_module(m.name)
print(json.dumps({"filters": [str(f) for f in warnings.filters if f not in filters],
                  "handlers": logging.getLogger().handlers != handlers,
                  "brought_in": [m for m in sys.modules if m not in before and m.split(".")[0] != "dispatcher"]}))
"""


def _changes_on_import(preimported=()):
    run = subprocess.run([sys.executable, "-c", IMPORT_ALL, json.dumps(list(preimported))], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_importing_every_module_leaves_warning_filters_and_logging_alone():
    changes = _changes_on_import()
    if changes["filters"] or changes["handlers"]:  # the pack's, or those of what it imports? Import those first
        changes = _changes_on_import(changes["brought_in"])
    assert not changes["filters"], changes["filters"]
    assert not changes["handlers"]


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
