"""One call object (dispatcher/call.py): the tensors and a frozen `CallSite`, checked and keyed once when made.

The site's key (`CallSite.cache_key`) holds every part of the site a decision reads and nothing else; the entry's
kept sites (`dispatch._sites`) give every call the site of its own arguments; the runtime op that carries a call
through torch.compile takes every field of the tensors and the site, and gives the same call back.
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dispatcher import AttentionInputError, Recorder, Rules, attention_backend, compiled, dispatch, eager
from dispatcher.call import SITE_FIELDS, AttentionCall, CallSite

B, L, H, D = 1, 8, 2, 16
FULL_PRECISION = Rules(low_precision=False)  # what keeps a call exact (the ComfyUI override's low_precision=False)


def qkv(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, L, H, D, generator=gen) for _ in range(3))


# ------------------------------------------------------------------------------------------------ the site

@pytest.mark.parametrize("fields, error, named", [
    ({"is_causal": "yes"}, TypeError, "is_causal"),
    ({"enable_gqa": 1}, TypeError, "enable_gqa"),
    ({"return_lse": None}, TypeError, "return_lse"),
    ({"dropout_p": False}, TypeError, "dropout_p"),
    ({"dropout_p": 1.5}, AttentionInputError, "dropout_p"),
    ({"scale": float("nan")}, AttentionInputError, "scale"),
    ({"scale": True}, TypeError, "scale"),
    ({"attention_kwargs": [("window", 1)]}, TypeError, "attention_kwargs"),
    ({"backend": ["native"]}, TypeError, "backend"),
    ({"guard": ("all", [3])}, TypeError, "guard"),
    ({"rules": {"low_precision": False}}, TypeError, "rules must be a dispatcher.Rules value"),
    ({"rules": Rules(memory_cap=1 << 20)}, ValueError, "memory_cap are rules of auto's candidates"),
])
def test_a_bad_site_field_raises_when_the_site_is_made_naming_it(fields, error, named):
    with pytest.raises(error, match=named):
        CallSite(**fields)


def test_rules_that_keep_nothing_exact_are_no_rules():
    """The default Rules refuse nothing: a site made with them is the site without (one key, one decision)."""
    assert CallSite(rules=Rules()) == CallSite() and CallSite(rules=Rules()).rules is None
    assert CallSite(rules=Rules()).cache_key == CallSite().cache_key != CallSite(rules=FULL_PRECISION).cache_key


def test_a_site_is_frozen():
    site = CallSite(is_causal=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        site.is_causal = False
    with pytest.raises(dataclasses.FrozenInstanceError):
        site.cache_key = 0
    changed = dataclasses.replace(site, is_causal=False)  # a new site, checked and keyed
    assert site.is_causal and not changed.is_causal and changed.cache_key != site.cache_key


# Each field: two values a decision tells apart (so the key must), or two it does not (so the key need not).
DECIDES = {
    "dropout_p": (0.0, 0.1), "is_causal": (False, True), "scale": (None, 0.5), "enable_gqa": (False, True),
    "attention_kwargs": (None, {"window": 1}), "backend": (None, "flex"), "layout": ("BSHD", "BHSD"),
    "policy": (None, "strict"), "return_lse": (False, True), "call_site": ("attention", "self #1"),
    "model": (None, "m"), "guard": (None, ("all", 3)), "rules": (None, FULL_PRECISION),
}
SAME_DECISION = {"dropout_p": (0.1, 0.2), "scale": (0.5, 0.25), "attention_kwargs": ({"window": 1}, {"window": 2}),
                 "recorder": (None, Recorder())}


def test_every_site_field_is_known_to_the_key_test():
    assert set(SITE_FIELDS) == set(DECIDES) | {"recorder"}


@settings(max_examples=80, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({name: st.sampled_from(values) for name, values in DECIDES.items()}),
       st.sampled_from(sorted(DECIDES)), st.sampled_from(sorted(SAME_DECISION)))
def test_the_site_key_changes_with_what_a_decision_reads_and_only_that(base, decided, same):
    """Equal sites, equal keys; a site that differs in a part a decision reads, another key; one that differs only in
    what no decision reads (the recorder, dropout's or scale's value, attention_kwargs' values), the same key."""
    site = CallSite(**base)
    assert CallSite(**base).cache_key == site.cache_key
    first, second = DECIDES[decided]
    other = second if base[decided] == first else first
    assert CallSite(**{**base, decided: other}).cache_key != site.cache_key, decided
    one, another = (CallSite(**{**base, same: value}) for value in SAME_DECISION[same])
    assert one != another and one.cache_key == another.cache_key, same


# ------------------------------------------------------------------------------------------------ the entry's sites

ARGUMENTS = {
    "dropout_p": (0.0, 0, 0.0, False), "is_causal": (False, True, 1, 0), "scale": (None, 0.5, 1.0, 1, True),
    "enable_gqa": (False, True, 1), "return_lse": (False, True, 0), "backend": (None, "_native_math"),
    "layout": ("BSHD", "BHSD"), "policy": (None, "strict"), "call_site": ("attention", "self #1"),
    "model": (None, "m"), "guard": (None, ("all", 3)), "recorder": (None, Recorder(), Recorder()),
    "rules": (None, FULL_PRECISION, Rules(exact_only=True)),
}


def test_every_site_field_is_varied_by_the_entry_test():
    assert set(ARGUMENTS) | {"attention_kwargs"} == set(SITE_FIELDS)  # attention_kwargs: never a kept site


def _valid(arguments: dict) -> bool:
    flags = all(arguments[n] is True or arguments[n] is False for n in ("is_causal", "enable_gqa", "return_lse"))
    return flags and arguments["dropout_p"] is not False and arguments["scale"] is not True


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.fixed_dictionaries({n: st.sampled_from(v) for n, v in ARGUMENTS.items()}), min_size=2, max_size=6))
def test_every_call_gets_the_site_of_its_own_arguments(calls):
    """dispatch_attention_fn keeps the sites it made per arguments: whatever came before, a call runs with a site of
    its own arguments, and an invalid one (True == 1 == 1.0: an int flag, a bool dropout or scale) still raises."""
    q, k, v = qkv()
    with _seen_calls() as seen, attention_backend("_native_math"):  # every variation runs there (lse, strict)
        for arguments in calls:
            qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v)) if arguments["layout"] == "BHSD" else (q, k, v)
            if not _valid(arguments):
                with pytest.raises(TypeError):
                    dispatch.dispatch_attention_fn(qs, ks, vs, **arguments)
                continue
            dispatch.dispatch_attention_fn(qs, ks, vs, **arguments)
            site = seen[-1].site
            for name, value in arguments.items():
                held = getattr(site, name)
                assert held == value and type(held) is type(value), (name, arguments)
            assert site.recorder is arguments["recorder"]


