"""What one tuning is of (`TuneKey`, the one key of everything the tuner remembers) and what it found
(`TuneRecord`: every candidate's verdict and timing, the choice and why)."""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

from .. import state
from ..inputs import AttentionInputs

LIVE, NOISE, DISK = "live values", "noise", "disk"  # what a record's verdicts were judged on (`judged_on`)
TRIAL_SOURCE = "prediction trial"
# The per-tensor fields (dtypes and devices of key and value) equal the query's in every call tuned, and the disk's
# key leaves them out: what is shared between tunings (timings, exact verdicts, budgets) leaves them out too.
_PER_TENSOR = {"key_dtype": None, "value_dtype": None, "key_device": None, "value_device": None}


class TuneKey(NamedTuple):
    """What a choice of `auto` depends on: the signature, for auto_exact or auto_fast, on whose activations (model),
    in which block ("" for auto_exact, whose verdicts hold for every block), with which attention_kwargs keys,
    under which trust settings (trust.scope_key()) on which machine (Machine.key). The store (store.py) keeps each
    kind of entry under the part of this key it depends on: the methods below; the disk key is `disk()`."""
    signature: AttentionInputs | None  # None only in `forward()`
    exact: bool
    model: str
    block: str
    attention_kwargs: tuple[str, ...] = ()
    trust: tuple = ()
    machine: str = ""

    def tuning(self) -> TuneKey:
        """What one tuning is of (its record's key): trust and machine left out, as a record says what it ran."""
        return self._replace(trust=(), machine="")

    def shared(self) -> TuneKey:
        """What every model and block shares (the disk's timings, a signature's tuning budget): the signature, the
        kind of auto and the attention_kwargs keys."""
        return TuneKey(dataclasses.replace(self.signature, **_PER_TENSOR), self.exact, "", "", self.attention_kwargs)

    def timings(self) -> TuneKey:
        """What timings made in this process hold for: the signature alone (either auto, any model or block)."""
        return TuneKey(dataclasses.replace(self.signature, **_PER_TENSOR), False, "", "")

    def verdicts(self) -> TuneKey:
        """What the exact kernels' verdicts made in this process hold for: the signature on one model's values."""
        return self.timings()._replace(model=self.model)

    def forward(self) -> TuneKey:
        """The model's forward a call belongs to (step.py): the model and kind of auto, under trust and machine."""
        return TuneKey(None, self.exact, self.model, "", (), self.trust, self.machine)

    def disk(self) -> str:
        """The key of the disk cache's entry (cache.py) for `shared()`: the signature's own text, then the kind of
        auto and the attention_kwargs keys."""
        kwargs = f"|attention_kwargs={','.join(self.attention_kwargs)}" if self.attention_kwargs else ""
        return self.signature.key() + ("|exact" if self.exact else "") + kwargs


@dataclass
class CandidateResult:
    name: str
    status: str  # chosen | valid | rejected | untimed | unjudged (quantised, and no live values to judge it on)
    priority: int = 0  # its place among the candidates, in the registry's priority order
    error_bound: float = 0.0
    rel_error: float | None = None
    median_ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    first_call_ms: float | None = None
    reason: str = ""


@dataclass
class TuneRecord:
    signature: AttentionInputs
    chosen: str
    source: str  # timed | judged | disk | preference | only-candidate | none | prediction trial
    reason: str = ""
    candidates: list[CandidateResult] = field(default_factory=list)
    skipped: list[tuple[str, list[str]]] = field(default_factory=list)  # backends that cannot run the call
    seconds: float = 0.0
    timed_shape: dict | None = None  # the lengths actually timed, when the memory cap shrank them
    layout: str = "BSHD"
    trust_sensitive: bool = False
    exact: bool = False  # decided for auto_exact (no quantised kernel)
    model: str = state.UNSCOPED_MODEL  # whose activations the verdicts were made on
    # which block's: auto_fast's call site as the caller wrote it (ComfyUI's "double.self #3", nodes/blocks.py), the
    # key its verdicts are saved under on disk; "" for auto_exact, whose verdicts hold for every block
    block: str = ""
    judged_on: str = ""  # live values | noise (provisional, judged again on the first live call) | disk
    attention_kwargs: tuple[str, ...] = ()  # the call's attention_kwargs keys: only backends honouring them compete
    # The budget ran out before every candidate was judged and timed (first calls that load or compile a kernel
    # count): those left are listed with the reason, and the choice is kept all the same (the budget is per
    # signature, every call of it included: going on at later calls tuned one signature 5 times, 11 s on a CPU).
    cut_short: bool = False

    @property
    def key(self) -> TuneKey:
        return TuneKey(self.signature, self.exact, self.model, self.block, self.attention_kwargs)

    @property
    def rejected(self) -> list[CandidateResult]:
        return [c for c in self.candidates if c.status == "rejected"]

    @property
    def settled(self) -> bool:
        """Whether its choice may be remembered: judged on live values (now or on disk), or there was nothing to
        judge. A provisional one (noise, a trace, a preference) is made again on the next call, with its values."""
        return self.judged_on in (LIVE, DISK) or self.source in ("only-candidate", "none")

    def as_dict(self) -> dict[str, Any]:
        return {"signature": self.signature.as_dict(), "description": self.signature.describe(), "exact": self.exact,
                "attention_kwargs": list(self.attention_kwargs),
                "model": self.model, "block": self.block, "judged_on": self.judged_on, "chosen": self.chosen,
                "source": self.source, "reason": self.reason, "cut_short": self.cut_short,
                "seconds": round(self.seconds, 4),
                "layout": self.layout, "timed_shape": self.timed_shape,
                "candidates": [asdict(c) for c in self.candidates],
                "rejected": {c.name: c.reason for c in self.rejected},
                "skipped": {name: reasons for name, reasons in self.skipped}}

    def explain_lines(self) -> list[str]:
        """Its lines in `Tuner.explain()`: the signature, the choice and why, then every candidate."""
        kind = "auto_exact" if self.exact else "auto_fast"
        judged = f", judged on {self.judged_on}" if self.judged_on else ""
        lines = [f"  {self.signature.describe()}"
                 + (f", attention_kwargs {list(self.attention_kwargs)}" if self.attention_kwargs else "")]
        at = f" at {self.block}" if self.block else ""
        lines.append(f"    {kind} for model {self.model}{at} -> {self.chosen} ({self.source}{judged}"
                     f"{': ' + self.reason if self.reason else ''}; {self.seconds:.2f} s)")
        for c in self.candidates:
            timing = f"{c.median_ms:.3f} ms" if c.median_ms is not None else "not timed"
            error = f"err {c.rel_error:.1e}" if c.rel_error is not None else "err -"
            lines.append(f"       {c.name:30} {c.status:9} {timing:>12}  {error}"
                         + (f"  ({c.reason})" if c.reason else ""))
        return lines
