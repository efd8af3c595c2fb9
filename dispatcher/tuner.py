"""`auto`: for each attention signature, the fastest backend whose result is correct, measured once.

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
`preference` order decides without timing. `report()` / `explain()` say what was measured, rejected
and chosen, and what it cost.

    from dispatcher import tuner
    out = dispatch_attention_fn(q, k, v, backend="auto")
    print(tuner.explain())
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import env, masks, registry, trust
from .inputs import AttentionInputs, describe_call
from .machine import Machine, current_machine

logger = logging.getLogger("attention_dispatch")

AUTO = "auto"
ENV_CACHE = "ATTN_DISPATCH_TUNE_CACHE"  # a JSON file (or a folder for tune.json); "off" = no disk cache
ENV_BUDGET = "ATTN_DISPATCH_TUNE_BUDGET"  # seconds per signature
ENV_MAX_SIGNATURES = "ATTN_DISPATCH_TUNE_MAX_SIGNATURES"
DEFAULT_BUDGET_S = 2.0
DEFAULT_MAX_SIGNATURES = 32
DEFAULT_TIE_MARGIN = 0.03  # at most: how much a later backend in preference order must beat an earlier one by
CACHE_FORMAT = 1
_OFF = frozenset({"", "0", "off", "no", "none", "false"})
# Backends that materialise the (B, H, Lq, Lk) score matrix: skipped when it would not fit the memory cap.
QUADRATIC_MEMORY = frozenset({"_native_math"})
_DTYPES = {str(d).replace("torch.", ""): d for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:0" are one device: one key
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return str(device)


# ----------------------------------------------------------------------------------------------- signatures

@dataclass(frozen=True)
class Signature:
    """What decides which backend is fastest: shapes, dtype, device and flags of one attention call."""

    batch: int
    heads_q: int
    len_q: int
    head_dim: int
    len_kv: int | None = None  # None: = len_q
    heads_kv: int | None = None  # None: = heads_q
    head_dim_v: int | None = None  # None: = head_dim
    dtype: str = "bfloat16"
    device: str = "cuda"
    mask_kind: str = "none"
    mask_shape: tuple[int, ...] | None = None
    is_causal: bool = False
    enable_gqa: bool = False
    custom_scale: bool = False
    dropout: bool = False
    return_lse: bool = False
    requires_grad: bool = False

    def __post_init__(self):
        for name, default in (("len_kv", "len_q"), ("heads_kv", "heads_q"), ("head_dim_v", "head_dim")):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(self, default))
        if isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", _dtype_name(self.dtype))
        object.__setattr__(self, "device", _device_name(self.device))
        if self.mask_shape is not None:
            object.__setattr__(self, "mask_shape", tuple(int(s) for s in self.mask_shape))
        if self.heads_kv != self.heads_q and not self.enable_gqa:
            object.__setattr__(self, "enable_gqa", True)

    @classmethod
    def from_inputs(cls, inputs: AttentionInputs) -> "Signature":
        return cls(batch=inputs.batch, heads_q=inputs.heads_q, len_q=inputs.len_q, head_dim=inputs.head_dim,
                   len_kv=inputs.len_kv, heads_kv=inputs.heads_kv, head_dim_v=inputs.head_dim_v,
                   dtype=_dtype_name(inputs.dtype), device=str(inputs.device), mask_kind=inputs.mask_kind,
                   mask_shape=inputs.mask_shape, is_causal=inputs.is_causal, enable_gqa=inputs.enable_gqa,
                   custom_scale=inputs.custom_scale, dropout=inputs.dropout, return_lse=inputs.return_lse,
                   requires_grad=inputs.requires_grad)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def to_inputs(self) -> AttentionInputs:
        device = torch.device(self.device)
        return AttentionInputs(
            batch=self.batch, heads_q=self.heads_q, heads_kv=self.heads_kv, len_q=self.len_q, len_kv=self.len_kv,
            head_dim=self.head_dim, head_dim_v=self.head_dim_v, dtype=self.torch_dtype, device=device,
            mask_kind=self.mask_kind, mask_shape=self.mask_shape, is_causal=self.is_causal, dropout=self.dropout,
            custom_scale=self.custom_scale, enable_gqa=self.enable_gqa, return_lse=self.return_lse,
            requires_grad=self.requires_grad, key_dtype=self.torch_dtype, value_dtype=self.torch_dtype,
            key_device=device, value_device=device)

    def key(self) -> str:
        """Stable text for the disk cache."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    def describe(self) -> str:
        return self.to_inputs().describe()

    @property
    def flops(self) -> int:
        """4·B·H·Lq·Lk·D (QKᵀ and PV, multiply-add = 2)."""
        return 2 * self.batch * self.heads_q * self.len_q * self.len_kv * (self.head_dim + self.head_dim_v)


