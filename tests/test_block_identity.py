"""A call's block identity is one value (nodes/blocks.py `BlockId`): made once per call from ComfyUI's
transformer_options, with its position read by one reader (nodes/comfy_versions.py `block_position`) that both names
the block and places it in a block range; written once as text (the call site the dispatcher, `auto_fast`'s verdicts
on disk and the reports key by) and read back by the value that wrote it (`blocks.named`), never by parsing the text:
the report carries its fields."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import tensors
from helpers.pack import PACK, comfy_func, load_pack

adapter, dispatcher, _ = load_pack()
reports = importlib.import_module(f"{PACK}.nodes.reports")
blocks = importlib.import_module(f"{PACK}.nodes.blocks")
comfy_versions = importlib.import_module(f"{PACK}.nodes.comfy_versions")
BlockId = blocks.BlockId

qkv = functools.partial(tensors.qkv, b=1, lq=16, lk=16, h=2, d=16, flat=True)  # ComfyUI's (B, L, H*D)


def served_where(block_range, to):
    """(the call site the call was named by, whether the node's backend served it rather than passing it on)."""
    rec = dispatcher.Recorder()
    adapter.make_override("native", recorder=rec, blocks=block_range)(comfy_func, *qkv(), 2, transformer_options=to)
    row, = rec.snapshot()["rows"]
    return row["site"], not row["served"].startswith("comfy:")


@pytest.mark.parametrize("to, named", [
    ({"block_index": 3, "total_blocks": 10}, "self #3"),  # a DiT of newer ComfyUI
    ({"transformer_index": 3, "block_index": 1, "block": ("input", 4)}, "input.self #3.1"),  # the SD/SDXL UNet
    # the two readers of the position used to differ on these: the name read block_index, the range
    # transformer_index (or nothing at all, a count below 1 being none)
    ({"block_index": 3, "total_blocks": 0, "transformer_index": 7}, "self #3"),
    ({"block_index": 3, "total_blocks": -1}, "self #3"),
])
def test_a_call_is_judged_by_the_block_it_is_named_after(to, named):
    """The block range serves exactly the block the call site names: a range of that block alone serves it, a
    range of the next block alone passes it on."""
    assert served_where((3, 3), to) == (named, True)
    assert served_where((4, 4), to) == (named, False)


identities = st.builds(
    lambda kind, stream, index, inner: (kind, stream, index, None if index is None else inner),
    st.sampled_from(["self", "cross"]), st.none() | st.sampled_from(["double", "single", "input", "middle", "output"]),
    st.none() | st.integers(-5, 5000), st.none() | st.integers(-3, 40))


def made(kind, stream, index, inner, compiling=False):
    """The BlockId `block_id` makes for these fields (ComfyUI's options saying them)."""
    to = {"block_type": stream} if stream else {"cond_or_uncond": []}
    position = None if index is None else (index, None, inner)
    return blocks.block_id(to, position, None, kind == "self", compiling=compiling)


@settings(max_examples=300, deadline=None)
@given(identities, st.booleans())
def test_a_named_block_is_read_back_by_its_text(fields, compiling):
    value = made(*fields, compiling=compiling)
    assert value == BlockId(*fields)
    assert blocks.named(value.text) == value and blocks.named(value.unnumbered.text) == value.unnumbered
    assert reports.site_kind(value.text) == value.unnumbered.text
    assert reports.block_of(value.text) == {"kind": fields[0], "stream": fields[1], "index": fields[2],
                                            "inner": fields[3]}


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=24) | st.from_regex(r"[a-z]{1,6}(\.[a-z]{1,6})? #-?[0-9]{1,3}(\.-?[0-9]{1,2})?", fullmatch=True))
def test_any_call_site_survives_being_read(site):
    """A library caller's own call site ("attention", "encoder 3") reads back to the same text: a kind of its own
    where no block was named by it."""
    assert blocks.named(site).text == site


