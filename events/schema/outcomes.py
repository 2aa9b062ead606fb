"""Command outcomes: exactly one per command, on ``llmgw.evt.command.<command id>``.

Each outcome keeps the command as it was received (``command``: its exact bytes, signature
included) and the key that signed it, so the log is evidence of who asked: `llmgw events verify`
checks every one again. A command id sent a second time (a replay, not a redelivery) gets no
second outcome; a ``command.replayed`` refusal on ``llmgw.evt.refusal.<id>`` says it was refused.
"""

from __future__ import annotations

from typing import Any

import msgspec

from llmgw.events.schema.registry import EventType

AGGREGATE = "command"


class Rejected(Exception):
    """Raised by a service's decision, or its check of who sent the command: the command is refused
    with this reason (its ``command.rejected`` outcome)."""

    def __init__(self, reason: str, code: str = "rejected") -> None:
        self.reason = reason
        self.code = code
        super().__init__(reason)


class CommandCompleted(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    requested_by: str = ""
    message: str
    events: list[str] = []
    last_seq: int = 0
    result: dict[str, Any] = {}
    signer: str = ""  # the key that signed the command (token:<prefix>, svc:<name>)
    command_seq: int = 0  # the command's sequence on the command stream
    command: msgspec.Raw = msgspec.Raw(b"null")  # the command's bytes as received (null: from before they were kept)


class CommandRejected(msgspec.Struct, frozen=True, kw_only=True):
    kind: str
    requested_by: str = ""
    reason: str
    code: str = "rejected"
    signer: str = ""
    command_seq: int = 0
    command: msgspec.Raw = msgspec.Raw(b"null")


REFUSAL_AGGREGATE = "refusal"


class CommandReplayed(msgspec.Struct, frozen=True, kw_only=True):
    """A command id that had its outcome already arrived again as a new message: nothing was done."""

    command_id: str
    kind: str
    requested_by: str = ""
    signer: str = ""
    first_seq: int  # the command stream sequence the id was first handled at
    replay_seq: int


EVENTS = (
    EventType("command.completed", 1, CommandCompleted, "A command was carried out; names the events it wrote."),
    EventType("command.rejected", 1, CommandRejected, "A command was refused, with a reason a person can act on."),
    EventType(
        "command.replayed",
        1,
        CommandReplayed,
        "A command id already handled was sent again (a replay); refused, nothing applied.",
    ),
)