@contextlib.contextmanager
def _seen_calls():
    """The calls dispatch_attention_fn hands the eager path, in order."""
    seen = []
    real = dispatch.dispatch_eager
    dispatch.dispatch_eager = lambda call: seen.append(call) or real(call)
    try:
        yield seen
    finally:
        dispatch.dispatch_eager = real


def test_a_repeat_call_reuses_its_site():
    q, k, v = qkv()
    with _seen_calls() as seen:
        for _ in range(2):
            dispatch.dispatch_attention_fn(q, k, v, is_causal=True, call_site="self #2")
        dispatch.dispatch_attention_fn(q, k, v, attention_kwargs={}, is_causal=True, call_site="self #2")
    assert seen[0].site is seen[1].site  # made and keyed once
    assert seen[2].site is not seen[0].site and seen[2].site.cache_key == seen[0].site.cache_key


def test_a_call_counts_in_its_own_recorder_even_one_equal_to_another():
    class Equal(Recorder):  # a recorder that compares by value: another equal one must not take its calls
        def __eq__(self, other):
            return isinstance(other, Equal)

        def __hash__(self):
            return 0

    q, k, v = qkv()
    first, second = Equal(), Equal()
    for recorder in (first, second, second):
        dispatch.dispatch_attention_fn(q, k, v, backend="_native_math", recorder=recorder)
    assert first.served_by("_native_math") == 1 and second.served_by("_native_math") == 2


