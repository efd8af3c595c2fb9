"""The declarative description of one backend: what it needs and which inputs it can run.

Everything a user or the dispatcher needs to decide "can X run this call here?" is data on
`BackendSpec`; `not_supported_reasons` turns it into every reason at once, the way xformers'
operators do, so an error lists all problems instead of the first.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .backend_options import BackendOptions
from .inputs import AttentionInputs
from .machine import capability_of
from .requirements import CudaCapability, Package, RocmArch, TorchVersion

FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
ANY_DEVICE = frozenset({"cpu", "cuda", "rocm", "mps", "xpu", "npu"})
HALF = frozenset({torch.float16, torch.bfloat16})
BF16 = frozenset({torch.bfloat16})

MASK_KINDS = ("none", "bool", "key_padding", "additive", "blockmask")
MASK_NAMES = {"bool": "a bool mask", "key_padding": "a bool key-padding mask", "additive": "an additive float mask",
              "blockmask": "a FlexAttention BlockMask", "integer": "an integer mask"}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


# dispatch_attention_fn's own arguments: never attention_kwargs keys. _INTERNAL: the built-in wrappers' own keywords.
STANDARD_ARGUMENTS = frozenset({"attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa", "return_lse"})
_INTERNAL = frozenset({"kernel", "style", "function", "pinned"})


def honoured_kwargs(fn) -> frozenset[str] | None:
    """The attention_kwargs keys a custom backend's function takes, read from its signature: the keyword
    parameters after query, key and value that are not standard arguments; None (any key) for a **kwargs one."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no signature to read (some builtins): it takes none
        return frozenset()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return None
    names = {p.name for p in params[3:] if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    return frozenset(names - STANDARD_ARGUMENTS - _INTERNAL)


@dataclass(frozen=True)
class HeadDims:
    minimum: int = 1
    maximum: int | None = None
    multiple_of: int = 1
    allowed: tuple[int, ...] | None = None

    def describe(self) -> str:
        if self.allowed:
            return ", ".join(map(str, self.allowed))
        text = f"{self.minimum}..{self.maximum}" if self.maximum else f">= {self.minimum}"
        return text + (f", multiple of {self.multiple_of}" if self.multiple_of > 1 else "")

    def reason(self, name: str, dim: int) -> str | None:
        ok = (dim in self.allowed) if self.allowed else (
            dim >= self.minimum and (self.maximum is None or dim <= self.maximum) and dim % self.multiple_of == 0)
        return None if ok else f"{name} {dim} is not supported (supported: {self.describe()})"


@dataclass(frozen=True)
class HubKernel:
    """A compiled kernel on the Hugging Face Hub, loaded through the `kernels` library."""

    repo_id: str
    function: str
    version: int | None = None
    revision: str | None = None
    min_kernels: str = "0.12"

    @property
    def publisher(self) -> str:
        return self.repo_id.split("/", 1)[0]

    @property
    def requirement(self) -> Package:
        """The kernels library it loads through, at the version it needs: a requirement of every backend that uses
        it, and what `hub.load` checks again at load time (in the same words)."""
        return Package("kernels", self.min_kernels)


@dataclass(frozen=True)
class LastResort:
    """Where `auto` leaves a backend out whenever another candidate can run the call (a kernel that cannot win there
    is not worth its first call), and the reason it gives; selected by name, the backend runs as ever."""

    devices: frozenset[str]  # device kinds (AttentionInputs.device_kind)
    reason: str


@dataclass(frozen=True)
class BackendSpec:
    name: str
    family: str
    description: str
    fn: Callable[..., Any] = field(compare=False, repr=False)
    layout: str = "BSHD"  # the layout the kernel takes and returns
    devices: frozenset[str] = frozenset({"cuda"})
    dtypes: frozenset[torch.dtype] = HALF
    head_dims: HeadDims = HeadDims(8, 256, 8)
    requires: tuple = ()
    masks: frozenset[str] = frozenset({"none"})
    causal: bool = True
    causal_alignment: str = "top_left"  # SDPA's; flash kernels align bottom-right when Lq != Lk
    # Takes attn_mask and is_causal=True together, applying both as SDPA does (the mask and the top-left diagonal).
    mask_with_causal: bool = False
    scale: bool = True
    gqa: bool = False
    dropout: bool = False
    lse: bool = False
    backward: bool = True
    different_value_dim: bool = False
    capability: CudaCapability | None = None
    rocm: RocmArch | None = None
    hub: HubKernel | None = None
    fallback: tuple[str, ...] = ("native",)
    # A kernel whose result may differ from exact attention by more than bf16 rounding (int8 Sage).
    error_bound: float = 2e-2
    quantised: bool = False  # computes in reduced precision (int8/fp8): never chosen by `auto_exact`
    # Leaves part of the attention out by design (block-sparse routing): its error depends on how local the model's
    # attention is, so `auto_fast` admits it only within its own `error_bound` on the model's own activations (not
    # `FAST_BOUND`), and the guard holds it to twice that. Like a quantised kernel, never chosen by `auto_exact`.
    approximate: bool = False
    extra_reasons: Callable[[AttentionInputs], list[str]] | None = field(default=None, compare=False, repr=False)
    # What the fields above do not say about a call: the attention_kwargs keys `fn` passes on to its kernel (None:
    # any key, a **kwargs function; every other key would be dropped or make the kernel raise), and whether it
    # takes SDPA's broadcasting of a key/value batch of 1 over the query's batch. A custom backend's keys come from
    # its function's signature, read once at registration (`honoured_kwargs`).
    attention_kwargs: frozenset[str] | None = frozenset()
    broadcast_kv: bool = False
    # Materialises the (B, H, Lq, Lk) score matrix (SDPA's math kernel): `auto` and the bench skip it where that
    # would not fit their memory cap.
    quadratic_memory: bool = False
    custom: bool = False
    # The backend's own options (backend_options.py: sol_attn's tau, dense blocks, minimum tokens), which a host
    # builds its inputs from and hands to the kernel around each call; None: it has none.
    options: BackendOptions | None = field(default=None, compare=False, repr=False)
    mask_format: str = "additive"  # what the kernel is handed: additive | bool | blockmask | key_padding
    auto_last_resort: LastResort | None = None  # where `auto` times it only when nothing else can run the call

    @property
    def exact(self) -> bool:
        """Its result is exact attention up to rounding: neither quantised nor approximate. Only exact kernels serve
        `auto_exact`, calls that ask for full precision, and recomputations after a failed guard check."""
        return not (self.quantised or self.approximate)

    @property
    def precision(self) -> str:
        """Its class, for listings: exact | quantised | approximate (an approximate kernel may also quantise)."""
        return "approximate" if self.approximate else "quantised" if self.quantised else "exact"

    @property
    def universal(self) -> bool:
        """Runs every floating dtype on every device kind, forward and backward, needs nothing of the machine but
        torch, judges the inputs by nothing else (SDPA and its math kernel): whether it can run a call depends on
        the call's shapes and flags only, and its kernel itself rejects query, key and value of mixed dtypes or
        devices (the eager path keys such decisions by shapes alone; see eager.py)."""
        return (self.devices >= ANY_DEVICE and self.dtypes >= FLOATS and self.backward and self.capability is None
                and self.rocm is None and self.hub is None and not self.custom and self.extra_reasons is None
                and all(isinstance(r, TorchVersion) for r in self.requires))

    @property
    def requirements(self) -> tuple:
        """What the machine must have: the declared requirements, then the GPU generations the spec names
        (stated once, as `capability` / `rocm`, and checked here as requirements too)."""
        return self.requires + tuple(r for r in (self.capability, self.rocm) if r is not None and r not in self.requires)

    def not_supported_reasons(self, inputs: AttentionInputs) -> list[str]:
        reasons: list[str] = []
        kind = inputs.device_kind
        if kind not in self.devices:
            reasons.append(f"device {inputs.device.type} is not supported (supported: {', '.join(sorted(self.devices))})")
        elif kind == "cuda" and self.capability is not None:
            problem = self.capability.check(capability_of(inputs.device))
            if problem:
                reasons.append(problem)
        if inputs.dtype not in self.dtypes:
            supported = ", ".join(sorted(_dtype_name(d) for d in self.dtypes))
            reasons.append(f"dtype {_dtype_name(inputs.dtype)} is not supported (supported: {supported})")
        for label, dim in (("head dim", inputs.head_dim),) + ((("value head dim", inputs.head_dim_v),)
                                                               if inputs.head_dim_v != inputs.head_dim else ()):
            problem = self.head_dims.reason(label, dim)
            if problem:
                reasons.append(problem)
        if inputs.head_dim_v != inputs.head_dim and not self.different_value_dim:
            reasons.append(f"value head dim {inputs.head_dim_v} differs from query head dim {inputs.head_dim}")
        # A key-padding mask is a bool mask: a backend that takes bool masks takes it too.
        mask_refused = inputs.mask_kind != "none" and inputs.mask_kind not in self.masks and not (
            inputs.mask_kind == "key_padding" and "bool" in self.masks)
        if mask_refused:
            accepted = [MASK_NAMES[m] for m in MASK_KINDS if m in self.masks and m != "none"]
            hint = f" (it accepts {' or '.join(accepted)})" if accepted else " (it takes no mask and would drop it)"
            reasons.append(f"attn_mask is {MASK_NAMES.get(inputs.mask_kind, inputs.mask_kind)}{hint}")
        if inputs.is_causal:
            if inputs.mask_kind != "none" and not mask_refused and not self.mask_with_causal:
                reasons.append("attn_mask with is_causal=True is not supported (the pair means both, the mask and "
                               "SDPA's top-left causal diagonal, as 'native' applies them)")
            if not self.causal:
                reasons.append("is_causal=True is not supported")
            elif inputs.len_q != inputs.len_kv and self.causal_alignment != "top_left":
                reasons.append(f"causal with Lq={inputs.len_q} != Lk={inputs.len_kv} would align the diagonal "
                               f"{self.causal_alignment.replace('_', '-')} instead of SDPA's top-left")
        if inputs.is_gqa and not self.gqa:
            reasons.append(f"grouped-query attention ({inputs.heads_q} query heads, {inputs.heads_kv} key/value heads) "
                           "is not supported")
        if inputs.dropout and not self.dropout:
            reasons.append("dropout_p > 0 is not supported")
        if inputs.custom_scale and not self.scale:
            reasons.append("a custom scale is not supported")
        if inputs.return_lse and not self.lse:
            reasons.append("return_lse=True is not supported")
        if inputs.requires_grad and not self.backward:
            reasons.append("has no backward pass (inputs require grad)")
        if self.extra_reasons is not None:
            reasons.extend(self.extra_reasons(inputs))
        return reasons

    @property
    def context_parallel_modes(self) -> tuple[str, ...]:
        """Context-parallel modes this backend can be the local kernel of (dispatcher.parallel): Ulysses
        runs any backend; ring and Ulysses+ring merge partial outputs by their LSE, so need lse=True."""
        return ("ulysses", "ring", "ulysses_ring") if self.lse else ("ulysses",)

    def constraints(self) -> dict[str, Any]:
        """The spec as plain data, for listings, the doctor, JSON and the web extension."""
        return {
            "family": self.family,
            "description": self.description,
            "layout": self.layout,
            "devices": sorted(self.devices),
            "dtypes": sorted(_dtype_name(d) for d in self.dtypes),
            "head_dims": self.head_dims.describe(),
            "requires": [r.describe() for r in self.requirements],
            "capability": self.capability.describe() if self.capability else None,
            "rocm_archs": list(self.rocm.archs) if self.rocm else None,
            "supports": {"mask": sorted(m for m in self.masks if m != "none"), "causal": self.causal,
                         "mask_with_causal": self.mask_with_causal,
                         "scale": self.scale, "gqa": self.gqa, "dropout": self.dropout, "lse": self.lse,
                         "backward": self.backward, "broadcast_kv": self.broadcast_kv,
                         "attention_kwargs": None if self.attention_kwargs is None else sorted(self.attention_kwargs)},
            "hub": None if self.hub is None else {"repo_id": self.hub.repo_id, "version": self.hub.version,
                                                  "revision": self.hub.revision, "function": self.hub.function},
            "fallback": list(self.fallback),
            "context_parallel": list(self.context_parallel_modes),
            "error_bound": self.error_bound,
            "quantised": self.quantised,
            "approximate": self.approximate,
            "precision": self.precision,
            "custom": self.custom,
        }
