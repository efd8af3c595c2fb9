"""The parts of the `kernels` library the pack uses beyond its top-level API, wherever the installed version
keeps them.

kernels 0.19 moved its modules under `kernels._internals` (`variants`, `validate` with the same functions) and
replaced `verify.verify_variant` (0.16-0.18: one call checking the signature and the digest) with
`verify.verify_signature` and `digest.verify_digest`. Everything else here imports from this module, so a
kernels release that moves them again is fixed in one place (and CI runs the newest and the oldest allowed).

It also owns what the pack tells kernels about trust and what kernels' own trust refusals mean. kernels 0.14+
checks a publisher itself before it reads anything, even a kernel already in the cache: unless HF_HUB_OFFLINE=1
(then it skips the check, with a warning) or `trust_remote_code` names the repo, it asks the Hub whether the
publisher is a trusted kernel publisher, and refuses when the Hub says no or cannot be asked (no network).
"""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path
from types import ModuleType

from .versions import at_least


def module(name: str) -> ModuleType:
    """`kernels.<name>` (kernels < 0.19) or `kernels._internals.<name>` (0.19+).

    Raises ModuleNotFoundError when neither exists, and lets through an import error from inside the module
    (sigstore missing, say), which says more than "not found".
    """
    for dotted in (f"kernels.{name}", f"kernels._internals.{name}"):
        try:
            return importlib.import_module(dotted)
        except ModuleNotFoundError as exc:
            if exc.name != dotted:
                raise
    raise ModuleNotFoundError(f"the installed kernels library has no module '{name}'", name=f"kernels.{name}")


def chosen_variant(variant_dir: Path):
    """The build variant the kernels library would pick among `variant_dir`'s siblings (None: none fits)."""
    variants = module("variants")
    chosen, _ = variants.resolve_variant(variants.get_variants_local(variant_dir.parent))
    return chosen


def check_arch(variant_dir: Path) -> None:
    """The library's own check that a build supports this device; raises with its reason."""
    validate = module("validate")
    metadata_cls = getattr(importlib.import_module("kernels"), "Metadata", None) or \
        importlib.import_module("kernels._rust").Metadata
    validate.ArchValidator().validate_metadata(metadata=metadata_cls.read_from_file(variant_dir / "metadata.json"),
                                               variant=variant_dir.name)


def signature_result(variant_dir: Path, repo_id: str | None, revision: str | None) -> tuple[str, str]:
    """(kind, detail) of the kernels library's signature and digest checks of a downloaded build.

    kind is one of "verified", "unsigned", "digest-failed", "digest-missing", "signature-failed",
    "metadata-missing"; detail is the library's words. Raises ImportError where this kernels (or its optional
    sigstore) cannot verify, and whatever the check raises (sigstore's trust root needs the network).
    """
    verify = module("verify")
    if hasattr(verify, "verify_variant"):  # kernels 0.16-0.18
        result = verify.verify_variant(Path(variant_dir))
        kinds = verify.VerificationResult
    else:  # kernels 0.19+: the signature of the metadata, then the files against the metadata's digest
        rust = importlib.import_module("kernels._rust")
        location = (rust.KernelLocation.remote(repo_id, rust.Oid.from_str(revision), Path(variant_dir).name)
                    if repo_id and revision else None)
        if location is None:
            raise ImportError("kernels 0.19+ verifies a build by its Hub repository and commit, and this build "
                              "has none (not a Hub cache snapshot)")
        result = verify.verify_signature(Path(variant_dir), location=location, cache=False)
        kinds = verify.SignatureVerificationResult
        if isinstance(result, kinds.Success):
            digest = module("digest")
            metadata = rust.Metadata.read_from_file(Path(variant_dir) / "metadata.json")
            result = digest.verify_digest(Path(variant_dir), metadata=metadata, location=location, cache=False)
            kinds = digest.DigestVerificationResult
    for cls_name, kind in _KINDS:
        cls = getattr(kinds, cls_name, None)
        if cls is not None and isinstance(result, cls):
            return kind, _detail(result)
    return "signature-failed", f"{type(result).__name__}: {_detail(result)}"


_KINDS = (("Success", "verified"), ("SignatureBundleMissing", "unsigned"),
          ("DigestVerificationFailure", "digest-failed"), ("DigestMissing", "digest-missing"),
          ("MetadataMissing", "metadata-missing"))


