"""One supervised follower: the only way an in-memory reader keeps its state current with the log.

Every service that answers from memory (the router's keys and replicas, the scheduler's view of
the fleet, the agent's desired replicas, the mirror's files) folds some subjects of the log and then
follows them. Written by hand, such a loop was a bare task nothing watched: when it raised, the
service went on answering from frozen state (a revoked key kept working) while its health said 200.

A :class:`Follower` is that loop once, supervised:

- it starts from a given position and state, or (with a :class:`~.snapshots.SnapshotPlan`) from the
  newest snapshot, whose next ones it then saves itself, and reads the tail;
- it says when it has caught up with the log as it was when it started (``caught_up``);
- the reader rides out NATS trouble and remakes a lost consumer itself (:mod:`.reader`); any other
  failure starts the loop again from the fold's position, with backoff (:func:`.retry.keep_running`),
  so nothing is skipped and nothing applied twice;
- an event the service's ``apply`` raises on is quarantined with the error (kept, counted, logged)
  and the fold goes on: one poisoned event never freezes the rest of the log behind it;
- a watchdog compares the fold's position with the log's head: a fold that has events to read and
  does not advance for ``stall_s`` seconds (or cannot learn the head that long) is ``stalled``.

Its :meth:`Follower.health` is plain data; a process's :class:`FollowerRegistry` gathers its folds — and
everything else that follows the bus under the same supervision (core-NATS subscribers,
:mod:`.subscriber`; projection slots) — for ``/healthz`` (503 naming each one that is not live) and for
the metrics.

Its first turn to live is logged at debug (a process starts dozens of folds: that is not news to a
person at a terminal); falling behind, failing and recovering from either are logged for a person.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, Protocol

import msgspec
import structlog
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily

from llmgw.events.runtime.retry import keep_running, retrying
from llmgw.events.runtime.snapshots import SnapshotPlan, Snapshotter, resume
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import subjects as S
from llmgw.events.schema.codec import encode_envelope
from llmgw.events.schema.envelope import RecordedEvent, UnknownPayload

log = structlog.get_logger("llmgw.events.runtime.follower")

STALL_S = 30.0  # a fold with events to read that has not advanced this long is stalled
STATES = ("starting", "catching_up", "live", "stalled", "failed")


class Folding(Protocol):
    """A fold a :class:`Follower` can keep current: its ``apply`` and the last sequence it has seen."""

    position: int

    def apply(self, event: RecordedEvent) -> Any: ...


Apply = Callable[[RecordedEvent], "Awaitable[None] | None"]


class FollowerHealth(msgspec.Struct, frozen=True, kw_only=True):
    """How one fold (or subscriber, or projection slot) is doing, as ``/healthz`` and the metrics report it."""

    name: str
    state: str  # one of STATES
    position: int  # the last log sequence folded (a subscriber: the messages it has handled)
    head: int | None = None  # the log's last sequence on the fold's subjects, when known
    error: str | None = None  # why it is not live (or the last failure it recovered from)
    since: float  # wall-clock time (Unix seconds) the fold has been in this state since
    quarantined: int = 0  # events its apply raised on, quarantined

    @property
    def live(self) -> bool:
        return self.state == "live"

    def reason(self) -> str:
        return f"{self.name} is {self.state}" + (f": {self.error}" if self.error else "")


class Observation(msgspec.Struct, frozen=True, kw_only=True):
    """What the fold knows about itself at one moment: the input to :func:`judge`."""

    reading: bool  # the follow loop has started reading at least once
    caught_up: bool
    position: int
    head: int | None
    behind_since: float | None  # when the watchdog first saw head > position with the position as it is now
    head_unknown_since: float | None  # when asking for the head started failing (None: it answers)
    head_error: str | None
    failure: str | None  # the follow loop failed and has not read since


def judge(o: Observation, now: float, stall_s: float) -> tuple[str, str | None]:
    """The fold's state and why, from what it knows (monotonic seconds)."""
    if o.failure is not None:
        return "failed", o.failure
    if o.behind_since is not None and o.head is not None and now - o.behind_since >= stall_s:
        return "stalled", (
            f"the log has events up to {o.head} but the fold has stood at {o.position} for {now - o.behind_since:.0f} s"
        )
    if o.head_unknown_since is not None and now - o.head_unknown_since >= stall_s:
        return "stalled", f"cannot learn the log's head for {now - o.head_unknown_since:.0f} s: {o.head_error}"
    if not o.reading:
        return "starting", None
    if not o.caught_up:
        return "catching_up", f"at {o.position} of {o.head}" if o.head is not None else None
    return "live", None


