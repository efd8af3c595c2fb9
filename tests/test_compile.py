"""torch.compile: a dispatched call inside a compiled model traces without a graph break and matches eager."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import dispatcher
from dispatcher import (AttentionInputError, BackendNotSupportedError, Recorder, UnknownBackendError,
                        attention_checks, dispatch_attention_fn, recording)
from dispatcher import machine as machine_module

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile",
                                        "ignore:return_lse is deprecated")

CPU_BACKENDS = ("native", "_native_math", "_native_flash", "flex")
FLEX_COMPILE_BUDGET_S = 60


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny(b=1, s=16, h=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, s, h, d, generator=gen) for _ in range(3))


def model(**kwargs):
    """A stand-in for a transformer block: tensor work before and after the attention call."""
    def block(q, k, v):
        out = dispatch_attention_fn(q * 2, k, v, **kwargs)
        if kwargs.get("return_lse"):
            return out[0] + 1, out[1]
        return out + 1
    return block


def breaks(fn, *args) -> int:
    explanation = torch._dynamo.explain(fn)(*args)
    assert explanation.graph_count >= 1
    return explanation.graph_break_count, [b.reason.splitlines()[0] for b in explanation.break_reasons]


def assert_same(compiled, eager, atol=1e-5):
    compiled = compiled if isinstance(compiled, tuple) else (compiled,)
    eager = eager if isinstance(eager, tuple) else (eager,)
    assert len(compiled) == len(eager)
    for c, e in zip(compiled, eager):
        torch.testing.assert_close(c, e, atol=atol, rtol=1e-4)


def test_assume_constant_result_marker_is_what_torch_sets():
    """dispatch.py marks its trace-time plan by hand (to keep torch._dynamo out of the import)."""
    def probe():
        return 0
    assert torch.compiler.assume_constant_result(probe)._dynamo_marked_constant is True
    assert dispatcher.dispatch._traced_plan._dynamo_marked_constant is True


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_no_graph_break(backend):
    q, k, v = tiny()
    count, reasons = breaks(model(backend=backend), q, k, v)
    assert count == 0, reasons


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_fullgraph_matches_eager(backend):
    q, k, v = tiny()
    fn = model(backend=backend)
    compiled = torch.compile(fn, backend="eager", fullgraph=True)
    assert_same(compiled(q, k, v), fn(q, k, v))
    assert_same(compiled(q, k, v), fn(q, k, v))


@pytest.mark.parametrize("backend", ["native", "_native_math", "_native_flash"])
def test_inductor_matches_eager(backend):
    q, k, v = tiny()
    fn = model(backend=backend)
    assert_same(torch.compile(fn, fullgraph=True)(q, k, v), fn(q, k, v))


@pytest.mark.slow
def test_inductor_flex_matches_eager():
    q, k, v = tiny(s=8, d=16)
    fn = model(backend="flex")
    start = time.perf_counter()
    compiled = torch.compile(fn, fullgraph=True)(q, k, v)
    seconds = time.perf_counter() - start
    assert_same(compiled, fn(q, k, v))
    if seconds > FLEX_COMPILE_BUDGET_S:
        warnings.warn(f"compiling flex on the CPU took {seconds:.0f} s (budget {FLEX_COMPILE_BUDGET_S} s)")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", ["bool_mask", "additive_mask", "lse", "bhsd", "gqa_scale", "causal"])
def test_variants_trace_without_break_and_match_eager(backend, case):
    q, k, v = tiny(s=12)
    kwargs = {"backend": backend}
    if case == "bool_mask":
        mask = torch.rand(1, 1, 12, 12) > 0.3
        mask[..., 0] = True
        kwargs["attn_mask"] = mask
    elif case == "additive_mask":
        kwargs["attn_mask"] = torch.randn(12, 12)
    elif case == "lse":
        if not dispatcher.get_backend_spec(backend).lse:
            pytest.skip(f"{backend} has no log-sum-exp")
        kwargs["return_lse"] = True
    elif case == "bhsd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # non-contiguous BHSD views
        kwargs["layout"] = "BHSD"
    elif case == "gqa_scale":
        k, v = k[:, :, :1], v[:, :, :1]
        kwargs.update(enable_gqa=True, scale=0.3)
    elif case == "causal":
        kwargs["is_causal"] = True
    fn = model(**kwargs)
    count, reasons = breaks(fn, q, k, v)
    assert count == 0, reasons
    assert_same(torch.compile(fn, backend="eager", fullgraph=True)(q, k, v), fn(q, k, v))


def test_default_backend_and_policy_from_state():
    q, k, v = tiny()
    with dispatcher.attention_backend("flex"):
        fn = model()
        count, reasons = breaks(fn, q, k, v)
        assert count == 0, reasons
        recorder = Recorder()
        with recording(recorder):
            torch.compile(fn, backend="eager", fullgraph=True)(q, k, v)
        assert recorder.served_by("flex") == 1


def test_first_call_of_the_process_inside_compile(monkeypatch):
    """Nothing detected or decided yet: the machine is detected at trace time, without crashing dynamo
    (torch constant-folds importlib.metadata.version and fails on a missing distribution)."""
    monkeypatch.setattr(machine_module, "_detected", None)
    dispatcher.dispatch.forget_decisions()
    q, k, v = tiny()
    count, reasons = breaks(model(), q, k, v)
    assert count == 0, reasons
    assert machine_module._detected is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="flash may be runnable on a GPU machine")
def test_fallback_inside_compile_is_recorded_with_its_reasons():
    q, k, v = tiny()
    fn = model(backend="flash")
    recorder = Recorder()
    with recording(recorder):
        compiled = torch.compile(fn, backend="eager", fullgraph=True)
        for _ in range(3):
            assert_same(compiled(q, k, v), fn(q, k, v))
    rows = recorder.snapshot()["rows"]
    assert {r["served"] for r in rows} == {"_native_flash"}
    assert all(r["fell_back"] and any("pip install" in x for x in r["reasons"]) for r in rows)
    # A compiled call is recorded when traced (once), the three eager calls each time.
    assert recorder.served_by("_native_flash") == 1 + 3


def test_a_new_backend_argument_retraces():
    q, k, v = tiny()
    choice = {"name": "native"}

    def fn(q, k, v):
        return dispatch_attention_fn(q, k, v, backend=choice["name"]) * 1

    compiled = torch.compile(fn, backend="eager")
    recorder = Recorder()
    with recording(recorder):
        compiled(q, k, v)
        choice["name"] = "_native_math"
        compiled(q, k, v)
    assert recorder.served_by("native") == 1 and recorder.served_by("_native_math") == 1


@pytest.mark.parametrize("error, kwargs, args", [
    (AttentionInputError, {}, "head_dim_mismatch"),
    (AttentionInputError, {"layout": "SBHD"}, "ok"),
    (AttentionInputError, {}, "rank"),
    (AttentionInputError, {"is_causal": True, "attn_mask": torch.ones(16, 16, dtype=torch.bool)}, "ok"),
    (UnknownBackendError, {"backend": "nope"}, "ok"),
    (BackendNotSupportedError, {"backend": "flex", "policy": "strict"}, "head_dim_4"),
])
def test_errors_inside_compile_are_the_eager_errors(error, kwargs, args):
    q, k, v = tiny()
    if args == "head_dim_mismatch":
        k = torch.randn(1, 16, 2, 8)
    elif args == "rank":
        q, k, v = q[0], k[0], v[0]
    elif args == "head_dim_4":
        q, k, v = tiny(d=4)
    fn = model(**kwargs)
    with pytest.raises(error):
        fn(q, k, v)
    with pytest.raises(error):
        torch.compile(fn, backend="eager")(q, k, v)


def test_checks_still_run_inside_compile():
    q, k, v = tiny()
    q[0, 3, 1, 2] = float("nan")
    fn = model(backend="native")
    torch.compile(fn, backend="eager")(q, k, v)  # checks off: no error
    torch._dynamo.reset()
    with attention_checks("raise"), pytest.raises(AttentionInputError, match="NaN"):
        torch.compile(fn, backend="eager")(q, k, v)


def test_dynamic_shapes_match_eager():
    fn = model(backend="native")
    compiled = torch.compile(fn, backend="eager", dynamic=True)
    for length in (8, 12, 20, 33):
        q, k, v = tiny(s=length, seed=length)
        assert_same(compiled(q, k, v), fn(q, k, v))


def test_eager_calls_are_unchanged_after_compiling():
    q, k, v = tiny(d=4)
    torch.compile(model(backend="flex"), backend="eager")(q, k, v)
    recorder = Recorder()
    with recording(recorder):
        dispatch_attention_fn(q, k, v, backend="flex")
    (row,) = recorder.snapshot()["rows"]
    assert row["served"] == "native" and any("head dim 4" in r for r in row["reasons"])
