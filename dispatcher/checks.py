"""Checks on attention inputs and outputs, each failure naming the tensor, the expected and the actual value.

Structural checks (device, dtype, shape, mask, mask-and-causal) read only metadata; the dispatcher
runs them whenever it decides a new call signature, so a bad call fails with a clear message before
any kernel sees it. Value checks (NaN/Inf) read the data and cost a device sync: they run on every
call only while checks are on (DIFFUSERS_ATTN_CHECKS=yes, `set_checks`, or `attention_checks`).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers
from collections.abc import Callable, Mapping

import torch

from .inputs import LAYOUTS, AttentionInputs
from .masks import broadcast_problem
from .log import logger


class AttentionInputError(ValueError):
    """The inputs of an attention call are inconsistent; no backend can run them."""


def _fail(message: str):
    raise AttentionInputError(message)


def check_structure(inputs: AttentionInputs) -> None:
    i = inputs
    for name, device in (("key", i.key_device), ("value", i.value_device)):
        if device != i.device:
            _fail(f"{name} is on {device} but query is on {i.device}: move query, key and value to one device")
    for name, dtype in (("key", i.key_dtype), ("value", i.value_dtype)):
        if dtype != i.dtype:
            _fail(f"{name} has dtype {dtype} but query has {i.dtype}: cast query, key and value to one dtype")
    if not i.dtype.is_floating_point:
        _fail(f"query has dtype {i.dtype}; attention needs floating point inputs (float16, bfloat16, float32)")
    if i.head_dim <= 0 or i.head_dim_v <= 0:
        # SDPA runs it: with no features the scores are all equal (value's mean over the keys) or the output empty
        _fail(f"head dim must be positive; got query head dim {i.head_dim}, value head dim {i.head_dim_v} (SDPA "
              "would return the mean of value over the keys for a query head dim 0, an empty output for a value "
              "head dim 0: neither is attention; give the heads their features)")
    # A batch, head count or length of 0 is an empty call: SDPA's result without a kernel (decisions.EMPTY).
    if i.heads_kv != i.heads_q:
        if i.heads_kv == 0 or i.heads_q % i.heads_kv:
            _fail(f"query has {i.heads_q} heads, not a multiple of the {i.heads_kv} key/value heads")
        if not i.enable_gqa and i.heads_kv != 1:  # one key/value head broadcasts, as in SDPA
            _fail(f"key/value have {i.heads_kv} heads but query has {i.heads_q}: pass enable_gqa=True for "
                  "grouped-query attention")
    if i.mask_kind == "integer":
        _fail("attn_mask has an integer dtype; pass a bool mask (True = attend) or an additive float mask "
              "(0 = keep, -inf = drop)")
    if i.mask_shape is not None and i.mask_kind != "blockmask":
        problem = broadcast_problem(i.mask_shape, i.batch, i.heads_q, i.len_q, i.len_kv)
        if problem:
            _fail(problem)


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


_PLAIN = (float, int)
_Tensor = torch.Tensor  # bound once: check_tensors runs on every call


def check_arguments(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                    attention_kwargs) -> None:
    """`check_tensors` and `check_site`'s checks of the flags, for a caller that holds the arguments apart."""
    check_tensors(query, key, value, attn_mask)
    _check_flags(dropout_p, is_causal, scale, enable_gqa, return_lse, attention_kwargs)


def check_tensors(query, key, value, attn_mask) -> None:
    """The types of a call's tensors and mask, on every call (no device sync)."""
    if not (isinstance(query, _Tensor) and isinstance(key, _Tensor) and isinstance(value, _Tensor)):
        for name, tensor in (("query", query), ("key", key), ("value", value)):
            if not isinstance(tensor, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor; got {type(tensor).__name__}")
    if attn_mask is not None and not isinstance(attn_mask, _Tensor) and type(attn_mask).__name__ != "BlockMask":
        raise TypeError(f"attn_mask must be a torch.Tensor, a FlexAttention BlockMask or None; "
                        f"got {type(attn_mask).__name__}")


def check_site(site) -> None:
    """The arguments of a call that are not its tensors (a `CallSite`), once, when the site is made.

    A wrong type is a TypeError and a wrong value an AttentionInputError, each naming the argument, before
    any kernel sees it: a kernel would misread it (bool("no") is True for is_causal) or raise, and a kernel
    that raises is demoted for the call's signature, which a bad argument must never cause.
    """
    _check_flags(site.dropout_p, site.is_causal, site.scale, site.enable_gqa, site.return_lse, site.attention_kwargs)
    # Parts of the site's key, checked by type rather than by hash(): Dynamo before torch 2.13 cannot trace hash()
    # of a str, and a site is made inside a compiled model's trace (a graph break on every call there).
    for name in ("backend", "policy", "layout", "call_site", "model"):
        value = getattr(site, name)
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a string or None; got {type(value).__name__}")
    guard = site.guard
    if guard is not None and not (isinstance(guard, tuple) and len(guard) == 2 and isinstance(guard[0], str)
                                  and isinstance(guard[1], int)):
        raise TypeError(f"guard must be a (mode, every) tuple of a string and an int, or None; got {guard!r}")


def _check_flags(dropout_p, is_causal, scale, enable_gqa, return_lse, attention_kwargs) -> None:
    if not ((is_causal is True or is_causal is False) and (enable_gqa is True or enable_gqa is False)
            and (return_lse is True or return_lse is False)):
        for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa), ("return_lse", return_lse)):
            if flag is not True and flag is not False:
                raise TypeError(f"{name} must be True or False; got {flag!r} ({type(flag).__name__})")
    if scale is not None:
        if type(scale) not in _PLAIN and not _real(scale):
            if isinstance(scale, torch.Tensor):  # a 0-d one without gradient was made a float at the entry
                raise TypeError(f"scale is a tensor of shape {tuple(scale.shape)}, dtype "
                                f"{str(scale.dtype).replace('torch.', '')}, requires_grad={scale.requires_grad}; "
                                f"a 0-d real tensor that needs no gradient is taken as its value (as SDPA takes "
                                f"it), SDPA refuses this one too: pass float(scale)")
            raise TypeError(f"scale must be a float or None (None = 1/sqrt(head dim)); got {type(scale).__name__}")
        if not math.isfinite(scale):
            _fail(f"scale must be finite; got {scale}")
    if type(dropout_p) not in _PLAIN and (dropout_p is None or not _real(dropout_p)):
        raise TypeError(f"dropout_p must be a float in [0, 1]; got {type(dropout_p).__name__}")
    if not 0.0 <= dropout_p <= 1.0:  # NaN fails too
        _fail(f"dropout_p must be in [0, 1]; got {dropout_p}")
    if attention_kwargs is not None and not isinstance(attention_kwargs, Mapping):
        raise TypeError(f"attention_kwargs must be a dict or None; got {type(attention_kwargs).__name__}")


