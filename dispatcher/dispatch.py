"""`dispatch_attention_fn`: the entry point. It describes the call once (`AttentionCall`: the tensors and a
`CallSite`) and routes it: context parallelism when a block is open, the traced routes inside torch.compile, else
the eager path. The sites it makes are kept per arguments (`_sites`), so a repeat call checks and keys none of them.
`PreparedAttention` is the same entry with its site made once, for callers that make many calls of one kind."""

from __future__ import annotations

import contextlib

import torch

from .call import AttentionCall, CallSite, new_call
from .checks import plain_scale as _plain_scale
from .compiled import dispatch_traced
from .decisions import BackendNotSupportedError, fallback_order  # noqa: F401  (public names)
from .decisions import UnderRules, under_rules
from .eager import LEFT, dispatch_eager, lane_for, run_lane
from .guard import settings as _guard_settings
from .inputs import describe_call
from .masks import sdpa_view as _sdpa_view
from .report import recording

# The context-parallel router (dispatcher.parallel's, installed through `install_router`: it answers NotImplemented
# outside its context) and a flag it turns on (`route_calls`) while any context_parallel() block is open, so a plain
# call pays one global check (a bool: torch.compile guards it). Written only here.
_context_parallel = None
_context_parallel_on = False
_dynamo_compiling = torch.compiler.is_dynamo_compiling  # bound once (dynamo knows the function, not the name)
_Tensor = torch.Tensor
# The sites dispatch_attention_fn made: its arguments but the tensors and attention_kwargs -> the CallSite (checked
# and keyed once). Only arguments whose equal values are equally valid come here (flags that are bools, a float
# dropout and scale: True == 1 == 1.0 would otherwise let an invalid flag find a valid site). Cleared when full.
_sites: dict[tuple, CallSite] = {}
_MAX_SITES = 1024


