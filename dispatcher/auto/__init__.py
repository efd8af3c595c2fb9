"""`auto` and `auto_exact`: for each attention signature, the fastest backend whose result is correct, measured once.

For a call signature met for the first time (device, dtype, B, H, Hk, Lq, Lk, D, Dv, mask kind and
shape, causal, GQA, scale, dropout, lse, grad), the tuner
- lists the candidates: every registered backend that can run on this machine and supports the call
  (Hub kernels only once fetched or loaded: `auto` never downloads code on its own);
- runs each on random inputs of that signature (its own seeded generator: the caller's RNG stream is
  untouched; memory capped by shrinking the lengths), checks the output against exact attention
  computed in float64 on a sample of query rows (relative error within the backend's `error_bound`,
  no NaN/Inf), so a kernel producing noise (Sage on some builds) is rejected with the reason;
- times the valid ones (warm-up, then the median of a few runs; CUDA events on GPUs) within a time
  budget per signature, and keeps the fastest.
Decisions live in memory (the dispatcher's hot path never comes back here once decided) and on disk
(JSON, `ATTN_DISPATCH_TUNE_CACHE` or ~/.cache/attention_dispatch/tune.json), keyed by the machine:
GPU name and capability (or CPU model), torch and the attention packages' versions. Any version change,
or a change in the set of candidates, means measuring again. Past `max_signatures` timed signatures per
process, or when timing is impossible (dropout, inside torch.compile tracing), the declared
priority order decides without timing. `report()` / `explain()` say what was measured, rejected
and chosen, and what it cost.

`auto_exact` is the same with exact kernels only (never a quantised one, e.g. int8 SageAttention).

    from dispatcher import auto
    out = dispatch_attention_fn(q, k, v, backend="auto")
    print(auto.explain())

This wing registers the two pseudo-backends with the registry; the dispatcher asks the registry for them
and never imports this package.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from .. import caches, registry
from ..inputs import AttentionInputs
from .cache import CACHE_FORMAT, ENV_CACHE, default_cache_path  # noqa: F401  (public names)
from .fingerprint import cpu_model, fingerprint_key, machine_fingerprint  # noqa: F401
from .measure import QUADRATIC_MEMORY  # noqa: F401
from .reference import exact_attention, first_line, non_finite, relative_error, sample_rows  # noqa: F401
from .tuner import (DEFAULT_BUDGET_S, DEFAULT_MAX_SIGNATURES, ENV_BUDGET, ENV_MAX_SIGNATURES,  # noqa: F401
                    CandidateResult, Tuner, TuneRecord, pick)

AUTO = "auto"
AUTO_EXACT = "auto_exact"

_default: Tuner | None = None
_default_lock = threading.Lock()


def default_tuner() -> Tuner:
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Tuner()
    return _default


def set_default_tuner(tuner: Tuner | None) -> Tuner | None:
    """Install `tuner` for `auto` (None: a fresh default one on next use); returns the previous one."""
    global _default
    with _default_lock:
        previous, _default = _default, tuner
    caches.forget()
    return previous


@contextlib.contextmanager
def using(tuner: Tuner):
    """Use `tuner` for `auto` inside the block (process-wide; tests and the bench)."""
    previous = set_default_tuner(tuner)
    try:
        yield tuner
    finally:
        set_default_tuner(previous)


@caches.on_forget
def forget_choices() -> None:
    """Forget the in-memory choices (when the registry changes); measurements stay on disk."""
    if _default is not None:
        _default.forget_choices()


def choose(inputs: AttentionInputs, **kwargs) -> tuple[str, bool]:
    return default_tuner().choose(inputs, **kwargs)


def tune(what, *args, **kwargs) -> TuneRecord:
    return default_tuner().tune(what, *args, **kwargs)


def report() -> dict[str, Any]:
    return default_tuner().report()


def explain() -> str:
    return default_tuner().explain()


def clear_cache(disk: bool = True) -> None:
    default_tuner().clear_cache(disk=disk)


def _resolver(exact: bool):
    def resolve(inputs: AttentionInputs, call, *, timing: bool) -> tuple[str, bool]:
        if call is None:
            return default_tuner().choose(inputs, timing=timing, exact=exact)
        return default_tuner().choose(inputs, layout=call.layout, timing=timing, exact=exact,
                                      tensors=(call.query, call.key, call.value, call.attn_mask))
    return resolve


registry.add_resolver(AUTO, _resolver(exact=False))
registry.add_resolver(AUTO_EXACT, _resolver(exact=True))
