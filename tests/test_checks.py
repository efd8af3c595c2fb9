"""Input checks: structural problems always raise AttentionInputError naming the tensor, the expected
and the actual value; value checks (NaN/Inf) run only while checks are on."""

from __future__ import annotations

import functools

import pytest
import torch

from dispatcher import AttentionInputError, attention_checks, dispatch_attention_fn, set_checks
from helpers import tensors

B, L, H, D = 2, 6, 2, 16


def t(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device) if device != "meta" else torch.empty(*shape, device="meta")


qkv = functools.partial(tensors.qkv, b=B, lq=L, lk=L, h=H, d=D)  # q=, k=, v= replace one tensor


def fails(*parts, **call):
    """The call raises AttentionInputError whose message contains every part."""
    args = call.pop("args")
    with pytest.raises(AttentionInputError) as err:
        dispatch_attention_fn(*args, **call)
    message = str(err.value)
    for part in parts:
        assert part in message, f"{part!r} not in {message!r}"
    return message


@pytest.mark.parametrize("policy", ["fallback", "strict"])
@pytest.mark.parametrize("backend", ["native", "flex", "_native_math"])
def test_dtype_mismatch(backend, policy):
    fails("key", "torch.float16", "torch.float32", args=qkv(k=t(B, L, H, D, dtype=torch.float16)),
          backend=backend, policy=policy)


def test_value_dtype_mismatch():
    fails("value", "torch.bfloat16", "torch.float32", args=qkv(v=t(B, L, H, D, dtype=torch.bfloat16)))


def test_device_mismatch():
    """The meta device stands in for a second device on a CPU-only machine (no data is read)."""
    fails("key is on meta", "query is on cpu", "one device",
          args=qkv(k=t(B, L, H, D, device="meta")))


def test_integer_query_is_refused():
    q = torch.ones(B, L, H, D, dtype=torch.int64)
    fails("floating point", "torch.int64", args=(q, q, q))


def test_head_dim_mismatch():
    fails("key head dim is 8", "query head dim is 16", args=qkv(k=t(B, L, H, 8)))


def test_key_value_length_mismatch():
    fails("key has sequence length 6", "value has 7", args=qkv(v=t(B, 7, H, D)))


def test_key_value_length_mismatch_bhsd():
    q, k, v = t(B, H, L, D), t(B, H, L, D), t(B, H, 9, D)
    fails("key has sequence length 6", "value has 9", args=(q, k, v), layout="BHSD")


def test_key_value_heads_mismatch():
    fails("key has 2 heads", "value has 1", args=qkv(v=t(B, L, 1, D)))


def test_batch_mismatch():
    fails("batch sizes differ", "query 2", "key 3", args=qkv(k=t(3, L, H, D), v=t(3, L, H, D)))


def test_gqa_without_enable_gqa():
    q, k, v = t(B, L, 4, D), t(B, L, 2, D), t(B, L, 2, D)
    fails("key/value have 2 heads", "query has 4", "enable_gqa=True", args=(q, k, v))
    assert dispatch_attention_fn(q, k, v, enable_gqa=True).shape == q.shape


def test_query_heads_not_a_multiple_of_kv_heads():
    q, k, v = t(B, L, 3, D), t(B, L, 2, D), t(B, L, 2, D)
    fails("query has 3 heads", "not a multiple of the 2 key/value heads", args=(q, k, v), enable_gqa=True)


@pytest.mark.parametrize("shape, axis, have, want", [
    ((L, 5), "key length", 5, L),  # 2-D (Lq, Lk)
    ((3, L, L), "heads", 3, H),  # 3-D (H, Lq, Lk), as SDPA reads it
    ((B, 3, L, L), "heads", 3, H),
    ((B, H, 4, L), "query length", 4, L),
])
def test_mask_that_does_not_broadcast(shape, axis, have, want):
    message = fails("attn_mask of shape", str(shape), "does not broadcast to (B, H, Lq, Lk)", f"({B}, {H}, {L}, {L})",
                    f"its {axis} axis is {have}, expected 1 or {want}", args=qkv(), attn_mask=torch.zeros(shape))
    assert message.count("attn_mask") == 1


@pytest.mark.parametrize("rank", [1, 5])
def test_mask_of_the_wrong_rank(rank):
    fails("attn_mask has", f"{rank} dimensions", "expected 2 to 4", args=qkv(), attn_mask=torch.zeros((1,) * (rank - 1) + (L,)))


def test_integer_mask():
    fails("integer dtype", "bool mask", "additive", args=qkv(), attn_mask=torch.ones(L, L, dtype=torch.int64))


def test_empty_inputs_are_not_refused():  # SDPA's result: tests/test_semantics.py
    assert dispatch_attention_fn(*qkv(k=t(B, 0, H, D), v=t(B, 0, H, D))).shape == (B, L, H, D)


def test_head_dim_zero():
    z = t(B, L, H, 0)
    fails("head dim must be positive", "query head dim 0", args=(z, z, z))


def test_query_heads_without_key_heads():
    fails("query has 2 heads, not a multiple of the 0 key/value heads", args=qkv(k=t(B, L, 0, D), v=t(B, L, 0, D)),
          enable_gqa=True)


def test_three_dimensional_tensors():
    x = t(B, L, H * D)
    fails("must be 4-D in layout BSHD", str((B, L, H * D)), args=(x, x, x))


