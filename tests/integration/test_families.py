"""Each way a model family's attention calls reach the pack, in real prompts of a real ComfyUI (CPU).

The WAN (B, L, H*D) with `heads=`, SD1.5 UNet (`heads` positional, `attn_precision=`, block sites) and text
encoder (Set CLIP Attention Backend) prompts are in test_comfyui.py. Here:
- Flux: ComfyUI's own Flux class, built in-process at a tiny size (the loader only detects hidden 3072): calls
  come as (B, H, L, D) with skip_reshape=True, non-contiguous views and `mask=` as a keyword, with and without
  Flux's attention-mask conditioning;
- the newer contract's keyword arguments (`scale=`, `enable_gqa=True`, `low_precision_attention=False`,
  `skip_output_reshape=True`), which ComfyUI 0.3.64's wrapper already hands to the override.

Each test checks which backend served how many calls, and the latent against ComfyUI's own attention (or an
exact SDPA reference where 0.3.64's own backends ignore the keyword arguments).
"""

from __future__ import annotations

import itertools

import pytest

from .test_comfyui import kind, latent, model_report, served

pytestmark = pytest.mark.integration
_prefix = itertools.count()
FLUX_CALLS_PER_STEP = 2  # 1 double block + 1 single block; cond and uncond run as one batch


def _cond(seed, dim, pooled, length=8):
    return {"class_type": "TestRandomConditioning", "inputs": {"seed": seed, "length": length, "dim": dim,
                                                                 "pooled_dim": pooled}}


def _close(a, b, rtol=1e-3):
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float((a - b).abs().max())
    assert err <= rtol * max(1.0, float(b.abs().max())), err
    return err


