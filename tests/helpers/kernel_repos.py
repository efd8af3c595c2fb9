"""Kernel repositories built on disk, loadable by the real `kernels` library with no network.

Two layouts (reference-dispatchers.md C.4/C.7):
- a local repository (`<repo>/build/torch-universal/{metadata.json, <python_name>/__init__.py}`), for
  `LOCAL_KERNELS="org/name=<repo>"` (read by `kernels` on every `get_kernel` call);
- the offline Hugging Face cache (`<cache>/kernels--<org>--<name>/refs/v<N>` holding a commit and
  `<cache>/kernels--<org>--<name>/snapshots/<commit>/build/torch-universal/...`), for
  `HF_HUB_CACHE=<cache>` + `HF_HUB_OFFLINE=1` (read by huggingface_hub at import: use a subprocess).

The kernel is a pure-torch `flash_attn_func` with the FlashAttention-2 signature, so the dispatcher's
real flash_hub calling code (`dispatcher.backends.flash.dense`) runs against it on the CPU.

Run as a script (`python tests/helpers/kernel_repos.py CONFIG.json`) it executes trust cases in a fresh
interpreter whose environment was set before huggingface_hub/kernels were imported, and prints one
JSON line with the outcome of each case.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository root

VARIANT = "torch-universal"

# The kernel: FlashAttention-2's flash_attn_func, (B, S, H, D) in and out, log-sum-exp (B, H, S).
KERNEL_SOURCE = '''\
"""Test kernel {tag!r}: FlashAttention-2's flash_attn_func in plain torch (BSHD)."""
import math

import torch

TAG = {tag!r}
CALLS = []


def flash_attn_func(q, k, v, softmax_scale=None, causal=False, return_attn_probs=False, dropout_p=0.0, **kwargs):
    if kwargs:
        raise TypeError(f"flash_attn_func() got unexpected keyword arguments {{sorted(kwargs)}}")
    CALLS.append({{"shape": tuple(q.shape), "causal": causal, "scale": softmax_scale,
                  "return_attn_probs": return_attn_probs, "dropout_p": dropout_p}})
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(d)
    compute = torch.promote_types(q.dtype, torch.float32)  # fp32 math for half inputs, fp64 stays fp64
    qh, kh, vh = (t.transpose(1, 2).to(compute) for t in (q, k, v))  # (B, H, S, D)
    if hk != h:
        kh, vh = kh.repeat_interleave(h // hk, dim=1), vh.repeat_interleave(h // hk, dim=1)
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:  # FlashAttention aligns the diagonal bottom-right
        keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, Sq)
    probs = torch.softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout_p)
    out = torch.matmul(probs, vh).transpose(1, 2).to(q.dtype).contiguous()  # (B, Sq, H, Dv)
    if return_attn_probs:
        return out, lse, None
    return out
