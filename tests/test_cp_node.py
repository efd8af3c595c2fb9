"""Replicated-input context parallelism (dispatcher.parallel.replicated), the Context Parallel Attention
node and its lockstep runtime (prompts, interrupts, prompt ends), without ComfyUI.

Worlds of 2, 3 and 4 gloo processes are spawned once each (file:// rendezvous, 127.0.0.1 only); each rank
runs every case of its table and writes its errors to JSON, one test per case reads them. Every case
compares the full output every rank gets (and the LSE) with the float64 `_native_math` attention of one
process: relative error < 1e-5 for float32 inputs, and all ranks' outputs bitwise equal.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types
import zlib
from dataclasses import dataclass

import pytest
import torch

from helpers.gloo_ranks import join_gloo, leave_gloo, spawn_ranks
from helpers.pack import PACK, comfy_func, load_pack

adapter, dispatcher, _ = load_pack()
parallel = importlib.import_module(f"{PACK}.dispatcher.parallel")
replicated = importlib.import_module(f"{PACK}.dispatcher.parallel.replicated")
cp_runtime = importlib.import_module(f"{PACK}.nodes.cp_runtime")
TOL = 1e-5


@dataclass(frozen=True)
class Case:
    name: str
    mode: str = "heads"
    via: str = "context"  # context | call | comfy (adapter override) | node (the node's override + wrapper)
    backend: str = "_native_math"
    B: int = 2
    S: int = 19
    Sk: int | None = None
    H: int = 5
    Hk: int | None = None
    D: int = 8
    layout: str = "BSHD"
    mask: str | None = None  # key_padding | per_head | additive_rows
    causal: bool = False
    return_lse: bool = True
    degree: int = 0
    skip_reshape: bool = False  # comfy/node: (B, H, L, D) inputs
    previous: str = "none"  # node: none (the node installs 'native') | sab (Set Attention Backend's) | foreign
    fail_rank: int | None = None  # this rank's local kernel raises: every rank must raise, then go on


BASE = [
    Case("heads_uneven_heads", H=5),
    Case("heads_gqa_bhsd_causal", H=6, Hk=2, layout="BHSD", causal=True),
    Case("heads_per_head_mask_native_no_lse", H=7, mask="per_head", backend="native", return_lse=False),
    Case("heads_fewer_heads_than_ranks", H=1, S=6),
    Case("heads_cross_attention_key_padding", H=4, Sk=11, mask="key_padding", via="call"),
    Case("sequence_uneven_rows_causal", mode="sequence", S=23, causal=True),
    Case("sequence_bhsd_additive_rows", mode="sequence", layout="BHSD", mask="additive_rows"),
    Case("sequence_gqa_flash", mode="sequence", H=6, Hk=3, backend="_native_flash", via="call"),
    Case("sequence_fewer_rows_than_ranks", mode="sequence", S=2, mask="key_padding"),
    Case("sequence_cross_attention_flex", mode="sequence", B=1, S=13, Sk=9, H=2, backend="flex"),
    Case("comfy_heads_b_l_hd", via="comfy", H=6, S=17, return_lse=False),
    Case("comfy_sequence_skip_reshape", via="comfy", mode="sequence", H=4, skip_reshape=True, return_lse=False,
         mask="key_padding"),
    Case("node_heads_default_native", via="node", H=6, return_lse=False),
    Case("node_sequence_after_set_attention_backend_skip_reshape", via="node", mode="sequence", previous="sab",
         skip_reshape=True, H=4, return_lse=False),
    Case("node_foreign_override_runs_whole", via="node", previous="foreign", H=4, return_lse=False),
    Case("kernel_failure_on_one_rank_stops_every_rank", fail_rank=1),
    Case("after_a_failure_the_next_call_works", mode="sequence"),
]
CASES = {
    2: BASE,
    3: BASE,
    4: [Case("heads_degree2_subgroups", degree=2, H=5), Case("sequence_degree2_subgroups", mode="sequence", degree=2),
        Case("node_heads_all_four", via="node", H=6, return_lse=False)],
}


# --- inside each spawned rank -------------------------------------------------------------------

def _mask(c: Case, gen, S, Sk):
    if c.mask is None:
        return None
    if c.mask == "key_padding":
        keep = torch.ones(c.B, 1, 1, Sk, dtype=torch.bool)
        keep[-1, ..., max(1, Sk // 3):] = False
        return keep
    if c.mask == "per_head":
        keep = torch.rand(c.B, c.H, S, Sk, generator=gen) < 0.6
        keep[..., torch.arange(S), torch.arange(S) % Sk] = True
        return keep
    if c.mask == "additive_rows":
        bias = torch.randn(c.B, S, Sk, generator=gen) * 0.5  # 3-D: (B, Lq, Lk), ComfyUI's rank rule
        bias[torch.rand(c.B, S, Sk, generator=gen) < 0.3] = float("-inf")
        bias[:, torch.arange(S), torch.arange(S) % Sk] = 0.0
        return bias
    raise ValueError(c.mask)


_configs: dict = {}


def _config(c: Case):
    key = (c.mode, c.degree)
    if key not in _configs:
        _configs[key] = replicated.ReplicatedConfig(mode=c.mode, degree=c.degree).setup()
    return _configs[key]


def _stub_comfy():
    """comfy_api / comfy.patcher_extension stand-ins (tests/helpers/node_stub.py) with the APPLY_MODEL kind too."""
    from helpers import node_stub
    for name, module in node_stub.stub_modules().items():
        sys.modules[name] = module
    sys.modules["comfy.patcher_extension"].WrappersMP = types.SimpleNamespace(OUTER_SAMPLE="outer_sample",
                                                                             APPLY_MODEL="apply_model")
    return node_stub, importlib.import_module(f"{PACK}.nodes.parallel_node")


def _comfy_call(override, c, q, k, v, mask):
    """One ComfyUI attention call through `override`, in ComfyUI's layout; returns (B, S, H, Dv)."""
    if c.skip_reshape:  # (B, H, L, D)
        out = override(comfy_func, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), q.shape[2], mask=mask,
                       skip_reshape=True, skip_output_reshape=True, transformer_options={})
        return out.transpose(1, 2)
    out = override(comfy_func, q.flatten(2), k.flatten(2), v.flatten(2), q.shape[2], mask=mask,
                   transformer_options={})
    return out.unflatten(-1, (q.shape[2], -1))


