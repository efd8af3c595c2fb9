"""The V3 nodes (ComfyUI only: imports comfy_api). Each clones its input and patches only the clone."""

from __future__ import annotations

import dataclasses

from comfy_api.latest import io

from ..dispatcher import (TRUSTED_PUBLISHERS, Recorder, auto, availability_reasons, backend_names, env,
                          get_backend_spec, guard, installing_helps, is_variant, trusted_publishers)
from . import blocks as _blocks
from . import comfy_versions, overrides, prediction_check, raw_prompt, reports
from . import validation as v
from .adapter import AUTO, AUTO_EXACT, AUTO_FAST, AUTOS, COMFY_DEFAULT, PASS_THROUGH, declared_options, override_for
from .clip_patch import patch_clip
from .check_tally import CheckTally
from .compare import Comparison
from .model_identity import model_key
from .override_config import OverrideConfig
from .window import window_text

CATEGORY = "advanced/attention"
OVERRIDE_KEY = "optimized_attention_override"
WRAPPER_KEY = "attention_dispatch"
POLICIES = ["fallback", "strict"]
Trust = io.Custom("ATTN_TRUST")
Sparse = io.Custom("ATTN_SPARSE")  # the options value SPARSE_BACKEND's spec declares (BackendSpec.options)
# The backend whose declared options (dispatcher/backend_options.py) the Sparse Attention Options node shows: the
# node's inputs, checks and value all come from that declaration, read through the registry.
SPARSE_BACKEND = "sol_attn"
CHECK_MODES = ["raise", "warn"]
# Which of our nodes patched a model, upstream first: model_options[CHAIN_KEY] (cloned with the model), read
# when a sampler runs to say which Set Attention Backend node took over (see _chain_notes).
CHAIN_KEY = "attention_dispatch_chain"
CHAIN_RULE = ("Chained Set Attention Backend nodes: the one nearest the sampler wins; an upstream one only "
              "serves the calls the downstream one passes on (outside its step window or block range).")
WINDOW_RULE = "the step window needs 0 <= start_percent <= end_percent <= 1"
# The quality guard's modes as the node shows them -> the dispatcher's (dispatcher.guard.GUARD_MODES).
GUARD_MODES = {"quantised kernels": "quantised", "every kernel": "all", "off": "off"}
DEFAULT_GUARD = "quantised kernels"
BLOCK_LIMIT = 10000
# Each node's output carries its own Recorder labelled with its node id: where ComfyUI leaves the node id out of
# a V3 node's cache key (comfy_versions.NODE_ID_OUT_OF_CACHE_KEY), not_idempotent puts it in.


def backend_options() -> list[str]:
    """The dropdown, in the order a user reads it: the two autos and ComfyUI's own attention, the backends that run
    on this machine (best first), then those that cannot, grouped by family (the family of the best first; the
    web extension heads each group with its reason). Private `_` names (a kernel variant an auto or a fallback
    chain picks) are not listed; they, and `auto` (= auto_exact, older workflows), are still accepted
    (`accepted_backends`)."""
    public = [name for name in backend_names() if not is_variant(name)]
    runs, cannot = [], {}
    for name in public:
        if availability_reasons(name):
            cannot.setdefault(get_backend_spec(name).family, []).append(name)
        else:
            runs.append(name)
    return [AUTO_EXACT, AUTO_FAST, COMFY_DEFAULT] + runs + [name for family in cannot.values() for name in family]


def accepted_backends() -> list[str]:
    """Valid values the dropdown does not list: `auto`, every private `_` backend (typed, or in a workflow) and
    ComfyUI's own attention names (nodes/comfy_versions.py: resolved or explained when queued)."""
    return [AUTO, *comfy_versions.COMFY_NAMES] + [name for name in backend_names() if is_variant(name)]


def unavailable_message(backend: str, policy: str) -> str | bool:
    """queue-time check: True, or why this backend cannot be used here (with the install command). ComfyUI's own
    attention names resolve here (nodes/comfy_versions.py), or say what they are."""
    explained = comfy_versions.not_offered(backend)
    if explained:
        return explained
    backend = comfy_versions.resolve(backend)
    if backend in AUTOS or backend == COMFY_DEFAULT:
        return True
    if not isinstance(backend, str) or backend not in backend_names():
        return v.check_value(_backend_field(""), backend) or f"unknown attention backend {backend!r}"
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
    fix = ("Install what is missing, pick another backend, or use policy 'fallback'." if installing_helps(backend)
           else "Pick another backend, or use policy 'fallback'.")
    return f"attention backend '{backend}' cannot run on this machine (policy strict): " + "; ".join(reasons) + ". " + fix


