"""docs/python.md: every caller refuses in the same words. One backend failing each kind of rule (a missing package,
a GPU generation, a dtype, head-dim or mask limit, trust, the memory cap, a ring mode without LSE, low precision
refused) gives `support.why_not`'s text from every caller that meets the rule: dispatch_attention_fn, the ComfyUI
override, auto's tuner, the install plan, the doctor, parallel and the low-precision path.

Everything runs in the pack as ComfyUI imports it (helpers.pack), so the override and the library are one copy."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F

from helpers.pack import PACK, comfy_func, load_pack

adapter, dispatcher, _ = load_pack()
support = importlib.import_module(f"{PACK}.dispatcher.support")
requirements = importlib.import_module(f"{PACK}.dispatcher.requirements")
spec_module = importlib.import_module(f"{PACK}.dispatcher.spec")
install_plan = importlib.import_module(f"{PACK}.dispatcher.tools.install_plan")
doctor = importlib.import_module(f"{PACK}.dispatcher.tools.doctor")
parallel = importlib.import_module(f"{PACK}.dispatcher.parallel")
call_of = importlib.import_module(f"{PACK}.dispatcher.call").AttentionCall
machine_module = importlib.import_module(f"{PACK}.dispatcher.machine")
inputs_module = importlib.import_module(f"{PACK}.dispatcher.inputs")
Tuner = importlib.import_module(f"{PACK}.dispatcher.auto").Tuner

B, L, H, D = 1, 16, 2, 32
UNTRUSTED_REPO = "attn-dispatch-untrusted-org/same-words-test"


def sdpa_bshd(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
              return_lse=False, kernel=None):
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return out.transpose(1, 2)


@pytest.fixture
def register():
    """Register backends in the pack's registry for one test; removed after it."""
    names = []

    def add(name, **fields):
        dispatcher.register_backend(name, sdpa_bshd, **{"devices": ("cpu",), **fields})
        names.append(name)
        return name
    yield add
    for name in names:
        dispatcher.unregister_backend(name)


def tensors(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, L, H, D, generator=gen, dtype=dtype) for _ in range(3))


def bool_mask():
    return torch.ones(B, 1, L, L, dtype=torch.bool).tril()


# ---- what each caller says ---------------------------------------------------------------------------------------

def said_by_dispatch(name, mask=None) -> str:
    q, k, v = tensors()
    with pytest.raises(Exception) as refused:
        dispatcher.dispatch_attention_fn(q, k, v, attn_mask=mask, backend=name, policy="strict")
    return str(refused.value)


def said_by_override(name, mask=None, **kwargs) -> list[str]:
    """The reasons the node's report lists for the calls the override served (policy 'fallback')."""
    recorder = dispatcher.Recorder()
    fn = adapter.make_override(name, recorder=recorder)
    flat = [t.flatten(2) for t in tensors()]
    fn(comfy_func, *flat, H, mask=None if mask is None else mask[:, 0],
       transformer_options={"optimized_attention_override": None}, _inside_attn_wrapper=True, **kwargs)
    return [reason for row in recorder.snapshot()["rows"] for reason in row["reasons"]]


def said_by_tuner(name, inputs) -> list[str]:
    _, skipped, _ = Tuner(cache_path=None, backends=(name,)).candidates(inputs, exact=True)
    return dict(skipped)[name]


def said_by_install_plan(name, machine) -> tuple[list[str], list[str]]:
    planned = install_plan.build(machine, lock={}).get(name)
    return planned.reasons, planned.why


def said_by_doctor(name) -> tuple[list[str], str]:
    """(the backend's reasons in the listing, the line of the group the doctor puts it in)."""
    data = doctor.report()
    (row,) = [b for b in data["backends"] if b["name"] == name]
    groups = data["groups"]
    line = [r["why"] for r in groups["step_away"] if r["name"] == name] + \
        [r["reason"] for r in groups["not_here"] if name in r["backends"]]
    assert len(line) == 1, groups
    return row["reasons"], line[0]


def call_inputs(mask=None, dtype=torch.float32):
    q, k, v = tensors(dtype)
    return inputs_module.describe_call(q, k, v, mask, 0.0, False, None, False, False, "BSHD")


def the_one(why) -> str:
    (reason,) = why.reasons
    return reason


def said_by_every_caller(name, said: str, machine) -> None:
    """A rule of the machine or of trust: the call's callers, the install plan and the doctor all say `said`."""
    assert said in said_by_dispatch(name)
    assert f"{name}: {said}" in said_by_override(name)
    assert said_by_tuner(name, call_inputs()) == [said]
    reasons, deciding = said_by_install_plan(name, machine)
    assert reasons == [said] and deciding == [said]
    listed, group = said_by_doctor(name)
    assert listed == [said] and group == said