def _run_case(c: Case, rank: int) -> dict:
    gen = torch.Generator().manual_seed(zlib.crc32(c.name.encode()))
    Hk, Sk = c.Hk or c.H, c.Sk or c.S
    q = torch.randn(c.B, c.S, c.H, c.D, generator=gen)
    k = torch.randn(c.B, Sk, Hk, c.D, generator=gen)
    v = torch.randn(c.B, Sk, Hk, c.D, generator=gen)
    mask = _mask(c, gen, c.S, Sk)  # in ComfyUI's convention (3-D = (B, Lq, Lk)): what the override is given
    comfy_mask = mask
    mask = adapter.comfy_mask(mask)  # as the library reads masks (SDPA's rule): what the library is given
    gqa = Hk != c.H
    ref_mask = mask if mask is None or mask.dtype == torch.bool else mask.double()
    ref, ref_lse = dispatcher.dispatch_attention_fn(q.double(), k.double(), v.double(), ref_mask, is_causal=c.causal,
                                                    enable_gqa=gqa, backend="_native_math", policy="strict",
                                                    return_lse=True)
    cfg = _config(c)
    found = {}
    if c.via in ("context", "call"):
        qs, ks, vs = (t.transpose(1, 2) for t in (q, k, v)) if c.layout == "BHSD" else (q, k, v)
        kw = dict(is_causal=c.causal, enable_gqa=gqa, backend=c.backend, layout=c.layout, return_lse=c.return_lse)
        restore = None
        if c.fail_rank is not None and rank == c.fail_rank:
            real = dispatcher.dispatch.dispatch_attention_fn

            def broken(*a, **k_):
                raise RuntimeError("injected kernel failure")
            restore = real
            dispatcher.dispatch.dispatch_attention_fn = broken
        try:
            if c.via == "context":
                with replicated.replicated_parallel(cfg):
                    assert parallel.active_config() is None  # the sharded-CP config is not confused with ours
                    result = dispatcher.dispatch_attention_fn(qs, ks, vs, mask, **kw)
            else:
                result = replicated.replicated_attention(qs, ks, vs, mask, config=cfg, **kw)
        except Exception as exc:  # noqa: BLE001
            if c.fail_rank is None:
                raise
            return {"raised": f"{type(exc).__name__}: {exc}"}
        finally:
            if restore is not None:
                dispatcher.dispatch.dispatch_attention_fn = restore
        if c.fail_rank is not None:
            return {"raised": None}
        out, lse = result if c.return_lse else (result, None)
        if c.layout == "BHSD":
            out = out.transpose(1, 2)
            lse = None if lse is None else lse.transpose(1, 2)
    elif c.via == "comfy":
        override = adapter.make_override("native", "strict")
        with replicated.replicated_parallel(cfg):
            out = _comfy_call(override, c, q, k, v, comfy_mask)
        lse = None
        found["split_calls"] = 1
    else:  # the node's clone: override + APPLY_MODEL wrapper, as ComfyUI's sampler would run them
        node_stub, parallel_node = _stub_comfy()
        model = node_stub.FakeModel()
        foreign_calls = []
        if c.previous == "sab":
            model.model_options["transformer_options"]["optimized_attention_override"] = \
                adapter.make_override("_native_math", "strict")
        elif c.previous == "foreign":
            def foreign(func, *a, **kw):
                foreign_calls.append(1)
                return func(*a, **kw)
            model.model_options["transformer_options"]["optimized_attention_override"] = foreign
        assert parallel_node.ContextParallelAttention.check_inputs(mode=c.mode, degree=c.degree) is True
        patched = parallel_node.ContextParallelAttention.execute(model=model, mode=c.mode, degree=c.degree).result[0]
        to = patched.model_options["transformer_options"]
        override = to["optimized_attention_override"]
        (apply_wrapper,) = to["wrappers"]["apply_model"]["attention_dispatch"]
        (report_wrapper,) = to["wrappers"]["outer_sample"]["attention_dispatch"]
        published = []
        reports = importlib.import_module(f"{PACK}.nodes.reports")
        real_publish = reports.publish
        reports.publish = lambda kind, node, data: published.append((kind, node, data))
        try:
            def sample():  # OUTER_SAMPLE around two model calls (APPLY_MODEL), one attention call each
                return [apply_wrapper(lambda: _comfy_call(override, c, q, k, v, comfy_mask)) for _ in range(2)]
            outs = report_wrapper(sample)
        finally:
            reports.publish = real_publish
        out, lse = outs[1], None
        torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
        (kind, node, data), = published
        found["report"] = {key: data[key] for key in ("split_calls", "unsplit_calls", "override_calls", "world_size")}
        found["foreign_calls"] = len(foreign_calls)
    assert out.dtype == q.dtype and out.shape == ref.shape, (out.dtype, tuple(out.shape))
    scale = max(ref.abs().max().item(), 1e-30)
    found["out"] = (out.double() - ref).abs().max().item() / scale
    if lse is not None:
        found["lse"] = (lse.double() - ref_lse).abs().max().item() / max(ref_lse.abs().max().item(), 1e-30)
    found["digest"] = zlib.crc32(out.contiguous().numpy().tobytes())  # every rank must hold the same bytes
    found["calls"] = cfg.calls
    return found


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    join_gloo(rank, world, init_file)
    results, broken = {}, None
    for case in CASES[world]:
        if broken:
            results[case.name] = {"error": f"not run: {broken} failed first on this rank"}
            continue
        try:
            results[case.name] = _run_case(case, rank)
        except Exception as exc:  # noqa: BLE001 - reported per case
            import traceback
            results[case.name] = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"}
            broken = case.name
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(results, handle)
    # The cached configs hold the process group: dropped first, destroy_process_group frees it and gloo's worker
    # threads end with it (kept, the group outlived the interpreter and a rank could abort at exit)
    _configs.clear()
    leave_gloo()


