"""Counting what a call does on the host: wrappers that count each call and then call through (they observe, they
replace nothing that runs), installed with pytest's monkeypatch for one test only."""

from __future__ import annotations

import collections
import functools

import torch

# torch.cuda's queries and switches: a repeat attention call needs none of them (the first call of a signature may).
CUDA_CALLS = ("is_available", "current_device", "device_count", "get_device_capability", "get_device_properties",
              "get_device_name", "current_stream", "default_stream", "synchronize", "set_device", "stream", "device")


def _counting(counts: collections.Counter, name: str, fn):
    @functools.wraps(fn)
    def counted(*args, **kwargs):
        counts[name] += 1
        return fn(*args, **kwargs)
    return counted


def count_host_calls(monkeypatch) -> collections.Counter:
    """Count, from now on: torch.cuda's queries, SDPA's context manager (torch's name and the one native.py bound),
    every read and write of SDPA's priority order and kernel flags made by native.py, and the eager path's first-call
    work (describing, deciding). Returns the live Counter."""
    from dispatcher import decisions, eager
    from dispatcher.backends import native

    counts: collections.Counter = collections.Counter()
    for name in CUDA_CALLS:
        monkeypatch.setattr(torch.cuda, name, _counting(counts, f"torch.cuda.{name}", getattr(torch.cuda, name)))
    monkeypatch.setattr(torch.nn.attention, "sdpa_kernel", _counting(counts, "sdpa_kernel", torch.nn.attention.sdpa_kernel))
    monkeypatch.setattr(native, "sdpa_kernel", _counting(counts, "sdpa_kernel", native.sdpa_kernel))
    monkeypatch.setattr(native, "_get_order", _counting(counts, "read order", native._get_order))
    monkeypatch.setattr(native, "_set_order", _counting(counts, "write order", native._set_order))
    monkeypatch.setattr(native, "_FLAG_ACCESS", [
        (member, _counting(counts, "read flag", get), _counting(counts, "write flag", put))
        for member, get, put in native._FLAG_ACCESS])
    monkeypatch.setattr(decisions, "decide", _counting(counts, "decide", decisions.decide))
    monkeypatch.setattr(eager, "_first_call", _counting(counts, "first call", eager._first_call))
    monkeypatch.setattr(eager, "describe_call", _counting(counts, "describe", eager.describe_call))
    return counts
