"""The mirror's policy around the one verified download (:mod:`llmgw.modelfiles.download`): a bounded disk
and what the hub's refusals mean.

The pipeline (HTTP ``Range`` resume from ``FILE.partial``, receive, write and hash overlapped) is
shared with the node agent; what stays here is the mirror's: how much its directory may take
(:class:`DiskGuard`), the hub's refusals in words a person can act on (gated, token, missing), the
token only for the hub's own host (``auth``), and git's blob id for files the hub publishes no
sha256 for. The digests are checked against what the hub published (or, for a peer's copy, what
the primary verified) by the pipeline, which deletes a mismatch and raises :class:`Mismatch`.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp

from llmgw.events.schema.mirror import MirrorFile
from llmgw.modelfiles import download as pipeline
from llmgw.modelfiles.download import Digests, DownloadError, Mismatch

__all__ = ["Digests", "DiskGuard", "DownloadError", "Mismatch", "download"]


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


def _hub_refusal(f: MirrorFile) -> Callable[[aiohttp.ClientResponse], DownloadError | None]:
    """What the hub's refusals of ``f`` mean (429 and 5xx are retried by the pipeline before this is asked)."""

    def refusal(resp: aiohttp.ClientResponse) -> DownloadError | None:
        status = resp.status
        if status in (200, 206, 416):
            return None
        if resp.headers.get("X-Error-Code") == "GatedRepo":
            return DownloadError(
                f"{f.path}: the repository is gated on the hub: accept its terms and configure a token "
                "(HF_TOKEN), or choose another repository",
                "refused",
                status=status,
            )
        if status in (401, 403):
            return DownloadError(
                f"the hub refused {f.path} ({status}): configure a token that can read it (HF_TOKEN)",
                "refused",
                status=status,
            )
        if status == 404:
            return DownloadError(f"the hub has no {f.path} at this commit ({status})", "refused", status=status)
        return DownloadError(f"the hub answered {status} for {f.path}", "refused", status=status)

    return refusal


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
    source: str = "the hub published",
) -> Digests:
    """Bring ``part`` to the whole of ``f``, resuming from what it holds; the digests of the whole file.

    ``source``: who vouches for ``f``'s size and digests, for a mismatch's message. Raises
    :class:`DownloadError` (:class:`Mismatch`: the file is not ``f``; the partial file was
    deleted), ``OSError`` (ENOSPC: the disk is full; the partial file was deleted), or
    ``CancelledError`` (the partial file is kept).
    """
    try:
        return await pipeline.download(
            session,
            url,
            part,
            pipeline.Expected(size=f.size, sha256=f.sha256, blob_id=f.blob_id, source=source),
            headers=auth,
            refusal=_hub_refusal(f),
            guard=guard,
            progress=progress,
            blob_id=f.sha256 is None,  # hashing twice halved the fetch rate: only when no sha256 is published
            chunk_bytes=chunk_bytes,
            retries=retries,
            backoff_s=backoff_s,
            user_agent="llmgw-mirror",
        )
    except DownloadError as exc:
        if exc.code == "network":
            raise DownloadError(f"{f.path}: {exc.reason}", exc.code, have=exc.have) from exc
        raise