_spawned: dict = {}


def _results(world: int, tmp_path_factory) -> list[dict]:
    if world not in _spawned:
        _spawned[world] = spawn_ranks(_worker, world, tmp_path_factory, "rcp")
    return _spawned[world]


@pytest.mark.parametrize("world,case", [(w, c) for w, cases in CASES.items() for c in cases],
                         ids=lambda x: x.name if isinstance(x, Case) else f"world{x}")
def test_replicated_split_matches_single_process(world, case, tmp_path_factory):
    per_rank = [r[case.name] for r in _results(world, tmp_path_factory)]
    errors = [f["error"] for f in per_rank if "error" in f]
    assert not errors, errors
    if case.fail_rank is not None:
        raised = [f["raised"] for f in per_rank]
        assert all(raised), raised  # every rank raised; none is left waiting in a collective
        assert "injected kernel failure" in raised[case.fail_rank]
        assert all("failed on rank(s) [1]" in r for i, r in enumerate(raised) if i != case.fail_rank), raised
        return
    assert len({f["digest"] for f in per_rank}) == 1, "ranks hold different outputs"
    worst = max(f["out"] for f in per_rank)
    assert worst < TOL, worst
    if case.return_lse:
        assert max(f["lse"] for f in per_rank) < TOL
    if case.via == "node":
        report = per_rank[0]["report"]
        assert report["world_size"] == (case.degree or world) and report["override_calls"] == 2
        if case.previous == "foreign":  # ComfyUI's own attention: whole on every rank, exact, and counted
            assert report == {**report, "split_calls": 0, "unsplit_calls": 2}
            assert per_rank[0]["foreign_calls"] == 2
        else:
            assert report["split_calls"] == 2 and report["unsplit_calls"] == 0


