"""The in-flight log: every usage record written to the router's disk as it is made, before the bus has it.

A record waits in memory for JetStream's acknowledgement (:mod:`.usage`); a router killed in that
moment — its client already answered — would lose it. So each record is also appended to a file
here with one ``write`` and no ``fsync``: the page cache outlives the process (``kill -9``, an
out-of-memory kill, a crash), though not the machine. Files are numbered and small; one whose
records have all been acknowledged, or moved to the spill journal, is deleted. A router that starts
moves whatever files it finds into the spill journal (fsynced) and publishes them from there; a
record the bus had already taken comes again with the same ``Nats-Msg-Id`` and the usage projection
keeps one row per request id, so none is counted twice.

Blocking, but a write to the page cache of a few hundred bytes: done on the event loop, so a
record is on disk before the next request is handled.

The reserve: each file is preallocated (Linux ``fallocate`` with ``FALLOC_FL_KEEP_SIZE``, so its
size stays that of the records written and a reader never sees zeros as records), and once the
current file is half used the next one is preallocated too, so the switch to it needs no new
space. When the disk fills, the records of requests already in progress land in that room; the
spare that cannot be made is the first sign (:attr:`InflightLog.reserve_error`), and the publisher
refuses billable requests in ``strict`` mode from then on while the bus does not acknowledge. A
file system without ``fallocate`` (or another OS) has no reserve: said once, at start.
"""

from __future__ import annotations

import ctypes
import errno
import os
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from llmgw.services.router.journal import frame, unframe

log = structlog.get_logger("llmgw.router.inflight")

