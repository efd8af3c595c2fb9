"""The bench's memory cap on a GPU (it has none on a CPU): a kernel that materialises the score matrix is skipped where
the scores would not fit, in `support.why_not`'s words (tests/test_same_words.py holds the tuner to the same)."""

from __future__ import annotations

import pytest
import torch

from dispatcher import support
from dispatcher.tools import bench

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_bench_skips_scores_over_its_cap_in_why_nots_words():
    device = torch.device("cuda")
    shape = bench.BenchShape("huge", "1x24x40960 d128", 1, 24, 40960, 128)  # float32 scores: 150 GiB
    rule = bench._memory_rule(device, torch.bfloat16)
    assert rule is not None and rule.memory_cap < 150 << 30
    result = bench.bench_shape(shape, dtype=torch.bfloat16, device=device, backends=["_native_math"], auto=False,
                               runs=1, warmup=0, log=lambda *a, **k: None)
    (row,) = result["rows"]
    said = support.why_not("_native_math", bench._inputs_of(shape, torch.bfloat16, device), rules=rule).rules
    assert said and said[0].startswith("it materialises the 150.0 GiB score matrix, over the memory cap of ")
    # the cap is read from the free memory when the row is made: the words up to it are why_not's
    assert row["error"].startswith("skipped: it materialises the 150.0 GiB score matrix, over the memory cap of ")
    assert row["ms"] is None and not row["valid"]
