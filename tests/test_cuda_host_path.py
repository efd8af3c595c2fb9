"""The host work of a repeat call, counted on the CPU (no GPU here): what a decided signature's call does besides
the kernel. The GPU branch of `native` (cuDNN tried first) is device-agnostic Python and runs on CPU tensors here;
tests/gpu/test_gpu_host_path.py counts the same on a GPU. The counting wrappers (helpers/host_calls.py) call through:
what runs is what runs without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from dispatcher import dispatch_attention_fn
from dispatcher.backends import native
from helpers.host_calls import count_host_calls

CUDNN_FIRST = native._backends_first(native.CUDA_PRIORITY, torch._C._get_sdp_priority_order())


@pytest.fixture
def sdpa_order():
    """Set SDPA's priority order for one test; the one found is put back."""
    found = torch._C._get_sdp_priority_order()
    yield torch._C._set_sdp_priority_order
    torch._C._set_sdp_priority_order(found)


def qkv(shape=(1, 24, 2, 16), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(*shape, generator=gen) for _ in range(3))


def test_a_repeat_call_decides_nothing_and_asks_torch_cuda_nothing(monkeypatch):
    q, k, v = qkv()
    first = dispatch_attention_fn(q, k, v)
    counts = count_host_calls(monkeypatch)
    for _ in range(5):
        out = dispatch_attention_fn(q, k, v)
        torch.testing.assert_close(out, first, rtol=0, atol=0)
    assert counts == {}  # no decision, no description, no torch.cuda query, no SDPA flag or order read or written
    bare = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    torch.testing.assert_close(out, bare, rtol=0, atol=0)
    # a new signature is decided once (the counting observes the first call, too)
    dispatch_attention_fn(q[:, :12], k[:, :12], v[:, :12])
    assert counts["first call"] == 1 and counts["decide"] == 1


@pytest.mark.parametrize("mask", [None, "bool"])
def test_the_gpu_branch_reads_the_order_once_and_writes_nothing_where_cudnn_is_first(monkeypatch, sdpa_order, mask):
    q, k, v = (t.transpose(1, 2) for t in qkv())
    attn_mask = None if mask is None else torch.rand(1, 1, 24, 24, generator=torch.Generator().manual_seed(1)) > 0.3
    sdpa_order(CUDNN_FIRST)
    counts = count_host_calls(monkeypatch)
    for calls in range(1, 4):
        out = native._sdpa_cuda(q, k, v, attn_mask, 0.0, False, None, False)
        assert counts == {"read order": calls}  # no context manager, no torch.cuda query, no write
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask), rtol=0, atol=0)


def test_the_gpu_branch_puts_cudnn_first_for_the_call_and_back(monkeypatch, sdpa_order):
    q, k, v = (t.transpose(1, 2) for t in qkv())
    default = [int(b) for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
                                SDPBackend.CUDNN_ATTENTION)]
    default += [p for p in torch._C._get_sdp_priority_order() if p not in default]
    sdpa_order(default)
    seen = []
    counts = count_host_calls(monkeypatch)
    native._sdpa_cuda(q, k, v, None, 0.0, False, None, False)  # warm the order cache
    monkeypatch.setattr(native, "_scaled_dot_product_attention",
                        lambda *a: seen.append(torch._C._get_sdp_priority_order()) or F.scaled_dot_product_attention(*a))
    counts.clear()
    out = native._sdpa_cuda(q, k, v, None, 0.0, False, None, False)
    assert seen == [CUDNN_FIRST] and torch._C._get_sdp_priority_order() == default
    assert counts == {"read order": 1, "write order": 2}  # SDPA's order for this call, then the caller's again
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), rtol=0, atol=0)


@pytest.mark.parametrize("gqa, scale, kv_batch", [(True, None, 1), (False, 0.3, 2), (False, None, 1)])
def test_the_gpu_branch_other_calls_compute_what_sdpa_does(sdpa_order, gqa, scale, kv_batch):
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 24, 16, generator=gen)
    heads_kv = 2 if gqa else 4
    k, v = (torch.randn(kv_batch, heads_kv, 24, 16, generator=gen) for _ in range(2))
    sdpa_order(CUDNN_FIRST)
    out = native._sdpa_cuda(q, k, v, None, 0.0, False, scale, gqa)
    want = F.scaled_dot_product_attention(q, k.expand(2, -1, -1, -1), v.expand(2, -1, -1, -1), scale=scale,
                                          enable_gqa=gqa)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_a_pin_writes_only_the_flags_that_differ_and_puts_back_only_those(monkeypatch):
    flags = [get for _, get, _ in native._FLAG_ACCESS]  # cuDNN, flash, efficient, math (and overrideable, newer torch)
    assert all(get() for get in flags)  # torch's default: every kernel enabled
    others = len(flags) - 1
    counts = count_host_calls(monkeypatch)
    inside = native._select(native.FLASH_ONLY, False, lambda: [get() for get in flags])
    assert inside == [member == SDPBackend.FLASH_ATTENTION for member, _, _ in native._FLAG_ACCESS]
    assert counts == {"read flag": len(flags), "write flag": 2 * others}  # the others off, then back on
    assert all(get() for get in flags)
    counts.clear()
    torch._C._set_sdp_use_math(False)
    try:
        native._select(native.FLASH_ONLY, False, lambda: None)
        # math is off already: neither written nor put back
        assert counts == {"read flag": len(flags), "write flag": 2 * (others - 1)}
        assert not torch._C._get_math_sdp_enabled() and torch._C._get_cudnn_sdp_enabled()
    finally:
        torch._C._set_sdp_use_math(True)


