"""Node inputs inside a real ComfyUI, through its HTTP API: every input of every node is checked at queue time
(POST /prompt answers 400 with the reason), a prompt that cannot run is never reported as a success, Trust
Remote Kernels confirms only what applies, and chained nodes say which one took over."""

from __future__ import annotations

import json

import pytest

from .test_comfyui import _cond, model_report, served

pytestmark = pytest.mark.integration
SET = "SetAttentionBackend"


def sampled(chain, seed, extra=None):
    """UNETLoader -> the nodes of `chain` ((id, class, inputs), each fed the model of the one before)
    -> KSampler -> SaveLatent."""
    p = {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny_wan21.safetensors", "weight_dtype": "default"}},
         "2": _cond(1), "3": _cond(2),
         "4": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 64, "height": 64, "length": 1,
                                                                  "batch_size": 1}}}
    model = ["1", 0]
    for node_id, class_type, inputs in chain:
        p[node_id] = {"class_type": class_type, "inputs": {"model": model, **inputs}}
        model = [node_id, 0]
    p["90"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": 2, "cfg": 2.0, "sampler_name": "euler", "scheduler": "simple",
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
    p["91"] = {"class_type": "SaveLatent", "inputs": {"samples": ["90", 0], "filename_prefix": f"latents/ni{seed}"}}
    p.update(extra or {})
    return p


def set_inputs(**kw):
    return {"backend": "native", "policy": "fallback", "start_percent": 0.0, "end_percent": 1.0, **kw}


def checks_inputs(**kw):
    return {"mode": "warn", "compare": False, "compare_every": 10, **kw}


def refused(comfy, prompt, node_id):
    """POST /prompt must answer 400; the node's errors, as text."""
    status, body = comfy.post_prompt(prompt)
    assert status == 400, f"expected 400, got {status}: {body}"
    errors = json.dumps(body.get("node_errors", {}).get(node_id, {}))
    assert node_id in body.get("node_errors", {}), body
    assert "not supported between instances" not in json.dumps(body), body  # never a crash message
    return errors


def test_trust_is_not_an_output_node(comfy):
    info = comfy.get("/object_info/TrustRemoteKernels")["TrustRemoteKernels"]
    assert info["output_node"] is False
    description = comfy.get(f"/object_info/{SET}")[SET]["description"]
    assert "the one nearest the sampler wins" in description


@pytest.mark.parametrize("inputs, expected", [
    (set_inputs(backend="flash", policy="strict"), "cannot run on this machine (policy strict)"),
    (set_inputs(backend="flsh"), "unknown attention backend 'flsh'. Did you mean 'flash'?"),
    (set_inputs(start_percent=0.8, end_percent=0.2), "start_percent 0.8 is after end_percent 0.2"),
])
def test_failed_set_node_with_trust_wired_refuses_the_prompt(comfy, inputs, expected):
    """Trust -> Set (fails validation) -> KSampler: the prompt is refused (400), not run as a 'success' of the
    Trust node alone."""
    trust = {"30": {"class_type": "TrustRemoteKernels", "inputs": {"publishers": "kernels-community"}}}
    prompt = sampled([("31", SET, {**inputs, "trust": ["30", 0]})], seed=301, extra=trust)
    assert expected in refused(comfy, prompt, "31")


@pytest.mark.parametrize("chain, node_id, expected", [
    ([("40", "AttentionChecks", checks_inputs(mode="explode"))], "40", "mode: unknown checks mode 'explode'"),
    ([("40", "AttentionChecks", checks_inputs(compare_every=0))], "40", "compare_every: 0 is below the minimum 1"),
    # ComfyUI turns the text "no" into True before the node's check: the check reads what the client sent
    ([("40", "AttentionChecks", checks_inputs(compare="no"))], "40", "compare: expected true or false, got 'no'"),
    ([("40", SET, set_inputs(start_percent="abc"))], "40", "start_percent: 'abc' is not a number"),
    ([("40", SET, set_inputs(end_percent=None))], "40", "end_percent: no value (null)"),
    ([("40", SET, set_inputs(end_percent=1.5))], "40", "end_percent: 1.5 is above the maximum 1"),
    ([("40", SET, set_inputs(policy="Strict"))], "40", "policy: unknown policy 'Strict'. Did you mean 'strict'?"),
])
def test_every_input_is_checked_at_queue_time(comfy, chain, node_id, expected):
    assert expected in refused(comfy, sampled(chain, seed=302), node_id)


def test_clip_node_inputs_are_checked(comfy):
    prompt = {"1": {"class_type": "TestTinyClip", "inputs": {"seed": 5}},
              "2": {"class_type": "SetClipAttentionBackend", "inputs": {"clip": ["1", 0], "backend": "natve",
                                                                        "policy": "fallback"}},
              "3": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["2", 0], "text": "a cat"}},
              "4": {"class_type": "TestConditioningStats", "inputs": {"conditioning": ["3", 0]}}}
    assert "Did you mean 'native'?" in refused(comfy, prompt, "2")


