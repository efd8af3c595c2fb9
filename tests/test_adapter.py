"""The ComfyUI override adapter against torch SDPA, with a fake ComfyUI `func` (no ComfyUI needed)."""

from __future__ import annotations

import copy
import functools
import importlib

import pytest
import torch
import torch.nn.functional as F

from helpers import tensors
from helpers.pack import CALLS, PACK, comfy_func, load_pack

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

adapter, dispatcher, compare_mod = load_pack()


def ref(q, k, v, heads, mask=None, skip_reshape=False, skip_output_reshape=False, scale=None):
    if not skip_reshape:
        b, lq, hd = q.shape
        d = hd // heads
        q, k, v = (t.unflatten(-1, (-1, d)).transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        while mask.ndim < 4:
            mask = mask.unsqueeze(0) if mask.ndim == 2 else mask.unsqueeze(1)
    out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale)
    return out if skip_output_reshape else out.transpose(1, 2).flatten(2)


def to_opts(**extra):
    return {"transformer_options": {"optimized_attention_override": None, **extra}, "_inside_attn_wrapper": True}


@pytest.fixture(autouse=True)
def _clear():
    CALLS.clear()


qkv = functools.partial(tensors.qkv, b=2, lq=16, lk=16, h=2, d=32, flat=True)  # ComfyUI's (B, L, H*D)


def rows(rec):
    return {(r["site"], r["requested"], r["served"]): r for r in rec.snapshot()["rows"]}


@pytest.mark.parametrize("backend", ["native", "flex", "auto"])
def test_flat_layout_heads_positional_and_keyword(backend):
    rec = dispatcher.Recorder()
    fn = adapter.make_override(backend, recorder=rec)
    q, k, v = qkv(lk=8)
    out_pos = fn(comfy_func, q, k, v, 2, **to_opts())
    out_kw = fn(comfy_func, q, k, v, heads=2, **to_opts())
    assert out_pos.shape == q.shape
    torch.testing.assert_close(out_pos, ref(q, k, v, 2), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(out_kw, out_pos)
    assert not CALLS  # ComfyUI's own backend was not used
    assert rec.total_calls == 2
    (site, requested, served), = rows(rec)
    assert site == "cross #0" and requested == backend  # each call here is a forward of its own: block 0
    if backend != "auto":
        assert served == backend


def test_skip_reshape_noncontiguous_and_output_reshape():
    rec = dispatcher.Recorder()
    fn = adapter.make_override("native", recorder=rec)
    base = torch.randn(3, 2, 16, 2, 32)  # Flux-like: permute -> (3, B, H, L, D), non-contiguous views
    q, k, v = base.permute(0, 1, 3, 2, 4).unbind(0)
    assert not v.is_contiguous()
    out = fn(comfy_func, q, k, v, 2, skip_reshape=True, **to_opts())
    assert out.shape == (2, 16, 64)
    torch.testing.assert_close(out, ref(q, k, v, 2, skip_reshape=True), atol=2e-5, rtol=1e-4)
    out4 = fn(comfy_func, q, k, v, 2, skip_reshape=True, skip_output_reshape=True, **to_opts())
    assert out4.shape == (2, 2, 16, 32)
    torch.testing.assert_close(out4, ref(q, k, v, 2, skip_reshape=True, skip_output_reshape=True), atol=2e-5, rtol=1e-4)
    flat_out4 = fn(comfy_func, *qkv(), 2, skip_output_reshape=True, **to_opts())
    assert flat_out4.shape == (2, 2, 16, 32)
    torch.testing.assert_close(flat_out4, ref(*qkv(), 2, skip_output_reshape=True), atol=2e-5, rtol=1e-4)
    assert rec.served_by("native") == 3


@pytest.mark.parametrize("shape", [(16, 8), (2, 16, 8), (1, 16, 8), (2, 1, 16, 8), (2, 2, 16, 8), (2, 1, 1, 8)])
@pytest.mark.parametrize("positional", [True, False])
def test_additive_masks_by_rank(shape, positional):
    q, k, v = qkv(lk=8)
    mask = torch.zeros(shape)
    mask[..., :3] = -torch.finfo(torch.float32).max
    fn = adapter.make_override("native", recorder=dispatcher.Recorder())
    out = fn(comfy_func, q, k, v, 2, mask, **to_opts()) if positional else fn(comfy_func, q, k, v, heads=2, mask=mask, **to_opts())
    torch.testing.assert_close(out, ref(q, k, v, 2, mask=mask), atol=2e-5, rtol=1e-4)
    assert not CALLS


def test_bool_mask():
    q, k, v = qkv(lk=8)
    mask = torch.ones(2, 16, 8, dtype=torch.bool)
    mask[..., 5:] = False
    fn = adapter.make_override("native", recorder=dispatcher.Recorder())
    torch.testing.assert_close(fn(comfy_func, q, k, v, 2, mask=mask, **to_opts()), ref(q, k, v, 2, mask=mask),
                               atol=2e-5, rtol=1e-4)


def test_integer_mask_goes_to_func_with_reason():
    rec = dispatcher.Recorder()
    q, k, v = qkv(lk=8)
    mask = torch.ones(2, 16, 8, dtype=torch.long)
    out = adapter.make_override("native", recorder=rec)(comfy_func, q, k, v, 2, mask, **to_opts())
    assert len(CALLS) == 1 and "transformer_options" in CALLS[0]  # func got ComfyUI's kwargs unchanged
    torch.testing.assert_close(out, ref(q, k, v, 2))
    row, = rec.snapshot()["rows"]
    assert row["served"] == "comfy:comfy_func" and "integer" not in row["reasons"][0] and "int64" in row["reasons"][0]


def test_comfy_default_always_calls_func():
    rec = dispatcher.Recorder()
    fn = adapter.make_override("comfy default", recorder=rec, previous=lambda *a, **kw: pytest.fail("not chained"))
    fn(comfy_func, *qkv(), 2, **to_opts())
    assert len(CALLS) == 1
    row, = rec.snapshot()["rows"]
    assert row["requested"] == row["served"] == "comfy:comfy_func" and not row["fell_back"]


def test_attn_precision_float32_upcasts_half():
    q, k, v = qkv(dtype=torch.bfloat16)
    fn = adapter.make_override("native", recorder=dispatcher.Recorder())
    out = fn(comfy_func, q, k, v, 2, attn_precision=torch.float32, **to_opts())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref(q, k, v, 2).to(torch.bfloat16), atol=1e-2, rtol=1e-2)


