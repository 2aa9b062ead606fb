"""Downloading one file into ``FILE.partial``: HTTP ``Range`` resume, hashing as it goes, a bounded disk.

Resuming is the mirror's own work: the partial file's size is the offset to ask for, whether the
bytes before it came from a connection cut a second ago or from a process that was stopped
yesterday (its prefix is hashed again first, so the checksum covers every byte). A hub that
ignores ``Range`` (200 instead of 206) gets the whole file again, from an empty partial.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import IO, Any
from urllib.parse import urljoin

import aiohttp
import msgspec

from llmgw.events.mirror import MirrorFile

HASH_BLOCK = 4 << 20
MAX_REDIRECTS = 5


class DownloadError(Exception):
    """A download that cannot go on: ``code`` is ``network`` (worth a later retry), ``refused``
    (the hub said no: gated, missing, forbidden) or ``checksum`` (the bytes are not what was published)."""

    def __init__(self, reason: str, code: str) -> None:
        self.reason = reason
        self.code = code
        super().__init__(reason)


class _Transient(Exception):
    """Worth trying again at once, from where the partial file ends."""


class Digests(msgspec.Struct, frozen=True, kw_only=True):
    size: int
    sha256: str
    blob_id: str  # the git blob id, for files the hub publishes no sha256 for
    resumed_from: int
    downloaded: int


class DiskGuard:
    """How much the mirror directory may still take: the file system's free space, and ``max_bytes``
    when set (a cap on what the directory holds; a fetch crossing it fails as on a full disk).

    ``claim`` is asked before each write; it raises ``OSError(ENOSPC)`` like a full disk would, so
    one code path handles both. Tests subclass it to fill the disk mid-file.
    """

    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._used: int | None = None

    def used(self) -> int:
        total = 0
        for dirpath, _, names in os.walk(self.root):
            for name in names:
                with contextlib.suppress(OSError):
                    total += os.lstat(os.path.join(dirpath, name)).st_size
        return total

    def refresh(self) -> None:
        self._used = self.used() if self.max_bytes is not None else None

    def free(self) -> int:
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        if self.max_bytes is not None:
            self.refresh()
            free = min(free, self.max_bytes - (self._used or 0))
        return free

    def claim(self, n: int) -> None:
        if self.max_bytes is None:
            return
        if self._used is None:
            self.refresh()
        used = self._used or 0
        if used + n > self.max_bytes:
            raise OSError(errno.ENOSPC, f"the mirror's limit of {self.max_bytes} bytes is reached", str(self.root))
        self._used = used + n


def _hash_prefix(path: Path, length: int, size: int, need_blob: bool = True) -> tuple[Any, Any]:
    sha = hashlib.sha256()
    # git's object id of the whole file, header first: only for files the hub published no sha256 for
    # (hashing twice halved the fetch rate, docs/benchmarks.md "Mirror and serve").
    blob = hashlib.sha1(b"blob %d\0" % size) if need_blob else None
    if length:
        with open(path, "rb") as fh:
            left = length
            while left:
                block = fh.read(min(HASH_BLOCK, left))
                if not block:
                    break
                sha.update(block)
                if blob is not None:
                    blob.update(block)
                left -= len(block)
    return sha, blob


def _write(fh: IO[bytes], data: bytes, sha: Any, blob: Any) -> None:
    fh.write(data)
    sha.update(data)
    if blob is not None:
        blob.update(data)


def _sync(fh: IO[bytes]) -> None:
    fh.flush()
    os.fsync(fh.fileno())


class _Download:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        part: Path,
        f: MirrorFile,
        *,
        auth: Callable[[str], dict[str, str]],
        guard: DiskGuard,
        chunk_bytes: int,
        progress: Callable[[int], Awaitable[None]],
    ) -> None:
        self.session = session
        self.url = url
        self.part = part
        self.f = f
        self.auth = auth
        self.guard = guard
        self.chunk_bytes = chunk_bytes
        self.progress = progress
        self.have = 0
        self.downloaded = 0
        self.sha: Any = None
        self.blob: Any = None
        self._need_blob = f.sha256 is None
        self._inflight: tuple[asyncio.Future, int] | None = None  # the write+hash running in a thread

    async def open_partial(self) -> int:
        have = self.part.stat().st_size if self.part.exists() else 0
        if have > self.f.size:
            self.part.unlink()  # longer than the file can be: not a prefix of it
            have = 0
        self.sha, self.blob = await asyncio.to_thread(_hash_prefix, self.part, have, self.f.size, self._need_blob)
        self.have = have
        return have

    def restart(self) -> None:
        self.part.unlink(missing_ok=True)
        self.have = 0
        self.sha, self.blob = _hash_prefix(self.part, 0, self.f.size, self._need_blob)

    async def _response(self) -> aiohttp.ClientResponse:
        url = self.url
        for _ in range(MAX_REDIRECTS + 1):
            headers = {"Accept-Encoding": "identity", "User-Agent": "llmgw-mirror", **self.auth(url)}
            if self.have:
                headers["Range"] = f"bytes={self.have}-"
            try:
                resp = await self.session.get(url, headers=headers, allow_redirects=False)
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc
            if resp.status in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                # Followed here, not by aiohttp, so the token is dropped when the redirect leaves the hub.
                url = urljoin(url, resp.headers["Location"])
                resp.release()
                continue
            return resp
        raise DownloadError(f"{self.f.path}: more than {MAX_REDIRECTS} redirects", "refused")

    def _refusal(self, resp: aiohttp.ClientResponse) -> DownloadError | _Transient | None:
        status = resp.status
        if status in (200, 206, 416):
            return None
        if status == 429 or status >= 500:
            return _Transient(f"the hub answered {status}")
        if resp.headers.get("X-Error-Code") == "GatedRepo":
            return DownloadError(
                f"{self.f.path}: the repository is gated on the hub: accept its terms and configure a token "
                "(HF_TOKEN), or choose another repository",
                "refused",
            )
        if status in (401, 403):
            return DownloadError(
                f"the hub refused {self.f.path} ({status}): configure a token that can read it (HF_TOKEN)", "refused"
            )
        if status == 404:
            return DownloadError(f"the hub has no {self.f.path} at this commit ({status})", "refused")
        return DownloadError(f"the hub answered {status} for {self.f.path}", "refused")

    async def once(self) -> None:
        """One request from ``have`` on; raises :class:`_Transient` when it ends early."""
        resp = await self._response()
        try:
            problem = self._refusal(resp)
            if problem is not None:
                raise problem
            if resp.status == 416:
                self.restart()  # the hub says our offset is past its file: what we hold is not its prefix
                raise _Transient("the hub refused the range asked for; starting the file again")
            if resp.status == 200 and self.have:
                self.restart()  # the hub ignored Range and sends it all: start from an empty partial
            elif resp.status == 206 and not resp.headers.get("Content-Range", "").startswith(f"bytes {self.have}-"):
                self.restart()
                raise _Transient(f"the hub answered another range ({resp.headers.get('Content-Range')})")
            await self._stream(resp)
        finally:
            resp.release()
        if self.have < self.f.size:
            raise _Transient(f"the connection ended at byte {self.have} of {self.f.size}")

    async def _flush(self, fh: IO[bytes], chunks: list[bytes]) -> None:
        """Hand the received bytes to a worker thread (write + hash) and return at once, so the next
        MiB is received while this one is written: one write in flight, in order, so the hashes see
        the bytes in file order."""
        data = b"".join(chunks)
        chunks.clear()
        self.guard.claim(len(data))
        await self._settle()
        self._inflight = (asyncio.ensure_future(asyncio.to_thread(_write, fh, data, self.sha, self.blob)), len(data))

    async def _settle(self) -> None:
        """Wait for the write in flight, then count its bytes as held."""
        if self._inflight is None:
            return
        write, n = self._inflight
        try:
            await asyncio.shield(write)
        except asyncio.CancelledError:
            # Let the write finish before the file closes under it: a torn write would corrupt the
            # prefix the next start resumes from.
            with contextlib.suppress(Exception):
                await write
            self._inflight = None
            self.have += n
            self.downloaded += n
            raise
        self._inflight = None
        self.have += n
        self.downloaded += n
        await self.progress(self.have)

    def _queued(self) -> int:
        return self.have + (self._inflight[1] if self._inflight else 0)

    async def _stream(self, resp: aiohttp.ClientResponse) -> None:
        chunks: list[bytes] = []
        size = 0
        fh = await asyncio.to_thread(open, self.part, "ab")
        try:
            async for chunk in resp.content.iter_chunked(256 * 1024):
                if self._queued() + size + len(chunk) > self.f.size:
                    raise DownloadError(
                        f"{self.f.name} is longer than the {self.f.size} bytes the hub published", "checksum"
                    )
                chunks.append(chunk)
                size += len(chunk)
                if size >= self.chunk_bytes:
                    await self._flush(fh, chunks)
                    size = 0
            if chunks:
                await self._flush(fh, chunks)
            await self._settle()
            if self.have == self.f.size:
                await asyncio.to_thread(_sync, fh)
        except (aiohttp.ClientError, TimeoutError) as exc:
            if chunks:
                await self._flush(fh, chunks)  # bytes that arrived are good bytes: keep them for the resume
            await self._settle()
            raise _Transient(f"{type(exc).__name__}: {exc}") from exc
        except asyncio.CancelledError:
            # Stopped mid-file: keep what arrived, so the next start resumes from it.
            with contextlib.suppress(BaseException):
                await self._settle()
            if chunks:
                with contextlib.suppress(OSError):
                    data = b"".join(chunks)
                    self.guard.claim(len(data))
                    _write(fh, data, self.sha, self.blob)
            raise
        finally:
            if self._inflight is not None:  # an error above left a write running: never close under it
                with contextlib.suppress(BaseException):
                    await asyncio.shield(self._inflight[0])
                self._inflight = None
            fh.close()


async def download(
    session: aiohttp.ClientSession,
    url: str,
    part: Path,
    f: MirrorFile,
    *,
    auth: Callable[[str], dict[str, str]],
    guard: DiskGuard,
    progress: Callable[[int], Awaitable[None]],
    chunk_bytes: int = 1 << 20,
    retries: int = 5,
    backoff_s: float = 1.0,
) -> Digests:
    """Bring ``part`` to ``f.size`` bytes, resuming from what it holds; the digests of the whole file.

    Raises :class:`DownloadError`, ``OSError`` (ENOSPC: the disk is full), or ``CancelledError``
    (the partial file is kept).
    """
    d = _Download(session, url, part, f, auth=auth, guard=guard, chunk_bytes=chunk_bytes, progress=progress)
    resumed_from = await d.open_partial()
    if f.size == 0:
        part.touch()  # nothing to ask the hub for
    failures = 0
    while d.have < f.size:
        before = d.have
        try:
            await d.once()
        except _Transient as exc:
            failures = 0 if d.have > before else failures + 1  # progress resets the count
            if failures > retries:
                raise DownloadError(
                    f"{f.path}: {exc}, {failures} times in a row; the {d.have} bytes that arrived are kept and the "
                    "next fetch resumes from there",
                    "network",
                ) from exc
            await asyncio.sleep(min(backoff_s * 2 ** max(failures - 1, 0), 30.0))  # backoff before retrying
    return Digests(
        size=d.have,
        sha256=d.sha.hexdigest(),
        blob_id=d.blob.hexdigest() if d.blob is not None else "",
        resumed_from=resumed_from,
        downloaded=d.downloaded,
    )
