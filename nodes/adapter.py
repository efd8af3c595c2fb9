"""The ComfyUI attention override: ComfyUI's call convention in, `dispatch_attention_fn` out.

ComfyUI calls `transformer_options["optimized_attention_override"](func, q, k, v, heads, ...)` with
`func` = its own (unwrapped) default backend. `AttentionOverride` is that callable: `ModelPatcher.clone()`
deep-copies model_options, and the override's `__deepcopy__` returns itself, so every clone shares one
override (its plans and its recorder). Nothing here imports ComfyUI.

Decisions, documented once:
- Calls this override does not handle (outside the step window, integer masks, unknown heads) go to
  `previous` (an override that was on the model before us) when there is one, else to `func`.
  "comfy default" always calls `func`. Each such call is recorded with the reason.
- `attn_precision=torch.float32` with fp16/bf16 inputs: ComfyUI's basic/sub-quad/split backends then
  compute softmax in fp32. We keep that promise by running the dispatcher on fp32 copies and casting
  the output back; a backend without fp32 support then falls back (policy "fallback") or fails ("strict").
- `low_precision_attention=False` (newer ComfyUI, e.g. WAN I2V image cross-attention): the call reaches the
  dispatcher with `Rules(low_precision=False)`, which keeps it exact (a quantised or approximate backend's exact
  stand-in, the one the quality guard would recompute with; `auto_exact` for `auto_fast`) and records it under the
  backend asked for, saying why another served it. `kept_exact` gives the override the same decision: each such
  call is counted in `precision_notes` (site, what kept it exact) for the node's report; a call passed on keeps
  the flag, and the count says where it went.
- Two call forms (docs/comfyui-versions.md): `__call__(func, q, k, v, ...)` with tensors (ComfyUI 0.3.64, and
  0.38 for overrides without `container_function`), and `container_function(q, k, v, ...)` with 0.38's
  single-owner AttentionTensorContainers and no `func`. A container call is planned on `peek()`ed tensors; the
  containers are taken once, only by whoever serves the call: this override when it runs it, else passed on
  untouched to a `container_function` down the chain. With no `func`, a container call passed on to a plain
  override or to ComfyUI's attention gets `default_attention()` (ComfyUI's default attention function).
  `preferred_attention` (a checkpoint's embedded method) is popped by ComfyUI before any override sees it and
  used only when no override is installed: the pack cannot honour it (the node's report says when a model has one).
- Chaining: `previous` is whatever override was on the key before this one (ours, the core Model Attention
  Backend or Model Sparse Attention, another pack's); calls passed on go to it and are recorded as served by
  "previous override: <its name>" (nodes/overrides.py). A chain that loops (a call comes back to an override that
  passed it on, e.g. an override that drops `_inside_attn_wrapper`) raises OverrideChainError, never recurses.
- "auto_exact" / "auto_fast" ("auto" = auto_exact, for older workflows): the dispatcher's autos (time and validate
  every backend that supports the call on its live values, cache the winner per signature). They never download
  code: Hub kernels count once fetched and trusted.
- model: the model's identity (nodes/model_identity.py), passed with every call: `auto_fast`'s verdicts and the
  quality guard's demotions are kept per model. guard_setting: (mode, every) for the quality guard, worked out
  once here.
- block identity: each call's call site names its block ("self #5": the text of nodes/blocks.py's `BlockId`, made
  once per call by `block_id`), so `auto_fast` judges and the quality guard checks and demotes per block.
- blocks: (start, end) of the block range (nodes/blocks.py); calls from other blocks are delegated like calls
  outside the step window. When a call says no usable block position, the backend serves it and the site is
  noted once (in `block_notes`, which the node's report reads).
- sparse: the backend's own options, as its spec declares them (`BackendSpec.options`, dispatcher/backend_options.py;
  sol_attn's tau, dense blocks, minimum tokens), only with a backend that declares options: calls the options keep
  dense (sol_attn: fewer than `min_tokens` tokens, or from `dense_blocks`) are delegated, as ComfyUI's Model Sparse
  Attention node does, and the value reaches the kernel through its `applied()` scope around each call.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from ..dispatcher import (AttentionInputError, PreparedAttention, Rules, attention_checks, auto,
                          availability_reasons, backend_names, checks, dispatch_attention_fn, get_backend_spec, guard,
                          kept_exact, tensors_key, trusted_publishers)
from . import comfy_versions
from .blocks import block_id, blocks_text, in_blocks
from .comfy_versions import Ordinals, block_position
from .comfy_versions import peek_containers as _peek_containers
from .comfy_versions import unwrap as _unwrap
from .override_config import OverrideConfig
from .overrides import OverrideChainError, chain, describe
from .window import in_window, window_text

AUTO, AUTO_EXACT, AUTO_FAST = auto.AUTO, auto.AUTO_EXACT, auto.AUTO_FAST
AUTOS = auto.PSEUDO_BACKENDS  # "auto" is auto_exact (older workflows)

COMFY_DEFAULT = "comfy default"
PASS_THROUGH = "pass through"  # checks/compare only: every call goes to `previous` (or `func`)
_HALF = (torch.float16, torch.bfloat16)
FULL_PRECISION = Rules(low_precision=False)  # a call with low_precision_attention=False: kept exact
_Tensor = torch.Tensor  # bound once, as is the next: read on every call
_dynamo_compiling = torch.compiler.is_dynamo_compiling


def _unnumbered(transformer_options, q, k, skip_reshape: bool):
    """The `BlockId` of a call without its block number, in either of ComfyUI's layouts ((B, H, L, D) with
    skip_reshape, else (B, L, H*D)): 'self'/'cross' from the lengths, with the model's block type."""
    axis = 2 if skip_reshape else 1
    return block_id(transformer_options, None, None, q.shape[axis] == k.shape[axis], compiling=_dynamo_compiling())


