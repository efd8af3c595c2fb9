"""The eager path's key (`eager.lane_key`: the site's `CallSite.cache_key`, the scope, and `call.tensors_key` of the
tensors) is finer than the decision's: two calls with one key are one decision.

A property over calls drawn near each other (a base call and the same call with one or two things changed), not a
hand-listed set of variations: whatever makes a new decision must make a new key, or a call would be served another
call's decision (and the override's lanes, which skip the key, are kept per plan key built by the same tensors_key).
The shorter key of a `shapes_only` chain (no dtypes, devices, grad) must give the same served kernels likewise. The
eager path writes the key out inline: that it stores its decisions under lane_key's keys is checked too.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from dispatcher import caches, checks, decisions, eager, state
from dispatcher.call import AttentionCall
from dispatcher.inputs import describe_call
from dispatcher.machine import current_machine

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

# Each part of a call and the values it takes: a call is one value of each.
PARTS = {
    "backend": ("native", "flex", "_native_math"),
    "length": (8, 16),
    "dtype": (torch.float32, torch.float64),
    "mask": (None, "bool", "additive", "additive per head", "additive (Sq, Sk)"),
    "is_causal": (False, True),
    "dropout_p": (0.0, 0.1),
    "scale": (None, 0.3, 0.5),
    "return_lse": (False, True),
    "grad": (False, True),
    "kv_batch_1": (False, True),
    "gqa": (False, True),
    "layout": ("BSHD", "BHSD"),
    "policy": (None, "strict", "fallback"),
    "model": (None, "another model"),
    "guard": (None, ("all", 3), ("off", 0)),
    "call_site": ("attention", "self #1"),
    "attention_kwargs": (None, {"window": 1}),
}
B, H, D = 2, 2, 8


def _call(parts: dict) -> AttentionCall:
    n = parts["length"]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, n, H, D, generator=gen, dtype=parts["dtype"])
    kv_batch = 1 if parts["kv_batch_1"] else B
    kv_heads = 1 if parts["gqa"] else H
    k, v = (torch.randn(kv_batch, n, kv_heads, D, generator=gen, dtype=parts["dtype"]) for _ in range(2))
    if parts["grad"]:
        q.requires_grad_()
    if parts["layout"] == "BHSD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    mask = {None: None, "bool": torch.ones(B, 1, n, n, dtype=torch.bool), "additive": torch.zeros(B, 1, n, n),
            "additive per head": torch.zeros(B, H, n, n), "additive (Sq, Sk)": torch.zeros(n, n)}[parts["mask"]]
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(parts["dtype"])
    return AttentionCall(q, k, v, mask, dropout_p=parts["dropout_p"], is_causal=parts["is_causal"],
                         scale=parts["scale"], enable_gqa=parts["gqa"], attention_kwargs=parts["attention_kwargs"],
                         backend=parts["backend"], layout=parts["layout"], policy=parts["policy"],
                         return_lse=parts["return_lse"], call_site=parts["call_site"], model=parts["model"],
                         guard=parts["guard"])


def _keys_and_decision(call: AttentionCall):
    """(the fast key, the shapes-only key, the decision) of `call` as the eager path makes them, or None for a call
    it refuses (the full path raises before any key is stored)."""
    (backend, policy, model, guard), _ = state.current()
    site = call.site
    requested = site.backend or backend
    policy, model, guard = site.policy or policy, site.model or model, site.guard or guard
    machine_id = id(current_machine())
    try:
        checks.check_shapes(call.query, call.key, call.value, site.layout, call.attn_mask)
        inputs = describe_call(call.query, call.key, call.value, call.attn_mask, site.dropout_p, site.is_causal,
                               site.scale, site.enable_gqa, site.return_lse, site.layout)
        decision = decisions.decision_for(requested, state.validate_policy(policy), inputs, site.layout, model,
                                          guard)
    except (checks.AttentionInputError, decisions.BackendNotSupportedError, TypeError, ValueError):
        return None
    return (eager.lane_key(call, requested, policy, model, guard, machine_id, False),
            eager.lane_key(call, requested, policy, model, guard, machine_id, True), decision)


def _served(decision) -> list:
    return [(c.name, c.transpose, c.convert_mask, c.guard) for c in decision.candidates]


@st.composite
def _near_calls(draw):
    """A base call and the same call with one or two of its parts changed."""
    base = {name: draw(st.sampled_from(values)) for name, values in PARTS.items()}
    other = dict(base)
    for name in draw(st.sets(st.sampled_from(sorted(PARTS)), min_size=1, max_size=2)):
        other[name] = draw(st.sampled_from(PARTS[name]))
    return base, other


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(_near_calls())
def test_one_fast_key_is_one_decision(pair):
    a, b = (_keys_and_decision(_call(parts)) for parts in pair)
    assume(a is not None and b is not None)
    (fast_a, shapes_a, decision_a), (fast_b, shapes_b, decision_b) = a, b
    if fast_a == fast_b:
        assert decision_a is decision_b, (pair, fast_a)
    if shapes_a == shapes_b and decision_a.shapes_only and decision_b.shapes_only \
            and decision_a.requested == pair[0]["backend"]:
        assert _served(decision_a) == _served(decision_b), pair


def test_the_property_draws_calls_that_share_a_key_and_calls_that_do_not():
    """Not vacuous: some drawn pairs share a fast key, some share only the shapes key, most share neither."""
    base = {name: values[0] for name, values in PARTS.items()}
    same = _keys_and_decision(_call(base))
    again = _keys_and_decision(_call(dict(base)))
    assert same[0] == again[0] and same[2] is again[2]
    double = _keys_and_decision(_call({**base, "dtype": torch.float64}))
    assert double[0] != same[0] and double[1] == same[1] and double[2] is not same[2]
    masked = _keys_and_decision(_call({**base, "mask": "bool"}))
    assert masked[0] != same[0] and masked[1] != same[1]


@settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({name: st.sampled_from(values) for name, values in PARTS.items()}))
def test_the_eager_path_stores_its_decisions_under_lane_keys(parts):
    """dispatch_eager writes lane_key out inline: a call it serves leaves its decision under lane_key's key (the
    shorter one too, for a shapes_only chain), so the property above is about the key the path uses."""
    caches.forget()  # from nothing: the first call stores the full key, the second the shorter one
    call = _call(parts)
    found = _keys_and_decision(call)
    assume(found is not None and not parts["attention_kwargs"])
    fast, short, decision = found
    eager.dispatch_eager(call)
    eager.dispatch_eager(call)  # the second call stores the shorter key of a shapes_only chain
    stored = eager._fast.get(fast)
    assert stored is decision or stored is eager._TRUST_SENSITIVE, parts
    if decision.shapes_only and decision.requested == parts["backend"]:
        assert eager._fast.get(short) is decision, parts