# --- single process -----------------------------------------------------------------------------

@pytest.fixture
def node(monkeypatch):
    from helpers import node_stub
    node_stub.install(monkeypatch)
    patcher = sys.modules["comfy.patcher_extension"]
    monkeypatch.setattr(patcher, "WrappersMP", types.SimpleNamespace(OUTER_SAMPLE="outer_sample",
                                                                     APPLY_MODEL="apply_model"))
    return node_stub, importlib.import_module(f"{PACK}.nodes.parallel_node")


def test_validate_inputs_without_a_launch_says_how_to_launch(node, monkeypatch):
    _, parallel_node = node
    monkeypatch.chdir("/")
    node_cls = parallel_node.ContextParallelAttention
    assert node_cls.check_inputs(mode="off", degree=0) is True
    for mode in ("heads", "sequence"):
        message = node_cls.check_inputs(mode=mode, degree=0)
        assert isinstance(message, str) and f"mode '{mode}'" in message
        assert "torchrun --nproc-per-node 2 main.py <your usual main.py arguments>" in message
        assert "torch.distributed is not initialized" in message and "mode to 'off'" in message
    assert "unknown mode" in node_cls.check_inputs(mode="ring", degree=0)
    assert "degree" in node_cls.check_inputs(mode="heads", degree=-1)


def test_mode_defaults_to_off_outside_torchrun(node, monkeypatch):
    """Dropped into a workflow of a ComfyUI not started by torchrun, the node's default changes nothing and the
    prompt is not refused; under a torchrun launch of several ranks the default splits by heads."""
    _, parallel_node = node
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert parallel_node.default_mode() == "off"
    assert parallel_node.ContextParallelAttention.validate_inputs() is True  # the defaults ComfyUI would use
    monkeypatch.setenv("RANK", "0"), monkeypatch.setenv("WORLD_SIZE", "2"), monkeypatch.setenv("LOCAL_RANK", "0")
    assert parallel_node.default_mode() == "heads"
    with pytest.raises(ValueError, match="needs one ComfyUI process per GPU"):  # raised: ComfyUI shows it once
        parallel_node.ContextParallelAttention.validate_inputs(mode="heads", degree=0)


def test_execute_off_returns_the_model_and_on_refuses_without_a_launch(node):
    node_stub, parallel_node = node
    model = node_stub.FakeModel()
    assert parallel_node.ContextParallelAttention.execute(model=model, mode="off", degree=0).result[0] is model
    with pytest.raises(parallel.ContextParallelError, match="torchrun --nproc-per-node"):
        parallel_node.ContextParallelAttention.execute(model=model, mode="heads", degree=0)
    assert model.override is None  # the input model is never patched


