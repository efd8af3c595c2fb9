"""The V3 nodes (ComfyUI only: imports comfy_api). Each clones its input and patches only the clone."""

from __future__ import annotations

from comfy_api.latest import io

from ..dispatcher import (Recorder, availability_reasons, backend_names, get_backend_spec, trusted_publishers)
from ..dispatcher import env as _env
from . import reports
from .adapter import AUTO, COMFY_DEFAULT, PASS_THROUGH, make_override
from .clip_patch import patch_clip
from .compare import Comparison

CATEGORY = "advanced/attention"
OVERRIDE_KEY = "optimized_attention_override"
WRAPPER_KEY = "attention_dispatch"
POLICIES = ["fallback", "strict"]
Trust = io.Custom("ATTN_TRUST")
# NODE_ID_IN_CACHE_KEY: each node's output carries its own Recorder labelled with its node id. ComfyUI
# 0.3.64 leaves the node id out of a V3 node's cache key even with hidden unique_id (it looks for the
# string in a tuple), so two identical nodes would share one output and one report; not_idempotent puts
# the node id in the key (outputs are still cached per node).


def backend_options() -> list[str]:
    return [AUTO, COMFY_DEFAULT] + backend_names()


def unavailable_message(backend: str, policy: str) -> str | bool:
    """queue-time check: True, or why this backend cannot be used here (with the install command)."""
    if backend in (AUTO, COMFY_DEFAULT):
        return True
    if backend not in backend_names():
        return f"unknown attention backend '{backend}'; valid: {', '.join(backend_options())}"
    if policy != "strict":
        return True  # fallback policy: runs the next backend in the chain, and the report says why
    spec = get_backend_spec(backend)
    # The TRUST input is a link, unknown at validation: judge Hub kernels as if their publisher were trusted
    # (DIFFUSERS_DISABLE_REMOTE_CODE still wins); the run itself applies the real trust list.
    publishers = [spec.hub.publisher] if spec.hub is not None else []
    with trusted_publishers(publishers):
        reasons = availability_reasons(backend)
    if not reasons:
        return True
    return (f"attention backend '{backend}' cannot run on this machine (policy strict): " + "; ".join(reasons)
            + ". Install what is missing, pick another backend, or use policy 'fallback'.")


def _run_wrapper(kind: str, node_id, recorder=None, compare=None, info=None):
    """WrappersMP.OUTER_SAMPLE: wraps one sampling run; resets the counters and publishes the report."""
    def wrapper(executor, *args, **kwargs):
        if recorder is not None:
            recorder.clear()
        if compare is not None:
            compare.clear()
        try:
            return executor(*args, **kwargs)
        finally:
            data = dict(info or {})
            if recorder is not None:
                data["recorder"] = recorder.snapshot()
                data["summary"] = recorder.summary()
            if compare is not None:
                data["compare"] = compare.snapshot()
            reports.publish(kind, node_id, data)
    return wrapper


def _add_outer_sample_wrapper(model, wrapper) -> None:
    import comfy.patcher_extension  # ComfyUI's own module, imported only when a node runs
    model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, wrapper)


class SetAttentionBackend(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SetAttentionBackend",
            display_name="Set Attention Backend",
            category=CATEGORY,
            description="Run this model's attention through the chosen backend (on a clone of the model).",
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model whose attention calls are redirected."),
                io.Combo.Input("backend", options=backend_options(), default=AUTO,
                               tooltip="Attention backend. 'auto' = best available for each call; 'comfy default' = "
                                       "ComfyUI's own attention. GET /attention_dispatch/backends says why each one "
                                       "can or cannot run here."),
                io.Combo.Input("policy", options=POLICIES, default="fallback",
                               tooltip="fallback: calls the backend cannot run go to the next backend in its chain "
                                       "(reported). strict: the prompt fails instead."),
                io.Float.Input("start_percent", default=0.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Use the backend from this point of the sampling run (0 = first step)."),
                io.Float.Input("end_percent", default=1.0, min=0.0, max=1.0, step=0.01,
                               tooltip="Use the backend up to this point (1 = last step); outside the window the "
                                       "previous override or ComfyUI's attention runs."),
                Trust.Input("trust", optional=True,
                            tooltip="From Trust Remote Kernels: publishers whose Hub kernels this model may load."),
            ],
            outputs=[io.Model.Output(tooltip="A clone of the model using the chosen attention backend.")],
            hidden=[io.Hidden.unique_id],
            not_idempotent=True,  # see NODE_ID_IN_CACHE_KEY
        )

    @classmethod
    def validate_inputs(cls, backend=AUTO, policy="fallback", start_percent=0.0, end_percent=1.0):
        if policy not in POLICIES:
            return f"unknown policy '{policy}'; valid: {', '.join(POLICIES)}"
        if not (0.0 <= start_percent <= end_percent <= 1.0):
            return f"need 0 <= start_percent <= end_percent <= 1; got {start_percent}..{end_percent}"
        return unavailable_message(backend, policy)

    @classmethod
    def execute(cls, model, backend, policy, start_percent, end_percent, trust=None) -> io.NodeOutput:
        node_id = cls.hidden.unique_id
        m = model.clone()
        to = m.model_options.setdefault("transformer_options", {})
        previous = to.get(OVERRIDE_KEY)
        recorder = Recorder(label=f"Set Attention Backend #{node_id}: {backend}")
        window = None if (start_percent <= 0.0 and end_percent >= 1.0) else (start_percent, end_percent)
        to[OVERRIDE_KEY] = make_override(backend, policy, recorder, window=window, trust=tuple(trust or ()),
                                         previous=previous)
        info = {"backend": backend, "policy": policy, "window": [start_percent, end_percent],
                "chained_previous": previous is not None}
        _add_outer_sample_wrapper(m, _run_wrapper("model", node_id, recorder, info=info))
        return io.NodeOutput(m)


