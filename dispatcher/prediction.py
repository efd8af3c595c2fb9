"""The model-level verdict on approximate kernels: whether block-sparse attention may serve a model, judged once on
what it does to the model's own prediction.

A per-call bound (sol_attn's 1e-1 on a block's own activations, the guard at twice that) says nothing of what 30
blocks x 50 steps of such calls do to a picture. So a host that can run the model's forward (ComfyUI's nodes: an
apply-model wrapper, nodes/prediction_check.py) asks for a verdict before an approximate kernel serves the model
under `auto_fast`:

    prediction.require(model)                 # approximate kernels wait for the verdict (support.for_auto says so)
    verdict, out = prediction_trial.judge(model, forward, forward, recorder=the_models_recorder)
        # 1. the forward with approximate kernels refused: the reference prediction
        # 2. the same forward, same input, with them allowed: the trial. `auto_fast` puts an approximate kernel on
        #    every block whose per-call verdict admits it, whatever the timings and the step's choice say
        #    (auto/tuner.py), so the trial is the most the kernel could serve; the recorder counts what it served
        # 3. no approximate call served: nothing was judged, the verdict stays pending (judged again at the next
        #    model call, at most MAX_TRIALS times); else admitted when the relative L2 difference of the two
        #    predictions is within `bound` (MODEL_BOUND). The prediction returned is the candidate's when
        #    admitted, the reference's otherwise

After the verdict, a refused model's calls never get an approximate kernel from `auto_fast` (the reason names the
prediction's error); an admitted one keeps the per-block choices on the blocks (call sites) an approximate kernel
served in the trial, and only there: a block the trial ran exactly (its per-call verdict, the guard, a fallback)
was not judged, so it stays exact. The per-call bound stays as the quality guard's tripwire. A model no host asked a
verdict for keeps the per-call rule (the library without a model forward). Verdicts are kept per model for the
process, like `auto_fast`'s per-block verdicts.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass

from . import caches
from .log import counted

# The largest relative L2 difference (float64, over the whole prediction) between the model's prediction with the
# approximate kernels `auto_fast` picks and with them refused, on the same input at the first step they would serve.
# A policy, not a measurement: a kernel that spoils a picture moves attention outputs by 0.3-1.0 per call
# (docs/auto.md), and a prediction 2% off at the first step is far from visible; the final latent's difference to
# `auto_exact` on the WAN 1.3B step is what the H200 run checks it against (docs/performance.md).
MODEL_BOUND = 2e-2

# Trials of one model whose candidate forward no approximate kernel served (its per-call verdicts rejected it on
# every block, say) before the host stops asking: each costs a second forward, and the kernels keep waiting.
MAX_TRIALS = 3

PENDING, TRIAL, ADMITTED, REFUSED = "pending", "trial", "admitted", "refused"


@dataclass(frozen=True)
class Verdict:
    model: str
    status: str  # admitted | refused | pending (the trial served no approximate call: nothing was judged)
    rel_error: float  # the prediction's relative L2 difference to the reference (inf for NaN/Inf)
    bound: float
    served: int = 0  # attention calls of the trial forward an approximate kernel served
    calls: int = 0  # attention calls of the trial forward
    sites: tuple[str, ...] = ()  # the call sites (blocks) it served there: an admission covers these only
    trials: int = 1  # trial forwards run for this model so far

    @property
    def text(self) -> str:
        """The badge's words: "sparse: prediction off by 3.1e-03 over 30 of 60 calls (within 2e-02)"."""
        if self.status == PENDING:
            again = ("judged again at the next step" if self.trials < MAX_TRIALS else
                     f"not tried again after {counted(self.trials, 'trial')}: approximate kernels stay off")
            return (f"sparse: no verdict yet: the trial forward's {counted(self.calls, 'attention call')} got no "
                    f"approximate kernel; {again}")
        off = f"prediction off by {self.rel_error:.1e} over {self.served} of {counted(self.calls, 'call')}"
        if self.status == ADMITTED:
            return f"sparse: {off} (within {self.bound:.0e})"
        return f"sparse refused: {off} > {self.bound:.0e}; its blocks run without approximate kernels"

    def as_dict(self) -> dict:
        return {**asdict(self), "sites": list(self.sites), "text": self.text}


_lock = threading.Lock()
_status: dict[str, str] = {}
_verdicts: dict[str, Verdict] = {}


def set_status(model: str, status: str) -> None:
    with _lock:
        changed = _status.get(model) != status
        _status[model] = status
    if changed:
        caches.forget()  # auto's choices for this model were made under the other status


def status(model: str) -> str | None:
    """PENDING, TRIAL, ADMITTED, REFUSED, or None (no host asked: the per-call rule alone)."""
    return _status.get(model)


def verdict(model: str) -> Verdict | None:
    return _verdicts.get(model)


def require(model: str) -> None:
    """A host will judge `model`'s prediction: until then approximate kernels wait (no-op once judged)."""
    if status(model) not in (ADMITTED, REFUSED):
        set_status(model, PENDING)


def settle(result: Verdict) -> None:
    """Keep a trial's verdict (prediction_trial.judge) and move the model to its status."""
    with _lock:
        _verdicts[result.model] = result
    set_status(result.model, result.status)


def due(model: str) -> bool:
    """Whether a host should run a trial for `model` now: pending, and fewer than MAX_TRIALS served nothing."""
    made = _verdicts.get(model)
    return status(model) == PENDING and (made is None or made.trials < MAX_TRIALS)


def refusal(model: str, block: str | None = None) -> str | None:
    """Why an approximate kernel may not serve `model` (at call site `block`, when given) now, or None
    (support.for_auto's policy reason)."""
    now = _status.get(model)
    if now == PENDING:
        return ("an approximate kernel: waits for this model's prediction-level verdict (its first step, judged with "
                "and without approximate kernels)")
    if now == REFUSED:
        return f"an approximate kernel: refused for this model by its {_verdicts[model].text.split(': ', 1)[1]}"
    made = _verdicts.get(model)
    if now == ADMITTED and block is not None and made is not None and block not in made.sites:
        return (f"an approximate kernel: block {block} ran exactly in this model's prediction-level trial, so its "
                f"admission ({made.text.split(': ', 1)[1]}) does not cover it")
    return None


def forget(model: str | None = None) -> None:
    """Drop the verdicts (of one model, or all): the next `require` asks again, with MAX_TRIALS trials."""
    with _lock:
        for name in [model] if model is not None else list(_status):
            _status.pop(name, None)
            _verdicts.pop(name, None)
    caches.forget()
