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
"""

from __future__ import annotations

import os
from pathlib import Path

import structlog

from llmgw.services.router.journal import frame, unframe

log = structlog.get_logger("llmgw.router.inflight")

SUFFIX = ".inflight"


class InflightLog:
    """Numbered files of framed records in ``directory``; :meth:`write` says which file a record went
    to, :meth:`done` when it no longer needs to be there."""

    def __init__(self, directory: str | Path, file_bytes: int = 256 << 10) -> None:
        self.directory = Path(directory)
        self.file_bytes = file_bytes
        self.directory.mkdir(parents=True, exist_ok=True)
        self._left = sorted(p for p in self.directory.glob(f"*{SUFFIX}") if p.stem.isdigit())
        self._next = int(self._left[-1].stem) + 1 if self._left else 1
        self._pending: dict[int, int] = {}  # file → its records still needed
        self._current: int | None = None
        self._fd: int | None = None
        self._size = 0

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
        if self._fd is None or self._size >= self.file_bytes:
            self._rotate()
        assert self._fd is not None and self._current is not None
        data = frame([payload])
        written = os.write(self._fd, data)
        self._size += written
        if written != len(data):
            self._close_current()  # never append behind a torn record
            raise OSError(28, f"short write ({written} of {len(data)} bytes)")
        self._pending[self._current] = self._pending.get(self._current, 0) + 1
        return self._current

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
        """Stop writing; the current file goes too when nothing in it is still needed."""
        current = self._current
        self._close_current()
        if current is not None and not self._pending.get(current):
            self._path(current).unlink(missing_ok=True)

    def _rotate(self) -> None:
        previous = self._current
        self._close_current()
        if previous is not None and not self._pending.get(previous):
            self._path(previous).unlink(missing_ok=True)
        self._current, self._next = self._next, self._next + 1
        self._fd = os.open(self._path(self._current), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def _close_current(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd, self._size = None, 0
        self._current = None

    def _path(self, file: int) -> Path:
        return self.directory / f"{file:012d}{SUFFIX}"
