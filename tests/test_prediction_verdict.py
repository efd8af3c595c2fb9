"""The prediction-level verdict on approximate kernels (dispatcher/prediction.py), with real tuning on the CPU.

A small model of six attention blocks (no residual: each block's error carries into the next, as errors compound
over a DiT's blocks and steps) and two fake approximate kernels, both "fine per call" (relative error within the
approximate class's bound of 1e-1, so `auto_fast`'s per-block verdicts admit them): one 8e-2 off on every call, which
compounds to a prediction 0.6 off; one 1e-3 off, whose prediction stays within MODEL_BOUND. The verdict refuses the
first and admits the second; without a verdict the per-call rule alone lets the bad one serve. A third bad one is
slower than the exact kernel, so no timing and no step choice would pick it: the trial must run it all the same
(issue 42: a trial the sparse kernel served on no block, or on one, was "admitted" at 0.0 or 2.3e-3 off).
"""

from __future__ import annotations

import pytest
import torch

import dispatcher
from dispatcher import Recorder, auto, dispatch_attention_fn, model_scope, prediction, prediction_trial
from dispatcher.auto import Tuner
from helpers import fake_clock
from helpers.tensors import sdpa

BLOCKS, HEADS, DIM, TOKENS = 6, 2, 16, 64
CLOCK = fake_clock.FakeClock()
exact_kernel = CLOCK.kernel(20)


def scaled(factor):
    """Exact attention times `factor`: a relative error of |factor - 1| on every call, always the same way."""
    return CLOCK.kernel(5, fn=lambda q, k, v: sdpa(q, k, v) * factor)


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    fake_clock.use(monkeypatch, CLOCK)
    names = ("t_sparse_bad", "t_sparse_good", "t_exact", "t_sparse_slow")
    dispatcher.register_backend(names[0], scaled(1.08), devices=("cpu",), approximate=True, error_bound=1e-1)
    dispatcher.register_backend(names[1], scaled(1.001), devices=("cpu",), approximate=True, error_bound=1e-1)
    dispatcher.register_backend(names[2], exact_kernel, devices=("cpu",))
    dispatcher.register_backend(names[3], CLOCK.kernel(40, fn=lambda q, k, v: sdpa(q, k, v) * 1.08),
                                devices=("cpu",), approximate=True, error_bound=1e-1)
    dispatcher.registry.set_priority(names + tuple(dispatcher.registry.names()))
    yield names[:3]
    prediction.forget()


def weights(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(3, HEADS * DIM, HEADS * DIM, generator=gen) / (HEADS * DIM) ** 0.5 for _ in range(BLOCKS)]


def forward(x, model: str, w, backend="auto_fast", recorder=None, blocks=BLOCKS):
    """The model's prediction: six self-attention blocks (the first `blocks` of them), each its own call site."""
    for i, (wq, wk, wv) in enumerate(w[:blocks]):
        q, k, v = ((x @ m).unflatten(-1, (HEADS, DIM)) for m in (wq, wk, wv))
        x = dispatch_attention_fn(q, k, v, backend=backend, call_site=f"self #{i}", model=model,
                                  recorder=recorder).flatten(-2) * 3.0  # keeps the scale through the blocks
    return x


def judged(model: str, x, w, recorder=None, **kw):
    """Ask for `model`'s verdict and make it: the forward with approximate kernels refused, then allowed."""
    prediction.require(model)
    return prediction_trial.judge(model, lambda: forward(x, model, w, **kw),
                            lambda: forward(x, model, w, recorder=recorder, **kw), recorder=recorder)


def inputs(seed=1):
    return torch.randn(1, TOKENS, HEADS * DIM, generator=torch.Generator().manual_seed(seed))


def served(rec) -> set[str]:
    return {row["served"] for row in rec.snapshot()["rows"]}


def served_next(x, model: str, w) -> set[str]:
    """What served the model's next forward."""
    rec = Recorder()
    forward(x, model, w, recorder=rec)
    return served(rec)


