"""The projection runner: keeps each projection's live tables folded up to the log, in batches.

Per projection, one asyncio task reads its subject from the checkpoint on and, for each batch,
applies every event and moves the checkpoint in ONE transaction — a crash (or a cancel) between
the two leaves neither, so nothing is applied twice or skipped. Quarantined positions and event
types nobody handles only move the checkpoint.

A handler error is never skipped: the batch is rolled back and tried once more (unbuffered,
which names the failing event); if it fails again the projection stops, logs the event and the
error, counts it, and reports it in :meth:`ProjectionRunner.status` and from ``wait_until``,
until :meth:`ProjectionRunner.restart` (after a fix). The other projections go on. Lost
connections, and errors of the machine rather than of an event (a full disk, a read-only file
system, a locked database: :func:`environmental`), are retried with backoff instead, so a
projection resumes by itself once space returns; each change of state is logged.

Each projection is also one of the process's supervised readers (given ``folds``, a
:class:`~llmgw.events.runtime.follower.FollowerRegistry`): ``projection-NAME`` on ``/healthz`` and in
``llmgw_fold_healthy``, failed once it stopped on an event, stalled once it has been retrying for
``stall_s`` (:func:`slot_health`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import msgspec
import structlog
from prometheus_client import CollectorRegistry

from llmgw.events.runtime.follower import STALL_S, FollowerHealth, FollowerRegistry
from llmgw.events.runtime.retry import backoff_delay
from llmgw.events.runtime.store import EventStore
from llmgw.projections.apply import (
    CheckpointMoved,
    HandlerError,
    ProjectionError,
    ProjectionSuperseded,
    claim_checkpoint,
    commit_batch,
    create_tables,
    ensure_checkpoints,
    init_checkpoint,
    read_checkpoint,
)
from llmgw.projections.backends import Backend, Transaction
from llmgw.projections.base import Projection
from llmgw.projections.metrics import ProjectionMetrics
from llmgw.projections.reader import read_log
from llmgw.projections.rebuild import rebuild

log = structlog.get_logger("llmgw.projections.runner")

RETRY_MIN_S = 0.2
RETRY_MAX_S = 30.0


_ENVIRONMENTAL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EAGAIN, errno.EBUSY}
# SQLite's messages for a full disk, a read-only file, a busy or locked database, an I/O error.
_ENVIRONMENTAL_SQLITE = ("full", "locked", "busy", "disk i/o", "readonly", "read-only", "unable to open")
# PostgreSQL SQLSTATE classes 53 (insufficient resources: disk full, out of memory, too many connections),
# 57P (operator intervention: shutdown, cannot connect now) and 58 (system error: I/O).
_ENVIRONMENTAL_SQLSTATES = ("53", "57P", "58")


def environmental(exc: BaseException) -> bool:
    """True when ``exc`` (or what caused it) is a condition of the machine that passes by itself
    or by an operator's hand — disk full, read-only, locked — not a fault of the event. Pure."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in _ENVIRONMENTAL_ERRNOS:
            return True
        if type(e).__module__ == "sqlite3" and type(e).__name__ == "OperationalError":
            text = str(e).lower()
            if any(word in text for word in _ENVIRONMENTAL_SQLITE):
                return True
        sqlstate = getattr(e, "sqlstate", None)
        if isinstance(sqlstate, str) and sqlstate.startswith(_ENVIRONMENTAL_SQLSTATES):
            return True
        e = e.__cause__ or e.__context__
    return False


class ProjectionFailed(ProjectionError):
    """The projection stopped on an error and will not reach the position asked for until restarted."""

    def __init__(self, name: str, cause: BaseException) -> None:
        self.name = name
        self.cause = cause
        super().__init__(f"{cause}; fix it, then `llmgw projections rebuild {name}` or restart the server")


class ProjectionState(msgspec.Struct, frozen=True, kw_only=True):
    """One projection as the runner sees it (``llmgw projections status``)."""

    name: str
    status: str  # starting | running | paused | retrying | failed | stopped
    position: int
    lag: int
    version: int
    applied: int
    error: str | None = None
    failed_seq: int | None = None


