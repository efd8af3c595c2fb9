"""The override's config value (one frozen OverrideConfig, not 17 restated parameters) and its per-site lane:
a repeat call of a planned site reaches the kernel without re-deciding, and leaves the lane whenever anything the
lane was made for changes (shape, dtype, mask, scope, a guard check due, a forget)."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn.functional as F

from helpers import tensors
from helpers.pack import CALLS, comfy_func, load_pack

adapter, dispatcher, _ = load_pack()

qkv = functools.partial(tensors.qkv, b=2, lq=16, lk=16, h=2, d=32, flat=True)  # ComfyUI's (B, L, H*D)


@pytest.fixture(autouse=True)
def _clear():
    CALLS.clear()


def test_the_override_is_made_from_one_frozen_config_value():
    notes: dict = {}
    fn = adapter.make_override("native", "strict", window=[0.1, 0.9], trust=["b", "a", "a"], model="m",
                               guard="all", guard_every=3, blocks=(0, 4), block_notes=notes)
    config = fn.config
    assert isinstance(config, adapter.OverrideConfig)
    assert (config.backend, config.policy, config.window, config.trust, config.blocks) == \
        ("native", "strict", (0.1, 0.9), ("a", "b"), (0, 4))
    assert config.block_notes is notes  # shared with the node's report
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.backend = "flex"
    # a node rebuilds it from attention_dispatch: every field but the tally, the same values
    names = {f.name for f in dataclasses.fields(adapter.OverrideConfig)} - {"tally"}
    assert fn.attention_dispatch == {name: getattr(config, name) for name in names}
    rebuilt = adapter.make_override(**fn.attention_dispatch)
    assert dataclasses.astuple(rebuilt.config) == dataclasses.astuple(config)
    # the class takes the value itself, not restated fields
    direct = adapter.AttentionOverride(config)
    q, k, v = qkv()
    torch.testing.assert_close(direct(comfy_func, q, k, v, 2, transformer_options={}),
                               fn(comfy_func, q, k, v, 2, transformer_options={}))