def setup(tmp_path, backends):
    return auto.using(Tuner(cache_path=tmp_path / "tune.json", backends=backends))


def test_the_per_call_rule_alone_lets_a_kernel_that_ruins_the_prediction_serve(kernels, tmp_path):
    bad, _, exact = kernels
    x, w = inputs(), weights()
    with setup(tmp_path, (bad, exact)), model_scope("m-unjudged"):
        reference = forward(x, "m-unjudged", w, backend=exact)
        rec = Recorder()
        got = forward(x, "m-unjudged", w, recorder=rec)
    assert served(rec) == {bad}  # each block's verdict admitted it: 8e-2 is within its 1e-1
    assert prediction_trial.relative_difference(got, reference) > 0.5


def test_a_kernel_fine_per_call_that_ruins_the_prediction_is_refused(kernels, tmp_path):
    bad, _, exact = kernels
    x, w = inputs(), weights()
    with setup(tmp_path, (bad, exact)) as tuner:
        prediction.require("m-bad")
        rec = Recorder()
        before = forward(x, "m-bad", w, recorder=rec)
        assert served(rec) == {exact}  # pending: it waits for the verdict
        trial = Recorder()
        verdict, out = prediction_trial.judge("m-bad", lambda: forward(x, "m-bad", w),
                                        lambda: forward(x, "m-bad", w, recorder=trial), recorder=trial)
        assert served(trial) == {bad}  # the candidate forward ran it, on every block
        assert verdict.status == prediction.REFUSED and verdict.rel_error > 0.5 and verdict.bound == 2e-2
        assert (verdict.served, verdict.calls) == (BLOCKS, BLOCKS)
        torch.testing.assert_close(out, before)  # the prediction returned is the reference's
        rec = Recorder()
        after = forward(x, "m-bad", w, recorder=rec)
        assert served(rec) == {exact}
        torch.testing.assert_close(after, before)
        skipped = [dict(r.skipped).get(bad) for r in tuner.records() if r.model == "m-bad" and r.block == "self #0"]
    assert any(why and why[0].startswith("an approximate kernel: refused for this model by its prediction off by")
               for why in skipped), skipped
    assert verdict.text.startswith(f"sparse refused: prediction off by {verdict.rel_error:.1e} over 6 of 6 calls > ")


def test_the_trial_runs_an_approximate_kernel_on_every_block_it_is_admitted_on_however_slow(tmp_path, kernels):
    """Slower than the exact kernel, timing alone (per signature or the step's replay) keeps it out of the trial's
    forward; the trial runs it on every block all the same, and the verdict refuses it."""
    _, _, exact = kernels
    x, w = inputs(), weights()
    with setup(tmp_path, ("t_sparse_slow", exact)) as tuner:
        trial = Recorder()
        verdict, _ = judged("m-slow", x, w, trial)
        chosen = {r.block: (r.chosen, r.source) for r in tuner.records() if r.model == "m-slow" and not r.exact}
    assert served(trial) == {"t_sparse_slow"}
    assert set(chosen.values()) == {("t_sparse_slow", "prediction trial")}, chosen
    assert verdict.status == prediction.REFUSED and (verdict.served, verdict.calls) == (BLOCKS, BLOCKS)


def test_a_trial_no_approximate_kernel_served_decides_nothing(kernels, tmp_path):
    """Nothing approximate ran, so the two predictions agree: that is no evidence; the verdict stays pending, the
    host tries again at its next model call, MAX_TRIALS times at most, and approximate kernels keep waiting."""
    bad, _, exact = kernels
    x, w = inputs(), weights()
    with setup(tmp_path, (bad, exact)):
        prediction.require("m-none")
        for trial in range(1, prediction.MAX_TRIALS + 1):
            assert prediction.due("m-none")
            verdict, out = prediction_trial.judge("m-none", lambda: forward(x, "m-none", w, backend=exact),
                                            lambda: forward(x, "m-none", w, backend=exact))
            assert verdict.status == prediction.PENDING == prediction.status("m-none")
            assert (verdict.served, verdict.calls, verdict.rel_error, verdict.trials) == (0, BLOCKS, 0.0, trial)
        assert not prediction.due("m-none")
        assert verdict.text == ("sparse: no verdict yet: the trial forward's 6 attention calls got no approximate "
                                "kernel; not tried again after 3 trials: approximate kernels stay off")
        assert served_next(x, "m-none", w) == {exact}


