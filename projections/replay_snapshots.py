"""Replay snapshots (SPEC EVT-2): the replayed projections' rows saved as a series, so that
``events replay --until T`` starts from the newest one at or before T and folds only the tail.

A replay folds the tenancy, fleet and access projections (:func:`replay_projections`) into a
scratch database. From 0 that costs the whole history (about 40 s per million events). The
process that runs the live projections already holds those rows, folded: every :data:`EVERY_EVENTS`
events its :class:`ReplaySnapshotter` reads them, with each projection's checkpoint, in one
read-only transaction (so rows and checkpoints agree), and saves them in the ``llmgw_snapshots``
object store as ``replay-<position:012d>``. The position is the highest of the three checkpoints;
a projection behind it folds its own tail from its own checkpoint, so the series never needs the
three to stand still together.

Unlike a router's snapshot (one object, replaced), these are a series, because a replay asks
for any moment: the newest :data:`KEEP_NEWEST`, and older ones thinned the older they are
(:func:`to_keep`), so their number grows with the log's length only logarithmically.

A snapshot is a shortcut only: one of another format or projection version, one that does not
decode or load, or one whose position is stamped with another time on the log than it recorded
(the log was deleted and begun again) is ignored, logged, and the replay folds from 0.
"""

from __future__ import annotations

import asyncio
import gc
import zlib
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

import msgspec
import structlog

from llmgw.events.snapshots import SnapshotStore
from llmgw.events.store import EventStore
from llmgw.projections.access import AccessProjection
from llmgw.projections.backends import Backend
from llmgw.projections.base import Projection
from llmgw.projections.fleet import FleetProjection
from llmgw.projections.fold import CHECKPOINTS, create_tables, drop_tables
from llmgw.projections.replay import stamp_of
from llmgw.projections.tenancy import TenancyProjection

log = structlog.get_logger("llmgw.projections.replay_snapshots")

PREFIX = "replay-"
FORMAT = 1  # of ReplayState and its wrapping; the projections' own versions are checked one by one
EVERY_EVENTS = 50_000  # a tail of at most this many events, plus a load, fits in 5 s at a million events
KEEP_NEWEST = 20


def replay_projections() -> list[Projection]:
    """The projections a replay folds (nodes, models, replicas, the tenancy tree, keys)."""
    return [TenancyProjection(), FleetProjection(), AccessProjection()]


class TableRows(msgspec.Struct, frozen=True, array_like=True):
    table: str  # the logical name
    columns: list[str]
    rows: list[tuple[Any, ...]]


class ProjectionRows(msgspec.Struct, frozen=True, array_like=True):
    name: str
    version: int
    checkpoint: int  # every event on its subject up to here is in ``tables``, none after
    tables: list[TableRows]


class ReplayState(msgspec.Struct, frozen=True, kw_only=True):
    position: int  # the highest checkpoint: the snapshot serves a replay to this position or later
    recorded: datetime | None  # the time the log stamped on the event at ``position``
    projections: list[ProjectionRows]


class ReplayStart(msgspec.Struct, frozen=True, kw_only=True):
    """What a replay started from: a snapshot's position and time, and each projection's checkpoint."""

    position: int
    recorded: datetime | None
    after: dict[str, int]


_state_decoder = msgspec.msgpack.Decoder(ReplayState)


def snapshot_name(position: int) -> str:
    return f"{PREFIX}{position:012d}"


def position_of(name: str) -> int | None:
    """The position a replay snapshot's name carries; None for any other name."""
    digits = name.removeprefix(PREFIX)
    return int(digits) if name.startswith(PREFIX) and digits.isdigit() else None


def encode_state(state: ReplayState) -> bytes:
    """msgpack, deflated (rows of ids and timestamps shrink about tenfold, and the object store reads
    at some 30 MB/s), as one msgpack ``bin``: a snapshot's state must itself be msgpack."""
    return msgspec.msgpack.encode(zlib.compress(msgspec.msgpack.encode(state), 1))


def decode_state(data: bytes) -> ReplayState:
    raw = zlib.decompress(msgspec.msgpack.decode(data, type=bytes))
    collecting = gc.isenabled()
    gc.disable()  # hundreds of thousands of rows that all live on: collections meanwhile only cost
    try:
        return _state_decoder.decode(raw)
    finally:
        if collecting:
            gc.enable()


def newest_at_or_before(positions: Iterable[int], position: int) -> int | None:
    """The snapshot a replay to ``position`` starts from: the newest at or before it. Pure."""
    return max((p for p in positions if 0 < p <= position), default=None)


