"""The only code that knows bytes: events and commands to JSON and back (msgspec)."""

from __future__ import annotations

from typing import Any

import msgspec

from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.registry import EventRegistry, PayloadDecodeError

_envelope_decoder = msgspec.json.Decoder(Envelope)
_encoder = msgspec.json.Encoder()


class EventDecodeError(ValueError):
    """Bytes on the log that are not an event this reader can read: quarantined, never folded."""


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def encode_envelope(envelope: Envelope) -> bytes:
    return _encoder.encode(envelope)


def decode_envelope(data: bytes) -> Envelope:
    try:
        return _envelope_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise EventDecodeError(f"not an event envelope: {exc}") from exc


def decode_event(registry: EventRegistry, data: bytes, subject: str, seq: int) -> RecordedEvent:
    """Envelope first, with ``data`` raw; then the payload by ``(type, v)``."""
    envelope = decode_envelope(data)
    try:
        payload = registry.decode(envelope.type, envelope.v, envelope.data)
    except PayloadDecodeError as exc:
        raise EventDecodeError(str(exc)) from exc
    return RecordedEvent(envelope=envelope, payload=payload, subject=subject, seq=seq)
