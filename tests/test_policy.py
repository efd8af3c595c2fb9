"""Fallback and strict policies, run-time failures, output checks and custom backends."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.nn.functional as F

import dispatcher
from dispatcher import (AttentionInputError, BackendNotSupportedError, HeadDims, Recorder, attention_checks,
                        dispatch_attention_fn, fallback_order, fallback_policy, recording, register_backend,
                        register_mask_format, unregister_backend)
from dispatcher import masks as masks_module
from helpers import tensors

LOGGER = "attention_dispatch"
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


qkv = functools.partial(tensors.qkv, b=1, lq=6, lk=6, h=2, d=16)


def sdpa_bshd(q, k, v, attn_mask=None):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask)
    return out.transpose(1, 2)


def warnings_of(caplog):
    return [r for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


class Calls:
    """A custom backend that counts its calls and keeps what it was handed."""

    def __init__(self, behaviour="sdpa"):
        self.behaviour, self.count, self.masks, self.shapes = behaviour, 0, [], []

    def __call__(self, q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
        self.count += 1
        self.masks.append(attn_mask)
        self.shapes.append(tuple(q.shape))
        if self.behaviour == "raise":
            raise RuntimeError("kernel exploded")
        if self.behaviour == "nan":
            return torch.full_like(q, float("nan"))
        return sdpa_bshd(q, k, v, attn_mask)


# --- strict -----------------------------------------------------------------------------------------

@pytest.mark.skipif(torch.cuda.is_available(), reason="flash may be runnable on a GPU machine")
def test_strict_lists_the_reasons_of_an_unavailable_backend():
    with pytest.raises(BackendNotSupportedError) as err:
        dispatch_attention_fn(*qkv(), backend="flash", policy="strict")
    exc = err.value
    assert exc.requested == "flash" and exc.policy == "strict"
    assert [name for name, _ in exc.skipped] == ["flash"]
    text = str(exc)
    assert "'flash' is not supported because:" in text and "needs an NVIDIA CUDA GPU" in text
    assert "pip install" not in text  # installing flash-attn would not make it run on this CPU
    assert "policy='fallback'" in text


def test_strict_lists_every_per_call_reason():
    q, k, v = qkv(d=4)
    with pytest.raises(BackendNotSupportedError) as err:
        dispatch_attention_fn(q, k, v, backend="flex", policy="strict", dropout_p=0.5)
    (name, reasons), = err.value.skipped
    assert name == "flex" and len(reasons) == 2
    assert any("head dim 4" in r for r in reasons) and any("dropout_p > 0" in r for r in reasons)


def test_strict_from_the_context_and_the_process_default():
    q, k, v = qkv(d=4)
    with fallback_policy("strict"), pytest.raises(BackendNotSupportedError):
        dispatch_attention_fn(q, k, v, backend="flex")
    dispatcher.set_fallback_policy("strict")
    with pytest.raises(BackendNotSupportedError):
        dispatch_attention_fn(q, k, v, backend="flex")
    with pytest.raises(ValueError, match="valid policies"):
        dispatcher.set_fallback_policy("lenient")


# --- fallback ---------------------------------------------------------------------------------------

def test_fallback_runs_the_chain_and_records_the_reasons():
    q, k, v = qkv(d=4)  # flex needs head dim >= 8
    recorder = Recorder("model")
    with recording(recorder):
        out = dispatch_attention_fn(q, k, v, backend="flex", call_site="block.0")
    torch.testing.assert_close(out, sdpa_bshd(q, k, v))
    (row,) = recorder.snapshot()["rows"]
    assert row["site"] == "block.0" and row["requested"] == "flex" and row["served"] == "native"
    assert row["fell_back"] and any("flex: head dim 4 is not supported" in r for r in row["reasons"])
    assert "asked for flex" in recorder.summary()


def test_fallback_order_ends_with_sdpa_and_math():
    assert fallback_order("flash") == ["flash", "_native_flash", "native", "_native_math"]
    for name in dispatcher.BUILTIN_NAMES:
        order = fallback_order(name)
        assert order[0] == name and len(order) == len(set(order))
        assert {"native", "_native_math"} <= set(order)


@pytest.mark.skipif(torch.cuda.is_available(), reason="flash may be runnable on a GPU machine")
def test_unavailable_backend_falls_back_along_its_chain():
    recorder = Recorder()
    with recording(recorder):
        dispatch_attention_fn(*qkv(), backend="flash")
    (row,) = recorder.snapshot()["rows"]
    assert row["served"] == "_native_flash"  # flash's chain: _native_flash, native
    assert any("needs an NVIDIA CUDA GPU" in r for r in row["reasons"])
    assert not any("pip install" in r for r in row["reasons"])


def test_each_distinct_fallback_reason_is_logged_once(caplog):
    q, k, v = qkv(d=4)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        dispatch_attention_fn(q, k, v, backend="flex")
        dispatch_attention_fn(q, k, v, backend="flex")
        assert len(warnings_of(caplog)) == 1
        message = warnings_of(caplog)[0].getMessage()
        assert "'flex' fell back to 'native'" in message and "head dim 4" in message
        # Another reason is another warning.
        dispatch_attention_fn(*qkv(d=4, dtype=torch.float32, lq=3), backend="flex", dropout_p=0.0, scale=0.5)
        dispatch_attention_fn(*qkv(d=16), backend="flex", dropout_p=0.25)
        assert len(warnings_of(caplog)) == 2
        assert "dropout_p > 0" in warnings_of(caplog)[1].getMessage()


def test_no_warning_when_the_requested_backend_serves(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        dispatch_attention_fn(*qkv(), backend="flex")
    assert warnings_of(caplog) == []


# --- run-time failures of a custom backend ----------------------------------------------------------

def test_a_backend_that_raises_falls_back_and_is_demoted(caplog):
    boom = Calls("raise")
    register_backend("boom", boom, devices=("cpu",))
    q, k, v = qkv()
    recorder = Recorder()
    with caplog.at_level(logging.WARNING, logger=LOGGER), recording(recorder):
        out = dispatch_attention_fn(q, k, v, backend="boom")
        torch.testing.assert_close(out, dispatch_attention_fn(q, k, v, backend="native"))
        assert boom.count == 1
        dispatch_attention_fn(q, k, v, backend="boom")
        assert boom.count == 1  # demoted for this signature: not tried again
    assert any("'boom' failed" in r.getMessage() and "RuntimeError" in r.getMessage() for r in warnings_of(caplog))
    snap = recorder.snapshot()
    assert snap["errors"] and snap["errors"][0]["backend"] == "boom" and "kernel exploded" in snap["errors"][0]["error"]
    fell = [r for r in snap["rows"] if r["requested"] == "boom"]
    assert fell and fell[0]["served"] == "native" and fell[0]["calls"] == 2
    assert any("raised RuntimeError" in r for r in fell[0]["reasons"])
    # Another signature tries it again.
    dispatch_attention_fn(*qkv(lq=3), backend="boom")
    assert boom.count == 2


def test_a_backend_that_raises_propagates_under_strict():
    boom = Calls("raise")
    register_backend("boom", boom, devices=("cpu",))
    with pytest.raises(RuntimeError, match="kernel exploded"):
        dispatch_attention_fn(*qkv(), backend="boom", policy="strict")
    with pytest.raises(RuntimeError, match="kernel exploded"):  # strict never demotes
        dispatch_attention_fn(*qkv(), backend="boom", policy="strict")
    assert boom.count == 2


def test_nan_output_is_caught_when_checks_are_on():
    register_backend("nans", Calls("nan"), devices=("cpu",))
    q, k, v = qkv()
    # checks off and the quality guard off: nothing reads values (by default the guard checks a custom kernel's
    # outputs for NaN/Inf and recomputes: tests/test_guard.py)
    assert torch.isnan(dispatch_attention_fn(q, k, v, backend="nans", guard="off")).all()
    torch.testing.assert_close(dispatch_attention_fn(q, k, v, backend="nans"), sdpa_bshd(q, k, v))
    with attention_checks("raise"), pytest.raises(AttentionInputError) as err:
        dispatch_attention_fn(q, k, v, backend="nans", policy="strict", guard="off")
    assert "output" in str(err.value) and "NaN" in str(err.value) and "'nans'" in str(err.value)
    # fallback too: checks "raise" fail the call, the output is not handed to the next backend (tests/test_faults.py)
    with attention_checks("raise"), pytest.raises(AttentionInputError, match="output of attention backend 'nans'"):
        dispatch_attention_fn(q, k, v, backend="nans", guard="off")


def test_nan_output_is_logged_in_warn_mode(caplog):
    register_backend("nans", Calls("nan"), devices=("cpu",))
    with caplog.at_level(logging.WARNING, logger=LOGGER), attention_checks("warn"):
        out = dispatch_attention_fn(*qkv(), backend="nans", guard="off")
    assert torch.isnan(out).all()
    assert any("output" in r.getMessage() and "NaN" in r.getMessage() for r in warnings_of(caplog))


# --- declared constraints of a custom backend ------------------------------------------------------

def test_custom_backend_receives_a_4d_bool_mask():
    calls = Calls()
    register_backend("boolish", calls, devices=("cpu",), masks=("bool",), mask_format="bool")
    q, k, v = qkv(b=2, lq=5, lk=7)
    mask = torch.rand(5, 7) > 0.3
    mask[:, 0] = True
    recorder = Recorder()
    with recording(recorder):
        out = dispatch_attention_fn(q, k, v, attn_mask=mask, backend="boolish", policy="strict")
    assert recorder.served_by("boolish") == 1
    (given,) = calls.masks
    assert given.dtype == torch.bool and given.shape == (1, 1, 5, 7)
    assert calls.shapes == [(2, 5, 2, 16)]  # its declared layout, BSHD
    torch.testing.assert_close(out, sdpa_bshd(q, k, v, mask))


def test_custom_bool_backend_takes_a_key_padding_mask():
    """A key-padding mask is a bool mask: declaring masks=("bool",) is enough to take one."""
    calls = Calls()
    register_backend("boolish", calls, devices=("cpu",), masks=("bool",), mask_format="bool")
    q, k, v = qkv(b=2, lq=5, lk=7)
    padding = torch.ones(2, 7, dtype=torch.bool)  # (B, Lk), as diffusers reads a 2-D mask with B != Lq
    padding[1, 5:] = False
    out = dispatch_attention_fn(q, k, v, attn_mask=padding, backend="boolish", policy="strict")
    assert calls.masks[0].shape == (2, 1, 1, 7) and calls.masks[0].dtype == torch.bool
    torch.testing.assert_close(out, sdpa_bshd(q, k, v, padding[:, None, None, :]))


def test_custom_bool_backend_is_skipped_for_an_additive_mask():
    calls = Calls()
    register_backend("boolish", calls, devices=("cpu",), masks=("bool",), mask_format="bool")
    q, k, v = qkv()
    additive = torch.zeros(1, 1, 6, 6)
    recorder = Recorder()
    with recording(recorder):
        dispatch_attention_fn(q, k, v, attn_mask=additive, backend="boolish")
    assert calls.count == 0
    (row,) = recorder.snapshot()["rows"]
    assert row["served"] == "native"
    assert any("additive" in r and "bool mask" in r for r in row["reasons"]), row["reasons"]
    with pytest.raises(BackendNotSupportedError, match="additive"):
        dispatch_attention_fn(q, k, v, attn_mask=additive, backend="boolish", policy="strict")


def test_custom_backend_declared_limits_are_respected():
    calls = Calls()
    register_backend("tiny", calls, devices=("cpu",), dtypes=(torch.float16,), head_dims=HeadDims(8, 64, 8))
    recorder = Recorder()
    with recording(recorder):
        dispatch_attention_fn(*qkv(d=16), backend="tiny")  # float32: not declared
        dispatch_attention_fn(*qkv(d=12, dtype=torch.float16), backend="tiny")  # 12 is not a multiple of 8
        dispatch_attention_fn(*qkv(d=16, dtype=torch.float16), backend="tiny")
    assert calls.count == 1
    text = " ".join(reason for row in recorder.snapshot()["rows"] if row["fell_back"] for reason in row["reasons"])
    assert "dtype float32" in text and "head dim 12" in text
    assert recorder.served_by("tiny") == 1


def test_custom_bhsd_backend_gets_bhsd_views_and_lse_is_converted():
    seen = []

    def bhsd(q, k, v, *, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
        seen.append(tuple(q.shape))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)
        if return_lse:
            s = (q @ k.transpose(-2, -1)) * (scale if scale is not None else q.shape[-1] ** -0.5)
            return out, torch.logsumexp(s, dim=-1)  # (B, H, S)
        return out

    register_backend("bhsd", bhsd, layout="BHSD", devices=("cpu",), lse=True)
    q, k, v = qkv(b=1, lq=5, lk=9, h=3)
    out, lse = dispatch_attention_fn(q, k, v, backend="bhsd", policy="strict", return_lse=True)
    assert seen == [(1, 3, 5, 16)]
    assert out.shape == q.shape and lse.shape == (1, 5, 3)  # BSHD caller: (B, S, H)
    ref_out, ref_lse = dispatch_attention_fn(q, k, v, backend="_native_math", return_lse=True)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_register_mask_format():
    name = "scaled_bias_for_test"
    seen = []

    def to_scaled(mask, dtype):
        seen.append(tuple(mask.shape))
        return masks_module.to_additive(mask, dtype) * 1.0

    register_mask_format(name, to_scaled)
    try:
        assert name in masks_module.mask_formats()
        with pytest.raises(ValueError, match="already exists"):
            register_mask_format(name, to_scaled)
        calls = Calls()
        register_backend("fmt", calls, devices=("cpu",), masks=("bool", "additive"), mask_format=name)
        q, k, v = qkv()
        mask = torch.ones(6, 6, dtype=torch.bool).tril()
        out = dispatch_attention_fn(q, k, v, attn_mask=mask, backend="fmt", policy="strict")
        assert seen == [(1, 1, 6, 6)]
        assert calls.masks[0].dtype == torch.float32 and torch.isinf(calls.masks[0]).any()
        torch.testing.assert_close(out, sdpa_bshd(q, k, v, mask))
    finally:
        masks_module._FORMATS.pop(name, None)


def test_registration_rules():
    fn = Calls()
    for builtin in ("native", "flash", "sage_hub"):
        with pytest.raises(ValueError, match="built-in"):
            register_backend(builtin, fn)
        with pytest.raises(ValueError, match="only custom backends"):
            unregister_backend(builtin)
    with pytest.raises(ValueError, match="mask_format"):
        register_backend("bad_format", fn, mask_format="nope")
    with pytest.raises(TypeError, match="callable"):
        register_backend("not_callable", 42)
    with pytest.raises(ValueError, match="non-empty"):
        register_backend("", fn)
    register_backend("mine", fn, devices=("cpu",))
    with pytest.raises(ValueError, match="already registered"):
        register_backend("mine", fn)
    replacement = Calls()
    register_backend("mine", replacement, devices=("cpu",), replace=True)
    dispatch_attention_fn(*qkv(), backend="mine")
    assert fn.count == 0 and replacement.count == 1
    assert dispatcher.get_backend_spec("mine").custom and "mine" in dispatcher.backend_names()
    assert dispatcher.get_backend_spec("mine").constraints()["family"] == "custom"
    unregister_backend("mine")
    assert "mine" not in dispatcher.backend_names()
    with pytest.raises(dispatcher.UnknownBackendError):
        dispatch_attention_fn(*qkv(), backend="mine")


def test_recorder_keeps_every_distinct_reason_of_a_row():
    """Two signatures that fall back from the same backend for different reasons: the row shows both."""
    recorder = Recorder()
    recorder.record("site", "flex", "native", ("flex: head dim 4 is not supported",))
    recorder.record("site", "flex", "native", ("flex: head dim 4 is not supported",))
    recorder.record("site", "flex", "native", ("flex: dropout_p > 0 is not supported",))
    recorder.record("site", "flex", "flex")
    rows = {r["served"]: r for r in recorder.snapshot()["rows"]}
    assert rows["native"]["calls"] == 3 and rows["native"]["fell_back"]
    assert rows["native"]["reasons"] == ["flex: head dim 4 is not supported", "flex: dropout_p > 0 is not supported"]
    assert rows["flex"]["reasons"] == [] and not rows["flex"]["fell_back"]
    assert recorder.total_calls == 4 and recorder.served_by("native") == 3
    recorder.clear()
    assert recorder.total_calls == 0 and "no attention calls" in recorder.summary()
