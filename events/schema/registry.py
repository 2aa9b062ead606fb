"""The registry of event payload types by wire name and schema version, with upcasters.

Payloads are frozen msgspec Structs listed explicitly by each aggregate module (``EVENTS``).
Decoding is by ``(type, v)``: an unknown type or a version newer than this reader knows stays
raw (:class:`UnknownPayload`) so folds skip it, instead of failing the way a tagged union would.
An older version is lifted to the current one by a chain of upcasters (v1→v2→v3) on plain dicts,
so folds only ever see current shapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from llmgw.events.schema.envelope import UnknownPayload

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]


class EventType(msgspec.Struct, frozen=True):
    """One registered payload: its wire name, current version and Struct."""

    name: str
    v: int
    struct: type[msgspec.Struct]
    doc: str = ""


class PayloadDecodeError(ValueError):
    """A payload whose type is known but whose bytes do not fit its schema."""


class EventRegistry:
    def __init__(self, types: Iterable[EventType] = ()) -> None:
        self._by_name: dict[str, EventType] = {}
        self._by_struct: dict[type, EventType] = {}
        self._decoders: dict[str, msgspec.json.Decoder] = {}
        self._upcasters: dict[tuple[str, int], Upcaster] = {}
        for t in types:
            self.add(t)

    def add(self, event_type: EventType) -> None:
        if event_type.name in self._by_name:
            raise ValueError(f"event type {event_type.name!r} is registered twice")
        self._by_name[event_type.name] = event_type
        self._by_struct[event_type.struct] = event_type
        self._decoders[event_type.name] = msgspec.json.Decoder(event_type.struct)

    def add_upcaster(self, name: str, from_v: int, fn: Upcaster) -> None:
        """``fn`` turns a version ``from_v`` payload (as a dict) into a version ``from_v + 1`` one."""
        self._upcasters[(name, from_v)] = fn

    def type_of(self, payload: msgspec.Struct) -> EventType:
        try:
            return self._by_struct[type(payload)]
        except KeyError:
            raise ValueError(f"{type(payload).__name__} is not a registered event payload") from None

    def get(self, name: str) -> EventType | None:
        return self._by_name.get(name)

    def names(self) -> list[str]:
        return sorted(self._by_name)

    def types(self) -> list[EventType]:
        return [self._by_name[n] for n in self.names()]

    def reads(self, type_at_version: str) -> bool:
        """Whether events of ``"type@v"`` decode here (known type, version not newer than this one's)."""
        name, _, v = type_at_version.rpartition("@")
        event_type = self._by_name.get(name)
        return event_type is not None and v.isdigit() and int(v) <= event_type.v

    def decode(self, name: str, v: int, raw: bytes) -> msgspec.Struct:
        """The payload as its current Struct, or :class:`UnknownPayload` when unknown or newer."""
        event_type = self._by_name.get(name)
        if event_type is None or v > event_type.v:
            return UnknownPayload(bytes(raw))
        try:
            if v == event_type.v:
                return self._decoders[name].decode(raw)
            data = msgspec.json.decode(raw)
            for step in range(v, event_type.v):
                upcaster = self._upcasters.get((name, step))
                if upcaster is None:
                    raise PayloadDecodeError(f"no upcaster for {name} v{step} → v{step + 1}")
                data = upcaster(data)
            return msgspec.convert(data, event_type.struct)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            raise PayloadDecodeError(f"{name} v{v}: {exc}") from exc
