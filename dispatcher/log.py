"""The library's one logger. Every runtime line goes through `logging` under the name `attention_dispatch` and
starts with PREFIX: ComfyUI's console prints bare messages, so the prefix is what says whose line it is."""

from __future__ import annotations

import logging

PREFIX = "[attention-dispatch]"


class _Prefixed(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"{PREFIX} {msg}", kwargs


logger = _Prefixed(logging.getLogger("attention_dispatch"), {})
