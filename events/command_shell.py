"""One way to handle a command: catch up, already applied?, decide, append, retry, busy.

Every command service is the same loop around its own rules. :class:`CommandShell` is that loop,
once: it waits until its :class:`LogFold` (the service's supervised live folds) has read the log up
to its head, answers "already applied" when an event the command caused is already folded (a
redelivery after the events were written but before the outcome was), asks the service's
``decide`` for a :class:`Decision`, appends it with the expected sequence the decision was made at
(or fenced on another subject's sequence), and on :class:`AppendConflict` catches up and decides
again, a bounded number of times, before refusing the command as ``busy`` with what to do. A fold
that cannot catch up in time (failed, stalled) refuses the command as ``unavailable``, naming the
fold and why. It stamps every event by the one rule (docs/decisions.md): causation is the
command's id, correlation the command's :attr:`Command.thread`.

A service supplies only its fold (``apply``), its ``decide`` and, where it has them, the effects
around the append as explicit hooks (the mirror cancels downloads before a removal is written and
starts one after a fetch is).
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Generic, TypeVar

import msgspec
import structlog

from llmgw.events.commands import Accepted, Command, CommandProcessor, Rejected
from llmgw.events.envelope import RecordedEvent
from llmgw.events.live_fold import FoldRegistry, LiveFold
from llmgw.events.store import AppendConflict, AppendResult, EventStore, NewEvent
from llmgw.events.subjects import aggregate_of

log = structlog.get_logger("llmgw.events.command_shell")

P = TypeVar("P")

MAX_ATTEMPTS = 5


class Fence(msgspec.Struct, frozen=True):
    """Append only while ``subject`` is still at ``seq`` (instead of expecting the decision's own subject)."""

    subject: str
    seq: int


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """What a service decided about one command: events for one subject, and what the caller is told.

    ``expected`` is the subject's last sequence as the decision saw it (0: a new aggregate). No
    ``payloads``: nothing to write (already so), the command completes with ``message``.
    """

    subject: str = ""
    payloads: list[msgspec.Struct] = []
    expected: int = 0
    fence: Fence | None = None
    message: str
    result: dict[str, Any] = {}


class Cause(msgspec.Struct, frozen=True):
    """On whose behalf a follow-on event is written (a download's progress): the command that started
    the work, and that command's correlation."""

    causation: str | None = None
    correlation: str | None = None


def stamp(command: Command, payloads: Iterable[msgspec.Struct]) -> list[NewEvent]:
    """The command's events, by the one rule: its actor, causation its id, correlation its thread."""
    return [
        NewEvent(payload=p, actor=command.actor, causation=command.id, correlation=command.thread) for p in payloads
    ]


class FoldNotCurrent(Exception):
    """A fold did not read the log up to its head in time: a decision now would be on stale state."""


CATCH_UP_S = 10.0  # the most a command waits for its service's folds; under a caller's 15 s deadline


class LogFold:
    """Keeps a pure fold current with some subjects of the log: one supervised :class:`LiveFold` each.

    ``subjects`` maps each subject filter to its fold's name, as ``/healthz`` and the
    ``llmgw_fold_healthy`` metric of ``registry`` (the process's) show it. ``apply`` gets every event
    on those subjects once, in order per subject; an event it raises on is quarantined and the fold
    goes on. The fold also remembers which commands caused the events it read (their causation),
    which is how a command that was applied already is recognised, whatever the service folds.

    The folds read in the background, from :meth:`start` (or the first :meth:`catch_up`) until
    :meth:`close`; they apply events only while the event loop is free, never in the middle of a
    synchronous ``decide``. A decision is still made on a fold that may move on while it is being
    appended: the ``expected`` sequence it carries guards the append, as it always did.
    """

    def __init__(
        self,
        store: EventStore,
        subjects: Mapping[str, str],
        apply: Callable[[RecordedEvent], Awaitable[None] | None],
        *,
        registry: FoldRegistry | None = None,
        wait_s: float = CATCH_UP_S,
    ) -> None:
        self.store = store
        self.apply = apply
        self.names = dict(subjects)
        self.registry = registry if registry is not None else FoldRegistry()
        self.wait_s = wait_s
        self.caused: dict[str, int] = {}  # command id -> sequence of the first event it caused
        self.folds: dict[str, LiveFold] = {}
        self._moved = asyncio.Condition()  # notified after each batch any of the folds applied
        self._closed = False

    @property
    def positions(self) -> dict[str, int]:
        """Each subject's position: the last sequence on it the fold has read (0 before it starts)."""
        return {s: self.folds[s].position if s in self.folds else 0 for s in self.names}

    def start(self) -> LogFold:
        """Start following the log (once); the folds appear in the registry from here on."""
        if self._closed:
            raise FoldNotCurrent(f"the service is stopping: its folds ({', '.join(self.names.values())}) are closed")
        if not self.folds:
            self.folds = {
                subject: LiveFold(
                    self.store, subject, self._fold, name=name, after=0, registry=self.registry, on_batch=self._notify
                ).start()
                for subject, name in self.names.items()
            }
        return self

    async def close(self) -> None:
        self._closed = True
        for fold in self.folds.values():
            await fold.close()

    def _fold(self, event: RecordedEvent) -> Awaitable[None] | None:
        if event.envelope.causation:
            self.caused.setdefault(event.envelope.causation, event.seq)
        return self.apply(event)

    async def _notify(self) -> None:
        async with self._moved:
            self._moved.notify_all()

    async def catch_up(self, timeout: float | None = None) -> None:
        """Return once every fold has read its subject up to the log's last event on it as of now.

        Raises :class:`FoldNotCurrent` naming the fold and its health when one does not within
        ``timeout`` seconds (default: the fold's ``wait_s``): a failed or stalled fold refuses, never hangs.
        ``math.inf`` waits as long as reading takes (a service starting on a long log).
        """
        self.start()
        # The last sequence on each subject (wildcards included): the fold is current once it has read that far.
        heads = await asyncio.gather(*(self.store.last_seq(s) for s in self.folds))
        targets = dict(zip(self.folds, heads, strict=True))
        wait_s = self.wait_s if timeout is None else timeout
        end = None if math.isinf(wait_s) else asyncio.get_running_loop().time() + wait_s
        for subject, last in targets.items():
            fold = self.folds[subject]
            if fold.position >= last:
                continue
            try:
                async with asyncio.timeout_at(end), self._moved:
                    await self._moved.wait_for(lambda f=fold, last=last: f.position >= last)
            except TimeoutError:
                raise FoldNotCurrent(
                    f"the {fold.name} fold has read the log to {fold.position} of {last} and did not catch up "
                    f"within {wait_s:.0f} s ({fold.health().reason()}): nothing was decided; send the command "
                    "again once the process's /healthz shows the fold live"
                ) from None

    def applied(self, command_id: str) -> int | None:
        """The sequence of the first event ``command_id`` caused, or None when it caused none yet."""
        return self.caused.get(command_id)


Decide = Callable[[Command, P], "Decision | Awaitable[Decision]"]
Hook = Callable[[Command, P, Decision], Awaitable[None]]
AfterHook = Callable[[Command, P, Decision, AppendResult], Awaitable[dict[str, Any] | None]]


class CommandShell(Generic[P]):
    """Handles one service's commands: the shell around its fold and its ``decide``.

    ``what`` names what the commands change, for the busy message ("the tenancy tree").
    ``decide(command, payload)`` reads the fold and returns a :class:`Decision` or raises
    :class:`Rejected`; it is pure, save for a service whose rules need facts from outside (the
    mirror asks the hub), which may gather them first and so be a coroutine. ``before_append`` runs
    once the decision is final, just before it is written; ``after_append`` once it is written, and
    may add to the caller's result. ``applied_result`` is the result a redelivered command answers
    with, for callers that need it (a job's id).
    """

    def __init__(
        self,
        store: EventStore,
        *,
        service: str,
        what: str,
        fold: LogFold,
        decide: Decide[P],
        payload_type: Any,
        before_append: Hook[P] | None = None,
        after_append: AfterHook[P] | None = None,
        applied_result: Callable[[Command, P], dict[str, Any]] | None = None,
        attempts: int = MAX_ATTEMPTS,
    ) -> None:
        self.store = store
        self.service = service
        self.what = what
        self.fold = fold
        self.decide = decide
        self.payload_type = payload_type
        self.before_append = before_append
        self.after_append = after_append
        self.applied_result = applied_result
        self.attempts = attempts

    async def handle(self, command: Command, payload: P) -> Accepted:
        moved = ""  # the subject that moved last: named in the busy message
        for _ in range(self.attempts):
            try:
                await self.fold.catch_up()
            except FoldNotCurrent as exc:  # deciding on state the log has moved past would be a guess
                raise Rejected(str(exc), "unavailable") from exc
            seq = self.fold.applied(command.id)
            if seq is not None:
                # Redelivered after its events were written but before its outcome was.
                result = self.applied_result(command, payload) if self.applied_result else {}
                return Accepted(message="already applied", last_seq=seq, result=result)
            decision = self.decide(command, payload)
            if inspect.isawaitable(decision):
                decision = await decision
            assert isinstance(decision, Decision)
            if not decision.payloads:
                return Accepted(message=decision.message, result=decision.result)
            events = stamp(command, decision.payloads)
            if self.before_append is not None:
                await self.before_append(command, payload, decision)
            try:
                appended = await self._append(decision, events)
            except AppendConflict as exc:  # for a fenced append, the fence moved
                log.info("decided on a stale fold; deciding again", command=command.id, subject=exc.subject)
                moved = exc.subject
                continue
            result = dict(decision.result)
            if self.after_append is not None:
                result |= await self.after_append(command, payload, decision, appended) or {}
            return Accepted(
                message=decision.message, events=[e.id for e in events], last_seq=appended.last_seq, result=result
            )
        raise Rejected(busy_message(self.what, command, self.attempts, moved), "busy")

    async def _append(self, decision: Decision, events: list[NewEvent]) -> AppendResult:
        if decision.fence is not None:
            return await self.store.append_fenced(
                [(decision.subject, e) for e in events],
                fence_subject=decision.fence.subject,
                fence_seq=decision.fence.seq,
            )
        return await self.store.append(decision.subject, events, expected=decision.expected)

    def processor(self) -> CommandProcessor:
        return CommandProcessor(self.store, self.service, self.payload_type, self.handle)


def busy_message(what: str, command: Command, attempts: int, subject: str) -> str:
    """Why a command was given up on after ``attempts`` conflicts, and what a person can do."""
    where = ""
    try:
        aggregate, _ = aggregate_of(subject)
        where = f"; `llmgw events tail --aggregate {aggregate}` shows who is changing it"
    except ValueError:
        pass
    return (
        f"{what} changed {attempts} times while this {command.kind} command was being decided (other writers are "
        f"busy on it): nothing was written; send the command again in a moment{where}"
    )