_passing_on = threading.local()  # ids of the overrides passing a call on in this thread (a loop comes back to one)


def _heads_first(t: torch.Tensor, size: tuple) -> torch.Tensor:
    """(B, L, H*D) as a (B, H, L, D) = `size` view: one as_strided where view + transpose take two (~1 us of host
    time less per tensor, which SDXL's small calls on a fast GPU wait for)."""
    s0, s1, s2 = t.stride()
    if s2 != 1:
        return t.view(size[0], size[2], size[1], size[3]).transpose(1, 2)
    return t.as_strided(size, (s0, size[3], s1, 1))


def _flat_output(out: torch.Tensor) -> torch.Tensor:
    """(B, H, L, D) -> ComfyUI's (B, L, H*D): one as_strided where the heads lie side by side in memory (the
    fused GPU kernels write them so), else transpose + flatten (which copies when they do not)."""
    b, h, length, d = out.shape
    s0, s1, s2, s3 = out.stride()
    if s1 == d and s3 == 1:
        return out.as_strided((b, length, h * d), (s0, s2, 1))
    return out.transpose(1, 2).flatten(2)


def _to_bhsd(out: torch.Tensor, skip_output_reshape: bool, heads: int) -> torch.Tensor:
    if skip_output_reshape:
        return out
    return out.unflatten(-1, (heads, -1)).transpose(1, 2)


def comfy_mask(mask):
    """ComfyUI's mask as the library reads masks (SDPA's rule), a view: ComfyUI's 2-D mask is (Lq, Lk), as in SDPA,
    but the library refuses a bare 2-D one with B == Lq as ambiguous (diffusers reads it as (B, Lk)), and its 3-D
    mask is (B, Lq, Lk) where SDPA and the library read (H, Lq, Lk). Other ranks as given."""
    if mask is None or not isinstance(mask, torch.Tensor):
        return mask
    if mask.ndim == 2:
        return mask[None, None]
    if mask.ndim == 3:
        return mask[:, None]
    return mask


