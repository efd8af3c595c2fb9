"""Context Parallel Attention: one sampling run's attention split over the ranks of a torchrun launch.

Every rank runs the same prompt on the same inputs (nodes/cp_runtime.py keeps them in lockstep), so the
split is of the attention work itself (dispatcher.parallel.replicated): 'heads' gives each rank a share
of the heads, 'sequence' a share of the query rows; an all-gather puts the output back together on
every rank. The backend stays with Set Attention Backend: this node opens the split around every model
call (an APPLY_MODEL wrapper), so every dispatcher call inside it, whichever override made it and in
whatever order the nodes are chained, runs split. With no override on the model it installs the
dispatcher's 'native' (PyTorch SDPA) one, since ComfyUI's own attention does not go through the
dispatcher. Calls that reach ComfyUI's attention anyway ('comfy default', outside a step window, another
pack's override) run whole on every rank: still exact, not faster; the report counts them.
"""

from __future__ import annotations

from comfy_api.latest import io

from ..dispatcher import log
from ..dispatcher.parallel import ContextParallelError, ReplicatedConfig, replicated_parallel
from . import comfy_versions, cp_runtime, reports
from . import validation as v
from .adapter import override_for
from .override_config import OverrideConfig
from .model_nodes import CATEGORY, OVERRIDE_KEY, WRAPPER_KEY

MODES = ["off", "heads", "sequence"]
DEFAULT_BACKEND = "native"


def default_mode() -> str:
    """'heads' in a ComfyUI started by torchrun with more than one rank, else 'off': a node dropped into an
    ordinary workflow must not get the prompt refused."""
    return "heads" if cp_runtime.launched() else "off"


def make_cp_override(config: ReplicatedConfig, inner, stats: dict):
    """An override that calls `inner` (the model's previous override) and counts the calls that were not
    split (those that never reached the dispatcher inside the split)."""
    def override(func, *args, **kwargs):
        before = config.calls
        out = inner(func, *args, **kwargs)
        stats["seen"] += 1
        if config.calls == before:
            stats["unsplit"] += 1
        return out

    override.attention_dispatch_cp = {"mode": config.mode, "degree": config.degree}
    return override


def _apply_model_wrapper(config: ReplicatedConfig):
    def wrapper(executor, *args, **kwargs):
        with replicated_parallel(config):
            return executor(*args, **kwargs)
    return wrapper


def _report_wrapper(config: ReplicatedConfig, stats: dict, node_id, info: dict):
    def wrapper(executor, *args, **kwargs):
        start = config.calls
        stats["seen"] = stats["unsplit"] = 0
        try:
            return executor(*args, **kwargs)
        finally:
            data = {**info, "rank": config.rank, "world_size": config.world_size, "split_calls": config.calls - start,
                    "override_calls": stats["seen"], "unsplit_calls": stats["unsplit"]}
            reports.publish("context_parallel", node_id, data)
    return wrapper


class ContextParallelAttention(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="ContextParallelAttention",
            display_name="Context Parallel Attention",
            category=CATEGORY,
            description="Split this model's attention over the GPUs of a context-parallel launch (ComfyUI started "
                        "by torchrun, one process per GPU). Exact: every GPU ends up with the same output. "
                        "Pick the backend with Set Attention Backend.",
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model whose attention is split (a clone is patched)."),
                io.Combo.Input("mode", options=MODES, default=default_mode(),
                               tooltip="heads: each GPU computes a share of the attention heads over the whole "
                                       "sequence; sequence: each GPU computes a share of the query tokens against "
                                       "all keys. Both are exact, with any backend; off: unchanged (the default "
                                       "when ComfyUI was not started by torchrun: the node then changes nothing "
                                       "and the prompt runs)."),
                io.Int.Input("degree", default=0, min=0, max=4096,
                             tooltip="How many ranks split each attention call: 0 = all ranks of the launch; "
                                     "otherwise a divisor of the number of ranks (torchrun's world size)."),
            ],
            outputs=[io.Model.Output(tooltip="A clone of the model whose attention runs split over the ranks.")],
            hidden=[io.Hidden.unique_id],
            not_idempotent=comfy_versions.NODE_ID_OUT_OF_CACHE_KEY,
        )

    @classmethod
    def check_inputs(cls, mode="off", degree=0):
        if mode not in MODES:
            return f"unknown mode {log.echo(mode)}; valid: {', '.join(MODES)}"
        if isinstance(degree, bool) or not isinstance(degree, int) or degree < 0:
            return f"degree must be an integer >= 0 (0 = all ranks); got {degree!r}"
        return cp_runtime.validation_message(mode, degree)

    @classmethod
    def validate_inputs(cls, mode="off", degree=0):
        return v.refuse(cls.check_inputs(mode=mode, degree=degree))  # raised: ComfyUI shows it once

    @classmethod
    def execute(cls, model, mode, degree) -> io.NodeOutput:
        if mode == "off":
            return io.NodeOutput(model)
        problem = cls.check_inputs(mode=mode, degree=degree)
        if problem is not True:
            raise ContextParallelError(problem)
        node_id = cls.hidden.unique_id
        config = ReplicatedConfig(mode=mode, degree=degree).setup()  # every rank runs this node: subgroups are safe
        m = model.clone()
        to = m.model_options.setdefault("transformer_options", {})
        previous = to.get(OVERRIDE_KEY)
        inner = previous if previous is not None else override_for(OverrideConfig(DEFAULT_BACKEND))
        stats = {"seen": 0, "unsplit": 0}
        to[OVERRIDE_KEY] = make_cp_override(config, inner, stats)
        import comfy.patcher_extension  # ComfyUI's own module, imported only when a node runs
        kinds = comfy.patcher_extension.WrappersMP
        m.add_wrapper_with_key(kinds.APPLY_MODEL, WRAPPER_KEY, _apply_model_wrapper(config))
        info = {"mode": mode, "degree": degree, "previous_override": previous is not None,
                "default_backend": None if previous is not None else DEFAULT_BACKEND}
        m.add_wrapper_with_key(kinds.OUTER_SAMPLE, WRAPPER_KEY, _report_wrapper(config, stats, node_id, info))
        return io.NodeOutput(m)


NODES = [ContextParallelAttention]