def dispatch_attention_fn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None,
                          dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                          enable_gqa: bool = False, attention_kwargs: dict | None = None, *, backend: str | None = None,
                          layout: str = "BSHD", policy: str | None = None, return_lse: bool = False,
                          call_site: str = "attention", recorder=None, model: str | None = None,
                          guard: str | tuple | None = None, guard_every: int | None = None, rules=None):
    """Scaled dot-product attention through the selected backend.

    query (B, Sq, H, D), key/value (B, Sk, Hk, D) in the default layout 'BSHD' (diffusers'), or
    (B, H, S, D) with layout='BHSD'. attn_mask: bool (True = attend) or additive float, broadcastable
    to (B, H, Sq, Sk) as SDPA broadcasts it (2-D = (Sq, Sk), 3-D = (H, Sq, Sk)), or a BlockMask; a 2-D (B, Sk)
    mask is key padding, as diffusers' native backend reads it (refused when B == Sq, where the readings differ).
    attn_mask with is_causal=True applies both (SDPA's top-left diagonal), on the backends that declare it.
    scale: a float, or a 0-d tensor (read as its value, as SDPA reads it). Empty inputs (a batch, head count or
    length of 0) return SDPA's result (empty, or zeros for Sk = 0) without running a kernel.
    Returns the output in the input layout, and with return_lse=True also the log-sum-exp,
    (B, Sq, H) for BSHD or (B, H, Sq) for BHSD, float32.
    recorder: count this call in it (a Recorder, or any other `events.RecorderProtocol`) instead of in the
    active `recording()` block's, without a context manager per call.
    call_site: where in the model the call comes from, its block included ("self #5"): `auto_fast` judges quantised
    kernels and the quality guard checks and demotes per call site.
    model: whose activations these are (default: the active `model_scope`); `auto`'s accuracy verdicts and the
    quality guard's demotions are kept per model.
    guard / guard_every: the quality guard for this call ('quantised' | 'all' | 'off'; each call site's first call
    checked, then one in guard_every of its calls, 0 = sized on this machine by the calls' and checks' times;
    default: the active `quality_guard` setting); a (mode, every) tuple from `guard.settings` is taken as is.
    rules: `Rules` that keep this call exact (`exact_only`, or `low_precision=False`: the model asks for full
    precision): a quantised or approximate backend is replaced by its exact stand-in and an auto by its exact twin
    (`kept_exact` says which, in the report's words); the recorder counts the call under the backend asked for,
    with why another served it. Checked when the call's site is made (a clear error for any other rule).
    """
    if guard is not None or guard_every is not None:
        if type(guard) is not tuple:
            guard = _guard_settings(guard, guard_every)
    if attn_mask is not None and type(attn_mask) is _Tensor and attn_mask.ndim == 2:
        attn_mask = _sdpa_view(attn_mask, query, key, layout)  # (B, Sk) key padding: (B, 1, 1, Sk)
    if scale is not None and type(scale) is not float:
        scale = _plain_scale(scale)
    if _dynamo_compiling():  # dynamo traces the class call, not tuple.__new__, and keeps no site
        return dispatch_call(AttentionCall(query, key, value, attn_mask, CallSite(
            dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
            attention_kwargs=attention_kwargs, backend=backend, layout=layout, policy=policy, return_lse=return_lse,
            call_site=call_site, recorder=recorder, model=model, guard=guard, rules=rules)))
    site = arguments = None
    if attention_kwargs is None and type(dropout_p) is float and (scale is None or type(scale) is float) \
            and (is_causal is True or is_causal is False) and (enable_gqa is True or enable_gqa is False) \
            and (return_lse is True or return_lse is False):
        arguments = (dropout_p, is_causal, scale, enable_gqa, backend, layout, policy, return_lse, call_site,
                     id(recorder), model, guard, rules)  # the recorder itself, not one equal to it (its site holds it)
        try:
            site = _sites.get(arguments)
        except TypeError:  # an unhashable argument: CallSite names it
            arguments = None
    if site is None:
        site = CallSite(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                        attention_kwargs=attention_kwargs, backend=backend, layout=layout, policy=policy,
                        return_lse=return_lse, call_site=call_site, recorder=recorder, model=model, guard=guard,
                        rules=rules)
        if arguments is not None:
            if len(_sites) >= _MAX_SITES:
                _sites.clear()
            _sites[arguments] = site
    call = new_call(AttentionCall, (query, key, value, attn_mask, site))
    if _context_parallel_on:
        return dispatch_call(call)
    return dispatch_eager(call)


