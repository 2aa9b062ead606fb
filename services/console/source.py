"""What a console page reads: the read models now, or as they were at a moment (the time slider).

Now is the live projections, read once they have caught up with the log (as the admin API's views are).
A past moment is the replay behind ``GET /api/v1/replay`` (services/api/replay.py): the fleet, access and
tenancy projections folded into a scratch database up to the last event at or before the moment; the
people and the tree are folded from their events up to that event. What the replay does not hold (usage
rollups, the event log's index, the mirror) a page reads live and bounds by :attr:`Source.at` or
:attr:`Source.position` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

from llmgw.events.folds.people import People
from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import people as P
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, event_subject
from llmgw.projections.access import tenancy_paths
from llmgw.projections.backends import Backend
from llmgw.projections.replay import position_at
from llmgw.services.api.replay import Replayed, replayed
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

    async def caught_up(self, projection: str) -> None:
        """Now: wait (bounded) until ``projection`` has read the log as far as the page shows it. The past
        is a replay folded to its position already."""
        if self.live:
            await self.api._caught_up(projection, self.position)

    async def fleet(self, table: str, sql_tail: str = "", *args: Any) -> list[dict[str, Any]]:
        """Rows of the fleet projection (nodes, models, replicas) as dicts of :data:`FLEET_COLUMNS`."""
        await self.caught_up("fleet")
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
            await self.caught_up("access")
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
async def source_at(api: AdminApi, when: datetime, moments: Moments | None = None) -> AsyncIterator[Source]:
    """The read models as they were at ``when``, open while the block lasts: from ``moments`` (kept
    replays) when given, else a scratch database folded for this block alone."""
    if moments is not None:
        moment = await moments.get(when)
        async with moment.using:
            yield Source(api, moment.backend, at=when, position=moment.position)
        return
    async with replayed(api.store, when) as replay:
        yield Source(api, replay.backend, at=when, position=replay.position)


class Moment:
    """One replayed moment kept open: its scratch database, and who is reading it."""

    def __init__(self, replay: Replayed, stack: contextlib.AsyncExitStack) -> None:
        self.backend = replay.backend
        self.position = replay.position
        self.stack = stack
        self.used_at = time.monotonic()
        self.readers = 0
        self.using = _Using(self)


class _Using:
    def __init__(self, moment: Moment) -> None:
        self.moment = moment

    async def __aenter__(self) -> Moment:
        self.moment.readers += 1
        self.moment.used_at = time.monotonic()
        return self.moment

    async def __aexit__(self, *exc: object) -> None:
        self.moment.readers -= 1


class Moments:
    """The last few moments the time slider showed, kept replayed: someone looking at the fleet as it
    was when an incident began goes from page to page at that moment, and each page after the first
    reads the kept replay instead of folding the log again (docs/benchmarks.md, "Console pages at
    scale"). Keyed by the log's position at the moment — two times with no event between them are one
    moment. At most ``size`` are kept, each for ``keep_s`` after it was last read; one is folded at a
    time, so a burst of slider moves costs one replay each, never several at once."""

    def __init__(self, store: EventStore, *, size: int = 2, keep_s: float = 300.0) -> None:
        self.store = store
        self.size = size
        self.keep_s = keep_s
        self._kept: dict[int, Moment] = {}
        self._folding = asyncio.Lock()

    async def get(self, when: datetime) -> Moment:
        position, _ = await position_at(self.store, when)
        async with self._folding:
            found = self._kept.get(position)
            if found is not None:
                found.used_at = time.monotonic()
                return found
            await self._evict(room_for=1)
            stack = contextlib.AsyncExitStack()
            try:
                replay = await stack.enter_async_context(replayed(self.store, when))
            except BaseException:
                await stack.aclose()
                raise
            moment = self._kept[replay.position] = Moment(replay, stack)
            return moment

    async def _evict(self, room_for: int = 0) -> None:
        """Close the moments nobody reads that are stale, and the least recently read beyond the size."""
        now = time.monotonic()
        idle = sorted((m for m in self._kept.values() if m.readers == 0), key=lambda m: m.used_at)
        over = len(self._kept) + room_for - self.size
        for moment in idle:
            if over > 0 or now - moment.used_at > self.keep_s:
                over -= 1
                self._kept.pop(moment.position, None)
                await moment.stack.aclose()

    async def close(self) -> None:
        async with self._folding:
            for moment in list(self._kept.values()):
                await moment.stack.aclose()
            self._kept.clear()


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
