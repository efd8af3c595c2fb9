"""The library's one logger, and the one way anything a user typed is echoed back.

Every runtime line goes through `logging` under the name `attention_dispatch` and starts with PREFIX: ComfyUI's
console prints bare messages, so the prefix is what says whose line it is.

`echo` is the only way a value that came from outside (a node input, a file, an exception's text) goes back out:
into a validation error, a log line or a report. It cuts the value (a 1 MB input once made a 12 MB HTTP 400 and a
2,000,175-character log line) and escapes what a console or a log file must not get raw: a newline would forge a
log line, a lone surrogate ('\\ud800') made the log handler raise UnicodeEncodeError. The logger passes every
argument through it, so a line is one line whatever its values hold.
"""

from __future__ import annotations

import logging
import threading

PREFIX = "[attention-dispatch]"
ECHO_LIMIT = 120  # characters of one value in a message: enough to recognise it, never the whole of it
LOG_LIMIT = 2000  # characters of one argument of a log line (a list of reasons, an exception's text)
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escaped(text: str, keep: str = "") -> str:
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch.isprintable() or ch in keep:
            out.append(ch)
        elif ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        else:
            code = ord(ch)
            out.append(f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}")
    return "".join(out)


def echo(value, limit: int = ECHO_LIMIT, quote: bool = True, keep: str = "") -> str:
    """`value` as safe text to echo: quoted like repr (quote=False: as str), control characters and lone surrogates
    escaped (but those in `keep`: a report's own line breaks), at most about `limit` characters, with the full
    length said when cut ('...' (1000000 characters)). Text, bytes and containers are read only as far as the
    text kept (`_bounded`): a 3M-item list is never turned into text whole."""
    total = len(value) if isinstance(value, (str, bytes, bytearray, list, tuple, dict, set, frozenset)) else None
    try:
        text = _bounded(value, limit * 2, quote, set()) if not isinstance(value, str) else (
            repr(value[:limit]) if quote else value[:limit])  # cut before repr: never a copy of the whole value
    except Exception as exc:  # a value whose repr raises (or nests past the recursion limit) is still named
        text = f"<{type(value).__name__}: repr failed with {type(exc).__name__}>"
    text = _escaped(text[:limit * 2], keep)
    if len(text) > limit or (isinstance(value, str) and total > limit):
        text = text[:limit] + "\u2026"
        if total is not None:
            text += f" ({total} characters)" if isinstance(value, str) else f" (length {total})"
    return text


_OPEN_CLOSE = {list: ("[", "]"), tuple: ("(", ")"), set: ("{", "}"), frozenset: ("frozenset({", "})"),
               dict: ("{", "}")}
_EMPTY = {set: "set()", frozenset: "frozenset()"}


def _bounded(value, budget: int, quote: bool, path: set) -> str:
    """repr(value) (quote=False: str) up to about `budget` characters, reading text, bytes and the built-in
    containers only as far as that: a container past the budget ends in '...'. What it shows of a value that
    fits is exactly its repr (a container that holds itself: '[...]', as repr writes it)."""
    kind = type(value)
    if isinstance(value, str):
        return repr(value[:budget]) if quote else value[:budget]
    if isinstance(value, (bytes, bytearray)):
        return repr(value[:budget])
    if kind not in _OPEN_CLOSE:
        return repr(value) if quote else str(value)
    if not value:
        return _EMPTY.get(kind) or repr(value)
    if id(value) in path:
        return "{...}" if kind is dict else "[...]" if kind is list else "..."
    path.add(id(value))
    try:
        parts, used = [], 0
        for item in (value.items() if kind is dict else value):
            if used >= budget:
                parts.append("...")
                break
            left = max(1, budget - used)
            text = (f"{_bounded(item[0], left, True, path)}: {_bounded(item[1], left, True, path)}"
                    if kind is dict else _bounded(item, left, True, path))
            parts.append(text)
            used += len(text) + 2
    finally:
        path.discard(id(value))
    opening, closing = _OPEN_CLOSE[kind]
    return opening + ", ".join(parts) + ("," if kind is tuple and len(value) == 1 else "") + closing


def _safe_arg(arg):
    if isinstance(arg, (int, float)):
        return arg  # numbers keep their %d / %.2f formatting
    return echo(arg, LOG_LIMIT, quote=False)


class _Prefixed(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"{PREFIX} {msg}", kwargs

    def log(self, level, msg, *args, **kwargs):
        if self.isEnabledFor(level):
            msg, kwargs = self.process(echo(msg, LOG_LIMIT * 2, quote=False), kwargs)
            self.logger.log(level, msg, *(_safe_arg(a) for a in args), **kwargs)


logger = _Prefixed(logging.getLogger("attention_dispatch"), {})

_said: set = set()
_said_lock = threading.Lock()


def warn_once(key, msg: str, *args) -> bool:
    """Log a warning the first time `key` is seen in this process (a repeated condition, such as a cache path
    that is a folder, said once, not once per call); True when it was logged."""
    with _said_lock:
        if key in _said:
            return False
        _said.add(key)
    logger.warning(msg, *args)
    return True


def forget_warnings() -> None:
    """Say every warn_once warning again (tests; a user who fixed the cause and wants to know if it is back)."""
    with _said_lock:
        _said.clear()


def counted(n: int, noun: str) -> str:
    """'1 call', '2 calls': a count in the words a report prints (issue #41: "1 calls")."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
