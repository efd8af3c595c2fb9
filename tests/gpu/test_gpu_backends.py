"""Every backend that can run on this GPU against a float64 reference, on real model shapes.

GPU only (marker `gpu`, skipped without CUDA). Run on a GPU machine:
    ATTN_GPU_RESULTS=out.json python -m pytest tests/gpu -m gpu
Each measured relative error is appended to the JSON file named by ATTN_GPU_RESULTS.

A Hub backend whose kernel is neither in the local cache nor downloadable (the H200 has no network) is skipped with
"no network here: ..." (kernel_repos.load_or_skip_without_network); any other load failure fails its test. To run
the Hub backends there, bring a kernel cache along (`python install.py` on a machine with network, then copy its
HF cache and set HF_HUB_CACHE).

An approximate kernel (sol_attn) is judged only on activations with the locality it relies on (`local_inputs`): on
N(0,1) noise its error is recorded, never held to its bound (issue 31 measured 0.76 there).
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

import dispatcher
from dispatcher.inputs import describe_call
from helpers.kernel_repos import load_or_skip_without_network

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


def _run_case(backend, case, q, k, v, local=False, **kwargs):
    inputs = describe_call(q, k, v, kwargs.get("attn_mask"), 0.0, kwargs.get("is_causal", False), None,
                           kwargs.get("enable_gqa", False), False, "BHSD")
    reasons = dispatcher.get_backend_spec(backend).not_supported_reasons(inputs)
    if reasons:
        _record(backend=backend, case=case, skipped=reasons)
        pytest.skip("; ".join(reasons))
    spec = dispatcher.get_backend_spec(backend)
    try:
        load_or_skip_without_network(spec)
    except pytest.skip.Exception as skipped:
        _record(backend=backend, case=case, skipped=[skipped.msg])
        raise
    bound = None if spec.approximate and not local else spec.error_bound
    recorder = dispatcher.Recorder()
    with dispatcher.recording(recorder):
        # An approximate kernel on noise (no locality to route by: sol_attn 0.76 off) is measured, not judged: the
        # guard would rightly refuse it under policy strict (tests/test_kitchen_and_fa4.py pins that on the CPU).
        out = dispatcher.dispatch_attention_fn(q, k, v, backend=backend, layout="BHSD", policy="strict",
                                               guard="off" if bound is None else None, **kwargs)
    torch.cuda.synchronize()
    assert recorder.served_by(backend) == 1
    assert not torch.isnan(out).any(), f"{backend} returned NaN on {case}"
    ref = reference(q, k, v, kwargs.get("attn_mask"), kwargs.get("is_causal", False))
    err = rel_error(out, ref)
    _record(backend=backend, case=case, shape=list(q.shape), kv_shape=list(k.shape), dtype=str(q.dtype),
            rel_error=err, bound=bound, local=local)
    if bound is not None:
        assert err <= bound, f"{backend} on {case}: relative error {err:.3e} > {bound}"
    return err


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


# --- the new kernels of issue 31, each against exact attention within its declared bound -------------------------

def local_inputs(frames, height, width, heads=12, d=128):
    """Video-like activations with the locality block-sparse routing relies on (dispatcher.tools.bench's
    `local_video_qkv`, the bench's own), in (B, H, L, D)."""
    from dispatcher.tools.bench import local_video_qkv
    q, k, v = local_video_qkv(1, heads, frames, height, width, d, device="cuda")
    return tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))


def _available(name):
    reasons = dispatcher.availability_reasons(name)
    if reasons:
        pytest.skip(f"{name}: " + "; ".join(reasons))


@pytest.mark.parametrize("grid", [(21, 30, 52), (8, 32, 48)], ids=["wan_480p_32760", "video_12288"])
def test_sol_attn_within_its_bound_where_attention_is_local(grid):
    """sol_attn (tau 1.0) on video-like local activations: within its declared bound of exact attention."""
    _available("sol_attn")
    q, k, v = local_inputs(*grid)
    _run_case("sol_attn", f"local_{'x'.join(map(str, grid))}", q, k, v, local=True)


