"""The latest attention reports, for the websocket event and the GET route.

Why a module-level store: routes run on the server thread, sampling on the prompt worker; the store
is the one place both see. It holds plain dicts (no tensors, no file paths), the newest last.
"""

from __future__ import annotations

import re
import threading
import time
import weakref
from collections import deque

from ..dispatcher import log, rotation_text
from .blocks import named

EVENT = "attention_dispatch.report"
_lock = threading.Lock()
_reports: deque = deque(maxlen=64)
_live: "weakref.WeakValueDictionary[str, object]" = weakref.WeakValueDictionary()


# An absolute file path inside a text (/home/u/..., C:\\Users\\..., ~/...): not after a word character, '.', ':'
# or '/', so repo ids (org/name), URLs (https://...) and ratios (1/sqrt(d)) are left alone.
_PATH = re.compile(r"(?<![\w.:/~-])(?:[A-Za-z]:[\\/]|~[\\/]|/(?=[\w.~-]))[^\s'\"<>|,;()\[\]]*")


REPORT_TEXT_LIMIT = 4000  # characters of one text in a report (a kernel's error, a summary)


def scrub(obj):
    """Plain data for the browser: no 'path' keys and no absolute file paths in texts (error messages name
    lock files, kernel caches and libraries); each path becomes '<path>'. Every text is cut and escaped
    (`log.echo`): a report echoes what kernels and inputs said."""
    if isinstance(obj, dict):
        return {k: scrub(v) for k, v in obj.items() if k != "path"}
    if isinstance(obj, (list, tuple)):
        return [scrub(v) for v in obj]
    if isinstance(obj, str):
        if len(obj) > REPORT_TEXT_LIMIT or not obj.isprintable():  # cut, escaped (its own line breaks kept)
            obj = log.echo(obj, REPORT_TEXT_LIMIT, quote=False, keep="\n")
        return _PATH.sub("<path>", obj) if ("/" in obj or "\\" in obj) else obj
    return obj


def _prompt_id():
    try:
        from server import PromptServer  # ComfyUI's server module; only present inside ComfyUI
        return getattr(PromptServer.instance, "last_prompt_id", None)
    except Exception:
        return None


def publish(kind: str, node_id, data: dict) -> dict:
    """Store a report and send it to the browser (when running inside ComfyUI)."""
    report = scrub({"kind": kind, "node": None if node_id is None else str(node_id), "prompt_id": _prompt_id(),
                    "time": time.time(), **data})
    with _lock:
        _reports.append(report)
    try:
        from server import PromptServer
        PromptServer.instance.send_sync(EVENT, report)
    except Exception:  # outside ComfyUI, or the server is shutting down: the store still has it
        pass
    return report


# ------------------------------------------------------------------------------------------------ report parts
# What a node's report says beyond the recorder's rows, computed once here so the route, the badge and the
# tests read the same thing.


def _delegated(served: str) -> bool:
    """A call the override handed on (step window, block range, ComfyUI's own attention): no kernel fallback."""
    return served.startswith("previous override") or served.startswith("comfy:")


def every_call_fallbacks(snapshot: dict) -> list[dict]:
    """Fallbacks that happened on every call the asked-for backend got at a call site (it served none there):
    [{requested, served: [..], sites: [..], calls, reasons: [..], every_site, text}], one per (requested, served
    backends). every_site: at every site where that backend was asked for."""
    per_site: dict[tuple[str, str], dict] = {}
    for row in snapshot.get("rows", ()) or ():
        requested, served = row.get("requested"), row.get("served")
        if not isinstance(requested, str) or not isinstance(served, str) or _delegated(served):
            continue
        entry = per_site.setdefault((requested, row.get("site")), {"own": 0, "served": {}, "reasons": []})
        if row.get("fell_back") and served != requested:
            entry["served"][served] = entry["served"].get(served, 0) + int(row.get("calls") or 0)
            entry["reasons"] += [r for r in row.get("reasons") or () if r not in entry["reasons"]]
        else:
            entry["own"] += int(row.get("calls") or 0)
    groups: dict[tuple, dict] = {}
    sites_of: dict[str, set] = {}
    for (requested, site), entry in sorted(per_site.items(), key=lambda item: tuple(map(str, item[0]))):
        sites_of.setdefault(requested, set()).add(site)
        if entry["own"] or not entry["served"]:
            continue
        key = (requested, tuple(sorted(entry["served"])))
        group = groups.setdefault(key, {"requested": requested, "served": list(key[1]), "sites": [], "calls": 0,
                                        "reasons": []})
        group["reasons"] += [r for r in entry["reasons"] if r not in group["reasons"]]
        group["sites"].append(site)
        group["calls"] += sum(entry["served"].values())
    out = []
    for group in groups.values():
        group["every_site"] = set(group["sites"]) == sites_of[group["requested"]]
        group["sites"] = _folded(group["sites"], sites_of[group["requested"]])
        where = "" if group["every_site"] else " at " + ", ".join(map(str, group["sites"]))
        why = "; ".join(group["reasons"])
        group["text"] = (f"{group['requested']} fell back to {' / '.join(group['served'])} on every call{where}"
                         + (f": {why}" if why else ""))
        out.append(group)
    return out


