"""The admission queue (issue "Following the load"): when every ready replica of a model is saturated, a
request waits in the gateway instead of piling onto an engine, and waiting requests are served
round-robin across projects as slots free.

Pure part: :class:`ModelQueue` (who is next, is there room) and :func:`retry_after_s`. The thin shell,
:class:`Gate`, keeps each waiter's future, grants slots as they free and sweeps deadlines and departed
clients; the router (``app.py``) asks it before choosing a replica.

Fairness is plain round-robin by project: each turn takes the oldest request of the next project that
has one, so a request of a project with one waiting is behind at most one request of every other
project, however many those have queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import time
from collections import deque
from collections.abc import Callable

FULL = "queue_full"  # the model's queue holds queue_max_per_model
PROJECT_FULL = "project_queue_full"  # the project's share of it holds queue_max_per_project
TIMEOUT = "timeout"  # waited queue_wait_s without a slot
REASONS = (FULL, PROJECT_FULL, TIMEOUT)


class Waiter:
    """One waiting request: its project, when it came, when it gives up."""

    __slots__ = ("at", "deadline", "id", "project")

    def __init__(self, id: int, project: str, at: float, deadline: float) -> None:
        self.id = id
        self.project = project
        self.at = at
        self.deadline = deadline

    def __repr__(self) -> str:
        return f"Waiter({self.id}, {self.project!r})"


class ModelQueue:
    """One model's waiting requests, by project, served round-robin. Pure: no clock, no I/O."""

    def __init__(self) -> None:
        self.by_project: dict[str, deque[Waiter]] = {}
        self.turns: deque[str] = deque()  # projects with a request waiting, the next to be served first
        self.depth = 0
        # Seconds between slots freeing while requests waited (EWMA): how fast the queue drains.
        self.drain_s: float | None = None
        self._last_free: float | None = None

    def room(self, project: str, max_model: int, max_project: int) -> str | None:
        """None when a request of ``project`` may join; else why not (FULL or PROJECT_FULL)."""
        if self.depth >= max_model:
            return FULL
        waiting = self.by_project.get(project)
        if waiting is not None and len(waiting) >= max_project:
            return PROJECT_FULL
        return None

    def push(self, w: Waiter) -> None:
        waiting = self.by_project.get(w.project)
        if waiting is None:
            waiting = self.by_project[w.project] = deque()
            self.turns.append(w.project)  # a project that starts waiting takes its turn after those already waiting
        waiting.append(w)
        self.depth += 1

    def pop(self) -> Waiter | None:
        """The next request to serve: the oldest of the project whose turn it is."""
        if not self.turns:
            return None
        project = self.turns.popleft()
        waiting = self.by_project[project]
        w = waiting.popleft()
        if waiting:
            self.turns.append(project)
        else:
            del self.by_project[project]
        self.depth -= 1
        return w

    def remove(self, w: Waiter) -> bool:
        """Take a request out wherever it stands (its client left, its deadline passed)."""
        waiting = self.by_project.get(w.project)
        if waiting is None or w not in waiting:
            return False
        waiting.remove(w)
        if not waiting:
            del self.by_project[w.project]
            self.turns.remove(w.project)
        self.depth -= 1
        return True

    def expired(self, now: float) -> list[Waiter]:
        """The waiting requests whose deadline has passed."""
        return [w for waiting in self.by_project.values() for w in waiting if w.deadline <= now]

    def freed(self, now: float) -> None:
        """A slot freed while requests waited: the drain rate moves toward the interval since the last."""
        if self._last_free is not None and self.depth:
            gap = now - self._last_free
            self.drain_s = gap if self.drain_s is None else 0.8 * self.drain_s + 0.2 * gap
        self._last_free = now if self.depth else None


def retry_after_s(depth: int, drain_s: float | None, wait_s: float) -> int:
    """Whole seconds until a full queue likely has room: the waiting requests at the drain rate seen,
    at least 1 and at most the queue's own deadline (the time by which every request in it is gone)."""
    if drain_s is None:
        return max(1, math.ceil(wait_s / 2))
    return max(1, min(math.ceil(wait_s), math.ceil(depth * drain_s)))


class QueueRefused(Exception):
    """The request may not wait (full) or waited too long: ``reason`` is one of REASONS."""

    def __init__(self, reason: str, depth: int, retry_after: int) -> None:
        self.reason = reason
        self.depth = depth
        self.retry_after = retry_after
        super().__init__(reason)


class ClientLeft(Exception):
    """The client disconnected while its request waited."""


Load = Callable[[str], tuple[int, int]]  # model -> (requests in flight to its ready replicas, their slots)


