"""One lifecycle for every service a process runs: start, stop, health.

``llmgw up`` and ``llmgw server`` run a table of services (cli/service_table.py); :func:`serve
<llmgw.cli.runtime.serve>` starts the ones named in order and stops them in reverse, each the same
way. A service's own class keeps its own shape (a command service has a processor, the router an HTTP
app); its entry in the table adapts it to :class:`Service`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Protocol


class Service(Protocol):
    """A service of the process, as ``serve()`` runs it."""

    name: str
    stop_s: float  # the most its stop may take before the process goes on without it

    async def start(self) -> None:
        """Make it run: when this returns it listens, follows and handles what it should."""
        ...

    def stopping(self) -> None:
        """The process is stopping: take no new work (without waiting). Every service is told at once,
        before the first is stopped."""
        ...

    async def stop(self) -> None:
        """Stop it and release what it holds; ``serve()`` bounds the time it may take."""
        ...

    def health(self) -> str | None:
        """Why it is not running as it should (a loop of its that ended), or None while it is."""
        ...

    def loops(self) -> list[asyncio.Task[Any]]:
        """Its long-running tasks: a process whose service loop ended is stopped (the cause logged)."""
        ...


class Loops:
    """The background loops of one service (each an object with ``run()`` and ``stop()``), run as
    tasks: the part of :class:`Service` most entries share."""

    def __init__(self) -> None:
        self.runners: list[Any] = []
        self.tasks: list[asyncio.Task[Any]] = []

    def run(self, name: str, runner: Any) -> Any:
        """Run ``runner.run()`` as the task ``name``; returns ``runner``."""
        self.runners.append(runner)
        self.tasks.append(asyncio.create_task(runner.run(), name=name))
        return runner

    def signal(self) -> None:
        """Ask each loop to stop (``runner.stop()``), without waiting."""
        for r in self.runners:
            r.stop()

    async def cancel(self) -> None:
        """Cancel the loops and wait until each has ended (its own error was its to log)."""
        for t in self.tasks:
            t.cancel()
        for t in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    def health(self) -> str | None:
        for t in self.tasks:
            if t.done():
                error = None if t.cancelled() else t.exception()
                return f"its loop {t.get_name()} ended" + (f": {error}" if error else "")
        return None


__all__ = ["Loops", "Service"]
