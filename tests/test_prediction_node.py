"""Set Attention Backend with auto_fast: the prediction-level verdict through the node's APPLY_MODEL wrapper
(nodes/prediction_check.py), without ComfyUI (stand-in comfy modules; the pack imported as ComfyUI imports it).

The model function is six attention blocks called through the node's own override in ComfyUI's (B, L, H*D) form, as
apply_model would; the fake approximate kernel is 8e-2 off per call (within its class's per-call bound) and the
prediction 0.6 off. The wrapper runs the forward twice at the first call, returns the reference prediction, and the
report says "sparse refused: prediction off by ...".
"""

from __future__ import annotations

import importlib

import pytest
import torch

from helpers import fake_clock, node_stub
from helpers.pack import PACK, load_pack
from helpers.tensors import sdpa

load_pack()
dispatcher = importlib.import_module(f"{PACK}.dispatcher")
prediction = importlib.import_module(f"{PACK}.dispatcher.prediction")
measure = importlib.import_module(f"{PACK}.dispatcher.auto.measure")
auto = importlib.import_module(f"{PACK}.dispatcher.auto")
reports = importlib.import_module(f"{PACK}.nodes.reports")

BLOCKS, HEADS, DIM, TOKENS = 6, 2, 16, 64
CLOCK = fake_clock.FakeClock()


@pytest.fixture
def nodes(monkeypatch, tmp_path):
    monkeypatch.setattr(measure, "now", CLOCK)
    names = ("t_node_sparse", "t_node_exact")
    dispatcher.register_backend(names[0], CLOCK.kernel(5, fn=lambda q, k, v: sdpa(q, k, v) * 1.08),
                                devices=("cpu",), approximate=True, error_bound=1e-1)
    dispatcher.register_backend(names[1], CLOCK.kernel(20), devices=("cpu",))
    previous = dispatcher.registry.priority()
    dispatcher.registry.set_priority(names + tuple(dispatcher.registry.names()))
    with auto.using(auto.Tuner(cache_path=tmp_path / "tune.json", backends=names)):
        yield node_stub.install(monkeypatch), names
    dispatcher.registry.set_priority(previous)
    for name in names:
        dispatcher.unregister_backend(name)
    prediction.forget()


def model_function(override, weights, served):
    """apply_model's stand-in: six blocks through the override (ComfyUI's (B, L, H*D) calls)."""
    def apply_model(x, t, c_concat=None, c_crossattn=None, control=None, transformer_options=None, **kwargs):
        for wq, wk, wv in weights:
            q, k, v = (x @ m for m in (wq, wk, wv))
            x = override(served, q, k, v, heads=HEADS, transformer_options=transformer_options) * 3.0
        return x
    return apply_model


def comfy_attention(q, k, v, heads, **kwargs):
    raise AssertionError("the override served every call itself")


def auto_fast_node(nodes):
    """Set Attention Backend with auto_fast on a six-block model: (the patched model, its apply_model wrapper, the
    model's weights, an input)."""
    (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "auto_fast", "fallback", 0.0, 1.0).result
    (wrapper,) = m.model_options["transformer_options"]["wrappers"]["apply_model"]["attention_dispatch"]
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(3, HEADS * DIM, HEADS * DIM, generator=gen) / (HEADS * DIM) ** 0.5 for _ in range(BLOCKS)]
    assert prediction.status(m.override.config.model) == prediction.PENDING
    reports.clear()
    return m, wrapper, weights, torch.randn(1, TOKENS, HEADS * DIM, generator=gen)


def test_auto_fast_refuses_a_sparse_kernel_that_ruins_the_prediction(nodes):
    nodes, (sparse, exact) = nodes
    m, wrapper, weights, x = auto_fast_node(nodes)
    override = m.override
    apply_model = model_function(override, weights, comfy_attention)
    options = {"cond_or_uncond": [0]}
    (outer,) = m.outer_wrappers()

    def sample():
        first = wrapper(apply_model, x, torch.tensor([1.0]), None, None, None, options)
        second = wrapper(apply_model, x, torch.tensor([0.5]), None, None, None, {"cond_or_uncond": [0]})
        return first, second
    first, second = outer(lambda: sample())
    verdict = prediction.verdict(override.config.model)
    assert verdict.status == prediction.REFUSED and verdict.rel_error > 0.5
    assert (verdict.served, verdict.calls) == (BLOCKS, BLOCKS)  # counted by the node's recorder
    # the reference prediction came back, and the next step ran without the sparse kernel
    with dispatcher.model_scope("reference"):
        reference = model_function(_exact_override(nodes, exact), weights, comfy_attention)(x, None)
    torch.testing.assert_close(first, reference)
    torch.testing.assert_close(second, reference)
    rows = {(r["site"], r["served"]): r["calls"] for r in override.config.recorder.snapshot()["rows"]}
    assert {served for _, served in rows} == {sparse, exact}  # the sparse kernel served the candidate forward only
    assert sum(c for (_, served), c in rows.items() if served == sparse) == BLOCKS
    report = reports.latest()["reports"][-1]
    assert report["sparse_verdict"]["status"] == "refused"
    assert any(n.startswith("sparse refused: prediction off by") for n in report["notes"]), report["notes"]
    assert "sparse refused: prediction off by" in report["summary"]
    assert f"over {BLOCKS} of {BLOCKS} calls" in report["summary"]


def test_a_trial_the_sparse_kernel_served_no_call_of_decides_nothing_and_is_tried_again(nodes, tmp_path):
    """Tuning off (budget 0): no block's verdict admits the sparse kernel, so the trial forward runs exactly. That
    decides nothing: each model call runs a trial again, MAX_TRIALS at most, and the report says why."""
    nodes, names = nodes
    with auto.using(auto.Tuner(cache_path=tmp_path / "off.json", backends=names, time_budget_s=0)):
        m, wrapper, weights, x = auto_fast_node(nodes)
        forwards = []
        model = model_function(m.override, weights, comfy_attention)

        def apply_model(*args, **kwargs):
            forwards.append(1)
            return model(*args, **kwargs)

        def sample():
            for step in range(prediction.MAX_TRIALS + 1):
                wrapper(apply_model, x, torch.tensor([1.0 - step / 10]), None, None, None, {"cond_or_uncond": [0]})
        m.outer_wrappers()[0](sample)
    verdict = prediction.verdict(m.override.config.model)
    assert len(forwards) == 2 * prediction.MAX_TRIALS + 1  # a reference and a trial per call, then one forward
    assert verdict.status == prediction.PENDING == prediction.status(m.override.config.model)
    assert (verdict.served, verdict.calls, verdict.trials) == (0, BLOCKS, prediction.MAX_TRIALS)
    report = reports.latest()["reports"][-1]
    assert report["sparse_verdict"]["status"] == "pending"
    assert f"sparse: no verdict yet: the trial forward's {BLOCKS} attention calls got no approximate kernel; not " \
           f"tried again after {prediction.MAX_TRIALS} trials" in report["summary"]
    assert {row["served"] for row in m.override.config.recorder.snapshot()["rows"]} == {names[1]}


def _exact_override(nodes, exact):
    (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), exact, "strict", 0.0, 1.0).result
    return m.override


def test_other_backends_install_no_verdict_wrapper(nodes):
    nodes, (sparse, exact) = nodes
    (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "auto_exact", "fallback", 0.0, 1.0).result
    assert "apply_model" not in m.model_options["transformer_options"].get("wrappers", {})
    assert prediction.status(m.override.config.model) is None