def _folded(sites, all_sites) -> list:
    """Sites, sorted, with the blocks of a kind named once by the kind when every block of it is there
    (["self #0", "self #1"] of those two -> ["self"])."""
    kinds: dict = {}
    for site in all_sites:
        kinds.setdefault(site_kind(site), set()).add(site)
    out = set()
    for site in sites:
        kind = site_kind(site)
        out.add(kind if kinds[kind] <= set(sites) else site)
    return sorted(out, key=str)


def site_kind(site) -> str:
    """A call site without its block: "self #5" -> "self" (the kind of the block that wrote the text, `named`)."""
    return named(str(site)).unnumbered.text


def block_of(site) -> dict:
    """The block a call site names, as a report carries it beside the text: {kind, stream, index, inner}, so the
    browser folds rows by their fields and never reads the text."""
    return named(str(site)).fields


def with_blocks(snapshot: dict) -> dict:
    """A recorder's snapshot whose rows carry their block's fields (`block`) beside their site's text."""
    return {**snapshot, "rows": [{**row, "block": block_of(row.get("site"))} for row in snapshot.get("rows", ())]}


def guard_results(snapshot: dict) -> list[dict]:
    """The quality guard's results, each with a `text`: one entry per block where it caught a kernel ("self #5"),
    and one per (kind of site, kernel) for the blocks where it passed ("self", with `blocks`: how many), so a model
    of 30 blocks reads as one line, not 30."""
    out, passed = [], {}
    for entry in snapshot.get("guard", ()) or ():
        backend, site, checks = entry.get("backend"), entry.get("site"), int(entry.get("checks") or 0)
        failures = list(entry.get("failures") or ())
        if failures:
            out.append({**entry, "checks": checks, "failures": failures, "blocks": 1})
            continue
        folded = passed.setdefault((site_kind(site), backend), {"site": site_kind(site), "backend": backend,
                                                                 "checks": 0, "max_error": None, "every": None,
                                                                 "failures": [], "blocks": 0})
        folded["checks"] += checks
        folded["blocks"] += 1
        error = entry.get("max_error")
        if isinstance(error, (int, float)) and (folded["max_error"] is None or error > folded["max_error"]):
            folded["max_error"] = error
        every = entry.get("every")
        if isinstance(every, int) and (folded["every"] is None or every > folded["every"]):
            folded["every"] = every
    for entry in [*out, *passed.values()]:
        backend, site, checks = entry["backend"], entry["site"], entry["checks"]
        entry["block"] = block_of(site)
        where = f"{site} ({entry['blocks']} blocks)" if entry["blocks"] > 1 else site
        text = f"quality guard: {backend} at {where}: {checks} check{'' if checks == 1 else 's'}"
        if isinstance(entry.get("max_error"), (int, float)):
            text += f", max error {entry['max_error']:.1e}"
        if entry.get("every"):
            text += f"; {rotation_text(entry['every'])}"
        for failure in entry["failures"]:
            replacement = failure.get("replacement")
            text += (f"; FAILED ({failure.get('reason')}): " +
                     (f"that call was recomputed with {replacement} and {backend} is demoted for this block of this "
                      "model" if replacement else "no exact backend was left to recompute it"))
        entry["text"] = text
    return [*out, *passed.values()]


def block_results(blocks: dict, notes: dict) -> dict:
    """The node's block range and the sites where it could not apply (site -> why, from the override)."""
    out = dict(blocks)
    unapplied: dict[str, list[str]] = {}
    for site, reason in sorted(notes.items(), key=lambda kv: str(kv[0])):
        unapplied.setdefault(reason, []).append(site)
    out["unapplied"] = [{"sites": sites, "reason": reason,
                         "text": f"block range {'..'.join(map(str, out.get('range', ())))} not applied at "
                                 f"{', '.join(map(str, sites))}: {reason}; every block used the backend"}
                        for reason, sites in unapplied.items()]
    return out


def full_precision_results(notes: dict) -> list[dict]:
    """Calls that came with low_precision_attention=False, per (kind of site, what kept them exact): the
    override's `precision_notes` (kept per block, "cross #5"), folded by kind, each with a `text`."""
    folded: dict = {}
    for (site, what), calls in notes.items():
        key = (site_kind(site), what)
        folded[key] = folded.get(key, 0) + calls
    return [{"site": site, "block": block_of(site), "calls": calls, "reason": what,
             "text": f"{site}: {calls} call{'' if calls == 1 else 's'} with low_precision_attention=False: {what}"}
            for (site, what), calls in sorted(folded.items(), key=lambda kv: tuple(map(str, kv[0])))]


def track_live(key: str, recorder) -> None:
    """A recorder with no end-of-run hook (text encoders): the route reads it when asked."""
    with _lock:  # latest() may be iterating on the server thread
        _live[key] = recorder


def latest() -> dict:
    with _lock:
        reports = list(_reports)
        recorders = list(_live.items())
    live = [{"kind": "live", "key": key, "recorder": scrub(rec.snapshot())} for key, rec in recorders]
    return {"reports": reports, "live": live}


def clear() -> None:
    with _lock:
        _reports.clear()
