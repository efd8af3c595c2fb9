"""What a saved `auto` decision is, and its bounds by value: checked on every read (a hand-edited or damaged cache
never fails a prompt) and cut to size before every write (one decision never grows without bound).

A decision (`Store.save` writes it) holds the candidates, when and how long it was tuned, each candidate's
timings, and per model and block the verdicts on that model's activations; a step decision (`Tuner._replay_step`)
holds the kernel chosen for a model's forward. What is read back is bounded: a decision's text is at most
MAX_DECISION_CHARS, a key (a signature, a candidate's, model's or block's name) at most MAX_KEY_CHARS, a text field
(tuned_at, a verdict's reason) at most MAX_TEXT_CHARS; so a report or explain() that quotes a saved decision grows
by at most MAX_TEXT_CHARS per candidate (a 2 MB tuned_at once made a 2 MB explain()).
"""

from __future__ import annotations

import json
import math

MAX_DECISION_CHARS = 64 * 1024  # one decision's JSON: a few models' verdicts for every block of a large model
MAX_KEY_CHARS = 1024  # a signature's key (its JSON, ~300 characters), a backend's, model's or block's name
MAX_TEXT_CHARS = 200  # a text field: tuned_at (25 characters), a verdict's reason (one line)
# Models whose verdicts one decision keeps: a signature's row took every model that used it (838 -> 4,019
# characters over 12 models, never trimmed). The least recently written model goes first.
MAX_MODELS_PER_DECISION = 16
MAX_CANDIDATES = 256  # backends in one decision: every registered backend is far fewer
MAX_TIMES = 64  # timed runs kept per candidate (the tuner keeps at most 2 x runs)
_STATUSES = frozenset({"valid", "rejected"})


def _number(x, low: float = 0.0) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= low


def _key(x) -> bool:
    return isinstance(x, str) and len(x) <= MAX_KEY_CHARS


def _text(x) -> bool:
    return isinstance(x, str) and len(x) <= MAX_TEXT_CHARS


def _timing_problem(name: str, timing) -> str | None:
    if not isinstance(timing, dict):
        return f"the timing of {name} is not an object"
    if not _number(timing.get("median_ms")):
        return f"the median of {name} is not a finite time"
    times = timing.get("times_ms", [])
    if not isinstance(times, list) or len(times) > MAX_TIMES or not all(_number(t) for t in times):
        return f"the times of {name} are not a list of at most {MAX_TIMES} finite times"
    return None


def _verdict_problem(where: str, verdict) -> str | None:
    if not isinstance(verdict, dict) or verdict.get("status") not in _STATUSES:
        return f"the verdict {where} has no status valid or rejected"
    rel_error = verdict.get("rel_error")
    if rel_error is not None and (isinstance(rel_error, bool) or not isinstance(rel_error, (int, float))):
        return f"the error of the verdict {where} is not a number"
    if verdict["status"] == "valid" and rel_error is not None and not _number(rel_error):
        return f"the verdict {where} is valid with an error that is not a finite number"  # a rejected one may be
    if not _text(verdict.get("reason", "")):
        return f"the reason of the verdict {where} is not a text of at most {MAX_TEXT_CHARS} characters"
    return None


def _verdicts_problem(verdicts) -> str | None:
    if not isinstance(verdicts, dict):
        return "its verdicts are not an object"
    for model, blocks in verdicts.items():
        if not _key(model) or not isinstance(blocks, dict):
            return "a model's verdicts are not an object under a name"
        for block, per_name in blocks.items():
            if not _key(block) or not isinstance(per_name, dict):
                return f"the verdicts of model {model[:60]} in a block are not an object under a name"
            for name, verdict in per_name.items():
                if not _key(name):
                    return "a verdict's backend name is not a name"
                problem = _verdict_problem(f"of {name[:60]} (model {model[:60]})", verdict)
                if problem:
                    return problem
    return None