def _check_call(q, k, v, mask, skip_reshape) -> None:
    """What any ComfyUI attention function needs: tensors of the right rank (a clear error, not an AttributeError)."""
    rank = 4 if skip_reshape else 3
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attention {name} must be a torch.Tensor; got {type(t).__name__}")
        if t.dim() != rank:
            layout = "(B, H, L, D) with skip_reshape=True" if skip_reshape else "(B, L, H*D)"
            raise AttentionInputError(f"attention {name} must be {rank}-D {layout}; got shape {tuple(t.shape)}")
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(f"attention mask must be a torch.Tensor or None; got {type(mask).__name__}")


def _head_dims(q, k, v, heads) -> tuple[int, int, int]:
    """(head dim, key/value heads, value head dim) of ComfyUI's (B, L, H*D) q, k, v with `heads` query heads; a clear
    error where they do not split."""
    if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0 or q.shape[-1] % heads:
        raise AttentionInputError(
            f"heads={heads!r} must be a positive int dividing the query's last dim {q.shape[-1]} (H*D)")
    dim = q.shape[-1] // heads
    if k.shape[-1] % dim:
        raise AttentionInputError(f"the key's last dim {k.shape[-1]} is not a multiple of the head dim {dim} "
                                  f"(query {q.shape[-1]} / heads={heads})")
    if v.shape[-1] % (k.shape[-1] // dim):
        raise AttentionInputError(f"the value's last dim {v.shape[-1]} does not split into the "
                                  f"{k.shape[-1] // dim} key/value heads")
    kv_heads = k.shape[-1] // dim
    return dim, kv_heads, v.shape[-1] // kv_heads


class _Plan:
    """What a repeat call of one signature does, worked out on its first call: a delegation (its reason), or
    the views to take, the rules to pass and how to shape the output, and the dispatcher's entry with the
    plan's arguments fixed (`attend`, called `keyed`: repeat calls run the decided kernel's lane, without the
    dispatcher's entry and lookup). name: the backend the checks name (what the rules keep the call to, once the
    first call asked: `exact`, the note counted per call). Plain attributes, read per call."""

    __slots__ = ("reason", "views", "layout", "upcast", "name", "site", "scale", "gqa", "output", "attend", "rules",
                 "exact", "kind")  # site: with the block ("self #5"); kind: without ("self")

    def __init__(self, reason=None, **fields):
        self.reason = reason
        for name in self.__slots__[1:]:
            setattr(self, name, fields.get(name))


class AttentionOverride:
    """The `optimized_attention_override` of one Set Attention Backend node (or Attention Checks node), made from
    one `OverrideConfig` (nodes/override_config.py: its fields), read as `self.config`; what is worked out from it
    once has names of its own (`sparse_options`, `guard_setting`, `previous_label`).

    Per call signature (shapes, dtype, mask kind, flags, block) the first call validates and plans; repeat
    calls cost a dict lookup, the views and the dispatcher's own lookup (see `_Plan`). The block (nodes/blocks.py
    `block_id`: the position ComfyUI passes, else the call's ordinal in the forward) names the call site the
    dispatcher gets ("self #5"): `auto_fast` judges and the quality guard checks and demotes per block.
    """

    def __init__(self, config: OverrideConfig):
        self.config = config
        declared = declared_options(config.backend)
        # the backend's own options in force: those given when they are its own, else its declared default
        self.sparse_options = None if declared is None else \
            config.sparse if declared.owns(config.sparse) else declared.default
        # A dense call's reason says first that the backend cannot run here at all, where so: "32 tokens <
        # min_tokens" alone read as if it would serve the longer calls.
        self._sparse_here = _cannot_run_here(config.backend) if self.sparse_options is not None else ""
        chain(config.previous)  # a chain that already loops fails here, when the node runs, not on the first call
        # what the report says served the calls passed on (fixed now: the previous override does not change)
        self.previous_label = None if config.previous is None else f"previous override: {describe(config.previous)}"
        # (mode, every), checked once here: the dispatcher takes a tuple as is (no per-call parsing)
        self.guard_setting = None if config.guard is None and config.guard_every is None else \
            guard.settings(config.guard, config.guard_every)
        self._outside_blocks = None if config.blocks is None else \
            f"outside the block range {blocks_text(config.blocks)}"
        # What a call needs besides the dispatch, each one test per call where the node asked for none of it:
        # passing every call on; passing some on (a step window, a block range, a sparse kernel's dense calls);
        # scopes around the call (trusted publishers, checks, the sparse options); checks or a comparison after it.
        self._passes_every_call = config.backend in (COMFY_DEFAULT, PASS_THROUGH)
        self._limited = config.window is not None or config.blocks is not None or self.sparse_options is not None
        self._scoped = bool(config.trust or config.checks or self.sparse_options is not None)
        self._finishing = bool(config.checks or config.compare is not None)
        self._plans: dict[tuple, _Plan] = {}
        self._ordinals = Ordinals()

    def __deepcopy__(self, memo):  # ModelPatcher.clone() deep-copies model_options: every clone shares this one
        return self

    def __call__(self, func, q, k, v, heads=None, mask=None, attn_precision=None, skip_reshape=False,
                 skip_output_reshape=False, **kwargs):
        """The plain form: ComfyUI's default backend `func` and tensors."""
        if not (isinstance(q, _Tensor) and isinstance(k, _Tensor) and isinstance(v, _Tensor)):
            q, k, v = _unwrap("q", q), _unwrap("k", k), _unwrap("v", v)
        plan, reason = self._route(q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape, kwargs)
        if reason is not None:
            return self._delegate(reason, func, q, k, v, heads, mask, attn_precision, skip_reshape,
                                  skip_output_reshape, kwargs, plan.site)
        return self._serve(plan, q, k, v, heads, mask, skip_reshape, skip_output_reshape)

    def container_function(self, q, k=None, v=None, heads=None, mask=None, attn_precision=None, skip_reshape=False,
                           skip_output_reshape=False, **kwargs):
        """ComfyUI 0.38's container form (wrap_attn calls it instead of the override, without `func`, when q/k/v
        come as AttentionTensorContainers): planned on the peeked tensors; each container is taken once, by
        whoever serves the call."""
        qt, kt, vt = _peek_containers(q, k, v)
        plan, reason = self._route(qt, kt, vt, heads, mask, attn_precision, skip_reshape, skip_output_reshape, kwargs)
        del qt, kt, vt  # the containers stay the only owners until the call is served
        if reason is not None:
            return self._delegate(reason, None, q, k, v, heads, mask, attn_precision, skip_reshape,
                                  skip_output_reshape, kwargs, plan.site, containers=True)
        return self._serve(plan, *comfy_versions.take(q, k, v), heads, mask, skip_reshape, skip_output_reshape)

    def _route(self, q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape, kwargs):
        """(plan, None) for a call this override serves, or (plan, why it is passed on): "" for a node that passes
        every call on ("comfy default", Attention Checks around another pack's override)."""
        to = kwargs.get("transformer_options") or {}
        if self._passes_every_call:
            _check_call(q, k, v, mask, skip_reshape)
            return _Plan("", site=_unnumbered(to, q, k, skip_reshape).text), ""
        block = signature = plan = q_shape = k_shape = None
        position = block_position(to)  # read once: it names the block, places it in the range and sparse's dense ones
        compiling = _dynamo_compiling()
        try:  # the block first: every call is counted, passed on or not, so ordinals stay block numbers
            q_shape, k_shape = q.shape, k.shape
            axis = 2 if skip_reshape else 1
            block = block_id(to, position, None if compiling else self._ordinals, q_shape[axis] == k_shape[axis],
                             compiling=compiling)
        except (AttributeError, IndexError, TypeError):  # not tensors: _plan says why
            pass
        if not compiling and q_shape is not None:  # traced once per graph: hashing symbolic sizes would specialise them
            try:  # everything a plan depends on; not tensors or unhashable options: no plan (_plan says why)
                # at least as fine as the eager path's key of the call it makes (PreparedAttention.keyed's lane
                # skips that key): the dispatcher's own key of the tensors the views are made of (tensors_key)
                signature = tensors_key((heads, attn_precision, skip_reshape, skip_output_reshape, kwargs.get("scale"),
                                         kwargs.get("enable_gqa", False), kwargs.get("low_precision_attention", True),
                                         block), q, k, v, mask)
                plan = self._plans.get(signature)
            except (AttributeError, TypeError):
                signature = plan = None
        if plan is None:
            plan = self._plan(q, k, v, heads, mask, skip_reshape, skip_output_reshape, attn_precision, kwargs, to,
                              block)
            if signature is not None:
                if plan.reason is None:
                    plan.attend = self._prepared(plan)
                self._plans[signature] = plan
        if self._limited:
            passed = self._passed_on_here(plan, to, position, q, skip_reshape)
            if passed is not None:
                return plan, passed
        return plan, plan.reason

    def _passed_on_here(self, plan, to, position, q, skip_reshape) -> str | None:
        """Why a call this override could serve is passed on all the same (its step window, its block range, the
        dense calls of a sparse backend's options), or None."""
        config = self.config
        window = config.window
        if window is not None and not in_window(to, window):
            return f"outside the step window {window_text(*window)}"
        if config.blocks is not None:
            inside = in_blocks(position, config.blocks)
            if inside is False:
                return self._outside_blocks
            if inside is not True and plan.kind not in config.block_notes:  # the range cannot apply: noted once
                config.block_notes[plan.kind] = inside
        sparse = self.sparse_options
        if plan.reason is None and sparse is not None:
            # ComfyUI's sparse node decides these before attention: dense means passed on
            dense = sparse.dense_reason(q.shape[2] if skip_reshape else q.shape[1],
                                        None if position is None else position[0])
            if dense is not None:
                return self._sparse_here + dense
        return None

    def _serve(self, plan, q, k, v, heads, mask, skip_reshape, skip_output_reshape):
        """Run a planned call through the dispatcher and shape its output the way ComfyUI expects."""
        views = plan.views
        if views is None:
            qs, ks, vs = q, k, v
        elif plan.layout == "BSHD":
            qs, ks, vs = q.view(*views[0]), k.view(*views[1]), v.view(*views[2])  # ints parse faster than a tuple
        else:
            qs, ks, vs = _heads_first(q, views[0]), _heads_first(k, views[1]), _heads_first(v, views[2])
        if plan.upcast:
            qs, ks, vs = qs.float(), ks.float(), vs.float()
        if mask is not None and mask.ndim != 4:
            mask = comfy_mask(mask)
        if plan.rules is not None:  # low_precision_attention=False: counted for the report, by what kept it exact
            self._count_kept_exact(plan, qs, ks, vs, mask)
        attend = plan.attend or self._unkept_attend(plan)
        found = None  # what the dispatcher's `warn` checks found in this call (the kernel's own output included)
        if self._scoped:  # scopes only when asked for: ~1 us each per call
            config, sparse = self.config, self.sparse_options
            with contextlib.ExitStack() as stack:
                if config.trust:
                    stack.enter_context(trusted_publishers(config.trust))
                if config.checks:
                    stack.enter_context(attention_checks(config.checks))
                    if config.tally is not None:
                        found = []
                        stack.enter_context(checks.reporting(found.append))
                if sparse is not None:
                    stack.enter_context(sparse.applied())
                out = attend(qs, ks, vs, mask)
        elif attend is plan.attend:  # a kept plan: keyed as finely as the dispatcher, so repeat calls take its lane
            out = attend.keyed(qs, ks, vs, mask)
        else:
            out = attend(qs, ks, vs, mask)
        if plan.upcast:
            out = out.to(q.dtype)
        output = plan.output
        if output == "transpose_flatten":
            out = _flat_output(out)
        elif output == "flatten":
            out = out.flatten(2)
        elif output == "transpose":
            out = out.transpose(1, 2)
        if self._finishing:
            return self._finish(out, plan.site, q, k, v, mask, heads, skip_reshape, skip_output_reshape, plan.scale,
                                plan.gqa, plan.name, found)
        return out

    def _count_kept_exact(self, plan, qs, ks, vs, mask) -> None:
        """Count a call with low_precision_attention=False by what kept it exact: the dispatcher's decision for the
        call under its rules (`kept_exact`), asked on the plan's first call, with the tensors as they are passed."""
        exact = plan.exact
        if exact is None:
            kept = kept_exact(qs, ks, vs, mask, backend=self.config.backend, rules=plan.rules, scale=plan.scale,
                              enable_gqa=plan.gqa, layout=plan.layout)
            plan.name, plan.exact = kept.backend, kept.note
            exact = plan.exact
        notes, key = self.config.precision_notes, (plan.site, exact)
        notes[key] = notes.get(key, 0) + 1

    def _prepared(self, plan) -> PreparedAttention:
        """The dispatcher's entry with this plan's arguments fixed, asked for once per plan: a repeat call passes
        only its tensors (a dozen keywords fewer to take apart)."""
        config = self.config
        return PreparedAttention(scale=plan.scale, enable_gqa=plan.gqa, backend=config.backend, layout=plan.layout,
                                 policy=config.policy, call_site=plan.site, recorder=config.recorder,
                                 model=config.model, guard=self.guard_setting, rules=plan.rules)

    def _unkept_attend(self, plan):
        """For a plan not kept (inside torch.compile, where dynamo traces the plain entry point, or with unhashable
        options): `dispatch_attention_fn` with the plan's arguments."""
        config = self.config

        def attend(q, k, v, mask):
            return dispatch_attention_fn(q, k, v, attn_mask=mask, scale=plan.scale, enable_gqa=plan.gqa,
                                         backend=config.backend, layout=plan.layout, policy=config.policy,
                                         call_site=plan.site, recorder=config.recorder, model=config.model,
                                         guard=self.guard_setting, rules=plan.rules)
        return attend

    def _record(self, site, requested, served, reasons):
        recorder = self.config.recorder
        if recorder is not None:
            recorder.record(site, requested, served, tuple(reasons))

    def _finish(self, out, site, q, k, v, mask, heads, skip_reshape, skip_output_reshape, scale, gqa, label,
                found=None):
        """found: what the dispatcher's `warn` checks found in this call (already logged): the kernel's own output
        too, which the quality guard may have replaced with a finite one since."""
        config = self.config
        mode = config.checks
        if mode:
            tally = config.tally
            if tally is None:
                checks.check_values({"output": out}, mode, label)
            elif found:
                tally.non_finite(found[0])
            else:  # judged as "raise" to see it; counted; a warn is then logged as the dispatcher would
                try:
                    checks.check_values({"output": out}, "raise", label)
                except AttentionInputError as exc:
                    if mode == "raise":
                        raise  # counted by CheckedOverride.__call__
                    tally.non_finite(str(exc))
                    checks.check_values({"output": out}, mode, label)
                else:
                    tally.checked()
        compare = config.compare
        comparable = mask is None or mask.dtype == torch.bool or mask.is_floating_point()
        if compare is not None and comparable and (skip_reshape or heads) and compare.wants():
            if skip_reshape:
                h, qb, kb, vb = q.shape[1], q, k, v
            else:
                h, dim = heads, q.shape[-1] // heads
                hk = k.shape[-1] // dim
                qb = q.unflatten(-1, (h, dim)).transpose(1, 2)
                kb, vb = k.unflatten(-1, (hk, dim)).transpose(1, 2), v.unflatten(-1, (hk, -1)).transpose(1, 2)
            compare.add(site, _to_bhsd(out, skip_output_reshape, h), qb, kb, vb, comfy_mask(mask), scale, gqa)
        return out

    def _delegate(self, reason, func, q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape, kwargs,
                  site, containers=False):
        """Pass a call on: to `previous` (unless this node asked for ComfyUI's own attention), else to ComfyUI's
        attention. A call that comes back here while it is being passed on is a loop: a clear error, not a
        RecursionError (or a hang, with a chain that never ends)."""
        if _dynamo_compiling():  # traced code: no thread-local bookkeeping; a loop would not trace either
            return self._pass_on(reason, func, q, k, v, heads, mask, attn_precision, skip_reshape,
                                 skip_output_reshape, kwargs, site, containers)
        active = getattr(_passing_on, "ids", None)
        if active is None:
            active = _passing_on.ids = set()
        if id(self) in active:
            raise OverrideChainError(
                f"the attention override chain loops: {describe(self)} passed a call on to "
                f"{self.previous_label or 'ComfyUI attention'} and got the same call back. An override in the chain "
                "calls a wrapped ComfyUI attention function without `_inside_attn_wrapper` (ComfyUI then calls the "
                "installed override again), or two overrides name each other as the previous one. Remove one of "
                "the attention nodes on this model, or update the pack whose override drops the flag.")
        active.add(id(self))
        try:
            return self._pass_on(reason, func, q, k, v, heads, mask, attn_precision, skip_reshape,
                                 skip_output_reshape, kwargs, site, containers)
        finally:
            active.discard(id(self))

    def _pass_on(self, reason, func, q, k, v, heads, mask, attn_precision, skip_reshape, skip_output_reshape, kwargs,
                 site, containers):
        config = self.config
        previous, backend, mode = config.previous, config.backend, config.checks
        to_previous = previous is not None and backend != COMFY_DEFAULT
        seen = (q, k, v)  # what checks and compare read; a container call is read by peeking, only when they run
        if containers:
            seen = _peek_containers(q, k, v) if (mode or config.compare is not None) else (None, None, None)
        target = previous if to_previous else None
        call, func, q, k, v = comfy_versions.passed_on(target, func, q, k, v, containers, config.default_attention)
        served = self.previous_label if target is not None else f"comfy:{getattr(func, '__name__', 'func')}"
        # "comfy default" asked for ComfyUI's attention: that is what served it, not a fallback.
        self._record(site, served if backend == COMFY_DEFAULT else backend, served, (reason,) if reason else ())
        if kwargs.get("low_precision_attention", True) is False:  # the flag goes with the call; counted
            notes, key = config.precision_notes, (site, f"passed on to {served} with the flag (it decides the kernel)")
            notes[key] = notes.get(key, 0) + 1
        if mode:
            checks.check_values({"query": seen[0], "key": seen[1], "value": seen[2], "attn_mask": mask}, mode, served)
        out = call(q, k, v, heads, mask=mask, attn_precision=attn_precision, skip_reshape=skip_reshape,
                   skip_output_reshape=skip_output_reshape, **kwargs)
        if seen[0] is None:
            return out
        return self._finish(out, site, *seen, mask, heads, skip_reshape, skip_output_reshape, kwargs.get("scale"),
                            bool(kwargs.get("enable_gqa", False)), served)

    def _plan(self, q, k, v, heads, mask, skip_reshape, skip_output_reshape, attn_precision, kwargs, to,
              block=None) -> _Plan:
        """The first call of a signature (of a block): validate, then decide the delegation or the dispatch."""
        _check_call(q, k, v, mask, skip_reshape)
        if block is None:
            block = _unnumbered(to, q, k, skip_reshape)
        site, kind = block.text, block.unnumbered.text
        if mask is not None and not (mask.dtype == torch.bool or mask.is_floating_point()):
            return _Plan(f"attn_mask has dtype {str(mask.dtype).replace('torch.', '')}, which ComfyUI's own "
                         "backend interprets; passed through unchanged", site=site, kind=kind)
        if not skip_reshape and not heads:
            return _Plan("heads was not given for (B, L, H*D) inputs", site=site, kind=kind)
        plan = _Plan(site=site, kind=kind, scale=kwargs.get("scale"), gqa=bool(kwargs.get("enable_gqa", False)),
                     upcast=attn_precision == torch.float32 and q.dtype in _HALF)
        plan.name = backend = self.config.backend
        if kwargs.get("low_precision_attention", True) is False:  # the model asked for full precision here: the
            plan.rules = FULL_PRECISION  # dispatcher keeps the call exact (what kept it: `_count_kept_exact`)
        if skip_reshape:  # (B, H, L, D), possibly non-contiguous: strides are kept, the dispatcher copes
            plan.layout = "BHSD"
            plan.output = "keep" if skip_output_reshape else "transpose_flatten"
        else:  # (B, L, H*D) -> free views, in the layout the kernel takes when one is named
            dim, kv_heads, dim_v = _head_dims(q, k, v, heads)
            if backend not in AUTOS and get_backend_spec(backend).layout == "BHSD" \
                    and not torch.compiler.is_dynamo_compiling():
                # (B, H, L, D) views (one as_strided each, `_heads_first`) rather than (B, L, H, D) views it permutes
                plan.layout = "BHSD"
                plan.views = ((q.shape[0], heads, q.shape[1], dim), (k.shape[0], kv_heads, k.shape[1], dim),
                              (v.shape[0], kv_heads, v.shape[1], dim_v))
                plan.output = "keep" if skip_output_reshape else "transpose_flatten"
            else:
                plan.layout = "BSHD"
                plan.views = ((*q.shape[:-1], heads, dim), (*k.shape[:-1], kv_heads, dim),
                              (*v.shape[:-1], kv_heads, dim_v))
                plan.output = "transpose" if skip_output_reshape else "flatten"
        return plan


def declared_options(backend: str):
    """The backend's own options as its spec declares them (dispatcher/backend_options.py), or None: none declared,
    or not a registered backend (the autos, "comfy default")."""
    return get_backend_spec(backend).options if backend in backend_names() else None


def _cannot_run_here(name: str) -> str:
    """'<name> cannot run on this machine (why), and ' when it cannot, else ''."""
    reasons = availability_reasons(name)
    return f"{name} cannot run on this machine ({'; '.join(reasons)}), and " if reasons else ""


class CheckedOverride(AttentionOverride):
    """An override with an Attention Checks node's tally: a call that fails its checks is counted, then raised."""

    def __call__(self, func, *args, **kwargs):
        return self._counted(AttentionOverride.__call__, func, *args, **kwargs)

    def container_function(self, *args, **kwargs):  # ComfyUI 0.38's container form, counted the same way
        return self._counted(AttentionOverride.container_function, *args, **kwargs)

    def _counted(self, serve, *args, **kwargs):
        try:
            return serve(self, *args, **kwargs)
        except AttentionInputError as exc:
            self.config.tally.non_finite(str(exc))
            raise


def override_for(config: OverrideConfig) -> AttentionOverride:
    """The `optimized_attention_override` one config makes: a Set Attention Backend node's, or an Attention Checks
    node's (a config with its `tally`: its CheckTally)."""
    return (AttentionOverride if config.tally is None else CheckedOverride)(config)


def make_override(*args, **fields) -> AttentionOverride:
    """`override_for(OverrideConfig(*args, **fields))`: the override of a config given by its fields."""
    return override_for(OverrideConfig(*args, **fields))
