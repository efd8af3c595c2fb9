"""Side by side with diffusers' own dispatcher (PyPI diffusers==0.42.1), on the CPU: where diffusers is right we
match it (bit for bit on `native`), where it misreads or drops an argument we refuse with the fix (issue #15).
SDPA's and diffusers' conventions (issue #33): a 2-D (B, Lk) key-padding mask, a 3-D (H, Lq, Lk) mask, attn_mask
with is_causal, empty inputs and a 0-d tensor scale run as diffusers runs them, bit for bit on `native`; where
diffusers raises (its math backend on a mask with is_causal: SDPA's math kernel refuses both; from torch 2.14 its
`native` too) we give what its `native` gives on torch 2.13, the mask and the causal diagonal both."""

from __future__ import annotations

import functools

import pytest
import torch

from dispatcher import AttentionInputError, BackendNotSupportedError, dispatch_attention_fn, registry, support
from helpers import tensors

ad = pytest.importorskip("diffusers.models.attention_dispatch")

# Hub backends of ours that diffusers 0.42.1 has no entry for (README/doctor say so).
PACK_ONLY_HUB = {"aiter_sage_hub": "diffusers 0.42.1 has no AITER SageAttention backend; the pack loads "
                                   "kernels-community/aiter-sage-attention v1 `sageattn` on its own account"}


def ours_hub():
    return {name: registry.get(name).hub for name in registry.names()
            if registry.get(name).hub is not None and not registry.get(name).custom}


def test_every_hub_backend_points_where_diffusers_points():
    theirs = {member.value: config for member, config in ad._HUB_KERNELS_REGISTRY.items()}
    mine = ours_hub()
    for name, hub in mine.items():
        if name in PACK_ONLY_HUB:
            assert name not in theirs, f"diffusers now has {name}: take its repo, function and version"
            continue
        assert name in theirs, f"{name} is a Hub backend diffusers does not have: add it to PACK_ONLY_HUB, with why"
        config = theirs[name]
        assert (hub.repo_id, hub.function, hub.version, hub.revision) == (
            config.repo_id, config.function_attr, config.version, config.revision), name
    assert set(theirs) <= set(mine), f"diffusers Hub backends we lack: {sorted(set(theirs) - set(mine))}"


qkv = functools.partial(tensors.qkv, b=2, lq=24, lk=24, h=4, d=32)


def theirs(q, k, v, backend="native", **kwargs):
    return ad.dispatch_attention_fn(q, k, v, backend=ad.AttentionBackendName(backend), **kwargs)


def theirs_or_folded(q, k, v, **kwargs):
    """diffusers' `native` on the call. For attn_mask with is_causal=True it hands both to SDPA, which runs the pair
    up to torch 2.13 (mask and top-left diagonal) and refuses it from 2.14: there, the same call with the diagonal
    folded into the mask, the meaning the pack serves on every torch (docs/python.md)."""
    try:
        return theirs(q, k, v, **kwargs)
    except RuntimeError as refusal:
        if not (kwargs.get("is_causal") and kwargs.get("attn_mask") is not None):
            raise
        assert "attn_mask should not be set when is_causal=True" in str(refusal)
    mask = kwargs["attn_mask"]
    if mask.shape == (q.shape[0], k.shape[1]):  # (B, Lk): key padding, as diffusers' native reads it
        mask = mask[:, None, None, :]
    folded = tensors.causal_folded(mask, q.shape[1], k.shape[1])
    return theirs(q, k, v, **(kwargs | dict(attn_mask=folded, is_causal=False)))


def _gen(seed):
    return torch.Generator().manual_seed(seed)