# ---- the rules ------------------------------------------------------------------------------------------------------

def test_a_missing_package_in_the_same_words(register):
    name = register("t_words_package", requires=(requirements.Package("attn-dispatch-absent-package", "1.0"),))
    said = the_one(support.why_not(name))
    assert "attn-dispatch-absent-package is not installed: pip install" in said
    said_by_every_caller(name, said, machine_module.current_machine())


def test_a_gpu_generation_in_the_same_words(register):
    name = register("t_words_gpu", devices=("cpu", "cuda"),
                    requires=(requirements.CudaCapability(minimum=(9, 0)),))
    t4 = install_plan.simulated("t4")
    with machine_module.use_machine(t4):
        said = the_one(support.why_not(name))
        assert said == "needs compute capability >= 9.0; this GPU is sm_75 (too old)"
        said_by_every_caller(name, said, t4)


@pytest.mark.parametrize("rule, fields, mask", [
    ("dtype", {"dtypes": (torch.float16,)}, None),
    ("head dim", {"head_dims": spec_module.HeadDims(8, 16)}, None),
    ("mask", {"masks": ("none",)}, bool_mask()),
])
def test_an_input_limit_in_the_same_words(register, rule, fields, mask):
    name = register(f"t_words_{rule.replace(' ', '_')}", **fields)
    said = the_one(support.why_not(name, call_inputs(mask)))
    assert said.startswith({"dtype": "dtype float32", "head dim": "head dim 32", "mask": "attn_mask is"}[rule])
    assert said in said_by_dispatch(name, mask)
    assert f"{name}: {said}" in said_by_override(name, mask)
    assert said_by_tuner(name, call_inputs(mask)) == [said]


def test_trust_in_the_same_words(register):
    name = register("t_words_trust", hub_kernel=spec_module.HubKernel(UNTRUSTED_REPO, "attn"))
    why = support.why_not(name)
    said = the_one(why)
    assert why.trust == (said,) and UNTRUSTED_REPO in said
    said_by_every_caller(name, said, machine_module.current_machine())
    with pytest.raises(dispatcher.KernelLoadError) as refused:  # the loader itself refuses in the same words
        dispatcher.registry.prepare(name)
    assert str(refused.value) == said


def test_the_memory_cap_in_the_same_words(register):
    scores, tiles = register("t_words_scores", quadratic_memory=True), register("t_words_tiles")
    cap = support.Rules(memory_cap=1024)  # the float32 scores are 1 x 2 x 16 x 16 x 4 bytes = 2 KiB
    said = the_one(support.why_not(scores, call_inputs(), rules=cap))
    assert said == "it materialises the 2.0 KiB score matrix, over the memory cap of 1.0 KiB"
    assert support.why_not(tiles, call_inputs(), rules=cap).runs
    record = Tuner(cache_path=None, backends=(scores, tiles), memory_cap_bytes=1024).tune(*tensors())
    by_name = {c.name: c for c in record.candidates}
    assert by_name[scores].reason == f"not run: {said}" and record.chosen == tiles


def test_a_ring_mode_without_lse_in_the_same_words(register):
    name = register("t_words_ring", lse=False)
    said = the_one(support.why_not(name, rules=support.Rules(context_parallel="ring")))
    assert "log-sum-exp" in said and "lse=False" in said
    ring = parallel.ContextParallelConfig(ring_degree=2)
    for refuse in (lambda: parallel.check_backend(name, ring),
                   lambda: parallel.context_parallel_attention(call_of(*tensors(), backend=name), config=ring)):
        with pytest.raises(parallel.ContextParallelError) as refused:
            refuse()
        assert said in str(refused.value)
    assert support.why_not(name, rules=support.Rules(context_parallel="ulysses")).runs  # Ulysses runs anything


@pytest.mark.parametrize("key", ["window_size", "scale", "no_such_key"])
def test_an_attention_kwargs_key_in_the_same_words(register, key):
    """A key a backend does not pass on to its kernel: why_not's reason is the line the call's error gives (a key
    that repeats an argument of dispatch_attention_fn, one another backend honours, one none honours)."""
    name = register(f"t_words_kwargs_{key}")
    (said,) = support.why_not(name, call_inputs(), attention_kwargs={key: 1}).attention_kwargs
    assert said.startswith(f"attention_kwargs key {key!r} ")
    q, k, v = tensors()
    with pytest.raises(support.AttentionKwargsError) as refused:
        dispatcher.dispatch_attention_fn(q, k, v, backend=name, attention_kwargs={key: 1})
    assert said in str(refused.value).splitlines()[-1]