def test_newer_kwargs_scale_and_gqa():
    fn = adapter.make_override("native", recorder=dispatcher.Recorder())
    q, k, v = qkv()
    out = fn(comfy_func, q, k, v, 2, scale=0.05, **to_opts())
    torch.testing.assert_close(out, ref(q, k, v, 2, scale=0.05), atol=2e-5, rtol=1e-4)
    # GQA: 4 query heads, 2 key/value heads, flat layout
    q4 = torch.randn(1, 16, 4 * 16)
    k2, v2 = torch.randn(1, 16, 2 * 16), torch.randn(1, 16, 2 * 16)
    out = fn(comfy_func, q4, k2, v2, 4, enable_gqa=True, **to_opts())
    expect = F.scaled_dot_product_attention(q4.unflatten(-1, (4, 16)).transpose(1, 2), k2.unflatten(-1, (2, 16)).transpose(1, 2),
                                            v2.unflatten(-1, (2, 16)).transpose(1, 2), enable_gqa=True).transpose(1, 2).flatten(2)
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=1e-4)


def test_low_precision_false_swaps_quantised_backend():
    rec = dispatcher.Recorder()
    fn = adapter.make_override("sage", recorder=rec)  # sage is unavailable on CPU; the swap happens first
    q, k, v = qkv()
    out = fn(comfy_func, q, k, v, 2, low_precision_attention=False, **to_opts())
    torch.testing.assert_close(out, ref(q, k, v, 2), atol=2e-5, rtol=1e-4)
    row, = rec.snapshot()["rows"]
    assert row["requested"] == "sage" and get_family(row["served"]) != "sage"
    assert any("low_precision_attention=False" in r for r in row["reasons"])


def get_family(name):
    return dispatcher.get_backend_spec(name).family


def test_unavailable_backend_fallback_records_reason_and_strict_raises():
    rec = dispatcher.Recorder()
    q, k, v = qkv()
    out = adapter.make_override("flash", recorder=rec)(comfy_func, q, k, v, 2, **to_opts())
    torch.testing.assert_close(out, ref(q, k, v, 2), atol=2e-5, rtol=1e-4)
    row, = rec.snapshot()["rows"]
    assert row["requested"] == "flash" and row["served"] != "flash" and row["fell_back"] and row["reasons"]
    with pytest.raises(dispatcher.BackendNotSupportedError):
        adapter.make_override("flash", policy="strict")(comfy_func, q, k, v, 2, **to_opts())


