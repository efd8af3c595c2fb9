"""Context-parallel attention (dispatcher.parallel) on 2 and 4 gloo processes of this machine.

Each world size is spawned once (torch.multiprocessing, file:// rendezvous, 127.0.0.1 only) and runs
every case of its table; each rank writes its errors to a JSON file, and one test per case reads them.
Every case compares this rank's output shard (and LSE) with the float64 `_native_math` reference of the
whole sequence: relative error < 1e-5 for float32 inputs.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from dataclasses import dataclass

import pytest
import torch

import dispatcher
from dispatcher import parallel
from helpers.gloo_ranks import join_gloo, leave_gloo, spawn_ranks

from dispatcher.parallel import ContextParallelConfig, ContextParallelError, context_parallel, head_plan

TOL = 1e-5


@dataclass(frozen=True)
class Case:
    name: str
    ulysses: int = 1
    ring: int = 1
    backend: str = "_native_math"
    B: int = 2
    S: int = 37
    H: int = 6
    Hk: int | None = None
    D: int = 16
    Dv: int | None = None
    Sk: int | None = None  # cross-attention: k/v length (replicated on every rank)
    mask: str | None = None  # key_padding | additive | bool_per_head | bool_2d
    mask_rows: str = "full"  # full | local: which query rows of a row mask each rank passes
    causal: bool = False
    layout: str = "BSHD"
    method: str = "p2p"
    via: str = "call"  # call | context (dispatch_attention_fn inside context_parallel)
    lens: tuple | None = None  # custom per-rank shard lengths
    pass_lens: bool = False
    return_lse: bool = True
    mesh: bool = False
    expect_error: str | None = None


CASES = {
    2: [
        Case("ulysses2_math_uneven_heads", ulysses=2, H=5),
        Case("ulysses2_flash_gqa_key_padding", ulysses=2, backend="_native_flash", H=6, Hk=2, mask="key_padding"),
        Case("ulysses2_native_no_lse_backend_bhsd_local_rows", ulysses=2, backend="native", mask="additive",
             mask_rows="local", layout="BHSD", return_lse=False),
        Case("ulysses2_per_head_bool_mask", ulysses=2, H=5, mask="bool_per_head"),
        Case("ring2_math_key_padding", ring=2, mask="key_padding"),
        Case("ring2_flash_gqa_key_padding", ring=2, backend="_native_flash", H=4, Hk=2, mask="key_padding"),
        Case("ring2_flex_additive", ring=2, backend="flex", B=1, S=21, H=2, D=8, mask="additive"),
        Case("ring2_allgather_flash_causal", ring=2, backend="_native_flash", causal=True, method="allgather"),
        Case("ring2_math_causal_custom_lens", ring=2, causal=True, lens=(30, 7), pass_lens=True),
        Case("ring2_context_manager_bhsd", ring=2, backend="_native_flash", via="context", layout="BHSD",
             mask="bool_2d"),
        Case("cross_attention_replicated_kv", ring=2, Sk=11, mask="key_padding", via="context"),
        Case("ring2_native_refused", ring=2, backend="native", expect_error="lse"),
    ],
    4: [
        Case("ulysses4_math_heads6_gqa_expanded", ulysses=4, H=6, Hk=2),
        Case("ulysses4_flash_heads8_kv2_key_padding", ulysses=4, backend="_native_flash", H=8, Hk=2,
             mask="key_padding"),
        Case("ulysses4_native_no_lse_backend", ulysses=4, backend="native", H=6, return_lse=False,
             mask="additive", mask_rows="local"),
        Case("ring4_math_key_padding", ring=4, mask="key_padding"),
        Case("ring4_flash_key_padding_hidden_blocks", ring=4, backend="_native_flash", mask="key_padding"),
        Case("ring4_flash_additive_local_rows", ring=4, backend="_native_flash", mask="additive", mask_rows="local"),
        Case("ring4_flex_small", ring=4, backend="flex", B=1, S=13, H=2, D=8, mask="key_padding"),
        Case("ring4_math_three_tokens", ring=4, S=3, mask="key_padding"),
        Case("ulysses4_math_three_tokens", ulysses=4, S=3, H=6),
        Case("combined2x2_math_gqa_key_padding", ulysses=2, ring=2, H=6, Hk=2, mask="key_padding"),
        Case("combined2x2_flash_additive_bhsd", ulysses=2, ring=2, backend="_native_flash", mask="additive",
             layout="BHSD"),
        Case("combined2x2_flash_causal_gqa", ulysses=2, ring=2, backend="_native_flash", H=6, Hk=3, causal=True),
        Case("combined2x2_allgather_per_head_bool", ulysses=2, ring=2, H=5, mask="bool_per_head", method="allgather"),
        Case("combined2x2_custom_lens_with_empty_shard", ulysses=2, ring=2, lens=(10, 0, 20, 7), mask="additive",
             mask_rows="local"),
        Case("combined2x2_one_query_shards_local_rows", ulysses=2, ring=2, S=5, mask="additive", mask_rows="local"),
        Case("ulysses4_one_query_shards_broadcast_rows", ulysses=4, S=5, mask="key_padding"),
        Case("ulysses4_one_query_each_local_rows", ulysses=4, S=4, mask="bool_per_head", mask_rows="local"),
        Case("combined2x2_empty_shards_broadcast_rows", ulysses=2, ring=2, S=2, mask="key_padding"),
        Case("combined2x2_flex_context", ulysses=2, ring=2, backend="flex", B=1, S=17, H=4, D=8, via="context"),
        Case("combined2x2_device_mesh", ulysses=2, ring=2, mesh=True, mask="key_padding"),
        Case("combined2x2_native_refused", ulysses=2, ring=2, backend="native", expect_error="lse"),
    ],
}


# --- inside each spawned rank -------------------------------------------------------------------

def _build_mask(c: Case, gen, S, Sk):
    if c.mask is None:
        return None
    if c.mask == "key_padding":
        keep = torch.ones(c.B, 1, 1, Sk, dtype=torch.bool)
        if c.B > 1:
            keep[1, ..., max(1, Sk // 3):] = False  # whole key blocks hidden for batch 1
        else:
            keep[0, ..., Sk // 2:] = False
        return keep
    if c.mask == "additive":
        bias = torch.randn(c.B, 1, S, Sk, generator=gen) * 0.5
        hidden = torch.rand(c.B, 1, S, Sk, generator=gen) < 0.3
        bias = bias.masked_fill(hidden, float("-inf"))
        bias[..., torch.arange(S), torch.arange(S) % Sk] = 0.0  # every row keeps a key
        return bias
    if c.mask == "bool_per_head":
        keep = torch.rand(c.B, c.H, S, Sk, generator=gen) < 0.6
        keep[..., torch.arange(S), torch.arange(S) % Sk] = True
        return keep
    if c.mask == "bool_2d":
        keep = torch.rand(S, Sk, generator=gen) < 0.5
        keep[torch.arange(S), torch.arange(S) % Sk] = True
        return keep
    raise ValueError(c.mask)


_configs: dict = {}


def _config(c: Case) -> ContextParallelConfig:
    key = (c.ulysses, c.ring, c.method, c.mesh)
    if key not in _configs:
        mesh = None
        if c.mesh:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (c.ring, c.ulysses), mesh_dim_names=("ring", "ulysses"))
        _configs[key] = ContextParallelConfig(ulysses_degree=c.ulysses, ring_degree=c.ring, ring_method=c.method,
                                              mesh=mesh).setup()
    return _configs[key]


def _relative(a: torch.Tensor, ref_shard: torch.Tensor, ref_full: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    assert a.shape == ref_shard.shape, (tuple(a.shape), tuple(ref_shard.shape))
    return (a.double() - ref_shard).abs().max().item() / max(ref_full.abs().max().item(), 1e-30)


def _run_case(c: Case) -> dict:
    cfg = _config(c)
    rank = cfg.rank
    gen = torch.Generator().manual_seed(zlib.crc32(c.name.encode()))
    S, Hk, Dv = c.S, c.Hk or c.H, c.Dv or c.D
    cross = c.Sk is not None
    Sk = c.Sk or S
    q_full = torch.randn(c.B, S, c.H, c.D, generator=gen)
    k_full = torch.randn(c.B, Sk, Hk, c.D, generator=gen)
    v_full = torch.randn(c.B, Sk, Hk, Dv, generator=gen)
    mask_full = _build_mask(c, gen, S, Sk)
    q_lens = list(c.lens) if c.lens else cfg.split_sizes(S)
    kv_lens = q_lens if not cross else None
    q_off = sum(q_lens[:rank])
    q = q_full.narrow(1, q_off, q_lens[rank])
    k, v = (k_full, v_full) if cross else (k_full.narrow(1, q_off, q_lens[rank]), v_full.narrow(1, q_off, q_lens[rank]))
    mask = mask_full
    if mask is not None and c.mask_rows == "local":
        mask = mask.narrow(-2, q_off, q_lens[rank])
    if c.layout == "BHSD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    gqa = Hk != c.H
    lens = dict(q_lens=q_lens, kv_lens=kv_lens) if c.pass_lens else {}
    if c.via == "context":
        with context_parallel(cfg, kv_sharded=lambda site: site != "cross", **lens):
            result = dispatcher.dispatch_attention_fn(
                q, k, v, mask, is_causal=c.causal, enable_gqa=gqa, backend=c.backend, layout=c.layout,
                return_lse=c.return_lse, call_site="cross" if cross else "self")
    else:
        result = parallel.context_parallel_attention(
            dispatcher.AttentionCall(q, k, v, mask, is_causal=c.causal, enable_gqa=gqa, backend=c.backend,
                                     layout=c.layout, return_lse=c.return_lse),
            config=cfg, kv_sharded=not cross, **lens)
    out, lse = result if c.return_lse else (result, None)
    if c.layout == "BHSD":
        out = out.transpose(1, 2)
        lse = None if lse is None else lse.transpose(1, 2)
    ref_mask = mask_full if mask_full is None or mask_full.dtype == torch.bool else mask_full.double()
    ref, ref_lse = dispatcher.dispatch_attention_fn(q_full.double(), k_full.double(), v_full.double(), ref_mask,
                                                    is_causal=c.causal, enable_gqa=gqa, backend="_native_math",
                                                    policy="strict", return_lse=True)
    assert out.dtype == q.dtype and out.shape == (c.B, q_lens[rank], c.H, Dv), (out.dtype, tuple(out.shape))
    found = {"out": _relative(out, ref.narrow(1, q_off, q_lens[rank]), ref)}
    if lse is not None:
        found["lse"] = _relative(lse, ref_lse.narrow(1, q_off, q_lens[rank]), ref_lse)
    found["gathered"] = _relative(cfg.gather(out, dim=1), ref, ref)  # the whole output back on every rank
    return found


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    join_gloo(rank, world, init_file)
    results, broken = {}, None
    for case in CASES[world]:
        if broken:
            results[case.name] = {"error": f"not run: {broken} failed first on this rank"}
            continue
        try:
            results[case.name] = _run_case(case)
            if case.expect_error:
                results[case.name]["error"] = "no error raised"
        except Exception as exc:  # noqa: BLE001 - reported per case
            results[case.name] = {"error": f"{type(exc).__name__}: {exc}", "expected": bool(case.expect_error)}
            if not (case.expect_error and isinstance(exc, ContextParallelError)):
                broken = case.name  # collectives may be out of step now: stop here
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(results, handle)
    _configs.clear()  # they hold the process groups: kept, the groups outlive the interpreter (leave_gloo says)
    leave_gloo()


# --- the tests ---------------------------------------------------------------------------------

_spawned: dict = {}


def _results(world: int, tmp_path_factory) -> list[dict]:
    if world not in _spawned:
        _spawned[world] = spawn_ranks(_worker, world, tmp_path_factory, "cp")
    return _spawned[world]


@pytest.mark.parametrize("world,case", [(w, c) for w, cases in CASES.items() for c in cases],
                         ids=lambda x: x.name if isinstance(x, Case) else f"world{x}")
def test_context_parallel_matches_single_process(world, case, tmp_path_factory):
    per_rank = [r[case.name] for r in _results(world, tmp_path_factory)]
    if case.expect_error:
        for found in per_rank:
            assert found.get("expected"), found
            message = found["error"]
            assert "log-sum-exp" in message and "_native_math" in message and "_native_flash" in message, message
            assert "ulysses" in message.lower()
        return
    errors = [f["error"] for f in per_rank if "error" in f]
    assert not errors, errors
    worst = {key: max(f[key] for f in per_rank) for key in per_rank[0]}
    assert worst["out"] < TOL and worst["gathered"] < TOL, worst
    if case.return_lse:
        assert worst["lse"] < TOL, worst


# --- single process ------------------------------------------------------------------------------

def test_supported_modes_follow_the_lse_flag():
    for name in dispatcher.backend_names():
        spec = dispatcher.get_backend_spec(name)
        modes = parallel.supported_modes(name)
        assert "ulysses" in modes
        assert ("ring" in modes) == ("ulysses_ring" in modes) == spec.lse, name
        assert spec.constraints()["context_parallel"] == list(spec.context_parallel_modes)
    assert {"_native_math", "_native_flash", "flex"} <= set(parallel.backends_for("ring"))
    assert "native" not in parallel.backends_for("ring") and "native" in parallel.backends_for("ulysses")


def test_ring_with_a_backend_without_lse_is_refused_with_the_alternatives():
    cfg = ContextParallelConfig(ring_degree=2)
    with pytest.raises(ContextParallelError) as info:
        parallel.check_backend("native", cfg)
    message = str(info.value)
    assert "'native'" in message and "lse=False" in message and "ring_degree=1" in message
    assert "_native_math" in message and "flex" in message
    parallel.check_backend("native", ContextParallelConfig(ulysses_degree=4))  # Ulysses runs anything
    with pytest.raises(ContextParallelError, match="log-sum-exp"):  # refused before any process group is needed
        parallel.context_parallel_attention(dispatcher.AttentionCall(*(torch.randn(1, 4, 2, 8),) * 3,
                                                                     backend="native"), config=cfg)


def test_config_validation_and_one_rank_passthrough():
    with pytest.raises(ContextParallelError, match="ulysses_degree"):
        ContextParallelConfig(ulysses_degree=0)
    with pytest.raises(ContextParallelError, match="ring_method"):
        ContextParallelConfig(ring_method="tree")
    assert ContextParallelConfig(ulysses_degree=2, ring_degree=3).mode == "ulysses_ring"
    assert ContextParallelConfig.for_world("ulysses_ring", world_size=8).as_dict()["ring_degree"] == 4
    assert ContextParallelConfig.for_world("ring", world_size=3).ring_degree == 3
    with pytest.raises(ContextParallelError, match="init_process_group"):
        ContextParallelConfig(ulysses_degree=2).setup()
    q, k, v = (torch.randn(2, 9, 4, 8) for _ in range(3))
    one = ContextParallelConfig()
    assert one.mode == "none" and one.rank == 0 and one.shard(q).shape == q.shape
    with context_parallel(one):
        assert parallel.active_config() is one
        out = dispatcher.dispatch_attention_fn(q, k, v, backend="_native_math")
    assert parallel.active_config() is None
    from dispatcher import dispatch
    assert dispatch._context_parallel_on is False  # plain calls skip the hook once no block is open
    torch.testing.assert_close(out, dispatcher.dispatch_attention_fn(q, k, v, backend="_native_math"))


def test_the_public_call_takes_an_attention_call_whole():
    """context_parallel_attention takes the described call itself: its recorder, model and guard reach the local
    call (they were not parameters of the old signature), and anything else is refused by name."""
    q, k, v = (torch.randn(1, 6, 2, 8) for _ in range(3))
    rec = dispatcher.Recorder()
    call = dispatcher.AttentionCall(q, k, v, backend="_native_math", call_site="cp site", recorder=rec, model="m")
    out = parallel.context_parallel_attention(call, config=ContextParallelConfig())
    torch.testing.assert_close(out, dispatcher.dispatch_attention_fn(q, k, v, backend="_native_math"))
    assert [(r["site"], r["served"]) for r in rec.snapshot()["rows"]] == [("cp site", "_native_math")]
    with pytest.raises(TypeError, match="takes an AttentionCall"):
        parallel.context_parallel_attention(q, config=ContextParallelConfig())


def test_split_sizes_and_head_plan():
    assert parallel.split_sizes(37, 4) == [10, 9, 9, 9] and parallel.split_sizes(3, 4) == [1, 1, 1, 0]
    for hq, hk, parts in [(6, 6, 4), (6, 2, 4), (8, 2, 4), (6, 3, 2), (5, 5, 2), (2, 1, 4), (24, 8, 4)]:
        plan = head_plan(hq, hk, parts)
        assert [h.start for h in plan][0] == 0 and plan[-1].stop == hq
        g = hq // hk
        for h in plan:
            assert len(h.kv) * h.group == h.count
            for i in range(h.count):  # query head start+i reads key/value head kv[i // group]
                assert h.kv[i // h.group] == (h.start + i) // g
    assert [h.group for h in head_plan(8, 2, 4)] == [2, 2, 2, 2]  # repeat kv only as far as needed
    assert [h.group for h in head_plan(6, 3, 2)] == [1, 1]


def test_lse_merge_of_two_key_blocks_is_exact_attention():
    from dispatcher.parallel.attention import _merge
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 7, 3, 8), torch.randn(2, 12, 3, 8), torch.randn(2, 12, 3, 8)
    keep = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    keep[1, ..., 5:] = False  # batch 1 sees nothing of the second block
    ref, ref_lse = dispatcher.dispatch_attention_fn(q, k, v, keep, backend="_native_math", return_lse=True)
    out = torch.zeros(2, 7, 3, 8)
    lse = torch.full((2, 7, 3), -math.inf)
    for sl in (slice(0, 5), slice(5, 12)):
        o, l = dispatcher.dispatch_attention_fn(q, k[:, sl], v[:, sl], keep[..., sl], backend="_native_math",
                                                return_lse=True)
        _merge(out, lse, o, l)  # the math kernel gives NaN rows for the hidden block: they add nothing
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-6)


def test_compiled_callers_route_inside_a_block_and_not_after(monkeypatch):
    from dispatcher.parallel import attention
    routed = []
    real = attention._run  # where the dispatcher's hook sends a described call

    def spy(config, call, *args):
        routed.append(config)
        return real(config, call, *args)

    monkeypatch.setattr(attention, "_run", spy)
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    f = torch.compile(lambda q, k, v: dispatcher.dispatch_attention_fn(q, k, v, backend="_native_math") * 2,
                      backend="eager")
    one = ContextParallelConfig()
    with context_parallel(one):
        inside = f(q, k, v)
    assert routed == [one]  # a graph break, then the context-parallel call eagerly
    outside = f(q, k, v)  # the block is closed: the compiled caller must not keep routing
    assert routed == [one]
    torch.testing.assert_close(inside, outside)


def test_a_recorder_passed_by_argument_counts_routed_calls():
    """The ComfyUI override hands the dispatcher its recorder by argument: a call routed through a
    context-parallel block (here one rank, plain local attention) is counted there too."""
    q, k, v = (torch.randn(1, 16, 2, 8) for _ in range(3))
    recorder = dispatcher.Recorder()
    with context_parallel(ContextParallelConfig()):
        dispatcher.dispatch_attention_fn(q, k, v, backend="native", recorder=recorder, call_site="cp")
    assert [(r["site"], r["served"], r["calls"]) for r in recorder.snapshot()["rows"]] == [("cp", "native", 1)]


# A fresh interpreter: this test process has long imported torch._dynamo. The order is a real launch's:
# the package first, then init_process_group, then the first context-parallel block (which imports dynamo).
_FREED_AFTER_DESTROY = """
import gc, os, sys, weakref
import torch, torch.distributed as dist
import dispatcher
from dispatcher.parallel import ContextParallelConfig, context_parallel
if os.path.exists("/sys/class/net/lo"):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
assert "torch._dynamo" not in sys.modules, "the test needs dynamo imported after init_process_group"
group = weakref.ref(dist.group.WORLD)
q = torch.randn(1, 8, 2, 4)
with context_parallel(ContextParallelConfig()):
    dispatcher.dispatch_attention_fn(q, q, q, backend="_native_math")
assert "torch._dynamo" in sys.modules
done = torch.ones(1)
dist.all_reduce(done)
dist.destroy_process_group()
gc.collect()
print("freed" if group() is None else f"alive with {sys.getrefcount(group()) - 1} references")
"""


def test_destroy_process_group_frees_the_group_when_a_block_imported_dynamo_after_init(tmp_path):
    """A group still alive at interpreter exit keeps gloo's worker threads, and one of them dropping a
    finished collective's tensors while the interpreter finalizes aborts the rank ("terminate called without
    an active exception", a -6 exit after a correct result). torch.distributed.nn, imported by dynamo,
    binds group.WORLD as default arguments when first imported: after init_process_group, that pinned the group.
    """
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    run = subprocess.run([sys.executable, "-c", _FREED_AFTER_DESTROY, str(tmp_path / "rendezvous")], cwd=root,
                         env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "freed", run.stdout[-2000:]
