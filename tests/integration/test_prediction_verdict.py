"""Issue 42 in a real ComfyUI 0.3.64 (CPU): Set Attention Backend with auto_fast judges an approximate kernel by
what it does to the model's prediction before it serves the model.

The test-only node `TestSparseKernel` registers `test_sparse_mean` with the pack's dispatcher: an approximate CPU
kernel that returns twice the mean of the values (no scores at all: faster than any exact kernel, so `auto_fast`
picks it wherever its verdicts admit it). It declares a per-call bound of 2.0, so the per-block verdicts on the
model's own activations admit it (about 1.0 off per call on a random-weight model, whose attention is nearly
uniform); what it does to the prediction is what the node's verdict sees.
"""

from __future__ import annotations

import itertools

import pytest

from .conftest import main_py, require_comfyui, serve_comfyui, write_test_node
from .test_autos_guard_blocks import wan
from .test_comfyui import latent, model_report, served

pytestmark = pytest.mark.integration
SPARSE = "test_sparse_mean"
_seed = itertools.count(4200)

SPARSE_NODE = r'''
NAME = "test_sparse_mean"


def kernel(q, k, v, *, attn_mask=None, scale=None, **_):
    """(B, H, L, D): every query gets twice the mean of the values."""
    return (2.0 * v.mean(dim=2, keepdim=True)).expand(*q.shape[:3], v.shape[-1]).contiguous()


def register():
    d = _dispatcher()
    if d is not None and NAME not in d.backend_names():
        d.register_backend(NAME, kernel, layout="BHSD", devices=("cpu",), approximate=True, error_bound=2.0,
                           fallback=("native",), description="test: approximate, fine by its own per-call bound")


class TestSparseKernel:
    @classmethod
    def INPUT_TYPES(cls):
        register()
        return {"required": {"model": ("MODEL",)}}
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "arm"
    CATEGORY = "testing"

    def arm(self, model):
        register()
        return (model,)


NODE_CLASS_MAPPINGS = {"TestSparseKernel": TestSparseKernel}
'''


@pytest.fixture(scope="module")
def comfy():
    require_comfyui()

    def command(base, port):
        write_test_node(base, "attn_dispatch_test_sparse", SPARSE_NODE)
        # A budget every block's verdict fits in: the tuning budget is a signature's over all its blocks, and a
        # loaded CPU can spend the default 0.5 s on block 0 alone, leaving the other blocks exact (what then serves,
        # and so what the prediction-level verdict judges, is one block of sparse attention, not the model's all).
        return ["env", "ATTN_DISPATCH_TUNE_BUDGET=20", *main_py(base, port)]

    def ready(server):
        return (server.get("/object_info/SetAttentionBackend") is not None
                and server.get("/object_info/TestSparseKernel") is not None)

    with serve_comfyui("attn-dispatch-issue42-", command, ready, start_timeout=600) as server:  # a loaded machine
        yield server


def sparse_wan(backend, seed):
    prompt = wan({"backend": backend}, steps=3, seed=seed)
    prompt["5"] = {"class_type": "TestSparseKernel", "inputs": {"model": ["1", 0]}}
    prompt["10"]["inputs"]["model"] = ["5", 0]
    return prompt


def test_auto_fast_refuses_an_approximate_kernel_that_moves_the_prediction(comfy):
    seed = next(_seed)
    exact = comfy.run(sparse_wan("auto_exact", seed))
    entry = comfy.run(sparse_wan("auto_fast", seed))
    report = model_report(comfy, entry, "10")
    verdict = report["sparse_verdict"]
    assert verdict["status"] == "refused" and verdict["rel_error"] > verdict["bound"], verdict
    assert any(n.startswith("sparse refused: prediction off by") for n in report["notes"]), report["notes"]
    assert "sparse refused" in report["summary"]
    # it served the judged forward's self-attention only; every later call went to exact kernels
    calls = served(report)
    assert 0 < calls.get(SPARSE, 0) < sum(calls.values()) // 3, calls
    # the reference prediction was kept: the run ends where auto_exact's does
    a, b = latent(comfy, entry, "12"), latent(comfy, exact, "12")
    assert float((a - b).abs().max()) <= 1e-3 * max(1.0, float(b.abs().max()))
    # a second prompt of the same model is not judged again: no sparse call at all
    again = model_report(comfy, comfy.run(sparse_wan("auto_fast", next(_seed))), "10")
    assert SPARSE not in served(again) and again["sparse_verdict"]["status"] == "refused"
