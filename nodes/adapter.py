"""The ComfyUI attention override: ComfyUI's call convention in, `dispatch_attention_fn` out.

ComfyUI calls `transformer_options["optimized_attention_override"](func, q, k, v, heads, ...)` with
`func` = its own (unwrapped) default backend. `make_override` returns a *closure* because
`ModelPatcher.clone()` deep-copies model_options: plain functions are copied by reference, callable
instances would be duplicated on every clone (and fail on locks). Nothing here imports ComfyUI.

Decisions, documented once:
- Calls this override does not handle (outside the step window, integer masks, unknown heads) go to
  `previous` (an override that was on the model before us) when there is one, else to `func`.
  "comfy default" always calls `func`. Each such call is recorded with the reason.
- `attn_precision=torch.float32` with fp16/bf16 inputs: ComfyUI's basic/sub-quad/split backends then
  compute softmax in fp32. We keep that promise by running the dispatcher on fp32 copies and casting
  the output back; a backend without fp32 support then falls back (policy "fallback") or fails ("strict").
- `low_precision_attention=False` (newer ComfyUI, e.g. WAN I2V image cross-attention) with a quantised
  backend (family "sage"): the first non-quantised backend in that backend's fallback chain runs instead.
- "auto": the available backend with the highest `preference` that supports the call; Hub kernels only
  when their publisher is in this node's trust list (auto never downloads code on its own).
"""

from __future__ import annotations

import contextlib

import torch

from ..dispatcher import (attention_checks, availability_reasons, backend_names, dispatch_attention_fn,
                          fallback_order, get_backend_spec, recording, trusted_publishers)
from ..dispatcher import checks as _checks
from ..dispatcher.inputs import describe_call
from .window import in_window

AUTO = "auto"
COMFY_DEFAULT = "comfy default"
PASS_THROUGH = "pass through"  # checks/compare only: every call goes to `previous` (or `func`)
QUANTISED_FAMILIES = frozenset({"sage"})
_HALF = (torch.float16, torch.bfloat16)


def call_site(transformer_options: dict | None, len_q: int, len_k: int) -> str:
    """'self'/'cross' from the lengths, prefixed by the block type when the model says it."""
    to = transformer_options or {}
    kind = "self" if len_q == len_k else "cross"
    block = to.get("block_type")
    if block is None and isinstance(to.get("block"), (tuple, list)) and to["block"]:
        block = to["block"][0]  # SD/SDXL UNet: ("input", 1)
    return f"{block}.{kind}" if block else kind


class _Relabel:
    """Duck-typed recorder: the dispatcher reports the name we passed; the report should show the
    name the user asked for ("auto", or sage before a low-precision swap) and why it changed."""

    def __init__(self, target, requested: str, notes: tuple[str, ...] = ()):
        self.target, self.requested, self.notes = target, requested, notes

    def record(self, site, requested, served, reasons=()):
        self.target.record(site, self.requested, served, self.notes + tuple(reasons))

    def record_error(self, site, backend, error):
        self.target.record_error(site, backend, error)


def _unwrap(t):
    # [2026] ComfyUI may hand AttentionTensorContainer objects (single owner, `.take()`).
    return t.take() if not isinstance(t, torch.Tensor) and hasattr(t, "take") else t


def _to_bhsd(out: torch.Tensor, skip_output_reshape: bool, heads: int) -> torch.Tensor:
    if skip_output_reshape:
        return out
    return out.unflatten(-1, (heads, -1)).transpose(1, 2)


def _auto_choice(inputs, trust: frozenset, low_precision_ok: bool) -> str:
    ranked = sorted(backend_names(), key=lambda n: -get_backend_spec(n).preference)
    for name in ranked:
        spec = get_backend_spec(name)
        if spec.hub is not None and spec.hub.publisher not in trust:
            continue
        if not low_precision_ok and spec.family in QUANTISED_FAMILIES:
            continue
        if availability_reasons(name) or spec.not_supported_reasons(inputs):
            continue
        return name
    return "native"


def _non_quantised(name: str) -> str:
    for candidate in fallback_order(name):
        if get_backend_spec(candidate).family not in QUANTISED_FAMILIES:
            return candidate
    return "native"