# ------------------------------------------------------------------------------------------------ inputs
# Every widget of every node is declared once as a validation.Field: the schema is built from it and the
# node's validate_inputs checks every value against it (ComfyUI 0.3.64 checks no V3 combo value).

def _backend_field(tooltip: str) -> v.Field:
    return v.Field("backend", "combo", options=backend_options, default=AUTO_EXACT, noun="attention backend",
                   tooltip=tooltip + COMFY_NAMES_TOOLTIP, accepted=accepted_backends)


def _policy_field(tooltip: str) -> v.Field:
    return v.Field("policy", "combo", options=POLICIES, default="fallback", noun="policy", tooltip=tooltip)


COMFY_NAMES_TOOLTIP = (" ComfyUI's own names are accepted where the pack runs the same kernel (pytorch = native, "
                       "sage3 = sage_blackwell_hub); sub_quad and split are ComfyUI's own attention: use 'comfy "
                       "default'.")
AUTOS_TOOLTIP = ("auto_exact (default): the fastest exact kernel for each call, judged on this model's own "
                 "activations; never a quantised kernel. auto_fast: also quantised kernels such as SageAttention "
                 f"whose error on this model's activations stays within {auto.FAST_BOUND:.0e}, and approximate ones "
                 "such as block-sparse sol_attn within their own bound, watched by the quality guard. ")
BLOCKS_TOOLTIP = ("Blocks outside block_start..block_end go where calls outside the step window go (an upstream Set "
                  "Attention Backend, else ComfyUI's attention). Needs a model that tells attention its block "
                  "position: newer ComfyUI's Flux, WAN, Chroma and Lumina, and the SD/SDXL UNet, do; ComfyUI "
                  "0.3.64's WAN and Flux do not, and the report then says the range cannot apply.")

SET_FIELDS = (
    _backend_field("Attention backend. " + AUTOS_TOOLTIP + "'comfy default' = ComfyUI's own attention. "
                   "GET /attention_dispatch/backends says why each one can or cannot run here."),
    _policy_field("fallback: calls the backend cannot run go to the next backend in its chain (reported). "
                  "strict: the prompt fails instead."),
    v.Field("start_percent", "float", default=0.0, min=0.0, max=1.0, step=0.01, rule=WINDOW_RULE,
            tooltip="Use the backend from this point of the sampling run (0 = first step)."),
    v.Field("end_percent", "float", default=1.0, min=0.0, max=1.0, step=0.01, rule=WINDOW_RULE,
            tooltip="Use the backend up to this point (1 = last step); outside the window the previous override "
                    "(an upstream Set Attention Backend) or ComfyUI's attention runs."),
    v.Field("block_start", "int", default=0, min=-BLOCK_LIMIT, max=BLOCK_LIMIT, rule=_blocks.RANGE_RULE,
            optional=True,
            tooltip="First transformer block that uses this backend (0 = the first; negative counts from the end, "
                    "-1 = the last). " + BLOCKS_TOOLTIP),
    v.Field("block_end", "int", default=-1, min=-BLOCK_LIMIT, max=BLOCK_LIMIT, rule=_blocks.RANGE_RULE,
            optional=True,
            tooltip="Last transformer block that uses this backend (-1 = the last block; negative counts from the "
                    "end). " + BLOCKS_TOOLTIP),
    v.Field("quality_guard", "combo", options=list(GUARD_MODES), default=DEFAULT_GUARD, noun="quality guard mode",
            optional=True,
            tooltip="While sampling, compare calls with exact attention on a few query rows: the first call of "
                    "every transformer block, then each block again in turn. 'quantised kernels': only quantised "
                    "kernels such as SageAttention (also those auto_fast picks), plus a NaN/Inf check on every output "
                    "of a custom kernel; 'every kernel': all of them (for a custom or new kernel); 'off': no checks. "
                    "On a failed check (NaN/Inf, or an error past the kernel's bound) that call is recomputed with "
                    "the fastest exact kernel, the kernel is demoted for that block of this model until ComfyUI "
                    "restarts, and this node's report and badge name the block."),
    v.Field("guard_every", "int", default=guard.DEFAULT_EVERY, min=0, max=100000, optional=True,
            tooltip="After its first call, each block is checked again once in this many of its calls (the blocks "
                    "take turns, so a few are checked each step). 0 (the default): sized on this machine from what "
                    "its first checks and the calls they check take, so the checks take at most 1% of the "
                    "attention time (a video model's long calls are checked every few steps, SDXL's short ones "
                    "far less often; the report says the interval and the times). On a failed check the call is "
                    "recomputed exactly, the kernel demoted for that block of this model, and this node's report "
                    "says so."),
)


