"""How one signature's candidates are judged and timed within its budget: each one's first call against exact
attention, its timed calls, then the front-runners side by side (`final_round`), and the pick. The clock, timed
calls and rounds, and the check of one output are measure.py's."""

from __future__ import annotations

import contextlib
import math
import statistics
from dataclasses import dataclass

import torch

from .. import decisions, prediction, registry, support
from ..call import AttentionCall
from ..execute import run
from ..reference import exact_attention, first_line, sample_rows
from . import hooks, measure
from .measure import random_inputs, shrink, spread, sync, time_calls, time_rounds, validate
from .record import LIVE, NOISE, CandidateResult, TuneRecord

ENV_BUDGET = "ATTN_DISPATCH_TUNE_BUDGET"  # seconds per signature
DEFAULT_TIE_MARGIN = 0.03  # at most: how much a later backend in priority order must beat an earlier one by
# Candidates timed within this of the fastest are timed again side by side (`final_round`) before the pick:
# timed one after the other, one kernel drifted 15% within its own runs on the H200 (clocks settling under
# load), more than the 10% this margin was: drift alone could keep the fastest kernel out of the round.
CONTENDER_MARGIN = 0.25
FINAL_ROUNDS = 3  # at least, side by side; more while the budget lasts (up to 2 x runs)
# A final-round sample runs a candidate back to back for about this long (2 to 100 calls), as long as the bench's
# samples: with 60 ms samples (2-3 calls on Wan 14B) the tuner ranked per-warp Sage last of the three Sage kernels
# in two runs on the H200 after a minute of load, where the bench ranks it first; with 200 ms samples and the
# balanced order (`measure.balanced_order`) it ranked first in both runs (bench/results, 2026-12-04).
FINAL_SAMPLE_MS = 200.0


def pick(valid: list, tie_margin: float):
    """The fastest of the valid candidates (given in preference order), unless a preferred one is within the
    noise of their timings (the larger relative spread of the two), counted up to `tie_margin`.

    Small kernels time the host as much as the GPU: picks among backends a few percent apart changed from run
    to run, and in a real SDXL step the less preferred ones lost (measured on the H200: bench/results)."""
    fastest = min(valid, key=lambda c: c.median_ms)
    return next(c for c in valid if c.median_ms <= fastest.median_ms * (
        1 + min(tie_margin, max(spread(c.times_ms), spread(fastest.times_ms)))))


def progress(record: TuneRecord, stage: str, done: int, total: int, start: float, budget: float, candidate=None,
             chosen=None) -> None:
    """Tell the host (hooks.set_progress_hook) where this signature's tuning stands."""
    sig = record.signature
    shape = f"q {sig.batch}x{sig.len_q}x{sig.heads_q}x{sig.head_dim}" + (
        f", k/v length {sig.len_kv}" if sig.len_kv != sig.len_q else "")
    hooks.progress(hooks.TuningProgress(
        "auto_exact" if record.exact else "auto_fast", shape, record.model, stage, done,
        total, measure.now() - start, budget, candidate, chosen))


def tuning_inputs(sig, layout, live, cap: int):
    """(inputs to run candidates on, their signature, whether they are the caller's live values)."""
    if live is not None:  # the call's own tensors: verdicts on them, and no copy to allocate
        return live._replace(dropout_p=0.0, attention_kwargs=None, backend=None, recorder=None), sig, True
    run_sig = shrink(sig, cap)
    q, k, v, mask = random_inputs(run_sig, layout)
    scale = (0.9 / math.sqrt(sig.head_dim)) if sig.custom_scale else None
    call = AttentionCall(query=q, key=k, value=v, attn_mask=mask, is_causal=run_sig.is_causal, scale=scale,
                         enable_gqa=run_sig.enable_gqa, layout=layout, return_lse=run_sig.return_lse)
    return call, run_sig, False


def reject(result: CandidateResult, reason: str, device: torch.device) -> None:
    result.status, result.reason = "rejected", reason
    result.median_ms, result.times_ms = None, []
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()


@dataclass
class Timing:
    """How candidates are judged and timed (calls per candidate, rows checked, the tie margin, the memory cap of
    the tuning inputs), and how many timings it has run (`calls`: tests assert a disk hit runs none)."""
    warmup: int = 1
    runs: int = 5
    validation_rows: int = 64
    tie_margin: float = DEFAULT_TIE_MARGIN
    memory_cap_bytes: int | None = None
    calls: int = 0

    def memory_cap(self, device: torch.device) -> int:
        """Bytes the tuning inputs may take: the one set, else a quarter of free GPU memory up to 8 GiB (512 MiB
        on a CPU)."""
        if self.memory_cap_bytes is not None:
            return int(self.memory_cap_bytes)
        if device.type == "cuda":
            try:
                free, _ = torch.cuda.mem_get_info(device)
                return int(min(8 << 30, free // 4))
            except Exception:
                return 2 << 30
        return 512 << 20

    def measure(self, record: TuneRecord, names: list[str], live, start: float, budget: float) -> None:
        """Judge (on live values) and time (where the disk has no timing) every candidate not known yet, within
        the budget, and make the record's choice: every call counts, first calls (which may load or compile a
        kernel) included. The budget is checked before each step, so one step at most runs past it; candidates
        left untried are tried again by the next process (their verdicts are not saved)."""
        sig, layout = record.signature, record.layout
        device = torch.device(sig.device)
        cap = self.memory_cap(device)
        attention_call, run_sig, is_live = tuning_inputs(sig, layout, live, cap)
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
        progress(record, "start", 0, len(names), start, budget)

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
            progress(record, "candidate", position, len(names), start, budget, candidate=name)
            try:
                call = _try(name, result, attention_call, run_sig, layout, device, rows, ref_out, ref_lse, is_live,
                            known)
                if call is None:
                    continue
                calls[name] = call
                if result.median_ms is not None:  # timed before (disk): only its verdict was wanted
                    continue
                if spent():
                    cut_short(result, "timed")
                    continue
                hooks.check_interrupt()
                self.calls += 1
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
                reject(result, f"raised {first_line(exc)}", device)
                calls.pop(name, None)
        valid = [c for c in record.candidates if c.status == "valid" and c.median_ms is not None]
        if timed_any:
            self.final_round(record, valid, calls, device, start, budget, len(names))
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

    def final_round(self, record, valid, calls, device, start, budget, total) -> None:
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
        self.calls += 1
        progress(record, "final round", total, total, start, budget)
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
                    reject(candidate, f"raised {first_line(failed[candidate.name])}", device)
            return
        for candidate, samples in zip(contenders, times):
            candidate.times_ms, candidate.median_ms = samples, statistics.median(samples)


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
