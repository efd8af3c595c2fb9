"""What a hostile client sends to a real ComfyUI's POST /prompt: the server answers 400 quickly, stays small, and
what it echoes (the 400 body, the console log) is cut and escaped."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest

from .test_node_inputs import checks_inputs, refused, sampled

pytestmark = pytest.mark.integration
SPARSE = "SparseAttentionOptions"


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _sparse_prompt(dense_blocks: str, seed: int) -> dict:
    sparse = {"50": {"class_type": SPARSE, "inputs": {"tau": 1.0, "dense_blocks": dense_blocks, "min_tokens": 0}}}
    return sampled([("51", "SetAttentionBackend", {"backend": "sol_attn", "policy": "fallback", "start_percent": 0.0,
                                                   "end_percent": 1.0, "sparse": ["50", 0]})], seed, extra=sparse)


def _raw_post(comfy, prompt: dict) -> tuple[int, bytes]:
    body = json.dumps({"prompt": prompt, "client_id": "attention-dispatch-tests"}).encode()
    req = urllib.request.Request(comfy.url + "/prompt", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _log_since(comfy, offset: int) -> str:
    return comfy.log.read_bytes()[offset:].decode("utf-8", errors="replace")


def test_huge_dense_block_ranges_are_refused_in_milliseconds_without_memory(comfy):
    """300 ranges of 100,000 blocks (5 KB of text): once 3-14 s of a blocked server and +2.4 GB of RSS."""
    text = ", ".join(f"{i * 100_001}-{i * 100_001 + 100_000}" for i in range(300))
    before = _rss_mb(comfy.proc.pid)
    start = time.perf_counter()
    errors = refused(comfy, _sparse_prompt(text, 601), "50")
    took = time.perf_counter() - start
    grown = _rss_mb(comfy.proc.pid) - before
    assert took < 1.0, f"the refusal took {took:.2f} s"
    assert grown < 50, f"the server's RSS grew by {grown:.0f} MB"
    assert "dense_blocks" in errors and "at most" in errors, errors


def test_a_megabyte_of_dense_blocks_is_echoed_cut(comfy):
    offset = comfy.log.stat().st_size
    status, body = _raw_post(comfy, _sparse_prompt("x" * 1_000_000, 602))
    assert status == 400
    assert len(body) < 100_000, f"a 400 body of {len(body)} bytes"
    time.sleep(0.5)
    longest = max(map(len, _log_since(comfy, offset).splitlines()), default=0)
    assert longest < 5_000, f"a log line of {longest} characters"


@pytest.mark.parametrize("node, inputs", [
    ("AttentionChecks", checks_inputs(mode="{value}")),
    ("ContextParallelAttention", {"mode": "{value}", "degree": 0}),
    (SPARSE, {"tau": 1.0, "dense_blocks": "1, {value}", "min_tokens": 0}),
])
def test_a_lone_surrogate_and_a_newline_are_escaped_in_the_log(comfy, node, inputs):
    """Once ComfyUI's log got a UnicodeEncodeError traceback for mode '\\ud800', and a raw newline (a forged line)
    for a newline in a value."""
    offset = comfy.log.stat().st_size
    for seed, value in ((603, "\ud800"), (604, "x\nINJECTED line")):
        given = {k: (x.replace("{value}", value) if isinstance(x, str) else x) for k, x in inputs.items()}
        if node == SPARSE:
            prompt = _sparse_prompt(given["dense_blocks"], seed)
        else:
            prompt = sampled([("40", node, given)], seed)
        errors = refused(comfy, prompt, "50" if node == SPARSE else "40")
        details = " ".join(e["details"] for e in json.loads(errors)["errors"])
        assert ("\\ud800" if seed == 603 else "x\\nINJECTED") in details, details  # escaped, so it is one line
        assert details.isprintable(), details
    time.sleep(0.5)
    log = _log_since(comfy, offset)
    assert "UnicodeEncodeError" not in log and "Logging error" not in log, log[-3000:]
    assert not any(line.startswith("INJECTED") for line in log.splitlines()), log[-3000:]