def option_field(option) -> v.Field:
    """The widget of one option a backend declares (backend_options.Option)."""
    return v.Field(option.name, option.kind, default=option.default, min=option.minimum, max=option.maximum,
                   step=option.step, tooltip=option.tooltip)


SPARSE_OPTIONS = declared_options(SPARSE_BACKEND)
SPARSE_FIELDS = tuple(option_field(option) for option in SPARSE_OPTIONS.fields)
CLIP_FIELDS = (
    _backend_field("Attention backend for the text encoder. " + AUTOS_TOOLTIP + "'comfy default' = unchanged."),
    _policy_field("fallback: unsupported calls run the next backend in the chain; strict: fail."),
)
CHECKS_FIELDS = (
    v.Field("mode", "combo", options=CHECK_MODES, default="warn", noun="checks mode",
            tooltip="raise: a NaN/Inf in an attention input or output fails the prompt, under either policy of "
                    "Set Attention Backend; warn: it is logged and the output kept. The report says how many calls "
                    "were checked and what was found."),
    v.Field("compare", "bool", default=False,
            tooltip="Also run PyTorch SDPA on a sample of calls and report the largest relative error (costs one "
                    "extra attention call per sample)."),
    v.Field("compare_every", "int", default=10, min=1, max=100000, tooltip="Compare one call in this many."),
)
TRUST_FIELDS = (
    v.Field("publishers", "string", default="", multiline=True,
            tooltip="Hugging Face publishers (the part before '/' in a kernel repo id), one per line or "
                    "comma-separated, spelled exactly as on the Hub. Loading their kernels downloads and runs their "
                    "code. Only publishers of a backend's Hub kernel are accepted; kernels-community is trusted "
                    "without this node."),
)


def widget(field: v.Field):
    """The io input of one field. An optional one (added after the node was published) keeps older API prompts,
    which do not carry it, valid: execute's default applies."""
    common = {"default": field.default, "tooltip": field.tooltip, "optional": field.optional}
    if field.kind == "combo":
        return io.Combo.Input(field.name, options=field.choices(), **common)
    if field.kind == "float":
        return io.Float.Input(field.name, min=field.min, max=field.max, step=field.step, **common)
    if field.kind == "int":
        return io.Int.Input(field.name, min=field.min, max=field.max, **common)
    if field.kind == "bool":
        return io.Boolean.Input(field.name, **common)
    return io.String.Input(field.name, **common, **field.extra)


def _window_rule(good: dict) -> list[str]:
    start, end = good.get("start_percent"), good.get("end_percent")
    if start is not None and end is not None and start > end:
        return [f"start_percent {start:g} is after end_percent {end:g} ({WINDOW_RULE})"]
    return []


def _block_rule(good: dict) -> list[str]:
    start, end = good.get("block_start"), good.get("block_end")
    problem = None if start is None or end is None else _blocks.range_problem(start, end)
    return [problem] if problem else []


def _availability_rule(good: dict) -> list[str]:
    if "backend" not in good or "policy" not in good:
        return []  # a bad backend or policy is already named; strictness cannot be judged without both
    message = unavailable_message(good["backend"], good["policy"])
    return [] if message is True else [f"backend: {message}"]


def validate(fields, values: dict, *rules) -> bool | str:
    """Queue-time check of one node: every value against its field, then the node's cross-field rules."""
    problems, good = v.check(fields, values)
    for rule in rules:
        problems += rule(good)
    return v.answer(problems)


def comfy_validate(node, fields, values: dict) -> bool:
    """ComfyUI's `validate_inputs(**values)`: the node's `check_inputs` on its widget values, a refusal raised
    once (validation.refuse). A BOOLEAN value is judged as the client sent it (raw_prompt: ComfyUI has already
    made "no" True)."""
    values = v.only(fields, values)
    node_id = getattr(getattr(node, "hidden", None), "unique_id", None)
    for field in fields:
        if field.kind == "bool" and field.name in values:
            values[field.name] = raw_prompt.raw_value(node_id, field.name, values[field.name])
    return v.refuse(node.check_inputs(**values))


