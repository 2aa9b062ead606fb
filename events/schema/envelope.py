"""The envelope every event and command travels in, and the actor naming rules."""

from __future__ import annotations

import re
from datetime import UTC, datetime

import msgspec

ACTOR_KINDS = ("user", "svc", "node", "key", "system")
_ACTOR = re.compile(r"^(user|svc|node|key|system):[a-z0-9][a-z0-9._@-]{0,63}$")


class Envelope(msgspec.Struct, frozen=True, kw_only=True):
    """What is on the wire. ``data`` stays raw until the registry decodes it by ``(type, v)``."""

    id: str
    type: str
    v: int = 1
    at: datetime
    actor: str
    causation: str | None = None
    correlation: str | None = None
    data: msgspec.Raw = msgspec.Raw(b"{}")


class UnknownPayload(msgspec.Struct, frozen=True):
    """The payload of an event type (or version) this reader does not know: kept, never folded."""

    raw: bytes


class RecordedEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event as read back from the log: its envelope, its decoded payload and its position."""

    envelope: Envelope
    payload: msgspec.Struct
    subject: str
    seq: int

    @property
    def type(self) -> str:
        return self.envelope.type

    @property
    def id(self) -> str:
        return self.envelope.id

    @property
    def known(self) -> bool:
        return not isinstance(self.payload, UnknownPayload)


def utc_now() -> datetime:
    return datetime.now(UTC)


def sanitize_actor(kind: str, name: str) -> str:
    """``kind:name`` with the name lower-cased, stripped to ``[a-z0-9._@-]`` and cut to 64 characters.

    An actor is never free text: it names who acted, and it ends up in logs, subjects and tables.
    """
    if kind not in ACTOR_KINDS:
        raise ValueError(f"actor kind {kind!r} is not one of {', '.join(ACTOR_KINDS)}")
    cleaned = re.sub(r"[^a-z0-9._@-]+", "-", name.strip().lower()).strip("-._@")[:64]
    return f"{kind}:{cleaned or 'unknown'}"


def is_valid_actor(actor: str) -> bool:
    return bool(_ACTOR.match(actor))
