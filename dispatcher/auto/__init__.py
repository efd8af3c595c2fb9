"""`auto_exact` and `auto_fast`: for each attention signature and model, the fastest backend that keeps the picture.

- `auto_exact`: exact kernels only (error at bf16 rounding level; never a quantised kernel).
- `auto_fast`: also quantised kernels (SageAttention's int8/fp8) whose relative error on the model's own
  activations is at most `FAST_BOUND` (docs/auto.md says why that number), and approximate ones (block-sparse
  sol_attn) within their own declared `error_bound`, judged for each block (the call's `call_site`, "self #5") on
  that block's own activations: the first step judges every block, timings stay per signature; the quality guard
  (dispatcher/guard.py) then watches them while sampling, and a block where one fails is served by `auto_exact`'s
  choice.
- `auto`: the name older workflows and callers use, the same as `auto_exact`.

For a call signature met for the first time, the tuner
- lists the candidates: every registered backend that can run on this machine and supports the call
  (Hub kernels only once fetched or loaded: `auto` never downloads code on its own);
- judges each on the call's own query/key/value/mask (the live tensors, not noise): its output against exact
  attention computed in float64 on a sample of query rows; NaN/Inf or an error past its bound rejects it,
  with the reason. A verdict belongs to the model it was made on (`model=` / `model_scope`);
- times the valid ones on the same tensors (warm-up, then the median of a few runs; CUDA events on GPUs)
  within a time budget per signature, and keeps the fastest (a preferred one within timing noise wins ties).
A model's live calls then wait for its first forward (`step.py`): the forward's calls are replayed in their order
for the mix of per-signature picks and for the best few single kernels, and one kernel serves every call unless
the mix beats it by more than the noise (a kernel fastest alone can lose the step to its host time and switches).
Decisions live in memory (the hot path never comes back here once decided) and on disk (SQLite, cache.py:
`ATTN_DISPATCH_TUNE_CACHE` or ~/.cache/attention_dispatch/tune.sqlite3), keyed by the machine (GPU or CPU
model, torch and attention package versions) and the set of candidates. On disk, timings are shared by
every model; verdicts are kept per model and reused only for the same model (calls without a model scope
keep theirs in memory). `tune(signature)` without tensors times on noise and leaves verdicts to the first
live call; noise never admits a quantised kernel. Past `max_signatures` timed signatures per process, or
when timing is impossible (dropout, a traced `auto_exact` call), the priority order decides among exact
kernels. `report()` / `explain()` say what was judged, timed, rejected and chosen, and what it cost. A host shows
tuning's progress and stops it through `set_progress_hook` / `set_interrupt_check`, and names the cache's folder
with `set_default_dir` (ComfyUI's nodes: nodes/host_hooks.py).

    from dispatcher import auto, model_scope
    with model_scope("my-unet"):
        out = dispatch_attention_fn(q, k, v, backend="auto_fast")
    print(auto.explain())

This wing registers the pseudo-backends with the registry; the dispatcher asks the registry for them and
never imports this package.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

from .. import caches, registry
from ..inputs import AttentionInputs
from . import tune_log
from .cache import CACHE_FORMAT, ENV_CACHE, default_cache_path, set_default_dir  # noqa: F401  (public names)
from .hooks import TuningProgress, set_interrupt_check, set_progress_hook  # noqa: F401  (for a host: ComfyUI's nodes)
from .fingerprint import cpu_model, fingerprint_key, machine_fingerprint  # noqa: F401
from ..reference import exact_attention, first_line, non_finite, relative_error, sample_rows  # noqa: F401
from .record import CandidateResult, TuneKey, TuneRecord  # noqa: F401
from .timing import ENV_BUDGET, pick  # noqa: F401
from .tuner import DEFAULT_BLOCK, DEFAULT_BUDGET_S, DEFAULT_MAX_SIGNATURES, ENV_MAX_SIGNATURES, Tuner  # noqa: F401
from ..guard import FAST_BOUND  # noqa: F401  (auto_fast's bound on a quantised kernel's error)

AUTO_EXACT = "auto_exact"
AUTO_FAST = "auto_fast"
AUTO = "auto"  # kept for older workflows and callers: the same as auto_exact
PSEUDO_BACKENDS = (AUTO_EXACT, AUTO_FAST, AUTO)

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


def log_summary() -> None:
    """Log how many blocks each decision group held since the last summary (a host calls it when a run ends)."""
    tune_log.summary()


def _resolver(exact: bool):
    def resolve(inputs: AttentionInputs, call, *, model: str, timing: bool) -> tuple[str, bool, bool]:
        return default_tuner().decide(inputs, layout=call.layout if call is not None else "BSHD", live=call,
                                      timing=timing, exact=exact, model=model,
                                      block=call.call_site if call is not None else DEFAULT_BLOCK)
    return resolve


# Inside torch.compile both decide at run time in one opaque op (their verdicts need the live values; measured on
# the H200, the op costs nothing in a compiled WAN step and keeps it free of graph breaks).
# Each names auto_exact as its exact twin (auto_exact itself: it picks exact kernels only), what a call that must
# stay exact asks instead (decisions.under_rules).
registry.add_resolver(AUTO_EXACT, _resolver(exact=True), needs_live_values=True, exact_twin=AUTO_EXACT)
registry.add_resolver(AUTO_FAST, _resolver(exact=False), needs_live_values=True, exact_twin=AUTO_EXACT)
registry.add_resolver(AUTO, _resolver(exact=True), needs_live_values=True,  # the older name: the same as auto_exact
                      exact_twin=AUTO_EXACT)