class PreparedAttention:
    """`dispatch_attention_fn` with every argument but the tensors fixed once: `prepared(query, key, value,
    attn_mask=None)` dispatches and records each call exactly as `dispatch_attention_fn(query, key, value,
    attn_mask, **fixed)` would, its site (`site`: a `CallSite`) made, checked and keyed once, here (the ComfyUI
    override keeps one per call signature, and calls `keyed`). The arguments are those of `dispatch_attention_fn`;
    a bad one raises here."""

    __slots__ = ("_site", "_layout", "_lane")

    def __init__(self, *, dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                 enable_gqa: bool = False, attention_kwargs: dict | None = None, backend: str | None = None,
                 layout: str = "BSHD", policy: str | None = None, return_lse: bool = False,
                 call_site: str = "attention", recorder=None, model: str | None = None,
                 guard: str | tuple | None = None, guard_every: int | None = None, rules=None):
        if (guard is not None or guard_every is not None) and type(guard) is not tuple:
            guard = _guard_settings(guard, guard_every)
        if scale is not None and type(scale) is not float:
            scale = _plain_scale(scale)
        self._layout, self._lane = layout, None
        self._site = CallSite(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
                              attention_kwargs=attention_kwargs, backend=backend, layout=layout, policy=policy,
                              return_lse=return_lse, call_site=call_site, recorder=recorder, model=model, guard=guard,
                              rules=rules)

    @property
    def site(self) -> CallSite:
        return self._site

    def __call__(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None):
        if attn_mask is not None and type(attn_mask) is _Tensor and attn_mask.ndim == 2:
            attn_mask = _sdpa_view(attn_mask, query, key, self._layout)
        if _dynamo_compiling():
            return dispatch_call(AttentionCall(query, key, value, attn_mask, self._site))
        call = new_call(AttentionCall, (query, key, value, attn_mask, self._site))
        if _context_parallel_on:
            return dispatch_call(call)
        return dispatch_eager(call)

    def keyed(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None):
        """The same call, for a caller that keeps one PreparedAttention per call signature at least as fine as the
        eager path's key (a key built by `call.tensors_key` on the tensors the views are made from): the ComfyUI
        override's plans. Once a call was served, the next ones run its lane (`eager.Lane`: the decided kernel, with
        what the lane re-checks itself) without the entry, the key or the lookup; a call the lane cannot take goes
        the full way, which leaves the lane for what is in force then. Never a lane inside torch.compile or while a
        context_parallel() block is open (its calls are routed)."""
        if attn_mask is not None and type(attn_mask) is _Tensor and attn_mask.ndim == 2:
            attn_mask = _sdpa_view(attn_mask, query, key, self._layout)
        lane = self._lane
        if lane is not None and not _context_parallel_on and not _dynamo_compiling():
            out = run_lane(lane, query, key, value, attn_mask)
            if out is not LEFT:
                return out
        out = self(query, key, value, attn_mask)  # the mask is a (B, 1, 1, Sk) view by now: taken as it is
        self._lane = None if _dynamo_compiling() or _context_parallel_on else \
            lane_for(query, key, value, attn_mask, self._site)
        return out


def kept_exact(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask=None, *, backend: str,
               rules, scale: float | None = None, enable_gqa: bool = False, layout: str = "BSHD") -> UnderRules:
    """What `dispatch_attention_fn(query, key, value, attn_mask, backend=backend, rules=rules, ...)` decides for this
    call under its rules (`under_rules`): the backend asked for, an auto's exact twin or a refused kernel's exact
    stand-in, with the note a host's report shows (the ComfyUI override counts its full-precision calls by it)."""
    if attn_mask is not None and type(attn_mask) is _Tensor and attn_mask.ndim == 2:
        attn_mask = _sdpa_view(attn_mask, query, key, layout)
    if scale is not None and type(scale) is not float:
        scale = _plain_scale(scale)
    inputs = describe_call(query, key, value, attn_mask, 0.0, False, scale, enable_gqa, False, layout)
    return under_rules(backend, rules, inputs)


def install_router(route) -> None:
    """The hook a wing above the dispatcher registers to take calls first (dispatcher.parallel's router): installed
    once, never swapped (a second, different router is an error: two wings cannot both own the calls)."""
    global _context_parallel
    if _context_parallel is not None and _context_parallel is not route:
        raise RuntimeError("dispatch: a different context-parallel router is already installed")
    _context_parallel = route


def route_calls(on: bool) -> None:
    """Whether calls go to the installed router first (on while some context_parallel() block is open)."""
    global _context_parallel_on
    if on and _context_parallel is None:
        raise RuntimeError("dispatch: route_calls(True) before install_router()")
    _context_parallel_on = bool(on)


def dispatch_call(call: AttentionCall):
    """Route one described call (context parallelism, traced, eager)."""
    if _context_parallel_on:  # a dispatcher.parallel.context_parallel() block is open somewhere
        # The routed call's local calls count in the active recorder: make it the one given by argument.
        recorder = call.site.recorder
        with recording(recorder) if recorder is not None else contextlib.nullcontext():
            routed = _context_parallel(call)
        if routed is not NotImplemented:
            return routed
    # Not is_compiling(): that flag is process-wide, so it is also true in threads that merely run while another
    # thread traces (eager flex_attention traces itself); this one is true only in the frame dynamo traces.
    if torch.compiler.is_dynamo_compiling():
        return dispatch_traced(call)
    return dispatch_eager(call)
