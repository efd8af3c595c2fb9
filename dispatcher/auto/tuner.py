"""The tuner behind `auto`: per call signature, the fastest backend whose result is correct, measured once."""

from __future__ import annotations

import contextlib
import math
import statistics
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from .. import caches, decisions, env, hub, prediction, registry, state, support, trust
from ..call import AttentionCall
from ..checks import check_shapes, check_structure
from ..execute import run
from ..guard import FAST_BOUND, admission_bound  # noqa: F401  (FAST_BOUND: auto's public name)
from ..inputs import AttentionInputs, describe_call
from . import cache, hooks, measure, step, tune_log
from .fingerprint import machine_fingerprint
from .measure import random_inputs, shrink, spread, sync, time_calls, time_rounds, validate
from ..reference import exact_attention, first_line, sample_rows
from ..log import logger
from ..machine import current_machine


ENV_BUDGET = "ATTN_DISPATCH_TUNE_BUDGET"  # seconds per signature
ENV_MAX_SIGNATURES = "ATTN_DISPATCH_TUNE_MAX_SIGNATURES"
DEFAULT_BUDGET_S = 2.0  # on a GPU
# On a CPU: its kernels differ by wide margins (flex runs eagerly there, ten times slower than SDPA) and the clock
# drift the final round guards against on a GPU does not arise, while each prompt meets as many signatures as on
# a GPU: 2 s each made a tiny model's first prompt on a CPU 36 s instead of 9 s.
CPU_BUDGET_S = 0.5
DEFAULT_MAX_SIGNATURES = 32
# On a CPU flex_attention runs eagerly through torch.compile's tracer: its first call of each signature took 4.4 s
# and its calls 640 ms against SDPA's 24 ms (tiny SD1.5's self-attention, 2 x 256 x 8 x 40, torch 2.13 on this
# CI's CPU): it never wins there, and its first call alone was 9x a CPU's whole budget. `auto` leaves it out on a
# CPU where another kernel can run the call (a BlockMask still gets it), with this reason.
CPU_UNTIMED_FAMILIES = ("flex",)
CPU_UNTIMED_REASON = ("auto leaves flex out on a CPU: it runs eagerly there, its first call per signature traces "
                      "for seconds and its calls were 25x SDPA's; select 'flex' by name to run it")
DEFAULT_TIE_MARGIN = 0.03  # at most: how much a later backend in priority order must beat an earlier one by
# Candidates timed within this of the fastest are timed again side by side (`_final_round`) before the pick:
# timed one after the other, one kernel drifted 15% within its own runs on the H200 (clocks settling under
# load), more than the 10% this margin was: drift alone could keep the fastest kernel out of the round.
CONTENDER_MARGIN = 0.25
FINAL_ROUNDS = 3  # at least, side by side; more while the budget lasts (up to 2 x runs)
# A final-round sample runs a candidate back to back for about this long (2 to 100 calls), as long as the bench's
# samples: with 60 ms samples (2-3 calls on Wan 14B) the tuner ranked per-warp Sage last of the three Sage kernels
# in two runs on the H200 after a minute of load, where the bench ranks it first; with 200 ms samples and the
# balanced order (`measure.balanced_order`) it ranked first in both runs (bench/results, seventh session).
FINAL_SAMPLE_MS = 200.0
LIVE, NOISE, DISK = "live values", "noise", "disk"
DEFAULT_BLOCK = "attention"  # the call site of a call that names no block (AttentionCall's default)


def pick(valid: list, tie_margin: float):
    """The fastest of the valid candidates (given in preference order), unless a preferred one is within the
    noise of their timings (the larger relative spread of the two), counted up to `tie_margin`.

    Small kernels time the host as much as the GPU: picks among backends a few percent apart changed from run
    to run, and in a real SDXL step the less preferred ones lost (measured on the H200: bench/results)."""
    fastest = min(valid, key=lambda c: c.median_ms)
    return next(c for c in valid if c.median_ms <= fastest.median_ms * (
        1 + min(tie_margin, max(spread(c.times_ms), spread(fastest.times_ms)))))


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


class TuningKey(NamedTuple):
    """What one tuning is of (its record's key, `TuneRecord.key`): the signature, for auto_exact or auto_fast, on
    whose activations, in which block, with which attention_kwargs keys."""
    signature: AttentionInputs
    exact: bool
    model: str
    block: str
    attention_kwargs: tuple[str, ...]


class ChoiceKey(NamedTuple):
    """A choice kept in memory (`Tuner._key`): the tuning, and what else it holds under (trust scope, machine)."""
    tuning: TuningKey
    trust: tuple
    machine: str  # Machine.key


@dataclass
class TuneRecord:
    signature: AttentionInputs
    chosen: str
    source: str  # timed | disk | preference | only-candidate | none
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
    def key(self) -> TuningKey:
        return TuningKey(self.signature, self.exact, self.model, self.block, self.attention_kwargs)

    @property
    def rejected(self) -> list[CandidateResult]:
        return [c for c in self.candidates if c.status == "rejected"]

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


_DEFAULT_PATH = object()