# ------------------------------------------------------------------------------------------------ the call

def test_a_call_is_its_tensors_and_its_site():
    q, k, v = qkv()
    site = CallSite(is_causal=True, backend="native")
    call = AttentionCall(q, k, v, None, site)
    assert call.site is site and call.query is q and call.attn_mask is None
    assert call.is_causal is True and call.backend == "native"  # the site's fields read through the call
    assert AttentionCall(q, k, v, is_causal=True, backend="native").site == site  # made from the site's fields
    assert AttentionCall(q, k, v, site=site, backend="flex").site == dataclasses.replace(site, backend="flex")
    changed = call._replace(query=k, is_causal=False)
    assert changed.query is k and changed.key is k and changed.site == dataclasses.replace(site, is_causal=False)
    assert call._replace(key=q).site is site  # tensors alone: the same site
    with pytest.raises(TypeError, match="no field nope"):
        call._replace(nope=1)
    with pytest.raises(TypeError, match="site must be a CallSite"):
        AttentionCall(q, k, v, None, 0.0)  # the old positional fields after the mask


def test_a_site_made_in_a_traced_frame_is_keyed_by_the_eager_path():
    """Nothing is interned while dynamo traces (a site made there has no key); the eager path keys such a site on
    arrival, so its calls share one decision with the same site made eagerly instead of all sharing None's."""
    q, k, v = qkv()
    unkeyed = CallSite(is_causal=True, backend="_native_math")
    object.__setattr__(unkeyed, "cache_key", None)  # what __post_init__ leaves inside a trace
    for _ in range(2):  # the full key, then the shorter one of a shapes_only chain
        expected = eager.dispatch_eager(AttentionCall(q, k, v, is_causal=True, backend="_native_math"))
    held = len(eager._fast)
    torch.testing.assert_close(eager.dispatch_eager(AttentionCall(q, k, v, None, unkeyed)), expected, rtol=0, atol=0)
    assert len(eager._fast) == held and unkeyed.keyed().cache_key is not None


# ------------------------------------------------------------------------------------------------ the runtime op

def test_the_runtime_ops_arguments_carry_every_field():
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    recorder = Recorder()
    call = AttentionCall(q, k, v, torch.ones(4, 4, dtype=torch.bool), dropout_p=0.0, is_causal=True, scale=0.5,
                         enable_gqa=False, backend="native", layout="BSHD", policy="strict", return_lse=True,
                         call_site="self #2", recorder=recorder, model="m", guard=("all", 3),
                         rules=FULL_PRECISION)
    arguments = compiled._op_arguments(call)
    assert len(arguments) == len(compiled._OP_ARGUMENT_NAMES)
    assert compiled._call_of(arguments) == call
    assert compiled._call_of(arguments).site is compiled._call_of(arguments).site  # made once per fields
    bare = AttentionCall(q, k, v)
    assert compiled._call_of(compiled._op_arguments(bare)) == bare
    # The registered op takes exactly these arguments, in this order: the tensors', then the site's fields.
    schema = compiled._runtime_op()._opoverload._schema
    assert tuple(a.name for a in schema.arguments) == compiled._OP_ARGUMENT_NAMES
    fields = ("query", "key", "value", "attn_mask") + SITE_FIELDS
    assert [n for n in compiled._OP_ARGUMENT_NAMES if n in fields] == [f for f in fields
                                                                       if f in compiled._OP_ARGUMENT_NAMES]


def test_the_runtime_op_runs_a_call_as_the_eager_path_does():
    q, k, v = (torch.randn(1, 6, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3))
    recorder = Recorder()
    call = AttentionCall(q, k, v, is_causal=True, backend="_native_math", return_lse=True, call_site="self #1",
                         recorder=recorder)
    out, lse = compiled._as_op(call)
    expected_out, expected_lse = compiled.dispatch_eager(call._replace(recorder=None))
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, expected_lse, rtol=0, atol=0)
    assert recorder.served_by("_native_math") == 1  # the recorder travelled by its serial
