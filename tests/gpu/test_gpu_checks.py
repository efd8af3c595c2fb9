"""Argument checks that need a real second device (tests/test_checks.py has the rest, with meta standing in)."""

from __future__ import annotations

import pytest
import torch

from dispatcher import AttentionInputError, dispatch_attention_fn

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_device_mismatch_cuda():
    q = torch.randn(1, 6, 2, 16)
    with pytest.raises(AttentionInputError) as err:
        dispatch_attention_fn(q, q.cuda(), q)
    assert "key is on cuda" in str(err.value) and "query is on cpu" in str(err.value)