def test_validation_with_a_launch_checks_the_degree(monkeypatch):
    monkeypatch.setattr(cp_runtime, "distributed", lambda: (True, 4, 0))
    assert cp_runtime.validation_message("heads", 0) is True
    assert cp_runtime.validation_message("sequence", 2) is True
    assert "divisor" in cp_runtime.validation_message("heads", 3)
    assert "divisor" in cp_runtime.validation_message("heads", 8)
    monkeypatch.setattr(cp_runtime, "distributed", lambda: (True, 1, 0))
    assert "single rank" in cp_runtime.validation_message("heads", 0)


def test_replicated_config_rules_and_one_rank_passthrough():
    with pytest.raises(parallel.ContextParallelError, match="unknown replicated"):
        replicated.ReplicatedConfig(mode="ulysses")
    with pytest.raises(parallel.ContextParallelError, match="degree"):
        replicated.ReplicatedConfig(degree=-1)
    with pytest.raises(parallel.ContextParallelError, match="init_process_group"):
        replicated.ReplicatedConfig(degree=2).setup()
    one = replicated.ReplicatedConfig(mode="sequence").setup()  # no process group: one rank, plain attention
    assert one.world_size == 1 and one.rank == 0
    q, k, v = (torch.randn(1, 9, 3, 8) for _ in range(3))
    with replicated.replicated_parallel(one):
        assert replicated.active_replicated_config() is one and parallel.active_config() is None
        out = dispatcher.dispatch_attention_fn(q, k, v, backend="_native_math")
    assert replicated.active_replicated_config() is None
    assert dispatcher.dispatch._context_parallel_on is False
    torch.testing.assert_close(out, dispatcher.dispatch_attention_fn(q, k, v, backend="_native_math"))


# --- the lockstep runtime, with a stand-in for the control group ----------------------------------

class FakeQueue:
    """ComfyUI's PromptQueue where it matters: a heap by item[0], get/put/get_flags/set_flag."""

    def __init__(self):
        self.items, self.flags, self.counter = [], {}, 0

    def put(self, item):
        import heapq
        heapq.heappush(self.items, item)

    def get(self, timeout=None):
        import heapq
        if not self.items:
            return None
        self.counter += 1
        return heapq.heappop(self.items), self.counter - 1

    def get_flags(self, reset=True):
        flags, self.flags = self.flags, ({} if reset else self.flags)
        return flags

    def set_flag(self, name, value):
        self.flags[name] = value


def test_rank0_broadcasts_prompts_as_they_start_and_workers_replay_them_in_order(monkeypatch):
    wire = []
    monkeypatch.setattr(cp_runtime, "_send", wire.append)
    lead = FakeQueue()
    cp_runtime._lead(lead)
    lead.put((5, "a", {"1": {}}, {"client_id": "x"}, ["1"]))
    lead.put((-1, "b", {"2": {}}, {}, ["2"]))  # queued at the front: rank 0 runs it first
    lead.put((6, "c", {"3": {}}, {}, ["3"]))
    first, _ = lead.get(timeout=1)
    lead.set_flag("free_memory", True)
    assert lead.get_flags() == {"free_memory": True}
    lead.items.remove((6, "c", {"3": {}}, {}, ["3"]))  # deleted from the queue before it ran: never sent
    second, _ = lead.get(timeout=1)
    assert lead.get(timeout=0) is None and lead.get_flags() == {}
    assert [m[0] for m in wire] == ["prompt", "flags", "prompt"]
    assert [first[1], second[1]] == ["b", "a"]

    follow = FakeQueue()
    incoming = iter(wire)
    monkeypatch.setattr(cp_runtime, "_receive", lambda: next(incoming))
    cp_runtime._follow(follow)
    got, _ = follow.get(timeout=1000)
    assert got[1:] == first[1:] and follow.get_flags() == {}
    assert follow.get(timeout=1000) is None and follow.get_flags() == {"free_memory": True}
    got, _ = follow.get(timeout=1000)
    assert got[1:] == second[1:]
    assert got[0] > 0  # renumbered in arrival order: a later "front" prompt cannot overtake on the worker