@pytest.mark.parametrize("text, expected", [
    ("*", "wildcards are not supported"),
    ("kernels-community/flash-attn2", "trust is per publisher"),
    ("Kernels-Community", "write 'kernels-community'"),
    ("kernels-community\u0007", "control characters"),
    ("someone", "no backend here loads Hub kernels from 'someone'"),
])
def test_trust_refuses_what_would_not_apply(comfy, text, expected):
    trust = {"30": {"class_type": "TrustRemoteKernels", "inputs": {"publishers": text}}}
    prompt = sampled([("31", SET, set_inputs(trust=["30", 0]))], seed=303, extra=trust)
    assert expected in refused(comfy, prompt, "30")


def test_trust_says_a_default_publisher_changes_nothing(comfy):
    trust = {"30": {"class_type": "TrustRemoteKernels", "inputs": {"publishers": "kernels-community"}}}
    entry = comfy.run(sampled([("31", SET, set_inputs(trust=["30", 0]))], seed=304, extra=trust))
    text = entry["outputs"]["30"]["text"][0]
    assert text == "Already trusted by default (changes nothing): kernels-community", text
    assert "Trusted for the connected models" not in text


def test_chained_set_nodes_say_which_one_took_over(comfy):
    entry = comfy.run(sampled([("50", SET, set_inputs(backend="native")), ("51", SET, set_inputs(backend="flex"))],
                              seed=305))
    upstream, downstream = model_report(comfy, entry, "50"), model_report(comfy, entry, "51")
    assert upstream["recorder"]["calls"] == 0 and upstream["overridden_by"]["node"] == "51", upstream
    assert upstream["notes"][0].startswith("Overridden: Set Attention Backend #51 (flex) comes after this node")
    assert set(served(downstream)) == {"flex"} and downstream["replaces"]["node"] == "50", downstream


def test_checks_before_set_say_they_saw_no_calls(comfy):
    entry = comfy.run(sampled([("60", "AttentionChecks", checks_inputs(compare=True, compare_every=1)),
                               ("61", SET, set_inputs(backend="flex"))], seed=306))
    checks = [r for r in comfy.reports(entry["prompt_id"]) if r["kind"] == "checks" and r["node"] == "60"]
    assert checks, comfy.get("/attention_dispatch/report")
    report = checks[-1]
    assert report["no_calls"] is True and report["compare"]["samples"] == 0
    assert report["notes"][0].startswith("Saw no attention calls: Set Attention Backend #61 (flex)"), report


@pytest.mark.parametrize("inputs, expected", [
    ({"tau": 1.0, "dense_blocks": "0, first", "min_tokens": 0}, "dense_blocks: 'first' is not a block number"),
    ({"tau": 9.0, "dense_blocks": "", "min_tokens": 0}, "tau: 9 is above the maximum 4"),
    ({"tau": 1.0, "dense_blocks": "", "min_tokens": -5}, "min_tokens: -5 is below the minimum 0"),
])
def test_sparse_options_are_checked_at_queue_time(comfy, inputs, expected):
    sparse = {"30": {"class_type": "SparseAttentionOptions", "inputs": inputs}}
    prompt = sampled([("31", SET, set_inputs(backend="sol_attn", sparse=["30", 0]))], seed=307, extra=sparse)
    assert expected in refused(comfy, prompt, "30")