def make_override(backend: str, policy: str = "fallback", recorder=None, window=None, trust=(), checks=None,
                  compare=None, previous=None):
    """An `optimized_attention_override` closure for one Set Attention Backend node.

    backend: a dispatcher backend name, "auto" or "comfy default"; policy: "fallback" | "strict";
    recorder: a `Recorder` (shared across clones); window: (start_percent, end_percent) or None;
    trust: publishers allowed for Hub kernels; checks: None | "raise" | "warn";
    compare: a `Comparison` or None; previous: the override that was installed before this one.
    """
    trust = frozenset(trust or ())
    window = tuple(window) if window is not None else None
    auto_cache: dict = {}

    def record(site, requested, served, reasons):
        if recorder is not None:
            recorder.record(site, requested, served, tuple(reasons))

    def finish(out, site, q, k, v, mask, heads, skip_reshape, skip_output_reshape, scale, gqa, label):
        if checks:
            _checks.check_values({"output": out}, checks, label)
        comparable = mask is None or mask.dtype == torch.bool or mask.is_floating_point()
        if compare is not None and comparable and (skip_reshape or heads) and compare.wants():
            if skip_reshape:
                h, qb, kb, vb = q.shape[1], q, k, v
            else:
                h, dim = heads, q.shape[-1] // heads
                hk = k.shape[-1] // dim
                qb = q.unflatten(-1, (h, dim)).transpose(1, 2)
                kb, vb = k.unflatten(-1, (hk, dim)).transpose(1, 2), v.unflatten(-1, (hk, -1)).transpose(1, 2)
            compare.add(site, _to_bhsd(out, skip_output_reshape, h), qb, kb, vb, mask, scale, gqa)
        return out

    def override(func, q, k, v, heads=None, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        q, k, v = _unwrap(q), _unwrap(k), _unwrap(v)
        to = kwargs.get("transformer_options") or {}
        scale = kwargs.get("scale")
        gqa = bool(kwargs.get("enable_gqa", False))
        low_precision_ok = kwargs.get("low_precision_attention", True) is not False
        len_q, len_k = (q.shape[2], k.shape[2]) if skip_reshape else (q.shape[1], k.shape[1])
        site = call_site(to, len_q, len_k)

        def delegate(reason, to_func=False):
            target_is_previous = previous is not None and not to_func
            served = "previous override" if target_is_previous else f"comfy:{getattr(func, '__name__', 'func')}"
            # "comfy default" asked for ComfyUI's attention: that is what served it, not a fallback.
            record(site, served if backend == COMFY_DEFAULT else backend, served, (reason,) if reason else ())
            if checks:
                _checks.check_values({"query": q, "key": k, "value": v, "attn_mask": mask}, checks, served)
            call = (lambda *a, **kw: previous(func, *a, **kw)) if target_is_previous else func
            out = call(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                       skip_output_reshape=skip_output_reshape, **kwargs)
            return finish(out, site, q, k, v, mask, heads, skip_reshape, skip_output_reshape, scale, gqa, served)

        if backend == COMFY_DEFAULT:
            return delegate("", to_func=True)
        if backend == PASS_THROUGH:
            return delegate("")
        if not in_window(to, window):
            return delegate(f"outside the step window {window[0]:.2f}..{window[1]:.2f}")
        if mask is not None and not (mask.dtype == torch.bool or mask.is_floating_point()):
            return delegate(f"attn_mask has dtype {str(mask.dtype).replace('torch.', '')}, which ComfyUI's own "
                            "backend interprets; passed through unchanged")
        if not skip_reshape and not heads:
            return delegate("heads was not given for (B, L, H*D) inputs")

        if skip_reshape:  # (B, H, L, D), possibly non-contiguous: strides are kept, the dispatcher copes
            layout, qs, ks, vs = "BHSD", q, k, v
        else:  # (B, L, H*D) -> free views (B, L, H, D)
            dim = q.shape[-1] // heads
            kv_heads = k.shape[-1] // dim
            layout = "BSHD"
            qs, ks, vs = q.unflatten(-1, (heads, dim)), k.unflatten(-1, (kv_heads, dim)), v.unflatten(-1, (kv_heads, -1))
        out_dtype = q.dtype
        if attn_precision == torch.float32 and q.dtype in _HALF:
            qs, ks, vs = qs.float(), ks.float(), vs.float()

        name, notes = backend, ()
        if backend == AUTO:
            inputs = describe_call(qs, ks, vs, mask, 0.0, False, scale, gqa, False, layout)
            key = (inputs, low_precision_ok)
            name = auto_cache.get(key)
            if name is None:
                with trusted_publishers(trust):
                    name = auto_cache.setdefault(key, _auto_choice(inputs, trust, low_precision_ok))
        if not low_precision_ok and get_backend_spec(name).family in QUANTISED_FAMILIES:
            replacement = _non_quantised(name)
            notes = (f"low_precision_attention=False: quantised '{name}' replaced by '{replacement}'",)
            name = replacement
        with contextlib.ExitStack() as stack:
            if recorder is not None:
                stack.enter_context(recording(_Relabel(recorder, backend, notes)))
            if trust:
                stack.enter_context(trusted_publishers(trust))
            if checks:
                stack.enter_context(attention_checks(checks))
            out = dispatch_attention_fn(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa, backend=name,
                                        layout=layout, policy=policy, call_site=site)
        out = out.to(out_dtype)
        if layout == "BSHD":
            out = out.transpose(1, 2) if skip_output_reshape else out.flatten(2)
        elif not skip_output_reshape:
            out = out.transpose(1, 2).flatten(2)
        return finish(out, site, q, k, v, mask, heads, skip_reshape, skip_output_reshape, scale, gqa, name)

    # Read by the Attention Checks node to rebuild this override with checks on (functions keep attributes
    # through deepcopy, since deepcopy returns the same function object).
    override.attention_dispatch = {"backend": backend, "policy": policy, "recorder": recorder, "window": window,
                                   "trust": tuple(sorted(trust)), "checks": checks, "compare": compare,
                                   "previous": previous}
    return override

