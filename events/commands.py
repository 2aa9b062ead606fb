"""Commands: what people and tools ask for, and the one outcome each gets (ARCHITECTURE §4).

A caller publishes a :class:`Command` on ``llmgw.cmd.<service>.<verb>`` (the work-queue stream)
and waits, with a deadline, for its outcome on ``llmgw.evt.command.<id>``. The owning service
runs a :class:`CommandProcessor`: it decodes the command strictly (an unknown kind or field is
refused), lets the service decide, and writes exactly one outcome — ``command.completed`` with
the events it wrote, or ``command.rejected`` with a reason a person can act on. The outcome is
appended with expected sequence 0 on its own subject, so however often a command is delivered,
it has one outcome; a redelivered command whose outcome exists is acknowledged and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js.api import AckPolicy, ConsumerConfig

from llmgw.events import log_context, signing
from llmgw.events import subjects as S
from llmgw.events.codec import decode_event
from llmgw.events.command_auth import CommandVerifier, ServiceSigner, Signer, sign_command
from llmgw.events.envelope import utc_now
from llmgw.events.ids import new_id
from llmgw.events.outcomes import (  # Rejected: re-exported, what every service raises
    REFUSAL_AGGREGATE,
    CommandCompleted,
    CommandRejected,
    CommandReplayed,
    Rejected,
)
from llmgw.events.retry import is_transient, keep_running
from llmgw.events.roles import Need
from llmgw.events.store import AppendConflict, EventStore, NewEvent, StoreError
from llmgw.events.subjects import event_subject

log = structlog.get_logger("llmgw.events.commands")

_VERB = re.compile(r"^[a-z][a-z0-9_-]*(\.[a-z][a-z0-9_-]*)*$")


class Command(msgspec.Struct, frozen=True, kw_only=True):
    """The command envelope. ``data`` is decoded by the owning service, strictly."""

    id: str
    kind: str  # "<service>.<verb>", e.g. "tenancy.create"
    actor: str
    at: datetime
    expected: int | None = None
    correlation: str | None = None
    data: msgspec.Raw = msgspec.Raw(b"{}")
    signer: str = ""  # the key that signed it: token:<prefix> (a person) or svc:<name> (events/command_auth.py)
    signature: str = ""  # Ed25519 over :meth:`signed_bytes`

    def signed_bytes(self) -> bytes:
        """What the signature covers: every field but the signature itself, the data as sent."""
        return signing.signed_bytes(
            id=self.id,
            kind=self.kind,
            actor=self.actor,
            at=self.at,
            expected=self.expected,
            correlation=self.correlation,
            signer=self.signer,
            data=bytes(self.data),
        )

    @property
    def thread(self) -> str:
        """The correlation of every event the command causes: the one it carries (a job's id when a job
        sent it), else its own id (docs/decisions.md, "One command-handling shell")."""
        return self.correlation or self.id


_command_decoder = msgspec.json.Decoder(Command)


def command_subject(service: str, verb: str) -> str:
    if not _VERB.match(service) or "." in service or not _VERB.match(verb):
        raise ValueError(f"bad command name {service}.{verb}: lower-case words separated by dots")
    return f"{S.COMMANDS_ROOT}.{service}.{verb}"


# -- what a caller sees ------------------------------------------------------------------------


class CommandError(Exception):
    """Base of the caller-side errors; each maps to an exit code in the CLI."""

    exit_code = 1


class CommandRejectedError(CommandError):
    """The owning service refused the command; ``reason`` says what to do."""

    exit_code = 2

    def __init__(self, reason: str, code: str = "rejected") -> None:
        self.reason = reason
        self.code = code
        super().__init__(reason)


class CommandTimeoutError(CommandError):
    exit_code = 3


class Unreachable(CommandError):
    exit_code = 4


class CommandClient:
    """Sign a command, publish it and wait for its outcome."""

    def __init__(self, store: EventStore, signer: Signer) -> None:
        self.store = store
        self.signer = signer

    @classmethod
    def for_service(cls, store: EventStore, service: str) -> CommandClient:
        """A client of a part of the system, signing as ``svc:<service>`` (it must be able to read the
        cluster secret)."""
        return cls(store, ServiceSigner(store, service))

    async def send(
        self,
        service: str,
        verb: str,
        payload: msgspec.Struct,
        *,
        actor: str,
        expected: int | None = None,
        correlation: str | None = None,
        timeout: float = 15.0,
    ) -> CommandCompleted:
        """The command's ``command.completed`` outcome; raises :class:`CommandRejectedError` on refusal."""
        command = Command(
            id=new_id(),
            kind=f"{service}.{verb}",
            actor=actor,
            at=utc_now(),
            expected=expected,
            correlation=correlation,
            data=msgspec.Raw(msgspec.json.encode(payload)),
        )
        command = await sign_command(command, self.signer)
        outcome_subject = S.command_outcome_subject(command.id)
        nc = self.store.nc
        # Subscribe before publishing, so the outcome cannot slip past us.
        sub = await nc.subscribe(outcome_subject, max_msgs=1)
        try:
            try:
                await self.store.js.publish(
                    command_subject(service, verb),
                    msgspec.json.encode(command),
                    headers={S.HDR_MSG_ID: command.id},
                )
            except Exception as exc:
                if not is_transient(exc):
                    raise
                raise Unreachable(f"the command stream did not answer ({exc!r}); is `llmgw up` running?") from exc
            deadline = asyncio.get_running_loop().time() + timeout
            while True:
                left = deadline - asyncio.get_running_loop().time()
                if left <= 0:
                    raise CommandTimeoutError(
                        f"no outcome for {command.kind} (command {command.id}) within {timeout:.0f}s: "
                        f"is the {service} service running? `llmgw events show {command.id}` "
                        "shows it once it is handled"
                    )
                try:
                    msg = await sub.next_msg(timeout=min(left, 1.0))
                    data, seq = msg.data, 0
                except nats.errors.TimeoutError:
                    # A fallback read from the log in case the live message was missed.
                    got = await self._read_outcome(outcome_subject)
                    if got is None:
                        continue
                    data, seq = got
                return self._outcome(data, outcome_subject, seq)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _read_outcome(self, subject: str) -> tuple[bytes, int] | None:
        try:
            async with asyncio.timeout(2.0):  # within the caller's deadline, not the store's 10 s
                msg = await self.store.js.get_last_msg(self.store.stream, subject, direct=True)
        except nats.js.errors.NotFoundError:
            return None
        except Exception as exc:
            if is_transient(exc):
                return None  # NATS is busy electing or reconnecting: the deadline decides
            raise
        return msg.data or b"", msg.seq or 0

    def _outcome(self, data: bytes, subject: str, seq: int) -> CommandCompleted:
        event = decode_event(self.store.registry, data, subject, seq)
        if isinstance(event.payload, CommandRejected):
            raise CommandRejectedError(event.payload.reason, event.payload.code)
        if isinstance(event.payload, CommandCompleted):
            return event.payload
        raise CommandError(f"unexpected outcome {event.type} on {subject}")


