"""Every backend that can run on this GPU against a float64 reference, on real model shapes.

GPU only (marker `gpu`, skipped without CUDA). Run on the lent H200:
    ATTN_GPU_RESULTS=out.json python -m pytest tests/gpu -m gpu
Each measured relative error is appended to the JSON file named by ATTN_GPU_RESULTS.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import dispatcher
from dispatcher.inputs import describe_call

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# (label, B, H, L, D): the shapes of ../shared/docs/gpu.md (SD1.5, SDXL, Flux and Wan 14B at 480p).
SHAPES = [("sd15_512", 2, 8, 4096, 40), ("sdxl_1024", 2, 10, 4096, 64), ("flux_1024", 1, 24, 4608, 128),
          ("wan14b_480p", 1, 40, 32760, 128)]
# Feature cases at a small shape: each backend that declares support must get them right.
FEATURES = ["additive_mask", "bool_key_padding", "causal", "gqa", "cross_attention"]
RESULTS: list[dict] = []


def reference(q, k, v, mask=None, causal=False, scale=None):
    """Exact attention in float64, one head and one query block at a time (BHSD)."""
    b, h, lq, d = q.shape
    hk = k.shape[1]
    scale = scale if scale is not None else 1 / math.sqrt(d)
    out = torch.empty(b, h, lq, v.shape[-1], dtype=torch.float64, device=q.device)
    for bi in range(b):
        for hi in range(h):
            kh, vh = k[bi, hi // (h // hk)].double(), v[bi, hi // (h // hk)].double()
            for start in range(0, lq, 4096):
                stop = min(lq, start + 4096)
                s = q[bi, hi, start:stop].double() @ kh.T * scale
                if causal:
                    rows = torch.arange(start, stop, device=q.device)[:, None]
                    s = s.masked_fill(rows < torch.arange(kh.shape[0], device=q.device)[None], float("-inf"))
                if mask is not None:
                    m = mask[bi if mask.shape[0] > 1 else 0, hi if mask.shape[1] > 1 else 0]
                    m = m[start:stop] if m.shape[0] > 1 else m
                    s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
                out[bi, hi, start:stop] = torch.softmax(s, dim=-1) @ vh
    return out


def rel_error(out, ref):
    return float((out.double() - ref).norm() / ref.norm())


def runnable_backends():
    return [s.name for s in dispatcher.list_backends() if s.available]


def _inputs(b, h, l, d, hk=None, lk=None, dtype=torch.bfloat16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, l, d, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(b, hk or h, lk or l, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(b, hk or h, lk or l, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v


def _record(**row):
    RESULTS.append(row)
    path = os.environ.get("ATTN_GPU_RESULTS")
    if path:
        with open(path, "w") as f:
            json.dump({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
                       "capability": list(torch.cuda.get_device_capability(0)),
                       "unavailable": {s.name: s.reasons for s in dispatcher.list_backends() if not s.available},
                       "results": RESULTS}, f, indent=1)


def _run_case(backend, case, q, k, v, **kwargs):
    inputs = describe_call(q, k, v, kwargs.get("attn_mask"), 0.0, kwargs.get("is_causal", False), None,
                           kwargs.get("enable_gqa", False), False, "BHSD")
    reasons = dispatcher.get_backend_spec(backend).not_supported_reasons(inputs)
    if reasons:
        _record(backend=backend, case=case, skipped=reasons)
        pytest.skip("; ".join(reasons))
    recorder = dispatcher.Recorder()
    with dispatcher.recording(recorder):
        out = dispatcher.dispatch_attention_fn(q, k, v, backend=backend, layout="BHSD", policy="strict", **kwargs)
    torch.cuda.synchronize()
    assert recorder.served_by(backend) == 1
    assert not torch.isnan(out).any(), f"{backend} returned NaN on {case}"
    ref = reference(q, k, v, kwargs.get("attn_mask"), kwargs.get("is_causal", False))
    err = rel_error(out, ref)
    bound = dispatcher.get_backend_spec(backend).error_bound
    _record(backend=backend, case=case, shape=list(q.shape), kv_shape=list(k.shape), dtype=str(q.dtype),
            rel_error=err, bound=bound)
    assert err <= bound, f"{backend} on {case}: relative error {err:.3e} > {bound}"


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("backend", runnable_backends())
def test_backend_on_model_shapes(backend, shape):
    label, b, h, l, d = shape
    if backend == "_native_math" and b * h * l * l * 2 > 16 * 2**30:
        _record(backend=backend, case=label, skipped=["the math kernel materialises the scores: over 16 GiB"])
        pytest.skip("math kernel would materialise > 16 GiB of scores")
    q, k, v = _inputs(b, h, l, d)
    _run_case(backend, label, q, k, v)


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("backend", runnable_backends())
def test_backend_features(backend, feature):
    b, h, l, d = 2, 8, 1024, 64
    kwargs = {}
    if feature == "gqa":
        q, k, v = _inputs(b, h, l, d, hk=2)
        kwargs["enable_gqa"] = True
    elif feature == "cross_attention":
        q, k, v = _inputs(b, h, l, d, lk=333)
    else:
        q, k, v = _inputs(b, h, l, d)
    if feature == "additive_mask":
        keep = torch.rand(b, 1, 1, l, device="cuda") > 0.3
        kwargs["attn_mask"] = torch.zeros(b, 1, 1, l, device="cuda", dtype=q.dtype).masked_fill(~keep, float("-inf"))
    elif feature == "bool_key_padding":
        kwargs["attn_mask"] = torch.arange(l, device="cuda")[None, None, None] < torch.tensor(
            [l, l // 2], device="cuda")[:, None, None, None]
    elif feature == "causal":
        kwargs["is_causal"] = True
    _run_case(backend, feature, q, k, v, **kwargs)