def to_keep(positions: Iterable[int], *, every: int, newest: int = KEEP_NEWEST) -> set[int]:
    """Which snapshots to keep: the ``newest``, then, by age (from the newest position), the oldest
    snapshot in each bucket of ``every · 2^k`` events, where k is 1 for ages under ``2 · newest · every``,
    2 under twice that, and so on: about ``newest / 2`` more per doubling of the history. Pure.

    Buckets are aligned at 0, so each is half of the next size up: a snapshot deleted is never one an
    older bucket would keep later, and the series thins without gaps opening where it keeps one.
    """
    ordered = sorted(set(positions), reverse=True)
    keep = set(ordered[:newest])
    if len(ordered) <= newest:
        return keep
    head = ordered[0]
    oldest: dict[tuple[int, int], int] = {}
    span = max(1, every * newest)
    for p in ordered[newest:]:
        tier = max(1, ((head - p) // span).bit_length())
        size = every << tier
        oldest[(tier, p // size)] = p  # descending order: the last one written is the bucket's oldest
    return keep | set(oldest.values())


# -- saving ---------------------------------------------------------------------------------------


async def dump(store: EventStore, backend: Backend, projections: Sequence[Projection]) -> ReplayState | None:
    """The projections' rows and checkpoints as one consistent state; None when one of them has not
    folded anything yet or runs another version (a rebuild under way)."""
    found: list[ProjectionRows] = []
    async with backend.snapshot() as tx:
        for p in projections:
            row = await tx.fetchone(f"SELECT position, version FROM {CHECKPOINTS} WHERE name = ?", p.name)
            if row is None or int(row[1]) != p.version:
                return None
            tables = []
            for logical in p.tables:
                physical = p.table_name(logical)
                columns = await tx.columns(physical)
                quoted = ", ".join(f'"{c}"' for c in columns)
                tables.append(TableRows(logical, columns, await tx.fetchall(f"SELECT {quoted} FROM {physical}")))
            found.append(ProjectionRows(p.name, p.version, int(row[0]), tables))
    position = max(r.checkpoint for r in found)
    if position <= 0:
        return None
    return ReplayState(position=position, recorded=await stamp_of(store, position), projections=found)


class ReplaySnapshotter:
    """Saves a replay snapshot of the live projections every ``every`` events, and thins the series.

    :meth:`folded` is the projection runner's ``on_batch`` (a projection's name and new checkpoint).
    The reading, encoding and writing run in one task at a time, beside the runner: the read is a
    read-only transaction of its own, so the runner goes on meanwhile. The first call learns from the
    store where the newest saved snapshot is, so a restart does not save again at once.
    """

    def __init__(
        self,
        store: EventStore,
        backend: Backend,
        *,
        projections: Sequence[Projection] | None = None,
        every: int = EVERY_EVENTS,
        newest: int = KEEP_NEWEST,
        open_store: Callable[[], Any] | None = None,
    ) -> None:
        self.store = store
        self.backend = backend
        self.projections = list(projections) if projections is not None else replay_projections()
        self.every = every
        self.newest = newest
        self._open_store = open_store or (lambda: SnapshotStore.open(store.js))
        self._snapshots: SnapshotStore | None = None
        self.positions: dict[str, int] = {}
        self.saved_at: int | None = None  # the newest snapshot's position; None until the store is asked
        self.saves = 0
        self.last_bytes = 0
        self.last_dump_s = 0.0
        self.last_encode_s = 0.0
        self._task: asyncio.Task[None] | None = None

    def folded(self, name: str, position: int) -> None:
        if name not in {p.name for p in self.projections}:
            return
        self.positions[name] = max(position, self.positions.get(name, 0))
        if self._task is not None and not self._task.done():
            return  # one at a time; the next batch asks again
        if not self._due():
            return  # also before the store is asked: a log shorter than ``every`` costs NATS nothing
        self._task = asyncio.create_task(self._save_if_due(), name="replay-snapshot")

    def _due(self) -> bool:
        return max(self.positions.values(), default=0) - (self.saved_at or 0) >= self.every

    async def _save_if_due(self) -> None:
        try:
            if self._snapshots is None:
                self._snapshots = await self._open_store()
            if self.saved_at is None:
                names = await self._snapshots.names(PREFIX)
                self.saved_at = max((position_of(n) or 0 for n in names), default=0)
            if self._due():
                await self._save(self._snapshots)
        except Exception as exc:  # a shortcut only: a failed save costs replays time, never the projections
            self.saved_at = max(self.saved_at or 0, *self.positions.values())  # try again ``every`` events on
            log.warning("a replay snapshot could not be saved; the next is tried later", error=str(exc))

    async def _save(self, snapshots: SnapshotStore) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        state = await dump(self.store, self.backend, self.projections)
        self.last_dump_s = loop.time() - started
        if state is None or state.position <= (self.saved_at or 0):
            return
        started = loop.time()
        data = await asyncio.to_thread(encode_state, state)  # deflating lets go of the interpreter
        self.last_encode_s = loop.time() - started
        self.last_bytes = await snapshots.save(snapshot_name(state.position), FORMAT, state.position, data)
        self.saved_at = state.position
        self.saves += 1
        log.info("replay snapshot saved", position=state.position, bytes=self.last_bytes)
        await self._thin(snapshots)

    async def _thin(self, snapshots: SnapshotStore) -> None:
        saved = {p: n for n in await snapshots.names(PREFIX) if (p := position_of(n)) is not None}
        keep = to_keep(saved, every=self.every, newest=self.newest)
        for position, name in sorted(saved.items()):
            if position not in keep:
                await snapshots.delete(name)

    async def flush(self) -> None:
        """Until the save under way (if any) is done."""
        if self._task is not None:
            await asyncio.shield(self._task)

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})


# -- starting a replay from one -------------------------------------------------------------------


async def start_from_snapshot(
    store: EventStore, backend: Backend, position: int, projections: Sequence[Projection]
) -> ReplayStart | None:
    """Load into ``backend`` (a fresh scratch database) the newest replay snapshot at or before ``position``
    and return where each projection goes on from; None (tables left empty) when there is none to trust."""
    try:
        snapshots = await SnapshotStore.open(store.js)
        saved = {p: n for n in await snapshots.names(PREFIX) if (p := position_of(n)) is not None}
    except Exception as exc:
        log.warning("replay snapshots are not available; replaying from 0", error=str(exc))
        return None
    chosen = newest_at_or_before(saved, position)
    if chosen is None:
        return None
    name = saved[chosen]
    found = await snapshots.load(name, FORMAT)  # None (logged there): another format, or bytes that do not decode
    if found is None:
        return None
    try:
        state = await asyncio.to_thread(decode_state, found[1])
    except (msgspec.DecodeError, msgspec.ValidationError, zlib.error) as exc:
        log.warning(
            "a replay snapshot that does not decode is ignored; replaying from 0", snapshot=name, error=f"{exc}"
        )
        return None
    reason = await _untrusted(store, state, projections)
    if reason is not None:
        log.warning(f"a replay snapshot {reason} is ignored; replaying from 0", snapshot=name)
        return None
    try:
        await _load_rows(backend, state, projections)
    except Exception as exc:
        log.warning("a replay snapshot that does not load is ignored; replaying from 0", snapshot=name, error=str(exc))
        for p in projections:
            async with backend.transaction(p) as tx:
                await drop_tables(tx, p)
        return None
    return ReplayStart(
        position=state.position,
        recorded=state.recorded,
        after={r.name: r.checkpoint for r in state.projections},
    )


async def _untrusted(store: EventStore, state: ReplayState, projections: Sequence[Projection]) -> str | None:
    """Why ``state`` cannot be trusted for this log and these projections; None when it can."""
    versions = {r.name: r.version for r in state.projections}
    if versions != {p.name: p.version for p in projections}:
        return f"of other projection versions ({versions})"
    if state.recorded is None or await stamp_of(store, state.position) != state.recorded:
        return "of another log (its position is stamped otherwise now)"
    return None


async def _load_rows(backend: Backend, state: ReplayState, projections: Sequence[Projection]) -> None:
    by_name = {r.name: r for r in state.projections}
    for p in projections:
        async with backend.transaction(p) as tx:
            await create_tables(tx, p)
            for t in by_name[p.name].tables:
                columns = ", ".join(f'"{c}"' for c in t.columns)
                marks = ", ".join("?" for _ in t.columns)
                await tx.executemany(f"INSERT INTO {{{t.table}}} ({columns}) VALUES ({marks})", t.rows)


__all__ = [
    "EVERY_EVENTS",
    "FORMAT",
    "KEEP_NEWEST",
    "PREFIX",
    "ReplaySnapshotter",
    "ReplayStart",
    "ReplayState",
    "decode_state",
    "dump",
    "encode_state",
    "newest_at_or_before",
    "position_of",
    "replay_projections",
    "snapshot_name",
    "start_from_snapshot",
    "to_keep",
]