class Tuner:
    """Measures and remembers `auto` decisions; thread-safe (one lock around tuning)."""

    def __init__(self, *, cache_path=_DEFAULT_PATH, time_budget_s: float | None = None,
                 max_signatures: int | None = None, warmup: int = 1, runs: int = 5, validation_rows: int = 64,
                 memory_cap_bytes: int | None = None, backends=None, tie_margin: float = DEFAULT_TIE_MARGIN,
                 step_check: bool = True):
        """cache_path: the cache file (SQLite; None: memory only; default: `cache.default_cache_path()`);
        time_budget_s: seconds per signature, everything included (ATTN_DISPATCH_TUNE_BUDGET; default 2 on a GPU,
        0.5 on a CPU); max_signatures: timed per process
        (ATTN_DISPATCH_TUNE_MAX_SIGNATURES, 32); warmup/runs: calls per candidate; validation_rows: query
        rows checked against exact attention; memory_cap_bytes: for the tuning inputs (default: a quarter
        of free GPU memory up to 8 GiB, 512 MiB on a CPU); backends: consider only these names; tie_margin:
        how much faster than a preferred backend another must be to win (timings carry host noise); step_check:
        check the picks of a model's forward against single kernels in the model's own call order (step.py)."""
        self._cache_path = cache_path
        self.backends = None if backends is None else tuple(backends)
        budget = time_budget_s if time_budget_s is not None else env.value(ENV_BUDGET)
        self.time_budget_s = None if budget is None else float(budget)  # None: by device (`budget`)
        self.max_signatures = int(max_signatures if max_signatures is not None
                                  else env.value(ENV_MAX_SIGNATURES, str(DEFAULT_MAX_SIGNATURES)))
        self.warmup, self.runs, self.validation_rows = int(warmup), max(1, int(runs)), int(validation_rows)
        self.memory_cap_bytes = memory_cap_bytes
        self.tie_margin = float(tie_margin)
        self.step_check = bool(step_check)
        self._lock = threading.RLock()
        # ChoiceKey -> (name, trust-sensitive); forgotten with the dispatcher's decisions (caches.on_forget,
        # auto/__init__.py), which are made from these choices.
        self._choices: dict[ChoiceKey, tuple[str, bool]] = {}
        self._records: dict[TuningKey, TuneRecord] = {}  # TuneRecord.key -> record (reports)
        # What one block's tuning leaves for the next block of the same signature (`_from_memory`, keyed by
        # `_memory_keys`): the timings ({name: (median_ms, times_ms)}) and the exact kernels' verdicts per model.
        self._timings: dict[str, tuple] = {}
        self._exact_verdicts: dict[tuple, dict] = {}
        # (disk key, candidates) -> seconds of tuning it has had in this process, every block. A new candidate set
        # (an approximate kernel admitted to a model's trial forward, a Hub kernel fetched) gets a budget of its own:
        # its new candidates were never tried, and the timings already made are reused.
        self._spent: dict[tuple[str, tuple[str, ...]], float] = {}
        # The model's step (step.py): per-signature choices of live calls wait in _pending (key -> record) while
        # the forward they belong to is recorded (_sequences: (model, exact, trust scope, machine) -> Sequence);
        # once it is complete, the step decision settles them all. _steps: sequence key -> StepRecord.
        self._pending: dict[tuple, TuneRecord] = {}
        self._sequences: dict[tuple, step.Sequence] = {}
        self._steps: dict[str, step.StepRecord] = {}
        self._timed = 0
        self.timing_calls = 0  # candidate timings actually run (tests: a disk hit runs none)

    # -- configuration
    @property
    def cache_path(self) -> Path | None:
        if self._cache_path is _DEFAULT_PATH:
            return cache.default_cache_path()
        return None if self._cache_path is None else Path(self._cache_path)

    def budget(self, device: str | torch.device) -> float:
        """Seconds of tuning per signature on `device`: the one set, else by device type."""
        if self.time_budget_s is not None:
            return self.time_budget_s
        return CPU_BUDGET_S if torch.device(device).type == "cpu" else DEFAULT_BUDGET_S

    def _budget_text(self) -> str:
        if self.time_budget_s is not None:
            return f"{self.time_budget_s:g} s"
        return f"{DEFAULT_BUDGET_S:g} s ({CPU_BUDGET_S:g} s on a CPU)"

    def _memory_cap(self, device: torch.device) -> int:
        if self.memory_cap_bytes is not None:
            return int(self.memory_cap_bytes)
        if device.type == "cuda":
            try:
                free, _ = torch.cuda.mem_get_info(device)
                return int(min(8 << 30, free // 4))
            except Exception:
                return 2 << 30
        return 512 << 20

    # -- the dispatcher's entry
    def choose(self, inputs: AttentionInputs, **kwargs) -> tuple[str, bool]:
        """(backend name, whether the choice depends on trust settings): `decide` without whether it holds."""
        return self.decide(inputs, **kwargs)[:2]

    def decide(self, inputs: AttentionInputs, *, layout: str = "BSHD", live: AttentionCall | None = None,
               timing: bool = True, exact: bool = False, model: str = state.UNSCOPED_MODEL,
               block: str = DEFAULT_BLOCK) -> tuple[str, bool, bool]:
        """(backend name, whether the choice depends on trust settings, whether it holds for the later calls of
        this block) for these inputs of `model`; live: the call itself (its tensors judge accuracy); exact=True:
        never a quantised kernel; block: which block of the model the call comes from (auto_fast judges quantised
        kernels on each block's own activations). A choice that does not hold (made on noise or in a trace) is made
        again on the next call."""
        block = "" if exact else block
        keys = tuple(sorted(live.attention_kwargs)) if live is not None and live.attention_kwargs else ()
        key = self._key(inputs, exact, model, block, keys)
        hit = self._choices.get(key)
        if hit is not None:
            return (*hit, True)
        with self._lock:
            hit = self._choices.get(key)
            if hit is not None:
                return (*hit, True)
            record = self._pending.get(key)
            if record is None:
                record = self._resolve(inputs, exact, layout=layout, live=live, timing=timing, model=model,
                                       block=block, keys=keys)
                hit = (record.chosen, record.trust_sensitive)
                if not _settled(record):
                    return (*hit, False)
                # a trial's pick is no timing pick either: no step to decide
                if live is None or not self.step_check or record.source in ("only-candidate", "none", TRIAL_SOURCE):
                    self._choices[key] = hit
                    return (*hit, True)
                self._pending[key] = record
            return self._in_step(key, record, live.call_site if live is not None else DEFAULT_BLOCK, exact, model)

    # -- the model's step (step.py)
    def _in_step(self, key: ChoiceKey, record: TuneRecord, site: str, exact: bool, model: str) -> tuple[str, bool, bool]:
        """Record this call in its model's forward; once the forward is complete, decide the step and settle every
        choice of it. Until then a call is served by its signature's own pick, provisionally."""
        forward = (model, exact, key.trust, key.machine)
        sequence = self._sequences.setdefault(forward, step.Sequence())
        if not sequence.add(site, key):
            return record.chosen, record.trust_sensitive, False
        del self._sequences[forward]
        records = {k: self._pending[k] for k in sequence.keys()}
        result = self._decide_step([k for _, k in sequence.calls], records, exact, model)
        for k, rec in records.items():
            del self._pending[k]
            self._choices[k] = (rec.chosen if result.chosen == step.MIX else result.chosen, rec.trust_sensitive)
        hit = self._choices.get(key) or (record.chosen, record.trust_sensitive)
        return (*hit, True)

    def _decide_step(self, order: list, records: dict, exact: bool, model: str) -> step.StepRecord:
        """One kernel for every call of the forward, or the mix of per-signature picks: see step.py."""
        start = measure.now()
        disk_keys = [_disk_key(records[k]) for k in order]
        result = step.StepRecord(model, exact, step.sequence_key(disk_keys, exact, model), len(order), len(records),
                                 step.MIX, "agree")
        top, result.predicted_ms = step.singles(order, records)
        picks = {r.chosen for r in records.values()}
        if len(records) == 1 or len(picks) == 1:
            result.chosen = next(iter(picks))
            result.source, result.reason = ("one-signature", "its own tuning compared the kernels on it") if len(
                records) == 1 else ("agree", "every signature picked it")
        elif not top:
            result.reason = "no kernel is valid for every call: each call keeps its own pick"
        else:
            self._replay_step(result, order, records, top)
        result.seconds = measure.now() - start
        self._steps[result.key] = result
        logger.info("auto: %s", result.text())
        return result

    def _replay_step(self, result: step.StepRecord, order: list, records: dict, top: list[str]) -> None:
        configs = top + [step.MIX]
        earlier = self._steps.get(result.key)  # decided in this process (before the choices were forgotten)
        chosen = earlier.chosen if earlier is not None else None
        if chosen is None and result.model != state.UNSCOPED_MODEL:  # timings are the machine's, the order the model's
            saved = cache.lookup(self.cache_path, result.key)
            chosen = saved.get("chosen") if saved is not None else None
        if chosen in configs:
            result.chosen = chosen
            result.source, result.reason = "disk" if earlier is None else "memory", "decided earlier for this forward"
            return
        device = torch.device(next(iter(records.values())).signature.device)
        cap = self._memory_cap(device)
        made: dict[tuple, tuple] = {}

        def inputs(key):
            if key not in made:
                rec = records[key]
                made[key] = self._inputs(rec.signature, rec.layout, None, cap)[:2]
            return made[key]

        self.timing_calls += 1
        try:
            step_ms, samples, why = step.replay(order, records, configs, inputs, device, self.budget(device),
                                                self.runs, self.tie_margin)
        except hooks.TuningInterrupted as stop:
            raise stop.original from None
        except Exception as exc:  # a kernel that fails here keeps each call's own pick (it ran them alone)
            result.reason = f"replaying the forward failed ({type(exc).__name__}: {exc}): each call keeps its pick"
            return
        finally:
            made.clear()
        if why:
            result.source, result.reason = "predicted", why + ": from the per-signature timings"
            result.chosen = step.step_pick({c: result.predicted_ms[c] for c in configs}, {}, self.tie_margin)
        else:
            result.source, result.step_ms, result.samples_ms = "timed", step_ms, samples
            result.chosen = step.step_pick(step_ms, samples, self.tie_margin)
        if result.model != state.UNSCOPED_MODEL:
            cache.update(self.cache_path, result.key, lambda previous: {
                "candidates": configs, "chosen": result.chosen, "source": result.source, "tuned_at": cache.now(),
                "step_ms": result.step_ms, "predicted_ms": result.predicted_ms})

    @staticmethod
    def _key(sig: AttentionInputs, exact: bool, model: str, block: str, keys: tuple = ()) -> ChoiceKey:
        """What a choice depends on besides the signature: the model and block, the call's attention_kwargs keys,
        trust settings and the machine."""
        return ChoiceKey(TuningKey(sig, exact, model, block, keys), trust.scope_key(), current_machine().key)

    def tune(self, what, key=None, value=None, *, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
             return_lse=False, dropout_p=0.0, layout="BSHD", force=False, exact=False, model=None,
             block=DEFAULT_BLOCK) -> TuneRecord:
        """Decide `auto` for tensors (query[, key, value]: judged on them) or an AttentionInputs signature (timed
        on noise; its verdicts wait for live values) now; the record. force=True measures again even when memory
        or disk already has a decision; exact=True: as `auto_exact`; model: default the active `model_scope`;
        block: the call site the verdicts are for (auto_fast)."""
        block = "" if exact else block
        live = None
        model = state.validate_model(model) if model is not None else state.active_model()
        if isinstance(what, AttentionInputs):
            inputs = what
        elif isinstance(what, torch.Tensor):
            key = what if key is None else key
            value = key if value is None else value
            check_shapes(what, key, value, layout)
            inputs = describe_call(what, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                                   layout)
            check_structure(inputs)
            live = AttentionCall(query=what, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p,
                                 is_causal=is_causal, scale=scale, enable_gqa=enable_gqa, layout=layout,
                                 return_lse=return_lse)
        else:
            raise TypeError(f"tune() takes an AttentionInputs signature or a query tensor; got {type(what).__name__}")
        with self._lock:
            record = self._resolve(inputs, exact, layout=layout, live=live, timing=True, model=model, block=block,
                                   use_disk=not force)
            if force:
                caches.forget()  # the dispatcher's decisions may hold the previous choice
            if _settled(record):
                self._choices[self._key(inputs, exact, model, block)] = (record.chosen, record.trust_sensitive)
        return record

    # -- reports
    def records(self) -> list[TuneRecord]:
        with self._lock:
            return list(self._records.values())

    def report(self) -> dict[str, Any]:
        """Per signature: candidates, timings, errors, rejections, chosen and seconds; plus the totals."""
        records = self.records()
        return {"time_budget_s": self.time_budget_s if self.time_budget_s is not None else
                {"gpu": DEFAULT_BUDGET_S, "cpu": CPU_BUDGET_S}, "max_signatures": self.max_signatures,
                "timed_signatures": self._timed, "total_seconds": round(sum(r.seconds for r in records), 4),
                "cache_path": str(self.cache_path) if self.cache_path else None,
                "machine": machine_fingerprint(), "signatures": [r.as_dict() for r in records],
                "steps": [s.as_dict() for s in self.steps()]}

    def steps(self) -> list[step.StepRecord]:
        """The model-level decisions made in this process (step.py)."""
        with self._lock:
            return list(self._steps.values())

    def explain(self) -> str:
        records = self.records()
        if not records:
            return "auto: no attention signature tuned in this process"
        lines = [f"auto: {len(records)} signatures, {self._timed} timed, "
                 f"{sum(r.seconds for r in records):.2f} s spent (budget {self._budget_text()} per signature, "
                 f"at most {self.max_signatures} timed)"]
        for r in records:
            kind = "auto_exact" if r.exact else "auto_fast"
            judged = f", judged on {r.judged_on}" if r.judged_on else ""
            lines.append(f"  {r.signature.describe()}"
                         + (f", attention_kwargs {list(r.attention_kwargs)}" if r.attention_kwargs else ""))
            at = f" at {r.block}" if r.block else ""
            lines.append(f"    {kind} for model {r.model}{at} -> {r.chosen} ({r.source}{judged}"
                         f"{': ' + r.reason if r.reason else ''}; {r.seconds:.2f} s)")
            for c in r.candidates:
                timing = f"{c.median_ms:.3f} ms" if c.median_ms is not None else "not timed"
                error = f"err {c.rel_error:.1e}" if c.rel_error is not None else "err -"
                lines.append(f"       {c.name:30} {c.status:9} {timing:>12}  {error}"
                             + (f"  ({c.reason})" if c.reason else ""))
        lines += [f"  {s.text()}" for s in self.steps()]
        return "\n".join(lines)

    def forget_choices(self) -> None:
        """Forget the choices (caches.forget: the registry or the tuning changed); the measurements they were made
        from stay (the records, the timings and verdicts in memory and on disk): choosing again reads them."""
        with self._lock:
            self._choices.clear()
            self._pending.clear()  # made among candidates that may have changed: resolved again
            self._sequences.clear()

    def clear_cache(self, disk: bool = True) -> None:
        """Forget every decision (and the disk cache file, with disk=True)."""
        with self._lock:
            self._choices.clear()
            self._records.clear()
            self._timings.clear()
            self._exact_verdicts.clear()
            self._spent.clear()
            self._pending.clear()
            self._sequences.clear()
            self._steps.clear()
            self._timed = 0
            if disk:
                cache.remove(self.cache_path)
        caches.forget()

    # -- candidates
    def candidates(self, inputs: AttentionInputs, exact: bool = False, attention_kwargs=(), model: str | None = None,
                   block: str | None = None) -> tuple[list[str], list[tuple[str, list[str]]], bool]:
        """(names in priority order, [(skipped name, reasons)], trust-sensitive): every backend `support.for_auto`
        finds nothing against (the decision's own reasons for these inputs and attention_kwargs keys, then auto's
        rules: exact kernels only for auto_exact, Hub kernels only once fetched, approximate ones as the model's
        prediction-level verdict allows at `block`)."""
        names, skipped, sensitive = [], [], False
        fetched = None
        for name in registry.names():
            if self.backends is not None and name not in self.backends:
                continue
            try:
                if fetched is None and registry.get(name).hub is not None:
                    fetched = hub.fetched_repos()
                why = support.for_auto(name, inputs, exact_only=exact, attention_kwargs=attention_kwargs,
                                       fetched=fetched or frozenset(), model=model, block=block)
                sensitive = sensitive or support.trust_decides(name, why, exact_only=exact)
            except registry.UnknownBackendError:  # removed by another thread
                continue
            if why.runs:
                names.append(name)
            else:
                skipped.append((name, why.reasons))
        if torch.device(inputs.device).type == "cpu":
            slow = [n for n in names if registry.get(n).family in CPU_UNTIMED_FAMILIES]
            if len(slow) < len(names):  # another can run it: a kernel that cannot win is not worth its first call
                names = [n for n in names if n not in slow]
                skipped += [(n, [CPU_UNTIMED_REASON]) for n in slow]
        return names, skipped, sensitive  # registry.names() is the priority order

    # -- deciding
    def _resolve(self, sig: AttentionInputs, exact: bool, *, layout: str, live, timing: bool, model: str,
                 block: str = "", use_disk: bool = True, keys: tuple = ()) -> TuneRecord:
        start = measure.now()
        names, skipped, sensitive = self.candidates(sig, exact, keys, model, block or None)
        record = TuneRecord(sig, names[0] if names else "native", "preference", skipped=skipped, layout=layout,
                            trust_sensitive=sensitive, exact=exact, model=model, block=block, attention_kwargs=keys)
        record.candidates = [CandidateResult(n, "untimed", i, admission_bound(registry.get(n)))
                             for i, n in enumerate(names)]
        from_disk = from_memory = False
        if use_disk and len(names) > 1:
            from_disk = self._from_disk(record, names)
            from_memory = self._from_memory(record)
        known = from_disk or from_memory
        judged = known and all(c.status in ("valid", "rejected") for c in record.candidates)
        timed = known and all(c.median_ms is not None for c in record.candidates if c.status == "valid")
        if not names:
            record.source, record.reason = "none", "no backend supports these inputs; 'native' explains why"
        elif len(names) == 1:
            record.source, record.reason = "only-candidate", ""
        elif judged and timed and any(c.status == "valid" for c in record.candidates):
            # judged on live values: on disk, or in this process (another block, the other auto's record)
            record.source, record.judged_on = ("disk", DISK) if from_disk and not from_memory else ("judged", LIVE)
            if from_memory:
                record.reason = "judged and timed earlier in this process (another block or the other auto)"
            else:
                self._to_memory(record)  # the next block and the other auto start from these
            record.chosen = pick([c for c in record.candidates if c.status == "valid"], self.tie_margin).name
        elif not timing:
            record.reason = "decided while torch.compile traces, which cannot time kernels: preference order"
        elif sig.dropout:
            record.reason = "dropout makes outputs random, so they cannot be validated: preference order"
        elif sig.mask_kind == "blockmask" and (live is None or live.attn_mask is None):
            record.reason = "a BlockMask cannot be synthesised for timing: preference order"
        elif self._timed >= self.max_signatures and not (timed and live is not None):
            record.reason = (f"the limit of {self.max_signatures} timed signatures per process is reached "
                             f"({ENV_MAX_SIGNATURES}): preference order")
        elif self.budget(sig.device) <= 0 and not (timed and live is not None):
            record.reason = f"the time budget is {self.budget(sig.device):g} s ({ENV_BUDGET}): preference order"
        else:
            counted = not known  # a signature measured before in this process is not counted again
            if counted:
                self._timed += 1
            spent_key = (_disk_key(record), tuple(names))
            spent_before = self._spent.get(spent_key, 0.0)
            try:  # the budget is the signature's, over every block and call that tunes it
                self._measure(sig, record, names, layout, live, start - spent_before)
            except hooks.TuningInterrupted as stop:  # the host's own interrupt: nothing is decided or saved
                if counted:
                    self._timed -= 1
                raise stop.original from None
            except Exception as exc:  # tuning must never break the call it was made for
                logger.warning("auto: tuning %s failed (%s: %s); using the preference order", sig.describe(),
                               type(exc).__name__, exc)
                record.source, record.judged_on = "preference", ""
                record.reason = f"tuning failed ({type(exc).__name__}: {exc}): preference order"
            finally:
                self._spent[spent_key] = spent_before + measure.now() - start
            if record.source in ("timed", "judged"):
                self._to_memory(record)
                self._to_disk(record, names)
        record.seconds = measure.now() - start
        if not exact and prediction.status(model) == prediction.TRIAL:
            _trial_pick(record)
        if record.source == "preference" and names:
            # Without a verdict on this model's values, never a kernel that is not exact.
            record.chosen = next((c.name for c in record.candidates if c.status != "rejected"
                                  and registry.get(c.name).exact), names[0])
        for c in record.candidates:
            if c.name == record.chosen and c.status in ("valid", "untimed", "unjudged"):
                c.status = "chosen"
        self._records[record.key] = record
        if record.source in ("timed", "judged", TRIAL_SOURCE):
            where = f"model {model}" + (f", {block}" if block else "")
            self._progress(record, "done", len(names), len(names), start, chosen=record.chosen)
            tune_log.decided(record, where)  # once per group of blocks with the same outcome
        return record

    @staticmethod
    def _inputs(sig, layout, live, cap: int):
        """(inputs to run candidates on, their signature, whether they are the caller's live values)."""
        if live is not None:  # the call's own tensors: verdicts on them, and no copy to allocate
            return live._replace(dropout_p=0.0, attention_kwargs=None, backend=None, recorder=None), sig, True
        run_sig = shrink(sig, cap)
        q, k, v, mask = random_inputs(run_sig, layout)
        scale = (0.9 / math.sqrt(sig.head_dim)) if sig.custom_scale else None
        call = AttentionCall(query=q, key=k, value=v, attn_mask=mask, is_causal=run_sig.is_causal, scale=scale,
                             enable_gqa=run_sig.enable_gqa, layout=layout, return_lse=run_sig.return_lse)
        return call, run_sig, False

    def _progress(self, record, stage, done, total, start, candidate=None, chosen=None) -> None:
        sig = record.signature
        shape = f"q {sig.batch}x{sig.len_q}x{sig.heads_q}x{sig.head_dim}" + (
            f", k/v length {sig.len_kv}" if sig.len_kv != sig.len_q else "")
        hooks.progress(hooks.TuningProgress(
            "auto_exact" if record.exact else "auto_fast", shape, record.model, stage, done,
            total, measure.now() - start, self.budget(record.signature.device), candidate, chosen))

    def _measure(self, sig, record, names, layout, live, start):
        """Judge (on live values) and time (where the disk has no timing) every candidate not known yet, within
        the budget: every call counts, first calls (which may load or compile a kernel) included. The budget is
        checked before each step, so one step at most runs past it; candidates left untried are tried again by
        the next process (their verdicts are not saved)."""
        device = torch.device(sig.device)
        budget = self.budget(device)
        cap = self._memory_cap(device)
        attention_call, run_sig, is_live = self._inputs(sig, layout, live, cap)
        if run_sig != sig:
            record.timed_shape = {"len_q": run_sig.len_q, "len_kv": run_sig.len_kv,
                                  "why": f"the inputs would exceed the tuning memory cap of {cap >> 20} MiB"}
        q, k, v, mask = attention_call.query, attention_call.key, attention_call.value, attention_call.attn_mask
        rows = sample_rows(run_sig.len_q, self.validation_rows)
        with torch.no_grad():
            ref_out, ref_lse = exact_attention(q, k, v, mask, run_sig.is_causal, attention_call.scale, layout, rows)
        within_cap = support.Rules(memory_cap=cap)
        by_name = {c.name: c for c in record.candidates}
        trial = not record.exact and prediction.status(record.model) == prediction.TRIAL
        calls = {}  # name -> its call on these inputs, for the final round
        timed_any = False
        self._progress(record, "start", 0, len(names), start)

        def spent() -> bool:  # once one candidate is valid and timed, the budget decides what else runs
            return (measure.now() - start >= budget
                    and any(c.status == "valid" and c.median_ms is not None for c in record.candidates))

        def cut_short(result, what: str) -> None:
            result.reason = (f"not {what}: the {budget:g} s budget for this signature was spent ({ENV_BUDGET} "
                             f"raises it)")
            record.cut_short = True

        for position, name in enumerate(names):
            hooks.check_interrupt()
            result = by_name[name]
            known = result.status in ("valid", "rejected")  # this model's verdict, from disk
            if known and (result.status == "rejected" or result.median_ms is not None):
                continue
            over_cap = support.why_not(name, run_sig, rules=within_cap).rules
            if over_cap:
                result.reason = "not run: " + "; ".join(over_cap)
                continue
            if spent() and result.median_ms is None and not (trial and registry.get(name).approximate):
                # one timed already (another block): judged on this block's values. In a prediction-level trial an
                # approximate kernel is judged all the same (one call): the trial must run it wherever it may serve
                cut_short(result, "timed" if known else "tried")
                continue
            self._progress(record, "candidate", position, len(names), start, candidate=name)
            try:
                call = self._try(name, result, attention_call, run_sig, layout, device, rows, ref_out,
                                 ref_lse, is_live, known)
                if call is None:
                    continue
                calls[name] = call
                if result.median_ms is not None:  # timed before (disk): only its verdict was wanted
                    continue
                if spent():
                    cut_short(result, "timed")
                    continue
                hooks.check_interrupt()
                self.timing_calls += 1
                timed_any = True
                # A timed warm call (the first one may have compiled or planned) sizes the runs that fit this
                # candidate's share of what is left of the budget.
                with torch.no_grad():
                    t0 = measure.now()
                    call()
                    sync(device)
                    steady = max(measure.now() - t0, 1e-6)
                    left = max(0.0, budget - (measure.now() - start))
                    fits = int(left / max(1, len(names) - position) / steady)
                    runs = max(1, min(self.runs, fits))
                    warmup = min(max(0, self.warmup - 1), max(0, fits - runs))
                    result.times_ms = time_calls(call, device, warmup, runs)
                result.median_ms = statistics.median(result.times_ms)
            except Exception as exc:  # one failing kernel leaves the tuning, never ends it
                _reject(result, f"raised {first_line(exc)}", device)
                calls.pop(name, None)
        valid = [c for c in record.candidates if c.status == "valid" and c.median_ms is not None]
        if timed_any:
            self._final_round(record, valid, calls, device, start, budget, len(names))
        valid = [c for c in record.candidates if c.status == "valid" and c.median_ms is not None]
        record.judged_on = LIVE if is_live else NOISE
        if not valid:
            record.source = "preference"
            record.reason = "no candidate passed validation: preference order (the dispatcher falls back if it fails)"
            return
        record.chosen = pick(valid, self.tie_margin).name
        record.source = "timed" if timed_any else "judged"
        if not is_live:
            record.reason = "timed on noise; verdicts wait for the model's own activations (the first live call)"

    @staticmethod
    def _try(name, result, attention_call, run_sig, layout, device, rows, ref_out, ref_lse, is_live, known):
        """Load `name` and, unless its verdict is known, judge its first call; its call, or None if rejected."""
        spec = registry.get(name)
        try:
            runner = registry.prepare(name)
        except Exception as exc:
            result.status, result.reason = "rejected", f"could not be loaded: {type(exc).__name__}: {exc}"
            return None
        candidate = decisions.candidate(name, spec, runner, run_sig, layout)  # run as the decision runs it

        def call(candidate=candidate):
            return run(candidate, attention_call)

        if known:
            return call
        with torch.no_grad():
            t0 = measure.now()
            result_value = call()
            sync(device)
            result.first_call_ms = (measure.now() - t0) * 1e3
        out, lse = result_value if run_sig.return_lse else (result_value, None)
        # Noise has none of the locality an approximate kernel relies on (sol_attn: 0.76 on N(0,1)): there only a
        # broken output (NaN, shape) rejects it; its error is judged on live values alone.
        bound = math.inf if spec.approximate and not is_live else result.error_bound
        problem = validate(out, lse, ref_out, ref_lse, rows, layout, bound, result)
        del result_value, out, lse
        if problem:
            result.status = "rejected"
            result.reason = problem + (" on this model's own activations" if is_live else " on noise")
            return None
        if is_live:
            result.status = "valid"
        elif not spec.exact:  # noise passes no verdict on a kernel that is not exact: its error depends on values
            result.status = "unjudged"
            result.reason = f"{spec.precision}: admitted only once judged on the model's own activations"
        else:
            result.status = "valid"  # exact by declaration and on noise; judged again on live values
        return call

    def _final_round(self, record, valid, calls, device, start, budget, total) -> None:
        """Time the front-runners (within CONTENDER_MARGIN of the fastest) again in interleaved rounds and keep
        those times: timed one after the other, two of them a few percent apart can swap places from drift
        alone. Each sample runs one candidate for about FINAL_SAMPLE_MS (measure.time_rounds says why), shorter
        when FINAL_ROUNDS rounds of those would not fit what is left of the budget; more rounds while the budget
        lasts (up to 2 x runs); none when not even FINAL_ROUNDS rounds of single calls fit."""
        if len(valid) < 2:
            return
        fastest = min(c.median_ms for c in valid)
        contenders = [c for c in valid if c.name in calls and c.median_ms <= fastest * (1 + CONTENDER_MARGIN)]
        if len(contenders) < 2:
            return
        left = budget - (measure.now() - start)
        one_each = sum(c.median_ms for c in contenders) / 1e3  # one call of each contender, in seconds
        fit = left / FINAL_ROUNDS / max(one_each, 1e-9) - 1  # calls per sample that fit FINAL_ROUNDS rounds
        if fit < 1:
            return
        per_sample = [max(min(2, int(fit)), min(100, int(fit), math.ceil(FINAL_SAMPLE_MS / max(c.median_ms, 1e-6))))
                      for c in contenders]  # 2 to 100 calls, fewer only when the budget has no room for 2
        per_round = sum(c.median_ms * (n + 1) for c, n in zip(contenders, per_sample)) / 1e3
        rounds = max(FINAL_ROUNDS, min(2 * self.runs, int(left / max(per_round, 1e-9))))
        self.timing_calls += 1
        self._progress(record, "final round", total, total, start)
        failed: dict[str, Exception] = {}

        def guarded(name):
            def call():
                try:
                    return calls[name]()
                except Exception as exc:
                    failed[name] = exc
                    raise
            return call

        try:
            with torch.no_grad():
                times = time_rounds([guarded(c.name) for c in contenders], device, rounds, per_sample,
                                    between=hooks.check_interrupt)
        except Exception:
            if not failed:
                raise
            for candidate in contenders:  # the others keep their own timings
                if candidate.name in failed:
                    _reject(candidate, f"raised {first_line(failed[candidate.name])}", device)
            return
        for candidate, samples in zip(contenders, times):
            candidate.times_ms, candidate.median_ms = samples, statistics.median(samples)

    # -- memory: what one block's tuning tells the next block of the same signature (and auto_exact's record)
    def _from_memory(self, record: TuneRecord) -> bool:
        """Fill the timings measured for this signature and the exact kernels' verdicts this model had on another
        block (or in the other auto's record): a block of auto_fast then has only its quantised kernels left to
        judge, on its own values. False when nothing of this signature was measured in this process."""
        timings_key, verdicts_key = _memory_keys(record)
        timings = self._timings.get(timings_key)
        if timings is None:
            return False
        verdicts = self._exact_verdicts.get(verdicts_key, {})
        for c in record.candidates:
            if c.median_ms is None and c.name in timings:
                c.median_ms, c.times_ms = timings[c.name][0], list(timings[c.name][1])
            if c.status not in ("valid", "rejected") and c.name in verdicts:
                c.status, c.rel_error, c.reason = verdicts[c.name]
        return True

    def _to_memory(self, record: TuneRecord) -> None:
        timings_key, verdicts_key = _memory_keys(record)
        self._timings.setdefault(timings_key, {}).update(
            {c.name: (c.median_ms, list(c.times_ms)) for c in record.candidates if c.median_ms is not None})
        if record.judged_on in (LIVE, DISK):
            self._exact_verdicts.setdefault(verdicts_key, {}).update(
                {c.name: ("valid" if c.status == "chosen" else c.status, c.rel_error, c.reason)
                 for c in record.candidates
                 if c.status in ("chosen", "valid", "rejected") and registry.get(c.name).exact})

    # -- disk: timings are shared by every model on this machine, accuracy verdicts belong to one model and block
    def _from_disk(self, record: TuneRecord, names: list[str]) -> bool:
        """Fill timings (and this model's verdicts) from disk; False when the disk has nothing usable."""
        decision = cache.lookup(self.cache_path, _disk_key(record))
        if decision is None or decision.get("candidates") != names:
            return False  # a backend came or went since it was measured: measure again
        timings = decision.get("timings", {})
        verdicts = (decision.get("verdicts", {}).get(record.model, {}).get(record.block)
                    if record.model != state.UNSCOPED_MODEL else None)
        for c in record.candidates:
            got = timings.get(c.name) or {}
            c.median_ms, c.times_ms = got.get("median_ms"), list(got.get("times_ms") or [])
            if verdicts and c.name in verdicts:
                c.status = verdicts[c.name].get("status", c.status)
                c.rel_error, c.reason = verdicts[c.name].get("rel_error"), verdicts[c.name].get("reason", "")
        record.reason = f"measured {decision.get('tuned_at', 'earlier')} ({self.cache_path})"
        return True

    def _to_disk(self, record: TuneRecord, names: list[str]) -> None:
        def merged(previous: dict | None) -> dict:
            """The saved decision with this record's timings and (live, scoped) verdicts added."""
            if previous is None or previous.get("candidates") != names:
                previous = {}
            timings = dict(previous.get("timings", {}))
            timings.update({c.name: {"median_ms": c.median_ms, "times_ms": c.times_ms} for c in record.candidates
                            if c.median_ms is not None})
            verdicts = dict(previous.get("verdicts", {}))
            if record.judged_on == LIVE and record.model != state.UNSCOPED_MODEL:  # unscoped ones stay in memory
                blocks = dict(verdicts.get(record.model, {}))
                blocks[record.block] = {c.name: {"status": "valid" if c.status == "chosen" else c.status,
                                                 "rel_error": c.rel_error, "reason": c.reason}
                                        for c in record.candidates if c.status in ("chosen", "valid", "rejected")}
                verdicts[record.model] = blocks
            return {"candidates": names, "tuned_at": cache.now(), "seconds": round(record.seconds, 4),
                    "timings": timings, "verdicts": verdicts}

        cache.update(self.cache_path, _disk_key(record), merged)


TRIAL_SOURCE = "prediction trial"


def _trial_pick(record: TuneRecord) -> None:
    """In the model's prediction-level trial (dispatcher/prediction.py): an approximate kernel this block's per-call
    verdict admits serves it, whatever the timings (the fastest timed one, else the first in priority order), so
    the trial judges every block it could serve later; a block with none keeps its pick."""
    admitted = [c for c in record.candidates
                if c.status in ("valid", "chosen") and registry.get(c.name).approximate]
    if not admitted or record.judged_on not in (LIVE, DISK):
        return
    best = min(admitted, key=lambda c: (c.median_ms is None, c.median_ms or 0.0, c.priority))
    record.chosen, record.source = best.name, TRIAL_SOURCE
    record.reason = ("the model's prediction-level trial: an approximate kernel serves every block its per-call "
                     "verdict admits it on, whatever the timings")


def _settled(record: TuneRecord) -> bool:
    """Whether a choice may be remembered: judged on live values (now or on disk), or there was nothing to judge.
    A provisional one (noise, a trace, a preference) is made again on the next call, with its live values."""
    return record.judged_on in (LIVE, DISK) or record.source in ("only-candidate", "none")


def _reject(result: CandidateResult, reason: str, device: torch.device) -> None:
    result.status, result.reason = "rejected", reason
    result.median_ms, result.times_ms = None, []
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


def _memory_keys(record: TuneRecord) -> tuple[str, tuple[str, str]]:
    """The keys of what one block's tuning leaves for the next: its timings (per signature, any model or block)
    and its exact kernels' verdicts (per signature and model)."""
    signature = record.signature.key()
    return signature, (signature, record.model)


def _disk_key(record: TuneRecord) -> str:
    kwargs = f"|attention_kwargs={','.join(record.attention_kwargs)}" if record.attention_kwargs else ""
    return record.signature.key() + ("|exact" if record.exact else "") + kwargs
