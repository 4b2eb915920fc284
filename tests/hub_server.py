"""A Hub-compatible HTTP server for tests, spoken to by the real ``huggingface_hub`` client.

It implements the endpoints in ``shared/HUB_PROTOCOL.md``: revision, tree, resolve (HEAD/GET with
Range), create repo, branch, tag, preupload, commit (ndjson, base64 files), LFS batch + PUT,
validate-yaml and the agent-harnesses probe (404). Repos live in memory with branches, tags and
commits; file oids are real git blob sha1s, commit shas are derived from the content so they are
consistent but not git's.

Every request is recorded in ``server.log`` (method, path) so tests can assert what was asked for.
Faults can be injected for retry tests: ``fail_next``, ``delay_next``, ``truncate_next``, ``oversize_next``;
and answers a real Hub never gives: ``answer_next`` (any status, headers and body: bad JSON, endless
pages, redirects), ``drip_next`` (a body sent a byte at a time) and ``drip_headers_next`` (the
status line and headers sent a byte at a time).
A misbehaving server for hostile tests: ``listing_overrides`` (a listing that lies about a file),
``late_files`` (files that appear in listings and downloads only after the first listing),
``any_revision`` (every revision name answered with the default branch). ``sent`` records the body
bytes each GET of a file really delivered before the client stopped reading. ``xet_files``: files
served as the Hub serves Xet-backed ones (listing ``xetHash``, ``X-Xet-Hash`` answers, a Xet token
route), with a fake Xet storage at ``/cas/`` that holds nothing (404 after ``cas_stall`` seconds).

Use it from a test file with::

    from hub_server import hub_server  # noqa: F401

The ``hub_server`` fixture points ``HF_ENDPOINT`` / ``HF_HUB_CACHE`` / ``HF_HOME`` / ``GENKIT_HOME``
at it and at temporary folders, both in the environment and in ``huggingface_hub.constants``
(which the client reads once, at import).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

LFS_THRESHOLD = 10 * 1024 * 1024  # files larger than this are sent through LFS


# the user the test token belongs to: a repo created without an organization lands in its namespace
USER = "genkit-tester"


def xet_hash(data: bytes) -> str:
    """The (fake, but well-formed: 64 hex) Xet hash the test server gives a Xet-backed file."""
    return hashlib.sha256(b"xet\x00" + data).hexdigest()


def git_blob_oid(data: bytes) -> str:
    """The git blob sha1 of ``data`` (what the Hub reports as a file's ``oid``)."""
    return hashlib.sha1(b"blob %d\x00" % len(data) + data).hexdigest()


@dataclass
class Commit:
    sha: str
    files: dict[str, bytes]
    message: str
    parent: str | None


@dataclass
class Repo:
    repo_id: str
    repo_type: str = "model"
    private: bool = False
    branches: dict[str, str] = field(default_factory=dict)
    tags: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)
    lfs: dict[str, bytes] = field(default_factory=dict)  # sha256 -> bytes

    def resolve(self, rev: str, any_revision: bool = False) -> Commit | None:
        sha = self.branches.get(rev) or self.tags.get(rev)
        if sha is None and any_revision:
            sha = self.branches.get("main")
        if sha is None and re.fullmatch(r"[0-9a-f]{40}", rev):
            sha = rev
        return self.commits.get(sha) if sha else None


@dataclass
class Fault:
    kind: str  # "status" | "delay" | "truncate" | "oversize" | "answer" | "drip" | "drip_headers"
    remaining: int
    match: Callable[[str, str], bool]
    status: int = 500
    seconds: float = 0.0
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


