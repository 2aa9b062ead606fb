"""Following the log with a deadline: the next event on any of a few subjects, or ``None`` in time.

A process that waits for something to happen (a fetch to end, a replica to be ready) follows the
subjects it cares about instead of reading them again and again: each read of the log creates and
deletes a JetStream consumer, and a waiter that polls every fraction of a second keeps the
server's API busy for nothing. A follower keeps one consumer per subject open for its life and
hears of each event the moment it is written.

Each subject is read by a supervised :class:`~llmgw.events.runtime.follower.Follower` whose apply puts the
event on a queue: a deleted consumer, a restarted server or a cut connection is ridden out by the
fold (it reads on from where it was, nothing skipped, nothing twice) instead of ending the wait,
and the folds report their health in a registry (the process's, when the caller passes it). The
queue is there because an async generator cannot be waited on with a timeout: a cancelled
``__anext__`` closes the generator.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from llmgw.events.runtime.follower import Follower, FollowerHealth, FollowerRegistry
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.envelope import RecordedEvent


class EventWaiter:
    """Events after given positions on one or more subjects, as they are written.

    Use it as ``async with EventWaiter(store, {subject: after, ...}) as f: e = await f.next(timeout)``.
    Events of one subject come in log order; events of different subjects interleave as they
    arrive. Quarantined (undecodable) events are skipped, as every reader skips them.

    ``registry`` is where its folds report, named ``NAME:SUBJECT`` (default: a registry of its own).
    """

    def __init__(
        self,
        store: EventStore,
        subjects: dict[str, int],
        *,
        registry: FollowerRegistry | None = None,
        name: str = "follower",
    ) -> None:
        self.store = store
        self.subjects = dict(subjects)
        self.name = name
        self.registry = registry if registry is not None else FollowerRegistry()
        self._queue: asyncio.Queue[RecordedEvent] = asyncio.Queue()
        self._folds: list[Follower] = []

    async def __aenter__(self) -> EventWaiter:
        self._folds = [
            Follower(
                self.store,
                subject,
                self._queue.put_nowait,
                name=f"{self.name}:{subject}",
                after=after,
                registry=self.registry,
            ).start()
            for subject, after in self.subjects.items()
        ]
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for fold in self._folds:
            await fold.close()

    async def next(self, timeout: float | None) -> RecordedEvent | None:
        """The next event, or ``None`` when ``timeout`` seconds pass first (``None``: wait forever).

        NATS trouble does not end the wait: the folds read on once it passes. A caller whose wait
        ends empty-handed can tell quiet from trouble by :meth:`not_live`.
        """
        try:
            if timeout is None:
                return await self._queue.get()
            async with asyncio.timeout(max(timeout, 0.0)):
                return await self._queue.get()
        except TimeoutError:
            return None

    def health(self) -> list[FollowerHealth]:
        return [fold.health() for fold in self._folds]

    def not_live(self) -> list[str]:
        """Why each of the follower's folds that is not live is not (empty: it is hearing the log)."""
        return [h.reason() for h in self.health() if not h.live]