SUFFIX = ".inflight"
FALLOC_FL_KEEP_SIZE = 1  # linux/falloc.h: allocate blocks, leave the file's size alone
RESERVE_RETRY_S = 1.0  # a spare that could not be made is tried again at most this often by writes
UNSUPPORTED = (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


def disk_problem(what: str, directory: str, exc: OSError) -> str:
    """A sentence saying why ``what`` (``the usage journal``) at ``directory`` cannot be written. Pure."""
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        state = "is full"
    elif exc.errno == errno.EROFS:
        state = "is on a read-only file system"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        state = "is not writable"
    else:
        state = "cannot be written"
    return f"{what} at {directory} {state} ({reason})"


def _fallocate() -> Callable[[int, int], None] | None:
    """``fallocate(fd, FALLOC_FL_KEEP_SIZE, 0, size)`` raising OSError, or None where libc has none."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.fallocate
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    call.restype = ctypes.c_int

    def allocate(fd: int, size: int) -> None:
        if call(fd, FALLOC_FL_KEEP_SIZE, 0, size) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return allocate


class InflightLog:
    """Numbered files of framed records in ``directory``; :meth:`write` says which file a record went
    to, :meth:`done` when it no longer needs to be there."""

    def __init__(
        self,
        directory: str | Path,
        file_bytes: int = 1 << 20,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = Path(directory)
        self.file_bytes = file_bytes
        self.clock = clock
        self.directory.mkdir(parents=True, exist_ok=True)
        self._left = sorted(p for p in self.directory.glob(f"*{SUFFIX}") if p.stem.isdigit())
        self._next = int(self._left[-1].stem) + 1 if self._left else 1
        self._pending: dict[int, int] = {}  # file → its records still needed
        self._current: int | None = None
        self._fd: int | None = None
        self._size = 0
        self._allocate = _fallocate()
        self._spare: tuple[int, int] | None = None  # (file, fd): preallocated, next after the current one
        self._tried = float("-inf")  # when a spare last could not be made
        # Why the reserve could not be made (a full disk), or None while it is there.
        self.reserve_error: OSError | None = None
        # Why there is no reserve at all (fallocate not supported here; the publisher says so at start), or None.
        self.unsupported: str | None = None if self._allocate else "this system's C library has no fallocate"

    @property
    def reserving(self) -> bool:
        """Whether this log keeps a reserve (fallocate works here)."""
        return self._allocate is not None

    def left_behind(self) -> list[bytes]:
        """The records of the files an earlier run left (in order); call :meth:`forget_left` once they
        are kept elsewhere."""
        records: list[bytes] = []
        for path in self._left:
            try:
                data = path.read_bytes()
            except OSError as exc:
                log.error("in-flight usage file cannot be read; not recovered", file=str(path), error=str(exc))
                continue
            got, end, problem = unframe(data)
            if problem is not None:
                # The tail of a write the process died in: every whole record before it is kept.
                log.warning("in-flight usage file ends in a torn record", file=str(path), skipped_bytes=len(data) - end)
            records.extend(got)
        return records

    def forget_left(self) -> None:
        for path in self._left:
            path.unlink(missing_ok=True)
        self._left = []

    def write(self, payload: bytes) -> int:
        """Append one record; the number of the file it is in. Raises OSError (a full disk)."""
        data = frame([payload])
        if self._fd is None or (self._size and self._size + len(data) > self.file_bytes):
            self._rotate()  # a record never runs past the room preallocated for it
        assert self._fd is not None and self._current is not None
        try:
            written = os.write(self._fd, data)
        except OSError:
            self._drop_current()  # a file that failed once is not written to again
            raise
        self._size += written
        if written != len(data):
            self._drop_current()  # never append behind a torn record
            raise OSError(28, f"short write ({written} of {len(data)} bytes)")
        self._pending[self._current] = self._pending.get(self._current, 0) + 1
        if self._spare is None and self._size * 2 >= self.file_bytes and self.clock() - self._tried >= RESERVE_RETRY_S:
            self.ensure_reserve()
        return self._current

    def ensure_reserve(self) -> bool:
        """Make the spare file if there is none: True when the reserve is there (or this log keeps
        none); False, with :attr:`reserve_error` set, when the disk has no room for it."""
        if self._allocate is None or self._spare is not None:
            return True
        number = self._next
        try:
            fd = self._open_allocated(number)
        except OSError as exc:
            self._tried = self.clock()
            if self.reserve_error is None or exc.errno != self.reserve_error.errno:
                log.error(
                    "the in-flight usage log cannot keep its reserve; records of requests in progress use what is "
                    "left of it",
                    directory=str(self.directory),
                    error=disk_problem("the in-flight usage log", str(self.directory), exc),
                )
            self.reserve_error = exc
            return False
        self._spare = (number, fd)  # unreserved where fallocate was just found unsupported
        self._next += 1
        if self.reserve_error is not None:
            log.info("the in-flight usage log keeps its reserve again", directory=str(self.directory))
            self.reserve_error = None
        return True

    def done(self, file: int) -> None:
        """One record of ``file`` is kept elsewhere now (acknowledged, or in the spill journal)."""
        left = self._pending.get(file, 0) - 1
        if left > 0:
            self._pending[file] = left
            return
        self._pending.pop(file, None)
        if file != self._current:
            self._path(file).unlink(missing_ok=True)

    def close(self) -> None:
        """Stop writing; the current file goes too when nothing in it is still needed, and the spare."""
        self._drop_current()
        if self._spare is not None:
            number, fd = self._spare
            os.close(fd)
            self._path(number).unlink(missing_ok=True)
            self._spare = None

    def _rotate(self) -> None:
        previous = self._current
        self._close_current()
        if previous is not None and not self._pending.get(previous):
            self._path(previous).unlink(missing_ok=True)
        if self._spare is None:
            self.ensure_reserve()  # the first file, or no spare was made in time: make one now
        if self._spare is not None:
            (self._current, self._fd), self._spare = self._spare, None
            return
        # No room for a preallocated file: an unreserved one, which a full disk fails at the first write.
        self._current, self._next = self._next, self._next + 1
        self._fd = os.open(self._path(self._current), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def _open_allocated(self, number: int) -> int:
        """File ``number`` opened for appending with ``file_bytes`` preallocated; OSError (ENOSPC) with
        nothing left behind. Where fallocate is not supported, this log stops reserving (:attr:`unsupported`)."""
        assert self._allocate is not None
        path = self._path(number)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            self._allocate(fd, self.file_bytes)
        except OSError as exc:
            if exc.errno in UNSUPPORTED:  # this file system: no reserve, the file is used as it is
                self._allocate = None
                self.unsupported = f"fallocate is not supported on this file system ({exc.strerror})"
                return fd
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return fd

    def _drop_current(self) -> None:
        """Stop writing to the current file; gone if nothing in it is needed (a full disk must not
        leave an empty file behind for each record it refused)."""
        current = self._current
        self._close_current()
        if current is not None and not self._pending.get(current):
            self._path(current).unlink(missing_ok=True)

    def _close_current(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._size = None, 0
        self._current = None

    def _path(self, file: int) -> Path:
        return self.directory / f"{file:012d}{SUFFIX}"
