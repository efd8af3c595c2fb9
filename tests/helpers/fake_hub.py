"""A local stand-in for the Hugging Face Hub that the real `kernels` library downloads from.

Point `HF_ENDPOINT` at `FakeHub.url` (before huggingface_hub is imported: use a subprocess) and
`kernels.install_kernel` / `get_kernel` run their real online path against it: the publisher
trust check (`/api/organizations/<org>/overview`, switchable per org: `set_org`), version branches (`/api/kernels/<repo>/refs`),
variant listing (`/api/kernels/<repo>/tree/<rev>/build`), `snapshot_download` (revision info,
recursive tree, then `HEAD`/`GET /kernels/<repo>/resolve/<rev>/<file>`).

A repository's files come from a directory on disk, typically a checkout built by
`kernel_repos.make_local_repo` (`build/<variant>/...`). Every request is logged, so a test can
assert that nothing was downloaded.
"""

from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


def dead_endpoint() -> str:
    """A localhost URL nothing listens on: connecting fails at once, like a machine without network."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Revision:
    commit: str
    files: dict[str, bytes]  # path in repo -> content


@dataclass
class Repo:
    repo_id: str
    branches: dict[str, str] = field(default_factory=dict)  # "v1" -> commit
    revisions: dict[str, Revision] = field(default_factory=dict)  # commit -> files


class FakeHub:
    def __init__(self):
        self.repos: dict[str, Repo] = {}
        self.trusted_orgs: dict[str, bool] = {}
        self.org_errors: dict[str, int] = {}  # org -> HTTP status its overview answers instead (401, 404, ...)
        self.requests: list[tuple[str, str]] = []
        # path in repo -> HTTP status answered instead of the file (a Hub error mid-download; 5xx are
        # retried by huggingface_hub for ~25 s, so tests use 4xx)
        self.error_files: dict[str, int] = {}
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ content

    def add_org(self, org: str, *, trusted: bool) -> None:
        self.trusted_orgs[org] = trusted

    def set_org(self, org: str, state: str) -> str:
        """What the publisher overview of `org` answers from now on: "trusted", "untrusted", "unknown" (404) or
        an HTTP status ("401"). A subprocess switches it between its cases through GET /_org/<org>/<state>."""
        self.org_errors.pop(org, None)
        if state in ("trusted", "untrusted"):
            self.trusted_orgs[org] = state == "trusted"
        elif state == "unknown":
            self.trusted_orgs.pop(org, None)
        else:
            self.org_errors[org] = int(state)
        return state

    def add_version(self, repo_id: str, version: int, checkout: Path, *, label: str | None = None) -> str:
        """Publish the files under `checkout` as branch v<version>; returns the commit."""
        files = {str(p.relative_to(checkout)).replace("\\", "/"): p.read_bytes()
                 for p in sorted(Path(checkout).rglob("*")) if p.is_file() and "__pycache__" not in p.parts}
        commit = hashlib.sha1(f"{repo_id}@{label or version}:{sorted(files)}".encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, Repo(repo_id))
        repo.revisions[commit] = Revision(commit, files)
        repo.branches[f"v{version}"] = commit
        self.trusted_orgs.setdefault(repo_id.split("/", 1)[0], False)
        return commit

    def downloads(self) -> list[str]:
        """The files fetched with GET (not HEAD) so far."""
        return [path for method, path in self.requests if method == "GET" and "/resolve/" in path]

    def requests_by_step(self) -> dict[str, list[tuple[str, str]]]:
        """The request log split at the runner's `/_mark/<step>` requests."""
        steps: dict[str, list[tuple[str, str]]] = {"": []}
        current = ""
        for method, path in self.requests:
            if path.startswith("/_mark/"):
                current = path[len("/_mark/"):]
                steps[current] = []
            else:
                steps[current].append((method, path))
        return steps

    # ------------------------------------------------------------------ server

    def start(self) -> "FakeHub":
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                hub._handle(self, "GET")

            def do_HEAD(self):
                hub._handle(self, "HEAD")

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    # ------------------------------------------------------------------ routing

    def _resolve(self, repo: Repo, rev: str) -> Revision | None:
        rev = unquote(rev)
        if rev in repo.revisions:
            return repo.revisions[rev]
        commit = repo.branches.get(rev) or (repo.branches[max(repo.branches)] if rev == "main" and repo.branches
                                            else None)
        return repo.revisions.get(commit) if commit else None

    def _handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        path = urlsplit(handler.path).path
        self.requests.append((method, path))
        parts = [unquote(p) for p in path.strip("/").split("/")]
        try:
            if parts[0] == "_mark":  # a test runner's step marker (see requests_by_step)
                return self._json(handler, {"mark": parts[1:]})
            if parts[0] == "_org" and len(parts) == 3:  # a test runner's switch: /_org/<org>/<state>
                return self._json(handler, {"org": self.set_org(parts[1], parts[2])})
            if parts[:2] == ["api", "organizations"] and len(parts) == 4 and parts[3] == "overview":
                org = parts[2]
                if org in self.org_errors:
                    return self._json(handler, {"error": "fake hub: refused"}, self.org_errors[org])
                if org not in self.trusted_orgs:
                    return self._json(handler, {"error": "not found"}, 404)
                return self._json(handler, {"name": org, "fullname": org,
                                            "trustedKernelPublisher": self.trusted_orgs[org]})
            if parts[:2] == ["api", "kernels"] and len(parts) >= 5:
                repo = self.repos.get(f"{parts[2]}/{parts[3]}")
                if repo is None:
                    return self._json(handler, {"error": "Repository not found"}, 404, repo_missing=True)
                return self._api(handler, repo, parts[4:])
            if parts[0] == "kernels" and len(parts) >= 6 and parts[3] == "resolve":
                repo = self.repos.get(f"{parts[1]}/{parts[2]}")
                if repo is None:
                    return self._json(handler, {"error": "Repository not found"}, 404, repo_missing=True)
                return self._file(handler, method, repo, parts[4], "/".join(parts[5:]))
        except (BrokenPipeError, ConnectionResetError):
            return
        return self._json(handler, {"error": f"fake hub: no route for {path}"}, 404)

    def _api(self, handler, repo: Repo, rest: list[str]):
        if rest == ["refs"]:
            branches = [{"name": name, "ref": f"refs/heads/{name}", "targetCommit": commit}
                        for name, commit in sorted(repo.branches.items())]
            return self._json(handler, {"branches": branches, "tags": [], "converts": []})
        if rest[0] == "revision" and len(rest) == 2:
            revision = self._resolve(repo, rest[1])
            if revision is None:
                return self._json(handler, {"error": "Revision not found"}, 404, revision_missing=True)
            return self._json(handler, {"id": repo.repo_id, "sha": revision.commit,
                                        "siblings": [{"rfilename": f} for f in revision.files]})
        if rest[0] == "tree" and len(rest) >= 2:
            revision = self._resolve(repo, rest[1])
            if revision is None:
                return self._json(handler, {"error": "Revision not found"}, 404, revision_missing=True)
            prefix = "/".join(rest[2:]).strip("/")
            recursive = "recursive=true" in (urlsplit(handler.path).query or "").lower()
            return self._json(handler, self._tree(revision, prefix, recursive))
        return self._json(handler, {"error": "fake hub: unknown api"}, 404)

    @staticmethod
    def _tree(revision: Revision, prefix: str, recursive: bool) -> list[dict]:
        entries, folders = [], set()
        base = prefix + "/" if prefix else ""
        for path, data in revision.files.items():
            if not path.startswith(base):
                continue
            rest = path[len(base):].split("/")
            for depth in range(1, len(rest)):
                folder = base + "/".join(rest[:depth])
                if (recursive or depth == 1) and folder not in folders:
                    folders.add(folder)
                    entries.append({"type": "directory", "oid": hashlib.sha1(folder.encode()).hexdigest(),
                                    "path": folder})
            if recursive or len(rest) == 1:
                entries.append({"type": "file", "oid": git_blob_id(data), "size": len(data), "path": path})
        return entries

    def _file(self, handler, method: str, repo: Repo, rev: str, filename: str):
        revision = self._resolve(repo, rev)
        if revision is None:
            return self._json(handler, {"error": "Revision not found"}, 404, revision_missing=True)
        if filename in self.error_files:
            return self._json(handler, {"error": "fake hub: refused"}, self.error_files[filename])
        data = revision.files.get(filename)
        if data is None:
            return self._json(handler, {"error": "Entry not found"}, 404, entry_missing=True)
        handler.send_response(200)
        handler.send_header("X-Repo-Commit", revision.commit)
        handler.send_header("ETag", f'"{git_blob_id(data)}"')
        handler.send_header("Content-Length", str(len(data)))
        handler.send_header("Content-Type", "application/octet-stream")
        handler.end_headers()
        if method == "GET":
            handler.wfile.write(data)

    @staticmethod
    def _json(handler, payload, status: int = 200, *, repo_missing=False, revision_missing=False,
              entry_missing=False):
        body = json.dumps(payload).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        if repo_missing:
            handler.send_header("X-Error-Code", "RepoNotFound")
        elif revision_missing:
            handler.send_header("X-Error-Code", "RevisionNotFound")
        elif entry_missing:
            handler.send_header("X-Error-Code", "EntryNotFound")
        handler.send_header("X-Error-Message", payload.get("error", "") if isinstance(payload, dict) else "")
        handler.end_headers()
        if handler.command != "HEAD":
            handler.wfile.write(body)
