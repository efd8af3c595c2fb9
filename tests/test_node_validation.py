"""Queue-time validation of every input of every node, Trust Remote Kernels' publishers, and what the reports
say when nodes are chained (CPU, no ComfyUI: tests/helpers/node_stub.py). The same cases inside a real ComfyUI, through
its HTTP API: tests/integration/test_node_inputs.py."""

from __future__ import annotations

import importlib
import math
import re
import types

import pytest

from helpers import node_stub
from helpers.pack import PACK

BAD_NUMBERS = ["abc", None, float("nan"), float("inf"), -float("inf"), True, [1], {"x": 1}]


@pytest.fixture
def nodes(monkeypatch):
    for var in ("DIFFUSERS_DISABLE_REMOTE_CODE", "DIFFUSERS_TRUST_REMOTE_KERNELS"):
        monkeypatch.delenv(var, raising=False)
    return node_stub.install(monkeypatch)


def _untrusted(nodes):
    """A publisher of a registered Hub backend that is not trusted by default (SageAttention today)."""
    publishers = nodes.hub_publishers()
    name = sorted(p for p in publishers if p not in nodes.TRUSTED_PUBLISHERS)[0]
    return name, publishers[name]


def _good(nodes):
    """A valid value for every field of every node, and each node's validate_inputs."""
    return {
        nodes.SetAttentionBackend: (nodes.SET_FIELDS, {"backend": "native", "policy": "fallback",
                                                       "start_percent": 0.0, "end_percent": 1.0, "block_start": 0,
                                                       "block_end": -1, "quality_guard": "quantised kernels",
                                                       "guard_every": 20}),
        nodes.SetClipAttentionBackend: (nodes.CLIP_FIELDS, {"backend": "native", "policy": "strict"}),
        nodes.AttentionChecks: (nodes.CHECKS_FIELDS, {"mode": "warn", "compare": True, "compare_every": 10}),
        nodes.TrustRemoteKernels: (nodes.TRUST_FIELDS, {"publishers": _untrusted(nodes)[0]}),
        nodes.SparseAttentionOptions: (nodes.SPARSE_FIELDS, {"tau": 1.0, "dense_blocks": "0, 47-49",
                                                             "min_tokens": 12288}),
    }


def _bad_values(field):
    if field.kind == "combo":
        return ["explode", "", None, 3, ["native"], field.default.upper() + "x"]
    if field.kind in ("float", "int"):
        bad = BAD_NUMBERS + [field.min - 1, field.max + 1]
        return bad + ([2.5] if field.kind == "int" else [])
    if field.kind == "bool":
        return ["false", None, 0]
    return [None, 3, ["a"]]


def test_every_node_checks_every_input(nodes):
    """One helper for every input of every node: a bad value of any field is refused with a message naming
    that input; nothing raises; the good values pass."""
    cases = 0
    for node, (fields, good) in _good(nodes).items():
        assert node.check_inputs(**good) is True, node
        assert {f.name for f in fields} == set(good), node
        for field in fields:
            for bad in _bad_values(field):
                answer = node.check_inputs(**{**good, field.name: bad})
                assert isinstance(answer, str) and answer.startswith(f"{field.name}:") or \
                    f"{field.name}:" in answer, (node, field.name, bad, answer)
                cases += 1
    assert cases > 60


@pytest.mark.parametrize("value, expected", [
    ("abc", "start_percent: 'abc' is not a number"),
    (None, "start_percent: no value (null); expected a number from 0 to 1"),
    (float("nan"), "start_percent: nan is not a finite number"),
    (1.5, "start_percent: 1.5 is above the maximum 1"),
    (-0.1, "start_percent: -0.1 is below the minimum 0"),
])
def test_set_window_numbers_never_crash(nodes, value, expected):
    answer = nodes.SetAttentionBackend.check_inputs("native", "fallback", value, 1.0)
    assert answer.startswith(expected), answer
    assert "0 <= start_percent <= end_percent <= 1" in answer