# ----------------------------------------------------------------------------------------------- exact reference

def to_bhsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    return t if layout == "BHSD" else t.transpose(1, 2)


def pick(valid: list, tie_margin: float):
    """The fastest of the valid candidates (given in preference order), unless a preferred one is within the
    noise of their timings (the larger relative spread of the two), counted up to `tie_margin`.

    Small kernels time the host as much as the GPU: picks among backends a few percent apart changed from run
    to run, and in a real SDXL step the less preferred ones lost (measured on the H200: bench/results)."""
    fastest = min(valid, key=lambda c: c.median_ms)
    return next(c for c in valid if c.median_ms <= fastest.median_ms * (
        1 + min(tie_margin, max(_spread(c.times_ms), _spread(fastest.times_ms)))))


def _spread(times_ms: list[float]) -> float:
    """Relative interquartile range of timing samples (their noise)."""
    if len(times_ms) < 2:
        return 0.0
    low, _, high = statistics.quantiles(times_ms, n=4) if len(times_ms) >= 4 else (min(times_ms), 0, max(times_ms))
    return (high - low) / max(statistics.median(times_ms), 1e-12)


def sample_rows(len_q: int, rows: int | None) -> torch.Tensor | None:
    """Evenly spaced query rows (first and last included), or None for all of them."""
    if rows is None or rows >= len_q:
        return None
    return torch.linspace(0, len_q - 1, rows).round().long().unique()


