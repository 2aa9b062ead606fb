"""The usage journal: an append-only spill file for usage records the bus has not acknowledged.

Records live in numbered segment files (``000000000001.journal``, …) in one directory. Each record
is framed as ``length (u32) | crc32 (u32) | payload``, little-endian, so a record cut short by a
crash, or one that was never fully written, is recognised when read back: the reader stops at it,
logs it, and the rest of that segment is skipped. An append writes a whole batch with one
``write`` and one ``fsync``; an append that fails is cut back off the file, so a later append never
lands behind a torn record. A journal opened again (after a crash) never appends to an old
segment: the next append starts a new one.

The journal knows bytes, not usage: the publisher decides what a payload is and when a segment
has been acknowledged in full and can be deleted.
"""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

import structlog

log = structlog.get_logger("llmgw.router.journal")

_HEADER = struct.Struct("<II")
SUFFIX = ".journal"
MAX_RECORD_BYTES = 1 << 24  # a length above this is corruption, not a record


class JournalError(Exception):
    """The journal directory cannot be used; the message says which and why."""


def frame(payloads: Sequence[bytes]) -> bytes:
    """The bytes that append ``payloads`` to a segment. Pure."""
    parts = []
    for p in payloads:
        parts.append(_HEADER.pack(len(p), zlib.crc32(p)))
        parts.append(p)
    return b"".join(parts)


def unframe(data: bytes, offset: int = 0) -> tuple[list[bytes], int, str | None]:
    """The whole records in ``data`` from ``offset``, the offset after the last of them, and why
    reading stopped early (a torn or corrupt record), or None at a clean end. Pure."""
    out: list[bytes] = []
    end = len(data)
    while offset < end:
        if end - offset < _HEADER.size:
            return out, offset, f"{end - offset} bytes of a record header at the end"
        length, crc = _HEADER.unpack_from(data, offset)
        start = offset + _HEADER.size
        if length > MAX_RECORD_BYTES:
            return out, offset, f"a record length of {length} bytes"
        if start + length > end:
            return out, offset, f"a record of {length} bytes with only {end - start} written"
        payload = data[start : start + length]
        if zlib.crc32(payload) != crc:
            return out, offset, "a record whose checksum does not match"
        out.append(payload)
        offset = start + length
    return out, offset, None


class Journal:
    """Segments of framed records in ``directory``; blocking file I/O (run it off the event loop)."""

    def __init__(self, directory: str | Path, segment_bytes: int = 1 << 20) -> None:
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        if self.directory.exists() and not self.directory.is_dir():
            raise JournalError(f"the usage journal path {self.directory} is not a directory")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            reason = exc.strerror or str(exc)
            raise JournalError(f"the usage journal directory {self.directory} cannot be created ({reason})") from exc
        # Segments already here are from an earlier run: read back, never appended to.
        self._segments = sorted(
            int(p.name[: -len(SUFFIX)]) for p in self.directory.glob(f"*{SUFFIX}") if p.stem.isdigit()
        )
        self._current: int | None = None  # the segment appends go to, opened on the first append
        self._fd: int | None = None
        self._size = 0

    def path(self, segment: int) -> Path:
        return self.directory / f"{segment:012d}{SUFFIX}"

    def segments(self) -> list[int]:
        """Every segment on disk, oldest first (the one being appended to last)."""
        return list(self._segments)

    def is_current(self, segment: int) -> bool:
        return segment == self._current

    def append(self, payloads: Sequence[bytes]) -> None:
        """Write ``payloads`` durably: one write, one fsync. Raises OSError (ENOSPC, EROFS, …) having
        left the segment as it was before the call, as far as the file system allows."""
        if not payloads:
            return
        data = frame(payloads)
        if self._fd is None or self._size >= self.segment_bytes:
            self._open_next()
        assert self._fd is not None
        before = self._size
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(28, f"short write ({written} of {len(data)} bytes)")
            os.fsync(self._fd)
        except OSError:
            self._cut_back(before)
            raise
        self._size += len(data)

    def read(self, segment: int, offset: int = 0) -> tuple[list[bytes], int]:
        """The records of ``segment`` from ``offset`` and the offset after them; a torn or corrupt
        record ends the segment (logged)."""
        try:
            data = self.path(segment).read_bytes()
        except FileNotFoundError:
            return [], offset
        if segment == self._current:
            data = data[: self._size]  # what this process wrote in full
        records, end, problem = unframe(data, offset)
        if problem is not None:
            log.warning(
                "usage journal: a torn or corrupt record ends this segment; the bytes after it are skipped",
                segment=str(self.path(segment)),
                offset=end,
                skipped_bytes=len(data) - end,
                problem=problem,
            )
        return records, end

    def size(self, segment: int) -> int:
        if segment == self._current:
            return self._size
        try:
            return self.path(segment).stat().st_size
        except FileNotFoundError:
            return 0

    def delete(self, segment: int) -> None:
        """Remove a segment whose records are all acknowledged (the current one too: the next append
        starts a new segment)."""
        if segment == self._current:
            self._close()
        self.path(segment).unlink(missing_ok=True)
        if segment in self._segments:
            self._segments.remove(segment)
        self._sync_dir()

    def close(self) -> None:
        self._close()

    # -- internals ---------------------------------------------------------------------------

    def _open_next(self) -> None:
        self._close()
        number = (self._segments[-1] + 1) if self._segments else 1
        fd = os.open(self.path(number), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self._segments.append(number)
        self._fd, self._current, self._size = fd, number, 0
        self._sync_dir()  # the new file's name must survive a crash too

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._current, self._size = None, None, 0

    def _cut_back(self, size: int) -> None:
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, size)
        except OSError:
            # The torn bytes stay; never append behind them: the next append starts a new segment.
            self._close()

    def _sync_dir(self) -> None:
        try:
            fd = os.open(self.directory, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        except OSError:
            pass
        finally:
            os.close(fd)