def plain_scale(scale):
    """`scale` as the kernels take it: a 0-d real tensor that needs no gradient becomes its float, as SDPA reads
    one (a device sync for a GPU tensor, in SDPA too); anything else is returned as given, for check_arguments
    to judge. Called at the entry when scale is neither None nor a float."""
    if (isinstance(scale, torch.Tensor) and scale.dim() == 0 and not scale.requires_grad
            and scale.dtype != torch.bool and not scale.is_complex()):
        return float(scale)
    return scale


def check_shapes(query, key, value, layout: str, attn_mask=None) -> None:
    if isinstance(attn_mask, torch.Tensor) and attn_mask.device != query.device:
        _fail(f"attn_mask is on {attn_mask.device} but query is on {query.device}: move attn_mask to the "
              "query's device")
    if layout not in LAYOUTS:
        _fail(f"unknown layout {layout!r}; valid layouts: {', '.join(LAYOUTS)} (BSHD = (B, S, H, D), BHSD = (B, H, S, D))")
    if key.dim() != 4 or value.dim() != 4 or query.dim() != 4:
        _fail(f"query, key and value must be 4-D in layout {layout}; got shapes {tuple(query.shape)}, "
              f"{tuple(key.shape)}, {tuple(value.shape)}")
    batch_axis, seq_axis, head_axis = 0, (1 if layout == "BSHD" else 2), (2 if layout == "BSHD" else 1)
    if key.shape[batch_axis] != value.shape[batch_axis] or key.shape[batch_axis] not in (1, query.shape[batch_axis]):
        _fail(f"batch sizes differ: query {query.shape[0]}, key {key.shape[0]}, value {value.shape[0]} (key and value "
              f"need the query's batch, or both batch 1 to broadcast over it as in SDPA)")
    if key.shape[-1] != query.shape[-1]:
        _fail(f"key head dim is {key.shape[-1]} but query head dim is {query.shape[-1]}: they must match")
    if key.shape[seq_axis] != value.shape[seq_axis]:
        _fail(f"key has sequence length {key.shape[seq_axis]} but value has {value.shape[seq_axis]}: they must match")
    if key.shape[head_axis] != value.shape[head_axis]:
        _fail(f"key has {key.shape[head_axis]} heads but value has {value.shape[head_axis]}: they must match")


def _non_finite(t: torch.Tensor, allow_inf: bool = False) -> str | None:
    if not t.is_floating_point():
        return None
    nans = int(torch.isnan(t).sum())
    infs = 0 if allow_inf else int(torch.isinf(t).sum())
    if nans or infs:
        return f"{nans} NaN and {infs} Inf values (expected all finite) in a tensor of shape {tuple(t.shape)}"
    return None


# Who hears of what `warn` found, besides the log (an Attention Checks node's tally): under `raise` the error
# itself says it. Set per call by `reporting`.
_observer: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar("checks_observer",
                                                                                        default=None)


@contextlib.contextmanager
def reporting(found: Callable[[str], None]):
    """Inside: every NaN/Inf that `warn` checks find is also passed to `found(message)`."""
    token = _observer.set(found)
    try:
        yield
    finally:
        _observer.reset(token)


def check_values(named: dict[str, torch.Tensor], mode: str, backend: str) -> None:
    for name, tensor in named.items():
        if tensor is None or not isinstance(tensor, torch.Tensor):
            continue
        problem = _non_finite(tensor, allow_inf=(name == "attn_mask"))
        if problem:
            message = f"{name} of attention backend '{backend}' has {problem}"
            if mode == "raise":
                _fail(message)
            logger.warning("%s", message)
            observer = _observer.get()
            if observer is not None:
                observer(message)


def broadcast_kv(q, k, v, enable_gqa: bool = True):
    """Key/value shaped for a kernel that wants the query's batch (and, without GQA, its heads), in a layout
    whose batch axis is 0 and head axis 1 (BHSD): SDPA's broadcasting of a key/value batch of 1, and of one
    key/value head, as stride-0 views (no copy)."""
    batch, heads = q.shape[0], q.shape[1]
    want_heads = k.shape[1] if (enable_gqa or k.shape[1] == heads) else heads
    if k.shape[0] == batch and k.shape[1] == want_heads:
        return k, v
    return (k.expand(batch, want_heads, *k.shape[2:]), v.expand(batch, want_heads, *v.shape[2:]))
