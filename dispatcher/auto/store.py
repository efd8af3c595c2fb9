"""What the tuner remembers, under one key (`record.TuneKey`): the choices the dispatcher reads, the records the
reports show, the timings and exact verdicts one block's tuning leaves for the next, the seconds each signature's
tuning has had, the model steps' choices waiting for their forward; and the disk (cache.py), keyed by
`TuneKey.disk()`. Every table holds its entries under the part of the key they depend on (`TuneKey.timings()`...).
Not locked: the tuner holds its lock around every change."""

from __future__ import annotations

from pathlib import Path

from .. import registry, state
from . import cache, step
from .record import DISK, LIVE, TuneKey, TuneRecord

DEFAULT_PATH = object()  # the cache file `cache.default_cache_path()` names when asked


class Store:
    def __init__(self, cache_path=DEFAULT_PATH):
        """cache_path: the cache file (SQLite; None: memory only; default: `cache.default_cache_path()`)."""
        self._cache_path = cache_path
        # TuneKey -> (name, trust-sensitive); forgotten with the dispatcher's decisions (caches.on_forget,
        # auto/__init__.py), which are made from these choices.
        self.choices: dict[TuneKey, tuple[str, bool]] = {}
        self.records: dict[TuneKey, TuneRecord] = {}  # under TuneKey.tuning() (reports)
        # What one block's tuning leaves for the next block of the same signature (`recall`):
        # {name: (median_ms, times_ms)} under TuneKey.timings(), {name: (status, rel_error, reason)} of the exact
        # kernels under TuneKey.verdicts().
        self.timings: dict[TuneKey, dict[str, tuple]] = {}
        self.verdicts: dict[TuneKey, dict[str, tuple]] = {}
        # TuneKey.shared() -> {candidates: seconds of tuning they have had in this process, every block}. A new
        # candidate set (an approximate kernel admitted to a model's trial forward, a Hub kernel fetched) gets a
        # budget of its own: its new candidates were never tried, and the timings already made are reused.
        self.spent: dict[TuneKey, dict[tuple[str, ...], float]] = {}
        # The model's step (step.py): per-signature choices of live calls wait in `pending` while the forward they
        # belong to is recorded (`sequences`, under TuneKey.forward()); once it is complete, the step decision
        # settles them all. `steps`: step.sequence_key -> StepRecord.
        self.pending: dict[TuneKey, TuneRecord] = {}
        self.sequences: dict[TuneKey, step.Sequence] = {}
        self.steps: dict[str, step.StepRecord] = {}

    @property
    def cache_path(self) -> Path | None:
        if self._cache_path is DEFAULT_PATH:
            return cache.default_cache_path()
        return None if self._cache_path is None else Path(self._cache_path)

    def forget_choices(self) -> None:
        """Forget the choices; the measurements they were made from stay (records, timings, verdicts, disk)."""
        self.choices.clear()
        self.pending.clear()  # made among candidates that may have changed: resolved again
        self.sequences.clear()

    def clear(self, disk: bool) -> None:
        for table in (self.choices, self.records, self.timings, self.verdicts, self.spent, self.pending,
                      self.sequences, self.steps):
            table.clear()
        if disk:
            cache.remove(self.cache_path)

    def spent_on(self, key: TuneKey, names: list[str]) -> float:
        """Seconds of tuning this signature's candidates `names` have had in this process."""
        return self.spent.get(key.shared(), {}).get(tuple(names), 0.0)

    def add_spent(self, key: TuneKey, names: list[str], seconds: float) -> None:
        spent = self.spent.setdefault(key.shared(), {})
        spent[tuple(names)] = spent.get(tuple(names), 0.0) + seconds

    # -- memory: what one block's tuning tells the next block of the same signature (and the other auto's record)
    def recall(self, record: TuneRecord) -> bool:
        """Fill the timings measured for this signature and the exact kernels' verdicts this model had on another
        block (or in the other auto's record): a block of auto_fast then has only its quantised kernels left to
        judge, on its own values. False when nothing of this signature was measured in this process."""
        timings = self.timings.get(record.key.timings())
        if timings is None:
            return False
        verdicts = self.verdicts.get(record.key.verdicts(), {})
        for c in record.candidates:
            if c.median_ms is None and c.name in timings:
                c.median_ms, c.times_ms = timings[c.name][0], list(timings[c.name][1])
            if c.status not in ("valid", "rejected") and c.name in verdicts:
                c.status, c.rel_error, c.reason = verdicts[c.name]
        return True

    def remember(self, record: TuneRecord) -> None:
        self.timings.setdefault(record.key.timings(), {}).update(
            {c.name: (c.median_ms, list(c.times_ms)) for c in record.candidates if c.median_ms is not None})
        if record.judged_on in (LIVE, DISK):
            self.verdicts.setdefault(record.key.verdicts(), {}).update(
                {c.name: ("valid" if c.status == "chosen" else c.status, c.rel_error, c.reason)
                 for c in record.candidates
                 if c.status in ("chosen", "valid", "rejected") and registry.get(c.name).exact})

    # -- disk: timings are shared by every model on this machine, accuracy verdicts belong to one model and block
    def load(self, record: TuneRecord, names: list[str]) -> bool:
        """Fill timings (and this model's verdicts) from disk; False when the disk has nothing usable."""
        decision = cache.lookup(self.cache_path, record.key.disk())
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

    def save(self, record: TuneRecord, names: list[str]) -> None:
        def merged(previous: dict | None) -> dict:
            """The saved decision with this record's timings and (live, scoped) verdicts added."""
            if previous is None or previous.get("candidates") != names:
                previous = {}
            timings = dict(previous.get("timings", {}))
            timings.update({c.name: {"median_ms": c.median_ms, "times_ms": c.times_ms} for c in record.candidates
                            if c.median_ms is not None})
            verdicts = dict(previous.get("verdicts", {}))
            if record.judged_on == LIVE and record.model != state.UNSCOPED_MODEL:  # unscoped ones stay in memory
                # written last, model and block: the cache keeps the most recently written ones (cache_shape.fitted)
                blocks = dict(verdicts.pop(record.model, {}))
                blocks.pop(record.block, None)
                blocks[record.block] = {c.name: {"status": "valid" if c.status == "chosen" else c.status,
                                                 "rel_error": c.rel_error, "reason": c.reason}
                                        for c in record.candidates if c.status in ("chosen", "valid", "rejected")}
                verdicts[record.model] = blocks
            return {"candidates": names, "tuned_at": cache.now(), "seconds": round(record.seconds, 4),
                    "timings": timings, "verdicts": verdicts}

        cache.update(self.cache_path, record.key.disk(), merged)

    # -- the model's step decisions on disk (step.sequence_key: made from the disk keys of the forward's calls)
    def load_step(self, key: str) -> str | None:
        """The configuration saved for this forward (a kernel or step.MIX), or None."""
        saved = cache.lookup(self.cache_path, key)
        return saved.get("chosen") if saved is not None else None

    def save_step(self, result: step.StepRecord, configs: list[str]) -> None:
        cache.update(self.cache_path, result.key, lambda previous: {
            "candidates": configs, "chosen": result.chosen, "source": result.source, "tuned_at": cache.now(),
            "step_ms": result.step_ms, "predicted_ms": result.predicted_ms})
