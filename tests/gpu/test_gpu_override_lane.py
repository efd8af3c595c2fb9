"""The override's lane on a GPU (tests/test_override_lane.py holds the same on the CPU): a repeat SDXL-sized call
through the override runs the decided kernel without the dispatcher's entry, key or lookup, bit for bit what the
full path gave, and a call of another dtype or with a mask goes the full way. Timing is bench/small_call.py's job
(`--before` against the commit before the lanes)."""

from __future__ import annotations

import pytest
import torch

from helpers.pack import comfy_func, load_pack
from helpers.python_steps import entered

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

adapter, dispatcher, _ = load_pack()


def test_a_repeat_sdxl_call_through_the_override_runs_its_lane():
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 1024, 20 * 64, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    rec = dispatcher.Recorder()
    fn = adapter.make_override("native", recorder=rec)
    call = (lambda: fn(comfy_func, q, k, v, 20, transformer_options={}))  # noqa: E731
    first = call()
    steps, out = entered(call)
    assert "run_lane" in steps and "dispatch_eager" not in steps and "shapes_key" not in steps, steps
    torch.testing.assert_close(out, first, rtol=0, atol=0)
    bare = torch.nn.functional.scaled_dot_product_attention(
        *(t.view(2, 1024, 20, 64).transpose(1, 2).float() for t in (q, k, v))).transpose(1, 2).flatten(2)
    torch.testing.assert_close(out.float(), bare, rtol=2e-2, atol=2e-2)
    assert rec.snapshot()["rows"][0]["calls"] == 2
    # another dtype, then a mask: each its own plan, the full way first
    for q2, k2, v2, mask in (((q.half(), k.half(), v.half(), None)),
                             (q, k, v, torch.zeros(1024, 1024, device="cuda", dtype=torch.bfloat16))):
        steps, out2 = entered(lambda: fn(comfy_func, q2, k2, v2, 20, mask=mask, transformer_options={}))
        assert "dispatch_eager" in steps and "run_lane" not in steps
        assert torch.isfinite(out2).all()
