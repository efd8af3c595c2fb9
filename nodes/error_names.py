"""Readable names for the library's exceptions in ComfyUI's error dialog.

Why: ComfyUI names an exception by `type.__module__` + `__qualname__`, and it loads a pack under its folder's
path, so an error raised while sampling reached the UI as `/.../custom_nodes/<pack>.dispatcher.guard.
AttentionQualityError`: the server's absolute path, and a module no user can import. Each public exception
gets the module it is exported from in the installed library (`attention_dispatch`, whose public names these
are), so the dialog reads `attention_dispatch.AttentionQualityError: <message>`. Only the display name
changes: nothing here pickles these exceptions.
"""

from __future__ import annotations

from .. import dispatcher
from ..dispatcher import parallel

PUBLIC = {"attention_dispatch": dispatcher, "attention_dispatch.parallel": parallel}


def public_exceptions() -> dict[type, str]:
    """Every exception class the library exports -> the public module it is exported from."""
    out: dict[type, str] = {}
    for public, module in PUBLIC.items():
        for name in getattr(module, "__all__", ()):
            obj = getattr(module, name, None)
            if isinstance(obj, type) and issubclass(obj, BaseException) and obj not in out:
                out[obj] = public
    return out


def name_for_comfyui() -> None:
    """Give each public exception its public module name (idempotent)."""
    for cls, public in public_exceptions().items():
        cls.__module__ = public