class SetClipAttentionBackend(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SetClipAttentionBackend",
            display_name="Set CLIP Attention Backend",
            category=CATEGORY,
            description="Run the text encoder's attention through the chosen backend (on a clone of the CLIP).",
            inputs=[
                io.Clip.Input("clip", tooltip="The text encoder whose attention is redirected."),
                io.Combo.Input("backend", options=backend_options(), default=AUTO,
                               tooltip="Attention backend for the text encoder ('comfy default' = unchanged)."),
                io.Combo.Input("policy", options=POLICIES, default="fallback",
                               tooltip="fallback: unsupported calls run the next backend in the chain; strict: fail."),
            ],
            outputs=[io.Clip.Output(tooltip="A clone of the CLIP whose attention modules use the backend.")],
            hidden=[io.Hidden.unique_id],
            not_idempotent=True,  # see NODE_ID_IN_CACHE_KEY
        )

    @classmethod
    def validate_inputs(cls, backend=AUTO, policy="fallback"):
        if policy not in POLICIES:
            return f"unknown policy '{policy}'; valid: {', '.join(POLICIES)}"
        return unavailable_message(backend, policy)

    @classmethod
    def execute(cls, clip, backend, policy) -> io.NodeOutput:
        node_id = cls.hidden.unique_id
        c = clip.clone()
        recorder = Recorder(label=f"Set CLIP Attention Backend #{node_id}: {backend}")
        paths = patch_clip(c, make_override(backend, policy, recorder))
        c._attention_dispatch_recorder = recorder  # keeps the live recorder alive as long as the clone
        reports.track_live(f"clip:{node_id}", recorder)
        return io.NodeOutput(c, ui={"text": [f"{backend}: patched {len(paths)} text-encoder attention modules"]})


class AttentionChecks(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="AttentionChecks",
            display_name="Attention Checks",
            category=CATEGORY,
            description="Check this model's attention inputs/outputs for NaN/Inf, and optionally compare a sample of "
                        "calls against PyTorch SDPA (the report shows the largest relative error).",
            inputs=[
                io.Model.Input("model", tooltip="The model to check (place it after Set Attention Backend)."),
                io.Combo.Input("mode", options=["raise", "warn"], default="warn",
                               tooltip="raise: a NaN/Inf fails the prompt; warn: it is logged."),
                io.Boolean.Input("compare", default=False,
                                 tooltip="Also run PyTorch SDPA on a sample of calls and report the largest "
                                         "relative error (costs one extra attention call per sample)."),
                io.Int.Input("compare_every", default=10, min=1, max=100000,
                             tooltip="Compare one call in this many."),
            ],
            outputs=[io.Model.Output(tooltip="A clone of the model with checks on.")],
            hidden=[io.Hidden.unique_id],
            not_idempotent=True,  # see NODE_ID_IN_CACHE_KEY
        )

    @classmethod
    def execute(cls, model, mode, compare, compare_every) -> io.NodeOutput:
        node_id = cls.hidden.unique_id
        m = model.clone()
        to = m.model_options.setdefault("transformer_options", {})
        existing = to.get(OVERRIDE_KEY)
        cmp = Comparison(compare_every) if compare else None
        config = getattr(existing, "attention_dispatch", None)
        if config is not None:  # ours: the same backend, now with checks
            to[OVERRIDE_KEY] = make_override(**{**config, "checks": mode, "compare": cmp})
        else:  # none or another pack's: check around it
            to[OVERRIDE_KEY] = make_override(PASS_THROUGH, recorder=None, checks=mode, compare=cmp, previous=existing)
        _add_outer_sample_wrapper(m, _run_wrapper("checks", node_id, compare=cmp, info={"checks": mode}))
        return io.NodeOutput(m)


class TrustRemoteKernels(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="TrustRemoteKernels",
            display_name="Trust Remote Kernels",
            category=CATEGORY,
            description="Allow Hub kernels from these publishers for the models this feeds (only those).",
            inputs=[
                io.String.Input("publishers", multiline=True, default="",
                                tooltip="Hugging Face publishers (the part before '/' in a kernel repo id), one per "
                                        "line or comma-separated. Loading their kernels downloads and runs their code."),
            ],
            outputs=[Trust.Output(tooltip="Connect to Set Attention Backend's trust input.")],
            is_output_node=True,
        )

    @classmethod
    def execute(cls, publishers) -> io.NodeOutput:
        names = tuple(sorted({p.strip() for p in publishers.replace(",", "\n").splitlines() if p.strip()}))
        if _env.flag(_env.DISABLE_REMOTE_CODE):
            text = (f"{_env.DISABLE_REMOTE_CODE}=true wins: no Hub kernel will load in this ComfyUI, whatever this "
                    "node allows.")
        elif names:
            text = "Trusted for the connected models: " + ", ".join(names)
        else:
            text = "No publishers given: only the default trusted publishers apply."
        return io.NodeOutput(names, ui={"text": [text]})


NODES = [SetAttentionBackend, SetClipAttentionBackend, AttentionChecks, TrustRemoteKernels]
