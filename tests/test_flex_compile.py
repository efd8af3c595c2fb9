"""flex inside a model compiled by inductor on the CPU, as ComfyUI's TorchCompileModel compiles it (issue #15).

Two ways used to fail there, each with a route of its own:
- symbolic sizes (torch.compile turns them on once a size changes): the call is the dispatcher's op, run eagerly
  by the compiled graph. AOT autograd runs each graph's first call under a TorchDispatchMode (its custom-op
  aliasing check), whose handler turns functorch off, and eager flex_attention needs vmap: "NotImplementedError:
  Cannot access storage of BatchedTensorImpl", and flex fell back to native for that signature from then on.
- static sizes: flex was traced into the graph and inductor lowered it with its C++ template, which reads four
  sizes from the storage under q/k/v; ComfyUI's q/k/v are 4-D views of (B, L, H*D) results: "LoweringException:
  ValueError: not enough values to unpack (expected 4, got 2)", and the prompt failed (the template's other
  failures: dispatcher/backends/flex.py, _cpu_op). On the CPU flex now runs there as one op (eager flex).
Each test compiles a small ComfyUI-like block (projections whose (B, L, H*D) results are viewed as heads, masks
made inside the graph) with the masks ComfyUI passes: none, (Lq, Lk) and (B, 1, Lq, Lk), additive float.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dispatcher import Recorder, dispatch_attention_fn
from dispatcher.backends.flex import vmap_enabled

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile",
                                        "ignore:return_lse is deprecated")

HEADS, DIM, WIDTH = 2, 64, 32


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Block(torch.nn.Module):
    """Cross-attention with a (Lq, Lk) mask, self-attention with a (B, 1, Lq, Lk) mask and self-attention with
    no mask, every call through the dispatcher with backend="flex"."""

    def __init__(self, recorder, heads=HEADS, dim=DIM, attend=None):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.heads, self.dim = heads, dim
        self.proj = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(WIDTH, heads * dim, generator=gen) / WIDTH ** 0.5) for _ in range(6)])
        self.recorder = recorder
        self.attend = attend or self.dispatch

    def dispatch(self, q, k, v, mask, site):
        return dispatch_attention_fn(q, k, v, attn_mask=mask, backend="flex", call_site=site, recorder=self.recorder)

    def heads_of(self, x, i):
        # ComfyUI's attention gets (B, L, H*D); the pack views it as (B, L, H, D)
        return (x @ self.proj[i]).view(x.shape[0], x.shape[1], self.heads, self.dim)

    def forward(self, x, context, bias2, bias4):
        b, lq, lk = x.shape[0], x.shape[1], context.shape[1]
        mask2 = (bias2 * 2).view(lq, lk)  # made inside the graph, like ComfyUI's masks
        c = self.attend(self.heads_of(x, 3), self.heads_of(context, 4), self.heads_of(context, 5), mask2, "2d")
        mask4 = (bias4 - 1).view(b, 1, lq, lq)
        s = self.attend(self.heads_of(x, 0) * 0.5, self.heads_of(x, 1), self.heads_of(x, 2), mask4, "4d")
        # The unmasked call last: test_a_masked_call_after_an_unmasked_one_traces_without_break says why.
        a = self.attend(self.heads_of(x, 0), self.heads_of(x, 1), self.heads_of(x, 2), None, "none")
        return a + c + s


def sdpa(q, k, v, mask, site):
    """The exact reference: SDPA in float64 with the same masks (broadcast by SDPA's own rules)."""
    t = lambda z: z.double().transpose(1, 2)  # noqa: E731
    return F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=None if mask is None else mask.double()
                                           ).transpose(1, 2).float()


def inputs(b=2, lq=16, lk=24, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(b, lq, WIDTH, generator=gen), torch.randn(b, lk, WIDTH, generator=gen),
            torch.randn(lq * lk, generator=gen), torch.randn(b * lq * lq, generator=gen))


def assert_flex_served_every_call(recorder, calls_per_site):
    snapshot = recorder.snapshot()
    rows = {row["site"]: row for row in snapshot["rows"]}
    assert set(rows) == {"none", "2d", "4d"}, snapshot
    for row in rows.values():
        assert (row["requested"], row["served"], row["fell_back"], row["reasons"]) == ("flex", "flex", False, []), \
            snapshot
        assert row["calls"] == calls_per_site if calls_per_site else row["calls"] >= 1, snapshot
    assert not snapshot["errors"], snapshot


def check(compiled, block, reference, args):
    with torch.no_grad():
        out = compiled(*args)
        expected = reference(*args)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)


