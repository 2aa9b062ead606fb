"""An index of the log: every event's id, position, type, actor, time, causation and correlation.

`llmgw events show ID` finds an event's position here and its causes and effects (events whose
causation is this one, or this command), then reads the event itself from the stream.
"""

from __future__ import annotations

from typing import Any

from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT
from llmgw.projections.base import Projection, Tx

_INSERT = (
    "INSERT INTO {events} (id, seq, type, subject, actor, at, causation, correlation) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING"
)


def matching(column: str, value: str, kind_marks: str = ":.") -> tuple[str, list[Any]]:
    """The audit's filter on ``column``: a value ending in one of ``kind_marks`` is a family (``user:``,
    ``key.``: every value that starts with it), any other is exact.

    An exact value is served by the ``(column, seq)`` index: newest first, only its own rows. A family
    is deliberately not (``substr`` hides the column from the planner): families are common (most
    events a person caused are ``user:``), and walking the ``seq`` index back from the newest finds a
    page of them at once, where the range over ``(actor, seq)`` would read them all to sort them
    (1.7 s against 0.05 s at a million events, `llmgw bench console`)."""
    if value[-1:] and value[-1] in kind_marks:
        return f"substr({column}, 1, ?) = ?", [len(value), value]
    return f"{column} = ?", [value]


class EventLogProjection(Projection):
    name = "eventlog"
    subject = f"{EVENTS_ROOT}.>"
    tables = {
        "events": "id TEXT PRIMARY KEY, seq BIGINT NOT NULL, type TEXT NOT NULL, subject TEXT NOT NULL, "
        "actor TEXT NOT NULL, at TEXT NOT NULL, causation TEXT, correlation TEXT",
    }
    primary_keys = {"events": ["id"]}
    # (type, seq) and (actor, seq): the audit filtered by one type or one actor, newest first, reads only its
    # own rows (without them SQLite walks the seq index back through every event: 1.7 s at a million).
    indexes = {"events": [["causation"], ["correlation"], ["seq"], ["type", "seq"], ["actor", "seq"]]}
    handlers = {}

    async def apply(self, tx: Tx, event: RecordedEvent) -> None:
        # Every event, known type or not: the index is of the log itself.
        env = event.envelope
        await tx.execute(
            _INSERT,
            env.id,
            event.seq,
            env.type,
            event.subject,
            env.actor,
            env.at.isoformat(),
            env.causation,
            env.correlation,
        )
