"""The house rules of docs/layout.md, read from the code's own imports (AST, nothing is run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dispatcher"
COMFY_NAMES = {"comfy", "comfy_api", "comfy_extras", "nodes", "server", "utils", "folder_paths", "execution"}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Modules of the package this file imports (resolved relative imports), and absolute top-level names."""
    module = _module(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
                if node.module:
                    found.add(target)
                found.update(f"{target}.{alias.name}" for alias in node.names)  # `from . import x` (or a name)
            else:
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def _relative(path: Path, name: str) -> bool:
    return not any(isinstance(node, ast.Import) and any(a.name == name for a in node.names) or
                   isinstance(node, ast.ImportFrom) and not node.level and node.module == name
                   for node in ast.walk(ast.parse(path.read_text())))


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {t for t in _imports(path) if t in files and t != name} for name, path in files.items()}


def test_the_library_never_imports_comfyui_or_uses_absolute_self_imports():
    for path in PACKAGE.rglob("*.py"):
        tops = {name.split(".")[0] for name in _imports(path) if not name.startswith("dispatcher")}
        assert not tops & COMFY_NAMES, (path, tops & COMFY_NAMES)
        # Relative imports only: the folder is installed under another name (attention_dispatch) too.
        absolute = [n for n in _imports(path) if n == "dispatcher" or n.startswith("dispatcher.")
                    if not _relative(path, n)]
        assert not absolute or path.name == "example.py", (path, absolute)


def test_no_import_cycle():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in graph:
        if node not in state:
            visit(node, [node])


def test_wings_are_reached_only_from_above():
    """The core never imports the tools or `auto`; `auto` never imports the tools; parallel sits above dispatch."""
    graph = _graph()
    for name, targets in graph.items():
        wing = name.split(".")[1] if name.count(".") >= 1 else ""
        core = wing not in ("tools", "auto", "parallel", "__main__") and name != "dispatcher"
        if core:
            assert not [t for t in targets if t.startswith(("dispatcher.tools", "dispatcher.auto", "dispatcher.parallel"))], (
                name, targets)
        if wing == "auto":
            assert not [t for t in targets if t.startswith("dispatcher.tools")], (name, targets)


def test_nodes_reach_kernels_only_through_the_registry():
    """No module of nodes/ imports a backend's module (dispatcher/backends/*): a backend's own options come from its
    spec (`BackendSpec.options`), its name from the registry, so a node never special-cases one kernel's code."""
    for path in (ROOT / "nodes").rglob("*.py"):
        reached = sorted(name for name in _imports(path) if name.startswith("dispatcher.backends"))
        assert not reached, (path.name, reached)


def _exported(init: Path) -> set[str]:
    """The names a package's `__init__.py` lists in `__all__` (read, not imported)."""
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


# The library's public modules and what each exports: the package, and its context-parallel wing (imported only
# where it is used: importing it installs its router).
PUBLIC = {"dispatcher": _exported(PACKAGE / "__init__.py"),
          "dispatcher.parallel": _exported(PACKAGE / "parallel" / "__init__.py")}


def _library_imports(source: str, module: str) -> list[tuple[str, str]]:
    """(module, name) of every name module `module` of the pack (its source) imports from the library."""
    package = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.split(".")
            base = base[: len(base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            if target == "":  # `from .. import dispatcher`: the package itself
                found += [("", alias.name) for alias in node.names if alias.name == "dispatcher"]
            elif target == "dispatcher" or target.startswith("dispatcher."):
                found += [(target, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.split(".")[0] == "dispatcher"]
    return found


def _private(source: str, module: str) -> list[str]:
    """What `module` imports from the library that is not a public name: the package itself, a name its `__all__`
    exports, its public wing, or a name the wing's `__all__` exports."""
    return [f"{name or target} from {target or 'the pack'}" for target, name in _library_imports(source, module)
            if not ((target == "" and name == "dispatcher") or name in PUBLIC.get(target, ())
                    or f"{target}.{name}" in PUBLIC)]


def test_nodes_import_only_the_librarys_public_names():
    """The ComfyUI side reaches the library through its public names alone, as any other host would: never a
    module of the library by its path, never a name it does not export. A name a node needs is exported
    deliberately first (dispatcher/__init__.py)."""
    assert PUBLIC["dispatcher"] and PUBLIC["dispatcher.parallel"]
    for path in sorted((ROOT / "nodes").rglob("*.py")):
        assert not _private(path.read_text(), _module(path)), (path.name, _private(path.read_text(), _module(path)))


@pytest.mark.parametrize("source", ["from ..dispatcher.decisions import exact_stand_in\n",
                                    "from ..dispatcher import registry\n",
                                    "from ..dispatcher.parallel.replicated import ReplicatedConfig\n",
                                    "from ..dispatcher.parallel import comm\n"])
def test_the_public_names_check_finds_a_private_import(source):
    assert _private(source, "nodes.bad")
    assert not _private("from ..dispatcher import Rules, auto, parallel\nfrom .. import dispatcher\n", "nodes.bad")


def _module_aliases(tree) -> set[str]:
    """The names a file binds to modules of the package (`from .. import dispatch` -> dispatch)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level and node.module is None:
            found.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
    return found


def test_no_module_writes_another_modules_private_globals():
    """A module's private globals are written by that module only: a wing that hooks into the core (parallel's
    router) does it through a function the core owns (dispatch.install_router / route_calls)."""
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        modules = _module_aliases(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AugAssign, ast.AnnAssign)) else []
            for target in targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and \
                        target.value.id in modules and target.attr.startswith("_"):
                    raise AssertionError(f"{path.relative_to(ROOT)}:{node.lineno} writes "
                                         f"{target.value.id}.{target.attr}")


# What only some ComfyUI versions have (0.38's core override nodes, its containers, a checkpoint's embedded method,
# the UNet's block position, the forward marker block ordinals read for models that pass no position): named by
# nodes/comfy_versions.py alone, so a version's quirk is found, and changed, in one module.
VERSION_MARKERS = ("set_model_optimized_attention", "comfy.model_patcher", "comfy_extras.", "comfy.ldm", "peek",
                   "comfy_attention", "transformer_index", "cond_or_uncond")


def _code_names(tree) -> list[str]:
    """String constants (docstrings left out), attribute names and imported modules of one file."""
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.append(node.value)
        elif isinstance(node, ast.Attribute):
            found.append(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append(node.module)
    return found


def test_comfyui_version_quirks_live_in_one_module():
    for path in (ROOT / "nodes").rglob("*.py"):
        if path.name == "comfy_versions.py":
            continue
        named = [(marker, text) for text in _code_names(ast.parse(path.read_text())) for marker in VERSION_MARKERS
                 if marker in text]
        assert not named, (path.name, named)
