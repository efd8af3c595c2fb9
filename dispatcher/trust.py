"""Who may run remote kernel code in this process.

The rules, checked by us before the `kernels` library is ever called (so they also hold with
kernels<0.14, which executes whatever it downloads):
- `DIFFUSERS_DISABLE_REMOTE_CODE=true` forbids every Hub kernel, whatever else says yes;
- publishers in `TRUSTED_PUBLISHERS` load without opt-in;
- any other publisher loads only with `DIFFUSERS_TRUST_REMOTE_KERNELS=true`, or inside a
  `trusted_publishers(...)` scope (the Trust Remote Kernels node scopes one to its models).

kernels 0.14+ then applies its own rule (docs/python.md#who-may-run-remote-kernel-code): online, it asks the Hub
whether the publisher is a trusted kernel publisher, unless told the repo is trusted. It is told so only for an
opt-in (`TrustDecision.opt_in`), or where the Hub cannot be reached and the kernel is read from the cache alone
(`hub.load`). So a kernel runs only where both rules allow it, or where the user opted in.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Iterable

from . import env

TRUSTED_PUBLISHERS = frozenset({"kernels-community"})

_scoped_publishers: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "attn_dispatch_trusted_publishers", default=frozenset())


@dataclass(frozen=True)
class TrustDecision:
    allowed: bool
    reason: str
    # A user opted in to this publisher (env or scope), trusted publisher or not: kernels is told to trust the repo too
    opt_in: bool = False


def _untrusted_hint(repo_id: str, publisher: str) -> str:
    return (f"set {env.TRUST_REMOTE_KERNELS}=true or allow '{publisher}' in a Trust Remote Kernels node "
            f"(dispatcher.trusted_publishers(['{publisher}'])) to load it")


def decide(repo_id: str) -> TrustDecision:
    publisher = repo_id.split("/", 1)[0]
    if env.flag(env.DISABLE_REMOTE_CODE):
        reason = (f"{env.DISABLE_REMOTE_CODE}=true forbids remote kernel code, so '{repo_id}' is not loaded; "
                  f"unset {env.DISABLE_REMOTE_CODE} to allow Hub kernels")
        if publisher not in TRUSTED_PUBLISHERS and not env.flag(env.TRUST_REMOTE_KERNELS) \
                and publisher not in _scoped_publishers.get():
            reason += f", and since '{publisher}' is not a trusted kernel publisher, also " + _untrusted_hint(repo_id, publisher)
        return TrustDecision(False, reason)
    if env.flag(env.TRUST_REMOTE_KERNELS):
        opted_by = f"{env.TRUST_REMOTE_KERNELS}=true trusts '{publisher}'"
    elif publisher in _scoped_publishers.get():
        opted_by = f"a Trust Remote Kernels scope allows '{publisher}'"
    else:
        opted_by = None
    if publisher in TRUSTED_PUBLISHERS:
        return TrustDecision(True, f"'{publisher}' is a trusted kernel publisher", opt_in=opted_by is not None)
    if opted_by is not None:
        return TrustDecision(True, opted_by, opt_in=True)
    return TrustDecision(False, f"'{repo_id}' is not published by a trusted kernel publisher, so loading it downloads and "
                                "runs remote code; " + _untrusted_hint(repo_id, publisher))


def kernels_refusal(repo_id: str, kind: str, detail: str) -> str:
    """The refusal of kernels' own publisher check (`kernels_api.trust_refusal`'s kind), in the pack's words and with
    the pack's fix; never kernels' advice to pass `trust_remote_code`, which is no setting of the pack."""
    publisher = repo_id.split("/", 1)[0]
    # "; set ..." and ": run ..." begin the fix where the web extension looks for it (web/format.js splitReason)
    if kind == "untrusted":
        return (f"the Hugging Face Hub does not list '{publisher}' as a trusted kernel publisher, so the kernels "
                f"library refuses to run '{repo_id}'; " + _untrusted_hint(repo_id, publisher) + " anyway, if you "
                "trust it")
    if kind == "auth":
        return (f"the Hugging Face Hub rejected your token while the kernels library checked the publisher of "
                f"'{repo_id}': run `hf auth login`, or update or unset HF_TOKEN")
    return (f"the kernels library could not confirm with the Hugging Face Hub that '{publisher}' is a trusted kernel "
            f"publisher ({detail}), so it refuses to run '{repo_id}'; " + _untrusted_hint(repo_id, publisher)
            + " anyway if you trust it, or try again later")


def scope_key() -> tuple:
    """What trust decisions currently depend on (part of cached dispatch decisions)."""
    return (_scoped_publishers.get(), env.flag(env.DISABLE_REMOTE_CODE), env.flag(env.TRUST_REMOTE_KERNELS))


@contextlib.contextmanager
def trusted_publishers(publishers: Iterable[str]):
    """Trust these publishers for the calls made inside the block (and only those).

    A single string is one publisher or a comma-separated list ("orgA, orgB"), never its letters.
    """
    if isinstance(publishers, str):
        publishers = publishers.split(",")
    names = frozenset(p.strip() for p in publishers if isinstance(p, str) and p.strip())
    token = _scoped_publishers.set(_scoped_publishers.get() | names)
    try:
        yield names
    finally:
        _scoped_publishers.reset(token)
