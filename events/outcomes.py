"""Command outcomes: exactly one per command, on ``llmgw.evt.command.<command id>``."""

from __future__ import annotations

from typing import Any

import msgspec

from llmgw.events.registry import EventType

AGGREGATE = "command"


class CommandCompleted(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    requested_by: str = ""
    message: str
    events: list[str] = []
    last_seq: int = 0
    result: dict[str, Any] = {}


class CommandRejected(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    requested_by: str = ""
    reason: str
    code: str = "rejected"


EVENTS = (
    EventType("command.completed", 1, CommandCompleted, "A command was carried out; names the events it wrote."),
    EventType("command.rejected", 1, CommandRejected, "A command was refused, with a reason a person can act on."),
)
