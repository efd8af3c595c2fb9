"""The host work of a repeat call on a GPU, counted (tests/test_cuda_host_path.py counts the same on the CPU): a
decided signature's call through `native` asks torch.cuda nothing, enters no context manager, reads SDPA's priority
order once and writes it only where cuDNN is not first already. Timing is bench/small_call.py --breakdown's job."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dispatcher import dispatch_attention_fn
from dispatcher.backends import native
from helpers.host_calls import count_host_calls

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDNN_FIRST = native._backends_first(native.CUDA_PRIORITY, torch._C._get_sdp_priority_order())
SDPA_OWN = native._backends_first((SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH,
                                   SDPBackend.CUDNN_ATTENTION), torch._C._get_sdp_priority_order())


@pytest.fixture
def sdpa_order():
    found = torch._C._get_sdp_priority_order()
    yield torch._C._set_sdp_priority_order
    torch._C._set_sdp_priority_order(found)


@pytest.mark.parametrize("order, per_call", [(CUDNN_FIRST, {"read order": 1}),
                                             (SDPA_OWN, {"read order": 1, "write order": 2})])
def test_a_repeat_sdxl_call_asks_torch_cuda_nothing(monkeypatch, sdpa_order, order, per_call):
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 1024, 20 * 64, device="cuda", dtype=torch.bfloat16, generator=gen).view(2, 1024, 20, 64)
               for _ in range(3))
    sdpa_order(order)
    first = dispatch_attention_fn(q, k, v)
    counts = count_host_calls(monkeypatch)
    for _ in range(3):
        out = dispatch_attention_fn(q, k, v)
    assert counts == {name: 3 * n for name, n in per_call.items()}
    assert torch._C._get_sdp_priority_order() == order
    torch.testing.assert_close(out, first, rtol=0, atol=0)
    with sdpa_kernel(list(native.CUDA_PRIORITY), set_priority=True):  # what `native` asks of SDPA
        bare = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(out, bare, rtol=0, atol=0)


@pytest.mark.parametrize("backend, pinned", [("_native_cudnn", SDPBackend.CUDNN_ATTENTION),
                                             ("_native_flash", SDPBackend.FLASH_ATTENTION),
                                             ("_native_efficient", SDPBackend.EFFICIENT_ATTENTION)])
def test_a_pinned_kernel_repeat_call_writes_only_the_flags_that_differ(monkeypatch, backend, pinned):
    q, k, v = (torch.randn(2, 256, 8, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    first = dispatch_attention_fn(q, k, v, backend=backend, policy="strict")
    counts = count_host_calls(monkeypatch)
    out = dispatch_attention_fn(q, k, v, backend=backend, policy="strict")
    flags = len(native._FLAG_ACCESS)
    assert counts == {"read flag": flags, "write flag": 2 * (flags - 1)}  # every kernel enabled: the others off and on
    torch.testing.assert_close(out, first, rtol=0, atol=0)
    with sdpa_kernel(pinned):
        bare = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    torch.testing.assert_close(out, bare, rtol=0, atol=0)