def test_three_dimensional_key_only():
    fails("must be 4-D", args=qkv(k=t(B, L, H * D)))


def test_unknown_layout():
    fails("unknown layout 'SBHD'", "BSHD", "BHSD", args=qkv(), layout="SBHD")


def test_structural_errors_raise_under_strict_and_fallback_and_with_checks_off():
    set_checks(False)
    for policy in ("fallback", "strict"):
        fails("key head dim", args=qkv(k=t(B, L, H, 8)), policy=policy)


def test_structural_error_is_not_swallowed_by_the_decision_cache():
    """The same bad signature fails every time, not just when first decided."""
    for _ in range(3):
        fails("attn_mask of shape (3, 6, 6)", args=qkv(), attn_mask=torch.ones(3, L, L, dtype=torch.bool))


# --- calls found by their shapes alone (SDPA's chain: eager.py's shorter key) ----------------------------

MIXED = {
    "key dtype": (dict(k=t(B, L, H, D, dtype=torch.float16)), ("key", "torch.float16", "torch.float32")),
    "value dtype": (dict(v=t(B, L, H, D, dtype=torch.bfloat16)), ("value", "torch.bfloat16")),
    "key device": (dict(k=t(B, L, H, D, device="meta")), ("key is on meta", "query is on cpu")),
    "integer inputs": (dict(q=torch.ones(B, L, H, D, dtype=torch.int64), k=torch.ones(B, L, H, D, dtype=torch.int64),
                            v=torch.ones(B, L, H, D, dtype=torch.int64)), ("floating point", "torch.int64")),
}


@pytest.mark.parametrize("case", sorted(MIXED))
@pytest.mark.parametrize("policy", ["fallback", "strict"])
def test_a_call_found_by_its_shapes_alone_is_still_checked_in_full(case, policy):
    """SDPA's decisions depend on shapes and flags only, so repeat calls find them by a key without dtypes and
    devices; a call of the same shapes with mixed dtypes or devices must still get the pack's own error (its
    kernel rejects it, the full path validates it), and demote nothing."""
    from dispatcher import Recorder, eager
    for _ in range(2):  # the second call of these shapes is found by its shapes
        dispatch_attention_fn(*qkv(), policy=policy)
    assert "native" in eager._shapes_only
    replaced, parts = MIXED[case]
    for _ in range(2):
        fails(*parts, args=qkv(**replaced), policy=policy)
    rec = Recorder()
    out = dispatch_attention_fn(*qkv(), policy=policy, recorder=rec)
    assert [(r["served"], r["fell_back"]) for r in rec.snapshot()["rows"]] == [("native", False)]  # not demoted
    torch.testing.assert_close(out, tensors.sdpa(*qkv()))


def test_only_the_sdpa_chain_is_decided_by_shapes_alone():
    """`universal`: every floating dtype on every device, forward and backward, nothing of the machine but torch."""
    from dispatcher import registry
    universal = {name for name in registry.names() if registry.get(name).universal}
    assert universal == {"native", "_native_math"}


# --- value checks -------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_nan_inputs_raise_only_when_checks_are_on(which):
    q, k, v = qkv()
    {"query": q, "key": k, "value": v}[which][0, 1, 0, 3] = float("nan")
    out = dispatch_attention_fn(q, k, v, backend="_native_math")  # checks off: nothing reads the values
    assert torch.isnan(out).any()
    # (torch's CPU flash kernel, which `native` may pick, turns a NaN query row into zeros: only checks see it)
    assert dispatch_attention_fn(q, k, v).shape == q.shape
    with attention_checks("raise"):
        message = fails(which, "1 NaN", "expected all finite", str((B, L, H, D)), args=(q, k, v))
    assert "attention backend 'native'" in message


def test_inf_input_raises_when_checks_are_on():
    q, k, v = qkv()
    q[0, 0, 0, 0] = float("inf")
    with attention_checks(True):
        fails("query", "0 NaN and 1 Inf", args=(q, k, v))


def test_mask_may_hold_inf_but_not_nan():
    q, k, v = qkv()
    mask = torch.zeros(L, L)
    mask[:, -1] = float("-inf")
    with attention_checks("raise"):
        out = dispatch_attention_fn(q, k, v, attn_mask=mask)
        assert torch.isfinite(out).all()
        mask[0, 0] = float("nan")
        fails("attn_mask", "1 NaN", args=(q, k, v), attn_mask=mask)


def test_warn_mode_logs_instead_of_raising(caplog):
    q, k, v = qkv()
    v[0, 0, 0, 0] = float("nan")
    with attention_checks("warn"):
        out = dispatch_attention_fn(q, k, v)
    assert torch.isnan(out).any()
    warned = [r.getMessage() for r in caplog.records if r.name == "attention_dispatch"]
    assert any(m.startswith("[attention-dispatch] value of attention backend 'native'") and "1 NaN" in m
               for m in warned), warned
    assert any(m.startswith("[attention-dispatch] output of attention backend 'native'") for m in warned), warned


def test_set_checks_turns_value_checks_on():
    q, k, v = qkv()
    v[1, 2, 1, 0] = float("nan")
    set_checks(True)
    fails("value", "NaN", args=(q, k, v))