def test_cross_field_rules(nodes):
    answer = nodes.SetAttentionBackend.check_inputs("native", "fallback", 0.8, 0.2)
    assert answer == "start_percent 0.8 is after end_percent 0.2 (the step window needs 0 <= start_percent <= " \
                     "end_percent <= 1)"
    strict = nodes.SetAttentionBackend.check_inputs("flash", "strict", 0.0, 1.0)
    assert strict.startswith("backend: attention backend 'flash' cannot run on this machine (policy strict)")
    # on this CPU no install makes flash run: the GPU is named, and no install hint or "Install what is missing"
    assert "needs an NVIDIA CUDA GPU" in strict and "pip install" not in strict and "Install" not in strict, strict
    assert nodes.SetAttentionBackend.check_inputs("flash", "fallback", 0.0, 1.0) is True
    assert "cannot run" in nodes.SetClipAttentionBackend.check_inputs("flash", "strict")
    # every problem at once, each named
    many = nodes.SetAttentionBackend.check_inputs("flsh", "Strict", "abc", None)
    assert [p.split(":")[0] for p in many.split("; ") if ":" in p.split(" ")[0]] == [
        "backend", "policy", "start_percent", "end_percent"], many


def test_every_problem_starts_with_the_input_it_is_about(nodes):
    """The contract web/node_errors.js relies on to move each problem of a refusal onto its widget (ComfyUI puts the
    whole message on the downstream `model` link): problems are joined by "; " and each starts with its input."""
    names = [f.name for f in nodes.SET_FIELDS]
    message = nodes.SetAttentionBackend.check_inputs("flash", "strict", 0.8, 0.2, 5, 2)
    problems = re.split(r"; (?=(?:%s)[:\s])" % "|".join(names), message)
    assert [re.match(r"\w+", p).group() for p in problems] == ["start_percent", "block_start", "backend"], message
    assert "; " in problems[-1]  # a problem may hold "; " itself (flash's reasons): the split is at input names


def test_unknown_values_name_the_close_match(nodes):
    answer = nodes.SetAttentionBackend.check_inputs("flsh", "fallback", 0.0, 1.0)
    assert answer == ("backend: unknown attention backend 'flsh'. Did you mean 'flash'? Valid: "
                      + ", ".join(nodes.backend_options())), answer
    assert "Did you mean 'strict'?" in nodes.SetClipAttentionBackend.check_inputs("native", "Strict")
    explode = nodes.AttentionChecks.check_inputs("explode", False, 10)
    assert explode == "mode: unknown checks mode 'explode'. Valid: raise, warn", explode
    assert "Did you mean 'raise'?" in nodes.AttentionChecks.check_inputs("RAISE", False, 10)
    assert nodes.AttentionChecks.check_inputs("warn", False, 0) == "compare_every: 0 is below the minimum 1"


def test_comfyui_gets_one_refusal_per_node(nodes):
    """ComfyUI repeats a returned message once per input validate_inputs names (8 copies for Set Attention
    Backend); validate_inputs raises the message once instead, a builtin ValueError (ComfyUI names a pack's own
    exception classes by the server's path). Links arrive as None and are ignored."""
    good = {"backend": "native", "policy": "fallback", "start_percent": 0.0, "end_percent": 1.0, "block_start": 0,
            "block_end": -1, "quality_guard": "off", "guard_every": 1}
    assert nodes.SetAttentionBackend.validate_inputs(model=None, trust=None, **good) is True
    with pytest.raises(ValueError) as refused:
        nodes.SetAttentionBackend.validate_inputs(model=None, **{**good, "backend": "flsh"})
    assert type(refused.value) is ValueError
    assert str(refused.value) == nodes.SetAttentionBackend.check_inputs(**{**good, "backend": "flsh"})
    assert str(refused.value).count("Did you mean 'flash'?") == 1
    for node, values in ((nodes.SetClipAttentionBackend, {"clip": None, "backend": "natve", "policy": "fallback"}),
                         (nodes.AttentionChecks, {"model": None, "mode": "rase", "compare": False,
                                                  "compare_every": 1}),
                         (nodes.TrustRemoteKernels, {"publishers": "*"})):
        with pytest.raises(ValueError, match="Did you mean|wildcards"):
            node.validate_inputs(**values)