class Gate:
    """The queue's I/O: waiters' futures, slots granted as they free, a sweep for deadlines and departures.

    A granted request holds its slot in ``granted`` until it is sent (:meth:`sent`), so a request that
    arrives between the grant and the send cannot take the same slot.
    """

    SWEEP_S = 0.1  # how often deadlines, departed clients and new replicas are looked at while requests wait

    def __init__(
        self,
        load: Load,
        max_per_model: int,
        max_per_project: int,
        wait_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_wait: Callable[[str, float], None] | None = None,
        on_refuse: Callable[[str, str], None] | None = None,
    ) -> None:
        self.load = load
        self.max_per_model = max_per_model
        self.max_per_project = max_per_project
        self.wait_s = wait_s
        self.clock = clock
        self.on_wait = on_wait
        self.on_refuse = on_refuse
        self.queues: dict[str, ModelQueue] = {}
        self.granted: dict[str, int] = {}  # model -> slots given to waiters not yet sent
        self._futures: dict[int, tuple[asyncio.Future[None], Callable[[], bool]]] = {}
        self._ids = itertools.count()
        self._sweeper: asyncio.Task[None] | None = None

    def depths(self) -> dict[str, int]:
        return {m: q.depth for m, q in self.queues.items()}

    def passes(self, model: str) -> bool:
        """True when a new request may go at once: nobody waits and a slot is free (the fast path)."""
        q = self.queues.get(model)
        if q is not None and q.depth:
            return False
        in_flight, slots = self.load(model)
        return in_flight + self.granted.get(model, 0) < slots

    async def wait(self, model: str, project: str, gone: Callable[[], bool]) -> float:
        """Wait for a slot of ``model``; the seconds waited. Raises QueueRefused or ClientLeft."""
        q = self.queues.get(model)
        if q is None:
            q = self.queues[model] = ModelQueue()
        why = q.room(project, self.max_per_model, self.max_per_project)
        if why is not None:
            self._refuse(model, why)
            raise QueueRefused(why, q.depth, retry_after_s(q.depth, q.drain_s, self.wait_s))
        now = self.clock()
        w = Waiter(next(self._ids), project, now, now + self.wait_s)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures[w.id] = (fut, gone)
        q.push(w)
        self.dispatch(model)  # a slot may be free already (a request ahead of it left)
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.create_task(self._sweep(), name="router-queue-sweep")
        try:
            await fut
        except asyncio.CancelledError:
            if not q.remove(w) and fut.done() and not fut.cancelled() and fut.exception() is None:
                self.sent(model)  # granted, but the handler was cancelled before it used the slot
                self.dispatch(model)
            raise
        finally:
            self._futures.pop(w.id, None)
        waited = self.clock() - w.at
        if self.on_wait is not None:
            self.on_wait(model, waited)
        return waited

    async def close(self) -> None:
        """Stop the sweep (a stopping router); requests still waiting end with their handlers."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    def sent(self, model: str) -> None:
        """A granted request is being sent: its slot now counts as in flight."""
        self.granted[model] -= 1

    def released(self, model: str) -> None:
        """A request to ``model`` finished (or moved to another replica): serve the next waiter."""
        q = self.queues.get(model)
        if q is not None and q.depth:
            q.freed(self.clock())
            self.dispatch(model)

    def dispatch(self, model: str) -> None:
        """Grant free slots to waiters, in fair order."""
        q = self.queues.get(model)
        if q is None or not q.depth:
            return
        in_flight, slots = self.load(model)
        free = slots - in_flight - self.granted.get(model, 0)
        while free > 0 and (w := q.pop()) is not None:
            fut, _ = self._futures[w.id]
            if fut.done():
                continue
            self.granted[model] = self.granted.get(model, 0) + 1
            fut.set_result(None)
            free -= 1

    def _refuse(self, model: str, why: str) -> None:
        if self.on_refuse is not None:
            self.on_refuse(model, why)

    async def _sweep(self) -> None:
        """While anything waits: fail the expired, drop the departed, and grant slots new replicas brought."""
        while any(q.depth for q in self.queues.values()):
            await asyncio.sleep(self.SWEEP_S)
            now = self.clock()
            for model, q in list(self.queues.items()):
                for w in q.expired(now):
                    q.remove(w)
                    fut, _ = self._futures[w.id]
                    if fut.done():
                        continue  # its handler was cancelled and has not yet run to take it out
                    self._refuse(model, TIMEOUT)
                    fut.set_exception(QueueRefused(TIMEOUT, q.depth, retry_after_s(q.depth, q.drain_s, self.wait_s)))
                for waiting in list(q.by_project.values()):
                    for w in list(waiting):
                        fut, gone = self._futures[w.id]
                        with contextlib.suppress(Exception):
                            if not fut.done() and gone():
                                q.remove(w)
                                fut.set_exception(ClientLeft())
                self.dispatch(model)
