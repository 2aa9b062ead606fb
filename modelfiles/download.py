"""One verified download of a model file into ``FILE.partial``, for the mirror and the node agent alike.

Receive, write and hash overlap: the event loop receives the next chunk while one worker thread
writes the previous ones and another hashes them (file writes and hashlib both release the GIL),
each fed in order and at most ``ahead_bytes`` behind the receiver, so a slow disk or a slow hash
holds the socket back instead of growing memory.

Resuming is the partial file's own: its size is the offset to ask for (``Range``), whether the
bytes before it came from a connection cut a second ago or from a process stopped yesterday (its
prefix is hashed again first, so the digest covers every byte). A server that ignores ``Range``
(200 instead of 206) sends the whole file again, into an emptied partial. Redirects are followed
here, with the caller's headers asked again for each URL, so a token stays with the host it is for.

At the end the digests are compared with what is expected (size, sha256, git blob id; each when
known): a mismatch deletes the partial file. A full disk (``ENOSPC`` from the write, or from the
caller's ``guard``) deletes it too, and raises :class:`DiskFull`. What stays with each caller is
its policy: where files go, what the refusals say, progress events, tokens, retries.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import hashlib
import os
import re
import shutil
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, Protocol
from urllib.parse import urljoin

import aiohttp
import msgspec

from llmgw.modelfiles.outbound import DestinationRefused

HASH_BLOCK = 4 << 20
MAX_REDIRECTS = 5
RECEIVE_BYTES = 256 << 10

_CONTENT_RANGE = re.compile(r"bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)")


class DownloadError(Exception):
    """A download that cannot go on: ``code`` is ``network`` (worth a later retry; ``have`` bytes are
    kept for it), ``refused`` (the server said no; ``status``) or ``checksum`` (the bytes are not what
    was expected; the partial file was deleted)."""

    def __init__(self, reason: str, code: str, *, status: int | None = None, have: int = 0) -> None:
        self.reason = reason
        self.code = code
        self.status = status
        self.have = have
        super().__init__(reason)


class Digests(msgspec.Struct, frozen=True, kw_only=True):
    size: int
    sha256: str
    blob_id: str  # git's blob id, when asked for (files the hub publishes no sha256 for); else ""
    resumed_from: int
    downloaded: int


class Mismatch(DownloadError):
    """The whole file arrived and is not what was expected (``field``: size, sha256 or blob_id); it was deleted."""

    def __init__(self, reason: str, field: str, got: Digests) -> None:
        super().__init__(reason, "checksum")
        self.field = field
        self.got = got


class DiskFull(OSError):
    """The disk (or the caller's cap) is full; the partial file was deleted. ``errno`` is ``ENOSPC``."""

    def __init__(self, part: Path, cause: OSError) -> None:
        self.free = _free(part.parent)
        super().__init__(errno.ENOSPC, f"{cause.strerror or cause}; the partial file was deleted", str(part))


class Expected(msgspec.Struct, frozen=True, kw_only=True):
    """What the file should be, each part when known: more bytes than ``size`` fail at once.

    ``source`` says who vouches for it (``the hub published``, ``the mirror verified``), so that a
    mismatch's message tells the reader whose word the file failed (empty: ``not the expected …``).
    """

    size: int | None = None
    sha256: str | None = None
    blob_id: str | None = None
    source: str = ""


class Guard(Protocol):
    """Asked before each write; raises ``OSError(ENOSPC)`` when the bytes may not be written (a cap)."""

    def claim(self, n: int) -> None: ...


def mismatch(expected: Expected, got: Digests) -> str | None:
    """Which expected part the digests miss (``size``, ``sha256``, ``blob_id``), or None when they match."""
    if expected.size is not None and got.size != expected.size:
        return "size"
    if expected.sha256 is not None and got.sha256.lower() != expected.sha256.lower():
        return "sha256"
    if expected.sha256 is None and expected.blob_id is not None and got.blob_id.lower() != expected.blob_id.lower():
        return "blob_id"
    return None


_SHOWN = {"size": "{} bytes", "sha256": "sha256 {}", "blob_id": "git blob id {}"}


def mismatch_reason(name: str, expected: Expected, got: Digests, field: str) -> str:
    """What a :class:`Mismatch` of ``field`` says: what arrived, and what was expected by whom."""
    have, want = getattr(got, field), getattr(expected, field)
    if isinstance(want, str):
        want = want.lower()
    arrived = f"{name} arrived with {_SHOWN[field].format(have)}"
    return f"{arrived}, and {expected.source} {want}" if expected.source else f"{arrived}, not the expected {want}"


def transient_status(status: int) -> bool:
    """Worth asking again: the server is busy or failing, not refusing."""
    return status == 429 or status >= 500


def answered(resp: aiohttp.ClientResponse) -> DownloadError | None:
    """The plain refusal policy: anything but 200, 206 or 416 (and transient statuses) is a refusal."""
    if resp.status in (200, 206, 416) or transient_status(resp.status):
        return None
    return DownloadError(f"{resp.url} answered {resp.status}", "refused", status=resp.status)


def no_headers(url: str) -> Mapping[str, str]:
    return {}


async def no_progress(done: int) -> None:
    return None


class _Transient(Exception):
    """Worth trying again at once, from where the partial file ends."""


def _name(part: Path) -> str:
    return part.name.removesuffix(".partial")


def _free(path: Path) -> int:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return 0


class _Hashes:
    """sha256 of the file, and git's blob id when asked (it needs the size up front)."""

    def __init__(self, blob_size: int | None) -> None:
        self.sha = hashlib.sha256()
        self.blob = hashlib.sha1(b"blob %d\0" % blob_size) if blob_size is not None else None

    def update(self, data: bytes | memoryview) -> None:
        self.sha.update(data)
        if self.blob is not None:
            self.blob.update(data)


def _hash_prefix(path: Path, length: int, hashes: _Hashes) -> None:
    if not length:
        return
    with open(path, "rb") as fh:
        left = length
        while left:
            block = fh.read(min(HASH_BLOCK, left))
            if not block:
                break
            hashes.update(block)
            left -= len(block)


def _write(fh: IO[bytes], data: bytes) -> int:
    fh.write(data)
    return len(data)


def _sync(fh: IO[bytes]) -> None:
    fh.flush()
    os.fsync(fh.fileno())


def _retrieved(fut: asyncio.Future[Any]) -> None:
    """Mark a write's or hash's error as seen: the path that ended the read reports it, or the one
    that failed first did; asyncio need not log it again."""
    if not fut.cancelled():
        fut.exception()


class _Overlap:
    """Writes and hashes chunks in order, the writer and the hasher each on a thread of its own, at
    most ``ahead`` bytes behind the receiver. ``done`` counts the bytes both have finished."""

    def __init__(self, fh: IO[bytes], hashes: _Hashes, guard: Guard | None, ahead: int) -> None:
        self.fh = fh
        self.hashes = hashes
        self.guard = guard
        self.ahead = ahead
        self.done = 0
        self.queued = 0
        self._failed: BaseException | None = None
        self._pending: deque[tuple[asyncio.Future[Any], asyncio.Future[Any], int]] = deque()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="download-write")
        self._hasher = ThreadPoolExecutor(1, thread_name_prefix="download-hash")

    def _write(self, pieces: list[bytes]) -> None:
        for piece in pieces:
            if self._failed is not None:
                return  # never write past a failed write: the file would not be a prefix
            try:
                _write(self.fh, piece)
            except BaseException as exc:
                self._failed = exc
                raise

    def _hash(self, pieces: list[bytes]) -> None:
        for piece in pieces:
            self.hashes.update(piece)

    def submit(self, pieces: list[bytes]) -> None:
        """Queue the pieces as received: not joined, which would copy every byte once more."""
        n = sum(len(p) for p in pieces)
        if self.guard is not None:
            self.guard.claim(n)
        loop = asyncio.get_running_loop()
        w = loop.run_in_executor(self._writer, self._write, pieces)
        h = loop.run_in_executor(self._hasher, self._hash, pieces)
        for fut in (w, h):
            fut.add_done_callback(_retrieved)
        self._pending.append((w, h, n))
        self.queued += n

    async def put(self, pieces: list[bytes]) -> None:
        self.submit(pieces)
        while self.queued > self.ahead:
            await self._settle_one()

    async def _settle_one(self) -> None:
        w, h, n = self._pending[0]
        await w
        await h
        self._pending.popleft()
        self.queued -= n
        self.done += n

    async def drain(self) -> None:
        while self._pending:
            await self._settle_one()

    def close(self) -> None:
        """Let every queued write and hash finish (a torn write would corrupt the prefix the next start
        resumes from), then stop the threads. Blocks for at most ``ahead`` bytes of work."""
        self._writer.shutdown(wait=True)
        self._hasher.shutdown(wait=True)
        while self._pending:
            _, _, n = self._pending.popleft()
            if self._failed is None:
                self.done += n
        self.queued = 0