def test_sol_attn_on_a_cpu_says_why_and_applies_the_dense_rules(comfy):
    """On this CPU sol_attn cannot run: with min_tokens 0 its calls fall back along its chain with the reason; with
    min_tokens above every sequence they all run dense (ComfyUI's attention), each with its reason."""
    def report_for(min_tokens, seed):
        sparse = {"30": {"class_type": "SparseAttentionOptions",
                         "inputs": {"tau": 1.3, "dense_blocks": "", "min_tokens": min_tokens}}}
        entry = comfy.run(sampled([("31", SET, set_inputs(backend="sol_attn", sparse=["30", 0]))], seed=seed,
                                  extra=sparse))
        return model_report(comfy, entry, "31")

    report = report_for(0, 308)
    assert report["sparse"] == {"tau": 1.3, "min_tokens": 0, "dense_blocks": []}
    rows = report["recorder"]["rows"]
    assert rows and all(r["served"] in ("_native_flash", "native") for r in rows), rows
    assert all(any("needs an NVIDIA CUDA GPU" in reason for reason in r["reasons"]) for r in rows), rows
    rows = report_for(1 << 20, 309)["recorder"]["rows"]
    assert rows and all(r["served"].startswith("comfy:") for r in rows), rows
    assert all(any("< min_tokens 1048576: short sequences run faster dense" in reason for reason in r["reasons"])
               for r in rows), rows
    # the machine's reason first: sol_attn would not serve the longer calls here either (issue #41)
    assert all(any(reason.startswith("sol_attn cannot run on this machine (") and "needs an NVIDIA CUDA GPU" in reason
                   for reason in r["reasons"]) for r in rows), rows


def test_a_refusal_appears_once_in_the_error_response(comfy):
    """ComfyUI repeats a message validate_inputs returns once per input it names (the list of backends 8 times
    for a typo): the pack's refusal reaches the /prompt answer, and so the error dialog, once."""
    status, body = comfy.post_prompt(sampled([("31", SET, set_inputs(backend="flsh"))], seed=310))
    assert status == 400, body
    errors = body["node_errors"]["31"]["errors"]
    assert len(errors) == 1, errors
    (error,) = errors
    assert error["details"].startswith("backend: unknown attention backend 'flsh'. Did you mean 'flash'?"), error
    # what the frontend's dialog shows: the top-level error, then "message: details" per node error
    dialog = [body["error"]["details"]] + [f"{e['message']}: {e['details']}" for node in body["node_errors"].values()
                                           for e in node["errors"]]
    assert "\n".join(dialog).count("Did you mean 'flash'?") == 1, dialog
    assert error["extra_info"]["exception_type"] == "ValueError"  # no server path in the type's name


def test_checks_raise_fails_the_prompt_under_fallback_with_a_readable_error(comfy):
    """Attention Checks 'raise' after Set Attention Backend (policy fallback): a NaN in the attention inputs fails
    the prompt; the error's type names the library, not the server's path; the checks' report says what it saw."""
    prompt = sampled([("70", SET, set_inputs(backend="native")), ("71", "AttentionChecks", checks_inputs(mode="raise"))],
                     seed=311, extra={"5": {"class_type": "TestNaNConditioning", "inputs": {"conditioning": ["2", 0]}}})
    prompt["90"]["inputs"]["positive"] = ["5", 0]
    status, body = comfy.post_prompt(prompt)
    assert status == 200, body
    entry = comfy.wait(body["prompt_id"])
    assert entry["status"]["status_str"] == "error", entry["status"]
    (error,) = [m[1] for m in entry["status"]["messages"] if m[0] == "execution_error"]
    assert error["exception_type"] == "attention_dispatch.AttentionInputError", error["exception_type"]
    assert "NaN" in error["exception_message"] and "/" not in error["exception_type"], error
    checks = [r for r in comfy.reports(body["prompt_id"]) if r["kind"] == "checks" and r["node"] == "71"]
    assert checks and checks[-1]["checked"]["non_finite"] >= 1, checks
    assert checks[-1]["summary"].startswith("NaN/Inf found, the prompt failed (checks: raise)"), checks[-1]
