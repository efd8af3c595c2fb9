"""sol_attn's options on the ComfyUI side, without ComfyUI: the Sparse Attention Options node (tau, dense blocks,
minimum tokens; checked at queue time), and what Set Attention Backend's override does with them: calls too short or
from a dense block go dense (delegated, with the reason), tau reaches the kernel. sol_attn itself needs an NVIDIA
GPU; here a CPU stand-in under its name records the tau it is called with (tests/gpu runs the real kernel)."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import importlib

import pytest
import torch

from helpers import node_stub, tensors
from helpers.pack import CALLS, PACK, comfy_func, load_pack

adapter, dispatcher, _ = load_pack()
kitchen = importlib.import_module(f"{PACK}.dispatcher.backends.kitchen")
registry = importlib.import_module(f"{PACK}.dispatcher.registry")

qkv = functools.partial(tensors.qkv, b=1, h=2, d=128, flat=True, dtype=torch.float32)  # ComfyUI's (B, L, H*D)


@pytest.fixture
def nodes(monkeypatch):
    return node_stub.install(monkeypatch)


@pytest.fixture(autouse=True)
def no_calls():
    CALLS.clear()
    yield
    CALLS.clear()


GOOD = {"tau": 1.3, "dense_blocks": "0, 1, 47-49", "min_tokens": 12288}


def test_good_options_pass_and_make_the_options(nodes):
    assert nodes.SparseAttentionOptions.check_inputs(**GOOD) is True
    (options,) = nodes.SparseAttentionOptions.execute(**GOOD).result
    assert options == kitchen.SolAttnOptions(tau=1.3, min_tokens=12288, dense_blocks=frozenset({0, 1, 47, 48, 49}))
    assert nodes.SparseAttentionOptions.check_inputs(**{**GOOD, "dense_blocks": ""}) is True


@pytest.mark.parametrize("field, value, expected", [
    ("tau", 4.5, "tau: 4.5 is above the maximum 4"),
    ("tau", -0.5, "tau: -0.5 is below the minimum 0"),
    ("tau", float("nan"), "tau: nan is not a finite number"),
    ("tau", "abc", "tau: 'abc' is not a number"),
    ("min_tokens", -1, "min_tokens: -1 is below the minimum 0"),
    ("min_tokens", 2.5, "min_tokens: 2.5 is not a whole number"),
    ("dense_blocks", "0, 1, last", "dense_blocks: 'last' is not a block number or a range; write block numbers "
                                   "from 0 and ranges a-b, separated by commas, e.g. '0, 1, 47-49'"),
    ("dense_blocks", "49-47", "dense_blocks: the range '49-47' runs backwards; write it 47-49"),
    ("dense_blocks", None, "dense_blocks:"),
])
def test_bad_options_are_refused_at_queue_time_naming_the_input(nodes, field, value, expected):
    answer = nodes.SparseAttentionOptions.check_inputs(**{**GOOD, field: value})
    assert isinstance(answer, str) and expected in answer, answer


HOSTILE = {
    # 300 ranges of 100,000 blocks (5 KB): once 3-14 s of a blocked ComfyUI and 2.4 GB, expanded before any check
    "300 huge ranges": (", ".join(f"{i * 100_001}-{i * 100_001 + 100_000}" for i in range(300)), "at most"),
    "one huge range": ("0-99999999", "past the highest block number accepted"),
    "two wide ranges": ("0-50000, 60000-99999", "at most"),
    "many numbers": (", ".join(str(i) for i in range(2000)), "at most"),
    "a megabyte": ("1" * 1_000_000, "characters long, at most"),
}


@pytest.mark.parametrize("text, expected", HOSTILE.values(), ids=HOSTILE.keys())
def test_huge_dense_blocks_are_refused_in_milliseconds_before_any_is_expanded(nodes, text, expected):
    import time
    import tracemalloc
    tracemalloc.start()
    try:
        start = time.perf_counter()
        answer = nodes.SparseAttentionOptions.check_inputs(**{**GOOD, "dense_blocks": text})
        took = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert isinstance(answer, str) and expected in answer and "dense_blocks" in answer, answer
    assert len(answer) < 400, answer  # the refusal names the problem, it does not echo the text
    assert took < 0.05, f"{took:.3f} s"
    assert peak < 3 * len(text) + 1_000_000, f"{peak} bytes allocated for {len(text)} characters"


def test_the_largest_accepted_dense_blocks_still_parse(nodes):
    text = f"0-{kitchen.MAX_DENSE_BLOCKS - 1}"
    assert nodes.SparseAttentionOptions.check_inputs(**{**GOOD, "dense_blocks": text}) is True
    assert len(kitchen.parse_dense_blocks(text)[0]) == kitchen.MAX_DENSE_BLOCKS


def test_execute_refuses_what_validation_refuses(nodes):
    with pytest.raises(ValueError, match="Sparse Attention Options: dense_blocks: 'x' is not a block number"):
        nodes.SparseAttentionOptions.execute(tau=1.0, dense_blocks="x", min_tokens=0)


def test_the_set_node_passes_the_options_to_sol_attn_only(nodes):
    options = kitchen.SolAttnOptions(tau=2.0, min_tokens=0)
    (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "sol_attn", "fallback", 0.0, 1.0,
                                             sparse=options).result
    assert m.override.sparse_options == options
    (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "sol_attn", "fallback", 0.0, 1.0).result
    assert m.override.sparse_options == kitchen.SolAttnOptions()  # ComfyUI's node defaults, tau as comfy_kitchen's
    (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "native", "fallback", 0.0, 1.0,
                                             sparse=options).result
    assert m.override.sparse_options is None


def test_short_sequences_and_dense_blocks_go_dense_with_the_reason():
    rec = dispatcher.Recorder()
    options = kitchen.SolAttnOptions(min_tokens=32, dense_blocks=frozenset({1}))
    fn = adapter.make_override("sol_attn", recorder=rec, sparse=options)
    short, long = qkv(lq=16), qkv(lq=64, seed=1)
    fn(comfy_func, *short, 2, transformer_options={"block_index": 0, "total_blocks": 4})
    fn(comfy_func, *long, 2, transformer_options={"block_index": 1, "total_blocks": 4})
    fn(comfy_func, *long, 2, transformer_options={"block_index": 2, "total_blocks": 4})
    assert len(CALLS) == 2  # the two dense calls ran ComfyUI's own attention
    dense = [r for r in rec.snapshot()["rows"] if r["served"] == "comfy:comfy_func"]  # a row per block
    assert sum(r["calls"] for r in dense) == 2
    reasons = {why for r in dense for why in r["reasons"]}
    # the machine's reason first: on this CPU sol_attn would not serve the longer calls either (issue #41)
    for rule in ("16 tokens < min_tokens 32: short sequences run faster dense", "block 1 is in dense_blocks"):
        (why,) = [why for why in reasons if why.endswith(rule)]
        assert why.startswith("sol_attn cannot run on this machine (") and "needs an NVIDIA CUDA GPU" in why, why
    # block 2 of 64 tokens was sol_attn's: on this CPU it falls back along its chain, and says why
    sparse_row = next(r for r in rec.snapshot()["rows"] if r["requested"] == "sol_attn" and
                      not r["served"].startswith("comfy:"))
    assert sparse_row["served"] in ("_native_flash", "native")
    assert any("needs an NVIDIA CUDA GPU" in reason for reason in sparse_row["reasons"])


@pytest.fixture
def cpu_sol_attn():
    """A CPU stand-in registered under sol_attn's name (same declaration, but CPU and float32): exact attention that
    records the tau of the `sol_attn_options` it runs under."""
    original = registry.get("sol_attn")
    seen = []

    def stand_in(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
        seen.append(kitchen._options.get().tau)
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    registry.add(dataclasses.replace(original, fn=stand_in, devices=frozenset({"cpu"}),
                                     dtypes=frozenset({torch.float32}), capability=None, requires=()), replace=True)
    try:
        yield seen
    finally:
        registry.add(original, replace=True)


def test_tau_reaches_the_kernel(cpu_sol_attn):
    rec = dispatcher.Recorder()
    fn = adapter.make_override("sol_attn", recorder=rec, sparse=kitchen.SolAttnOptions(tau=2.5, min_tokens=0))
    q, k, v = qkv(lq=64)
    out = fn(comfy_func, q, k, v, 2, transformer_options={})
    assert cpu_sol_attn == [2.5] and not CALLS
    assert {r["served"] for r in rec.snapshot()["rows"]} == {"sol_attn"}
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.unflatten(-1, (2, 128)).transpose(1, 2) for t in (q, k, v))).transpose(1, 2).flatten(2)
    torch.testing.assert_close(out, ref)
    assert kitchen._options.get().tau == kitchen.DEFAULT_TAU  # the scope ends with the call


def test_the_python_scope_checks_tau():
    with kitchen.sol_attn_options(1.5) as options:
        assert kitchen._options.get() is options
    with pytest.raises(ValueError, match=r"sol_attn: tau must be a number from 0 to 4 \(higher is sparser\); got 7"):
        with kitchen.sol_attn_options(7):
            pass


@dataclasses.dataclass(frozen=True)
class Width:
    """Options of a test backend: another backend's own options, declared the way kitchen.py declares sol_attn's."""
    width: int = 4

    def applied(self):
        return _width_scope(self)

    def dense_reason(self, tokens, block):
        return "block 0 stays dense" if block == 0 else None

    def as_dict(self):
        return {"width": self.width}


_WIDTH = contextvars.ContextVar("width", default=None)


@contextlib.contextmanager
def _width_scope(options):
    token = _WIDTH.set(options)
    try:
        yield options
    finally:
        _WIDTH.reset(token)


@pytest.fixture
def own_options_backend():
    """A CPU backend whose spec declares its own options: what its kernel sees of them."""
    declared = importlib.import_module(f"{PACK}.dispatcher.backend_options")
    spec_module = importlib.import_module(f"{PACK}.dispatcher.spec")
    seen = []

    def kernel(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse):
        seen.append(_WIDTH.get())
        return torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    options = declared.BackendOptions(fields=(declared.Option("width", "int", 4, minimum=1, maximum=64),),
                                      build=lambda width=4: (Width(width), []), default=Width())
    registry.add(spec_module.BackendSpec(name="t_own_options", family="test", description="test", fn=kernel,
                                         devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}),
                                         head_dims=spec_module.HeadDims(1, 256), options=options, custom=True))
    try:
        yield seen
    finally:
        registry.remove("t_own_options")


def test_a_backends_declared_options_reach_its_kernel_through_the_set_node(nodes, own_options_backend):
    """Nothing in nodes/ names the backend: the Set node and the override read its spec's declaration."""
    (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "t_own_options", "fallback", 0.0, 1.0,
                                             sparse=Width(16)).result
    q, k, v = qkv(lq=64)
    m.override(comfy_func, q, k, v, 2, transformer_options={"block_index": 1, "total_blocks": 4})
    assert own_options_backend == [Width(16)] and not CALLS
    m.override(comfy_func, q, k, v, 2, transformer_options={"block_index": 0, "total_blocks": 4})
    assert len(CALLS) == 1 and own_options_backend == [Width(16)]  # its dense_reason passed block 0 on
    assert _WIDTH.get() is None  # the scope ends with the call
    # sol_attn's options given to this backend are not its own: its declared default runs
    (m,) = nodes.SetAttentionBackend.execute(node_stub.FakeModel(), "t_own_options", "fallback", 0.0, 1.0,
                                             sparse=kitchen.SolAttnOptions()).result
    m.override(comfy_func, q, k, v, 2, transformer_options={"block_index": 1, "total_blocks": 4})
    assert own_options_backend[-1] == Width()
