"""One attention call: its tensors and its site, described once at the entry point and carried unchanged to the kernel.

`CallSite` is everything of a call but its tensors: dropout, the flags, the scale, attention_kwargs, the backend,
layout, policy, call site, recorder, model, guard and the rules that keep it exact. It is frozen and checked once,
when it is made, and it owns its part of every cache key of calls (`CallSite.cache_key`, a small int made once per
distinct part): a caller that makes many calls of one kind makes its site once (`PreparedAttention`, the ComfyUI
override's plans), and `dispatch_attention_fn` keeps the sites it made for its arguments, so a repeat call checks and
hashes none of them.

`AttentionCall` is the tensors (query, key, value, attn_mask) and a site: a tuple, so the hot path builds one for the
cost of a tuple (`new_call`). Its site's fields read through it by name (`call.scale` is `call.site.scale`); made
with site fields by keyword (`AttentionCall(q, k, v, is_causal=True)`) or changed with `call._replace(...)`, it
makes the site they describe. The eager path, the traced routes, context parallelism and the backend runner take it
whole; the runtime op that carries a call through torch.compile builds its arguments from these definitions
(compiled.OP_SCHEMA).

`tensors_key` / `shapes_key`: what of a call's tensors every key of calls reads. The eager path's key and the ComfyUI
override's plan key are both built by them, so the override's plans stay at least as fine as the dispatcher's key.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .checks import check_site
from .inputs import DEFAULT_CALL_SITE
from .rules import Rules, call_rules



# Each distinct key part -> its int. Ints are never reused: once the table is cleared (past _MAX_KEYS parts), a part
# seen again gets a new int (one more entry in the eager path's cache), never another part's.
_keys: dict[tuple, int] = {}
_next_key = itertools.count(1).__next__
_MAX_KEYS = 4096


def _key_part(site: CallSite) -> tuple:
    """What of a site a decision can depend on: whether dropout or a scale is given, not its value; attention_kwargs'
    names, not their values; never the recorder."""
    kwargs = site.attention_kwargs
    return (site.backend, site.policy, site.layout, site.is_causal, site.dropout_p > 0, site.scale is None,
            site.enable_gqa, site.return_lse, site.model, site.guard, site.call_site,
            frozenset(kwargs) if kwargs else None, site.rules)


def _cache_key(site: CallSite) -> int:
    """The site's part of a call's key (`_key_part`) as its int."""
    part = _key_part(site)
    key = _keys.get(part)
    if key is None:
        if len(_keys) >= _MAX_KEYS:
            _keys.clear()
        key = _keys[part] = _next_key()
    return key


@dataclass(frozen=True, slots=True)
class CallSite:
    """Everything of a call but its tensors, fixed per call site; `dispatch_attention_fn`'s arguments of the same
    names (None: the active scope's backend, policy, model, guard). Checked when made (a bad value raises here,
    naming it); change one with `dataclasses.replace`, which makes and checks a new site."""
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    attention_kwargs: dict | None = None
    backend: str | None = None  # None: the active backend
    layout: str = "BSHD"
    policy: str | None = None  # None: the active policy
    return_lse: bool = False
    call_site: str = DEFAULT_CALL_SITE
    recorder: Any = None  # None: the active `recording()` block's
    model: str | None = None  # whose activations these are (accuracy verdicts are per model); None: the active scope
    guard: tuple | None = None  # (mode, every) of the quality guard; None: the active setting
    rules: Rules | None = None  # the rules that keep the call exact (rules.call_rules); None: none
    # What of the site a decision can depend on (`_key_part`) as one int, made once, here: sites of unequal parts
    # never share one. None for a site made inside a traced frame, where nothing is interned (`keyed` makes it).
    cache_key: int | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        check_site(self)
        if not torch.compiler.is_dynamo_compiling():  # a site made in a trace is checked when the eager path keys it
            if self.rules is not None:  # only the rules that keep a call exact, else a clear error; the default: None
                object.__setattr__(self, "rules", call_rules(self.rules))
            object.__setattr__(self, "cache_key", _cache_key(self))

    def __hash__(self) -> int:  # equal sites have equal parts (attention_kwargs, a dict, is read by its names)
        return hash(_key_part(self))

    def keyed(self) -> CallSite:
        """This site with its cache key (a site made in a traced frame has none)."""
        return self if self.cache_key is not None else dataclasses.replace(self)


SITE_FIELDS = tuple(f.name for f in dataclasses.fields(CallSite) if f.init)
DEFAULT_SITE = CallSite()

TENSOR_FIELDS = ("query", "key", "value", "attn_mask")


class _Parts(NamedTuple):
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: Any = None
    site: CallSite = DEFAULT_SITE


class AttentionCall(_Parts):
    """The tensors of one call and its site. `AttentionCall(query, key, value, attn_mask=None, site=None,
    **site_fields)`: the site given, or made from the site fields given by keyword (or the given site with them
    changed). `call._replace(...)` takes tensors, `site` and site fields alike."""
    __slots__ = ()

    def __new__(cls, query, key, value, attn_mask=None, site: CallSite | None = None, **site_fields):
        if site is None:
            site = CallSite(**site_fields) if site_fields else DEFAULT_SITE
        elif type(site) is not CallSite:
            raise TypeError(f"an AttentionCall's site must be a CallSite; got {type(site).__name__} (pass "
                            f"dropout_p, is_causal and the other fields of CallSite by keyword)")
        elif site_fields:
            site = dataclasses.replace(site, **site_fields)
        return tuple.__new__(cls, (query, key, value, attn_mask, site))

    def _replace(self, **changes) -> AttentionCall:
        site = changes.pop("site", self.site)
        site_changes = {name: changes.pop(name) for name in SITE_FIELDS if name in changes}
        tensors = {name: changes.pop(name, getattr(self, name)) for name in TENSOR_FIELDS}
        if changes:
            raise TypeError(f"AttentionCall has no field {', '.join(sorted(changes))}")
        return AttentionCall(**tensors, site=dataclasses.replace(site, **site_changes) if site_changes else site)


def _site_field(name: str) -> property:
    return property(lambda call: getattr(call.site, name), doc=f"The site's {name} (`call.site.{name}`).")


for _name in SITE_FIELDS:  # call.scale reads call.site.scale: the routes and the guard read a call's fields by name
    setattr(AttentionCall, _name, _site_field(_name))
del _name

# tuple.__new__ directly: AttentionCall.__new__ costs a Python frame per call on the hot path.
# new_call(AttentionCall, (query, key, value, attn_mask, site)): the four tensors in SDPA's order, then the site.
new_call = tuple.__new__

_Tensor = torch.Tensor


def tensors_key(prefix, query, key, value, attn_mask) -> tuple:
    """`prefix` (the caller's own part) and what of a call's tensors a decision can depend on: shapes, dtypes,
    devices, the mask's kind, dtype, shape and device. Every key of calls is built here: the eager path's
    (eager.lane_key) and the ComfyUI override's plans (on its tensors before its views, which follow from them).
    Whether a gradient is wanted is the caller's to add (the eager path's prefix holds it; a lane re-checks it)."""
    m = attn_mask
    if m is None:
        mask = None
    elif type(m) is _Tensor:
        mask = (m.dtype, m.shape, m.device)
    else:  # a BlockMask (or a wrong type: the full path raises the real error)
        mask = (type(m), getattr(m, "dtype", None), getattr(m, "shape", None), getattr(m, "device", None))
    return (prefix, query.shape, key.shape, value.shape, mask, query.dtype, key.dtype, value.dtype, query.device,
            key.device, value.device)


def shapes_key(prefix, query, key, value, attn_mask) -> tuple:
    """The shorter key of a `shapes_only` chain (SDPA's: every dtype and device): `tensors_key` without dtypes and
    devices. Never equal to a `tensors_key` (fewer parts)."""
    m = attn_mask
    if m is None:
        mask = None
    elif type(m) is _Tensor:
        mask = (m.dtype, m.shape)
    else:
        mask = (type(m), getattr(m, "dtype", None), getattr(m, "shape", None), getattr(m, "device", None))
    return prefix, query.shape, key.shape, value.shape, mask