def exact_attention(query, key, value, attn_mask=None, is_causal=False, scale=None, layout="BSHD", rows=None,
                    max_bytes: int = 256 << 20):
    """Exact attention in float64 for query rows `rows` (an index tensor, None = all): (out, lse).

    out is (B, H, R, Dv) and lse (B, H, R), float64, from the caller's (possibly low-precision) inputs,
    so a comparison measures the kernel's error only. Grouped-query heads are expanded, causal is
    SDPA's top-left diagonal, the mask follows ComfyUI's rank rule. Heads are processed in chunks so the
    float64 scores stay under `max_bytes`.
    """
    q, k, v = to_bhsd(query, layout), to_bhsd(key, layout), to_bhsd(value, layout)
    b, h, lq, d = q.shape
    hk, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
    groups = h // hk
    idx = torch.arange(lq, device=q.device) if rows is None else rows.to(q.device)
    scale = scale if scale is not None else 1.0 / math.sqrt(d)
    mask4 = None
    if attn_mask is not None:
        mask4 = masks.to_4d(attn_mask).expand(b, h, lq, lk)
    per_head = b * len(idx) * lk * 8 * 3 + b * lk * (d + dv) * 8
    chunk = max(1, min(h, int(max_bytes // max(per_head, 1))))
    outs, lses = [], []
    for h0 in range(0, h, chunk):
        heads = torch.arange(h0, min(h, h0 + chunk), device=q.device)
        qh = q[:, heads][:, :, idx].double()
        kh, vh = k[:, heads // groups].double(), v[:, heads // groups].double()
        scores = torch.matmul(qh, kh.transpose(-2, -1)) * scale
        if is_causal:
            keep = torch.arange(lk, device=q.device)[None, :] <= idx[:, None]
            scores = scores.masked_fill(~keep, float("-inf"))
        if mask4 is not None:
            m = mask4[:, heads][:, :, idx]
            scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.double()
        lse = torch.logsumexp(scores, dim=-1)
        outs.append(torch.matmul(torch.exp(scores - lse[..., None]), vh))
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


def relative_error(out_rows: torch.Tensor, ref_rows: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ (Frobenius), the measure every accuracy check of the pack uses."""
    return float((out_rows.double() - ref_rows).norm() / ref_rows.norm().clamp_min(1e-30))


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


def non_finite(t: torch.Tensor) -> int:
    return int((~torch.isfinite(t)).sum())


# ----------------------------------------------------------------------------------------------- machine key

@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def machine_fingerprint(machine: Machine | None = None) -> dict[str, Any]:
    """What a measurement depends on: the device, torch and every attention package's version."""
    m = machine or current_machine()
    return {"device": m.device_type, "name": m.device_name if m.device_type != "cpu" else cpu_model(),
            "capability": list(m.cuda_capability) if m.cuda_capability else None, "rocm_arch": m.rocm_arch,
            "torch": m.torch_version, "cuda": m.cuda_version, "hip": m.hip_version,
            "packages": dict(sorted(m.packages.items()))}


def fingerprint_key(fingerprint: dict) -> str:
    return hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]


def default_cache_path() -> Path | None:
    raw = os.environ.get(ENV_CACHE)
    if raw is not None:
        if raw.strip().lower() in _OFF:
            return None
        path = Path(raw.strip()).expanduser()
        return path / "tune.json" if path.is_dir() else path
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "attention_dispatch" / "tune.json"


# ----------------------------------------------------------------------------------------------- results

@dataclass
class CandidateResult:
    name: str
    status: str  # chosen | valid | rejected | untimed
    preference: int = 0
    error_bound: float = 0.0
    rel_error: float | None = None
    median_ms: float | None = None
    times_ms: list[float] = field(default_factory=list)
    first_call_ms: float | None = None
    reason: str = ""


@dataclass
class TuneRecord:
    signature: Signature
    chosen: str
    source: str  # timed | disk | preference | only-candidate | none
    reason: str = ""
    candidates: list[CandidateResult] = field(default_factory=list)
    skipped: list[tuple[str, list[str]]] = field(default_factory=list)  # backends that cannot run the call
    seconds: float = 0.0
    timed_shape: dict | None = None  # the lengths actually timed, when the memory cap shrank them
    layout: str = "BSHD"
    trust_sensitive: bool = False

    @property
    def rejected(self) -> list[CandidateResult]:
        return [c for c in self.candidates if c.status == "rejected"]

    def as_dict(self) -> dict[str, Any]:
        return {"signature": asdict(self.signature), "description": self.signature.describe(), "chosen": self.chosen,
                "source": self.source, "reason": self.reason, "seconds": round(self.seconds, 4),
                "layout": self.layout, "timed_shape": self.timed_shape,
                "candidates": [asdict(c) for c in self.candidates],
                "rejected": {c.name: c.reason for c in self.rejected},
                "skipped": {name: reasons for name, reasons in self.skipped}}


# ----------------------------------------------------------------------------------------------- the tuner

_DEFAULT_PATH = object()


class Tuner:
    """Measures and remembers `auto` decisions; thread-safe (one lock around tuning)."""

    def __init__(self, *, cache_path=_DEFAULT_PATH, time_budget_s: float | None = None,
                 max_signatures: int | None = None, warmup: int = 1, runs: int = 5, validation_rows: int = 64,
                 memory_cap_bytes: int | None = None, backends=None, tie_margin: float = DEFAULT_TIE_MARGIN):
        """cache_path: the JSON file (None: memory only; default: ATTN_DISPATCH_TUNE_CACHE or ~/.cache/...);
        time_budget_s: seconds per signature (ATTN_DISPATCH_TUNE_BUDGET, 2); max_signatures: timed per process
        (ATTN_DISPATCH_TUNE_MAX_SIGNATURES, 32); warmup/runs: calls per candidate; validation_rows: query
        rows checked against exact attention; memory_cap_bytes: for the tuning inputs (default: a quarter
        of free GPU memory up to 8 GiB, 512 MiB on a CPU); backends: consider only these names; tie_margin:
        how much faster than a preferred backend another must be to win (timings carry host noise)."""
        self._cache_path = cache_path
        self.backends = None if backends is None else tuple(backends)
        self.time_budget_s = float(time_budget_s if time_budget_s is not None
                                   else env.value(ENV_BUDGET, str(DEFAULT_BUDGET_S)))
        self.max_signatures = int(max_signatures if max_signatures is not None
                                  else env.value(ENV_MAX_SIGNATURES, str(DEFAULT_MAX_SIGNATURES)))
        self.warmup, self.runs, self.validation_rows = int(warmup), max(1, int(runs)), int(validation_rows)
        self.memory_cap_bytes = memory_cap_bytes
        self.tie_margin = float(tie_margin)
        self._lock = threading.RLock()
        self._choices: dict[tuple, tuple[str, bool]] = {}  # (signature, trust, machine) -> (name, trust-sensitive)
        self._records: dict[Signature, TuneRecord] = {}
        self._timed = 0
        self.timing_calls = 0  # candidate timings actually run (tests: a disk hit runs none)

    # -- configuration
    @property
    def cache_path(self) -> Path | None:
        if self._cache_path is _DEFAULT_PATH:
            return default_cache_path()
        return None if self._cache_path is None else Path(self._cache_path)

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
    def choose(self, inputs: AttentionInputs, *, layout: str = "BSHD", tensors=None, timing: bool = True
               ) -> tuple[str, bool]:
        """(backend name, whether the choice depends on trust settings) for these inputs."""
        key = self._key(Signature.from_inputs(inputs))
        hit = self._choices.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self._choices.get(key)
            if hit is None:
                record = self._resolve(key[0], inputs, layout=layout, tensors=tensors, timing=timing)
                hit = (record.chosen, record.trust_sensitive)
                if timing or record.source != "preference":  # a traced guess must not stop a later measurement
                    self._choices[key] = hit
        return hit

    @staticmethod
    def _key(sig: Signature) -> tuple:
        """What a choice depends on besides the signature: trust settings and the machine (use_machine)."""
        return sig, trust.scope_key(), fingerprint_key(machine_fingerprint())

    def tune(self, what, key=None, value=None, *, attn_mask=None, is_causal=False, scale=None, enable_gqa=False,
             return_lse=False, dropout_p=0.0, layout="BSHD", force=False) -> TuneRecord:
        """Decide `auto` for a Signature, AttentionInputs or tensors (query[, key, value]) now; the record.

        force=True measures again even when memory or disk already has a decision.
        """
        tensors = None
        if isinstance(what, Signature):
            inputs = what.to_inputs()
        elif isinstance(what, AttentionInputs):
            inputs = what
        elif isinstance(what, torch.Tensor):
            key = what if key is None else key
            value = key if value is None else value
            from .checks import check_shapes, check_structure
            check_shapes(what, key, value, layout)
            inputs = describe_call(what, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                                   layout)
            check_structure(inputs)
            tensors = (what, key, value, attn_mask)
        else:
            raise TypeError(f"tune() takes a Signature, AttentionInputs or query tensor; got {type(what).__name__}")
        sig = Signature.from_inputs(inputs)
        with self._lock:
            record = self._resolve(sig, inputs, layout=layout, tensors=tensors, timing=True, use_disk=not force)
            if force:
                from . import dispatch
                dispatch.forget_decisions()  # dispatch's fast path may hold the previous choice
            self._choices[self._key(sig)] = (record.chosen, record.trust_sensitive)
        return record

    # -- reports
    def records(self) -> list[TuneRecord]:
        with self._lock:
            return list(self._records.values())

    def report(self) -> dict[str, Any]:
        """Per signature: candidates, timings, errors, rejections, chosen and seconds; plus the totals."""
        records = self.records()
        return {"time_budget_s": self.time_budget_s, "max_signatures": self.max_signatures,
                "timed_signatures": self._timed, "total_seconds": round(sum(r.seconds for r in records), 4),
                "cache_path": str(self.cache_path) if self.cache_path else None,
                "machine": machine_fingerprint(), "signatures": [r.as_dict() for r in records]}

    def explain(self) -> str:
        records = self.records()
        if not records:
            return "auto: no attention signature tuned in this process"
        lines = [f"auto: {len(records)} signatures, {self._timed} timed, "
                 f"{sum(r.seconds for r in records):.2f} s spent (budget {self.time_budget_s:g} s per signature, "
                 f"at most {self.max_signatures} timed)"]
        for r in records:
            lines.append(f"  {r.signature.describe()}")
            lines.append(f"    -> {r.chosen} ({r.source}{': ' + r.reason if r.reason else ''}; {r.seconds:.2f} s)")
            for c in r.candidates:
                timing = f"{c.median_ms:.3f} ms" if c.median_ms is not None else "not timed"
                error = f"err {c.rel_error:.1e}" if c.rel_error is not None else "err -"
                lines.append(f"       {c.name:30} {c.status:9} {timing:>12}  {error}"
                             + (f"  ({c.reason})" if c.reason else ""))
        return "\n".join(lines)

    def forget_choices(self) -> None:
        with self._lock:
            self._choices.clear()

    def clear_cache(self, disk: bool = True) -> None:
        """Forget every decision (and the disk cache file, with disk=True)."""
        with self._lock:
            self._choices.clear()
            self._records.clear()
            self._timed = 0
            path = self.cache_path
            if disk and path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        from . import dispatch
        dispatch.forget_decisions()

    # -- candidates
    def candidates(self, inputs: AttentionInputs) -> tuple[list[str], list[tuple[str, list[str]]], bool]:
        """(names best-preference first, [(skipped name, reasons)], trust-sensitive)."""
        names, skipped, sensitive = [], [], False
        fetched = None
        for name in registry.names():
            if self.backends is not None and name not in self.backends:
                continue
            spec = registry.get(name)
            reasons = registry.availability_reasons(name)
            if spec.hub is not None:
                verdict = trust.decide(spec.hub.repo_id)
                if not [r for r in reasons if verdict.allowed or r != verdict.reason]:
                    sensitive = True  # only trust stands between this Hub kernel and the candidates
            reasons = reasons or spec.not_supported_reasons(inputs)
            if not reasons and spec.hub is not None:
                if fetched is None:
                    fetched = _fetched_repos()
                if spec.hub.repo_id not in fetched:
                    reasons = [f"Hub kernel '{spec.hub.repo_id}' is not fetched or loaded yet; auto never downloads "
                               f"code: select '{name}' once (or run install.py) to make it a candidate"]
            if reasons:
                skipped.append((name, list(reasons)))
            else:
                names.append(name)
        order = {n: i for i, n in enumerate(names)}
        names.sort(key=lambda n: (-registry.get(n).preference, order[n]))
        return names, skipped, sensitive

    # -- deciding
    def _resolve(self, sig: Signature, inputs: AttentionInputs, *, layout: str, tensors, timing: bool,
                 use_disk: bool = True) -> TuneRecord:
        start = time.perf_counter()
        names, skipped, sensitive = self.candidates(inputs)
        record = TuneRecord(sig, names[0] if names else "native", "preference", skipped=skipped, layout=layout,
                            trust_sensitive=sensitive)
        specs = {n: registry.get(n) for n in names}
        record.candidates = [CandidateResult(n, "untimed", specs[n].preference, specs[n].error_bound) for n in names]
        if not names:
            record.source, record.reason = "none", "no backend supports these inputs; 'native' explains why"
        elif len(names) == 1:
            record.source, record.reason = "only-candidate", ""
        elif use_disk and self._from_disk(sig, names, record):
            pass
        elif not timing:
            record.reason = "decided while torch.compile traces, which cannot time kernels: preference order"
        elif sig.dropout:
            record.reason = "dropout makes outputs random, so they cannot be validated: preference order"
        elif sig.mask_kind == "blockmask" and (tensors is None or tensors[3] is None):
            record.reason = "a BlockMask cannot be synthesised for timing: preference order"
        elif self._timed >= self.max_signatures:
            record.reason = (f"the limit of {self.max_signatures} timed signatures per process is reached "
                             f"({ENV_MAX_SIGNATURES}): preference order")
        elif self.time_budget_s <= 0:
            record.reason = f"the time budget is {self.time_budget_s:g} s ({ENV_BUDGET}): preference order"
        else:
            self._timed += 1
            try:
                self._measure(sig, inputs, record, names, layout, tensors, start)
            except Exception as exc:  # tuning must never break the call it was made for
                logger.warning("auto: tuning %s failed (%s: %s); using the preference order", sig.describe(),
                               type(exc).__name__, exc)
                record.source, record.chosen = "preference", names[0]
                record.reason = f"tuning failed ({type(exc).__name__}: {exc}): preference order"
            if record.source == "timed":
                self._to_disk(sig, names, record)
        record.seconds = time.perf_counter() - start
        if record.source == "preference" and names:
            record.chosen = next((c.name for c in record.candidates if c.status != "rejected"), names[0])
        for c in record.candidates:
            if c.name == record.chosen and c.status in ("valid", "untimed"):
                c.status = "chosen"
        self._records[sig] = record
        if record.source == "timed":
            rejected = "; ".join(f"{c.name} ({c.reason})" for c in record.rejected)
            logger.info("auto: %s -> %s (%d candidates, %.2f s)%s", sig.describe(), record.chosen, len(names),
                        record.seconds, f"; rejected: {rejected}" if rejected else "")
            for c in record.rejected:
                logger.warning("auto rejected attention backend '%s' for %s: %s", c.name, sig.describe(), c.reason)
        return record

    def _measure(self, sig, inputs, record, names, layout, live, start):
        from . import dispatch

        device = torch.device(sig.device)
        cap = self._memory_cap(device)
        run_sig = _shrink(sig, cap)
        if run_sig != sig:
            record.timed_shape = {"len_q": run_sig.len_q, "len_kv": run_sig.len_kv,
                                  "why": f"the inputs would exceed the tuning memory cap of {cap >> 20} MiB"}
        q, k, v, mask = _random_inputs(run_sig, layout, live if run_sig == sig else None)
        scale = (0.9 / math.sqrt(sig.head_dim)) if sig.custom_scale else None
        rows = sample_rows(run_sig.len_q, self.validation_rows)
        with torch.no_grad():
            ref_out, ref_lse = exact_attention(q, k, v, mask, run_sig.is_causal, scale, layout, rows)
        score_bytes = run_sig.batch * run_sig.heads_q * run_sig.len_q * run_sig.len_kv * 4
        by_name = {c.name: c for c in record.candidates}
        valid: list[CandidateResult] = []
        # A first call may JIT-compile (Triton, inductor): that one-off cost is not charged to the budget,
        # or the first candidate in preference order would use it up and win untimed.
        compiling = 0.0
        for position, name in enumerate(names):
            result = by_name[name]
            elapsed = time.perf_counter() - start - compiling
            if valid and elapsed >= self.time_budget_s:
                result.reason = f"not timed: the {self.time_budget_s:g} s budget for this signature was spent"
                continue
            if name in QUADRATIC_MEMORY and score_bytes > cap:
                result.reason = (f"not timed: it materialises the {score_bytes >> 20} MiB score matrix, over the "
                                 f"tuning memory cap")
                continue
            spec = registry.get(name)
            try:
                runner = registry.prepare(name)
            except Exception as exc:
                result.status, result.reason = "rejected", f"could not be loaded: {type(exc).__name__}: {exc}"
                continue

            def call(spec=spec, runner=runner):
                return dispatch._run(spec, runner, q, k, v, mask, 0.0, run_sig.is_causal, scale, run_sig.enable_gqa,
                                     run_sig.return_lse, layout, {})

            self.timing_calls += 1
            try:
                with torch.no_grad():
                    t0 = time.perf_counter()
                    result_value = call()
                    _sync(device)
                    first = time.perf_counter() - t0
                    compiling += first
            except Exception as exc:
                if device.type == "cuda":
                    with contextlib.suppress(Exception):
                        torch.cuda.empty_cache()
                result.status = "rejected"
                result.reason = f"raised {first_line(exc)}"
                continue
            result.first_call_ms = first * 1e3
            out, lse = result_value if run_sig.return_lse else (result_value, None)
            problem = _validate(out, lse, ref_out, ref_lse, rows, layout, spec.error_bound, result)
            del result_value, out, lse
            if problem:
                result.status, result.reason = "rejected", problem
                continue
            # A timed warm call (the first one may have compiled or planned) sizes the runs that fit this
            # candidate's share of what is left of the budget.
            with torch.no_grad():
                t0 = time.perf_counter()
                call()
                _sync(device)
                steady = max(time.perf_counter() - t0, 1e-6)
                left = max(0.0, self.time_budget_s - (time.perf_counter() - start - compiling))
                fits = int(left / max(1, len(names) - position) / steady)
                runs = max(1, min(self.runs, fits))
                warmup = min(max(0, self.warmup - 1), max(0, fits - runs))
                result.times_ms = _time(call, device, warmup, runs)
            result.median_ms = statistics.median(result.times_ms)
            result.status = "valid"
            valid.append(result)
        if not valid:
            record.source = "preference"
            record.reason = "no candidate passed validation: preference order (the dispatcher falls back if it fails)"
            return
        record.chosen, record.source = pick(valid, self.tie_margin).name, "timed"

    # -- disk
    def _load_disk(self) -> dict:
        path = self.cache_path
        if path is None or not path.exists():
            return {}
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            logger.warning("auto: ignoring the unreadable tuning cache %s (%s)", path, exc)
            return {}
        if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or not isinstance(data.get("machines"), dict):
            return {}
        return data

    def _from_disk(self, sig: Signature, names: list[str], record: TuneRecord) -> bool:
        entry = self._load_disk().get("machines", {}).get(fingerprint_key(machine_fingerprint()), {})
        decision = entry.get("decisions", {}).get(sig.key()) if isinstance(entry, dict) else None
        if not isinstance(decision, dict):
            return False
        if decision.get("candidates") != names or decision.get("chosen") not in names:
            return False  # a backend came or went since it was measured: measure again
        record.chosen, record.source = decision["chosen"], "disk"
        record.reason = f"measured {decision.get('tuned_at', 'earlier')} ({self.cache_path})"
        saved = decision.get("results", {})
        for c in record.candidates:
            got = saved.get(c.name, {})
            c.status = got.get("status", c.status)
            c.median_ms, c.rel_error, c.reason = got.get("median_ms"), got.get("rel_error"), got.get("reason", "")
        return True

    def _to_disk(self, sig: Signature, names: list[str], record: TuneRecord) -> None:
        path = self.cache_path
        if path is None:
            return
        try:
            data = self._load_disk() or {"format": CACHE_FORMAT, "machines": {}}
            fingerprint = machine_fingerprint()
            entry = data["machines"].setdefault(fingerprint_key(fingerprint), {"machine": fingerprint, "decisions": {}})
            entry["updated"] = _now()
            entry["decisions"][sig.key()] = {
                "chosen": record.chosen, "candidates": names, "tuned_at": _now(), "seconds": round(record.seconds, 4),
                "results": {c.name: {"status": "valid" if c.status == "chosen" else c.status, "median_ms": c.median_ms,
                                     "rel_error": c.rel_error, "reason": c.reason} for c in record.candidates}}
            if len(data["machines"]) > 16:  # keep the most recently updated machines
                keep = sorted(data["machines"].items(), key=lambda kv: kv[1].get("updated", ""))[-16:]
                data["machines"] = dict(keep)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tune-", suffix=".json", dir=path.parent)
            with os.fdopen(fd, "w") as fh:
                json.dump(data, fh, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except OSError as exc:
            logger.warning("auto: could not write the tuning cache %s (%s)", path, exc)


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _fetched_repos() -> set[str]:
    from . import hub
    repos = {k.repo_id for k in hub.loaded_kernels()}
    with contextlib.suppress(Exception):
        repos |= set(hub.read_lock())
    return repos


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(call, device: torch.device, warmup: int, runs: int) -> list[float]:
    """Milliseconds of each of `runs` calls after `warmup` calls (CUDA events on GPUs)."""
    for _ in range(warmup):
        call()
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(runs)]
        _sync(device)
        for begin, end in events:
            begin.record()
            call()
            end.record()
        _sync(device)
        return [begin.elapsed_time(end) for begin, end in events]
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        call()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _validate(out, lse, ref_out, ref_lse, rows, layout, bound, result) -> str | None:
    if not isinstance(out, torch.Tensor):
        return f"returned {type(out).__name__}, not a tensor"
    expected = ref_out.shape
    got = to_bhsd(out, layout)
    if got.shape[:2] != expected[:2] or got.shape[-1] != expected[-1]:
        return f"returned shape {tuple(out.shape)}, which does not match the inputs"
    bad = non_finite(out)
    if bad:
        return f"output has {bad} NaN/Inf values"
    picked = got if rows is None else got[:, :, rows.to(got.device)]
    err = relative_error(picked, ref_out)
    result.rel_error = err
    if not err <= bound:
        return f"relative error {err:.2e} vs exact attention exceeds its bound {bound:.0e}"
    if lse is not None:
        lse_b = lse if layout == "BHSD" else lse.transpose(1, 2)
        if non_finite(lse_b):
            return f"log-sum-exp has {non_finite(lse_b)} NaN/Inf values"
        picked = lse_b if rows is None else lse_b[:, :, rows.to(lse_b.device)]
        lse_err = relative_error(picked, ref_lse)
        if not lse_err <= bound:
            return f"log-sum-exp relative error {lse_err:.2e} exceeds the bound {bound:.0e}"
    return None


def _shrink(sig: Signature, cap: int) -> Signature:
    """The signature with both lengths scaled down until q, k, v, out and a workspace fit `cap` bytes."""
    item = torch.empty((), dtype=sig.torch_dtype).element_size()

    def need(lq, lk):
        per_q = sig.batch * sig.heads_q * (sig.head_dim + sig.head_dim_v) * 2  # q, out, workspace
        per_k = sig.batch * sig.heads_kv * (sig.head_dim + sig.head_dim_v)
        return item * (lq * per_q + lk * per_k)

    if need(sig.len_q, sig.len_kv) <= cap:
        return sig
    factor = cap / need(sig.len_q, sig.len_kv)
    lq, lk = max(1, int(sig.len_q * factor)), max(1, int(sig.len_kv * factor))
    mask_shape = None
    if sig.mask_shape is not None:
        shape = list(sig.mask_shape)
        if len(shape) >= 2:
            shape[-1] = lk if shape[-1] == sig.len_kv else shape[-1]
            shape[-2] = lq if shape[-2] == sig.len_q else shape[-2]
        mask_shape = tuple(shape)
    from dataclasses import replace
    return replace(sig, len_q=lq, len_kv=lk, mask_shape=mask_shape)


def _random_inputs(sig: Signature, layout: str, live=None):
    """Seeded random q, k, v in `layout` (the strides of live tensors when given and compact) and a mask."""
    device, dtype = torch.device(sig.device), sig.torch_dtype
    gen = torch.Generator(device=device).manual_seed(1234)

    def shape(heads, length, dim):
        return (sig.batch, length, heads, dim) if layout == "BSHD" else (sig.batch, heads, length, dim)

    shapes = (shape(sig.heads_q, sig.len_q, sig.head_dim), shape(sig.heads_kv, sig.len_kv, sig.head_dim),
              shape(sig.heads_kv, sig.len_kv, sig.head_dim_v))
    tensors = []
    for i, size in enumerate(shapes):
        template = live[i] if live is not None else None
        t = None
        if template is not None and tuple(template.shape) == size:
            strides = template.stride()
            extent = 1 + sum((s - 1) * st for s, st in zip(size, strides))
            if min(strides) >= 0 and extent <= 4 * template.numel():  # same strides, e.g. Flux's permuted views
                t = torch.empty_strided(size, strides, dtype=dtype, device=device)
                t.as_strided((extent,), (1,)).copy_(torch.randn(extent, generator=gen, device=device, dtype=dtype))
        tensors.append(t if t is not None else torch.randn(size, generator=gen, device=device, dtype=dtype))
    mask = None
    if live is not None and live[3] is not None:
        mask = live[3]  # masks are small and decide the kernel's work: use the caller's
    elif sig.mask_kind in ("bool", "key_padding", "additive") and sig.mask_shape is not None:
        keep = torch.rand(sig.mask_shape, generator=gen, device=device) > 0.2
        keep[..., 0] = True  # no fully masked row
        mask = keep if sig.mask_kind != "additive" else torch.zeros(
            sig.mask_shape, dtype=dtype, device=device).masked_fill_(~keep, float("-inf"))
    return tensors[0], tensors[1], tensors[2], mask


# ----------------------------------------------------------------------------------------------- module API

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
    from . import dispatch
    dispatch.forget_decisions()
    return previous


@contextlib.contextmanager
def using(tuner: Tuner):
    """Use `tuner` for `auto` inside the block (process-wide; tests and the bench)."""
    previous = set_default_tuner(tuner)
    try:
        yield tuner
    finally:
        set_default_tuner(previous)


def forget_choices() -> None:
    """Forget the in-memory decisions (the dispatcher calls this when the registry changes)."""
    if _default is not None:
        _default.forget_choices()


def configure(**settings) -> Tuner:
    """Replace the default tuner with one built from these settings (see `Tuner`)."""
    tuner = Tuner(**settings)
    set_default_tuner(tuner)
    return tuner


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
