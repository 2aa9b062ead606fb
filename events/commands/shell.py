"""One way to handle a command: catch up, already applied?, decide, append, retry, busy.

Every command service is the same loop around its own rules. :class:`CommandShell` is that loop,
once: it waits until its :class:`Followers` (the service's supervised followers) has read the log up
to its head, answers "already applied" when an event the command caused is already folded (a
redelivery after the events were written but before the outcome was), asks the service's pure
``decide(state, payload, now)`` for a :class:`Decision`, appends it with the expected sequence of
the aggregate it writes as the fold had read it when deciding (or fenced on another subject's), and
on :class:`AppendConflict` catches up and decides again, a bounded number of times, before refusing
the command as ``busy`` with what to do. A fold that cannot catch up in time (failed, stalled)
refuses the command as ``unavailable``, naming the fold and why. It stamps every event by the one
rule (docs/decisions.md): causation is the command's id, correlation the command's
:attr:`Command.thread`.

A service supplies only its folds and its state, its rules' ``decide`` and, where it has them, what
it must ``gather`` from outside before deciding (the mirror asks the hub) and the effects around the
append as explicit hooks (the mirror cancels downloads before a removal is written and starts one
after a fetch is). No service keeps sequences of its own: the shell's fold knows each aggregate's.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping
from datetime import datetime
from typing import Any, Generic, TypeVar

import msgspec
import structlog

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.command import Command
from llmgw.events.commands.processor import Accepted, CommandProcessor
from llmgw.events.commands.roles import Need, cluster_admin
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers, NotCaughtUp
from llmgw.events.runtime.store import AppendConflict, AppendResult, EventStore, NewEvent
from llmgw.events.schema.envelope import utc_now
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import aggregate_of

log = structlog.get_logger("llmgw.events.commands.shell")

S = TypeVar("S")
P = TypeVar("P")

MAX_ATTEMPTS = 5


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """What a service's rules decided about one command: events for one aggregate, and what the caller is told.

    ``subject`` is the aggregate the events are written to; the shell appends them expecting it to be
    where the fold had read it when deciding (0: a new aggregate). With ``fence``, the append expects
    that other subject unchanged instead (a key is created only while the tenancy tree is as decided
    on). No ``payloads``: nothing to write (already so), the command completes with ``message``.
    ``confirm`` is what the service's ``before_append`` must still make sure of outside, once the
    decision is final (the mirror asks the hub whether a gated file may be read); None for most.
    """

    subject: str = ""
    payloads: list[msgspec.Struct] = []
    fence: str | None = None
    message: str
    result: dict[str, Any] = {}
    confirm: Any = None


class Append(msgspec.Struct, frozen=True):
    """How the shell writes a decision: the sequence it expects ``subject`` (or ``fence``) at."""

    subject: str
    expected: int
    fence: str | None = None


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


Decide = Callable[[S, P, datetime], Decision]
Gather = Callable[[Command, P], "S | Awaitable[S]"]
Hook = Callable[[Command, P, Decision], Awaitable[None]]
AfterHook = Callable[[Command, P, Decision, AppendResult], Awaitable[dict[str, Any] | None]]


class CommandShell(Generic[S, P]):
    """Handles one service's commands: the shell around its folds and its rules.

    ``what`` names what the commands change, for the busy message ("the tenancy tree").
    ``decide(state, payload, now)`` is the service's rules: pure, it reads ``state`` (what ``fold``
    keeps current) and returns a :class:`Decision` or raises :class:`Rejected`. A service whose
    rules need facts from outside (the mirror: the hub's file list) or from the command itself (the
    jobs: its id names the job) passes ``gather(command, payload)``, which may be a coroutine and
    returns the state ``decide`` is given instead: gather first, then decide purely.
    ``before_append`` runs once the decision is final, just before it is written (and may still
    refuse); ``after_append`` once it is written, and may add to the caller's result.
    ``applied_result`` is the result a redelivered command answers with, for callers that need it
    (a job's id). ``verifier`` is the process's shared :class:`CommandVerifier` (one fold of the
    people and the tree for all its services); without one, the service's processor makes its own.
    """

    def __init__(
        self,
        store: EventStore,
        *,
        service: str,
        what: str,
        fold: Followers,
        state: S | None = None,
        decide: Decide[S, P],
        payload_type: Any,
        gather: Gather[S, P] | None = None,
        before_append: Hook[P] | None = None,
        after_append: AfterHook[P] | None = None,
        applied_result: Callable[[Command, P], dict[str, Any]] | None = None,
        authorize: Callable[[Command, P], Need | None] | None = None,
        attempts: int = MAX_ATTEMPTS,
        verifier: CommandVerifier | None = None,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self.store = store
        self.service = service
        self.what = what
        self.fold = fold
        self.state = state
        self.decide = decide
        self.payload_type = payload_type
        self.gather = gather
        self.before_append = before_append
        self.after_append = after_append
        self.applied_result = applied_result
        self.authorize = authorize or (lambda command, payload: cluster_admin(f"{command.kind} (a {service} command)"))
        self.attempts = attempts
        self.verifier = verifier
        self.clock = clock

    async def handle(self, command: Command, payload: P) -> Accepted:
        moved = ""  # the subject that moved last: named in the busy message
        for _ in range(self.attempts):
            try:
                await self.fold.catch_up()
            except NotCaughtUp as exc:  # deciding on state the log has moved past would be a guess
                raise Rejected(str(exc), "unavailable") from exc
            seq = self.fold.applied(command.id)
            if seq is not None:
                # Redelivered after its events were written but before its outcome was.
                result = self.applied_result(command, payload) if self.applied_result else {}
                return Accepted(message="already applied", last_seq=seq, result=result)
            state = await self._gather(command, payload)
            # From the decision to reading the sequences nothing awaits: they are the ones it was made on.
            decision = self.decide(state, payload, self.clock())
            if not decision.payloads:
                return Accepted(message=decision.message, result=decision.result)
            append = self.append_of(decision)
            events = stamp(command, decision.payloads)
            if self.before_append is not None:
                await self.before_append(command, payload, decision)
            try:
                appended = await self._append(append, events)
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

    async def _gather(self, command: Command, payload: P) -> S:
        if self.gather is None:
            return self.state  # type: ignore[return-value]
        state = self.gather(command, payload)
        return await state if inspect.isawaitable(state) else state

    def append_of(self, decision: Decision) -> Append:
        """The append of ``decision``: its aggregate (or its fence) expected where the fold has read it now."""
        for subject in (decision.subject, decision.fence):
            # A subject the fold does not follow would always be expected new: a service's mistake, said at once.
            if subject is not None and not self.fold.follows(subject):
                raise RuntimeError(f"the {self.service} service decided on {subject}, which its folds do not follow")
        if decision.fence is not None:
            return Append(decision.subject, self.fold.seq(decision.fence), fence=decision.fence)
        return Append(decision.subject, self.fold.seq(decision.subject))

    async def _append(self, append: Append, events: list[NewEvent]) -> AppendResult:
        if append.fence is not None:
            return await self.store.append_fenced(
                [(append.subject, e) for e in events], fence_subject=append.fence, fence_seq=append.expected
            )
        return await self.store.append(append.subject, events, expected=append.expected)

    def processor(self) -> CommandProcessor:
        """The service's processor: every command verified (signer, signature, actor, role) before it is decided."""
        # The process's shared verifier when it was given one; else one of the service's own.
        verifier = self.verifier or CommandVerifier(
            self.store, name=f"signers-{self.service}", registry=self.fold.registry
        )
        return CommandProcessor(
            self.store, self.service, self.payload_type, self.handle, verifier=verifier, authorize=self.authorize
        )


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


class FoldedService:
    """A command service whose state is one fold of some subjects and whose rules are ``decide`` and
    ``need`` (pure): the followers, the shell, start, close and processor, once. A service that shares a
    fold or gathers from outside builds its own around :class:`CommandShell` instead."""

    def __init__(
        self,
        store: EventStore,
        *,
        service: str,
        what: str,
        state: Any,
        subjects: Mapping[str, str],
        decide: Callable[[Any, Any, datetime], Decision],
        payload_type: Any,
        need: Callable[[Any], Need | None],
        folds: FollowerRegistry | None = None,
        verifier: CommandVerifier | None = None,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        self.store = store
        self.state = state
        self.fold = Followers(store, subjects, state.apply, registry=folds)
        self.shell = CommandShell(
            store,
            service=service,
            what=what,
            fold=self.fold,
            state=state,
            decide=decide,
            payload_type=payload_type,
            authorize=lambda command, payload: need(payload),
            verifier=verifier,
            clock=clock,
        )

    def start(self) -> None:
        self.fold.start()

    async def close(self) -> None:
        await self.fold.close()

    def processor(self) -> CommandProcessor:
        return self.shell.processor()