def sampled(model_node: dict, *, backend=None, policy="fallback", checks=None, cond: tuple, latent_node: dict,
            seed=5, steps=2, cfg=2.0, extra: dict | None = None):
    """model -> [Set Attention Backend "10"] -> [Attention Checks "13"] -> KSampler "11" -> SaveLatent "12"."""
    p = {"1": model_node, "2": cond[0], "3": cond[1], "4": latent_node, **(extra or {})}
    model = ["1", 0]
    if backend is not None:
        p["10"] = {"class_type": "SetAttentionBackend", "inputs": {"model": model, "backend": backend, "policy": policy,
                                                                   "start_percent": 0.0, "end_percent": 1.0}}
        model = ["10", 0]
    if checks is not None:
        p["13"] = {"class_type": "AttentionChecks", "inputs": {"model": model, **checks}}
        model = ["13", 0]
    p["11"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": steps, "cfg": cfg, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
    p["12"] = {"class_type": "SaveLatent", "inputs": {"samples": ["11", 0],
                                                      "filename_prefix": f"latents/fam{next(_prefix)}"}}
    return p


# -- Flux: (B, H, L, D), skip_reshape=True, mask= keyword ------------------------------------------------------

FLUX = {"class_type": "TestTinyFlux", "inputs": {"seed": 3}}
FLUX_LATENT = {"class_type": "EmptySD3LatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
FLUX_COND = (_cond(1, 64, 32), _cond(2, 64, 32))
MASK = {"20": {"class_type": "TestAttentionMask", "inputs": {"conditioning": ["21", 0], "image_tokens_h": 4,
                                                            "image_tokens_w": 4, "masked": 3}},
        "21": _cond(1, 64, 32)}


def flux(backend=None, *, masked=False, checks=None, seed=5):
    p = sampled(FLUX, backend=backend, checks=checks, cond=FLUX_COND, latent_node=FLUX_LATENT, seed=seed,
                extra=MASK if masked else None)
    if masked:  # the positive prompt goes through TestAttentionMask (node "20")
        p["11"]["inputs"]["positive"] = ["20", 0]
    return p


@pytest.fixture(scope="module")
def flux_default(comfy):
    """Flux with ComfyUI's own attention, unmasked and masked: (latent, latent)."""
    out = []
    for masked in (False, True):
        entry = comfy.run(flux("comfy default", masked=masked))
        report = model_report(comfy, entry, "10")
        assert set(served(report)) == {"comfy:attention_sub_quad"}, report
        out.append(latent(comfy, entry, "12"))
    return out


@pytest.mark.parametrize("backend", ["native", "flex"])
def test_flux_skip_reshape_calls_are_served_and_match_comfy_default(comfy, flux_default, backend):
    entry = comfy.run(flux(backend))
    report = model_report(comfy, entry, "10")
    assert served(report) == {backend: 2 * FLUX_CALLS_PER_STEP}, report  # 2 steps
    assert not any(row["fell_back"] for row in report["recorder"]["rows"]), report
    assert {kind(row["site"]) for row in report["recorder"]["rows"]} == {"self"}  # joint text+image attention
    _close(latent(comfy, entry, "12"), flux_default[0])


def test_flux_every_call_matches_exact_sdpa(comfy):
    # Attention Checks compares each sampled call's output (back in ComfyUI's (B, L, H*D) layout) with SDPA.
    entry = comfy.run(flux("flex", checks={"mode": "raise", "compare": True, "compare_every": 1}, seed=6))
    checks = [r for r in comfy.reports(entry["prompt_id"]) if r["kind"] == "checks"]
    assert checks and checks[-1]["compare"]["samples"] >= 2 * FLUX_CALLS_PER_STEP, checks
    assert checks[-1]["compare"]["max_rel_error"] < 1e-4, checks[-1]["compare"]
    assert served(model_report(comfy, entry, "10")) == {"flex": 2 * FLUX_CALLS_PER_STEP}


@pytest.mark.parametrize("backend", ["native", "flex"])
def test_flux_attention_mask_reaches_the_backend(comfy, flux_default, backend):
    unmasked, masked_reference = flux_default
    # The mask matters: hiding three text tokens changes ComfyUI's own result...
    assert float((masked_reference - unmasked).abs().max()) > 1e-3
    entry = comfy.run(flux(backend, masked=True))
    report = model_report(comfy, entry, "10")
    # ...and the backend honours it (the masked cond and the unmasked uncond run as two batches).
    assert set(served(report)) == {backend} and report["recorder"]["calls"] >= 2 * FLUX_CALLS_PER_STEP, report
    assert not any(row["fell_back"] for row in report["recorder"]["rows"]), report
    _close(latent(comfy, entry, "12"), masked_reference)


# -- The newer contract's keyword arguments ----------------------------------------------------------------------

KW_LATENT = {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}}
KW_COND = (_cond(1, 64, 32), _cond(2, 64, 32))
KW_CALLS_PER_STEP = 2  # self (scale=, enable_gqa=) + cross (low_precision_attention=False, skip_output_reshape)


def kwargs_dit(backend=None, *, reference=False, policy="fallback", seed=9):
    return sampled({"class_type": "TestKwargsDiT", "inputs": {"seed": 4, "reference": reference}}, backend=backend,
                   policy=policy, cond=KW_COND, latent_node=KW_LATENT, seed=seed)


@pytest.fixture(scope="module")
def kwargs_reference(comfy):
    """The same model with exact SDPA (scale, GQA) in place of ComfyUI's attention: no override involved."""
    return latent(comfy, comfy.run(kwargs_dit(reference=True)), "12")


@pytest.mark.parametrize("backend", ["native", "flex"])
def test_scale_and_gqa_keywords_are_honoured(comfy, kwargs_reference, backend):
    entry = comfy.run(kwargs_dit(backend))
    report = model_report(comfy, entry, "10")
    assert served(report) == {backend: 2 * KW_CALLS_PER_STEP}, report
    assert {kind(row["site"]) for row in report["recorder"]["rows"]} == {"self", "cross"}
    assert not any(row["fell_back"] for row in report["recorder"]["rows"]), report
    _close(latent(comfy, entry, "12"), kwargs_reference)


def test_low_precision_false_never_gets_a_quantised_backend(comfy, kwargs_reference):
    # Sage asked for: the cross-attention calls (low_precision_attention=False) get a non-quantised backend
    # of sage's chain, and the report says why; the self-attention calls fall back (no sageattention on a CPU).
    entry = comfy.run(kwargs_dit("sage"))
    rows = model_report(comfy, entry, "10")["recorder"]["rows"]
    cross = [row for row in rows if kind(row["site"]) == "cross"]
    assert cross and all(row["requested"] == "sage" and row["served"] != "sage" for row in cross), rows
    assert all(any("low_precision_attention=False" in reason for reason in row["reasons"]) for row in cross), cross
    assert sum(row["calls"] for row in cross) == 2 and sum(row["calls"] for row in rows) == 2 * KW_CALLS_PER_STEP
    assert not any(row["served"] == "sage" for row in rows), rows
    _close(latent(comfy, entry, "12"), kwargs_reference)