class _Download:
    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        part: Path,
        expected: Expected,
        *,
        headers: Callable[[str], Mapping[str, str]],
        refusal: Callable[[aiohttp.ClientResponse], DownloadError | None],
        guard: Guard | None,
        progress: Callable[[int], Awaitable[None]],
        blob_id: bool,
        chunk_bytes: int,
        ahead_bytes: int,
        user_agent: str,
    ) -> None:
        self.session = session
        self.url = url
        self.part = part
        self.expected = expected
        self.headers = headers
        self.refusal = refusal
        self.guard = guard
        self.progress = progress
        self._reporting: asyncio.Future[None] | None = None
        self.chunk_bytes = chunk_bytes
        self.ahead_bytes = max(ahead_bytes, chunk_bytes)
        self.user_agent = user_agent
        self.size = expected.size  # learned from the response when not known
        self._blob = blob_id and expected.size is not None
        self.hashes = _Hashes(None)
        self.have = 0
        self.downloaded = 0

    def _new_hashes(self) -> _Hashes:
        return _Hashes(self.expected.size if self._blob else None)

    async def open_partial(self) -> int:
        have = self.part.stat().st_size if self.part.exists() else 0
        if self.size is not None and have > self.size:
            self.part.unlink()  # longer than the file can be: not a prefix of it
            have = 0
        self.hashes = self._new_hashes()
        await asyncio.to_thread(_hash_prefix, self.part, have, self.hashes)
        self.have = have
        return have

    def restart(self) -> None:
        self.part.unlink(missing_ok=True)
        self.have = 0
        self.hashes = self._new_hashes()

    async def _response(self) -> aiohttp.ClientResponse:
        url = self.url
        for _ in range(MAX_REDIRECTS + 1):
            headers = {"Accept-Encoding": "identity", "User-Agent": self.user_agent, **self.headers(url)}
            if self.have:
                headers["Range"] = f"bytes={self.have}-"
            try:
                resp = await self.session.get(url, headers=headers, allow_redirects=False)
            except DestinationRefused as exc:
                # The session's outbound rule (:mod:`.outbound`): no retry will change its mind.
                raise DownloadError(f"{_name(self.part)}: {exc.reason}", "refused") from exc
            except (aiohttp.ClientError, TimeoutError) as exc:
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc
            if resp.status in (301, 302, 303, 307, 308) and "Location" in resp.headers:
                # Followed here, not by aiohttp, so the headers (a token) are asked again for the new host.
                url = urljoin(url, resp.headers["Location"])
                resp.release()
                continue
            return resp
        raise DownloadError(
            f"{self.part.name.removesuffix('.partial')}: more than {MAX_REDIRECTS} redirects", "refused"
        )

    def _learn_size(self, resp: aiohttp.ClientResponse) -> None:
        if self.expected.size is not None:
            return
        m = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
        if m and m.group(3) != "*":
            self.size = int(m.group(3))
        elif resp.status == 200 and resp.content_length is not None:
            self.size = resp.content_length

    async def once(self) -> bool:
        """One request from ``have`` on; True when the file is whole. Raises :class:`_Transient` when it ends early."""
        resp = await self._response()
        try:
            if transient_status(resp.status):
                raise _Transient(f"the server answered {resp.status}")
            problem = self.refusal(resp)
            if problem is not None:
                raise problem
            self._learn_size(resp)
            if resp.status == 416:
                if self.size is not None and self.have == self.size:
                    return True  # the partial holds the whole file already (a stop after its last byte)
                self.restart()  # our offset is past the file: what we hold is not its prefix
                raise _Transient("the server refused the range asked for; starting the file again")
            if resp.status == 200 and self.have:
                self.restart()  # Range ignored: the whole file comes again, into an empty partial
            elif resp.status == 206 and not resp.headers.get("Content-Range", "").startswith(f"bytes {self.have}-"):
                self.restart()
                raise _Transient(f"the server answered another range ({resp.headers.get('Content-Range')})")
            await self._stream(resp)
        finally:
            resp.release()
        if self.size is not None and self.have < self.size:
            raise _Transient(f"the connection ended at byte {self.have} of {self.size}")
        return True

    def _report(self) -> None:
        """Tell ``progress`` what is held, without holding the socket: at most one report runs at a
        time, and one asked for while another runs is skipped (the next one carries the news)."""
        if self._reporting is not None:
            if not self._reporting.done():
                return
            self._reporting.result()  # a report that failed fails the download, as if awaited inline
        self._reporting = asyncio.ensure_future(self.progress(self.have))

    async def reported(self) -> None:
        """Wait for the report in flight, so none lands after the download has returned."""
        if self._reporting is not None:
            try:
                await self._reporting
            finally:
                self._reporting = None

    def stop_reporting(self) -> None:
        if self._reporting is not None and not self._reporting.done():
            self._reporting.cancel()

    def _too_long(self) -> DownloadError:
        self.part.unlink(missing_ok=True)
        return DownloadError(f"{_name(self.part)} is longer than the {self.size} bytes published", "checksum")

    async def _stream(self, resp: aiohttp.ClientResponse) -> None:
        chunks: list[bytes] = []
        size = 0
        start = self.have
        fh = await asyncio.to_thread(open, self.part, "ab")
        overlap = _Overlap(fh, self.hashes, self.guard, self.ahead_bytes)
        try:
            try:
                async for chunk in resp.content.iter_chunked(RECEIVE_BYTES):
                    if self.size is not None and start + overlap.queued + overlap.done + size + len(chunk) > self.size:
                        raise self._too_long()
                    chunks.append(chunk)
                    size += len(chunk)
                    if size >= self.chunk_bytes:
                        data, chunks, size = chunks, [], 0
                        await overlap.put(data)
                        self.have = start + overlap.done
                        self._report()
            except (aiohttp.ClientError, TimeoutError) as exc:
                # Bytes that arrived are good bytes: keep them for the resume.
                if chunks:
                    overlap.submit(chunks)
                await overlap.drain()
                raise _Transient(f"{type(exc).__name__}: {exc}") from exc
            if chunks:
                overlap.submit(chunks)
                chunks = []  # the list is the writer's now: never cleared under it
            await overlap.drain()
            await asyncio.to_thread(_sync, fh)
        except asyncio.CancelledError:
            # Stopped mid-file: keep what arrived, so the next start resumes from it.
            if chunks:
                with contextlib.suppress(OSError):
                    overlap.submit(chunks)
            raise
        finally:
            overlap.close()  # an error or a stop may leave writes queued: never close the file under them
            fh.close()
            self.downloaded += overlap.done
            self.have = start + overlap.done


