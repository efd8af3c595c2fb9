"""The example workflows as shipped, read without ComfyUI: what a new user met (nodes drawn over each other, no
thumbnails, raw file names, a model nobody is offered, a mode that needs torchrun) checked on the files themselves.
The browser test (tests/web/test_examples.py) checks the layout with the frontend's real node sizes and runs each
example in a real ComfyUI."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = sorted((ROOT / "example_workflows").glob("*.json"))
TITLE = 30  # LiteGraph.NODE_TITLE_HEIGHT: a node's title bar sits above its pos


def test_six_examples_with_readable_names_and_a_thumbnail_each():
    """The Templates browser titles a pack's template by its file name and shows <name>.jpg beside it."""
    assert len(EXAMPLES) == 6
    for path in EXAMPLES:
        assert "_" not in path.stem and path.stem[0].isupper(), path.name
        thumbnail = path.with_suffix(".jpg")
        assert thumbnail.is_file() and thumbnail.read_bytes()[:3] == b"\xff\xd8\xff", thumbnail.name  # a JPEG
        assert thumbnail.stat().st_size < 150_000, thumbnail.name  # small


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_no_node_is_drawn_over_another(path):
    nodes = json.loads(path.read_text())["nodes"]
    boxes = [(n["type"], n["pos"][0], n["pos"][1] - TITLE, n["size"][0], n["size"][1] + TITLE) for n in nodes]
    for i, (ta, xa, ya, wa, ha) in enumerate(boxes):
        for tb, xb, yb, wb, hb in boxes[i + 1:]:
            overlap = min(xa + wa, xb + wb) > max(xa, xb) and min(ya + ha, yb + hb) > max(ya, yb)
            assert not overlap, (path.name, ta, tb)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_model_is_one_users_have_or_are_offered(path):
    """ComfyUI's own default workflow's checkpoint, with its download entry (the templates' `properties.models`),
    so the frontend offers it when it is missing; and nothing that needs torchrun is switched on."""
    nodes = json.loads(path.read_text())["nodes"]
    (loader,) = [n for n in nodes if n["type"] == "CheckpointLoaderSimple"]
    (model,) = loader["properties"]["models"]
    assert loader["widgets_values"] == [model["name"]] == ["v1-5-pruned-emaonly-fp16.safetensors"]
    assert model["directory"] == "checkpoints" and model["url"].startswith("https://huggingface.co/Comfy-Org/")
    for node in nodes:
        if node["type"] == "ContextParallelAttention":
            assert node["widgets_values"][0] == "off"  # heads/ring/sequence need ComfyUI started by torchrun
        if node["type"] in ("SetAttentionBackend", "SetClipAttentionBackend"):
            assert node["widgets_values"][1] == "fallback"  # a GPU-only kernel falls back on a CPU, never refused
    assert any(n["type"] == "Note" and n["widgets_values"][0].strip() for n in nodes)  # says what it shows


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_note_says_what_to_download_where_and_how_long_a_cpu_takes(path):
    """A new user reads the note first: the model file its loader names, the folder it goes in, its size, how long
    the shipped run takes on a CPU and how to see the badge sooner (issue #48); the README says the same."""
    nodes = json.loads(path.read_text())["nodes"]
    (note,) = [n["widgets_values"][0] for n in nodes if n["type"] == "Note"]
    (loader,) = [n for n in nodes if n["type"] == "CheckpointLoaderSimple"]
    (model,) = loader["properties"]["models"]
    readme = (ROOT / "README.md").read_text()
    for text in (note, readme):
        assert model["name"] in text and f"models/{model['directory']}" in text
        assert re.search(r"about \d+ GB", text) and re.search(r"CPU the shipped 20 steps at 512x512 take about", text)
        assert "1 step at 64x64" in text
    sampler = next(n for n in nodes if n["type"] == "KSampler")
    latent = next(n for n in nodes if n["type"] == "EmptyLatentImage")
    assert sampler["widgets_values"][2] == 20 and latent["widgets_values"][:2] == [512, 512]  # what the note says
