"""Acting for a person over HTTP: one command, signed with the person's own token, and its outcome.

The management API (``/api/v1``) and the console send every change through here, so a change made
in a browser is the same command the CLI sends: signed with the token the request was authenticated
by (a session's or a personal one; the cookie of a console session holds a session token), its actor
left blank for the command service to write the verified person. The service, not this module,
decides whether the person may (roles, docs/people.md).

An ``Idempotency-Key`` becomes the command's id (:func:`command_id_for`), per person: sent again, the
command is answered with its first outcome and applied once.
"""

from __future__ import annotations

import hashlib
import uuid
from typing import Any

import msgspec

from llmgw.events.commands.auth import TokenSigner
from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.errors import CommandRejectedError, CommandTimeoutError, Unreachable
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.ids import new_id

# The HTTP status of a refusal, by its code; a code not named here is a 400 if it starts with
# ``invalid_`` (the input was wrong), else a 409 (the state refuses it).
STATUS_OF_CODE = {
    "invalid": 400,
    "invalid_request": 400,
    "unsigned": 401,
    "unknown_signer": 401,
    "expired": 401,
    "bad_signature": 401,
    "disabled": 403,
    "forged_actor": 403,
    "forbidden": 403,
    "not_found": 404,
    "unknown": 404,
    "exists": 409,
    "conflict": 409,
    "busy": 409,
    "replayed": 409,
    "unavailable": 503,
    "timeout": 504,
}
MAX_KEY_LENGTH = 255


class Outcome(msgspec.Struct, kw_only=True):
    """What a command came to: applied with its events, or refused with its code and reason."""

    command: str  # the command's id: `llmgw events show ID` finds it
    kind: str  # "<service>.<verb>"
    outcome: str  # "applied" | "refused"
    message: str
    events: list[str] = []
    result: dict[str, Any] = {}
    code: str | None = None  # the refusal's code (None when applied)

    @property
    def applied(self) -> bool:
        return self.outcome == "applied"

    @property
    def status(self) -> int:
        """The HTTP status that answers it: 200 applied, else by the refusal's code."""
        if self.applied:
            return 200
        code = self.code or ""
        # The services name what was wrong with the input: invalid_name, invalid_role, invalid_scope, …
        return STATUS_OF_CODE.get(code, 400 if code.startswith("invalid_") else 409)


class BadIdempotencyKey(ValueError):
    """An ``Idempotency-Key`` that cannot name a command (empty or too long)."""


def command_id_for(person: str, key: str) -> str:
    """The command id an ``Idempotency-Key`` stands for: the same person and key, the same id (a UUID
    derived from both, so one person's key never names another's command)."""
    key = key.strip()
    if not key or len(key) > MAX_KEY_LENGTH or not key.isprintable():
        raise BadIdempotencyKey(f"the Idempotency-Key must be 1 to {MAX_KEY_LENGTH} printable characters")
    digest = bytearray(hashlib.sha256(f"llmgw idempotency\n{person}\n{key}".encode()).digest()[:16])
    # UUID version 8 (custom) by hand: Python before 3.12 refuses version=8 in uuid.UUID.
    digest[6] = (digest[6] & 0x0F) | 0x80
    digest[8] = (digest[8] & 0x3F) | 0x80
    return str(uuid.UUID(bytes=bytes(digest)))


async def act(
    store: EventStore,
    token: str,
    service: str,
    verb: str,
    payload: msgspec.Struct,
    *,
    command_id: str | None = None,
    timeout: float = 15.0,
) -> Outcome:
    """Send ``service.verb`` with ``payload`` signed by ``token``'s holder and wait for its outcome.

    Never raises for a refusal, a timeout or an unreachable bus: each is an :class:`Outcome` with its code."""
    kind = f"{service}.{verb}"
    command_id = command_id or new_id()
    try:
        signer = TokenSigner(token)
    except ValueError as exc:
        return Outcome(command=command_id, kind=kind, outcome="refused", message=str(exc), code="unknown_signer")
    client = CommandClient(store, signer)
    try:
        done = await client.send(service, verb, payload, actor="", timeout=timeout, command_id=command_id)
    except CommandRejectedError as exc:
        return Outcome(command=command_id, kind=kind, outcome="refused", message=exc.reason, code=exc.code)
    except CommandTimeoutError as exc:
        return Outcome(command=command_id, kind=kind, outcome="refused", message=str(exc), code="timeout")
    except Unreachable as exc:
        return Outcome(command=command_id, kind=kind, outcome="refused", message=str(exc), code="unavailable")
    if done.kind != kind:  # an Idempotency-Key used before for another command: its outcome is not this one's
        message = (
            f"this Idempotency-Key named a {done.kind} command before (command {command_id}); "
            "use a new key for a new command"
        )
        return Outcome(command=command_id, kind=kind, outcome="refused", message=message, code="conflict")
    return Outcome(
        command=command_id,
        kind=kind,
        outcome="applied",
        message=done.message,
        events=list(done.events),
        result=dict(done.result),
    )
