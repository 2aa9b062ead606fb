"""What a projection is: a name, the subject it reads, its tables, and one short handler per event type.

A projection's SQL is one dialect subset that SQLite and PostgreSQL both run (``INSERT … ON
CONFLICT``), with ``?`` placeholders and table names written as ``{table}`` (the logical name in
braces). The backend renders table names — live or shadow — and placeholders, so the same
projection code fills the live tables and a rebuild's shadow.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, ClassVar, Protocol

from llmgw.events.schema.codec import decode_event
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.registry import EventRegistry
from llmgw.events.schema.subjects import STREAM_EVENTS

Row = tuple[Any, ...]


class Tx(Protocol):
    """One transaction of a backend, as a projection sees it."""

    async def execute(self, sql: str, *args: Any) -> None: ...

    async def fetchone(self, sql: str, *args: Any) -> Row | None: ...

    async def fetchall(self, sql: str, *args: Any) -> list[Row]: ...


Handler = Callable[[Tx, RecordedEvent], Awaitable[None]]


class Projection:
    """Subclass with ``name``, ``subject``, ``tables`` and ``handlers``.

    ``subject`` is read from ``stream`` (the event log unless a projection says otherwise, e.g. the
    usage stream); :meth:`decode` turns each message there into a :class:`RecordedEvent`.

    ``tables`` maps a logical table name to its column definitions (the part inside
    ``CREATE TABLE x (...)``), ``primary_keys`` names each table's key columns (verify sorts
    and diffs rows by them), and ``handlers`` maps an event type to a method name. Event types
    without a handler, and events whose type this reader does not know, are skipped.
    """

    name: ClassVar[str]
    subject: ClassVar[str]
    stream: ClassVar[str] = STREAM_EVENTS
    version: ClassVar[int] = 1
    tables: ClassVar[dict[str, str]]
    primary_keys: ClassVar[dict[str, Sequence[str]]]
    indexes: ClassVar[dict[str, Sequence[str]]] = {}  # table -> column lists, e.g. ["org_id"]
    handlers: ClassVar[dict[str, str]]

    def decode(self, registry: EventRegistry, data: bytes, subject: str, seq: int) -> RecordedEvent:
        """One message of ``stream`` as an event; raises ``EventDecodeError`` for bytes to quarantine.

        The event log's envelope by default; a projection of a stream with another format overrides it.
        """
        return decode_event(registry, data, subject, seq)

    async def apply(self, tx: Tx, event: RecordedEvent) -> None:
        if not event.known:
            return
        method = self.handlers.get(event.type)
        if method is not None:
            await getattr(self, method)(tx, event)

    async def apply_batch(self, tx: Tx, events: Sequence[RecordedEvent]) -> None:
        """Apply a batch in log order, exactly as :meth:`apply` one event at a time would.

        Override only to save round trips (fold many events into a few statements): the runner
        calls it with a whole batch on the first try and falls back to :meth:`apply` event by
        event when that fails, to name the failing event.
        """
        for event in events:
            await self.apply(tx, event)

    def table_name(self, logical: str, shadow: bool = False) -> str:
        """The physical table: the projection's name prefixes it; a shadow adds ``__shadow``."""
        return f"{self.name}_{logical}" + ("__shadow" if shadow else "")