def test_flex_serves_every_call_with_symbolic_sizes_under_inductor():
    """The dispatcher's op route: every run decides and is counted; each new graph's first run is the one AOT
    autograd checks under its dispatch mode."""
    assert torch._functorch.config.check_custom_op_aliasing  # what put flex inside a dispatch mode's handler
    recorder = Recorder()
    block = Block(recorder)
    reference = Block(None, attend=sdpa)
    reference.load_state_dict(block.state_dict())
    compiled = torch.compile(block, backend="inductor", dynamic=True)
    for lq, lk in ((16, 24), (20, 9), (16, 24)):
        check(compiled, block, reference, inputs(lq=lq, lk=lk, seed=lq + lk))
    assert_flex_served_every_call(recorder, calls_per_site=3)


@pytest.mark.slow
@pytest.mark.parametrize("dim", [DIM, 16])
def test_flex_serves_every_call_with_static_sizes_under_inductor(dim):
    """The traced route: flex is traced into the caller's graph, without a break, and inductor compiles it there
    (each run of the graph counts its calls, once per run, not once per trace: a graph compiled for one prompt
    counts in the next). Head dim 16 is one that inductor's C++ flex template gets wrong unless padded."""
    recorder = Recorder()
    block = Block(recorder, dim=dim)
    reference = Block(None, dim=dim, attend=sdpa)
    reference.load_state_dict(block.state_dict())
    args = inputs()
    with torch.no_grad():  # as ComfyUI samples; flex has no backward on the CPU
        explanation = torch._dynamo.explain(block)(*args)
    assert explanation.graph_break_count == 0, [b.reason for b in explanation.break_reasons]
    torch._dynamo.reset()
    recorder.clear()  # explain ran the block once
    compiled = torch.compile(block, backend="inductor")
    check(compiled, block, reference, args)
    check(compiled, block, reference, inputs(seed=2))
    assert_flex_served_every_call(recorder, calls_per_site=2)
    recorder.clear()  # the next prompt: the graph is cached, no trace, and its calls still count
    check(compiled, block, reference, inputs(seed=3))
    assert_flex_served_every_call(recorder, calls_per_site=1)


@pytest.mark.parametrize("backend", ["native", "flex"])
def test_a_masked_call_after_an_unmasked_one_in_one_graph(backend):
    """A 3-D mask is (H, Lq, Lk) as SDPA reads it (1, H, Lq, Lk); flex takes it through the 4-D view, native as
    given. The traced route once handed a masked call after an unmasked one in one graph the first call's mask
    handling (dynamo reads compiled.py's candidate cache as it was at its first read in the frame)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 16, 2, DIM, generator=gen) for _ in range(3))  # batch 2, heads 2
    bias = torch.randn(2, 16, 16, generator=gen)

    def block(q, k, v, bias):
        out = dispatch_attention_fn(q, q, q, backend=backend)
        return out + dispatch_attention_fn(q, k, v, attn_mask=bias * 2, backend=backend)
    seen = []

    def spy(gm, example_inputs):  # the traced graph as dynamo hands it over, run as traced
        seen.append(gm)
        return gm.forward
    with torch.no_grad():
        out = torch.compile(block, backend=spy)(q, k, v, bias)
        expected = block(q, k, v, bias)
        sdpa = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, q, q))).transpose(1, 2) + \
            F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)), attn_mask=bias * 2).transpose(1, 2)
    assert len(seen) == 1  # one graph, no break
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(expected, sdpa, atol=2e-5, rtol=1e-4)


def test_eager_flex_runs_inside_a_dispatch_mode_handler():
    """What AOT autograd's aliasing check does to the op's body, without compiling: the body runs from a
    TorchDispatchMode's handler, where functorch's keys are excluded. flex still serves it, exactly."""
    from torch.utils._python_dispatch import TorchDispatchMode

    recorder = Recorder()
    q, k, v = (torch.randn(2, 16, HEADS, DIM, generator=torch.Generator().manual_seed(i)) for i in range(3))
    mask = torch.randn(2, 1, 16, 16)
    seen = {}

    class Handler(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.add.Tensor and "out" not in seen:  # the op whose body runs here
                seen["functorch_off"] = torch._C._dispatch_tls_local_exclude_set().has(
                    torch._C.DispatchKey.FuncTorchDynamicLayerFrontMode)
                seen["out"] = dispatch_attention_fn(q, k, v, attn_mask=mask, backend="flex", recorder=recorder)
            return func(*args, **(kwargs or {}))

    with Handler():
        torch.ones(1) + 1
    assert seen["functorch_off"]
    torch.testing.assert_close(seen["out"], sdpa(q, k, v, mask, ""), atol=2e-5, rtol=1e-4)
    (row,) = recorder.snapshot()["rows"]
    assert (row["served"], row["fell_back"], row["reasons"]) == ("flex", False, []), row


def test_vmap_enabled_changes_nothing_outside_a_handler_or_inside_a_transform():
    before = torch._C._dispatch_tls_local_exclude_set()
    with vmap_enabled():
        assert torch._C._dispatch_tls_local_exclude_set() == before

    def inside(x):
        with vmap_enabled():
            return x * 2
    torch.testing.assert_close(torch.vmap(inside)(torch.arange(4.0)), torch.arange(4.0) * 2)
