"""Queue-time checks of node inputs, one helper for every node and every input (no ComfyUI import).

Why the pack checks what ComfyUI could: ComfyUI does not check every value a V3 node gets (which versions skip
which checks, and hand `validate_inputs` raw values, is nodes/comfy_versions.py's). So each node declares its
widgets once as `Field`s (the schema is built from them) and its `validate_inputs` runs `check` on every value it
gets, whatever the version checked: type, finite, whole, range, option (with the close match), then the node's
cross-field rules.

Each node's `check_inputs` answers True or one message naming every problem by input name. ComfyUI
repeats a message that `validate_inputs` returns once per input the function names (one
`custom_validation_failed` error per input: the list of backends 8 times for one typo), so `validate_inputs`
raises that message instead (`refuse`): ComfyUI reports an exception in validation once
(`exception_during_inner_validation`, "Exception when validating inner node: <message>"). It raises a
ValueError, a builtin, because ComfyUI names an exception by its module and a pack's modules by their path.

ComfyUI puts that error on the downstream node's input that links to ours (`input_name: "model"`): neither path
lets a `validate_inputs` name the widget at fault. So each problem starts with the input it is about ("backend:
...", "start_percent 0.8 is after end_percent 0.2 (...)") and problems are joined by "; ": the web extension
(web/node_errors.js) splits the message there and moves each problem onto its widget before the frontend shows it.
"""

from __future__ import annotations

import difflib
import math
from typing import Callable, Iterable, Sequence

from ..dispatcher import log

MISSING = object()  # an input the prompt does not carry: ComfyUI reports it itself (required_input_missing)


class Field:
    """One widget input: kind is combo | float | int | bool | string. optional: an input added after the node was
    published (older API prompts lack it; execute's default applies). accepted: combo values that are valid but not
    listed (a renamed option older workflows still carry, a private name), or a function giving them."""

    __slots__ = ("name", "kind", "options", "default", "min", "max", "step", "tooltip", "noun", "rule", "optional",
                 "accepted", "extra")

    def __init__(self, name: str, kind: str, *, default=None, options: Sequence | Callable[[], Sequence] = None,
                 min=None, max=None, step=None, tooltip: str = "", noun: str | None = None, rule: str | None = None,
                 optional: bool = False, accepted: Sequence | Callable[[], Sequence] = (), **extra):
        self.name, self.kind, self.default = name, kind, default
        self.options, self.min, self.max, self.step = options, min, max, step
        self.tooltip, self.noun, self.rule, self.extra = tooltip, noun, rule, extra
        self.optional, self.accepted = optional, accepted

    def choices(self) -> list:
        options = self.options() if callable(self.options) else self.options
        return list(options or ())

    def unlisted(self) -> list:
        accepted = self.accepted() if callable(self.accepted) else self.accepted
        return list(accepted or ())


def _short(value, limit: int = 60) -> str:
    return log.echo(value, limit)


def _number(x) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def close_matches(value, options: Iterable, n: int = 1) -> list:
    """The option `value` most likely meant: equal ignoring case first, else difflib's closest."""
    options = [o for o in options if isinstance(o, str)]
    if not isinstance(value, str) or len(value) > 200:  # difflib's cost grows with the product of the lengths
        return []
    folded = [o for o in options if o.lower() == value.strip().lower()]
    if folded:
        return folded[:n]
    return difflib.get_close_matches(value.strip(), options, n=n, cutoff=0.6)


def _combo(field: Field, value) -> str | None:
    options, unlisted = field.choices(), field.unlisted()
    if any(type(option) is type(value) and option == value for option in (*options, *unlisted)):
        return None
    noun = field.noun or "value"
    close = close_matches(value, [*options, *unlisted])
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return f"{field.name}: unknown {noun} {_short(value)}.{hint} Valid: {', '.join(map(str, options))}"


def _numeric(field: Field, value) -> str | None:
    kind = "a whole number" if field.kind == "int" else "a number"
    bounds = ""
    if field.min is not None and field.max is not None:
        bounds = f" from {_number(field.min)} to {_number(field.max)}"
    if value is None:
        return f"{field.name}: no value (null); expected {kind}{bounds}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        if isinstance(value, str):
            return f"{field.name}: {_short(value)} is not {kind}; expected {kind}{bounds}"
        return f"{field.name}: expected {kind}{bounds}, got {type(value).__name__} {_short(value)}"
    if isinstance(value, float) and not math.isfinite(value):
        return f"{field.name}: {value} is not a finite number; expected {kind}{bounds}"
    if field.kind == "int" and isinstance(value, float) and not value.is_integer():
        return f"{field.name}: {value:g} is not a whole number"
    if field.min is not None and value < field.min:
        return f"{field.name}: {_number(value)} is below the minimum {_number(field.min)}"
    if field.max is not None and value > field.max:
        return f"{field.name}: {_number(value)} is above the maximum {_number(field.max)}"
    return None


def check_value(field: Field, value) -> str | None:
    """Why `value` is not a valid value of `field`, or None."""
    if field.kind == "combo":
        problem = _combo(field, value)
    elif field.kind in ("float", "int"):
        problem = _numeric(field, value)
    elif field.kind == "bool":
        problem = None if isinstance(value, bool) else f"{field.name}: expected true or false, got {_short(value)}"
    elif field.kind == "string":
        problem = None if isinstance(value, str) else f"{field.name}: expected text, got {_short(value)}"
    else:
        raise ValueError(f"unknown field kind {field.kind!r}")
    if problem and field.rule:
        problem += f" ({field.rule})"
    return problem


