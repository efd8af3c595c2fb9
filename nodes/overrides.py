"""Other attention overrides on ComfyUI's one `optimized_attention_override` key: who they are, which override each
passes calls on to, and chains that loop.

Why here: ComfyUI has one key for every pack and core node (contract §1.5, §1.7). Newer ComfyUI writes it from two
core nodes: "Model Attention Backend" (`ModelPatcher.set_model_optimized_attention`, a closure that calls one
backend and never passes a call on) and "Model Sparse Attention" (a closure over `previous`, which it calls for
the calls it keeps dense, and which re-installs itself on top of the key every step). The node's report names the
override that served the calls this pack passed on, and says when one installed after it never passes calls on.
Nothing here imports ComfyUI; how each ComfyUI version's core nodes are recognised is nodes/comfy_versions.py's.
"""

from __future__ import annotations

from .comfy_versions import core_override
from .override_config import OverrideConfig

_LINK_NAMES = ("previous", "prev", "inner")  # what an override that chains usually calls the one it wraps


class OverrideChainError(RuntimeError):
    """An override chain that loops (a call passed on comes back to an override that already passed it on)."""


def _closure(fn) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells:
        return {}
    values = {}
    for name, cell in zip(code.co_freevars, cells):
        try:
            values[name] = cell.cell_contents
        except ValueError:  # an empty cell
            pass
    return values


def kind(fn) -> str:
    """'ours' | 'context_parallel' | 'core_backend' | 'core_sparse' | 'other' (None: 'none')."""
    if fn is None:
        return "none"
    if isinstance(getattr(fn, "config", None), OverrideConfig):
        return "ours"
    if getattr(fn, "attention_dispatch_cp", None) is not None:
        return "context_parallel"
    return core_override(fn) or "other"


def describe(fn) -> str:
    """A name for the report: which override this is, as a user would recognise it."""
    what = kind(fn)
    if what == "none":
        return "none"
    if what == "ours":
        config = fn.config
        label = getattr(config.recorder, "label", "")
        if not label and config.backend == "pass through":
            return "Attention Checks"  # around an override that is not this pack's
        return label or f"Set Attention Backend ({config.backend})"
    if what == "context_parallel":
        return "Context Parallel Attention"
    if what == "core_backend":
        inner = _closure(fn).get("optimized_attention")
        name = getattr(inner, "__name__", None)
        return f"ComfyUI Model Attention Backend ({name})" if name else "ComfyUI Model Attention Backend"
    if what == "core_sparse":
        return "ComfyUI Model Sparse Attention"
    # ComfyUI imports a custom node pack under its folder's path: the folder's name is what a user recognises
    module = (getattr(fn, "__module__", "") or "").replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}" if module else name


def short_name(fn) -> str:
    """A few words for a badge: the core node's name, or the override's own name."""
    what = kind(fn)
    if what == "core_backend":
        return "Model Attention Backend"
    if what == "core_sparse":
        return "Model Sparse Attention"
    if what in ("ours", "context_parallel", "none"):
        return describe(fn)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return name.rsplit(".", 1)[-1]


def passes_to(fn):
    """The override `fn` passes the calls it does not take to: a list (empty: it passes none on, only to ComfyUI's
    own attention or its one backend), or None when that cannot be told from outside."""
    what = kind(fn)
    if what == "none" or what == "core_backend":
        return []
    if what == "ours":
        config = fn.config
        previous = config.previous  # "comfy default" passes every call to ComfyUI's attention, never to it
        return [] if previous is None or config.backend == "comfy default" else [previous]
    closure = _closure(fn)
    for name in _LINK_NAMES:
        if name in closure:  # a closure over its predecessor; None: it passes calls to ComfyUI's own attention
            link = closure[name]
            return [link] if callable(link) else []
        link = getattr(fn, name, None)
        if callable(link):
            return [link]
    if what in ("context_parallel", "core_sparse"):
        return []  # their link is None: they pass calls to ComfyUI's own attention
    return None


def chain(top) -> tuple[list, bool]:
    """(the overrides reached from `top`, top first; whether the end is known). Raises OverrideChainError when
    the chain comes back to an override it passed."""
    seen, order, current = set(), [], top
    while current is not None:
        if id(current) in seen:
            loop = " -> ".join(describe(o) for o in order + [current])
            raise OverrideChainError(
                f"the attention override chain loops: {loop}. Each override passes the calls it does not take to the "
                "one installed before it, so this chain would never end. Remove one of these attention nodes (or the "
                "pack that rewires the override) and queue again.")
        seen.add(id(current))
        order.append(current)
        links = passes_to(current)
        if links is None:
            return order, False
        current = links[0] if links else None
    return order, True


def reaches(top, target) -> bool | None:
    """Whether calls reach `target` through `top`'s chain: True, False, or None when an override on the way does
    not say where it passes calls."""
    order, known = chain(top)
    if any(o is target for o in order):
        return True
    return False if known else None