def test_checks_compare_is_judged_as_sent(nodes):
    """ComfyUI makes a BOOLEAN value True with bool() before validate_inputs runs ("no" -> True); the raw value
    the client sent is kept per request (raw_prompt) and judged: "no" is refused, not run as True."""
    raw_prompt = importlib.import_module(f"{PACK}.nodes.raw_prompt")
    sent = {"prompt": {"7": {"class_type": "AttentionChecks",
                             "inputs": {"model": ["1", 0], "mode": "warn", "compare": "no", "compare_every": 10}}}}
    import contextvars

    def validate_as_comfyui_does():
        raw_prompt.remember(sent)
        sent["prompt"]["7"]["inputs"]["compare"] = bool("no")  # what ComfyUI does to the prompt next
        return nodes.AttentionChecks.validate_inputs(model=None, mode="warn", compare=True, compare_every=10)

    with pytest.raises(ValueError, match="compare: expected true or false, got 'no'"):
        contextvars.copy_context().run(validate_as_comfyui_does)
    sent["prompt"]["7"]["inputs"]["compare"] = False
    assert contextvars.copy_context().run(validate_as_comfyui_does) is True
    # a request that kept no copy (another node id, or none at all) judges the value ComfyUI hands over
    assert nodes.AttentionChecks.validate_inputs(mode="warn", compare=True, compare_every=10) is True


def test_dropdown_leads_with_the_autos_and_what_runs_here(nodes):
    """The autos and ComfyUI's attention first, then what runs on this machine (best first), then what cannot,
    grouped by family; private `_` names are not listed but are still accepted, typed or from a workflow."""
    options = nodes.backend_options()
    assert options[:3] == ["auto_exact", "auto_fast", "comfy default"]
    runs = [n for n in options[3:] if not nodes.availability_reasons(n)]
    assert options[3:3 + len(runs)] == runs and {"native", "flex"} <= set(runs)  # a CPU machine
    assert runs == [n for n in nodes.backend_names() if n in runs]  # best first
    families = [nodes.get_backend_spec(n).family for n in options[3 + len(runs):]]
    assert all(families[i] == families[i - 1] or families[i] not in families[:i] for i in range(1, len(families))), \
        families  # each family in one block
    assert not any(n.startswith("_") for n in options)
    assert set(options[3:]) == {n for n in nodes.backend_names() if not n.startswith("_")}
    for private in [n for n in nodes.backend_names() if n.startswith("_")] + ["auto"]:
        assert nodes.SetAttentionBackend.check_inputs(private, "fallback", 0.0, 1.0) is True, private
    assert "Did you mean '_native_math'?" in nodes.SetAttentionBackend.check_inputs("_native_mat", "fallback", 0.0,
                                                                                    1.0)


def test_inputs_the_prompt_does_not_carry_are_left_to_comfyui(nodes):
    """ComfyUI reports a missing required input itself; validate_inputs does not add a second message."""
    assert nodes.SetAttentionBackend.check_inputs(backend="native") is True
    assert nodes.AttentionChecks.check_inputs() is True


# ------------------------------------------------------------------------------------------------ Trust


@pytest.mark.parametrize("text, fragment", [
    ("*", "wildcards are not supported"),
    ("{P}/sage-attention", "is a repo id or URL: trust is per publisher (the part before '/'), so write '{P}'"),
    ("https://huggingface.co/{P}", "write '{P}'"),
    ("{P_SWAP}", "'{P_SWAP}' is not '{P}': publishers match exactly, case included; write '{P}'"),
    ("KERNELS-COMMUNITY", "write 'kernels-community'"),
    ("{P}\x00x", "contains spaces or control characters"),
    ("{P} x", "contains spaces or control characters"),
    ("-bad-", "is not a Hugging Face user or organisation name"),
    ("someone", "no backend here loads Hub kernels from 'someone', so trusting it changes nothing"),
    ("{P}x", "Did you mean '{P}'?"),
])
def test_trust_refuses_what_cannot_apply(nodes, text, fragment):
    publisher, _ = _untrusted(nodes)
    values = {"P": publisher, "P_SWAP": publisher.swapcase()}
    text, fragment = text.format(**values), fragment.format(**values)
    answer = nodes.TrustRemoteKernels.check_inputs(f"{publisher}\n{text}")
    assert isinstance(answer, str) and answer.startswith("publishers: ") and fragment in answer, answer
    out = nodes.TrustRemoteKernels.execute(text)
    (names,) = out.result
    assert "Trusted for the connected models" not in out.ui["text"][0], out.ui  # never confirmed
    if text not in ("someone", f"{publisher}x"):
        assert names == (), names  # can never match: not passed on


