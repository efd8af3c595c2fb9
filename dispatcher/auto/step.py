"""The model's step: whether the per-signature picks, mixed, beat one kernel for all of a model's calls.

Each signature's pick is the kernel fastest when timed alone. In a step that is not what wins: on the H200's SDXL
step `auto_exact` mixed FA3, cuDNN, efficient and native across its sites and ran 64.6 ms where `_native_flash` for
every call ran 58.4 ms (issue #39): a kernel faster alone pays its host time and the switch of SDPA's flags between
kernels from one call to the next, which a kernel timed back to back never shows. So once the tuner has picked for
every call of one forward (`Sequence`: the calls in their order, a forward ends where a call site comes back with
the same signature), it replays that recorded order of (signature, call) on inputs of each signature for the mix
and for each of the best few single kernels (those valid for every call), in interleaved rounds, and keeps the
winner. A single kernel within the noise of the mix (at least `STEP_FLOOR`) wins: one kernel for all calls.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field

import torch

from .. import decisions, registry
from ..execute import run
from ..log import counted
from . import hooks, measure

MIX = "mix"  # the per-signature picks, each call its own
TOP_SINGLES = 3  # single kernels replayed besides the mix: the best by their per-signature timings
MAX_SEQUENCE = 4096  # calls recorded for one forward at most: past it the step is decided on what was recorded
# A single kernel within this of the mix's step time wins even when the samples' spread is smaller: differences
# under 1% of a step are below what bench/comfy_model_step.py resolves between runs on the H200.
STEP_FLOOR = 0.01
MIN_ROUNDS = 3


@dataclass
class StepRecord:
    """The model-level decision for one recorded forward of `model`."""
    model: str
    exact: bool
    key: str  # the sequence's key (its signatures and their counts): what the disk keeps it under
    calls: int  # calls in the recorded forward
    signatures: int
    chosen: str  # a kernel for every call, or MIX
    source: str  # timed | predicted | disk | one-signature | agree
    reason: str = ""
    step_ms: dict[str, float] = field(default_factory=dict)  # config -> median of its replayed step
    samples_ms: dict[str, list[float]] = field(default_factory=dict)
    predicted_ms: dict[str, float] = field(default_factory=dict)  # config -> sum of per-signature medians
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"model": self.model, "exact": self.exact, "calls": self.calls, "signatures": self.signatures,
                "chosen": self.chosen, "source": self.source, "reason": self.reason,
                "step_ms": {k: round(v, 4) for k, v in self.step_ms.items()},
                "predicted_ms": {k: round(v, 4) for k, v in self.predicted_ms.items()},
                "seconds": round(self.seconds, 4)}

    def text(self) -> str:
        kind = "auto_exact" if self.exact else "auto_fast"
        what = "each call's own pick (mix)" if self.chosen == MIX else f"{self.chosen} for every call"
        times = ", ".join(f"{k} {v:.3f} ms" for k, v in sorted(self.step_ms.items(), key=lambda kv: kv[1]))
        return (f"{kind} step of model {self.model} ({counted(self.calls, 'call')}, {counted(self.signatures, 'signature')}) -> {what} "
                f"({self.source}{': ' + self.reason if self.reason else ''}{'; ' + times if times else ''}; "
                f"{self.seconds:.2f} s)")


class Sequence:
    """One forward's calls in their order, as (call site, tuner key), until a call site comes back with the same
    signature (the next forward began) or MAX_SEQUENCE calls."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []
        self._seen: set[tuple[str, tuple]] = set()

    def add(self, site: str, key: tuple) -> bool:
        """Record a call; True when the forward is complete (this call is the next forward's, not recorded)."""
        entry = (site, key)
        if entry in self._seen:
            return True
        self._seen.add(entry)
        self.calls.append(entry)
        return len(self.calls) >= MAX_SEQUENCE

    def keys(self) -> list[tuple]:
        return list(dict.fromkeys(key for _, key in self.calls))