class _Slot:
    """The runner's mutable state for one projection."""

    def __init__(self, projection: Projection, store: EventStore) -> None:
        self.projection = projection
        self.store = store.on_stream(projection.stream)  # the stream its subject is on
        self.position = 0
        self.head = 0  # highest sequence known on the projection's subject, for the lag
        self.applied = 0
        self.status = "starting"
        self.error: BaseException | None = None
        self.failed_seq: int | None = None
        self.task: asyncio.Task[None] | None = None
        # Held for each batch transaction; a rebuild holds it to pause this projection.
        self.lock = asyncio.Lock()
        self.changed = asyncio.Condition()
        # Monotonic: the first failure of the run of them it is in; over once a batch commits or, with
        # nothing to read, once it is found caught up with the log.
        self.retrying_since: float | None = None
        self.last_error: str | None = None  # why it retried last (``error`` is cleared while it tries again)

    @property
    def failed(self) -> bool:
        return self.status == "failed"


def slot_health(
    status: str, error: str | None, retrying_since: float | None, now: float, stall_s: float
) -> tuple[str, str | None]:
    """A projection's state as a supervised reader (``/healthz``'s words) and why. Pure.

    One stopped on an event is failed; one that has kept failing and retrying (the bus or the
    database away, the disk full or read-only) for ``stall_s`` is stalled — before that a blip is not
    news. Otherwise running (or paused by a rebuild) is live, and so is one another release supersedes
    (it writes the tables now)."""
    if status == "failed":
        return "failed", error
    if retrying_since is not None and now - retrying_since >= stall_s:
        return "stalled", f"failing and retrying for {now - retrying_since:.0f} s: {error}"
    if status == "starting":
        return "starting", None
    return "live", error if status in ("retrying", "superseded") else None


class _SlotHealth:
    """One projection as a :class:`FollowerRegistry` entry."""

    def __init__(self, slot: _Slot, runner: ProjectionRunner) -> None:
        self.name = f"projection-{slot.projection.name}"
        self.slot = slot
        self.runner = runner
        self.since = (slot.status, time.time())

    def health(self) -> FollowerHealth:
        slot, runner = self.slot, self.runner
        error = str(slot.error) if slot.error is not None else slot.last_error
        state, reason = slot_health(slot.status, error, slot.retrying_since, runner.clock(), runner.stall_s)
        if state != self.since[0]:
            self.since = (state, time.time())
        return FollowerHealth(
            name=self.name, state=state, position=slot.position, head=slot.head, error=reason, since=self.since[1]
        )


