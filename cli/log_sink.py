"""Log lines written by a thread of their own, so a stream that cannot take them never fails the work.

A process's log goes to its stderr, which may be a file on a disk that fills, a pipe whose reader
has gone (`llmgw up | head`), or a terminal that stopped reading. Written where the line is made,
each of those either raises inside whatever logged (a request answered 500 because its access line
could not be written) or blocks it. Here the caller only appends the line to a bounded queue; one
thread writes the queue to the stream's file descriptor, many lines per write. A line that cannot
be written — the write fails, or the queue is full because the stream does not keep up — is
dropped and counted (:attr:`LineSink.dropped`, exported as ``llmgw_log_lines_dropped_total``), and
the first write that works again begins with one line saying how many were lost and why.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TextIO

from prometheus_client.metrics_core import CounterMetricFamily
from prometheus_client.registry import Collector

CAPACITY = 10_000  # lines waiting for the writer; past it a line is dropped, never waited for
BATCH = 512  # lines joined into one write
TICK_S = 0.02  # how often the writer looks for lines: a wake-up per line would cost the caller a thread switch
FLUSH_S = 2.0  # the longest a stopping process waits for its last lines


class _Flushed:
    """Put in the queue by :meth:`LineSink.flush`; set once every line before it is dealt with."""

    def __init__(self) -> None:
        self.done = threading.Event()


_STOP = object()


class LineSink:
    """Lines to ``stream`` from a writer thread; :meth:`write` never raises and never blocks."""

    def __init__(self, stream: TextIO, capacity: int = CAPACITY) -> None:
        self.stream = stream
        self.capacity = capacity
        self.dropped = 0  # lines lost since the start (a counter: it only grows)
        self._unsaid = 0  # lines lost since the last notice
        self._error: str | None = None  # why the last ones were lost
        self._torn = False  # the last write stopped inside a line
        self._lock = threading.Lock()
        # A deque's append and popleft are atomic: the caller appends and goes on, waking nobody; the
        # writer looks every TICK_S (or at once when :meth:`flush` or :meth:`close` ask it to).
        self._queue: deque = deque()
        self._wake = threading.Event()
        self._fd = _descriptor(stream)
        self._thread = threading.Thread(target=self._run, name="log-writer", daemon=True)
        if self._fd is not None:
            self._thread.start()

    def write(self, line: str) -> None:
        """Queue ``line`` (a newline is added); dropped and counted when the queue is full."""
        if self._fd is None:
            # A stream in memory (a test's capture, click's runner) neither fills nor blocks: written here.
            self._emit([line])
            return
        if len(self._queue) >= self.capacity:
            self._lose(1, "the stream did not take lines as fast as they came")
            return
        self._queue.append(line)

    def flush(self, timeout_s: float = FLUSH_S) -> bool:
        """Wait up to ``timeout_s`` for the lines queued so far to be written (or dropped)."""
        if not self._thread.is_alive():
            return True
        marker = _Flushed()
        self._queue.append(marker)
        self._wake.set()
        return marker.done.wait(timeout_s)

    def close(self, timeout_s: float = FLUSH_S) -> None:
        """Write what is queued (within ``timeout_s``) and stop the thread."""
        self.flush(timeout_s)
        self._queue.append(_STOP)
        self._wake.set()

    # -- the writer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if not self._queue:
                self._wake.wait(TICK_S)
                self._wake.clear()
                continue
            lines: list[str] = []
            markers: list[_Flushed] = []
            stop = False
            while self._queue and len(lines) < BATCH:
                item = self._queue.popleft()
                if item is _STOP:
                    stop = True
                    break
                if isinstance(item, _Flushed):
                    markers.append(item)
                else:
                    lines.append(item)
            if lines:
                self._emit(lines)
            for m in markers:
                m.done.set()
            if stop:
                if self._fd is not None:
                    os.close(self._fd)
                return

    def _emit(self, lines: list[str]) -> None:
        text = "\n".join(lines) + "\n"
        with self._lock:
            unsaid, error = self._unsaid, self._error
        notice = ""
        if unsaid:
            notice = f"llmgw: {unsaid} log lines could not be written and were lost ({error}); writing works again\n"
        if self._torn:
            notice = "\n" + notice  # a write that failed half-way left a line without its end
        data = (notice + text).encode("utf-8", errors="replace")
        written, failure = self._write(data)
        if written:
            self._torn = data[written - 1 : written] != b"\n"
        if failure is not None:
            # Whole lines that made it before the failure are not lost; the notice's, if it went, is said.
            ended = data[:written].count(b"\n") - notice.count("\n")
            if ended >= 0 and unsaid:
                with self._lock:
                    self._unsaid -= unsaid
            self._lose(len(lines) - max(0, ended), _reason(failure))
            return
        if unsaid:
            with self._lock:
                self._unsaid -= unsaid

    def _write(self, data: bytes) -> tuple[int, BaseException | None]:
        """Write ``data``; how many bytes went, and the error that stopped it (None: all went)."""
        if self._fd is None:
            try:
                self.stream.write(data.decode("utf-8"))
                self.stream.flush()
            except (OSError, ValueError) as exc:  # ValueError: the stream was closed
                return 0, exc
            return len(data), None
        view = memoryview(data)
        done = 0
        while done < len(data):
            try:
                done += os.write(self._fd, view[done:])
            except OSError as exc:
                return done, exc
        return done, None

    def _lose(self, lines: int, error: str) -> None:
        with self._lock:
            self.dropped += lines
            self._unsaid += lines
            self._error = error


def _descriptor(stream: TextIO) -> int | None:
    """A descriptor of the sink's own for the stream's file, written to directly (bypassing Python's
    buffer, which would keep a failed write's bytes and fail every later flush); None for a stream
    without one (a test's capture). Its own, a duplicate: the stream's number, once the stream is
    closed, may be given to a socket, and a log line written there would be written into it."""
    try:
        fd = os.dup(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None
    try:
        stream.flush()  # what was printed before the sink took over goes first
    except (OSError, ValueError):
        pass
    return fd


def _reason(exc: BaseException) -> str:
    if isinstance(exc, BrokenPipeError):
        return "the reader of the stream has gone (broken pipe)"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


class DroppedLinesCollector(Collector):
    """``llmgw_log_lines_dropped_total`` for a process's /metrics: the lines its sink could not write.
    ``sink`` is asked at each scrape (None: logging not set up by :func:`llmgw.cli.logs.configure`; 0)."""

    def __init__(self, sink: Callable[[], LineSink | None]) -> None:
        self.sink = sink

    def collect(self) -> Iterator[CounterMetricFamily]:
        sink = self.sink()
        yield CounterMetricFamily(
            "llmgw_log_lines_dropped",
            "Log lines this process could not write (its stderr full, closed or not read) and dropped",
            value=sink.dropped if sink is not None else 0,
        )