def hub_publishers() -> dict[str, list[str]]:
    """Publisher -> the backends whose Hub kernel it publishes (what a Trust Remote Kernels entry can change)."""
    out: dict[str, list[str]] = {}
    for name in backend_names():
        hub = get_backend_spec(name).hub
        if hub is not None:
            out.setdefault(hub.publisher, []).append(name)
    return out


def publisher_list(text) -> v.PublisherList:
    return v.PublisherList(text, hub_publishers(), TRUSTED_PUBLISHERS)


# ------------------------------------------------------------------------------------------------ reports

def _chain_of_run(executor):
    """Our nodes on the model this sampling run uses (the guider's model_options), upstream first; None when
    the executor does not say (not ComfyUI's WrapperExecutor)."""
    options = getattr(getattr(executor, "class_obj", None), "model_options", None)
    return tuple(options.get(CHAIN_KEY, ())) if isinstance(options, dict) else None


def _window_text(entry) -> str:
    start, end = entry.get("window") or (0.0, 1.0)
    return "" if (start <= 0.0 and end >= 1.0) else window_text(start, end)


def _scope_text(entry) -> str:
    """'step window 0.5..1', 'block range 2..-1', both joined by 'and', or '' (every call)."""
    parts = []
    window = _window_text(entry)
    if window:
        parts.append(f"step window {window}")
    start, end = entry.get("blocks") or _blocks.DEFAULT_RANGE
    if not _blocks.is_default(start, end):
        parts.append(f"block range {start}..{end}")
    return " and ".join(parts)


def _chain_notes(kind: str, node_id, chain) -> dict:
    """What a report must say when a Set Attention Backend node after this one (nearer the sampler) took over."""
    if not chain:
        return {}
    mine = [i for i, e in enumerate(chain) if e.get("node") == str(node_id) and e.get("kind") == kind]
    if not mine:
        return {}
    later = [e for e in chain[mine[-1] + 1:] if e.get("kind") == "model"]
    if not later:
        return {}
    winner = later[-1]
    scope = _scope_text(winner)
    who = f"Set Attention Backend #{winner['node']} ({winner.get('backend')})"
    if kind == "model":
        if scope:
            note = (f"{who} comes after this node and wins inside its {scope}; this node's backend "
                    "serves only the calls outside it. " + CHAIN_RULE)
        else:
            note = f"Overridden: {who} comes after this node and this node's backend serves no calls. " + CHAIN_RULE
        return {"overridden_by": winner, "notes": [note]}
    if scope:
        note = (f"{who} comes after these checks and runs its own attention inside its {scope}: they "
                "saw only the calls outside it. Put Attention Checks after Set Attention Backend.")
        return {"replaced_by": winner, "notes": [note]}
    note = (f"Saw no attention calls: {who} comes after these checks and replaced the attention they wrap. "
            "Put Attention Checks after Set Attention Backend.")
    return {"replaced_by": winner, "no_calls": True, "notes": [note]}


def _installed_override(executor):
    """The override on the model this sampling run uses (None when the executor does not say)."""
    options = getattr(getattr(executor, "class_obj", None), "model_options", None)
    to = options.get("transformer_options") if isinstance(options, dict) else None
    return to.get(OVERRIDE_KEY) if isinstance(to, dict) else None


