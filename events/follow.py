"""Following the log with a deadline: the next event on any of a few subjects, or ``None`` in time.

A process that waits for something to happen (a fetch to end, a replica to be ready) follows the
subjects it cares about instead of reading them again and again: each read of the log creates and
deletes a JetStream consumer, and a waiter that polls every fraction of a second keeps the
server's API busy for nothing. A follower keeps one consumer per subject open for its life and
hears of each event the moment it is written.

The readers run in tasks of their own and hand events over through a queue, because an async
generator cannot be waited on with a timeout: a cancelled ``__anext__`` closes the generator.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType

from llmgw.events.envelope import RecordedEvent
from llmgw.events.store import EventStore


class _ReaderEnded(Exception):
    """A reader task ended: the log ended (it never does when following) or reading it failed."""


class LogFollower:
    """Events after given positions on one or more subjects, as they are written.

    Use it as ``async with LogFollower(store, {subject: after, ...}) as f: e = await f.next(timeout)``.
    Events of one subject come in log order; events of different subjects interleave as they
    arrive. Quarantined (undecodable) events are skipped, as every reader skips them.
    """

    def __init__(self, store: EventStore, subjects: dict[str, int]) -> None:
        self.store = store
        self.subjects = dict(subjects)
        self._queue: asyncio.Queue[RecordedEvent | BaseException] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []

    async def __aenter__(self) -> LogFollower:
        self._tasks = [asyncio.create_task(self._read(s, after)) for s, after in self.subjects.items()]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def _read(self, subject: str, after: int) -> None:
        try:
            async for batch in self.store.subscribe(subject, after=after):
                for e in batch:
                    if isinstance(e, RecordedEvent):
                        self._queue.put_nowait(e)
            self._queue.put_nowait(_ReaderEnded(f"the log of {subject} ended"))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # handed to the waiter, who decides what a broken read means
            self._queue.put_nowait(exc)

    async def next(self, timeout: float | None) -> RecordedEvent | None:
        """The next event, or ``None`` when ``timeout`` seconds pass first (``None``: wait forever).

        Raises what a reader raised (e.g. ``StoreError``), so a broken read is never mistaken for quiet.
        """
        try:
            if timeout is None:
                item = await self._queue.get()
            else:
                async with asyncio.timeout(max(timeout, 0.0)):
                    item = await self._queue.get()
        except TimeoutError:
            return None
        if isinstance(item, BaseException):
            raise item
        return item