def test_the_texts_are_the_ones_verdicts_were_saved_under():
    """The text did not change with the value: verdicts saved by earlier versions (keyed "double.self #3") are read
    as they are, with no migration."""
    assert BlockId("self", "double", 3).text == "double.self #3"
    assert BlockId("self", "input", 4, 1).text == "input.self #4.1" and BlockId("cross").text == "cross"
    assert blocks.named(made("self", "input", 4, 1).text) == BlockId("self", "input", 4, 1)


def quantised(q, k, v, **_):  # a quantised kernel that is exact here (its verdict: valid)
    return tensors.sdpa(q, k, v)


def test_a_block_identity_round_trips_through_disk_and_report(tmp_path):
    """auto_fast's verdict for a block is saved under the block's text; a new process reads it back for the block
    ComfyUI's options name, and the report folds the block's rows by the kind read from the same value."""
    dispatcher.register_backend("t_bi_quantised", quantised, devices=("cpu",), quantised=True)
    try:
        to = {"block_index": 3, "total_blocks": 19, "block_type": "double"}
        made = blocks.block_id(to, comfy_versions.block_position(to), None, True, compiling=False)
        assert made == BlockId("self", "double", 3)
        rec = dispatcher.Recorder()
        path = tmp_path / "tune.json"
        with dispatcher.auto.using(dispatcher.auto.Tuner(cache_path=path, backends=("t_bi_quantised", "native"))):
            fn = adapter.make_override("auto_fast", recorder=rec, model="model-x")
            q, k, v = qkv(seed=2)
            fn(comfy_func, q, k, v, 2, transformer_options=to)
        (entry,) = dispatcher.auto.cache.dump(path)["machines"].values()
        (decision,) = [d for key, d in entry["decisions"].items() if not key.startswith("step|")]
        (saved,) = decision["verdicts"]["model-x"]
        assert saved == made.text and blocks.named(saved) == made
        again = dispatcher.auto.Tuner(cache_path=path, backends=("t_bi_quantised", "native"))
        heads_first = [t.unflatten(-1, (2, -1)) for t in (q, k, v)]  # the call as the override passes it (BSHD)
        record = again.tune(*heads_first, model="model-x", block=made.text)
        assert record.source == "disk" and record.judged_on == "disk"
        row, = rec.snapshot()["rows"]
        assert row["site"] == made.text and reports.site_kind(row["site"]) == made.unnumbered.text == "double.self"
    finally:
        dispatcher.registry.remove("t_bi_quantised")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_block_is_named_inside_a_dynamic_shape_compile():
    """The override names its block inside a dynamic-shape compile, where the self/cross test is symbolic. (In
    ComfyUI 0.3.64's compiled WAN the identity cache, keyed by that test, raised "BooleanAtom not allowed in this
    context": tests/integration catch that case; this smaller trace did not reproduce it.)"""
    override = adapter.make_override("native")
    to = {"cond_or_uncond": [0]}  # WAN of ComfyUI 0.3.64: no block index, and no counting inside a trace

    def step(q, k, v):
        return override(comfy_func, q, k, v, 2, transformer_options=to)

    compiled = torch.compile(step, backend="eager", dynamic=True)
    for lq, lk in ((16, 8), (24, 12)):  # a cross-attention's two lengths: symbols from the second size on
        q, k, v = tensors.qkv(b=1, lq=lq, lk=lk, h=2, d=16, flat=True)
        torch.testing.assert_close(compiled(q, k, v), comfy_func(q, k, v, 2))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_a_compiled_models_blocks_are_known_to_its_report():
    """Inside torch.compile the override runs only while a graph is traced: the blocks it names there are kept for
    the report as in eager mode, without the graph reading or guarding on them (one graph for two runs)."""
    to = {"block_index": 3, "total_blocks": 10, "block_type": "t_compiled"}
    override = adapter.make_override("native")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(lambda q, k, v: override(comfy_func, q, k, v, 2, transformer_options=to),
                             backend=backend)
    q, k, v = qkv()
    for _ in range(2):
        torch.testing.assert_close(compiled(q, k, v), comfy_func(q, k, v, 2))
    assert len(graphs) == 1
    assert blocks.named("t_compiled.self #3") == BlockId("self", "t_compiled", 3)
    assert reports.site_kind("t_compiled.self #3") == "t_compiled.self"
