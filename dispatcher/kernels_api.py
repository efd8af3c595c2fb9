"""The parts of the `kernels` library the pack uses beyond its top-level API, wherever the installed version
keeps them.

kernels 0.19 moved its modules under `kernels._internals` (`variants`, `validate` with the same functions) and
replaced `verify.verify_variant` (0.16-0.18: one call checking the signature and the digest) with
`verify.verify_signature` and `digest.verify_digest`. Everything else here imports from this module, so a
kernels release that moves them again is fixed in one place (and CI runs the newest and the oldest allowed).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType


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