# -- what a service implements -----------------------------------------------------------------


class Accepted(msgspec.Struct, frozen=True, kw_only=True):
    message: str
    events: list[str] = []
    last_seq: int = 0
    result: dict[str, Any] = {}


Handler = Callable[[Command, Any], Awaitable[Accepted]]
Authorize = Callable[[Command, Any], "Need | None"]


class CommandProcessor:
    """Feeds one service's commands to its handler, one at a time, and writes each outcome once.

    ``payload_type`` is the service's strict tagged union of command payloads; ``handler``
    decides and appends, returning :class:`Accepted` or raising :class:`Rejected`. Before either,
    ``verifier`` proves who signed the command and ``authorize`` names the role it needs
    (:mod:`llmgw.events.command_auth`); a command that fails is refused, its refusal in the log.
    """

    def __init__(
        self,
        store: EventStore,
        service: str,
        payload_type: Any,
        handler: Handler,
        *,
        verifier: CommandVerifier,
        authorize: Authorize,
        max_deliver: int = 5,
        ack_wait_s: float = 30.0,
    ) -> None:
        self.store = store
        self.service = service
        self.actor = f"svc:{service}"
        self.handler = handler
        self.verifier = verifier
        self.authorize = authorize
        self.max_deliver = max_deliver
        self.ack_wait_s = ack_wait_s
        self._payload_decoder = msgspec.json.Decoder(payload_type)
        self._stopping = asyncio.Event()
        self.handled = 0

    async def run(self) -> None:
        """Handle commands until :meth:`stop`; rides out NATS trouble (an election, a lost node) by retrying."""
        self.verifier.start()
        try:
            await keep_running(
                f"{self.service} commands", self._run_once, stop=self._stopping, closed=lambda: self.store.nc.is_closed
            )
        finally:
            await self.verifier.close()

    async def _run_once(self) -> None:
        durable = f"svc-{self.service}"
        sub = await self.store.js.pull_subscribe(
            f"{S.COMMANDS_ROOT}.{self.service}.>",
            durable=durable,
            stream=S.STREAM_COMMANDS,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT, ack_wait=self.ack_wait_s, max_deliver=self.max_deliver
            ),
        )
        log.info("command processor started", service=self.service)
        try:
            while not self._stopping.is_set():
                try:
                    # One at a time: a larger batch would hold early commands while it waits to fill.
                    msgs = await sub.fetch(batch=1, timeout=1.0)
                except nats.errors.TimeoutError:
                    continue
                except (nats.errors.ConnectionClosedError, nats.errors.DrainTimeoutError):
                    return
                for msg in msgs:
                    try:
                        await self._process(msg)
                    except Exception as exc:
                        if not is_transient(exc):
                            raise
                        # The store went away mid-command: hand it back to be delivered again soon.
                        log.warning(
                            "command interrupted; it will be delivered again", service=self.service, error=str(exc)
                        )
                        with contextlib.suppress(Exception):
                            await msg.nak(delay=1.0)
        finally:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await sub.unsubscribe()

    def stop(self) -> None:
        self._stopping.set()

    async def _process(self, msg: Any) -> None:
        try:
            command = _command_decoder.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            seq = msg.metadata.sequence.stream
            await self.store.quarantine(S.STREAM_COMMANDS, msg.subject, seq, msg.data, f"not a command: {exc}")
            await msg.term()
            return
        outcome_subject = S.command_outcome_subject(command.id)
        seq = msg.metadata.sequence.stream
        handled = await self.store.last_seq(outcome_subject)
        if handled:
            # One outcome per command, however often delivered; the same id in a new message is a replay.
            await self._refuse_replay(command, handled, seq)
            await msg.ack()
            return
        kept = {"signer": command.signer, "command_seq": seq, "command": msgspec.Raw(msg.data)}
        # Every line logged while this command is handled names it (OBS-4): id, kind, correlation.
        bound = log_context.bind(
            ("command_id", command.id), ("command", command.kind), ("correlation_id", command.thread or "")
        )
        try:
            await self._decide(msg, command, seq, kept, outcome_subject)
        finally:
            log_context.unbind(bound)

    async def _decide(self, msg: Any, command: Command, seq: int, kept: dict[str, Any], outcome_subject: str) -> None:
        outcome: msgspec.Struct
        try:
            verified = await self.verifier.verify(command)  # raises Rejected: unsigned, forged, unknown…
            command = msgspec.structs.replace(command, actor=verified.actor)  # its events carry the proven actor
            try:
                payload = self._payload_decoder.decode(command.data)
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise Rejected(f"malformed {command.kind} command: {exc}", "malformed") from exc
            await self.verifier.authorize(verified, self.authorize(command, payload))
            accepted = await self.handler(command, payload)
            outcome = CommandCompleted(
                kind=command.kind,
                requested_by=command.actor,
                message=accepted.message,
                events=accepted.events,
                last_seq=accepted.last_seq,
                result=accepted.result,
                **kept,
            )
        except Rejected as exc:
            outcome = CommandRejected(
                kind=command.kind, requested_by=command.actor, reason=exc.reason, code=exc.code, **kept
            )
        except Exception as exc:
            delivered = msg.metadata.num_delivered
            log.exception("command handler failed", kind=command.kind, command=command.id, delivered=delivered)
            if delivered < self.max_deliver:
                await msg.nak(delay=min(2.0**delivered, 30.0))
                return
            outcome = CommandRejected(
                kind=command.kind,
                requested_by=command.actor,
                reason=f"the {self.service} service failed on this command {delivered} times ({exc}); "
                "see its log, fix the cause and send it again",
                code="internal",
                **kept,
            )
        try:
            await self.store.append(
                outcome_subject,
                [NewEvent(payload=outcome, actor=self.actor, causation=command.id, correlation=command.thread)],
                expected=0,
            )
        except AppendConflict:
            pass  # another delivery wrote the outcome first
        except StoreError:
            log.exception("could not write command outcome", command=command.id)
            await msg.nak(delay=1.0)
            return
        self.handled += 1
        await msg.ack()

    async def _refuse_replay(self, command: Command, handled: int, seq: int) -> None:
        """Write a ``command.replayed`` refusal when ``command`` came again as a new message (once per message)."""
        first = await self.store.get(handled)
        payload = getattr(first, "payload", None)
        first_seq = getattr(payload, "command_seq", 0)
        if not first_seq or first_seq == seq:
            return  # a redelivery of the message it was handled from (or an outcome from before replays were told)
        refusal = CommandReplayed(
            command_id=command.id,
            kind=command.kind,
            requested_by=getattr(payload, "requested_by", command.actor),  # as verified the first time
            signer=command.signer,
            first_seq=first_seq,
            replay_seq=seq,
        )
        log.warning("a command id was sent again: refused", command=command.id, kind=command.kind, seq=seq)
        event = NewEvent(payload=refusal, actor=self.actor, causation=command.id, correlation=command.thread)
        with contextlib.suppress(AppendConflict):  # this replay's refusal was written by an earlier delivery
            await self.store.append(event_subject(REFUSAL_AGGREGATE, f"{command.id}.{seq}"), [event], expected=0)