def test_setup_from_env_is_a_no_op_without_torchrun(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert cp_runtime.torchrun_env() is None and cp_runtime.setup_from_env() is False
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert cp_runtime.torchrun_env() == (0, 1, 0)
    assert cp_runtime.launched() is False and cp_runtime.setup_from_env() is False  # one rank: plain ComfyUI
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cp_runtime.launched() is True
    assert cp_runtime.launch_command(3).startswith("torchrun --nproc-per-node 3 main.py <your usual main.py arguments>")


class FakeMM:
    """comfy.model_management's interrupt state."""

    class InterruptProcessingException(Exception):
        pass

    def __init__(self):
        import threading
        self.interrupt_processing_mutex = threading.RLock()
        self.interrupt_processing = False

    def interrupt_current_processing(self, value=True):
        self.interrupt_processing = value

    def throw_exception_if_processing_interrupted(self):
        if self.interrupt_processing:
            self.interrupt_processing = False
            raise self.InterruptProcessingException()


@pytest.fixture
def relay(monkeypatch):
    """cp_runtime's interrupt relay and lockstep on a FakeQueue of rank 0 of 2, with `peer` playing rank 1."""
    mm = FakeMM()
    comfy_pkg = types.ModuleType("comfy")
    comfy_pkg.model_management = mm
    monkeypatch.setitem(sys.modules, "comfy", comfy_pkg)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    monkeypatch.setattr(cp_runtime, "_state", dict(cp_runtime._state, world=2, rank=0, prompt_thread=None, checks=0))
    peer = {"states": iter(()), "seen": []}

    def exchange(interrupted, ended):
        peer["seen"].append((int(interrupted), int(ended)))
        return [(int(interrupted), int(ended)), next(peer["states"])]

    monkeypatch.setattr(cp_runtime, "_exchange", exchange)
    monkeypatch.setattr(cp_runtime, "_send", lambda message: None)
    queue = FakeQueue()
    done = []
    queue.task_done = lambda item_id, *a, **k: done.append(item_id)
    cp_runtime._lead(queue)
    cp_runtime._lockstep(queue)
    cp_runtime._relay_interrupts()
    return mm, queue, peer, done


def test_a_cancel_on_rank_0_is_taken_by_every_rank_at_one_check(relay):
    mm, queue, peer, done = relay
    mm.throw_exception_if_processing_interrupted()  # outside a prompt: the local check, no collective
    assert peer["seen"] == []
    queue.put((1, "p", {}, {}, []))
    _, item_id = queue.get()
    peer["states"] = iter([(0, 0), (0, 0), (0, 0), (0, 1)])
    mm.throw_exception_if_processing_interrupted()
    mm.throw_exception_if_processing_interrupted()
    mm.interrupt_current_processing(True)  # /interrupt on rank 0
    with pytest.raises(mm.InterruptProcessingException):
        mm.throw_exception_if_processing_interrupted()
    assert mm.interrupt_processing is False and cp_runtime._state["checks"] == 3
    queue.task_done(item_id, {}, None)  # rank 1 raised at the same check and ended: one round, both ended
    assert done == [item_id] and peer["seen"] == [(0, 0), (0, 0), (1, 0), (0, 1)]


def test_a_rank_that_ends_a_prompt_early_stops_the_others_at_their_next_check(relay):
    mm, queue, peer, done = relay
    queue.put((1, "p", {}, {}, []))
    _, item_id = queue.get()
    peer["states"] = iter([(0, 0), (0, 1), (0, 1)])  # rank 1 failed alone after one check, then waits to end
    mm.throw_exception_if_processing_interrupted()
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] ended this prompt early"):
        mm.throw_exception_if_processing_interrupted()
    queue.task_done(item_id, {}, None)
    assert done == [item_id] and peer["seen"][-1] == (0, 1)


def test_rank_0_waits_at_the_end_of_a_prompt_for_the_slower_ranks(relay):
    mm, queue, peer, done = relay
    queue.put((1, "p", {}, {}, []))
    _, item_id = queue.get()
    peer["states"] = iter([(0, 0), (0, 0), (0, 1)])  # rank 1 still makes two checks (it then stops at them)
    queue.task_done(item_id, {}, None)
    assert done == [item_id] and peer["seen"] == [(0, 1)] * 3