class HubState:
    """In-memory repos plus the request log and the fault queue."""

    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], Repo] = {}
        self.log: list[tuple[str, str]] = []
        self.faults: list[Fault] = []
        self.lock = threading.RLock()
        self._counter = 0
        # path -> fields that replace the truth in every tree listing (a misbehaving server)
        self.listing_overrides: dict[str, dict[str, Any]] = {}
        # path -> bytes served (listed and downloadable) only after the first tree listing was answered
        self.late_files: dict[str, bytes] = {}
        self.tree_requests = 0
        # answer any revision name (even one a client should never send) with the default branch
        self.any_revision = False
        # (path, body bytes delivered) per GET of a file
        self.sent: list[tuple[str, int]] = []
        # paths served as Xet-backed files, as the Hub does for large files: listed with their LFS
        # metadata and a ``xetHash``, answered (HEAD/GET) with ``X-Xet-Hash`` and ``X-Xet-Refresh-Route``;
        # the refresh route hands out a Xet token whose storage (CAS) is ``{endpoint}/cas``
        self.xet_files: set[str] = set()
        # seconds the fake Xet storage (CAS) waits before answering 404 to a request (hf_xet talks to it)
        self.cas_stall = 0.0

    # ---- repo helpers for tests -------------------------------------------------------------
    def create_repo(self, repo_id: str, repo_type: str = "model", private: bool = False) -> Repo:
        with self.lock:
            key = (repo_type, repo_id)
            if key not in self.repos:
                repo = Repo(repo_id, repo_type, private)
                self.repos[key] = repo
                self.commit(repo_id, {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"},
                            message="initial commit", repo_type=repo_type)
            return self.repos[key]

    def repo(self, repo_id: str, repo_type: str = "model") -> Repo | None:
        return self.repos.get((repo_type, repo_id))

    def commit(self, repo_id: str, files: dict[str, bytes | str], *, branch: str = "main", message: str = "update",
               deleted: tuple[str, ...] = (), repo_type: str = "model", replace: bool = False) -> str:
        """Add a commit on ``branch`` (created from main when new); returns its sha."""
        with self.lock:
            repo = self.repos.get((repo_type, repo_id))
            if repo is None:
                repo = self.create_repo(repo_id, repo_type)
            head = repo.branches.get(branch) or repo.branches.get("main")
            base = {} if replace or head is None else dict(repo.commits[head].files)
            for path in deleted:
                base = {p: d for p, d in base.items() if p != path and not p.startswith(path.rstrip("/") + "/")}
            for path, data in files.items():
                base[path] = data.encode() if isinstance(data, str) else data
            self._counter += 1
            h = hashlib.sha1(f"{repo_id}\n{head}\n{message}\n{self._counter}\n".encode())
            for path in sorted(base):
                h.update(f"{path}:{git_blob_oid(base[path])}\n".encode())
            sha = h.hexdigest()
            repo.commits[sha] = Commit(sha, base, message, head)
            repo.branches[branch] = sha
            return sha

    def tag(self, repo_id: str, tag: str, rev: str = "main", repo_type: str = "model") -> str:
        with self.lock:
            repo = self.repos[(repo_type, repo_id)]
            commit = repo.resolve(rev)
            assert commit is not None, rev
            repo.tags[tag] = commit.sha
            return commit.sha

    # ---- faults ----------------------------------------------------------------------------
    @staticmethod
    def _matcher(pattern: str | None) -> Callable[[str, str], bool]:
        if pattern is None:
            return lambda method, path: not path.startswith("/api/agent-harnesses")
        rx = re.compile(pattern)
        return lambda method, path: bool(rx.search(f"{method} {path}"))

    def fail_next(self, n: int, status: int = 500, match: str | None = None) -> None:
        """Answer the next ``n`` matching requests with ``status`` (``match``: regex on 'METHOD /path')."""
        self.faults.append(Fault("status", n, self._matcher(match), status=status))

    def delay_next(self, n: int, seconds: float, match: str | None = None) -> None:
        """Sleep ``seconds`` before answering the next ``n`` matching requests."""
        self.faults.append(Fault("delay", n, self._matcher(match), seconds=seconds))

    def truncate_next(self, n: int, match: str | None = None) -> None:
        """Send only half the body (with the full Content-Length) of the next ``n`` matching GETs."""
        self.faults.append(Fault("truncate", n, self._matcher(match)))

    def oversize_next(self, n: int, extra: int = 10_000_000, match: str | None = None) -> None:
        """Send ``extra`` more bytes than the file has (a body longer than its listing, with a
        Content-Length to match) on the next ``n`` matching GETs of a file."""
        self.faults.append(Fault("oversize", n, self._matcher(match), status=extra))

    def answer_next(self, n: int, match: str, status: int = 200, body: bytes = b"",
                    headers: dict[str, str] | None = None) -> None:
        """Answer the next ``n`` matching requests with ``status``, ``headers`` and ``body`` instead of
        the truth; ``{endpoint}`` in a header value is the server's address."""
        self.faults.append(Fault("answer", n, self._matcher(match), status=status, body=body,
                                 headers=dict(headers or {})))

    def drip_next(self, n: int, seconds: float, match: str | None = None) -> None:
        """Send the body of the next ``n`` matching GETs one byte every ``seconds`` (a slow server
        that never lets a read time out)."""
        self.faults.append(Fault("drip", n, self._matcher(match), seconds=seconds))

    def drip_headers_next(self, n: int, seconds: float, match: str | None = None) -> None:
        """Send the status line and headers of the next ``n`` matching requests (GET or HEAD) one byte
        every ``seconds``: each read of the client gets a byte, so no per-read timeout ever trips."""
        self.faults.append(Fault("drip_headers", n, self._matcher(match), seconds=seconds))

    def take_fault(self, method: str, path: str) -> Fault | None:
        with self.lock:
            for fault in self.faults:
                if fault.remaining > 0 and fault.match(method, path):
                    if fault.kind in ("truncate", "oversize", "drip") and method != "GET":
                        continue
                    fault.remaining -= 1
                    return fault
        return None

    # ---- log helpers -----------------------------------------------------------------------
    def requested(self, suffix: str = "", method: str | None = None) -> list[tuple[str, str]]:
        """Logged requests whose path (without query) ends with ``suffix``."""
        return [(m, p) for m, p in list(self.log)
                if urlsplit(p).path.endswith(suffix) and (method is None or m == method)]

    def file_requests(self) -> list[tuple[str, str]]:
        """Logged HEAD/GET requests for file contents (the resolve endpoint)."""
        return [(m, p) for m, p in list(self.log) if "/resolve/" in p]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: HubServer

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    # ---- plumbing --------------------------------------------------------------------------
    @property
    def state(self) -> HubState:
        return self.server.state

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            return self.rfile.read(length)
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        return b""

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json", head: bool = False, truncate: bool = False,
              record: str | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        if truncate:
            self.send_header("Connection", "close")
            self.close_connection = True
        self._end_headers()
        if head:
            return
        body = body[: len(body) // 2] if truncate else body
        sent = 0
        piece = 1 if self._drip else 1 << 16
        try:  # in pieces, so a client that stops reading is seen (and `sent` says how much it took)
            for start in range(0, len(body), piece):
                self.wfile.write(body[start:start + piece])
                sent += min(piece, len(body) - start)
                if self._drip:
                    self.wfile.flush()
                    time.sleep(self._drip)
            self.wfile.flush()
        finally:
            if record is not None:
                with self.state.lock:
                    self.state.sent.append((record, sent))

    def _end_headers(self) -> None:
        if not self._drip_headers:
            return self.end_headers()
        self._headers_buffer.append(b"\r\n")  # what end_headers() would send, but a byte at a time
        data, self._headers_buffer = b"".join(self._headers_buffer), []
        for i in range(len(data)):
            self.wfile.write(data[i:i + 1])
            self.wfile.flush()
            time.sleep(self._drip_headers)
        return None

    def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None, head: bool = False) -> None:
        self._send(status, json.dumps(obj).encode(), headers, head=head)

    def _error(self, status: int, code: str | None, message: str, head: bool = False) -> None:
        headers = {"X-Error-Code": code} if code else {}
        headers["X-Error-Message"] = message
        self._json(status, {"error": message}, headers, head=head)

    def _dispatch(self, method: str) -> None:
        path = self.path
        with self.state.lock:
            self.state.log.append((method, path))
        body = self._body() if method in ("POST", "PUT") else b""
        fault = self.state.take_fault(method, path)
        self._truncate = False
        self._oversize = 0
        self._drip = 0.0
        self._drip_headers = fault.seconds if fault is not None and fault.kind == "drip_headers" else 0.0
        if fault is not None:
            if fault.kind == "answer":
                headers = {k: v.replace("{endpoint}", self.server.endpoint) for k, v in fault.headers.items()}
                try:
                    self._send(fault.status, fault.body, headers, head=method == "HEAD", record=path)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                return
            self._drip = fault.seconds if fault.kind == "drip" else 0.0
            if fault.kind == "status":
                self._error(fault.status, None, f"injected {fault.status}", head=method == "HEAD")
                return
            if fault.kind == "delay":
                time.sleep(fault.seconds)
            if fault.kind == "truncate":
                self._truncate = True
            if fault.kind == "oversize":
                self._oversize = fault.status
        try:
            self._route(method, path, body)
        except (BrokenPipeError, ConnectionResetError):
            pass

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    # ---- routing ---------------------------------------------------------------------------
    def _route(self, method: str, raw: str, body: bytes) -> None:
        split = urlsplit(raw)
        path, query = split.path, parse_qs(split.query)
        head = method == "HEAD"
        if path == "/api/agent-harnesses" or path.startswith("/api/agent-harnesses/"):
            return self._error(404, None, "not found", head=head)
        if path == "/api/repos/create" and method == "POST":
            return self._create_repo(json.loads(body or b"{}"))
        if path == "/api/validate-yaml" and method == "POST":
            return self._json(200, {"errors": [], "warnings": []})
        if path.startswith("/lfs-upload/") and method == "PUT":
            return self._lfs_put(path, body)
        if path.startswith("/cas/"):
            return self._cas(head)
        m = re.fullmatch(r"/api/(models|datasets|spaces)/([^/]+/[^/]+)(?:/(.*))?", path)
        if m:
            return self._api(method, {"models": "model", "datasets": "dataset", "spaces": "space"}[m.group(1)],
                             m.group(2), m.group(3) or "", query, body)
        m = re.fullmatch(r"/(?:(datasets|spaces)/)?([^/]+/[^/]+?)\.git/info/lfs/objects/batch", path)
        if m and method == "POST":
            return self._lfs_batch({"datasets": "dataset", "spaces": "space"}.get(m.group(1) or "", "model"),
                                   m.group(2), json.loads(body))
        m = re.fullmatch(r"/(?:(datasets|spaces)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m and method in ("GET", "HEAD"):
            return self._resolve({"datasets": "dataset", "spaces": "space"}.get(m.group(1) or "", "model"),
                                 m.group(2), unquote(m.group(3)), unquote(m.group(4)), head)
        return self._error(404, None, f"no route for {method} {path}", head=head)

    def _repo_or_404(self, repo_type: str, repo_id: str, head: bool = False) -> Repo | None:
        repo = self.state.repo(repo_id, repo_type)
        if repo is None:
            self._error(404, "RepoNotFound", f"Repository Not Found for url: {repo_id}", head=head)
        return repo

    def _info(self, repo: Repo, commit: Commit) -> dict[str, Any]:
        return {"id": repo.repo_id, "modelId": repo.repo_id, "sha": commit.sha, "private": repo.private,
                "siblings": [{"rfilename": p} for p in sorted(commit.files)], "tags": [],
                "lastModified": "2026-01-01T00:00:00.000Z", "gated": False, "disabled": False}

    def _api(self, method: str, repo_type: str, repo_id: str, rest: str, query: dict[str, list[str]],
             body: bytes) -> None:
        repo = self._repo_or_404(repo_type, repo_id)
        if repo is None:
            return
        parts = rest.split("/", 1) if rest else [""]
        action, arg = parts[0], unquote(parts[1]) if len(parts) > 1 else ""
        if method == "GET" and action in ("", "revision"):
            commit = repo.resolve(arg or "main", self.state.any_revision)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {arg}")
            return self._json(200, self._info(repo, commit))
        if method == "GET" and action == "tree":
            rev, _, sub = arg.partition("/")
            commit = repo.resolve(unquote(rev), self.state.any_revision)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            with self.state.lock:
                self.state.tree_requests += 1
                late = self.state.tree_requests > 1
            listing = self._tree(commit, sub, query.get("recursive", ["false"])[0] in ("true", "True", "1"), late)
            return self._json(200, listing)
        if method == "GET" and action == "xet-read-token":
            return self._send(200, b"{}", {"X-Xet-Cas-Url": f"{self.server.endpoint}/cas",
                                           "X-Xet-Access-Token": "xet-test-token",
                                           "X-Xet-Token-Expiration": str(int(time.time()) + 3600)})
        if method == "GET" and action == "refs":
            return self._json(200, {"branches": [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": s}
                                                 for b, s in repo.branches.items()],
                                    "tags": [{"name": t, "ref": f"refs/tags/{t}", "targetCommit": s}
                                             for t, s in repo.tags.items()], "converts": []})
        if method == "POST" and action == "preupload":
            files = json.loads(body)["files"]
            return self._json(200, {"files": [
                {"path": f["path"], "uploadMode": "lfs" if f.get("size", 0) > LFS_THRESHOLD else "regular",
                 "shouldIgnore": False, "oid": None} for f in files]})
        if method == "POST" and action == "commit":
            return self._commit(repo, arg or "main", body)
        if method == "POST" and action == "branch":
            start = json.loads(body or b"{}").get("startingPoint") or "main"
            commit = repo.resolve(start)
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {start}")
            if arg in repo.branches:
                return self._error(409, None, f"branch {arg} already exists")
            repo.branches[arg] = commit.sha
            return self._json(200, {})
        if method == "POST" and action == "tag":
            tag = json.loads(body)["tag"]
            commit = repo.resolve(arg or "main")
            if commit is None:
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {arg}")
            repo.tags[tag] = commit.sha
            return self._json(200, {})
        return self._error(404, None, f"no route for {method} /api/.../{rest}")

    def _files(self, commit: Commit, late: bool) -> dict[str, bytes]:
        return {**commit.files, **self.state.late_files} if late else commit.files

    def _tree(self, commit: Commit, sub: str, recursive: bool, late: bool = False) -> list[dict[str, Any]]:
        sub = sub.strip("/")
        prefix = f"{sub}/" if sub else ""
        entries: dict[str, dict[str, Any]] = {}
        for path, data in sorted(self._files(commit, late).items()):
            if not path.startswith(prefix):
                continue
            rel = path[len(prefix):]
            pieces = rel.split("/")
            for i in range(1, len(pieces)):
                d = prefix + "/".join(pieces[:i])
                if (recursive or i == 1) and d not in entries:
                    entries[d] = {"type": "directory", "path": d, "oid": hashlib.sha1(d.encode()).hexdigest()}
            if not recursive and len(pieces) > 1:
                continue
            entry: dict[str, Any] = {"type": "file", "path": path, "size": len(data), "oid": git_blob_oid(data)}
            if len(data) > LFS_THRESHOLD or path in self.state.xet_files:
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            if path in self.state.xet_files:
                entry["xetHash"] = xet_hash(data)
            entry.update(self.state.listing_overrides.get(path, {}))  # a server whose listing lies
            entries[path] = entry
        return list(entries.values())

    def _resolve(self, repo_type: str, repo_id: str, rev: str, filename: str, head: bool) -> None:
        repo = self._repo_or_404(repo_type, repo_id, head)
        if repo is None:
            return
        commit = repo.resolve(rev, self.state.any_revision)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", head=head)
        data = self._files(commit, self.state.tree_requests > 0).get(filename)
        if data is None:
            return self._error(404, "EntryNotFound", f"{filename} does not exist at {rev}", head=head)
        xet = filename in self.state.xet_files
        etag = hashlib.sha256(data).hexdigest() if len(data) > LFS_THRESHOLD or xet else git_blob_oid(data)
        headers = {"X-Repo-Commit": commit.sha, "ETag": f'"{etag}"', "Accept-Ranges": "bytes"}
        if xet:
            route = f"{self.server.endpoint}/api/{repo_type}s/{repo_id}/xet-read-token/{commit.sha}"
            headers.update({"X-Xet-Hash": xet_hash(data), "X-Xet-Refresh-Route": route,
                            "Link": f'<{route}>; rel="xet-auth"'})
        status, payload = 200, data + b"#" * self._oversize
        rng = self.headers.get("Range")
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", rng or "")
        if m:
            start = int(m.group(1))
            end = int(m.group(2)) if m.group(2) else len(data) - 1
            payload = data[start:end + 1]
            status = 206
            headers["Content-Range"] = f"bytes {start}-{start + len(payload) - 1}/{len(data)}"
        headers["Content-Length"] = str(len(payload))
        self._send(status, payload, headers, content_type="application/octet-stream", head=head,
                   truncate=self._truncate, record=None if head else filename)

    def _cas(self, head: bool) -> None:
        """The fake Xet storage: waits ``cas_stall`` seconds (the request is logged), then 404."""
        time.sleep(self.state.cas_stall)
        self._error(404, None, "the test server stores no Xet data", head=head)

    def _create_repo(self, req: dict[str, Any]) -> None:
        name, org = req.get("name"), req.get("organization")
        repo_id = f"{org}/{name}" if org else f"{USER}/{name}"  # a bare name: the token's user, as on the Hub
        repo_type = req.get("type") or "model"
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        url = f"{self.server.endpoint}/{prefix}{repo_id}"
        if self.state.repo(repo_id, repo_type) is not None:
            return self._json(409, {"error": "You already created this repo", "url": url})
        private = bool(req.get("private")) or req.get("visibility") in ("private", "protected")
        self.state.create_repo(repo_id, repo_type, private)
        return self._json(200, {"url": url, "name": repo_id})

    def _commit(self, repo: Repo, branch: str, body: bytes) -> None:
        files: dict[str, bytes] = {}
        deleted: list[str] = []
        message = "update"
        for line in body.decode().splitlines():
            if not line.strip():
                continue
            item = json.loads(line)
            key, value = item["key"], item["value"]
            if key == "header":
                message = value.get("summary") or message
            elif key == "file":
                files[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                data = repo.lfs.get(value["oid"])
                if data is None:
                    return self._error(400, None, f"LFS object {value['oid']} was not uploaded")
                files[value["path"]] = data
            elif key in ("deletedFile", "deletedFolder"):
                deleted.append(value["path"])
        if branch not in repo.branches and branch != "main":
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {branch}")
        sha = self.state.commit(repo.repo_id, files, branch=branch, message=message, deleted=tuple(deleted),
                                repo_type=repo.repo_type)
        prefix = "" if repo.repo_type == "model" else f"{repo.repo_type}s/"
        return self._json(200, {"commitUrl": f"{self.server.endpoint}/{prefix}{repo.repo_id}/commit/{sha}",
                                "commitOid": sha, "success": True})

    def _lfs_batch(self, repo_type: str, repo_id: str, req: dict[str, Any]) -> None:
        repo = self._repo_or_404(repo_type, repo_id)
        if repo is None:
            return
        objects = []
        for obj in req.get("objects", []):
            entry: dict[str, Any] = {"oid": obj["oid"], "size": obj["size"]}
            if obj["oid"] not in repo.lfs:
                entry["actions"] = {"upload": {
                    "href": f"{self.server.endpoint}/lfs-upload/{repo_type}/{repo_id}/{obj['oid']}"}}
            objects.append(entry)
        body = json.dumps({"transfer": "basic", "objects": objects}).encode()
        self._send(200, body, content_type="application/vnd.git-lfs+json")

    def _lfs_put(self, path: str, body: bytes) -> None:
        _, _, repo_type, org, name, oid = path.split("/", 5)
        repo = self.state.repo(f"{org}/{name}", repo_type)
        if repo is None or hashlib.sha256(body).hexdigest() != oid:
            return self._error(400, None, "bad LFS upload")
        repo.lfs[oid] = body
        self._send(200, b"")


class HubServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.state = HubState()
        self.endpoint = f"http://127.0.0.1:{self.server_address[1]}"
        self._thread: threading.Thread | None = None

    def start(self) -> HubServer:
        self._thread = threading.Thread(target=self.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def point_client_at(endpoint: str, hf_home: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Point the huggingface_hub client (env and the constants it read at import) at ``endpoint``."""
    import os

    from huggingface_hub import constants

    cache = os.path.join(hf_home, "hub")
    env = {"HF_ENDPOINT": endpoint, "HF_HOME": hf_home, "HF_HUB_CACHE": cache, "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_ETAG_TIMEOUT": "5",
           "HF_HUB_DOWNLOAD_TIMEOUT": "5", "HF_TOKEN": "hf_test_token_for_local_server"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    for name, value in {"ENDPOINT": endpoint, "HF_HOME": hf_home, "HF_HUB_CACHE": cache,
                        "HUGGINGFACE_HUB_CACHE": cache, "HF_HUB_DISABLE_XET": True, "HF_HUB_OFFLINE": False,
                        "HF_HUB_DISABLE_TELEMETRY": True, "HF_HUB_ETAG_TIMEOUT": 5, "HF_HUB_DOWNLOAD_TIMEOUT": 5,
                        "HUGGINGFACE_CO_URL_TEMPLATE": endpoint + "/{repo_id}/resolve/{revision}/{filename}",
                        }.items():
        if hasattr(constants, name):
            monkeypatch.setattr(constants, name, value)
    # the module-level HfApi behind huggingface_hub.file_exists & co. froze its endpoint at import
    from huggingface_hub import hf_api

    if getattr(hf_api, "api", None) is not None:
        monkeypatch.setattr(hf_api.api, "endpoint", endpoint)


@pytest.fixture
def hub_server(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    """A fresh in-memory Hub on 127.0.0.1 with the client, the HF cache and GENKIT_HOME pointed at
    temporary folders (``tmp_path/hf_home``, ``tmp_path/genkit_home``)."""
    server = HubServer().start()
    hf_home = tmp_path / "hf_home"
    point_client_at(server.endpoint, str(hf_home), monkeypatch)
    monkeypatch.setenv("GENKIT_HOME", str(tmp_path / "genkit_home"))
    monkeypatch.delenv("GENKIT_TRUSTED_REPOS", raising=False)
    monkeypatch.delenv("GENKIT_TRUST_LOCAL_RECIPES", raising=False)
    try:
        yield server
    finally:
        server.stop()


def write_recipe(root: Any, files: dict[str, str | bytes], readme: str | None = None) -> Any:
    """Write a recipe folder: ``files`` maps paths relative to ``root`` to contents; a README with
    the custom_generate tag is added unless ``readme`` says otherwise ('' for none)."""
    from pathlib import Path

    root = Path(root)
    for rel, data in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data, encoding="utf-8")
    if readme is None:
        readme = "---\ntags:\n  - custom_generate\n---\n\n# test recipe\n\nA recipe used by the tests.\n"
    if readme:
        (root / "README.md").write_text(readme, encoding="utf-8")
    return root


def group_beam_recipe(root: Any) -> str:
    """The group beam search recipe of tests/group_beam_recipe.py (transformers 4.x's algorithm on
    transformers 5's internals) written as a recipe folder at ``root``; returns its path."""
    from pathlib import Path

    code = (Path(__file__).resolve().parent / "group_beam_recipe.py").read_text(encoding="utf-8")
    return str(write_recipe(root, {"custom_generate/generate.py": code}))
