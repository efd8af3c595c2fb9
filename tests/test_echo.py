"""What the pack echoes back (validation errors, log lines, reports) is cut and escaped by one helper, `log.echo`:
a 1 MB input once made a 12 MB HTTP 400 and a 2,000,175-character log line, a lone surrogate a UnicodeEncodeError
traceback in the log, a newline a forged log line."""

from __future__ import annotations

import io
import logging

import pytest

from dispatcher.log import LOG_LIMIT, echo, logger, warn_once, forget_warnings
from helpers import node_stub


@pytest.fixture
def log_stream():
    """The pack's logger into a UTF-8 text stream that raises on what UTF-8 cannot encode (as a console does)."""
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="utf-8", errors="strict", write_through=True)
    handler = logging.StreamHandler(stream)
    base = logging.getLogger("attention_dispatch")
    base.addHandler(handler)
    errors = []
    handler.handleError = lambda record: errors.append(record)  # logging's "--- Logging error ---" path
    try:
        yield raw, errors
    finally:
        base.removeHandler(handler)


def test_echo_cuts_and_says_how_long():
    text = echo("x" * 1_000_000)
    assert len(text) < 200 and "1000000 characters" in text


@pytest.mark.parametrize("value, shown", [("\ud800", "\\ud800"), ("a\nb", "\\n"), ("a\rb\x1b[2J", "\\x1b"),
                                          ("caf\u00e9", "caf\u00e9")])
def test_echo_escapes_what_a_console_must_not_get_raw(value, shown):
    text = echo(value)
    assert shown in text and text.isprintable()
    text.encode("utf-8")  # never raises


def test_log_lines_are_one_line_cut_and_encodable(log_stream):
    raw, errors = log_stream
    logger.warning("value %s and %r, %d calls", "x" * 2_000_000, "a\nINJECTED \ud800", 3)
    written = raw.getvalue().decode("utf-8")
    assert not errors
    assert written.count("\n") == 1 and "INJECTED" in written and "\nINJECTED" not in written
    assert len(written) < 2 * LOG_LIMIT + 200 and "3 calls" in written


def test_a_repeated_warning_is_said_once(log_stream):
    raw, _ = log_stream
    forget_warnings()
    for _ in range(5):
        warn_once(("cache", "/x"), "the tuning cache %s is a folder", "/x")
    assert raw.getvalue().decode().count("is a folder") == 1


@pytest.mark.parametrize("node, inputs", [
    ("AttentionChecks", {"mode": "{v}", "compare": False, "compare_every": 10}),
    ("SparseAttentionOptions", {"tau": 1.0, "dense_blocks": "1, {v}", "min_tokens": 0}),
    ("SetAttentionBackend", {"backend": "{v}", "policy": "fallback", "start_percent": 0.0, "end_percent": 1.0}),
])
@pytest.mark.parametrize("value", ["x" * 1_000_000, "\ud800", "a\nINJECTED"])
def test_validation_errors_echo_values_cut_and_escaped(monkeypatch, node, inputs, value):
    nodes = node_stub.install(monkeypatch)
    given = {k: (x.replace("{v}", value) if isinstance(x, str) else x) for k, x in inputs.items()}
    answer = getattr(nodes, node).check_inputs(**given)
    assert isinstance(answer, str) and answer.isprintable() and len(answer) < 4000, answer[:300]
    answer.encode("utf-8")


def test_reports_cut_and_escape_their_texts_keeping_their_own_line_breaks():
    from helpers.pack import PACK, load_pack
    import importlib
    load_pack()
    reports = importlib.import_module(f"{PACK}.nodes.reports")
    data = reports.scrub({"summary": "line one\nline two", "errors": ["RuntimeError: " + "x" * 1_000_000,
                                                                       "bad \ud800 \x1b[2J"]})
    assert data["summary"] == "line one\nline two"
    assert len(data["errors"][0]) < 5000 and "1000014 characters" in data["errors"][0]
    assert data["errors"][1] == "bad \\ud800 \\x1b[2J"
    import json
    json.dumps(data, ensure_ascii=False).encode("utf-8")  # what the websocket sends: never raises


class _Counted:
    """An item whose repr counts its calls: how much of a container `echo` turned into text."""
    calls = 0

    def __repr__(self):
        _Counted.calls += 1
        return "i"


@pytest.mark.parametrize("make", [list, tuple, set, frozenset, lambda items: dict.fromkeys(items, 0),
                                  lambda items: [list(items)], lambda items: {"k": (list(items),)}],
                         ids=["list", "tuple", "set", "frozenset", "dict", "nested list", "nested dict"])
def test_echo_reads_only_what_it_shows_of_a_container(make):
    """A 3M-item list became 4.8 s of repr and tens of MB of text before it was cut: echo reads a container's items
    only as far as the text it keeps, and still says how long the value was."""
    value = make(_Counted() for _ in range(3_000_000))
    _Counted.calls = 0
    text = echo(value, LOG_LIMIT)
    assert _Counted.calls <= LOG_LIMIT and len(text) < LOG_LIMIT + 40, (_Counted.calls, len(text))
    if isinstance(value, (list, tuple, set, frozenset)) and len(value) > 1:
        assert text.endswith("(length 3000000)"), text[-80:]


@pytest.mark.parametrize("value", [b"\x00" * 20_000_000, bytearray(20_000_000)])
def test_echo_cuts_bytes_before_their_repr(value):
    """20 MB of bytes once became an 80 MB repr before the cut (4 characters a byte)."""
    import tracemalloc
    tracemalloc.start()
    try:
        text = echo(value)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20 and len(text) < 200 and "(length 20000000)" in text, (peak, text)


@pytest.mark.parametrize("value", [[1, "a", (2,), {3}, {"k": None}], (1,), (), set(), frozenset({1}), {},
                                   {"a": [1, 2], 3: b"x"}, [[]], "plain", b"bytes", 3.5, None])
def test_echo_of_a_short_value_is_its_repr(value):
    assert echo(value, 1000) == repr(value)
    assert echo(value, 1000, quote=False) == str(value)


def test_echo_of_a_self_containing_list_ends():
    loop: list = [1]
    loop.append(loop)
    assert echo(loop) == repr(loop) == "[1, [...]]"
