"""The active backend, policy and checks: environment, process defaults, scoped overrides, threads."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import dispatcher
from dispatcher import (BackendUnavailableError, Recorder, UnknownBackendError, active_backend, active_checks,
                        active_policy, attention_backend, attention_checks, dispatch_attention_fn, fallback_policy,
                        recording, set_attention_backend, set_checks)
from dispatcher import report, state
from helpers import tensors

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def small_qkv():
    q = torch.randn(1, 4, 1, 8)
    return q, torch.randn(1, 4, 1, 8), torch.randn(1, 4, 1, 8)


def served_by(**kwargs) -> str:
    recorder = Recorder()
    with recording(recorder):
        dispatch_attention_fn(*small_qkv(), **kwargs)
    (row,) = recorder.snapshot()["rows"]
    return row["served"]


# --- DIFFUSERS_ATTN_BACKEND -------------------------------------------------------------------------

def test_default_is_native():
    assert active_backend() == "native"
    assert served_by() == "native"


def test_env_sets_the_default(monkeypatch):
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "flex")
    assert active_backend() == "flex"  # read lazily, on first use
    assert served_by() == "flex"
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "_native_math")
    assert active_backend() == "flex"  # read once ...
    state.reset_default_backend()
    assert active_backend() == "_native_math"  # ... until reset


def test_env_value_is_stripped(monkeypatch):
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "  flex \n")
    state.reset_default_backend()
    assert active_backend() == "flex"


def test_invalid_env_value_logs_and_uses_native(monkeypatch, caplog):
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "sagee")
    state.reset_default_backend()
    with caplog.at_level(logging.ERROR, logger="attention_dispatch"):
        assert active_backend() == "native"
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert "DIFFUSERS_ATTN_BACKEND=sagee" in errors[0] and "Did you mean 'sage'?" in errors[0]
    assert "using 'native'" in errors[0]
    assert served_by() == "native"


# --- set_attention_backend -------------------------------------------------------------------------

def test_set_attention_backend_validates():
    with pytest.raises(UnknownBackendError):
        set_attention_backend("nope")
    with pytest.raises(TypeError):
        set_attention_backend(3)
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="needs an NVIDIA CUDA GPU; this machine has a CPU$"):
            set_attention_backend("flash")
    assert active_backend() == "native"  # a failed set changes nothing
    set_attention_backend("flex")
    assert active_backend() == "flex" and served_by() == "flex"


def test_set_attention_backend_beats_the_env(monkeypatch):
    monkeypatch.setenv("DIFFUSERS_ATTN_BACKEND", "flex")
    set_attention_backend("_native_math")
    assert active_backend() == "_native_math"


def test_every_process_default_reaches_the_next_call():
    """The eager path reads the process defaults worked out once per change (state.current): each setter must
    reach the very next call, after calls that used the old value."""
    assert served_by() == "native"
    set_attention_backend("_native_math")
    assert served_by() == "_native_math"
    state.reset_default_backend()
    assert served_by() == "native"
    dispatcher.set_fallback_policy("strict")
    assert state.current()[0][1] == "strict"
    dispatcher.set_quality_guard("all", 7)
    assert state.current()[0][3] == ("all", 7)
    set_checks("warn")
    assert state.current()[1] == "warn" and active_checks() == "warn"


def test_blocks_of_different_settings_nest_and_unwind():
    with attention_backend("_native_math"), dispatcher.model_scope("m1"), dispatcher.quality_guard("all", 3):
        with dispatcher.fallback_policy("strict"), dispatcher.attention_checks("warn"):
            assert state.current() == (("_native_math", "strict", "m1", ("all", 3)), "warn")
        assert state.current() == (("_native_math", "fallback", "m1", ("all", 3)), "off")
        assert served_by() == "_native_math"
    assert state.current() == (("native", "fallback", "unscoped", dispatcher.guard.DEFAULT), "off")


# --- attention_backend() ---------------------------------------------------------------------------

def test_context_manager_restores_on_exit():
    with attention_backend("flex") as name:
        assert name == "flex" and active_backend() == "flex"
        assert served_by() == "flex"
    assert active_backend() == "native"


def test_context_manager_restores_on_exception():
    with pytest.raises(KeyError):
        with attention_backend("flex"):
            raise KeyError("boom")
    assert active_backend() == "native"


def test_context_managers_nest():
    set_attention_backend("_native_flash")
    with attention_backend("flex"):
        with attention_backend("_native_math"):
            assert active_backend() == "_native_math"
            with attention_backend("native"):
                assert active_backend() == "native"
            assert active_backend() == "_native_math"
        assert active_backend() == "flex"
    assert active_backend() == "_native_flash"


def test_context_manager_with_a_policy():
    with attention_backend("flex", policy="strict"):
        assert active_policy() == "strict"
        with pytest.raises(dispatcher.BackendNotSupportedError):
            dispatch_attention_fn(torch.randn(1, 4, 1, 4), torch.randn(1, 4, 1, 4), torch.randn(1, 4, 1, 4))
    assert active_policy() == "fallback"
    with pytest.raises(ValueError):
        with attention_backend("flex", policy="sometimes"):
            pass
    assert active_backend() == "native"


def test_explicit_backend_argument_beats_the_context():
    with attention_backend("flex"):
        assert served_by(backend="_native_math") == "_native_math"


def test_context_manager_is_thread_safe():
    names = ("native", "flex", "_native_math", "_native_flash") * 2  # 8 threads
    iterations = 50
    barrier = threading.Barrier(len(names))
    failures: list[str] = []
    q, k, v = small_qkv()

    def worker(index: int, name: str):
        recorder = Recorder(f"thread-{index}")
        try:
            barrier.wait()
            with recording(recorder):
                for i in range(iterations):
                    assert active_backend() == "native"
                    with attention_backend(name):
                        if active_backend() != name:
                            failures.append(f"thread {index}: active {active_backend()} != {name} at {i}")
                        dispatch_attention_fn(q, k, v)
                        if active_backend() != name:
                            failures.append(f"thread {index}: active {active_backend()} != {name} after call {i}")
            served = {row["served"] for row in recorder.snapshot()["rows"]}
            if served != {name} or recorder.served_by(name) != iterations:
                failures.append(f"thread {index} ({name}): {recorder.summary()}")
        except Exception as exc:  # collected, re-raised by the main thread
            failures.append(f"thread {index}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i, n)) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert failures == []
    assert active_backend() == "native"


def test_a_thread_started_inside_a_block_uses_the_default_unless_it_runs_in_a_copy_of_the_context():
    """Documented (state.attention_backend): the blocks are this context's; a new thread starts with an empty
    one, so it sees the process default, and `contextvars.copy_context().run` carries the blocks over."""
    import contextvars
    seen = {}

    def work(label):
        seen[label] = (active_backend(), active_policy(), served_by())

    with attention_backend("_native_math", policy="strict"):
        plain = threading.Thread(target=work, args=("plain",))
        carried = threading.Thread(target=contextvars.copy_context().run, args=(work, "carried"))
        for t in (plain, carried):
            t.start()
            t.join(timeout=60)
    assert seen["plain"] == ("native", "fallback", "native")
    assert seen["carried"] == ("_native_math", "strict", "_native_math")
    assert "copy_context().run" in dispatcher.attention_backend.__doc__


# --- policy ------------------------------------------------------------------------------------------

def test_policy_defaults_and_scopes():
    assert active_policy() == "fallback"
    with fallback_policy("strict"):
        assert active_policy() == "strict"
    assert active_policy() == "fallback"
    dispatcher.set_fallback_policy("strict")
    assert active_policy() == "strict"
    with fallback_policy("fallback"):
        assert active_policy() == "fallback"
    with pytest.raises(ValueError):
        with fallback_policy("nope"):
            pass
    with pytest.raises(ValueError):
        dispatch_attention_fn(*small_qkv(), policy="nope")


# --- checks ------------------------------------------------------------------------------------------

def test_checks_are_off_by_default():
    assert active_checks() == "off"


@pytest.mark.parametrize("value", ["yes", "1", "true", "on", "YES", "True", " on "])
def test_env_turns_checks_on(monkeypatch, value):
    monkeypatch.setenv("DIFFUSERS_ATTN_CHECKS", value)
    assert active_checks() == "raise"


@pytest.mark.parametrize("value", ["", "0", "no", "false", "off", "maybe"])
def test_env_leaves_checks_off(monkeypatch, value):
    monkeypatch.setenv("DIFFUSERS_ATTN_CHECKS", value)
    assert active_checks() == "off"


def test_set_checks_switch(monkeypatch):
    set_checks(True)
    assert active_checks() == "raise"
    set_checks("warn")
    assert active_checks() == "warn"
    monkeypatch.setenv("DIFFUSERS_ATTN_CHECKS", "1")
    set_checks(False)
    assert active_checks() == "off"  # the switch beats the env
    set_checks(None)
    assert active_checks() == "raise"  # back to following the env
    with attention_checks("warn"):
        assert active_checks() == "warn"  # a scope beats both
    with attention_checks(False):
        assert active_checks() == "off"
    assert active_checks() == "raise"
    with pytest.raises(ValueError, match="valid modes"):
        set_checks("sometimes")


def test_env_checks_raise_on_nan(monkeypatch):
    q, k, v = small_qkv()
    q[0, 0, 0, 0] = float("nan")
    dispatch_attention_fn(q, k, v)  # off: no value is read
    monkeypatch.setenv("DIFFUSERS_ATTN_CHECKS", "yes")
    with pytest.raises(dispatcher.AttentionInputError, match="query"):
        dispatch_attention_fn(q, k, v)


def test_a_report_counts_one_call_in_the_singular():
    """Issue #41: the report said "1 calls"."""
    recorder = Recorder("one")
    q, k, v = tensors.qkv(b=1, lq=4, lk=4, h=1, d=8)
    with recording(recorder):
        dispatcher.dispatch_attention_fn(q, k, v, backend="native")
    text = recorder.summary()
    assert "one: 1 attention call\n" in text and "served 1 call" in text and "1 calls" not in text, text
    assert report.counted(2, "call") == "2 calls" and report.counted(0, "call") == "0 calls"