def block_mask():
    from torch.nn.attention.flex_attention import create_block_mask
    return create_block_mask(lambda b, h, q, k: q >= k, None, None, L, L, device="cpu")


@pytest.mark.parametrize("what", ["BlockMask", "mask and causal"])
def test_a_call_context_parallelism_cannot_cut_in_the_same_words(register, what):
    """What no backend can run under context parallelism: why_not's context-parallel rule says it of the call, and
    context_parallel_attention refuses it in those words, with a backend or with auto (which why_not cannot name)."""
    name = register(f"t_words_cp_{what.replace(' ', '_')}")
    mask, causal = (block_mask(), False) if what == "BlockMask" else (bool_mask(), True)
    q, k, v = tensors()
    inputs = inputs_module.describe_call(q, k, v, mask, 0.0, causal, None, False, False, "BSHD")
    (said,) = support.why_not(name, inputs, rules=support.Rules(context_parallel="ulysses")).rules
    assert ("BlockMask" in said) if what == "BlockMask" else said.startswith("is_causal=True with attn_mask")
    assert support.why_not(name, inputs).rules == ()  # a plain call: no context-parallel rule applies
    ulysses = parallel.ContextParallelConfig(ulysses_degree=2)
    for backend in (name, "auto"):
        with pytest.raises(parallel.ContextParallelError) as refused:  # before any process group is needed
            parallel.context_parallel_attention(call_of(q, k, v, mask, is_causal=causal, backend=backend),
                                                config=ulysses)
        assert str(refused.value) == said


def test_low_precision_refused_in_the_same_words(register):
    name = register("t_words_quantised", quantised=True)
    said = the_one(support.why_not(name, rules=support.Rules(low_precision=False)))
    assert said == "a quantised kernel: the call asks for full precision (low_precision_attention=False)"
    notes, recorder = {}, dispatcher.Recorder()
    fn = adapter.make_override(name, recorder=recorder, precision_notes=notes)
    flat = [t.flatten(2) for t in tensors()]
    fn(comfy_func, *flat, H, transformer_options={"optimized_attention_override": None}, _inside_attn_wrapper=True,
       low_precision_attention=False)
    ((_, kept_exact),) = notes
    assert kept_exact.endswith(f"serves instead: {said}")
    assert any(reason.endswith(said) for row in recorder.snapshot()["rows"] for reason in row["reasons"])
    # auto_exact's rule: the same kind of refusal, in auto's words, from the tuner and why_not alike
    assert said_by_tuner(name, call_inputs()) == [the_one(support.why_not(name, rules=support.Rules(
        exact_only=True)))]


def test_rules_never_hide_the_owners_reasons(register):
    """Rules add reasons after the machine's, trust's and the call's; they never replace them (except the
    precision rules, decided by the spec alone before any package is imported)."""
    name = register("t_words_both", requires=(requirements.Package("attn-dispatch-absent-package", "1.0"),),
                    quadratic_memory=True, lse=False)
    rules = support.Rules(memory_cap=1024, context_parallel="ring")
    why = support.why_not(name, call_inputs(), rules=rules)
    assert why.machine == support.why_not(name).machine and len(why.rules) == 2
    assert why.reasons == list(why.machine) + list(why.rules)
    with pytest.raises(dataclasses.FrozenInstanceError):  # a value: hashable, never changed under a caller
        rules.memory_cap = 1


def test_the_install_plan_reads_records_that_name_their_requirement(register):
    """The install plan sorts each reason by its requirement's declared `remedy` (why_not's records), never by the
    requirement's type or a count: a custom requirement declaring that a repair fixes it is 'broken', in its own
    words; one `checked_last` (a real call, like Probe) waits until everything else is met."""

    class ImportsButFails:
        remedy = "repair"
        checked_last = True

        def describe(self):
            return "a working custom call"

        def reason(self, machine):
            return "imports but a tiny custom call fails; reinstall it for this torch"

    name = register("t_words_repair", requires=(ImportsButFails(),))
    said = the_one(support.why_not(name))
    planned = install_plan.build(machine_module.current_machine(), lock={}).get(name)
    assert planned.status == install_plan.BROKEN and planned.why == [said] and planned.steps == []
    missing = requirements.Package("attn-dispatch-absent-package", "1.0")
    both = register("t_words_repair_later", requires=(missing, ImportsButFails()))
    assert support.why_not(both).machine == (missing.reason(machine_module.current_machine()),)
    assert install_plan.build(machine_module.current_machine(), lock={}).get(both).status == install_plan.PIP