CASES = {
    "plain": (dict(), dict()),
    "causal": (dict(lk=24), dict(is_causal=True)),
    "scale": (dict(), dict(scale=0.3)),
    "gqa": (dict(hk=2), dict(enable_gqa=True)),
    "value_head_dim": (dict(d=64, dv=32), dict()),
    "kv_batch_1": (dict(bk=1), dict()),
    "one_kv_head": (dict(hk=1), dict()),
    "bf16_float32_mask": (dict(dtype=torch.bfloat16), dict(attn_mask=torch.randn(2, 1, 24, 24, generator=_gen(1)) * 10)),
    "fp16_float32_mask": (dict(dtype=torch.float16), dict(attn_mask=torch.randn(1, 24, 24, generator=_gen(2)))),
    "lq_lk_mask": (dict(lq=16), dict(attn_mask=torch.randn(16, 24, generator=_gen(3)))),
    "bool_4d": (dict(), dict(attn_mask=torch.rand(2, 1, 24, 24, generator=_gen(4)) > 0.2)),
    "key_padding_4d": (dict(), dict(attn_mask=torch.ones(2, 1, 1, 24, dtype=torch.bool).index_fill_(3, torch.arange(20, 24), False))),
    # issue #33
    "key_padding_2d": (dict(), dict(attn_mask=torch.rand(2, 24, generator=_gen(5)) > 0.3)),
    "key_padding_2d_additive": (dict(lq=16), dict(attn_mask=torch.randn(2, 24, generator=_gen(6)) * 4)),
    "heads_3d_additive": (dict(), dict(attn_mask=torch.randn(4, 24, 24, generator=_gen(7)) * 3)),
    "heads_3d_bool_batch_is_heads": (dict(h=2), dict(attn_mask=torch.rand(2, 24, 24, generator=_gen(8)) > 0.3)),
    "mask_causal": (dict(), dict(attn_mask=torch.rand(2, 1, 24, 24, generator=_gen(9)) > 0.3, is_causal=True)),
    "additive_mask_causal_cross": (dict(lq=16, lk=40), dict(attn_mask=torch.randn(16, 40, generator=_gen(10)),
                                                            is_causal=True)),
    "key_padding_causal_gqa": (dict(hk=2), dict(attn_mask=torch.rand(2, 24, generator=_gen(11)) > 0.2,
                                                is_causal=True, enable_gqa=True)),
    "empty_queries": (dict(lq=0), dict()),
    "empty_keys": (dict(lk=0), dict()),
    "empty_batch": (dict(b=0), dict(is_causal=True)),
    "empty_keys_masked": (dict(lk=0), dict(attn_mask=torch.ones(2, 1, 24, 0, dtype=torch.bool))),
    "tensor_scale": (dict(), dict(scale=torch.tensor(0.3))),
    "tensor_scale_causal": (dict(), dict(scale=torch.tensor(0.2, dtype=torch.float64), is_causal=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_is_bit_identical_to_diffusers(case):
    shape, kwargs = CASES[case]
    q, k, v = qkv(**shape)
    expected = theirs_or_folded(q, k, v, **kwargs)
    got = dispatch_attention_fn(q, k, v, backend="native", policy="strict", **kwargs)
    assert torch.equal(got, expected), (got - expected).abs().max()


@pytest.mark.parametrize("case", ["plain", "causal", "gqa", "value_head_dim", "bf16_float32_mask", "bool_4d",
                                  "heads_3d_additive", "heads_3d_bool_batch_is_heads", "empty_queries", "empty_keys",
                                  "empty_batch", "tensor_scale"])
def test_math_matches_diffusers_native_math(case):
    shape, kwargs = CASES[case]
    q, k, v = qkv(**shape)
    expected = theirs(q, k, v, backend="_native_math", **kwargs)
    got = dispatch_attention_fn(q, k, v, backend="_native_math", policy="strict", **kwargs)
    tolerance = 2e-2 if q.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("case", ["mask_causal", "additive_mask_causal_cross", "key_padding_causal_gqa"])
def test_mask_with_causal_where_diffusers_math_raises_we_give_its_native_result(case):
    """diffusers' `_native_math` pins SDPA's math kernel, which refuses attn_mask with is_causal; SDPA itself runs
    such a call up to torch 2.13 (its CPU flash kernel), and so does our math backend on every torch, with
    diffusers' `native` result (from 2.14: on the mask with the diagonal folded in)."""
    shape, kwargs = CASES[case]
    q, k, v = qkv(**shape)
    with pytest.raises(RuntimeError, match="attn_mask should not be set when is_causal=True"):
        theirs(q, k, v, backend="_native_math", **kwargs)
    got = dispatch_attention_fn(q, k, v, backend="_native_math", policy="strict", **kwargs)
    torch.testing.assert_close(got, theirs_or_folded(q, k, v, **kwargs), atol=1e-5, rtol=1e-5)


def test_batch_by_key_mask_is_key_padding_and_the_ambiguous_one_is_refused():
    """diffusers' native reads a 2-D (B, Lk) mask as key padding, SDPA a 2-D mask as (Lq, Lk). Where only the key
    padding reading can run (B != Lq) we run it, bit for bit diffusers'; where both can and differ (B == Lq) we
    refuse, naming both reshapes; with either, the result is diffusers' (or SDPA's) bit for bit."""
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[0, 18:] = False
    q, k, v = qkv(b=2, lq=8, lk=24)  # B != Lq
    assert torch.equal(dispatch_attention_fn(q, k, v, attn_mask=mask, backend="native"),
                       theirs(q, k, v, attn_mask=mask))
    q, k, v = qkv(b=2, lq=2, lk=24)  # B == Lq: the ambiguous case
    expected = theirs(q, k, v, attn_mask=mask)
    with pytest.raises(AttentionInputError, match=r"ambiguous.*as SDPA reads a 2-D mask.*diffusers' native"):
        dispatch_attention_fn(q, k, v, attn_mask=mask, backend="native")
    assert torch.equal(dispatch_attention_fn(q, k, v, attn_mask=mask[:, None, None, :], backend="native"), expected)
    assert torch.equal(dispatch_attention_fn(q, k, v, attn_mask=mask[None, None], backend="native"),
                       theirs(q, k, v, attn_mask=mask[None, None]))


def test_flex_with_mask_and_causal_diffusers_drops_the_mask_we_skip_flex_with_the_reason():
    """diffusers' flex builds a causal BlockMask and drops attn_mask when both are given; flex here does not claim
    the pair (`mask_with_causal`): strict names why, fallback serves it with SDPA's result."""
    shape, kwargs = CASES["mask_causal"]
    q, k, v = qkv(**shape)
    sdpa_result = theirs_or_folded(q, k, v, **kwargs)
    causal_only = theirs(q, k, v, is_causal=True)
    torch.testing.assert_close(theirs(q, k, v, backend="flex", **kwargs), causal_only, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(causal_only, sdpa_result, atol=1e-3)
    with pytest.raises(BackendNotSupportedError, match="attn_mask with is_causal=True is not supported"):
        dispatch_attention_fn(q, k, v, backend="flex", policy="strict", **kwargs)
    assert torch.equal(dispatch_attention_fn(q, k, v, backend="flex", **kwargs), sdpa_result)


def test_attention_kwargs_diffusers_drops_are_refused_with_a_reason():
    """diffusers passes window_size to flash and drops it (silently, checks off) for native; we name the key
    and the backends that honour it."""
    q, k, v = qkv()
    theirs(q, k, v, attention_kwargs={"window_size": (4, 4)})  # runs, window dropped
    assert "window_size" in ad._AttentionBackendRegistry._supported_arg_names[ad.AttentionBackendName.FLASH]
    candidates = [(n, registry.get(n), registry.get(n).fn) for n in ("native", "_native_math")]
    with pytest.raises(support.AttentionKwargsError, match="'window_size' is honoured by"):
        support.candidates_for_attention_kwargs("native", "fallback", candidates, {"window_size": (4, 4)})
    for name, member in (("flash", ad.AttentionBackendName.FLASH), ("flash_hub", ad.AttentionBackendName.FLASH_HUB),
                         ("_flash_3_hub", ad.AttentionBackendName._FLASH_3_HUB)):
        assert "window_size" in ad._AttentionBackendRegistry._supported_arg_names[member]
        assert "window_size" in registry.get(name).attention_kwargs