'''

RAISING_SOURCE = '''\
raise RuntimeError("this kernel download is corrupted: {tag}")
'''


@dataclass(frozen=True)
class KernelRepo:
    repo_id: str
    path: Path  # the repository root (LOCAL_KERNELS) or the snapshot directory (cache)
    kernel_id: str  # metadata id: the sys.modules key of the imported kernel
    tag: str
    commit: str | None = None  # the snapshot commit, for cache repositories

    @property
    def name(self) -> str:
        return self.repo_id.split("/", 1)[1]

    @property
    def variant_dir(self) -> Path:
        return self.path / "build" / VARIANT


def python_name(name: str) -> str:
    return name.replace("-", "_")


def unique_id(repo_id: str) -> str:
    return "_attn_test_" + python_name(repo_id.replace("/", "_")) + "_" + uuid.uuid4().hex[:10]


def write_variant(variant_dir: Path, *, name: str, kernel_id: str, tag: str, broken: str | None = None,
                  flat: bool = False) -> Path:
    """One `torch-universal` build: metadata.json and the package. broken: None | 'metadata' | 'import'."""
    variant_dir.mkdir(parents=True, exist_ok=True)
    metadata = {"name": name, "id": kernel_id, "version": 1, "license": "Apache-2.0", "python-depends": [],
                "backend": {"type": "cpu"}}
    text = json.dumps(metadata, indent=2)
    if broken == "metadata":
        text = text[: len(text) // 2]  # a truncated download: invalid JSON
    (variant_dir / "metadata.json").write_text(text)
    package = variant_dir if flat else variant_dir / python_name(name)
    package.mkdir(parents=True, exist_ok=True)
    source = RAISING_SOURCE if broken == "import" else KERNEL_SOURCE
    (package / "__init__.py").write_text(source.format(tag=tag))
    return variant_dir


def make_local_repo(root: Path, repo_id: str, *, tag: str | None = None, broken: str | None = None,
                    flat: bool = False) -> KernelRepo:
    """A kernel repository checked out at `root/<org>__<name>` (for LOCAL_KERNELS)."""
    org, name = repo_id.split("/", 1)
    path = Path(root) / f"{org}__{name}"
    kernel_id = unique_id(repo_id)
    tag = tag or f"local:{repo_id}"
    write_variant(path / "build" / VARIANT, name=name, kernel_id=kernel_id, tag=tag, broken=broken, flat=flat)
    return KernelRepo(repo_id=repo_id, path=path, kernel_id=kernel_id, tag=tag)


def commit_for(repo_id: str, label: str) -> str:
    return hashlib.sha1(f"{repo_id}@{label}".encode()).hexdigest()


def cache_repo_dir(cache: Path, repo_id: str) -> Path:
    org, name = repo_id.split("/", 1)
    return Path(cache) / f"kernels--{org}--{name}"


def make_cache_repo(cache: Path, repo_id: str, *, version: int | None = 1, label: str = "v1-build",
                    tag: str | None = None, broken: str | None = None) -> KernelRepo:
    """A kernel downloaded into the HF cache layout: refs/v<version> -> snapshots/<commit>/build/...

    version=None writes the snapshot without a version ref (reachable by revision only). Call again
    with another label to add a second snapshot; the last call with a version owns refs/v<version>.
    """
    name = repo_id.split("/", 1)[1]
    base = cache_repo_dir(cache, repo_id)
    commit = commit_for(repo_id, label)
    snapshot = base / "snapshots" / commit
    kernel_id = unique_id(repo_id)
    tag = tag or f"cache:{repo_id}@{label}"
    write_variant(snapshot / "build" / VARIANT, name=name, kernel_id=kernel_id, tag=tag, broken=broken)
    if version is not None:
        (base / "refs").mkdir(parents=True, exist_ok=True)
        (base / "refs" / f"v{version}").write_text(commit)
    return KernelRepo(repo_id=repo_id, path=snapshot, kernel_id=kernel_id, tag=tag, commit=commit)


def local_kernels_value(*repos: KernelRepo) -> str:
    """The LOCAL_KERNELS value mapping each repo id to its checkout."""
    return ":".join(f"{r.repo_id}={r.path}" for r in repos)


def write_lock(path: Path, entries: list[dict]) -> Path:
    """The dispatcher's lock file: {"kernels": [{"repo_id", "version", "revision", "variant"}]}."""
    Path(path).write_text(json.dumps({"kernels": [{"variant": VARIANT, **e} for e in entries]}, indent=2))
    return Path(path)


def load_or_skip_without_network(spec) -> None:
    """Load the Hub kernel of backend `spec` (if it has one) before a test runs it. Where the Hub cannot be reached
    and the kernel is not in the local cache (a GPU machine without network), the test is skipped with
    "no network here: <the pack's reason>"; any other failure to load (refused, broken, no build for this GPU)
    raises KernelLoadError, and so fails the test as it should."""
    if spec.hub is None:
        return
    import pytest

    from dispatcher import hub
    try:
        hub.load(spec.hub)
    except hub.HubUnreachableError as exc:
        pytest.skip(f"no network here: {exc}")


# ---------------------------------------------------------------------------------------------------------------
# Subprocess runner: cases whose environment must exist before huggingface_hub / kernels are imported.
# ---------------------------------------------------------------------------------------------------------------

# Read by the dispatcher per call: each case starts from the interpreter's own values of these.
CASE_VARS = ("DIFFUSERS_DISABLE_REMOTE_CODE", "DIFFUSERS_TRUST_REMOTE_KERNELS", "ATTN_DISPATCH_KERNEL_LOCK")


def _tell_fake_hub(path: str) -> None:
    """GET `path` on the fake Hub HF_ENDPOINT names (tests/helpers/fake_hub.py): a step mark or an org switch."""
    import urllib.request
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    opener.open(os.environ["HF_ENDPOINT"].rstrip("/") + path, timeout=10).read()


def run_cases(config: dict) -> list[dict]:
    """Run each case of `config["cases"]` through dispatcher.hub.load and dispatch; one result each.

    A case: {"id", "backend", "repo_id", "env": {var: value}, "scope": [publishers] | None,
    "dispatch": bool, "policy", "orgs": {org: state}}. With a fake Hub at HF_ENDPOINT, each case first marks its
    step (`FakeHub.requests_by_step()[id]`) and sets what the Hub says of the `orgs` it names (`FakeHub.set_org`).
    config["backends"]: [{"name", "repo_id", "version", "revision"}].
    """
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import torch

    import dispatcher
    from dispatcher import caches, hub, registry

    flash_hub_fn = registry.get("flash_hub").fn
    for b in config["backends"]:
        dispatcher.register_backend(
            b["name"], flash_hub_fn, devices=("cpu",), causal=True, lse=True, dropout=True, gqa=True,
            hub_kernel=dispatcher.HubKernel(b["repo_id"], "flash_attn_func", version=b.get("version"),
                                            revision=b.get("revision")))
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 16, 4, 32) for _ in range(3))
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    base_env = {var: os.environ[var] for var in CASE_VARS if var in os.environ}
    results = []
    fake_hub = config.get("fake_hub", False)
    for case in config["cases"]:
        if fake_hub:
            _tell_fake_hub(f"/_mark/{case['id']}")
            for org, state in case.get("orgs", {}).items():
                _tell_fake_hub(f"/_org/{org}/{state}")
        for var in CASE_VARS:
            os.environ.pop(var, None)
        os.environ.update(base_env)
        os.environ.update(case.get("env", {}))
        hub.forget_loaded()
        caches.forget()
        registry.forget_availability()
        result = {"id": case["id"], "loaded": False, "error": None, "record": None, "reasons": None,
                  "served": None, "max_error": None, "calls": None}
        scope = case.get("scope")
        ctx = dispatcher.trusted_publishers(scope) if scope is not None else contextlib.nullcontext()
        with ctx:
            spec = registry.get(case["backend"])
            result["reasons"] = dispatcher.availability_reasons(case["backend"])
            result["imported_before"] = case.get("kernel_id") in sys.modules
            try:
                fn, record = hub.load(spec.hub)
                result["loaded"], result["record"] = True, record.as_dict()
                module = sys.modules.get(fn.__module__)
                result["tag"] = getattr(module, "TAG", None)
            except hub.KernelLoadError as exc:
                result["error"] = str(exc)
                result["error_type"] = type(exc).__name__
            if case.get("dispatch"):
                recorder = dispatcher.Recorder()
                try:
                    with dispatcher.recording(recorder):
                        out = dispatcher.dispatch_attention_fn(q, k, v, backend=case["backend"],
                                                               policy=case.get("policy", "fallback"))
                    result["max_error"] = float((out - reference).abs().max())
                    result["served"] = recorder.snapshot()["rows"][0]["served"]
                    result["fallback_reasons"] = recorder.snapshot()["rows"][0]["reasons"]
                except Exception as exc:  # strict policy: reported, asserted by the test
                    result["dispatch_error"] = f"{type(exc).__name__}: {exc}"
        result["imported"] = case.get("kernel_id") in sys.modules
        results.append(result)
    return results


def main(argv: list[str]) -> int:
    config = json.loads(Path(argv[1]).read_text())
    results = run_cases(config)
    import huggingface_hub.constants as constants
    import kernels
    print("RESULTS " + json.dumps({"results": results, "offline": constants.HF_HUB_OFFLINE,
                                   "cache": constants.HF_HUB_CACHE, "kernels": kernels.__version__}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
