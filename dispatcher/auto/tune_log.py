"""What `auto`'s tuning says in the log: one line per decision group, then a summary per run.

A decision group is every block of one model whose calls of one signature came to the same choice with the same
kernels rejected (`auto_fast` judges each block on its own values). Its first block is logged in full; the
others are counted, and `summary()` (the host calls it when a run ends: ComfyUI's nodes after each sampling run)
says how many blocks each group held. A 200-block WAN under `auto_fast` once logged 1,200 lines on its first
prompt (a line and a warning per rejected kernel, per block and site).
"""

from __future__ import annotations

import threading

from ..log import logger

_MAX_GROUPS = 4096  # a bound for a process that never asks for a summary (a script)
_lock = threading.Lock()
_groups: dict[tuple, list] = {}  # group key -> [blocks counted since the last summary, described signature, model]


def decided(record, where: str) -> None:
    """Log a timed or judged decision `record` (a TuneRecord) made at `where` (model, block), once per group."""
    sig = record.signature.describe()
    rejected = record.rejected
    key = (sig, record.exact, record.model, record.chosen, tuple(c.name for c in rejected))
    with _lock:
        group = _groups.get(key)
        if group is not None:
            group[0] += 1
            return
        if len(_groups) >= _MAX_GROUPS:
            _groups.clear()
        _groups[key] = [1, sig, record.model, record.chosen]
    line = ("auto: %s (%s) -> %s (%d candidates, judged on %s, %.2f s)%s; other blocks of this model with the same "
            "outcome are counted, not logged")
    args = (sig, where, record.chosen, len(record.candidates), record.judged_on, record.seconds,
            "; rejected: " + "; ".join(f"{c.name} ({c.reason})" for c in rejected) if rejected else "")
    (logger.warning if rejected else logger.info)(line, *args)


def summary() -> None:
    """One line for the decisions since the last summary that were counted, not logged; then start again."""
    with _lock:
        groups = [g for g in _groups.values() if g[0] > 1]
        _groups.clear()
    if not groups:
        return
    blocks = sum(g[0] for g in groups)
    logger.info("auto: this run decided %d more blocks like the ones logged above: %s", blocks - len(groups),
                "; ".join(f"{sig} -> {chosen} for {count} blocks of model {model}"
                          for count, sig, model, chosen in groups))