class ProjectionRunner:
    """Runs projections against one event store and one backend.

    ``metrics`` (or a ``registry`` to create them in) receives the Prometheus series; with
    neither they go to a private registry. ``lag_interval_s`` refreshes the lag gauges in the
    background (``None``: only when :meth:`refresh_lag` is called, e.g. on each scrape). ``folds``,
    when given, holds each projection's health while the runner runs (``stall_s``: how long a
    projection may retry before it is stalled there).
    """

    def __init__(
        self,
        store: EventStore,
        backend: Backend,
        projections: Sequence[Projection],
        *,
        batch_size: int = 1000,
        metrics: ProjectionMetrics | None = None,
        registry: CollectorRegistry | None = None,
        lag_interval_s: float | None = 5.0,
        on_batch: Callable[[str, int], None] | None = None,
        folds: FollowerRegistry | None = None,
        stall_s: float = STALL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        names = [p.name for p in projections]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"projection names must be unique; repeated: {', '.join(duplicates)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        self.store = store
        self.backend = backend
        self.projections = list(projections)
        self.batch_size = batch_size
        self.metrics = metrics if metrics is not None else ProjectionMetrics(registry)
        self.lag_interval_s = lag_interval_s
        # Told (projection, new checkpoint) after each committed batch: the replay snapshots' saver.
        self.on_batch = on_batch
        self._slots = {p.name: _Slot(p, store) for p in self.projections}
        self.folds = folds
        self.stall_s = stall_s
        self.clock = clock
        self._health = [_SlotHealth(slot, self) for slot in self._slots.values()]
        self._lag_task: asyncio.Task[None] | None = None
        self._started = False

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Create tables and checkpoints where missing, then follow the log (returns once following)."""
        if self._started:
            return
        self._started = True
        await ensure_checkpoints(self.backend)
        for slot in self._slots.values():
            await self._prepare(slot)
        for slot in self._slots.values():
            slot.task = asyncio.create_task(self._run(slot), name=f"projection-{slot.projection.name}")
        for entry in self._health if self.folds is not None else ():
            self.folds.add(entry)  # type: ignore[union-attr]
        if self.lag_interval_s:
            self._lag_task = asyncio.create_task(self._lag_loop(), name="projection-lag")

    async def stop(self) -> None:
        """Stop every projection; a batch in flight is rolled back (its events are read again next time)."""
        tasks = [t for t in (self._lag_task, *(s.task for s in self._slots.values())) if t is not None]
        for t in tasks:
            t.cancel()
        for t in tasks:
            while not t.done():
                # A cancel can be swallowed — Python 3.11's asyncio.wait_for returns normally when the
                # cancel and its inner wait's completion land in the same loop turn — so ask again.
                await asyncio.wait({t}, timeout=1.0)
                t.cancel()
            if not t.cancelled() and t.exception() is not None:
                log.error("projection task ended with an error", task=t.get_name(), error=str(t.exception()))
        self._lag_task = None
        for entry in self._health if self.folds is not None else ():
            self.folds.remove(entry)  # type: ignore[union-attr]
        for slot in self._slots.values():
            slot.task = None
            if not slot.failed:
                slot.status = "stopped"
            await self._notify(slot)
        self._started = False

    @property
    def running(self) -> bool:
        """Whether this runner follows the log (between :meth:`start` and :meth:`stop`)."""
        return self._started

    async def __aenter__(self) -> ProjectionRunner:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def restart(self, name: str) -> None:
        """Run a projection stopped by an error again, from its checkpoint (after the cause is fixed)."""
        slot = self._slot(name)
        if slot.task is not None and not slot.task.done():
            return
        slot.error, slot.failed_seq, slot.status = None, None, "starting"
        self.metrics.failed.labels(projection=name).set(0)
        slot.task = asyncio.create_task(self._run(slot), name=f"projection-{name}")

    # -- reading its state -----------------------------------------------------------------------

    def position(self, name: str) -> int:
        """The stream sequence up to which ``name`` has applied every event on its subject."""
        return self._slot(name).position

    def state(self, name: str) -> ProjectionState:
        slot = self._slot(name)
        return ProjectionState(
            name=name,
            status=slot.status,
            position=slot.position,
            lag=max(0, slot.head - slot.position),
            version=slot.projection.version,
            applied=slot.applied,
            error=None if slot.error is None else str(slot.error),
            failed_seq=slot.failed_seq,
        )

    def states(self) -> list[ProjectionState]:
        return [self.state(name) for name in self._slots]

    def status(self) -> list[dict[str, Any]]:
        """:meth:`states` as plain dicts (JSON-ready)."""
        return msgspec.to_builtins(self.states())

    async def wait_until(self, name: str, position: int, timeout: float = 10.0) -> bool:
        """True once ``name`` has applied everything on its subject up to ``position``; False on timeout.

        Read-your-writes: pass the sequence your append returned. The event there may be on
        another subject than the projection reads, so once the log has reached ``position`` the
        goal is the last event *on its subject* at or before it. A position the log has not
        reached yet is waited for as it is. Raises :class:`ProjectionFailed` if the projection
        has stopped on an error, instead of waiting out the timeout. Positions are sequences of
        the projection's own stream (``Projection.stream``).
        """
        slot = self._slot(name)
        if slot.position >= position:
            return True
        try:
            async with asyncio.timeout(timeout):
                goal = position
                # In this order: once the log holds `position`, the subject's head read after it
                # covers every event on the subject up to `position`.
                if await slot.store.stream_last_seq() >= position:
                    head = await slot.store.last_seq(slot.projection.subject)
                    slot.head = max(slot.head, head)
                    goal = min(position, head)
                async with slot.changed:
                    await slot.changed.wait_for(lambda: slot.position >= goal or slot.failed)
        except TimeoutError:
            return False
        if slot.position >= goal:
            return True
        raise ProjectionFailed(name, slot.error or ProjectionError(f"projection {name} failed"))

    async def refresh_lag(self) -> None:
        """Ask the log for each subject's last sequence and update the lag gauges (while running:
        a process that runs no projections reports no lag)."""
        if not self._started:
            return
        for slot in self._slots.values():
            try:
                slot.head = max(slot.head, await slot.store.last_seq(slot.projection.subject))
            except Exception as exc:  # metrics must never take the runner down
                log.warning("could not read the log head for the lag", projection=slot.projection.name, error=str(exc))
                continue
            if slot.status == "running" and slot.position >= slot.head:
                slot.retrying_since = None  # reading again with nothing left to read: the trouble is over
            self._gauge(slot)

    # -- pausing (rebuild) -----------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def paused(self, name: str) -> AsyncIterator[None]:
        """Hold ``name`` between batches: no transaction of its runs until the block ends."""
        slot = self._slot(name)
        async with slot.lock:
            before, slot.status = slot.status, ("paused" if slot.status == "running" else slot.status)
            try:
                yield
            finally:
                if slot.status == "paused":
                    slot.status = before

    async def note_checkpoint(self, name: str, position: int) -> None:
        """Adopt a checkpoint someone else wrote (a rebuild's swap), while holding :meth:`paused`."""
        slot = self._slot(name)
        slot.position = position
        self._gauge(slot)
        await self._notify(slot)

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    # -- internals -------------------------------------------------------------------------------

    def _slot(self, name: str) -> _Slot:
        try:
            return self._slots[name]
        except KeyError:
            known = ", ".join(self._slots) or "none"
            raise KeyError(f"no projection named {name!r} in this runner (known: {known})") from None

    def _gauge(self, slot: _Slot) -> None:
        name = slot.projection.name
        slot.head = max(slot.head, slot.position)
        self.metrics.position.labels(projection=name).set(slot.position)
        self.metrics.lag.labels(projection=name).set(slot.head - slot.position)

    async def _notify(self, slot: _Slot) -> None:
        async with slot.changed:
            slot.changed.notify_all()

    async def _prepare(self, slot: _Slot) -> None:
        p = slot.projection
        async with self.backend.transaction() as tx:
            checkpoint = await init_checkpoint(tx, p.name, p.version)
            if checkpoint.version == p.version:
                await create_tables(tx, p)
        if checkpoint.version != p.version:
            # The projection's code changed shape: its tables are rebuilt from the log, then swapped in.
            log.warning(
                "projection version changed; rebuilding it from the log",
                projection=p.name,
                stored_version=checkpoint.version,
                version=p.version,
            )
            result = await rebuild(self.store, self.backend, p, batch_size=max(self.batch_size, 1000))
            slot.position = result.position
        else:
            slot.position = checkpoint.position
        self.metrics.failed.labels(projection=p.name).set(0)
        self.metrics.applied.labels(projection=p.name)  # the series exists from the start, at 0
        self.metrics.errors.labels(projection=p.name)
        self._gauge(slot)
        await self._notify(slot)

    async def _run(self, slot: _Slot) -> None:
        p = slot.projection
        retries = 0
        while True:
            try:
                slot.status = "running"
                batches = read_log(
                    slot.store, p.subject, after=slot.position, follow=True, batch_size=self.batch_size, decode=p.decode
                )
                async with contextlib.aclosing(batches):
                    async for batch in batches:
                        async with slot.lock:
                            try:
                                rewind = await self._apply(slot, batch)
                            except Exception as exc:
                                raise _ApplyFailed() from exc
                        if retries:
                            log.info("projection resumed", projection=p.name, position=slot.position, retries=retries)
                            retries = 0
                        slot.retrying_since = None
                        if rewind:
                            break
                    else:
                        return  # a following reader only ends when the store closes
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                error = exc.__cause__ if isinstance(exc, _ApplyFailed) else exc
                assert isinstance(error, Exception)
                if isinstance(error, ProjectionSuperseded):
                    # A rolling upgrade: the newer release rebuilt the projection and writes it now.
                    slot.status, slot.error = "superseded", error
                    log.warning("projection superseded by another release", projection=p.name, error=str(error))
                    await self._notify(slot)
                    return
                cause = error.cause if isinstance(error, HandlerError) else error
                if isinstance(exc, _ApplyFailed) and not (self.backend.is_transient(cause) or environmental(cause)):
                    await self._fail(slot, error)
                    return
                # The bus or the database went away, or the disk is full: read again from the
                # checkpoint, with backoff; the first retry and every 10th are logged.
                self.metrics.errors.labels(projection=p.name).inc()
                if slot.retrying_since is None:
                    slot.retrying_since = self.clock()
                slot.status, slot.error, slot.last_error = "retrying", error, str(error)
                retries += 1
                delay = backoff_delay(retries, RETRY_MIN_S, RETRY_MAX_S)
                if retries == 1 or retries % 10 == 0:
                    log.warning(
                        "projection interrupted; retrying",
                        projection=p.name,
                        error=str(error),
                        retry_in_s=delay,
                        retries=retries,
                    )
                await asyncio.sleep(delay)
                slot.error = None

    async def _apply(self, slot: _Slot, batch: Sequence[Any]) -> bool:
        """Apply one batch and move the checkpoint; True when the reader must start again further back."""
        p = slot.projection
        events = [e for e in batch if e.seq > slot.position]  # a rebuild's swap may have moved us on
        while events:
            target = events[-1].seq
            expected = slot.position

            async def claim(tx: Transaction, expected: int = expected, target: int = target) -> None:
                if not await claim_checkpoint(tx, p.name, expected, target, p.version):
                    found = await read_checkpoint(tx, p.name)
                    if found is not None and found.version != p.version:
                        raise ProjectionSuperseded(p.name, found.version, p.version)
                    raise CheckpointMoved(found.position if found else 0)

            def retrying(exc: BaseException, first: int = events[0].seq, last: int = target) -> None:
                self.metrics.errors.labels(projection=p.name).inc()
                log.warning(
                    "projection batch failed; trying it again event by event",
                    projection=p.name,
                    first_seq=first,
                    last_seq=last,
                    error=f"{type(exc).__name__}: {exc}",
                )

            try:
                await commit_batch(self.backend, p, events, before=claim, on_retry=retrying)
            except CheckpointMoved as moved:
                # Another writer (a second process, a rebuild) got there first.
                log.info("projection checkpoint moved elsewhere", projection=p.name, ours=expected, now=moved.position)
                slot.position = moved.position
                self._gauge(slot)
                await self._notify(slot)
                if moved.position < expected:
                    return True
                events = [e for e in events if e.seq > moved.position]
                continue
            slot.position = target
            slot.applied += len(events)
            self.metrics.applied.labels(projection=p.name).inc(len(events))
            self._gauge(slot)
            await self._notify(slot)
            if self.on_batch is not None:
                try:
                    self.on_batch(p.name, target)
                except Exception as exc:  # a listener's fault must not stop the projection
                    log.warning("projection batch listener failed", projection=p.name, error=str(exc))
            return False
        return False

    async def _fail(self, slot: _Slot, exc: Exception) -> None:
        name = slot.projection.name
        slot.status, slot.error = "failed", exc
        slot.failed_seq = exc.seq if isinstance(exc, HandlerError) else None
        self.metrics.errors.labels(projection=name).inc()
        self.metrics.failed.labels(projection=name).set(1)
        log.error(
            "projection stopped: an event could not be applied",
            projection=name,
            seq=slot.failed_seq,
            event_type=exc.event_type if isinstance(exc, HandlerError) else None,
            position=slot.position,
            error=str(exc),
            exc_info=exc,
        )
        await self._notify(slot)

    async def _lag_loop(self) -> None:
        assert self.lag_interval_s
        while True:
            await self.refresh_lag()
            await asyncio.sleep(self.lag_interval_s)


class _ApplyFailed(Exception):
    """Raised from the batch's error: tells the run loop the batch failed, not the reader."""