def _foreign_notes(own, top, calls: int) -> dict:
    """What the report says about overrides that are not this pack's, installed after this node (nearer the
    sampler): one that never passes calls on to it (it then serves none: 'overridden_by'), or one that gets each
    call first (Model Sparse Attention re-installs itself on top every step)."""
    if own is None or top is None or top is own:
        return {}
    try:
        order, known = overrides.chain(top)
    except overrides.OverrideChainError as error:
        return {"notes": [str(error)]}
    recorder = own.config.recorder if overrides.kind(own) == "ours" else None

    def mine(o):  # this node's override, or Attention Checks' rebuild of it (same recorder)
        return o is own or (recorder is not None and overrides.kind(o) == "ours" and o.config.recorder is recorder)

    above = []
    for o in order:
        if mine(o):
            break
        above.append(o)
    foreign = [o for o in above if overrides.kind(o) not in ("ours", "context_parallel")]
    if not foreign:
        return {}  # only this pack's nodes after this one: _chain_notes says who took over
    first = overrides.describe(foreign[0])
    if len(above) == len(order):  # not reached
        if known:
            last = overrides.describe(foreign[-1])
            return {"overridden_by": {"node": None, "label": last, "short": overrides.short_name(foreign[-1]),
                                      "backend": last},
                    "notes": [f"Overridden: {last} was installed after this node and does not pass attention calls on "
                              f"to it, so this node's backend served {calls} calls. ComfyUI has one override key and "
                              f"the last writer wins: put Set Attention Backend after {last} (nearer the sampler); it "
                              "then passes the calls it does not take to it."]}
        if not calls:
            return {"notes": [f"No attention call reached this node: {first} is installed after it and does not say "
                              "whether it passes calls on. Put Set Attention Backend after it (nearer the sampler)."]}
        return {}
    if overrides.kind(foreign[0]) == "core_sparse":
        return {"notes": [f"{first} gets each attention call before this node (it re-installs itself on top every "
                          "step): the calls it runs sparse never reach this node; the calls it keeps dense do."]}
    return {"notes": [f"{first} was installed after this node and gets each attention call first; this node serves "
                      "the calls it passes on."]}


def _precision_notes(notes: dict) -> dict:
    results = reports.full_precision_results(notes)
    if not results:
        return {}
    total = sum(r["calls"] for r in results)
    return {"full_precision": results,
            "notes": [f"Kept exact: {total} calls with low_precision_attention=False (the model asks for full "
                      "precision there; quantised kernels can give NaN): " + "; ".join(r["text"] for r in results)]}


def _run_wrapper(kind: str, node_id, recorder=None, compare=None, info=None, block_notes=None, override=None,
                 precision_notes=None, tally=None):
    """WrappersMP.OUTER_SAMPLE: wraps one sampling run; resets the counters and publishes the report."""
    def wrapper(executor, *args, **kwargs):
        for counters in (recorder, compare, block_notes, precision_notes, tally):
            if counters is not None:
                counters.clear()
        try:
            return executor(*args, **kwargs)
        finally:
            auto.log_summary()  # the blocks `auto` decided like the ones it logged: counted, said once per run
            data = dict(info or {})
            data["notes"] = list(data.get("notes", ()))
            if recorder is not None:
                snapshot = recorder.snapshot()
                data["recorder"] = reports.with_blocks(snapshot)
                data["summary"] = recorder.summary()
                data["guard"] = reports.guard_results(snapshot)
                data["fallback_every_call"] = reports.every_call_fallbacks(snapshot)
            if block_notes is not None and data.get("blocks"):
                data["blocks"] = reports.block_results(data["blocks"], dict(block_notes))
            config = None if override is None else override.config
            verdict = prediction_check.report(config.model) if config is not None and config.backend == AUTO_FAST \
                and config.model else {}
            if verdict.get("sparse_verdict") and data.get("summary"):
                data["summary"] = f"{data['summary']}; {verdict['sparse_verdict']['text']}"
            for extra in (verdict, _precision_notes(dict(precision_notes or {})),
                          _foreign_notes(override, _installed_override(executor),
                                         recorder.total_calls if recorder is not None else 0)):
                data["notes"] += extra.pop("notes", [])
                data.update(extra)
            chained = _chain_notes(kind, node_id, _chain_of_run(executor))
            data["notes"] += chained.pop("notes", [])
            data.update(chained)
            if compare is not None:
                data["compare"] = compare.snapshot()
            if tally is not None:
                data["checked"] = tally.snapshot()
                data["summary"] = tally.summary()
                if not data["checked"]["calls"]:
                    data["no_calls"] = True
                    data["summary"] = "No attention call reached these checks: nothing was checked."
                    if not chained:
                        data["notes"].append("No attention call reached these checks, so nothing was checked or "
                                             "compared (0 calls is not a clean result).")
            reports.publish(kind, node_id, data)
    return wrapper


def _add_to_chain(model, entry: dict):
    """Append this node to the model's chain; returns the last Set Attention Backend entry before it."""
    chain = tuple(model.model_options.get(CHAIN_KEY, ()))
    model.model_options[CHAIN_KEY] = chain + (entry,)
    upstream = [e for e in chain if e.get("kind") == "model"]
    return upstream[-1] if upstream else None


def _add_outer_sample_wrapper(model, wrapper) -> None:
    import comfy.patcher_extension  # ComfyUI's own module, imported only when a node runs
    model.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, WRAPPER_KEY, wrapper)