@pytest.mark.parametrize("text", [
    "https://huggingface.co/{P}/sage-attention", "{P}/sage-attention", "kernels-community/flash-attn2",
    "someone/kernel", "hf.co/someone", "/home/me/kernels", "./kernels", "~/kernels", "C:\\kernels\\flash",
    "https://example.com/x",
])
def test_trust_advice_for_a_path_like_entry_is_accepted(nodes, text):
    """Whatever the advice for a repo id, URL or path tells the user to write, the node then accepts; where no
    publisher can be read from it, the advice lists the publishers that apply here."""
    import re
    publisher, _ = _untrusted(nodes)
    answer = nodes.TrustRemoteKernels.check_inputs(text.format(P=publisher))
    assert isinstance(answer, str), answer
    suggested = re.findall(r"write '([^']+)'", answer)
    for value in suggested:
        assert nodes.TrustRemoteKernels.check_inputs(value) is True, (answer, value)
    if not suggested:
        assert f"publishers of Hub backends here: " in answer and publisher in answer, answer


def test_trust_confirms_only_what_applies(nodes, monkeypatch):
    publisher, backends = _untrusted(nodes)
    assert nodes.TrustRemoteKernels.check_inputs(f"{publisher}, kernels-community\n\n") is True
    assert nodes.TrustRemoteKernels.check_inputs("") is True
    out = nodes.TrustRemoteKernels.execute(f"{publisher}, kernels-community\n{publisher}")
    assert out.result == (tuple(sorted(["kernels-community", publisher])),)
    lines = out.ui["text"][0].split("\n")
    assert lines[0] == f"Trusted for the connected models: {publisher} ({', '.join(backends)})", lines
    assert lines[1] == "Already trusted by default (changes nothing): kernels-community"
    # the example workflow's text
    only_default = nodes.TrustRemoteKernels.execute("kernels-community").ui["text"][0]
    assert only_default == "Already trusted by default (changes nothing): kernels-community"
    assert "kernels-community" in nodes.TrustRemoteKernels.execute("").ui["text"][0]
    monkeypatch.setenv("DIFFUSERS_TRUST_REMOTE_KERNELS", "true")
    assert "already trusts every publisher" in nodes.TrustRemoteKernels.execute(publisher).ui["text"][0]
    monkeypatch.setenv("DIFFUSERS_DISABLE_REMOTE_CODE", "true")
    assert "DIFFUSERS_DISABLE_REMOTE_CODE=true wins" in nodes.TrustRemoteKernels.execute(publisher).ui["text"][0]


# ------------------------------------------------------------------------------------------------ chains


class Executor:
    """ComfyUI's WrapperExecutor as the OUTER_SAMPLE wrappers see it: callable, and `class_obj` is the guider
    whose model_options are the sampled model's."""

    def __init__(self, model):
        self.class_obj = types.SimpleNamespace(model_options=model.model_options)

    def __call__(self, *args, **kwargs):
        return "latent"


def _as(monkeypatch, node, node_id):
    monkeypatch.setattr(node, "hidden", types.SimpleNamespace(unique_id=node_id), raising=False)


def _run(model):
    """Run every OUTER_SAMPLE wrapper of the sampled model; the reports they publish, by node."""
    reports = importlib.import_module(f"{PACK}.nodes.reports")
    reports.clear()
    for wrapper in model.outer_wrappers():
        wrapper(Executor(model))
    return {(r["kind"], r["node"]): r for r in reports.latest()["reports"]}


def test_chained_set_nodes_say_which_one_wins(nodes, monkeypatch):
    _as(monkeypatch, nodes.SetAttentionBackend, "1")
    (a,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "native", "fallback", 0.0, 1.0).result
    _as(monkeypatch, nodes.SetAttentionBackend, "2")
    (b,) = nodes.SetAttentionBackend.execute(a, "flex", "fallback", 0.0, 1.0).result
    got = _run(b)
    upstream, downstream = got[("model", "1")], got[("model", "2")]
    assert upstream["overridden_by"]["node"] == "2" and upstream["overridden_by"]["backend"] == "flex"
    assert upstream["notes"][0].startswith("Overridden: Set Attention Backend #2 (flex) comes after this node")
    assert "nearest the sampler wins" in upstream["notes"][0]
    assert downstream["replaces"]["node"] == "1" and "overridden_by" not in downstream
    assert downstream["notes"][0].startswith("Takes over from Set Attention Backend #1 (native) upstream")
    # The upstream node's own output, sampled directly, is not overridden.
    alone = _run(a)[("model", "1")]
    assert "overridden_by" not in alone and alone["notes"] == []