async def download(
    session: aiohttp.ClientSession,
    url: str,
    part: Path,
    expected: Expected,
    *,
    headers: Callable[[str], Mapping[str, str]] = no_headers,
    refusal: Callable[[aiohttp.ClientResponse], DownloadError | None] = answered,
    guard: Guard | None = None,
    progress: Callable[[int], Awaitable[None]] = no_progress,
    blob_id: bool = False,
    chunk_bytes: int = 1 << 20,
    ahead_bytes: int = 8 << 20,
    retries: int = 5,
    backoff_s: float = 1.0,
    user_agent: str = "llmgw",
) -> Digests:
    """Bring ``part`` to the whole file, resuming from what it holds, and check it against ``expected``.

    ``headers(url)``: extra request headers for each URL asked (a token for its own host);
    ``refusal(response)``: the caller's words for a status it will not retry; ``guard``: asked before
    each write (a cap); ``progress(bytes held)``: after each chunk; ``blob_id``: also compute git's
    blob id (needs ``expected.size``). Up to ``retries`` failures in a row (progress resets the
    count) are retried after a doubling backoff.

    Raises :class:`DownloadError` (:class:`Mismatch` when the whole file is not what was expected;
    the partial file was deleted), :class:`DiskFull` (deleted too), another ``OSError``, or
    ``CancelledError`` (the partial file is kept).
    """
    d = _Download(
        session,
        url,
        part,
        expected,
        headers=headers,
        refusal=refusal,
        guard=guard,
        progress=progress,
        blob_id=blob_id,
        chunk_bytes=chunk_bytes,
        ahead_bytes=ahead_bytes,
        user_agent=user_agent,
    )
    try:
        try:
            resumed_from = await d.open_partial()
            failures = 0
            whole = expected.size == 0
            if whole:
                part.touch()  # nothing to ask for
            while not whole:
                before = d.have
                try:
                    whole = await d.once()
                except _Transient as exc:
                    failures = 0 if d.have > before else failures + 1  # progress resets the count
                    if failures > retries:
                        raise DownloadError(
                            f"{exc}, {failures} times in a row; the {d.have} bytes that arrived are kept and the next "
                            "try resumes from there",
                            "network",
                            have=d.have,
                        ) from exc
                    await asyncio.sleep(min(backoff_s * 2 ** max(failures - 1, 0), 30.0))  # backoff before retrying
            await d.reported()
        except BaseException:
            d.stop_reporting()
            raise
    except OSError as exc:
        if exc.errno != errno.ENOSPC or isinstance(exc, DiskFull):
            raise
        part.unlink(missing_ok=True)  # a partial file on a full disk only keeps it full
        raise DiskFull(part, exc) from exc
    got = Digests(
        size=d.have,
        sha256=d.hashes.sha.hexdigest(),
        blob_id=d.hashes.blob.hexdigest() if d.hashes.blob is not None else "",
        resumed_from=resumed_from,
        downloaded=d.downloaded,
    )
    field = mismatch(expected, got)
    if field is not None:
        part.unlink(missing_ok=True)
        raise Mismatch(mismatch_reason(_name(part), expected, got, field), field, got)
    return got
