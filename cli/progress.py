"""A download's progress for a person: a bar redrawn in place on a terminal, plain lines elsewhere.

Fed the mirror's progress telemetry (events/schema/mirror.py ``DownloadProgress``) by `mirror fetch` and
`ctl model serve`. The rate is an average over the last few seconds of samples, and the time left
follows from it; both are left out until two samples say something.
"""

from __future__ import annotations

import sys
from collections import deque
from typing import IO

BAR = 24
WINDOW_S = 5.0  # the rate is averaged over this much of the recent past
PLAIN_STEP = 10  # without a terminal, a line every this many percent


def human_bytes(n: int | float) -> str:
    """``n`` bytes as the mirror says them (services/mirror/rules.py ``human``), imported at the first line."""
    from llmgw.services.mirror.rules import human

    return human(n)


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class FileProgress:
    """One file's progress: ``update`` with each sample, ``finish`` when it is verified."""

    def __init__(self, name: str, size: int, stream: IO[str] | None = None, terminal: bool | None = None) -> None:
        self.name = name
        self.size = max(size, 1)
        self.stream = stream or sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self.samples: deque[tuple[float, int]] = deque()
        self.shown_step = -1
        self.width = 0
        self.done = 0

    def rate(self) -> float | None:
        """Bytes a second over the window, or None before two samples."""
        if len(self.samples) < 2:
            return None
        (t0, d0), (t1, d1) = self.samples[0], self.samples[-1]
        return (d1 - d0) / (t1 - t0) if t1 > t0 else None

    def line(self) -> str:
        share = min(self.done / self.size, 1.0)
        parts = [f"{self.name}", f"{100 * share:3.0f}%", f"{human_bytes(self.done)} of {human_bytes(self.size)}"]
        rate = self.rate()
        if rate:
            parts.append(f"{human_bytes(int(rate))}/s")
            parts.append(f"{_duration((self.size - self.done) / rate)} left")
        if self.terminal:
            filled = int(share * BAR)
            parts.insert(1, "[" + "#" * filled + "." * (BAR - filled) + "]")
        return "  ".join(parts)

    def update(self, done: int, at: float) -> None:
        if done < self.done:
            return  # an older sample arriving late
        self.done = done
        self.samples.append((at, done))
        while len(self.samples) > 2 and at - self.samples[0][0] > WINDOW_S:
            self.samples.popleft()
        if self.terminal:
            text = self.line()
            self.stream.write("\r" + text.ljust(self.width))
            self.width = len(text)
            self.stream.flush()
            return
        step = int(100 * done / self.size) // PLAIN_STEP
        if step > self.shown_step:
            self.shown_step = step
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def finish(self) -> None:
        """The file is whole: a terminal's bar gives way to the line that says so."""
        if self.terminal and self.width:
            self.stream.write("\r" + " " * self.width + "\r")
            self.stream.flush()
            self.width = 0


class Downloads:
    """Every file of one fetch, by name."""

    def __init__(self, stream: IO[str] | None = None, terminal: bool | None = None) -> None:
        self.stream, self.terminal = stream, terminal
        self.files: dict[str, FileProgress] = {}

    def update(self, file: str, done: int, size: int, at: float) -> None:
        bar = self.files.get(file)
        if bar is None:
            for other in self.files.values():
                other.finish()
            bar = self.files[file] = FileProgress(file, size, self.stream, self.terminal)
        bar.update(done, at)

    def finish(self, file: str) -> None:
        bar = self.files.get(file)
        if bar is not None:
            bar.finish()