def test_windowed_downstream_set_node_leaves_calls_outside_its_window(nodes, monkeypatch):
    _as(monkeypatch, nodes.SetAttentionBackend, "1")
    (a,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "native", "fallback", 0.0, 1.0).result
    _as(monkeypatch, nodes.SetAttentionBackend, "2")
    (b,) = nodes.SetAttentionBackend.execute(a, "flex", "fallback", 0.5, 1.0).result
    got = _run(b)
    assert "wins inside its step window 0.5..1" in got[("model", "1")]["notes"][0]
    assert "outside this node's step window 0.5..1 #1's backend runs" in got[("model", "2")]["notes"][0]


@pytest.mark.parametrize("compare", [False, True])
def test_checks_before_set_say_they_saw_no_calls(nodes, monkeypatch, compare):
    _as(monkeypatch, nodes.AttentionChecks, "5")
    (c,) = nodes.AttentionChecks.execute(node_stub.FakeModel(), "warn", compare, 1).result
    _as(monkeypatch, nodes.SetAttentionBackend, "6")
    (s,) = nodes.SetAttentionBackend.execute(c, "native", "fallback", 0.0, 1.0).result
    report = _run(s)[("checks", "5")]
    assert report["no_calls"] is True and report["replaced_by"]["node"] == "6"
    assert report["notes"] == ["Saw no attention calls: Set Attention Backend #6 (native) comes after these checks "
                               "and replaced the attention they wrap. Put Attention Checks after Set Attention "
                               "Backend."]


def test_checks_with_no_samples_never_read_as_clean(nodes, monkeypatch):
    _as(monkeypatch, nodes.SetAttentionBackend, "6")
    (s,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "native", "fallback", 0.0, 1.0).result
    _as(monkeypatch, nodes.AttentionChecks, "5")
    (c,) = nodes.AttentionChecks.execute(s, "warn", True, 1).result
    report = _run(c)[("checks", "5")]  # the sampler made no attention call at all
    assert report["compare"]["samples"] == 0 and report["no_calls"] is True
    assert "nothing was checked or compared" in report["notes"][0] and "replaced_by" not in report


def test_message_text_is_plain(nodes):
    """Messages quote odd values with repr (control characters stay visible) and stay short."""
    answer = nodes.SetAttentionBackend.check_inputs("x\x1b[31m" * 40, "fallback", 0.0, 1.0)
    assert "\x1b" not in answer and "\u2026" in answer
    assert not math.isnan(len(answer))


@pytest.mark.parametrize("window, text", [((1e-300, 1.0), "1e-300..1"), ((0.5, 1.0), "0.5..1"),
                                          ((0.0, 0.25), "0..0.25"), ((1 / 3, 1.0), "0.3333333333333333..1")])
def test_step_windows_are_shown_as_the_numbers_they_are(window, text):
    """A window of 1e-300..1 is not 'outside the step window 0.00..1.00': each bound reads back as itself."""
    from helpers.pack import load_pack
    load_pack()
    window_mod = importlib.import_module(f"{PACK}.nodes.window")
    assert window_mod.window_text(*window) == text
    assert tuple(float(x) for x in text.split("..")) == window


def test_library_errors_read_without_the_server_path():
    """ComfyUI names an exception by module + qualname and loads the pack under its path: the exceptions the
    library exports are named by the module they are exported from (attention_dispatch), never by a path."""
    from helpers.pack import load_pack
    load_pack()
    error_names = importlib.import_module(f"{PACK}.nodes.error_names")
    dispatcher = importlib.import_module(f"{PACK}.dispatcher")
    error_names.name_for_comfyui()
    named = {f"{cls.__module__}.{cls.__qualname__}" for cls in error_names.public_exceptions()}
    assert {"attention_dispatch.AttentionQualityError", "attention_dispatch.AttentionInputError",
            "attention_dispatch.BackendNotSupportedError", "attention_dispatch.parallel.ContextParallelError"} <= named
    assert not any("/" in n or PACK in n for n in named), named
    try:
        raise dispatcher.AttentionQualityError("x")
    except dispatcher.AttentionQualityError as exc:  # still the same class: only its name changed
        assert type(exc).__module__ == "attention_dispatch"