def _detail(result) -> str:
    violations = getattr(result, "violations", None)
    if violations:
        return "; ".join(str(v) for v in violations[:3])
    return " ".join(str(getattr(result, "reason", "") or "").split())[:300]


# ---- trust: what kernels is told, and what its refusals mean --------------------------------------------------

def trust_argument(kernels_version: str | None, repo_id: str) -> dict:
    """The `get_kernel`/`install_kernel` keyword that makes kernels accept `repo_id` without asking the Hub, for a
    repo the pack has decided to trust: its allowlist `[repo_id]` (0.17+), which leaves the repo's kernel
    dependencies to kernels' own check; True on 0.14-0.16 (they read a list as signing identities and ignore it);
    nothing before 0.14, which has no check of its own."""
    if kernels_version is None or not at_least(kernels_version, "0.14"):
        return {}
    return {"trust_remote_code": [repo_id] if at_least(kernels_version, "0.17") else True}


def trust_refusal(exc: BaseException) -> tuple[str, BaseException] | None:
    """(kind, what the Hub said) when `exc` is one of kernels' own publisher refusals, by its words (the same in
    0.14-0.19), else None. kind: "untrusted" (the Hub says the publisher is not a trusted kernel publisher), "auth"
    (the Hub refused the token: 0.19+), "unverified" (the Hub could not be asked: `hub_unreachable` says whether
    for want of a network)."""
    text = str(exc)
    for words, kind in (("is not from a trusted publisher", "untrusted"),
                        ("authentication failed while checking the publisher", "auth"),
                        ("could not verify publisher trust status", "unverified")):
        if words in text:
            return kind, exc.__cause__ or exc.__context__ or exc
    return None


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and its causes: kernels 0.19 raises its refusal `from` the Hub's error, 0.17 inside its handler."""
    chain, cursor = [], exc
    while cursor is not None and len(chain) < 20 and all(cursor is not seen for seen in chain):
        chain.append(cursor)
        cursor = cursor.__cause__ or cursor.__context__
    return chain


# httpx (huggingface_hub 1.x+), requests (0.x) and socket names for "no connection to the Hub at all"
_NETWORK_ERRORS = frozenset({"ConnectError", "ConnectTimeout", "TimeoutException", "NetworkError", "ConnectionError",
                             "ConnectTimeoutError", "ProxyError", "gaierror", "OfflineModeIsEnabled"})


def hub_unreachable(exc: BaseException) -> BaseException | None:
    """The error that says the Hub could not be reached at all (no network, DNS, a proxy, a timeout), if that is
    what `exc` comes from; None for an answer from the Hub (404, 401, ...) or any other failure."""
    for cursor in _chain(exc):
        if _NETWORK_ERRORS & {cls.__name__ for cls in type(cursor).__mro__}:
            return cursor
    return None


def known_cause(exc: BaseException) -> str:
    """The fix for a failure whose cause is known to be a version clash rather than the Hub or the kernel, or ""."""
    if os.environ.get("HF_HUB_DISABLE_TELEMETRY") and any("Illegal header value" in str(c) for c in _chain(exc)):
        return (" (with HF_HUB_DISABLE_TELEMETRY set, kernels 0.17 and huggingface_hub 2.x send an invalid "
                "User-Agent header: unset HF_HUB_DISABLE_TELEMETRY)")
    return ""


_NOT_CACHED = re.compile(r"not available in the local cache|Cannot find a local snapshot|is not in the local cache|"
                         r"^Version \d+ not found, available versions")


def not_cached(exc: BaseException) -> bool:
    """Whether kernels' cache-only resolution failed because the kernel (that version or revision) is not in the
    local cache, rather than because what is there is broken."""
    return any(type(c).__name__ == "LocalEntryNotFoundError" or _NOT_CACHED.search(str(c)) for c in _chain(exc))


def load_cached(kernels: ModuleType, repo_id: str, request: dict, trust: dict) -> ModuleType:
    """The kernel from the local cache alone, never the network: kernels' own offline resolution (the version's ref or
    the commit, the build variant it picks for this machine), as HF_HUB_OFFLINE=1 would do, then its local loader.
    `request`: {"version": N} or {"revision": R}; `trust`: `trust_argument`'s. kernels 0.17+ (install_kernel takes a
    version since 0.17); raises whatever kernels raises (see `not_cached`)."""
    variant = Path(kernels.install_kernel(repo_id, **request, local_files_only=True, **trust))
    return kernels.get_local_kernel(variant, **trust)
