"""Tools beside the core: the doctor, the bench, install planning and Hub fetching (`python -m dispatcher ...` in
the ComfyUI pack's folder, `attention-dispatch ...` once installed as a library; `python install.py`). The core
never imports from here."""

import os
import sys

PACK_COMMAND = "python -m dispatcher"  # how the docs of the tools name the command line (the pack's spelling)


def command() -> str:
    """How this copy's command line is started: `attention-dispatch` (the wheel's script), `python -m
    attention_dispatch` (the wheel's import name) or `python -m dispatcher` (the pack's folder)."""
    if os.path.basename(sys.argv[0] or "") in ("attention-dispatch", "attention-dispatch.exe"):
        return "attention-dispatch"
    return f"python -m {__name__.split('.')[0]}"


def named(text: str) -> str:
    """`text` with the command line named the way this copy is started."""
    return text.replace(PACK_COMMAND, command())