def test_step_window_chains_previous_outside():
    seen = []

    def previous(func, *args, **kwargs):
        seen.append(kwargs["transformer_options"]["sigmas"])
        return func(*args, **kwargs)

    rec = dispatcher.Recorder()
    fn = adapter.make_override("flex", recorder=rec, window=(0.0, 0.5), previous=previous)
    schedule = torch.tensor([10.0, 5.0, 2.0, 1.0, 0.0])  # 4 steps: percents 0, .25, .5, .75
    for sigma in schedule[:-1]:
        fn(comfy_func, *qkv(), 2, **to_opts(sample_sigmas=schedule, sigmas=sigma.reshape(1)))
    assert len(seen) == 1 and float(seen[0]) == 1.0
    r = rows(rec)
    assert r[("self #0", "flex", "flex")]["calls"] == 3  # each call a forward of its own: block 0
    label = f"previous override: {__name__}.test_step_window_chains_previous_outside.<locals>.previous"
    assert "outside the step window" in r[("self #0", "flex", label)]["reasons"][0]
    # without a previous override, out-of-window calls go to ComfyUI's own func
    fn2 = adapter.make_override("flex", window=(0.6, 1.0))
    fn2(comfy_func, *qkv(), 2, **to_opts(sample_sigmas=schedule, sigmas=schedule[0:1]))
    assert len(CALLS) == 2  # once via previous, once directly


def test_sampling_percent():
    window = importlib.import_module(f"{PACK}.nodes.window")
    s = torch.tensor([10.0, 5.0, 2.0, 1.0, 0.0])
    assert window.sampling_percent({"sample_sigmas": s, "sigmas": torch.tensor([10.0, 10.0])}) == 0.0
    assert window.sampling_percent({"sample_sigmas": s, "sigmas": torch.tensor([1.0])}) == 0.75
    assert window.sampling_percent({"sample_sigmas": s, "sigmas": torch.tensor([3.5])}) == pytest.approx(0.375)
    assert window.sampling_percent({}) is None


def test_call_site_labels():
    blocks = importlib.import_module(f"{PACK}.nodes.blocks")
    assert blocks.block_id({"block": ("input", 1)}, None, None, False, compiling=False).text == "input.cross"
    assert blocks.block_id({"block_type": "double"}, None, None, True, compiling=False).text == "double.self"
    assert blocks.block_id(None, None, None, True, compiling=False).text == "self"


def test_containers_are_unwrapped():
    class Container:
        def __init__(self, t):
            self.t = t

        def take(self):
            t, self.t = self.t, None
            return t

    q, k, v = qkv()
    out = adapter.make_override("native")(comfy_func, Container(q), Container(k), Container(v), 2, **to_opts())
    torch.testing.assert_close(out, ref(q, k, v, 2), atol=2e-5, rtol=1e-4)


def test_checks_raise_on_nan_and_compare_reports_error():
    q, k, v = qkv()
    bad = q.clone()
    bad[0, 0, 0] = float("nan")
    fn = adapter.make_override("native", checks="raise")
    with pytest.raises(dispatcher.AttentionInputError):
        fn(comfy_func, bad, k, v, 2, **to_opts())
    cmp = compare_mod.Comparison(every=2)
    fn = adapter.make_override("flex", compare=cmp)
    for _ in range(4):
        fn(comfy_func, q, k, v, 2, **to_opts())
    snap = cmp.snapshot()
    assert snap["samples"] == 2 and snap["max_rel_error"] < 1e-4 and snap["worst_site"] == "self #0"


def test_closure_survives_deepcopy_like_model_patcher_clone():
    rec = dispatcher.Recorder()
    options = {"transformer_options": {"optimized_attention_override": adapter.make_override("native", recorder=rec)}}
    cloned = copy.deepcopy(options)
    fn = cloned["transformer_options"]["optimized_attention_override"]
    assert fn is options["transformer_options"]["optimized_attention_override"]
    fn(comfy_func, *qkv(), 2, **to_opts())
    assert rec.total_calls == 1
    assert fn.config.backend == "native"


def test_private_kwargs_never_reach_the_dispatcher(monkeypatch):
    """The override asks the dispatcher once per plan for a prepared call: ComfyUI's private keywords are in
    neither what fixes it nor what each call passes."""
    fixed, passed = {}, []
    real = adapter.PreparedAttention

    class Spy(real):
        __slots__ = ()

        def __init__(self, **kwargs):
            fixed.update(kwargs)
            super().__init__(**kwargs)

        def keyed(self, *args, **kwargs):
            passed.append((len(args), kwargs))
            return super().keyed(*args, **kwargs)

    monkeypatch.setattr(adapter, "PreparedAttention", Spy)
    override = adapter.make_override("native")
    for _ in range(2):
        override(comfy_func, *qkv(), 2, **to_opts())  # to_opts() has _inside_attn_wrapper
    assert fixed and "transformer_options" not in fixed and "_inside_attn_wrapper" not in fixed
    assert fixed["backend"] == "native" and fixed["call_site"] == "self #0"  # the block, as the forward's first
    assert passed == [(4, {}), (4, {})]  # the tensors and the mask, twice through the one prepared call


