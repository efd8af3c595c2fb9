"""Issue 42 in a real ComfyUI 0.3.64 (CPU): Set Attention Backend with auto_fast judges an approximate kernel by
what it does to the model's prediction before it serves the model.

The test-only node `TestSparseKernel` registers `test_sparse_mean` with the pack's dispatcher: an approximate CPU
kernel that returns four times the mean of the values (no scores at all). It declares a per-call bound of 10, so the
per-block verdicts on the model's own activations admit it on every block (about 3 off per call on a random-weight
model, whose attention is nearly uniform); what it does to the prediction is what the node's verdict sees. Whether
it is also the fastest kernel of a block does not matter: the trial runs it on every block its per-call verdict
admits (issue 42: when timing decided, the trial ran it on some blocks or none, and 2.3e-3 or 0.0 was "admitted").
With twice the mean (1.0 off per call) the prediction moved 4.3e-2 against the bound of 2e-2; four times is far
past it whatever the seed.
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
    """(B, H, L, D): every query gets four times the mean of the values."""
    return (4.0 * v.mean(dim=2, keepdim=True)).expand(*q.shape[:3], v.shape[-1]).contiguous()


def register():
    d = _dispatcher()
    if d is not None and NAME not in d.backend_names():
        d.register_backend(NAME, kernel, layout="BHSD", devices=("cpu",), approximate=True, error_bound=10.0,
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
        # The trial judges the approximate kernel on every block past the tuning budget (a signature's over all its
        # blocks); a budget that fits every block keeps the rest of the tuning (the exact kernels' timings) whole
        # too, so a loaded CPU runs the same prompt as an idle one.
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
    assert verdict["status"] == "refused" and verdict["rel_error"] > 5 * verdict["bound"], verdict
    # the trial ran it on every call of the judged forward (2 blocks x self and cross attention): all were judged
    assert verdict["served"] == verdict["calls"] == 4 and verdict["trials"] == 1, verdict
    assert verdict["sites"] == ["cross #0", "cross #1", "self #0", "self #1"], verdict
    assert any(n.startswith("sparse refused: prediction off by") and " over 4 of 4 calls > 2e-02" in n
               for n in report["notes"]), report["notes"]
    assert "sparse refused" in report["summary"]
    # it served the judged forward only; every later call went to exact kernels
    calls = served(report)
    assert calls.get(SPARSE, 0) == 4 and sum(calls.values()) == 16, calls
    # the reference prediction was kept: the run ends where auto_exact's does
    a, b = latent(comfy, entry, "12"), latent(comfy, exact, "12")
    assert float((a - b).abs().max()) <= 1e-3 * max(1.0, float(b.abs().max()))
    # a second prompt of the same model is not judged again: no sparse call at all
    again = model_report(comfy, comfy.run(sparse_wan("auto_fast", next(_seed))), "10")
    assert SPARSE not in served(again) and again["sparse_verdict"]["status"] == "refused"
