"""Side by side with diffusers' own dispatcher (PyPI diffusers==0.42.1), on the CPU: where diffusers is right we
match it (bit for bit on `native`), where it misreads or drops an argument we refuse with the fix (issue #15)."""

from __future__ import annotations

import functools

import pytest
import torch

from dispatcher import AttentionInputError, checks, dispatch_attention_fn, registry
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
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_native_is_bit_identical_to_diffusers(case):
    shape, kwargs = CASES[case]
    q, k, v = qkv(**shape)
    if kwargs.get("attn_mask") is not None and kwargs["attn_mask"].dim() == 3:
        kwargs = {**kwargs, "attn_mask": kwargs["attn_mask"][:, None]}  # 3-D: (B, Lq, Lk) here, (H, Lq, Lk) in SDPA
    expected = theirs(q, k, v, **kwargs)
    got = dispatch_attention_fn(q, k, v, backend="native", policy="strict", **kwargs)
    assert torch.equal(got, expected), (got - expected).abs().max()


@pytest.mark.parametrize("case", ["plain", "causal", "gqa", "value_head_dim", "bf16_float32_mask", "bool_4d"])
def test_math_matches_diffusers_native_math(case):
    shape, kwargs = CASES[case]
    q, k, v = qkv(**shape)
    expected = theirs(q, k, v, backend="_native_math", **kwargs)
    got = dispatch_attention_fn(q, k, v, backend="_native_math", policy="strict", **kwargs)
    tolerance = 2e-2 if q.dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_batch_by_key_mask_is_refused_with_the_reshape_diffusers_means():
    """diffusers' native reads a 2-D (B, Lk) mask as key padding; a 2-D mask is (Lq, Lk) here. Where the two
    differ we refuse, naming the reshape; with it, the result is diffusers' bit for bit."""
    q, k, v = qkv(b=2, lq=2, lk=24)  # B == Lq: the ambiguous case, silently different before
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[0, 18:] = False
    expected = theirs(q, k, v, attn_mask=mask)
    with pytest.raises(AttentionInputError, match=r"ambiguous"):
        dispatch_attention_fn(q, k, v, attn_mask=mask, backend="native")
    assert torch.equal(dispatch_attention_fn(q, k, v, attn_mask=mask[:, None, None, :], backend="native"), expected)
    q, k, v = qkv(b=2, lq=8, lk=24)  # B != Lq: diffusers runs key padding, we refuse with the fix
    expected = theirs(q, k, v, attn_mask=mask)
    with pytest.raises(AttentionInputError, match=r"attn_mask\[:, None, None, :\]"):
        dispatch_attention_fn(q, k, v, attn_mask=mask, backend="native")
    assert torch.equal(dispatch_attention_fn(q, k, v, attn_mask=mask[:, None, None, :], backend="native"), expected)


def test_attention_kwargs_diffusers_drops_are_refused_with_a_reason():
    """diffusers passes window_size to flash and drops it (silently, checks off) for native; we name the key
    and the backends that honour it."""
    q, k, v = qkv()
    theirs(q, k, v, attention_kwargs={"window_size": (4, 4)})  # runs, window dropped
    assert "window_size" in ad._AttentionBackendRegistry._supported_arg_names[ad.AttentionBackendName.FLASH]
    candidates = [(n, registry.get(n), registry.get(n).fn) for n in ("native", "_native_math")]
    with pytest.raises(checks.AttentionKwargsError, match="'window_size' is honoured by"):
        checks.candidates_for_attention_kwargs("native", "fallback", candidates, {"window_size": (4, 4)})
    for name, member in (("flash", ad.AttentionBackendName.FLASH), ("flash_hub", ad.AttentionBackendName.FLASH_HUB),
                         ("_flash_3_hub", ad.AttentionBackendName._FLASH_3_HUB)):
        assert "window_size" in ad._AttentionBackendRegistry._supported_arg_names[member]
        assert "window_size" in checks.semantics_of(registry.get(name)).attention_kwargs