def check(fields: Sequence[Field], values: dict) -> tuple[list[str], dict]:
    """Every problem of `values` (name -> value; MISSING ones are skipped), and the values that passed."""
    problems, good = [], {}
    for field in fields:
        value = values.get(field.name, MISSING)
        if value is MISSING:
            continue
        problem = check_value(field, value)
        if problem:
            problems.append(problem)
        else:
            good[field.name] = value
    return problems, good


ANSWER_LIMIT = 4000  # characters of one refusal: ComfyUI repeats it in its 400 body and its log


def answer(problems: Iterable[str]) -> bool | str:
    """check_inputs' answer: True, or every problem in one message (cut past ANSWER_LIMIT, saying how many more)."""
    problems = [p for p in problems if p]
    if not problems:
        return True
    text, shown = "", 0
    for problem in problems:
        if shown and len(text) + len(problem) > ANSWER_LIMIT:
            return f"{text}; and {len(problems) - shown} more problems"
        text, shown = (f"{text}; {problem}" if shown else problem[:ANSWER_LIMIT]), shown + 1
    return text


def refuse(result: bool | str) -> bool:
    """validate_inputs' answer to ComfyUI: True, or the message raised once (see the module docstring)."""
    if result is True:
        return True
    raise ValueError(str(result))


def only(fields: Sequence[Field], values: dict) -> dict:
    """The values of `fields` among what ComfyUI hands a `validate_inputs(**values)` (links arrive as None)."""
    names = {f.name for f in fields}
    return {k: x for k, x in values.items() if k in names}


# ------------------------------------------------------------------------------------------------ publishers

# A Hugging Face user or organisation name: letters, digits, '-', '_', '.', not starting or ending with
# '-' or '.', at most 96 characters (the Hub's own rule for repo-id parts).
_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.")
WILDCARDS = frozenset("*?[]")


def _path_like_problem(token: str, publishers: Sequence[str]) -> str:
    """A repo id, URL or file path: the advice names a value the node accepts, or the publishers that apply."""
    parts = [p for p in token.replace("\\", "/").split("/")
             if p and p not in ("https:", "http:", "huggingface.co", "hf.co", "www.huggingface.co")]
    candidate = parts[0] if parts and not token.startswith(("/", ".", "~")) and ":" not in parts[0] else ""
    exact = [p for p in publishers if candidate and p.lower() == candidate.lower()]
    if exact:
        return (f"{_short(token)} is a repo id or URL: trust is per publisher (the part before '/'), so write "
                f"'{exact[0]}' to trust every Hub kernel of {exact[0]}")
    what = "a repo id or URL" if candidate else "a path, not a publisher name"
    return (f"{_short(token)} is {what}, and no backend here loads Hub kernels from "
            f"{repr(candidate) if candidate else 'a path'}. Trust names a Hugging Face publisher; publishers of "
            f"Hub backends here: {', '.join(publishers)}")


def _publisher_problem(token: str, publishers: Sequence[str] = ()) -> str | None:
    if any(ord(c) < 32 or ord(c) == 127 or c.isspace() for c in token):
        return f"{_short(token)} contains spaces or control characters; write one name per line or comma"
    if any(c in WILDCARDS for c in token):
        return (f"{_short(token)}: wildcards are not supported, publishers match exactly; name each publisher "
                "(DIFFUSERS_TRUST_REMOTE_KERNELS=true trusts every publisher, for the whole ComfyUI)")
    if "/" in token or "\\" in token:
        return _path_like_problem(token, publishers)
    if len(token) > 96 or any(c not in _NAME_CHARS for c in token) or token[0] in "-." or token[-1] in "-.":
        return f"{_short(token)} is not a Hugging Face user or organisation name"
    return None


class PublisherList:
    """Trust Remote Kernels' text, judged against what could apply here.

    names: what the node passes on (valid names, each exactly as written, sorted, no duplicates);
    refused: (token, reason) for text that can never match (syntax, a case variant of a known publisher);
    default: names trusted without this node; unused: valid names no registered backend loads kernels from;
    effective: the names that change something (known publishers, not trusted by default).
    """

    def __init__(self, text, known: dict[str, Sequence[str]], default: Iterable[str]):
        self.known, self.default_set = dict(known), frozenset(default)
        self.refused: list[tuple[str, str]] = []
        names = set()
        tokens = [] if not isinstance(text, str) else [t.strip() for t in text.replace(",", "\n").splitlines()]
        for token in tokens:
            if not token:
                continue
            problem = _publisher_problem(token, sorted(set(self.known) | self.default_set))
            if problem is None and token not in self.known and token not in self.default_set:
                exact = [p for p in (*self.known, *self.default_set) if p.lower() == token.lower()]
                if exact:
                    problem = (f"'{token}' is not '{exact[0]}': publishers match exactly, case included; "
                               f"write '{exact[0]}'")
            if problem is not None:
                if (token, problem) not in self.refused:
                    self.refused.append((token, problem))
                continue
            names.add(token)
        self.names = tuple(sorted(names))
        self.default = tuple(n for n in self.names if n in self.default_set)
        self.unused = tuple(n for n in self.names if n not in self.default_set and n not in self.known)
        self.effective = tuple(n for n in self.names if n not in self.default_set and n in self.known)

    def unused_problem(self, name: str) -> str:
        known = sorted(set(self.known) | self.default_set)
        close = close_matches(name, known)
        hint = f" Did you mean '{close[0]}'?" if close else ""
        return (f"no backend here loads Hub kernels from '{name}', so trusting it changes nothing.{hint} "
                f"Publishers of Hub backends here: {', '.join(known)}")

    def problems(self) -> list[str]:
        """Queue-time refusals: text that can never match, and names that change nothing."""
        out = [reason for _, reason in self.refused]
        out += [self.unused_problem(n) for n in self.unused]
        return [f"publishers: {p}" for p in out]