def sequence_key(disk_keys: list[str], exact: bool, model: str) -> str:
    """What the disk keeps a model's step decision under: the model, the kind of auto and the forward's
    signatures in order (each call's per-signature disk key: signature, exact, attention_kwargs), hashed."""
    text = "\n".join(disk_keys)
    digest = hashlib.sha256(text.encode()).hexdigest()[:24]
    return f"step|{'exact' if exact else 'fast'}|model={model}|{digest}"


def singles(order: list, records: dict) -> tuple[list[str], dict[str, float]]:
    """(the single kernels valid for every call, best predicted first, at most TOP_SINGLES; each one's predicted
    step: the sum of its per-signature medians over the calls in order)."""
    valid = None
    for record in records.values():
        names = {c.name for c in record.candidates if c.status in ("valid", "chosen") and c.median_ms is not None}
        valid = names if valid is None else valid & names
    predicted = {name: sum(_median(records[key], name) for key in order) for name in (valid or ())}
    predicted[MIX] = sum(_median(records[key], records[key].chosen) for key in order)
    ranked = sorted((n for n in predicted if n != MIX), key=lambda n: (predicted[n], registry_rank(n)))
    return ranked[:TOP_SINGLES], predicted


def registry_rank(name: str) -> int:
    names = registry.names()
    return names.index(name) if name in names else len(names)


def _median(record, name: str) -> float:
    for c in record.candidates:
        if c.name == name:
            return c.median_ms if c.median_ms is not None else float("inf")
    return float("inf")


def step_pick(step_ms: dict[str, float], samples: dict[str, list[float]], tie_margin: float) -> str:
    """The fastest configuration, unless a single kernel is within the noise of it (the larger relative spread of
    the two, at least STEP_FLOOR, at most `tie_margin`): then the single kernel earliest in priority order."""
    fastest = min(step_ms, key=step_ms.get)
    preference = sorted((n for n in step_ms if n != MIX), key=registry_rank) + [MIX]
    for name in preference:
        noise = min(tie_margin, max(STEP_FLOOR, measure.spread(samples.get(name, [])),
                                      measure.spread(samples.get(fastest, []))))
        if step_ms[name] <= step_ms[fastest] * (1 + noise):
            return name
    return fastest


def replay(order: list, records: dict, configs: list[str], inputs, device: torch.device, budget_s: float,
           runs: int, tie_margin: float) -> tuple[dict, dict, str]:
    """Time the recorded forward (`order`: tuner keys, one per call) for each configuration (MIX or a kernel),
    in interleaved rounds (measure.time_rounds: each sample after an untimed replay, the order balanced), within
    `budget_s` of the host's clock. inputs(key) -> (AttentionCall on that signature's inputs, its signature).
    Returns (median ms per configuration, samples, a reason when it could not be timed)."""
    start = measure.now()
    calls: dict[tuple, object] = {}  # (key, kernel) -> its call on that signature's inputs

    def call_for(key, name):
        found = calls.get((key, name))
        if found is None:
            attention_call, run_sig = inputs(key)
            candidate = decisions.candidate(name, registry.get(name), registry.prepare(name), run_sig,
                                            records[key].layout)
            found = calls[(key, name)] = lambda c=candidate, a=attention_call: run(c, a)
        return found

    def forward(config):
        plan = [call_for(key, records[key].chosen if config == MIX else config) for key in order]

        def step():
            for call in plan:
                call()
        return step

    steps = [forward(config) for config in configs]
    with torch.no_grad():
        t0 = measure.now()
        for step in steps:  # first calls (load, plan) and one pass each, untimed: how long a round takes
            hooks.check_interrupt()
            step()
        measure.sync(device)
        one_pass = max(measure.now() - t0, 1e-9)
        left = budget_s - (measure.now() - start)
        rounds = min(2 * runs, int(left / (2 * one_pass)))  # each sample follows an untimed replay
        if rounds < MIN_ROUNDS:
            return {}, {}, (f"{MIN_ROUNDS} rounds of the {len(order)}-call forward would not fit the "
                            f"{budget_s:g} s budget (one pass of every configuration took {one_pass:.2f} s)")
        samples = measure.time_rounds(steps, device, rounds, between=hooks.check_interrupt)
    return ({c: statistics.median(s) for c, s in zip(configs, samples)},
            {c: s for c, s in zip(configs, samples)}, "")
