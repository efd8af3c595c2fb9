"""`auto_exact` against every exact kernel pinned, over SDXL's attention calls in a forward's order (issue #39): on
the H200 the per-signature mix ran 64.6 ms a step where `_native_flash` pinned ran 58.4 ms. With the step check
(dispatcher/auto/step.py) auto_exact must reach 0.99 of the best pinned kernel on the same calls.

The calls are SDXL's at 1024x1024 with cfg batch 2, per UNet forward, in order: 4 transformer blocks at 4096 tokens
(10 heads) and 20 at 1024 tokens (20 heads) on the input side, 10 in the middle, 30 at 1024 and 6 at 4096 on the
output side (70 blocks), each a self-attention and a text cross-attention (77 keys), head dim 64: 140 calls, as
ComfyUI 0.3.64's UNet makes them (bench/comfy_model_step.py --model sdxl times the whole model)."""

from __future__ import annotations

import statistics

import pytest
import torch

import dispatcher
from dispatcher import dispatch_attention_fn, model_scope
from dispatcher import auto
from dispatcher.auto import Tuner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def sdxl_forward_calls():
    """[(call site, q, k, v)] of one SDXL forward, (B, L, H, D)."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def t(length, heads):
        return torch.randn(2, length, heads, 64, device="cuda", dtype=torch.bfloat16, generator=gen)

    text = {10: t(77, 10), 20: t(77, 20)}
    big, small = (t(4096, 10), t(4096, 10), t(4096, 10)), (t(1024, 20), t(1024, 20), t(1024, 20))
    plan = [(4096, 10, 4), (1024, 20, 20), (1024, 20, 10), (1024, 20, 30), (4096, 10, 6)]  # (tokens, heads, blocks)
    calls, block = [], 0
    for tokens, heads, blocks in plan:
        qkv = big if tokens == 4096 else small
        for _ in range(blocks):
            calls.append((f"self #{block}", *qkv))
            calls.append((f"cross #{block}", qkv[0], text[heads], text[heads]))
            block += 1
    return calls


def forward_ms(calls, backend, rounds=1):
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(rounds):
        for site, q, k, v in calls:
            dispatch_attention_fn(q, k, v, backend=backend, call_site=site, policy="strict")
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / rounds


def test_auto_exact_is_within_one_percent_of_the_best_pinned_kernel_over_sdxls_calls(tmp_path):
    calls = sdxl_forward_calls()
    pinned = [n for n in dispatcher.registry.names()
              if dispatcher.get_backend_spec(n).exact and not dispatcher.get_backend_spec(n).quadratic_memory
              and not dispatcher.availability_reasons(n) and dispatcher.get_backend_spec(n).hub is None]
    with auto.using(Tuner(cache_path=tmp_path / "tune.json")), model_scope("sdxl-calls"):
        for _ in range(3):  # tune, then the step decision at the second forward's first call
            forward_ms(calls, "auto_exact")
        (decision,) = auto.default_tuner().steps()
        configs = ["auto_exact"] + pinned
        times = {c: [] for c in configs}
        for c in configs:
            forward_ms(calls, c)  # warm
        for _ in range(15):  # interleaved rounds of 5 forwards each
            for c in configs:
                times[c].append(forward_ms(calls, c, rounds=5))
    med = {c: statistics.median(t) for c, t in times.items()}
    best = min(med[c] for c in pinned)
    assert best / med["auto_exact"] >= 0.99, (decision.text(), med)
