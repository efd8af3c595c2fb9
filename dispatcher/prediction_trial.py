"""The trial that makes a model's prediction-level verdict (dispatcher/prediction.py says what the verdict is and
how `auto_fast` reads it): the model's forward with approximate kernels refused and allowed, on the same input, and
the calls the approximate kernels served in it, counted by the model's recorder."""

from __future__ import annotations

import math
from collections import Counter
from contextlib import nullcontext
from typing import Callable

import torch

from . import prediction, registry
from .prediction import ADMITTED, MODEL_BOUND, PENDING, REFUSED, TRIAL, Verdict
from .report import Recorder, recording


def available_here() -> list[str]:
    """The approximate backends this machine can run (none: nothing to judge, no second forward)."""
    return [name for name in registry.names()
            if registry.get(name).approximate and not registry.requirement_reasons(name)]


def relative_difference(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """||candidate - reference|| / ||reference|| in float64 (inf when either has NaN/Inf)."""
    c, r = candidate.detach().double(), reference.detach().double()
    if not (torch.isfinite(c).all() and torch.isfinite(r).all()):
        return math.inf
    return float((c - r).norm() / r.norm().clamp_min(1e-30))


def _served_calls(recorder: Recorder) -> Counter:
    """(call site, served backend) -> calls recorded so far."""
    out: Counter = Counter()
    for row in recorder.snapshot()["rows"]:
        out[(row["site"], row["served"])] += row["calls"]
    return out


def _approximate(name: str) -> bool:
    return registry.is_known(name) and registry.get(name).approximate


def judge(model: str, reference: Callable[[], torch.Tensor], candidate: Callable[[], torch.Tensor], *,
          bound: float = MODEL_BOUND, recorder: Recorder | None = None) -> tuple[Verdict, torch.Tensor]:
    """(the verdict, the prediction to use): `reference()` runs the model's forward with approximate kernels refused,
    `candidate()` the same forward on the same input with them allowed (see the module's docstring). recorder: the
    one the model's calls record into (a host's); None: the calls name none, and the judge records them itself.
    A trial whose forward no approximate kernel served judges nothing: the verdict returned is PENDING (status
    stays pending, `due` says whether to try again) with the reference prediction."""
    counter = recorder if recorder is not None else Recorder("prediction trial")
    prediction.set_status(model, PENDING)
    try:
        expected = reference()
        prediction.set_status(model, TRIAL)
        before = _served_calls(counter)
        with recording(counter) if recorder is None else nullcontext():
            got = candidate()
        trial = _served_calls(counter) - before
    except BaseException:
        prediction.set_status(model, PENDING)  # an interrupted or failing forward decides nothing
        raise
    approximate = {key: n for key, n in trial.items() if _approximate(key[1])}
    served = sum(approximate.values())
    error = relative_difference(got, expected)
    previous = prediction.verdict(model)
    trials = previous.trials + 1 if previous is not None and previous.status == PENDING else 1
    status_now = PENDING if not served else ADMITTED if error <= bound else REFUSED
    result = Verdict(model, status_now, error, bound, served, sum(trial.values()),
                     tuple(sorted({site for site, _ in approximate})), trials)
    prediction.settle(result)
    return result, got if result.status == ADMITTED else expected