def test_auto_with_low_precision_off_never_picks_a_quantised_backend():
    """ComfyUI passes low_precision_attention=False where int8 attention produces NaNs (WAN I2V image
    cross-attention): `auto_fast` must then choose among exact backends only (as `auto_exact`), even when a
    quantised one is fastest."""
    from attention_dispatch_pack.dispatcher.backends.native import sdpa_attention
    from attention_dispatch_pack.dispatcher.registry import add, remove
    from attention_dispatch_pack.dispatcher.spec import FLOATS, BackendSpec, HeadDims

    add(BackendSpec(name="test_int8_like", family="sage", description="a quantised stand-in", fn=sdpa_attention, quantised=True,
                    layout="BHSD", devices=frozenset({"cpu"}), dtypes=FLOATS, head_dims=HeadDims(),
                    custom=True))
    try:
        q, k, v = qkv()
        exact, lowp = dispatcher.Recorder(), dispatcher.Recorder()
        with dispatcher.auto.using(dispatcher.auto.Tuner(cache_path=None, backends=("test_int8_like",))):
            out = adapter.make_override("auto_fast", recorder=lowp)(comfy_func, q, k, v, 2, **to_opts())
        torch.testing.assert_close(out, ref(q, k, v, 2), atol=2e-5, rtol=1e-4)
        assert {r["served"] for r in lowp.snapshot()["rows"]} == {"test_int8_like"}  # the only candidate
        out = adapter.make_override("auto_fast", recorder=exact)(comfy_func, q, k, v, 2,
                                                                  low_precision_attention=False, **to_opts())
        torch.testing.assert_close(out, ref(q, k, v, 2), atol=2e-5, rtol=1e-4)
        served = {r["served"] for r in exact.snapshot()["rows"]}
        assert served and "test_int8_like" not in served
    finally:
        remove("test_int8_like")


@pytest.mark.parametrize("backend", ["native", "_native_math", "flex", "auto"])
@pytest.mark.parametrize("made", ["contiguous", "slices of a fused qkv", "last dim strided", "batch of one key"])
@pytest.mark.parametrize("skip_output_reshape", [False, True])
def test_flat_inputs_of_any_strides_give_comfyuis_result(backend, made, skip_output_reshape):
    """(B, L, H*D) inputs as models make them: a (B, H, L, D) kernel gets them through one as_strided view
    (`_heads_first`), a (B, L, H, D) one through plain views; both must equal ComfyUI's own path."""
    b, lq, h, d = 2, 16, 2, 32
    gen = torch.Generator().manual_seed(3)
    if made == "slices of a fused qkv":
        q, k, v = torch.randn(b, lq, 3 * h * d, generator=gen).chunk(3, dim=-1)
    elif made == "last dim strided":
        q, k, v = (torch.randn(b, h * d, lq, generator=gen).transpose(1, 2) for _ in range(3))
    elif made == "batch of one key":
        q = torch.randn(b, lq, h * d, generator=gen)
        k, v = (torch.randn(1, lq, h * d, generator=gen).expand(b, -1, -1) for _ in range(2))
    else:
        q, k, v = (torch.randn(b, lq, h * d, generator=gen) for _ in range(3))
    fn = adapter.make_override(backend)
    for _ in range(2):  # the first call plans, the second takes the plan
        out = fn(comfy_func, q, k, v, h, skip_output_reshape=skip_output_reshape, **to_opts())
        torch.testing.assert_close(out, comfy_func(q, k, v, h, skip_output_reshape=skip_output_reshape),
                                   atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", ["native", "_native_math", "flex", "auto"])
@pytest.mark.parametrize("batch", [2, 3])  # B == H (read as (H, Lq, Lk) it would run, silently wrong); B != H
@pytest.mark.parametrize("skip_reshape", [False, True])
def test_comfyuis_three_d_mask_is_batch_by_query_by_key(backend, batch, skip_reshape):
    """ComfyUI's 3-D mask is (B, Lq, Lk); the library reads a 3-D mask as SDPA does, (H, Lq, Lk): the adapter
    converts it, and the result is ComfyUI's (each batch element its own mask)."""
    q, k, v = tensors.qkv(b=batch, lq=16, lk=8, h=2, d=32, flat=True)
    bias = torch.randn(batch, 16, 8, generator=torch.Generator().manual_seed(6)) * 3
    if skip_reshape:
        q, k, v = (t.unflatten(-1, (2, -1)).transpose(1, 2) for t in (q, k, v))
    fn = adapter.make_override(backend)
    for _ in range(2):  # plans, then takes the plan
        out = fn(comfy_func, q, k, v, 2, mask=bias, skip_reshape=skip_reshape, **to_opts())
        torch.testing.assert_close(out, ref(q, k, v, 2, mask=bias, skip_reshape=skip_reshape), atol=2e-5, rtol=1e-4)
    assert adapter.comfy_mask(bias).shape == (batch, 1, 16, 8)
    assert adapter.comfy_mask(bias[0]).shape == (1, 1, 16, 8)
