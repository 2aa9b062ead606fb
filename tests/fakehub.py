"""A Hugging Face–compatible hub for tests: the part of the HTTP API `huggingface_hub` and the mirror use.

- ``GET /api/models/{owner}/{name}[/revision/{rev}]`` (``?blobs=true`` adds sizes and LFS
  checksums), what ``HfApi.model_info(..., files_metadata=True)`` reads;
- ``HEAD|GET /{owner}/{name}/resolve/{rev}/{path}`` with the headers ``hf_hub_download`` expects
  (``X-Repo-Commit``, ``ETag``, ``X-Linked-Etag``, ``X-Linked-Size``, ``Content-Length``) and
  ``Range``; LFS files are redirected (302) to ``/cdn/…`` on a second port, another origin, as the
  real hub sends them to its CDN;
- errors as the hub sends them: 404 with ``X-Error-Code: RepoNotFound | RevisionNotFound |
  EntryNotFound``, 403 ``GatedRepo``.

Knobs for the cases a mirror must survive: a gated repository, a published sha256 that does not
match the bytes, a download cut off after N bytes, a download that stalls after N bytes until
released; and it counts the bytes it serves per file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
from pathlib import Path

from aiohttp import web

from tests.support import free_ports

CHUNK = 64 * 1024
_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


def git_blob_id(data: bytes) -> str:
    """The git object id of a file's bytes: what the hub publishes as ``blobId``."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class Served:
    """One GET answered with file bytes: where it started and how much it sent."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.sent = 0


class HubFile:
    def __init__(self, path: str, data: bytes, *, lfs: bool) -> None:
        self.path = path
        self.data = data
        self.lfs = lfs
        self.sha256 = hashlib.sha256(data).hexdigest()
        self.blob_id = git_blob_id(data)
        self.published_sha256: str | None = None  # a lie, when set: what info and headers say instead
        self.cut_after: int | None = None  # absolute offset at which a response is cut off
        self.cut_times = 0
        self.stall_after: int | None = None
        self.stall_times = 0
        self.stalled = asyncio.Event()  # set when a response reaches the stall point
        self.release = asyncio.Event()  # set to let a stalled response go on
        self.served: list[Served] = []

    @property
    def bytes_served(self) -> int:
        return sum(s.sent for s in self.served)

    @property
    def advertised_sha256(self) -> str:
        return self.published_sha256 or self.sha256


class HubRepo:
    def __init__(self, repo_id: str, commit: str, gated: str | bool) -> None:
        self.repo_id = repo_id
        self.commit = commit
        self.gated = gated
        self.revisions = {"main": commit, commit: commit}
        self.files: dict[str, HubFile] = {}
        self.granted_tokens: set[str] = set()  # tokens whose owner accepted a gated repo's terms


class FakeHub:
    def __init__(self, *, redirect_lfs: bool = True) -> None:
        self.redirect_lfs = redirect_lfs
        self.repos: dict[str, HubRepo] = {}
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, in order
        self.auth_seen: list[str | None] = []
        self.port, self.cdn_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.cdn_url = f"http://127.0.0.1:{self.cdn_port}"
        self._runner: web.AppRunner | None = None
        self._blobs: dict[str, HubFile] = {}

    # -- what a test sets up -----------------------------------------------------------------

    def add_repo(self, repo_id: str, *, gated: str | bool = False, commit: str | None = None) -> HubRepo:
        commit = commit or hashlib.sha1(repo_id.encode()).hexdigest()
        repo = HubRepo(repo_id, commit, gated)
        self.repos[repo_id] = repo
        return repo

    def add_file(self, repo_id: str, path: str, data: bytes | Path, *, lfs: bool | None = None) -> HubFile:
        """Serve ``data`` (bytes, or a file's contents, e.g. one `write_tiny_gguf` wrote) as ``path``."""
        content = Path(data).read_bytes() if isinstance(data, Path) else data
        f = HubFile(path, content, lfs=len(content) > 1024 if lfs is None else lfs)
        self.repos[repo_id].files[path] = f
        self._blobs[f.sha256] = f
        return f

    def file(self, repo_id: str, path: str) -> HubFile:
        return self.repos[repo_id].files[path]

    def resolve_requests(self) -> list[tuple[str, str]]:
        return [r for r in self.requests if "/resolve/" in r[1] or r[1].startswith("/cdn/")]

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> FakeHub:
        app = web.Application()
        app.router.add_get("/api/models/{owner}/{name}", self._info)
        app.router.add_get("/api/models/{owner}/{name}/revision/{revision}", self._info)
        app.router.add_route("*", "/{owner}/{name}/resolve/{revision}/{path:.+}", self._resolve)
        app.router.add_route("*", "/cdn/{sha256}", self._cdn)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        # One app on two ports: the second is the "CDN", another origin, so clients treat it as such.
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        await web.TCPSite(self._runner, "127.0.0.1", self.cdn_port).start()
        return self

    async def stop(self) -> None:
        for repo in self.repos.values():
            for f in repo.files.values():
                f.release.set()
        if self._runner is not None:
            await self._runner.cleanup()

    # -- handlers ----------------------------------------------------------------------------

    def _note(self, request: web.Request) -> None:
        self.requests.append((request.method, request.path))
        self.auth_seen.append(request.headers.get("Authorization"))

    @staticmethod
    def _error(status: int, code: str, message: str, commit: str | None = None) -> web.Response:
        headers = {"X-Error-Code": code, "X-Error-Message": message}
        if commit:
            headers["X-Repo-Commit"] = commit
        return web.json_response({"error": message}, status=status, headers=headers)

    async def _info(self, request: web.Request) -> web.Response:
        self._note(request)
        repo = self.repos.get(f"{request.match_info['owner']}/{request.match_info['name']}")
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        revision = request.match_info.get("revision", "main")
        commit = repo.revisions.get(revision)
        if commit is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        blobs = request.query.get("blobs", "").lower() in ("1", "true")
        siblings = []
        for f in repo.files.values():
            sibling: dict = {"rfilename": f.path}
            if blobs:
                sibling["size"] = len(f.data)
                sibling["blobId"] = f.blob_id
                if f.lfs:
                    sibling["lfs"] = {"size": len(f.data), "sha256": f.advertised_sha256, "pointerSize": 134}
            siblings.append(sibling)
        body = {
            "_id": repo.commit[:24],
            "id": repo.repo_id,
            "modelId": repo.repo_id,
            "sha": commit,
            "private": False,
            "gated": repo.gated,
            "disabled": False,
            "tags": [],
            "siblings": siblings,
            "lastModified": "2026-01-01T00:00:00.000Z",
        }
        return web.json_response(body)

    async def _resolve(self, request: web.Request) -> web.StreamResponse:
        self._note(request)
        repo = self.repos.get(f"{request.match_info['owner']}/{request.match_info['name']}")
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        commit = repo.revisions.get(request.match_info["revision"])
        if commit is None:
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        if repo.gated:
            token = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            if token not in repo.granted_tokens:
                return self._error(
                    403,
                    "GatedRepo",
                    f"Access to model {repo.repo_id} is restricted. You must have access to it and be authenticated.",
                    commit,
                )
        f = repo.files.get(request.match_info["path"])
        if f is None:
            return self._error(404, "EntryNotFound", "Entry not found", commit)
        headers = {"X-Repo-Commit": commit, "Accept-Ranges": "bytes"}
        if f.lfs:
            headers["X-Linked-Etag"] = f'"{f.advertised_sha256}"'
            headers["X-Linked-Size"] = str(len(f.data))
            if self.redirect_lfs:
                headers["ETag"] = f'"{f.blob_id}"'  # the pointer's; the file's is X-Linked-Etag
                headers["Location"] = f"{self.cdn_url}/cdn/{f.sha256}"
                return web.Response(status=302, headers=headers)
            headers["ETag"] = f'"{f.advertised_sha256}"'
        else:
            headers["ETag"] = f'"{f.blob_id}"'
        return await self._send(request, f, headers)

    async def _cdn(self, request: web.Request) -> web.StreamResponse:
        self._note(request)
        f = self._blobs.get(request.match_info["sha256"])
        if f is None:
            return web.Response(status=404, text="NoSuchKey")
        return await self._send(request, f, {"ETag": f'"{f.advertised_sha256}"', "Accept-Ranges": "bytes"})

    async def _send(self, request: web.Request, f: HubFile, headers: dict[str, str]) -> web.StreamResponse:
        size = len(f.data)
        start, end = 0, size - 1
        status = 200
        spec = request.headers.get("Range")
        if spec:
            m = _RANGE.match(spec.strip())
            if m is None or int(m.group(1)) >= size:
                return web.Response(status=416, headers={**headers, "Content-Range": f"bytes */{size}"})
            start = int(m.group(1))
            end = min(int(m.group(2)), size - 1) if m.group(2) else size - 1
            status = 206
            headers = {**headers, "Content-Range": f"bytes {start}-{end}/{size}"}
        length = end - start + 1
        headers = {**headers, "Content-Length": str(length), "Content-Type": "application/octet-stream"}
        if request.method == "HEAD":
            return web.Response(status=status, headers=headers)
        resp = web.StreamResponse(status=status, headers=headers)
        await resp.prepare(request)
        served = Served(start)
        f.served.append(served)
        pos = start
        cut = f.cut_after if f.cut_times > 0 and f.cut_after is not None and f.cut_after > start else None
        if cut is not None:
            f.cut_times -= 1
        stall = f.stall_after if f.stall_times > 0 and f.stall_after is not None and f.stall_after > start else None
        if stall is not None:
            f.stall_times -= 1
        while pos <= end:
            stop = min(end + 1, pos + CHUNK)
            if cut is not None:
                stop = min(stop, cut)
            if stall is not None:
                stop = min(stop, stall)
            await resp.write(f.data[pos:stop])
            served.sent += stop - pos
            pos = stop
            if cut is not None and pos >= cut:
                # Cut off mid-body: what was written is flushed, then the connection closes.
                if request.transport is not None:
                    request.transport.close()
                return resp
            if stall is not None and pos >= stall:
                stall = None
                f.stalled.set()
                await f.release.wait()
                if request.transport is None or request.transport.is_closing():
                    return resp
        with contextlib.suppress(ConnectionResetError):
            await resp.write_eof()
        return resp