def _setup_notes(asked: str, previous, model) -> list[str]:
    """What the report says from the start: a ComfyUI name resolved, an override of another kind taken over, a
    checkpoint's embedded attention method that the override hides."""
    notes = []
    alias = comfy_versions.alias_note(asked)
    if alias:
        notes.append(alias)
    what = overrides.kind(previous)
    if what == "core_sparse":
        notes.append(f"{overrides.describe(previous)} comes before this node, and re-installs itself on top of this "
                     "node's override every step: it still gets each call first and passes the calls it keeps dense "
                     "to this node; this node passes on to it only the calls it does not take (outside its step "
                     "window or block range).")
    elif what not in ("none", "ours"):
        notes.append(f"Takes over from {overrides.describe(previous)} upstream: it serves only the calls this node "
                     "passes on (outside its step window or block range, or every call with 'comfy default'); the "
                     "report counts them as 'previous override: ...'.")
    for method, modules in sorted(comfy_versions.embedded_methods(model).items()):
        notes.append(f"This checkpoint embeds the attention method '{method}' in {modules} modules. ComfyUI uses it "
                     "only when no attention override is installed and does not show it to an override, so this "
                     "node's backend serves those calls; remove Set Attention Backend to use the embedded method.")
    return notes


class SetAttentionBackend(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SetAttentionBackend",
            display_name="Set Attention Backend",
            category=CATEGORY,
            description="Run this model's attention through the chosen backend (on a clone of the model). "
                        + CHAIN_RULE,
            inputs=[
                io.Model.Input("model", tooltip="The diffusion model whose attention calls are redirected. "
                                                + CHAIN_RULE),
                *[widget(f) for f in SET_FIELDS],
                Trust.Input("trust", optional=True,
                            tooltip="From Trust Remote Kernels: publishers whose Hub kernels this model may load."),
                Sparse.Input("sparse", optional=True,
                             tooltip="From Sparse Attention Options: tau, dense blocks and minimum tokens for backend "
                                     "sol_attn (ignored with any other backend)."),
            ],
            outputs=[io.Model.Output(tooltip="A clone of the model using the chosen attention backend.")],
            hidden=[io.Hidden.unique_id],
            not_idempotent=comfy_versions.NODE_ID_OUT_OF_CACHE_KEY,
        )

    @classmethod
    def check_inputs(cls, backend=v.MISSING, policy=v.MISSING, start_percent=v.MISSING, end_percent=v.MISSING,
                     block_start=v.MISSING, block_end=v.MISSING, quality_guard=v.MISSING, guard_every=v.MISSING):
        values = {"backend": backend, "policy": policy, "start_percent": start_percent, "end_percent": end_percent,
                  "block_start": block_start, "block_end": block_end, "quality_guard": quality_guard,
                  "guard_every": guard_every}
        return validate(SET_FIELDS, values, _window_rule, _block_rule, _availability_rule)

    @classmethod
    def validate_inputs(cls, **values):
        return comfy_validate(cls, SET_FIELDS, values)

    @classmethod
    def execute(cls, model, backend, policy, start_percent, end_percent, trust=None, block_start=0, block_end=-1,
                quality_guard=DEFAULT_GUARD, guard_every=guard.DEFAULT_EVERY, sparse=None) -> io.NodeOutput:
        node_id = cls.hidden.unique_id
        asked, backend = backend, comfy_versions.resolve(backend)
        m = model.clone()
        to = m.model_options.setdefault("transformer_options", {})
        previous = to.get(OVERRIDE_KEY)
        recorder = Recorder(label=f"Set Attention Backend #{node_id}: {backend}")
        window = None if (start_percent <= 0.0 and end_percent >= 1.0) else (start_percent, end_percent)
        blocks = None if _blocks.is_default(block_start, block_end) else (block_start, block_end)
        block_notes: dict = {}
        key = model_key(model)
        guard_mode = GUARD_MODES[quality_guard]
        precision_notes: dict = {}
        override = override_for(OverrideConfig(
            backend, policy, recorder, window=window, trust=tuple(trust or ()), previous=previous, model=key,
            guard=guard_mode, guard_every=guard_every, blocks=blocks, block_notes=block_notes,
            precision_notes=precision_notes, sparse=sparse))
        to[OVERRIDE_KEY] = override
        info = {"backend": backend, "policy": policy, "window": [start_percent, end_percent],
                "chained_previous": previous is not None, "model": key,
                "quality_guard": {"mode": guard_mode, "every": guard_every},
                "notes": _setup_notes(asked, previous, model)}
        if previous is not None:
            info["previous_override"] = overrides.describe(previous)
        if override.sparse_options is not None:
            info["sparse"] = override.sparse_options.as_dict()
        if sparse is not None and override.sparse_options is not sparse:  # not this backend's own options
            info["notes"].append(f"Sparse Attention Options apply to backend {SPARSE_BACKEND} only; this node's "
                                 f"backend is {backend}: they are ignored.")
        if blocks is not None:
            info["blocks"] = {"range": list(blocks)}
        entry = {"kind": "model", "node": str(node_id), "backend": backend, "window": [start_percent, end_percent],
                 "blocks": [block_start, block_end]}
        replaces = _add_to_chain(m, entry)
        if replaces is not None:
            info["replaces"] = replaces
            upstream = f"Set Attention Backend #{replaces['node']} ({replaces.get('backend')})"
            scope = _scope_text(entry)
            info["notes"].append(f"Takes over from {upstream} upstream: the node nearest the sampler wins"
                                 + (f"; outside this node's {scope} #{replaces['node']}'s backend runs." if scope
                                    else "."))
        _add_outer_sample_wrapper(m, _run_wrapper("model", node_id, recorder, info=info, block_notes=block_notes,
                                                  override=override, precision_notes=precision_notes))
        if backend == AUTO_FAST:  # approximate kernels wait for the model's prediction-level verdict
            prediction_check.require(m, key, window, WRAPPER_KEY, recorder)
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
                *[widget(f) for f in CLIP_FIELDS],
            ],
            outputs=[io.Clip.Output(tooltip="A clone of the CLIP whose attention modules use the backend.")],
            hidden=[io.Hidden.unique_id],
            not_idempotent=comfy_versions.NODE_ID_OUT_OF_CACHE_KEY,
        )

    @classmethod
    def check_inputs(cls, backend=v.MISSING, policy=v.MISSING):
        return validate(CLIP_FIELDS, {"backend": backend, "policy": policy}, _availability_rule)

    @classmethod
    def validate_inputs(cls, **values):
        return comfy_validate(cls, CLIP_FIELDS, values)

    @classmethod
    def execute(cls, clip, backend, policy) -> io.NodeOutput:
        node_id = cls.hidden.unique_id
        backend = comfy_versions.resolve(backend)
        c = clip.clone()
        recorder = Recorder(label=f"Set CLIP Attention Backend #{node_id}: {backend}")
        paths = patch_clip(c, override_for(OverrideConfig(backend, policy, recorder,
                                                          model=model_key(getattr(clip, "patcher", clip)))))
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
                io.Model.Input("model", tooltip="The model to check. Place it after Set Attention Backend (nearer "
                                                "the sampler): a Set Attention Backend after it replaces the "
                                                "attention it checks, and its report then says so."),
                *[widget(f) for f in CHECKS_FIELDS],
            ],
            outputs=[io.Model.Output(tooltip="A clone of the model with checks on.")],
            hidden=[io.Hidden.unique_id],
            not_idempotent=comfy_versions.NODE_ID_OUT_OF_CACHE_KEY,
        )

    @classmethod
    def check_inputs(cls, mode=v.MISSING, compare=v.MISSING, compare_every=v.MISSING):
        return validate(CHECKS_FIELDS, {"mode": mode, "compare": compare, "compare_every": compare_every})

    @classmethod
    def validate_inputs(cls, **values):
        return comfy_validate(cls, CHECKS_FIELDS, values)

    @classmethod
    def execute(cls, model, mode, compare, compare_every) -> io.NodeOutput:
        node_id = cls.hidden.unique_id
        m = model.clone()
        _add_to_chain(m, {"kind": "checks", "node": str(node_id)})
        to = m.model_options.setdefault("transformer_options", {})
        existing = to.get(OVERRIDE_KEY)
        cmp = Comparison(compare_every) if compare is True else None
        tally = CheckTally(mode)
        if overrides.kind(existing) == "ours":  # the same backend, now with checks
            config = dataclasses.replace(existing.config, checks=mode, compare=cmp, tally=tally)
        else:  # none or another pack's: check around it
            config = OverrideConfig(PASS_THROUGH, checks=mode, compare=cmp, previous=existing, tally=tally)
        to[OVERRIDE_KEY] = override_for(config)
        _add_outer_sample_wrapper(m, _run_wrapper("checks", node_id, compare=cmp, info={"checks": mode},
                                                  tally=tally))
        return io.NodeOutput(m)