class Follower:
    """Keeps ``fold`` (an object with ``apply`` and ``position``, or a bare apply function) current
    with ``subject`` of the log, supervised; see the module's docstring.

    ``after`` is where to start (default: the fold's own ``position``, else 0). ``snapshot`` starts it
    from the newest snapshot instead, when one decodes, and saves the next ones (:meth:`restore`).
    ``on_batch`` runs after each batch is applied (a service wakes its loops there). ``apply`` may be a
    coroutine function; while it is awaited the fold does not advance (a stall the watchdog sees).
    """

    def __init__(
        self,
        store: EventStore,
        subject: str,
        fold: Folding | Apply,
        *,
        name: str,
        after: int | None = None,
        registry: FollowerRegistry | None = None,
        on_batch: Callable[[], Any] | None = None,
        snapshot: SnapshotPlan | None = None,
        stall_s: float = STALL_S,
        check_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store = store
        self.subject = subject
        self.name = name
        self._target = fold if hasattr(fold, "apply") else None
        self._apply: Apply = fold.apply if hasattr(fold, "apply") else fold  # type: ignore[union-attr,assignment]
        start = after if after is not None else int(getattr(self._target, "position", 0) or 0)
        self.position = start
        self.on_batch = on_batch
        self.snapshot = snapshot
        self.snapshotter: Snapshotter | None = None  # saves the next snapshots, once restored with a plan
        self._restored = snapshot is None
        self.stall_s = stall_s
        self.check_s = check_s if check_s is not None else max(min(stall_s / 3, 5.0), 0.05)
        self.clock = clock
        self.caught_up = asyncio.Event()
        self.head: int | None = None
        self.quarantined = 0
        # "type@v" of events this fold passed without reading (a newer version's, in a rolling upgrade):
        # a snapshot of this fold says so, and a reader that reads them does not start from it.
        self.unread: set[str] = set()
        self.registry = registry if registry is not None else FollowerRegistry()
        self.registry.add(self)
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._target_head: int | None = None  # the head when the fold started: caught up once there
        self._reading = False
        self._failure: str | None = None
        self._failed_at = 0.0
        self._attempt_at = 0.0
        self._behind: tuple[int, float] | None = None  # (position, since) while head > position
        self._head_unknown_since: float | None = None
        self._head_error: str | None = None
        self._last_error: str | None = None
        self._shown: tuple[str, float] = ("starting", time.time())
        self._alarmed = False  # it was logged as not live, and has not been logged live again since

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Follower:
        """Run the fold in a task of its own (stopped by :meth:`close`)."""
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"fold-{self.name}")
        return self

    async def restore(self) -> None:
        """Start from the newest snapshot of the ``snapshot`` plan (if one decodes at its schema) and set up
        the saving of the next ones. Once, before reading: :meth:`run` does it if the service did not (a
        service that must not take requests before its state is restored awaits it first)."""
        if self._restored:
            return
        self._restored = True
        plan = self.snapshot
        assert plan is not None
        resumed = await resume(
            self.store,
            plan.name,
            plan.schema_version,
            plan.decode,
            plan.encode,
            lambda: self.position,
            every_events=plan.every_events,
            every_s=plan.every_s,
            live=plan.live or self.caught_up.is_set,
            unread=lambda: self.unread,
        )
        if resumed is None:
            return
        restored, self.snapshotter = resumed
        if restored is not None:
            self.start_at(restored.position, plan.adopt(restored.state), unread=restored.unread)

    def start_at(self, position: int, fold: Folding | Apply | None = None, unread: Iterable[str] = ()) -> None:
        """Before the fold runs: start after ``position`` (a snapshot's), folding into ``fold`` if given;
        ``unread``: what the snapshot's fold had passed without reading, still unread."""
        if self._reading or self._target_head is not None:
            raise RuntimeError(f"the {self.name} fold is already reading: it cannot start elsewhere")
        if fold is not None:
            self._target = fold if hasattr(fold, "apply") else None
            self._apply = fold.apply if hasattr(fold, "apply") else fold  # type: ignore[union-attr,assignment]
        self.position = position
        self.unread.update(unread)

    async def wait_caught_up(self, timeout: float | None = None) -> bool:
        """Whether the fold caught up with the log as it was at its start within ``timeout`` seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self.caught_up.wait()
        except TimeoutError:
            return False
        return True

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        self.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self.registry.remove(self)

    async def run(self) -> None:
        """Follow the log until stopped, the follow loop restarted after any failure, watched."""
        await self.restore()
        watchdog = asyncio.create_task(self._watch(), name=f"fold-{self.name}-watchdog")
        try:
            await keep_running(
                f"{self.name} fold", self._follow_once, stop=self._stop, closed=lambda: self.store.nc.is_closed
            )
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watchdog
            if self.snapshotter is not None:
                self.snapshotter.close()

    # -- the loop ----------------------------------------------------------------------------

    async def _follow_once(self) -> None:
        self._attempt_at = self.clock()
        try:
            if self._target_head is None:
                # What the log holds now: caught up once the fold has read that far.
                self._target_head = await retrying(f"the {self.name} fold's start", self._head, stop=self._stop)
                self.head = self._target_head
                if self.position >= self._target_head:
                    self.caught_up.set()
            # From where the fold is: a loop started again never applies an event twice.
            async for batch in self.store.subscribe(self.subject, after=self.position, follow=True):
                self._reading = True
                for event in batch:
                    if event.seq <= self.position:
                        continue
                    if isinstance(event, RecordedEvent):
                        await self._apply_one(event)
                    self._advance(event.seq)
                self._failure = None
                if self._target_head is not None and self.position >= self._target_head:
                    self.caught_up.set()
                if self.on_batch is not None:
                    result = self.on_batch()
                    if inspect.isawaitable(result):
                        await result
                if self.snapshotter is not None:
                    self.snapshotter.folded()  # at the batch's edge, the service's own work on it done
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failure = self._last_error = _describe(exc)
            self._failed_at = self.clock()
            raise

    async def _apply_one(self, event: RecordedEvent) -> None:
        if isinstance(event.payload, UnknownPayload):
            self.unread.add(f"{event.envelope.type}@{event.envelope.v}")
        try:
            result = self._apply(event)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            await self._quarantine(event, exc)

    def _advance(self, seq: int) -> None:
        self.position = seq
        if self._target is not None and getattr(self._target, "position", 0) < seq:
            self._target.position = seq  # a fold that skips events it does not fold still moves on

    async def _quarantine(self, event: RecordedEvent, exc: Exception) -> None:
        # Kept with its bytes and the error, counted and logged: skipped, never silently.
        self.quarantined += 1
        self.registry.quarantined.labels(fold=self.name).inc()
        error = f"the {self.name} fold could not apply {event.type}: {_describe(exc)}"
        self._last_error = error
        log.error(
            "an event the fold cannot apply was quarantined; the fold goes on",
            fold=self.name,
            subject=event.subject,
            seq=event.seq,
            type=event.type,
            exc_info=exc,
        )
        await self.store.quarantine(self.store.stream, event.subject, event.seq, encode_envelope(event.envelope), error)

    # -- the watchdog ------------------------------------------------------------------------

    async def _head(self) -> int:
        if self.store.stream == S.STREAM_EVENTS and self.subject == f"{S.EVENTS_ROOT}.>":
            # The whole stream: its state says, where a wildcard lookup scans every subject (~10x slower
            # at 100,000 subjects).
            return await self.store.stream_last_seq()
        return await self.store.last_seq(self.subject)

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.check_s)
            now = self.clock()
            try:
                async with asyncio.timeout(max(self.check_s, 1.0)):
                    head = await self._head()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self._head_unknown_since is None:
                    self._head_unknown_since = now
                self._head_error = _describe(exc) if not isinstance(exc, TimeoutError) else "NATS does not answer"
                self.health()
                continue
            self._head_unknown_since = self._head_error = None
            self.head = head
            if head <= self.position:
                self._behind = None
                self.caught_up.set()  # a start target on events since removed: nothing is left to read
                if self._failure is not None and self._attempt_at > self._failed_at:
                    self._failure = None  # started again and current: nothing left to fail on
            elif self._behind is None or self._behind[0] != self.position:
                self._behind = (self.position, now)
            self.health()  # logs a change of state, for a process nobody asks (the agent)

    # -- health ------------------------------------------------------------------------------

    def observe(self) -> Observation:
        behind = self._behind
        return Observation(
            reading=self._reading or self.caught_up.is_set(),
            caught_up=self.caught_up.is_set(),
            position=self.position,
            head=self.head,
            behind_since=behind[1] if behind is not None and behind[0] == self.position else None,
            head_unknown_since=self._head_unknown_since,
            head_error=self._head_error,
            failure=self._failure,
        )

    def health(self) -> FollowerHealth:
        state, reason = judge(self.observe(), self.clock(), self.stall_s)
        if state != self._shown[0]:
            self._shown = (state, time.time())
            self._alarmed = log_change(self.name, self._alarmed, state, reason, position=self.position)
        return FollowerHealth(
            name=self.name,
            state=state,
            position=self.position,
            head=self.head,
            error=reason or self._last_error,
            since=self._shown[1],
            quarantined=self.quarantined,
        )


def log_change(name: str, alarmed: bool, state: str, reason: str | None, **facts: Any) -> bool:
    """Log one supervised reader's change to ``state``, for a person where it needs one: not live is an
    error; live again after that (``alarmed``) is news; the first turn to live at start is not (debug).
    Returns whether it is alarmed now."""
    if state in ("stalled", "failed"):
        log.error("a fold is not live", fold=name, state=state, reason=reason, **facts)
        return True
    if state == "live" and alarmed:
        log.info("a fold is live again", fold=name, **facts)
        return False
    if state == "live":
        log.debug("a fold is live", fold=name, **facts)
    return alarmed


class Supervised(Protocol):
    """What a :class:`FollowerRegistry` holds: anything following the bus that says how it is doing."""

    name: str

    def health(self) -> FollowerHealth: ...


class FollowerRegistry:
    """The supervised readers of one process — followers, subscribers, projection slots — for its
    ``/healthz`` and its metrics (passed in: no globals)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self._folds: dict[str, Supervised] = {}
        self.metrics = registry if registry is not None else CollectorRegistry()
        self.quarantined = Counter(
            "llmgw_fold_quarantined",
            "Events a fold's apply raised on, quarantined so the fold could go on",
            ["fold"],
            registry=self.metrics,
        )
        self.metrics.register(_FollowerCollector(self))

    def add(self, fold: Supervised) -> None:
        self._folds[fold.name] = fold

    def remove(self, fold: Supervised) -> None:
        if self._folds.get(fold.name) is fold:
            del self._folds[fold.name]

    def health(self) -> list[FollowerHealth]:
        return [f.health() for f in self._folds.values()]


def health_body(folds: list[FollowerHealth]) -> dict[str, Any]:
    """The folds' part of a ``/healthz`` answer: each fold's health, and why each one not live is not."""
    return {
        "folds": {h.name: msgspec.to_builtins(h) for h in folds},
        "unhealthy_folds": [h.reason() for h in folds if not h.live],
    }


class _FollowerCollector:
    """``llmgw_fold_healthy{fold}``: 1 while the fold is live, else 0 — computed when scraped."""

    def __init__(self, folds: FollowerRegistry) -> None:
        self.folds = folds

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # computed at scrape time: nothing to check at registration

    def collect(self) -> Iterator[GaugeMetricFamily]:
        gauge = GaugeMetricFamily(
            "llmgw_fold_healthy", "1 while the fold is live (caught up, advancing)", labels=["fold"]
        )
        for h in self.folds.health():
            gauge.add_metric([h.name], 1.0 if h.live else 0.0)
        yield gauge


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if text.startswith(type(exc).__name__) else f"{type(exc).__name__}: {text}"


__all__ = [
    "Follower",
    "FollowerHealth",
    "FollowerRegistry",
    "Observation",
    "Supervised",
    "health_body",
    "judge",
    "log_change",
]
