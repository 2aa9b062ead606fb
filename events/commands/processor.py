"""Carrying out commands: the one outcome each gets (ARCHITECTURE §4).

The owning service of a :class:`~llmgw.events.commands.command.Command` runs a
:class:`CommandProcessor`: it decodes the command strictly (an unknown kind or field is refused),
lets the service decide, and writes exactly one outcome — ``command.completed`` with the events it
wrote, or ``command.rejected`` with a reason a person can act on. The outcome is appended with
expected sequence 0 on its own subject, so however often a command is delivered, it has one outcome;
a redelivered command whose outcome exists is acknowledged and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.js.api import AckPolicy, ConsumerConfig

from llmgw.events.commands.auth import CommandVerifier
from llmgw.events.commands.command import Command, command_decoder
from llmgw.events.commands.roles import Need
from llmgw.events.runtime import log_context
from llmgw.events.runtime.connection import StoreError
from llmgw.events.runtime.retry import is_transient, keep_running
from llmgw.events.runtime.store import AppendConflict, EventStore, NewEvent
from llmgw.events.schema import subjects as S
from llmgw.events.schema.outcomes import (
    REFUSAL_AGGREGATE,
    CommandCompleted,
    CommandRejected,
    CommandReplayed,
    Rejected,
)
from llmgw.events.schema.subjects import event_subject

log = structlog.get_logger("llmgw.events.commands.processor")


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
    (:mod:`llmgw.events.commands.auth`); a command that fails is refused, its refusal in the log.
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
            command = command_decoder.decode(msg.data)
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
