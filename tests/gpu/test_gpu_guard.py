"""The quality guard on a GPU: a check of a small call never makes the host wait for the GPU, and still repairs
the call it finds wrong; the verdict is read later. GPU only (marker `gpu`): run on the lent H200 with
    python -m pytest tests/gpu -m gpu
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dispatcher
from dispatcher import Recorder, dispatch_attention_fn, guard, recording

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def exact(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


def drifting(good_calls):
    calls = []

    def kernel(q, k, v, **_):
        calls.append(1)
        out = exact(q, k, v)
        return out if len(calls) <= good_calls else out + torch.randn_like(out)
    return kernel, calls


def sdxl_like():
    gen = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(2, 1024, 20, 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3)]


def test_a_passing_check_of_a_small_call_does_not_wait_for_the_gpu():
    kernel, _ = drifting(good_calls=10**9)
    name = dispatcher.register_backend("g_fine", kernel, devices=("cuda",), quantised=True).name
    q, k, v = sdxl_like()
    assert not guard.waits(dispatcher.AttentionCall(q, k, v))
    rec = Recorder()
    with recording(rec):
        dispatch_attention_fn(q, k, v, backend=name, guard_every=2)  # decides; checks call 1
        dispatch_attention_fn(q, k, v, backend=name, guard_every=2)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host-device sync in the checked call raises
        try:
            out = dispatch_attention_fn(q, k, v, backend=name, guard_every=2)  # call 3: checked
        finally:
            torch.cuda.set_sync_debug_mode("default")
    (g,) = rec.snapshot()["guard"]
    assert g["checks"] == 2 and not g["failures"] and g["max_error"] < 1e-2
    torch.testing.assert_close(out, exact(q, k, v))


def test_a_failing_check_of_a_small_call_repairs_it_on_the_device_and_demotes_when_read():
    kernel, calls = drifting(good_calls=1)
    name = dispatcher.register_backend("g_drift", kernel, devices=("cuda",), quantised=True).name
    q, k, v = sdxl_like()
    ref = exact(q, k, v)
    rec = Recorder()
    with recording(rec):
        outs = [dispatch_attention_fn(q, k, v, backend=name, guard_every=2) for _ in range(3)]  # checks 1 and 3
        (g,) = rec.snapshot()["guard"]  # reads the verdict still in flight
        after = dispatch_attention_fn(q, k, v, backend=name, guard_every=2)
    assert g["checks"] == 2 and g["failures"] and g["failures"][0]["replacement"]
    for out in (outs[0], outs[2], after):
        torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    assert len(calls) == 3  # demoted once the verdict was read


def test_a_large_call_waits_for_its_verdict_and_is_recomputed(monkeypatch):
    monkeypatch.setattr(guard, "WAIT_ABOVE_FLOPS", 0)
    kernel, calls = drifting(good_calls=0)
    name = dispatcher.register_backend("g_large", kernel, devices=("cuda",), quantised=True).name
    q, k, v = sdxl_like()
    rec = Recorder()
    with recording(rec):
        out = dispatch_attention_fn(q, k, v, backend=name)
        again = dispatch_attention_fn(q, k, v, backend=name)
    ref = exact(q, k, v)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(again, ref, atol=2e-2, rtol=2e-2)
    assert len(calls) == 1  # demoted on the first call itself
