"""Sending a command and waiting for its one outcome (ARCHITECTURE §4).

A caller publishes a signed :class:`~llmgw.events.commands.command.Command` on
``llmgw.cmd.<service>.<verb>`` (the work-queue stream) and waits, with a deadline, for its outcome
on ``llmgw.evt.command.<id>``: ``command.completed`` with the events it wrote, or
``command.rejected`` with a reason a person can act on (:class:`CommandRejectedError`).
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import nats.errors
import nats.js.errors

from llmgw.events.commands.auth import ServiceSigner, Signer, sign_command
from llmgw.events.commands.command import Command, command_subject
from llmgw.events.commands.errors import (
    CommandError,
    CommandRejectedError,
    CommandTimeoutError,
    Unreachable,
)
from llmgw.events.runtime.retry import is_transient
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import subjects as S
from llmgw.events.schema.codec import decode_event
from llmgw.events.schema.envelope import utc_now
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.outcomes import CommandCompleted, CommandRejected


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
        command_id: str | None = None,
    ) -> CommandCompleted:
        """The command's ``command.completed`` outcome; raises :class:`CommandRejectedError` on refusal.

        ``command_id`` names the command (an HTTP ``Idempotency-Key``, made into an id): sent again, it is
        the same command, answered with its first outcome and never applied twice."""
        command = Command(
            id=command_id or new_id(),
            kind=f"{service}.{verb}",
            actor=actor,
            at=utc_now(),
            expected=expected,
            correlation=correlation,
            data=msgspec.Raw(msgspec.json.encode(payload)),
        )
        command = await sign_command(command, self.signer)
        outcome_subject = S.command_outcome_subject(command.id)
        if command_id is not None:  # sent before: its first outcome is the answer, nothing is sent again
            got = await self._read_outcome(outcome_subject)
            if got is not None:
                return self._outcome(got[0], outcome_subject, got[1])
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
