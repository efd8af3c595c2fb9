"""The dispatcher's hooks into a real ComfyUI 0.3.64 (CPU): `auto`'s tuning cache in ComfyUI's user directory,
and every line the pack logs while tuning carries the one prefix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_comfyui import model_report, sd15_prompt

pytestmark = pytest.mark.integration


def test_auto_tunes_into_comfyuis_user_directory_with_prefixed_lines(comfy):
    entry = comfy.run(sd15_prompt("auto_exact", seed=11))
    report = model_report(comfy, entry, "10")
    assert report["recorder"]["rows"], report
    cache = Path(comfy.base) / "user" / "attention_dispatch" / "tune.json"
    assert cache.exists(), comfy.tail()
    data = json.loads(cache.read_text())
    (machine,) = data["machines"].values()
    assert machine["decisions"], data
    lines = comfy.log.read_text(errors="replace").splitlines()
    tuning = [l for l in lines if "auto: " in l and "->" in l]
    assert tuning, comfy.tail()
    assert all("[attention-dispatch] auto: " in l for l in tuning), tuning