def test_an_admission_covers_only_the_blocks_the_trial_ran_it_on(kernels, tmp_path):
    """A block the trial forward did not run an approximate kernel on was not judged: it stays exact."""
    _, good, exact = kernels
    x, w = inputs(), weights()
    with setup(tmp_path, (good, exact)) as tuner:
        verdict, _ = judged("m-part", x, w, blocks=3)
        assert verdict.status == prediction.ADMITTED and (verdict.served, verdict.calls) == (3, 3)
        assert verdict.sites == ("self #0", "self #1", "self #2")
        assert " over 3 of 3 calls " in verdict.text
        rec = Recorder()
        forward(x, "m-part", w, recorder=rec)
        skipped = {r.block: dict(r.skipped).get(good) for r in tuner.records() if r.model == "m-part"}
    rows = {row["site"]: row["served"] for row in rec.snapshot()["rows"]}
    assert rows == {**{f"self #{i}": good for i in range(3)}, **{f"self #{i}": exact for i in range(3, BLOCKS)}}
    assert skipped["self #4"][0].startswith("an approximate kernel: block self #4 ran exactly in this model's "
                                            "prediction-level trial"), skipped


def test_a_kernel_that_keeps_the_prediction_is_admitted_and_serves(kernels, tmp_path):
    _, good, exact = kernels
    x, w = inputs(), weights()
    with setup(tmp_path, (good, exact)):
        reference = forward(x, "m-good", w, backend=exact)
        verdict, out = judged("m-good", x, w)
        assert verdict.status == prediction.ADMITTED and 1e-3 < verdict.rel_error < prediction.MODEL_BOUND
        assert (verdict.served, verdict.calls) == (BLOCKS, BLOCKS)
        assert verdict.text == f"sparse: prediction off by {verdict.rel_error:.1e} over 6 of 6 calls (within 2e-02)"
        torch.testing.assert_close(out, reference, atol=0.05, rtol=0.05)
        assert served_next(x, "m-good", w) == {good}


def test_a_nan_prediction_is_refused_and_a_failed_forward_decides_nothing(kernels, tmp_path):
    bad, _, exact = kernels
    x, w = inputs(), weights()

    def nan_forward():
        forward(x, "m-nan", w, backend=bad)  # an approximate kernel served it
        return torch.tensor([1.0, float("nan"), 1.0])
    verdict, out = prediction_trial.judge("m-nan", lambda: torch.ones(3), nan_forward)
    assert verdict.status == prediction.REFUSED and verdict.rel_error == float("inf")
    torch.testing.assert_close(out, torch.ones(3))

    def broken():
        raise RuntimeError("out of memory")
    with pytest.raises(RuntimeError, match="out of memory"):
        prediction_trial.judge("m-oom", lambda: torch.ones(3), broken)
    assert prediction.status("m-oom") == prediction.PENDING and prediction.verdict("m-oom") is None


def test_only_approximate_kernels_wait(kernels, tmp_path):
    """Quantised and exact kernels are not held back by a pending verdict; auto_exact never sees either class."""
    from dispatcher.support import for_auto
    prediction.require("m-pending")
    call = dispatcher.AttentionInputs.of(1, HEADS, TOKENS, DIM, dtype=torch.float32, device="cpu")
    assert for_auto("t_sparse_bad", call, exact_only=False, model="m-pending").rules == (
        "an approximate kernel: waits for this model's prediction-level verdict (its first step, judged with and "
        "without approximate kernels)",)
    assert for_auto("t_sparse_bad", call, exact_only=False, model="another").runs
    assert for_auto("t_exact", call, exact_only=False, model="m-pending").runs
    assert "t_sparse_bad" in prediction_trial.available_here()
