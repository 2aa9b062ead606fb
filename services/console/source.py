"""What a console page reads: the read models now, or as they were at a moment (the time slider).

Now is the live projections, read once they have caught up with the log (as the admin API's views are).
A past moment is the replay behind ``GET /api/v1/replay`` (services/api/replay.py): the fleet, access and
tenancy projections folded into a scratch database up to the last event at or before the moment; the
people and the tree are folded from their events up to that event. What the replay does not hold (usage
rollups, the event log's index, the mirror) a page reads live and bounds by :attr:`Source.at` or
:attr:`Source.position` itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from llmgw.events.folds.people import People
from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.schema import people as P
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, event_subject
from llmgw.projections.access import tenancy_paths
from llmgw.projections.backends import Backend
from llmgw.services.api.replay import replayed
from llmgw.services.api.views import ACCESS_COLUMNS, FLEET_COLUMNS

if TYPE_CHECKING:
    from llmgw.services.api.app import AdminApi


class Source:
    """The read models as of :attr:`at` (None: now)."""

    def __init__(self, api: AdminApi, backend: Backend, *, at: datetime | None, position: int) -> None:
        self.api = api
        self.backend = backend
        self.at = at
        self.position = position  # the last event shown: the log's head now, else the last at or before ``at``
        self._people: People | None = None
        self._tree: TenancyTree | None = None

    @property
    def live(self) -> bool:
        return self.at is None

    async def fleet(self, table: str, sql_tail: str = "", *args: Any) -> list[dict[str, Any]]:
        """Rows of the fleet projection (nodes, models, replicas) as dicts of :data:`FLEET_COLUMNS`."""
        if self.live:
            await self.api._caught_up("fleet", self.position)
        cols = FLEET_COLUMNS[table]
        rows = await self.backend.query("fleet", f"SELECT {', '.join(cols)} FROM {{{table}}} {sql_tail}", *args)
        return [dict(zip(cols, r, strict=True)) for r in rows]

    async def access(
        self, table: str, sql_tail: str = "", *args: Any
    ) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
        """Rows of an access table as dicts, and the tenancy paths (id -> (kind, path)) to name scopes with."""
        if self.live:
            tree_seq = await self.api.store.last_seq(event_subject(T.AGGREGATE, T.TREE_ID))
            await self.api._caught_up("tenancy", tree_seq)
            await self.api._caught_up("access", self.position)
        cols = ACCESS_COLUMNS[table]
        rows = await self.backend.query("access", f"SELECT {', '.join(cols)} FROM {{{table}}} {sql_tail}", *args)
        return [dict(zip(cols, r, strict=True)) for r in rows], await tenancy_paths(self.backend)

    async def people(self) -> People:
        """The people (their roles, tokens, languages) as they were."""
        if self.live and self.api.signin is not None:
            return self.api.signin.people
        if self._people is None:
            people = People()
            await self._fold(f"{EVENTS_ROOT}.{P.AGGREGATE}.>", people.apply)
            self._people = people
        return self._people

    async def tree(self) -> TenancyTree:
        """The tenancy tree as it was."""
        if self.live and self.api.signin is not None:
            return self.api.signin.tree
        if self._tree is None:
            tree = TenancyTree()
            await self._fold(event_subject(T.AGGREGATE, T.TREE_ID), tree.apply)
            self._tree = tree
        return self._tree

    async def _fold(self, subject: str, apply: Callable[[RecordedEvent], None]) -> None:
        """Fold ``subject``'s events up to :attr:`position` (nothing after it: the page shows that moment)."""
        if self.position <= 0:
            return
        async for batch in self.api.store.subscribe(subject, follow=False, until=self.position):
            for event in batch:
                if isinstance(event, RecordedEvent) and event.seq <= self.position:
                    apply(event)


async def live_source(api: AdminApi) -> Source:
    return Source(api, api.backend, at=None, position=await api.store.stream_last_seq())


@contextlib.asynccontextmanager
async def source_at(api: AdminApi, when: datetime) -> AsyncIterator[Source]:
    """The read models as they were at ``when``, open while the block lasts (a scratch database)."""
    async with replayed(api.store, when) as moment:
        yield Source(api, moment.backend, at=when, position=moment.position)


def marked(
    then: Iterable[dict[str, Any]], now: Iterable[dict[str, Any]], key: str = "id", fields: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """The rows as they were, each marked against now: ``_diff`` is ``same``, ``changed`` (``_changed``
    names the fields that differ; all fields compared when ``fields`` is empty) or ``gone`` (not there
    now); the rows there now but not then follow, marked ``added``. Pure."""
    current = {row[key]: row for row in now}
    out: list[dict[str, Any]] = []
    seen = set()
    for row in then:
        seen.add(row[key])
        other = current.get(row[key])
        if other is None:
            out.append({**row, "_diff": "gone", "_changed": []})
            continue
        names = fields or [f for f in row if not f.startswith("_")]
        changed = [f for f in names if row.get(f) != other.get(f)]
        out.append({**row, "_diff": "changed" if changed else "same", "_changed": changed})
    out += [{**row, "_diff": "added", "_changed": []} for k, row in current.items() if k not in seen]
    return out