class SparseAttentionOptions(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SparseAttentionOptions",
            display_name="Sparse Attention Options",
            category=CATEGORY,
            description="Options of the block-sparse backend sol_attn (comfy-kitchen's Sol-Attn, as ComfyUI's Model "
                        "Sparse Attention node sets them): tau, the blocks and the short sequences that stay dense. "
                        "Connect to Set Attention Backend's sparse input with backend sol_attn.",
            inputs=[widget(f) for f in SPARSE_FIELDS],
            outputs=[Sparse.Output(tooltip="Connect to Set Attention Backend's sparse input.")],
        )

    @classmethod
    def check_inputs(cls, **values):
        problems, good = v.check(SPARSE_FIELDS, values)
        _, more = SPARSE_OPTIONS.build(**good)  # the backend's own rules on the values its fields passed
        return v.answer(problems + [p for p in more if p not in problems])

    @classmethod
    def validate_inputs(cls, **values):
        return comfy_validate(cls, SPARSE_FIELDS, values)

    @classmethod
    def execute(cls, **values) -> io.NodeOutput:
        kinds = {"float": float, "int": int}  # ComfyUI may hand a whole number to a float input
        options, problems = SPARSE_OPTIONS.build(**{f.name: kinds.get(f.kind, lambda x: x)(values[f.name])
                                                   for f in SPARSE_FIELDS})
        if problems:  # validate_inputs said so at queue time; a prompt that skipped it still gets the same words
            raise ValueError("Sparse Attention Options: " + "; ".join(problems))
        return io.NodeOutput(options)