def test_sol_attn_error_grows_with_tau():
    """Higher tau routes fewer key blocks exactly: the error must not shrink as tau grows (the option reaches the
    kernel), and every tau stays finite."""
    _available("sol_attn")
    from dispatcher.backends.kitchen import sol_attn_options
    q, k, v = local_inputs(8, 32, 48)
    ref = reference(q, k, v)
    errors = {}
    for tau in (0.5, 1.0, 2.0, 3.0):
        with sol_attn_options(tau):
            out = dispatcher.dispatch_attention_fn(q, k, v, backend="sol_attn", layout="BHSD", policy="strict",
                                                   guard="off")
        assert torch.isfinite(out).all()
        errors[tau] = rel_error(out, ref)
    _record(backend="sol_attn", case="tau_sweep_local_8x32x48", errors=errors)
    assert errors[0.5] <= errors[3.0] * 1.05, errors


def test_sol_attn_options_declared_by_its_spec_reach_the_real_kernel():
    """The value a host builds from sol_attn's declared options (`BackendSpec.options`: what the Sparse Attention
    Options node makes and Set Attention Backend applies around each call) runs the kernel with its tau: the output
    of `sol_attn_options` at that tau, not the default tau's."""
    _available("sol_attn")
    from dispatcher.backends.kitchen import sol_attn_options
    declared = dispatcher.get_backend_spec("sol_attn").options
    options, problems = declared.build(tau=3.0, dense_blocks="", min_tokens=0)
    assert not problems and options.tau == 3.0
    q, k, v = local_inputs(8, 32, 48)

    def run():
        return dispatcher.dispatch_attention_fn(q, k, v, backend="sol_attn", layout="BHSD", policy="strict",
                                                guard="off")
    with options.applied():
        through_options = run()
    with sol_attn_options(3.0):
        direct = run()
    default = run()
    same, other = rel_error(through_options, direct.double()), rel_error(through_options, default.double())
    _record(backend="sol_attn", case="declared_options_tau3", errors={"vs_tau3": same, "vs_default": other})
    assert same <= 1e-3 and same * 10 <= other, (same, other)  # the tau reached the kernel, and only it


def test_comfy_kitchen_int8_masks_as_comfyui_passes_them():
    """ComfyUI hands int8_attention its masks as SDPA takes them: bool (True = attend) and additive (-inf = drop),
    broadcast over heads and queries, on text cross-attention (Lk 77, 512) and on keys past 1024, where the kernel
    packs a broadcast mask into its own tile layout first (comfy_kitchen's `_prepare_attn_mask`)."""
    _available("comfy_kitchen_int8")
    for lk in (77, 512, 4096):
        q, k, v = _inputs(2, 10, 4096, 64, lk=lk)
        keep = torch.arange(lk, device="cuda")[None, None, None] < torch.tensor([lk, lk // 3], device="cuda")[:, None,
                                                                                                                None, None]
        _run_case("comfy_kitchen_int8", f"bool_mask_lk{lk}", q, k, v, attn_mask=keep)
        bias = torch.zeros(2, 1, 1, lk, device="cuda", dtype=q.dtype).masked_fill(~keep, float("-inf"))
        _run_case("comfy_kitchen_int8", f"additive_mask_lk{lk}", q, k, v, attn_mask=bias)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_flash_4_head_dims_on_this_gpu(d):
    """FlashAttention-4 (exact) at the head dims it declares for this GPU generation, bf16 and fp16."""
    _available("flash_4")
    for dtype in (torch.bfloat16, torch.float16):
        q, k, v = _inputs(1, 8, 2048, d, dtype=dtype)
        _run_case("flash_4", f"d{d}_{str(dtype).replace('torch.', '')}", q, k, v)


def test_flash_4_returns_the_log_sum_exp():
    _available("flash_4")
    q, k, v = _inputs(1, 8, 1024, 128)
    out, lse = dispatcher.dispatch_attention_fn(q, k, v, backend="flash_4", layout="BHSD", policy="strict",
                                                return_lse=True)
    ref_lse = torch.logsumexp(q.double() @ k.double().transpose(-1, -2) / math.sqrt(128), dim=-1)
    assert lse.shape == (1, 8, 1024) and float((lse.double() - ref_lse).abs().max()) < 2e-2
