"""`PreparedAttention`: dispatch_attention_fn with everything but the tensors fixed once; each call behaves as the
plain entry point's (result, recording, fallback, argument errors)."""

from __future__ import annotations

import pytest
import torch

import dispatcher
from dispatcher import PreparedAttention, Recorder, dispatch_attention_fn
from helpers import tensors


@pytest.mark.parametrize("fixed", [
    {},
    {"backend": "_native_math", "is_causal": True, "scale": 0.2, "call_site": "self"},
    {"backend": "flex", "layout": "BHSD", "return_lse": True},
    {"backend": "native", "guard": "all", "guard_every": 2, "model": "m", "policy": "strict"},
])
def test_a_prepared_call_is_the_plain_call(fixed):
    q, k, v = tensors.qkv(b=2, lq=16, h=2, d=32)
    if fixed.get("layout") == "BHSD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    mine, theirs = Recorder(), Recorder()
    prepared = PreparedAttention(recorder=mine, **fixed)
    # The plain calls for another model where there is one: the guard counts calls per decision, which a model has.
    plain = {**fixed, "model": fixed["model"] + "-plain"} if "model" in fixed else fixed
    for _ in range(3):  # the first call decides, the later ones take the fast lane
        got = prepared(q, k, v)
        expected = dispatch_attention_fn(q, k, v, recorder=theirs, **plain)
        for g, e in zip(got if fixed.get("return_lse") else (got,), expected if fixed.get("return_lse") else (expected,)):
            torch.testing.assert_close(g, e, rtol=0, atol=0)
    assert mine.snapshot()["rows"] == theirs.snapshot()["rows"]
    assert mine.snapshot()["guard"] == theirs.snapshot()["guard"]


def test_a_prepared_call_takes_a_mask_and_checks_its_arguments_per_call():
    q, k, v = tensors.qkv(b=2, lq=16, h=2, d=32)
    keep = torch.rand(2, 1, 16, 16, generator=torch.Generator().manual_seed(0)) > 0.3
    keep[..., 0] = True
    prepared = PreparedAttention(backend="native")
    torch.testing.assert_close(prepared(q, k, v, keep), dispatch_attention_fn(q, k, v, keep, backend="native"))
    with pytest.raises(TypeError, match="is_causal must be True or False"):
        PreparedAttention(is_causal="yes")(q, k, v)
    with pytest.raises(TypeError, match="attn_mask must be"):
        prepared(q, k, v, [[1]])
    with pytest.raises(dispatcher.UnknownBackendError):
        PreparedAttention(backend="nope")(q, k, v)
    with pytest.raises(ValueError):
        PreparedAttention(guard="sometimes")
