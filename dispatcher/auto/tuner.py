"""The tuner behind `auto`: per call signature, the fastest backend whose result is correct, measured once.

It decides; its parts say which backends compete (candidates.py), how they are judged and timed (timing.py,
measure.py), what is remembered in memory and on disk under one key (store.py, record.py), and whether one kernel
serves a model's whole forward (step.py)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from .. import caches, decisions, env, prediction, registry, state, trust
from ..call import AttentionCall
from ..checks import check_shapes, check_structure
from ..guard import admission_bound
from ..inputs import AttentionInputs, describe_call
from ..log import logger
from ..machine import current_machine
from . import hooks, measure, step, tune_log
from .candidates import candidates
from .fingerprint import machine_fingerprint
from .record import DISK, LIVE, TRIAL_SOURCE, CandidateResult, TuneKey, TuneRecord
from .store import DEFAULT_PATH, Store
from .timing import DEFAULT_TIE_MARGIN, ENV_BUDGET, Timing, pick, progress, tuning_inputs

ENV_MAX_SIGNATURES = "ATTN_DISPATCH_TUNE_MAX_SIGNATURES"
DEFAULT_BUDGET_S = 2.0  # on a GPU
# On a CPU: its kernels differ by wide margins (flex runs eagerly there, ten times slower than SDPA) and the clock
# drift the final round guards against on a GPU does not arise, while each prompt meets as many signatures as on
# a GPU: 2 s each made a tiny model's first prompt on a CPU 36 s instead of 9 s.
CPU_BUDGET_S = 0.5
DEFAULT_MAX_SIGNATURES = 32
DEFAULT_BLOCK = "attention"  # the call site of a call that names no block (AttentionCall's default)


class Tuner:
    """Measures and remembers `auto` decisions; thread-safe (one lock around tuning)."""

    def __init__(self, *, cache_path=DEFAULT_PATH, time_budget_s: float | None = None,
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
        self.store = Store(cache_path)
        self.backends = None if backends is None else tuple(backends)
        budget = time_budget_s if time_budget_s is not None else env.value(ENV_BUDGET)
        self.time_budget_s = None if budget is None else float(budget)  # None: by device (`budget`)
        self.max_signatures = int(max_signatures if max_signatures is not None
                                  else env.value(ENV_MAX_SIGNATURES, str(DEFAULT_MAX_SIGNATURES)))
        self.timing = Timing(int(warmup), max(1, int(runs)), int(validation_rows), float(tie_margin),
                             memory_cap_bytes)
        self.step_check = bool(step_check)
        self._lock = threading.RLock()
        self._timed = 0  # signatures timed in this process (`max_signatures`)

    # -- configuration
    @property
    def cache_path(self) -> Path | None:
        return self.store.cache_path

    @property
    def timing_calls(self) -> int:
        """Candidate timings actually run (tests: a disk hit runs none)."""
        return self.timing.calls

    def budget(self, device: str | torch.device) -> float:
        """Seconds of tuning per signature on `device`: the one set, else by device type."""
        if self.time_budget_s is not None:
            return self.time_budget_s
        return CPU_BUDGET_S if torch.device(device).type == "cpu" else DEFAULT_BUDGET_S

    def _budget_text(self) -> str:
        if self.time_budget_s is not None:
            return f"{self.time_budget_s:g} s"
        return f"{DEFAULT_BUDGET_S:g} s ({CPU_BUDGET_S:g} s on a CPU)"

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
        hit = self.store.choices.get(key)
        if hit is not None:
            return (*hit, True)
        with self._lock:
            hit = self.store.choices.get(key)
            if hit is not None:
                return (*hit, True)
            record = self.store.pending.get(key)
            if record is None:
                record = self._resolve(key, layout=layout, live=live, timing=timing)
                hit = (record.chosen, record.trust_sensitive)
                if not record.settled:
                    return (*hit, False)
                # a trial's pick is no timing pick either: no step to decide
                if live is None or not self.step_check or record.source in ("only-candidate", "none", TRIAL_SOURCE):
                    self.store.choices[key] = hit
                    return (*hit, True)
                self.store.pending[key] = record
            return self._in_step(key, record, live.call_site if live is not None else DEFAULT_BLOCK)

    @staticmethod
    def _key(sig: AttentionInputs, exact: bool, model: str, block: str, keys: tuple = ()) -> TuneKey:
        """What a choice depends on: the signature, the model and block, the call's attention_kwargs keys, trust
        settings and the machine."""
        return TuneKey(sig, exact, model, block, keys, trust.scope_key(), current_machine().key)

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
            key = self._key(inputs, exact, model, block)
            record = self._resolve(key, layout=layout, live=live, timing=True, use_disk=not force)
            if force:
                caches.forget()  # the dispatcher's decisions may hold the previous choice
            if record.settled:
                self.store.choices[key] = (record.chosen, record.trust_sensitive)
        return record

    # -- the model's step (step.py)
    def _in_step(self, key: TuneKey, record: TuneRecord, site: str) -> tuple[str, bool, bool]:
        """Record this call in its model's forward; once the forward is complete, decide the step and settle every
        choice of it. Until then a call is served by its signature's own pick, provisionally."""
        sequences, pending = self.store.sequences, self.store.pending
        sequence = sequences.setdefault(key.forward(), step.Sequence())
        if not sequence.add(site, key):
            return record.chosen, record.trust_sensitive, False
        del sequences[key.forward()]
        records = {k: pending[k] for k in sequence.keys()}
        result = self._decide_step([k for _, k in sequence.calls], records, key.exact, key.model)
        for k, rec in records.items():
            del pending[k]
            self.store.choices[k] = (rec.chosen if result.chosen == step.MIX else result.chosen, rec.trust_sensitive)
        hit = self.store.choices.get(key) or (record.chosen, record.trust_sensitive)
        return (*hit, True)

    def _decide_step(self, order: list, records: dict, exact: bool, model: str) -> step.StepRecord:
        """One kernel for every call of the forward, or the mix of per-signature picks: see step.py."""
        start = measure.now()
        disk_keys = [records[k].key.disk() for k in order]
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
        self.store.steps[result.key] = result
        logger.info("auto: %s", result.text())
        return result

    def _replay_step(self, result: step.StepRecord, order: list, records: dict, top: list[str]) -> None:
        configs = top + [step.MIX]
        earlier = self.store.steps.get(result.key)  # decided in this process (before the choices were forgotten)
        chosen = earlier.chosen if earlier is not None else None
        if chosen is None and result.model != state.UNSCOPED_MODEL:  # timings are the machine's, the order the model's
            chosen = self.store.load_step(result.key)
        if chosen in configs:
            result.chosen = chosen
            result.source, result.reason = "disk" if earlier is None else "memory", "decided earlier for this forward"
            return
        device = torch.device(next(iter(records.values())).signature.device)
        cap = self.timing.memory_cap(device)
        made: dict[TuneKey, tuple] = {}

        def inputs(key):
            if key not in made:
                rec = records[key]
                made[key] = tuning_inputs(rec.signature, rec.layout, None, cap)[:2]
            return made[key]

        self.timing.calls += 1
        tie_margin = self.timing.tie_margin
        try:
            step_ms, samples, why = step.replay(order, records, configs, inputs, device, self.budget(device),
                                                self.timing.runs, tie_margin)
        except hooks.TuningInterrupted as stop:
            raise stop.original from None
        except Exception as exc:  # a kernel that fails here keeps each call's own pick (it ran them alone)
            result.reason = f"replaying the forward failed ({type(exc).__name__}: {exc}): each call keeps its pick"
            return
        finally:
            made.clear()
        if why:
            result.source, result.reason = "predicted", why + ": from the per-signature timings"
            result.chosen = step.step_pick({c: result.predicted_ms[c] for c in configs}, {}, tie_margin)
        else:
            result.source, result.step_ms, result.samples_ms = "timed", step_ms, samples
            result.chosen = step.step_pick(step_ms, samples, tie_margin)
        if result.model != state.UNSCOPED_MODEL:
            self.store.save_step(result, configs)

    # -- reports
    def records(self) -> list[TuneRecord]:
        with self._lock:
            return list(self.store.records.values())

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
            return list(self.store.steps.values())

    def explain(self) -> str:
        records = self.records()
        if not records:
            return "auto: no attention signature tuned in this process"
        lines = [f"auto: {len(records)} signatures, {self._timed} timed, "
                 f"{sum(r.seconds for r in records):.2f} s spent (budget {self._budget_text()} per signature, "
                 f"at most {self.max_signatures} timed)"]
        for r in records:
            lines += r.explain_lines()
        lines += [f"  {s.text()}" for s in self.steps()]
        return "\n".join(lines)

    def forget_choices(self) -> None:
        """Forget the choices (caches.forget: the registry or the tuning changed); the measurements they were made
        from stay (the records, the timings and verdicts in memory and on disk): choosing again reads them."""
        with self._lock:
            self.store.forget_choices()

    def clear_cache(self, disk: bool = True) -> None:
        """Forget every decision (and the disk cache file, with disk=True)."""
        with self._lock:
            self.store.clear(disk)
            self._timed = 0
        caches.forget()

    def candidates(self, inputs: AttentionInputs, exact: bool = False, attention_kwargs=(), model: str | None = None,
                   block: str | None = None) -> tuple[list[str], list[tuple[str, list[str]]], bool]:
        """(names in priority order, [(skipped name, reasons)], trust-sensitive): candidates.py, among this tuner's
        `backends`."""
        return candidates(inputs, exact=exact, attention_kwargs=attention_kwargs, model=model, block=block,
                          among=self.backends)

    # -- deciding
    def _resolve(self, key: TuneKey, *, layout: str, live, timing: bool, use_disk: bool = True) -> TuneRecord:
        """Decide for `key`: from memory or disk where this signature's candidates were judged and timed, by the
        preference order where it cannot be timed, else by judging and timing them; the record, kept for reports."""
        start = measure.now()
        sig, exact, model, block, keys = key.signature, key.exact, key.model, key.block, key.attention_kwargs
        names, skipped, sensitive = self.candidates(sig, exact, keys, model, block or None)
        record = TuneRecord(sig, names[0] if names else "native", "preference", skipped=skipped, layout=layout,
                            trust_sensitive=sensitive, exact=exact, model=model, block=block, attention_kwargs=keys)
        record.candidates = [CandidateResult(n, "untimed", i, admission_bound(registry.get(n)))
                             for i, n in enumerate(names)]
        from_disk = from_memory = False
        if use_disk and len(names) > 1:
            from_disk = self.store.load(record, names)
            from_memory = self.store.recall(record)
        known = from_disk or from_memory
        judged = known and all(c.status in ("valid", "rejected") for c in record.candidates)
        timed = known and all(c.median_ms is not None for c in record.candidates if c.status == "valid")
        untimed = self._untimed(sig, live, timing, timed)
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
                self.store.remember(record)  # the next block and the other auto start from these
            record.chosen = pick([c for c in record.candidates if c.status == "valid"], self.timing.tie_margin).name
        elif untimed:
            record.reason = untimed
        else:
            self._measure(record, names, live, start, counted=not known)
        record.seconds = measure.now() - start
        if not exact and prediction.status(model) == prediction.TRIAL:
            _trial_pick(record)
        if record.source == "preference" and names:
            # Without a verdict on this model's values, never a kernel that is not exact.
            open_names = {c.name for c in record.candidates if c.status != "rejected"}
            record.chosen = decisions.exact_stand_in(names[0], among=names, usable=open_names.__contains__) or names[0]
        for c in record.candidates:
            if c.name == record.chosen and c.status in ("valid", "untimed", "unjudged"):
                c.status = "chosen"
        self.store.records[key.tuning()] = record
        if record.source in ("timed", "judged", TRIAL_SOURCE):
            where = f"model {model}" + (f", {block}" if block else "")
            progress(record, "done", len(names), len(names), start, self.budget(sig.device), chosen=record.chosen)
            tune_log.decided(record, where)  # once per group of blocks with the same outcome
        return record

    def _untimed(self, sig: AttentionInputs, live, timing: bool, timed: bool) -> str:
        """Why these inputs are decided without timing (the preference order), or "" where they may be timed."""
        if not timing:
            return "decided while torch.compile traces, which cannot time kernels: preference order"
        if sig.dropout:
            return "dropout makes outputs random, so they cannot be validated: preference order"
        if sig.mask_kind == "blockmask" and (live is None or live.attn_mask is None):
            return "a BlockMask cannot be synthesised for timing: preference order"
        if self._timed >= self.max_signatures and not (timed and live is not None):
            return (f"the limit of {self.max_signatures} timed signatures per process is reached "
                    f"({ENV_MAX_SIGNATURES}): preference order")
        if self.budget(sig.device) <= 0 and not (timed and live is not None):
            return f"the time budget is {self.budget(sig.device):g} s ({ENV_BUDGET}): preference order"
        return ""

    def _measure(self, record: TuneRecord, names: list[str], live, start: float, counted: bool) -> None:
        """Judge and time the candidates (timing.py) on what is left of the signature's budget, over every block
        and call that tunes it; remember and save what was measured. counted: a signature not measured before in
        this process counts towards `max_signatures`."""
        if counted:
            self._timed += 1
        spent_before = self.store.spent_on(record.key, names)
        try:
            self.timing.measure(record, names, live, start - spent_before, self.budget(record.signature.device))
        except hooks.TuningInterrupted as stop:  # the host's own interrupt: nothing is decided or saved
            if counted:
                self._timed -= 1
            raise stop.original from None
        except Exception as exc:  # tuning must never break the call it was made for
            logger.warning("auto: tuning %s failed (%s: %s); using the preference order", record.signature.describe(),
                           type(exc).__name__, exc)
            record.source, record.judged_on = "preference", ""
            record.reason = f"tuning failed ({type(exc).__name__}: {exc}): preference order"
        finally:
            self.store.add_spent(record.key, names, measure.now() - start)
        if record.source in ("timed", "judged"):
            self.store.remember(record)
            self.store.save(record, names)


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
