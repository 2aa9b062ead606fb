"""The node's weights cache (SPEC FLEET-8): files fetched from the mirror, verified, kept for reuse.

A model whose source is ``mirror:MODEL/VERSION/FILE`` is fetched from the mirror's file server
(``GET /files/MODEL/VERSION/FILE`` with the cluster's mirror token) into
``AGENT_DATA/weights/MODEL/VERSION/FILE``: bytes go to ``FILE.partial`` first, a transfer cut off
is resumed with ``Range``, and the whole file is hashed as it arrives and compared with the sha256
the mirror verified (``X-Llmgw-Sha256``) before it is renamed into place. The download itself is the
one the mirror uses (:mod:`llmgw.modelfiles.download`); this module keeps the cache's policy: where
files go, the token, which mirror to ask, and what a failure tells the operator. A file whose bytes do not match —
downloaded or already cached — is deleted and never given to an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import aiohttp
import msgspec
import structlog

from llmgw.modelfiles.download import DiskFull, DownloadError, Expected, Mismatch, download

log = structlog.get_logger("llmgw.agent.weights")

PARTIAL = ".partial"
CHUNK = 1024 * 1024
TRIES = 5


class WeightsError(Exception):
    """A mirror file could not be made available on this node; the message is the reason."""


class Verified(msgspec.Struct, frozen=True, kw_only=True):
    """A cached file this process hashed: reused without hashing again while size and mtime stay."""

    sha256: str
    size: int
    mtime_ns: int


def _hash_file(path: Path, h: hashlib._Hash | None = None) -> hashlib._Hash:
    h = h or hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Unanswered(Exception):
    """This mirror did not answer (connection error, timeout, 5xx) or does not hold the file: try the next."""


def mirror_list(urls: str | Iterable[str] | None) -> list[str]:
    """Mirror URLs from ``"A,B"``, a list of such strings, or nothing; in order, without repeats."""
    parts = [urls] if isinstance(urls, str) else list(urls or [])
    out: list[str] = []
    for part in parts:
        for url in part.split(","):
            url = url.strip().rstrip("/")
            if url and url not in out:
                out.append(url)
    return out


class WeightsCache:
    """``root/MODEL/VERSION/FILE``, filled from the mirrors at ``mirror_url`` with the bearer ``token()``.

    Several mirrors (MIR-4: a primary and its peers) are tried in order: one that does not answer
    (connection error, timeout, 5xx) or answers 404 is passed over for the next; a peer may lag behind
    its primary, and every mirror serves only bytes whose sha256 it verified, so any of them will do.
    """

    def __init__(
        self, root: Path, mirror_url: str | Iterable[str] | None, token: Callable[[], str], timeout_s: float = 60.0
    ) -> None:
        self.root = root
        self.mirror_urls = mirror_list(mirror_url)
        self.mirror_url = self.mirror_urls[0] if self.mirror_urls else ""
        self.token = token
        self.timeout_s = timeout_s
        self._verified: dict[str, Verified] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    # -- what is here ------------------------------------------------------------------------

    def path_of(self, ref: str) -> Path:
        model, version, name = ref.split("/")
        return self.root / model / version / name

    def held(self) -> list[str]:
        """Every whole file in the cache, as ``MODEL/VERSION/FILE`` (partial files are not held)."""
        out = []
        with contextlib.suppress(OSError):
            for p in self.root.glob("*/*/*"):
                if p.is_file() and not p.name.endswith(PARTIAL):
                    out.append(str(p.relative_to(self.root)))
        return sorted(out)

    def _all_files(self) -> list[tuple[str, Path]]:
        """(ref, path) of every file, partial ones under the ref they will become."""
        out = []
        with contextlib.suppress(OSError):
            for p in self.root.glob("*/*/*"):
                if p.is_file():
                    rel = str(p.relative_to(self.root))
                    out.append((rel.removesuffix(PARTIAL), p))
        return out

    # -- removing ----------------------------------------------------------------------------

    def remove(self, refs: Iterable[str], keep: Iterable[str] = ()) -> list[str]:
        """Delete the named files (and their partial files) unless kept; what was deleted."""
        wanted = set(refs) - set(keep)
        return self._delete([(ref, p) for ref, p in self._all_files() if ref in wanted])

    def collect(self, keep: Iterable[str]) -> list[str]:
        """Delete every file (and partial file) not in ``keep``; what was deleted."""
        kept = set(keep)
        return self._delete([(ref, p) for ref, p in self._all_files() if ref not in kept])

    def _delete(self, items: list[tuple[str, Path]]) -> list[str]:
        removed = []
        for ref, p in sorted(items, key=lambda x: str(x[1])):
            lock = self._locks.get(ref)
            if lock is not None and lock.locked():
                continue  # being fetched right now: a start needs it
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                removed.append(str(p.relative_to(self.root)))
                self._verified.pop(ref, None)
            for parent in (p.parent, p.parent.parent):
                with contextlib.suppress(OSError):
                    parent.rmdir()  # only when empty
        if removed:
            log.info("weights removed", files=removed)
        return removed

    # -- fetching ----------------------------------------------------------------------------

    async def ensure(self, ref: str) -> Path:
        """The verified local copy of ``ref``, fetched from the mirror when needed.

        Raises :class:`WeightsError` with a reason a person can act on.
        """
        lock = self._locks.setdefault(ref, asyncio.Lock())
        async with lock:
            return await self._ensure(ref)

    def _headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token()}", "Accept-Encoding": "identity", **(extra or {})}

    async def _ensure(self, ref: str) -> Path:
        if not self.mirror_url:
            raise WeightsError(
                f"source mirror:{ref} needs the mirror, and this agent has no mirror URL: "
                "start it with `llmgw agent --mirror URL`"
            )
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            reasons: list[str] = []
            for base in self.mirror_urls:
                url = f"{base}/files/{ref}"
                try:
                    return await self._from(http, url, ref)
                except _Unanswered as exc:
                    reasons.append(str(exc))
                    if base != self.mirror_urls[-1]:
                        log.warning("mirror did not serve weights; trying the next", ref=ref, reason=str(exc))
        if len(reasons) == 1:
            raise WeightsError(reasons[0])
        raise WeightsError(f"no mirror served mirror:{ref}: " + "; ".join(reasons))

    async def _from(self, http: aiohttp.ClientSession, url: str, ref: str) -> Path:
        path = self.path_of(ref)
        expected = await self._expected(http, url, ref)
        if path.exists():
            got = await self._sha_of(path, ref)
            if got == expected:
                return path
            path.unlink(missing_ok=True)
            self._verified.pop(ref, None)
            log.warning("cached weights corrupted; deleted", ref=ref, sha256=got, expected=expected)
            raise WeightsError(
                f"the cached copy of mirror:{ref} has sha256 {got}, and the mirror verified {expected}: "
                "it was deleted and not used; the next start fetches it again"
            )
        try:
            await self._download(http, url, ref, expected)
        except DiskFull as exc:
            # The download gave the space back: a partial file on a full disk only keeps it full.
            free = exc.free
            raise WeightsError(
                f"this node's disk is full: mirror:{ref} does not fit in its weights cache {self.root} "
                f"({free} bytes free); the partial file was deleted. Free space, or remove weights no "
                "model uses with `llmgw ctl weights --collect`"
            ) from exc
        return path

    async def _expected(self, http: aiohttp.ClientSession, url: str, ref: str) -> str:
        base = url.rsplit("/files/", 1)[0]
        at = f" at {base}" if len(self.mirror_urls) > 1 else ""
        try:
            async with http.head(url, headers=self._headers()) as resp:
                if resp.status == 404:
                    raise _Unanswered(f"the mirror{at} does not hold {ref} (`llmgw mirror list` shows what it holds)")
                if resp.status in (401, 403):
                    raise WeightsError(f"the mirror{at} refused this node's token ({resp.status}) for {ref}")
                if resp.status >= 500:
                    raise _Unanswered(f"the mirror{at} answered {resp.status} for {ref}")
                if resp.status != 200:
                    raise WeightsError(f"the mirror{at} answered {resp.status} for {ref}")
                sha = resp.headers.get("X-Llmgw-Sha256", "").lower()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _Unanswered(f"the mirror at {base} did not answer for {ref}: {exc}") from exc
        if not sha:
            raise WeightsError(f"the mirror sent no checksum for {ref}; it cannot be verified, so it is not used")
        return sha

    async def _sha_of(self, path: Path, ref: str) -> str:
        st = path.stat()
        seen = self._verified.get(ref)
        if seen is not None and seen.size == st.st_size and seen.mtime_ns == st.st_mtime_ns:
            return seen.sha256
        sha = (await asyncio.to_thread(_hash_file, path)).hexdigest()
        self._remember(ref, path, sha)
        return sha

    def _remember(self, ref: str, path: Path, sha: str) -> None:
        st = path.stat()
        self._verified[ref] = Verified(sha256=sha, size=st.st_size, mtime_ns=st.st_mtime_ns)

    async def _download(self, http: aiohttp.ClientSession, url: str, ref: str, expected: str) -> None:
        path = self.path_of(ref)
        partial = path.with_name(path.name + PARTIAL)
        partial.parent.mkdir(parents=True, exist_ok=True)
        token = f"Bearer {self.token()}"
        try:
            got = await download(
                http,
                url,
                partial,
                Expected(sha256=expected, source="the mirror verified"),
                headers=lambda _url: {"Authorization": token},
                retries=TRIES - 1,
                backoff_s=0.4,
                user_agent="llmgw-agent",
            )
        except Mismatch as exc:
            raise WeightsError(
                f"mirror:{ref}: {exc.reason}: it was deleted and not used; the next start fetches it again"
            ) from exc
        except DownloadError as exc:
            if exc.code == "network":
                raise WeightsError(
                    f"fetching {ref} from the mirror failed {TRIES} times in a row ({exc.reason}); "
                    f"{exc.have} bytes are kept and the next start resumes"
                ) from exc
            if exc.status is not None:
                raise WeightsError(f"the mirror answered {exc.status} for {ref}") from exc
            raise WeightsError(f"fetching {ref} from the mirror failed: {exc.reason}") from exc
        partial.replace(path)
        _fsync_dir(path.parent)
        self._remember(ref, path, got.sha256)
        log.info("weights fetched", ref=ref, bytes=got.downloaded, resumed_from=got.resumed_from)