class TrustRemoteKernels(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="TrustRemoteKernels",
            display_name="Trust Remote Kernels",
            category=CATEGORY,
            description="Allow Hub kernels from these publishers for the models this feeds (only those). Not an "
                        "output node: it runs with the Set Attention Backend it feeds, so a prompt whose Set node "
                        "fails validation is refused as a whole.",
            inputs=[widget(f) for f in TRUST_FIELDS],
            outputs=[Trust.Output(tooltip="Connect to Set Attention Backend's trust input.")],
            # Not an output node: ComfyUI runs every output node that validates, so a Trust node feeding a Set
            # Attention Backend that fails validation would run alone and the prompt would "succeed".
        )

    @classmethod
    def check_inputs(cls, publishers=v.MISSING):
        problems, good = v.check(TRUST_FIELDS, {"publishers": publishers})
        if "publishers" in good:
            problems += publisher_list(good["publishers"]).problems()
        return v.answer(problems)

    @classmethod
    def validate_inputs(cls, **values):
        return comfy_validate(cls, TRUST_FIELDS, values)

    @classmethod
    def execute(cls, publishers) -> io.NodeOutput:
        parsed = publisher_list(publishers)
        lines = []
        if env.flag(env.DISABLE_REMOTE_CODE):
            lines.append(f"{env.DISABLE_REMOTE_CODE}=true wins: no Hub kernel will load in this ComfyUI, whatever "
                         "this node allows.")
        elif env.flag(env.TRUST_REMOTE_KERNELS) and parsed.names:
            lines.append(f"{env.TRUST_REMOTE_KERNELS}=true already trusts every publisher in this ComfyUI: this "
                         "node changes nothing while it is set.")
        elif parsed.effective:
            lines.append("Trusted for the connected models: " + ", ".join(
                f"{n} ({', '.join(parsed.known[n])})" for n in parsed.effective))
        if parsed.default:
            lines.append("Already trusted by default (changes nothing): " + ", ".join(parsed.default))
        if parsed.unused:
            lines.append("Changes nothing: no backend here loads Hub kernels from " + ", ".join(parsed.unused))
        for token, reason in parsed.refused:
            lines.append(f"Ignored: {reason}")
        if not parsed.names and not parsed.refused and not lines:
            lines.append("No publishers given: only the default trusted publishers apply ("
                         + ", ".join(sorted(TRUSTED_PUBLISHERS)) + ").")
        return io.NodeOutput(parsed.names, ui={"text": ["\n".join(lines)]})


NODES = [SetAttentionBackend, SetClipAttentionBackend, AttentionChecks, SparseAttentionOptions, TrustRemoteKernels]