# ------------------------------------------------------------------------------- bench/small_call.py --breakdown

def _small_call():
    import sys
    from pathlib import Path
    bench = str(Path(__file__).resolve().parent.parent / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import small_call
    return small_call


def test_every_breakdown_layer_computes_the_bare_call_bit_for_bit():
    import dispatcher
    small_call = _small_call()
    q, k, v = qkv((2, 24, 3, 16))
    layers = small_call.breakdown_layers(dispatcher, q, k, v)
    assert set(layers) == set(small_call.BREAKDOWN)
    bare = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    for name, fn in layers.items():
        want = bare if name == "prepared" else bare.transpose(1, 2)  # the prepared call is (B, H, L, D) in and out
        torch.testing.assert_close(fn(), want, rtol=0, atol=0, msg=name)


def test_the_breakdown_attributes_each_layer_once():
    small_call = _small_call()
    host = {"bare": 10.0, "views": 14.0, "runner": 11.5, "run": 16.0, "eager": 18.0, "dispatcher": 18.5,
            "prepared": 17.0, "override": 20.0}
    steps = small_call.increments(host)
    assert steps == {"views (3 in, 1 out)": 4.0, "native runner (on a GPU: SDPA's priority order)": 1.5, "execute.run": 0.5,
                     "eager path (lookup, scope, fast lane)": 2.0, "entry (dispatch_attention_fn)": 0.5,
                     "prepared call on (B, H, L, D) views": 7.0, "override over its prepared call (4 views, plan)": 3.0}
    # bare + the dispatcher's steps = the dispatcher; bare + the override's two = the override
    assert host["bare"] + sum(list(steps.values())[:5]) == host["dispatcher"]
    assert host["bare"] + sum(list(steps.values())[5:]) == host["override"]


def test_the_order_options_set_what_they_name(sdpa_order):
    small_call = _small_call()
    small_call.set_order("cudnn")
    assert torch._C._get_sdp_priority_order() == CUDNN_FIRST
    small_call.set_order("sdpa")
    assert torch._C._get_sdp_priority_order()[:4] == [int(getattr(SDPBackend, m)) for m in small_call.ORDERS["sdpa"]]
    before = torch._C._get_sdp_priority_order()
    small_call.set_order("found")
    assert torch._C._get_sdp_priority_order() == before


def test_the_host_profile_names_sdpa():
    rows = _small_call().host_profile(lambda: F.scaled_dot_product_attention(*qkv()), calls=3)
    assert any("scaled_dot_product" in r["name"] for r in rows) and all(r["self_cpu_us_per_call"] >= 0 for r in rows)


def test_the_small_call_bench_runs_its_breakdown_on_the_cpu(tmp_path):
    """End to end, in its own process (it loads the pack under the name the adapter tests use, and sets SDPA's order)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    out = tmp_path / "small_call.json"
    env = {k: v for k, v in os.environ.items() if k != "COMFYUI_PATH"}  # ComfyUI's own column needs a ComfyUI
    run = subprocess.run([sys.executable, "bench/small_call.py", "--device", "cpu", "--shape", "1,2,8,16", "--rounds",
                          "2", "--calls", "3", "--breakdown", "--order", "cudnn", "--inference-mode", "--profile",
                          "--json", str(out)],
                         cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["inference_mode"] and result["order_set"] == "cudnn" and result["device"] == "cpu"
    assert result["sdpa_priority_order"] == CUDNN_FIRST
    layers = {"bare", "dispatcher", "override", "runner", "views", "run", "eager", "prepared", "override_model",
              "gpu_branch"}
    assert layers <= set(result["host_us"]) and all(v > 0 for v in result["host_us"].values())
    assert len(result["breakdown_us"]) == 8
    # the inventory of a repeat call: the dispatcher's own functions, the views and SDPA; nothing of torch.cuda's
    inventory = result["python_calls"]["dispatcher"]
    assert inventory["dispatch.py:dispatch_attention_fn"] == 1 and inventory["Tensor.permute"] == 4
    assert inventory["eager.py:dispatch_eager"] == 1 and "eager.py:_first_call" not in inventory
    assert not [name for name in inventory if "cuda" in name.lower() or "sdpa_kernel" in name or "contextmanager" in name]
    assert result["python_calls"]["bare"] == {"torch._C._nn.scaled_dot_product_attention": 1.0}
    assert {"bare", "dispatcher", "override"} == set(result["profile"])