def decision_problem(decision) -> str | None:
    """Why `decision` is not a decision the tuner saved (what `Store.save` or `_replay_step` writes), or None.
    Everything the tuner reads is checked here, so a hand-edited or damaged cache can never fail a prompt."""
    if not isinstance(decision, dict):
        return f"a decision is an object, not {type(decision).__name__}"
    candidates = decision.get("candidates")
    if not isinstance(candidates, list) or len(candidates) > MAX_CANDIDATES or not all(map(_key, candidates)):
        return "its candidates are not a list of backend names"
    if not _text(decision.get("tuned_at", "")):
        return f"its tuned_at is not a text of at most {MAX_TEXT_CHARS} characters"
    if not _number(decision.get("seconds", 0)):
        return "its seconds are not a finite number"
    if "chosen" in decision and not _key(decision["chosen"]):
        return "its chosen kernel is not a name"
    timings = decision.get("timings", {})
    if not isinstance(timings, dict) or len(timings) > MAX_CANDIDATES:
        return "its timings are not an object"
    for name, timing in timings.items():
        problem = _timing_problem(name[:60], timing) if _key(name) else "a timing's backend name is not a name"
        if problem:
            return problem
    return _verdicts_problem(decision.get("verdicts", {}))


def text_problem(text) -> str | None:
    """Why the stored text of a decision is not one (not text, too long, not JSON), or None (its content is
    `decision_problem`'s)."""
    if not isinstance(text, str):
        return f"it is stored as {type(text).__name__}, not text"
    if len(text) > MAX_DECISION_CHARS:
        return f"it is {len(text)} characters long, more than {MAX_DECISION_CHARS}"
    return None


def loaded(text) -> tuple[dict | None, str | None]:
    """(the decision stored as `text`, None) or (None, why it is not one)."""
    problem = text_problem(text)
    if problem is None:
        try:
            decision = json.loads(text)
        except ValueError as exc:
            return None, f"unreadable JSON: {exc}"[:MAX_TEXT_CHARS]
        problem = decision_problem(decision)
        if problem is None:
            return decision, None
    return None, problem


def _cut(text: str) -> str:
    return text if len(text) <= MAX_TEXT_CHARS else text[:MAX_TEXT_CHARS - 1] + "\u2026"


def fitted(decision) -> tuple[str | None, str | None]:
    """(the JSON text to store for `decision`, None) or (None, why it is not stored). The text holds its reasons
    cut to MAX_TEXT_CHARS, the verdicts of at most MAX_MODELS_PER_DECISION models (the last written: a model's
    verdicts are written last when it is tuned), and fits MAX_DECISION_CHARS: the least recently written models'
    verdicts go first, then the oldest blocks of the last one. Never what the next read would refuse."""
    problem = decision_problem(_with_reasons_cut(decision))
    if problem is not None:
        return None, problem
    out = _with_reasons_cut(decision)
    verdicts = out.get("verdicts", {})
    for model in list(verdicts)[:-MAX_MODELS_PER_DECISION]:
        del verdicts[model]
    while True:
        try:
            text = json.dumps(out)  # a rejected verdict's error may be inf: JSON's Infinity, which json reads back
        except (TypeError, ValueError) as exc:
            return None, f"it is not JSON ({exc})"
        if len(text) <= MAX_DECISION_CHARS:
            return text, None
        if not verdicts:
            return None, f"it takes {len(text)} characters without verdicts, more than {MAX_DECISION_CHARS}"
        oldest = next(iter(verdicts))
        if len(verdicts) > 1 or len(verdicts[oldest]) <= 1:
            del verdicts[oldest]
        else:
            blocks = verdicts[oldest]
            del blocks[next(iter(blocks))]


def _with_reasons_cut(decision):
    """A copy of `decision` with its verdicts' reasons cut to MAX_TEXT_CHARS (an exception's text can be long);
    `decision` itself where it is not of the shape that has them."""
    if not isinstance(decision, dict) or "verdicts" not in decision:
        return decision
    try:
        verdicts = {model: {block: {name: {**v, "reason": _cut(v["reason"])} if isinstance(v.get("reason"), str)
                                    else dict(v) for name, v in per_name.items()}
                            for block, per_name in blocks.items()}
                    for model, blocks in decision["verdicts"].items()}
    except (AttributeError, TypeError):
        return decision
    return {**decision, "verdicts": verdicts}
