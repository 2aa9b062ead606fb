"""Replay snapshots (SPEC EVT-2): the replayed projections' tables saved as a series, so that
``events replay --until T`` starts from the newest one at or before T and folds only the tail.

A replay folds the tenancy, fleet and access projections (:func:`replay_projections`) into a
scratch SQLite database. From 0 that costs the whole history. The process that runs the live
projections already holds those tables, folded: every :data:`EVERY_EVENTS` events its
:class:`ReplaySnapshotter` copies their rows, with each projection's checkpoint, in one read-only
transaction (so rows and checkpoints agree), into a SQLite file laid out as a replay's scratch
database is, and saves the file (deflated) in the ``llmgw_snapshots`` object store as
``replay-<position:012d>``. A replay from it writes the file back and opens it: nothing is
inserted row by row on the replay's path (at a million events that took longer than the tail).
The position is the highest of the three checkpoints; a projection behind it folds its own tail
from its own checkpoint, so the three never have to stand still together.

Unlike a router's snapshot (one object, replaced), these are a series, because a replay asks for
any moment: the newest :data:`KEEP_NEWEST`, and older ones thinned the older they are
(:func:`to_keep`), so their number grows with the log's length only logarithmically.

A snapshot is a shortcut only: one of another format or projection version, one that does not
decode or whose tables are not the ones the code makes, or one whose position is stamped with
another time on the log than it recorded (the log was deleted and begun again) is ignored,
logged, and the replay folds from 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
import tempfile
import zlib
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import structlog

from llmgw.events.runtime.snapshots import SnapshotStore
from llmgw.events.runtime.store import EventStore
from llmgw.projections.access import AccessProjection
from llmgw.projections.apply import CHECKPOINTS, table_ddl
from llmgw.projections.backends import Backend, Transaction
from llmgw.projections.base import Projection
from llmgw.projections.fleet import FleetProjection
from llmgw.projections.replay import stamp_of
from llmgw.projections.tenancy import TenancyProjection

log = structlog.get_logger("llmgw.projections.replay_snapshots")

PREFIX = "replay-"
FORMAT = 1  # of ReplayState and its database's wrapping; the projections' own versions are checked one by one
EVERY_EVENTS = 10_000  # a tail of at most this many events, plus a load, fits in 5 s at a million events
KEEP_NEWEST = 50  # at 10,000 events apart: the last 500,000 events, each a tail of at most 10,000
PAGE_ROWS = 20_000  # rows read from the live database at a time while saving: bounds the saver's memory
CHUNK_BYTES = 1 << 20  # the database file is deflated and inflated in pieces of this size


def replay_projections() -> list[Projection]:
    """The projections a replay folds (nodes, models, replicas, the tenancy tree, keys)."""
    return [TenancyProjection(), FleetProjection(), AccessProjection()]


class ProjectionAt(msgspec.Struct, frozen=True, array_like=True):
    name: str
    version: int
    checkpoint: int  # every event on its subject up to here is in the database's tables, none after


class ReplayState(msgspec.Struct, frozen=True, kw_only=True):
    position: int  # the highest checkpoint: the snapshot serves a replay to this position or later
    recorded: datetime | None  # the time the log stamped on the event at ``position``
    projections: list[ProjectionAt]
    database: bytes  # a SQLite file holding the projections' tables, deflated


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
    return msgspec.msgpack.encode(state)


def decode_state(data: bytes) -> ReplayState:
    return _state_decoder.decode(data)


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


# -- the database file ----------------------------------------------------------------------------


def _create_database(path: Path, projections: Sequence[Projection]) -> tuple[sqlite3.Connection, list[str]]:
    """A new SQLite file with the projections' tables (their indexes are returned, to make after the rows)."""
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode = OFF")  # a file being written, then copied: nothing to recover
    db.execute("PRAGMA synchronous = OFF")
    db.execute("BEGIN")
    indexes: list[str] = []
    for p in projections:
        for logical in p.tables:
            table, *more = table_ddl(p, logical)
            db.execute(table)
            indexes.extend(more)
    return db, indexes


def _insert(db: sqlite3.Connection, table: str, columns: list[str], rows: list[Any]) -> None:
    names = ", ".join(f'"{c}"' for c in columns)
    db.executemany(f"INSERT INTO {table} ({names}) VALUES ({', '.join('?' for _ in columns)})", rows)


def _finish(db: sqlite3.Connection, indexes: list[str]) -> None:
    try:
        for statement in indexes:
            db.execute(statement)
        db.execute("COMMIT")
    finally:
        db.close()


def _deflate(path: Path) -> bytes:
    packer = zlib.compressobj(1)  # the fastest level: ids and timestamps shrink about sevenfold even so
    parts = []
    with path.open("rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            parts.append(packer.compress(chunk))
    parts.append(packer.flush())
    return b"".join(parts)


def _inflate(data: bytes, path: Path, projections: Sequence[Projection]) -> None:
    """Write the snapshot's database to ``path`` and check its tables are the ones this code makes."""
    unpacker = zlib.decompressobj()
    with path.open("wb") as f:
        for at in range(0, len(data), CHUNK_BYTES):
            f.write(unpacker.decompress(data[at : at + CHUNK_BYTES]))
        f.write(unpacker.flush())
    if not unpacker.eof:
        raise ValueError("the database is cut short")
    expected = sqlite3.connect(":memory:")
    found = sqlite3.connect(path)
    try:
        for p in projections:
            for logical in p.tables:
                table = p.table_name(logical)
                for statement in table_ddl(p, logical)[:1]:
                    expected.execute(statement)
                want = [r[1] for r in expected.execute(f'PRAGMA table_info("{table}")')]
                have = [r[1] for r in found.execute(f'PRAGMA table_info("{table}")')]
                if have != want:
                    raise ValueError(f"table {table} has columns {have}, not {want}")
    finally:
        expected.close()
        found.close()


# -- saving ---------------------------------------------------------------------------------------


async def dump(
    store: EventStore, backend: Backend, projections: Sequence[Projection], path: Path
) -> ReplayState | None:
    """The projections' tables and checkpoints as one consistent state, copied into a new SQLite file
    at ``path`` and deflated; None when one of them has not folded anything yet or runs another
    version (a rebuild under way). The copying runs in threads; the live database is read in pages."""
    at: list[ProjectionAt] = []
    # One thread for every use of the new file's connection, in order: a save cancelled while a page
    # is being inserted (the service stopping) must not finish or close the connection beside it.
    one = ThreadPoolExecutor(max_workers=1, thread_name_prefix="replay-snapshot")
    loop = asyncio.get_running_loop()
    try:
        db, indexes = await loop.run_in_executor(one, _create_database, path, projections)
        try:
            async with backend.snapshot() as tx:
                for p in projections:
                    row = await tx.fetchone(f"SELECT position, version FROM {CHECKPOINTS} WHERE name = ?", p.name)
                    if row is None or int(row[1]) != p.version:
                        return None
                    for logical in p.tables:
                        table = p.table_name(logical)
                        columns = await tx.columns(table)
                        async for rows in _pages(tx, table, columns, list(p.primary_keys[logical])):
                            await loop.run_in_executor(one, _insert, db, table, columns, rows)
                    at.append(ProjectionAt(p.name, p.version, int(row[0])))
        finally:
            done = indexes if len(at) == len(projections) else []
            await asyncio.shield(loop.run_in_executor(one, _finish, db, done))
    finally:
        one.shutdown(wait=False)
    position = max(a.checkpoint for a in at)
    if position <= 0:
        return None
    database = await asyncio.to_thread(_deflate, path)  # zlib lets go of the interpreter while it works
    return ReplayState(position=position, recorded=await stamp_of(store, position), projections=at, database=database)


async def _pages(tx: Transaction, table: str, columns: list[str], keys: list[str]) -> Any:
    """The table's rows in pages of :data:`PAGE_ROWS`, in key order (each page starts after the last key)."""
    names = ", ".join(f'"{c}"' for c in columns)
    order = ", ".join(f'"{k}"' for k in keys)
    at = [columns.index(k) for k in keys]
    marks = ", ".join("?" for _ in keys)
    first = f"SELECT {names} FROM {table} ORDER BY {order} LIMIT {PAGE_ROWS}"
    after = f"SELECT {names} FROM {table} WHERE ({order}) > ({marks}) ORDER BY {order} LIMIT {PAGE_ROWS}"
    rows = await tx.fetchall(first)
    while rows:
        yield rows
        if len(rows) < PAGE_ROWS:
            return
        rows = await tx.fetchall(after, *(rows[-1][i] for i in at))


class ReplaySnapshotter:
    """Saves a replay snapshot of the live projections every ``every`` events, and thins the series.

    :meth:`folded` is the projection runner's ``on_batch`` (a projection's name and new checkpoint).
    The copying, deflating and writing run in one task at a time, beside the runner (the copy reads
    a read-only transaction of its own, so the runner goes on meanwhile): while a save is under way
    no other starts, so one that takes long spaces the next out. The first call learns from the
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
        self.names = {p.name for p in self.projections}
        self.every = every
        self.newest = newest
        self._open_store = open_store or (lambda: SnapshotStore.open(store.js))
        self._snapshots: SnapshotStore | None = None
        self.positions: dict[str, int] = {}
        self.saved_at: int | None = None  # the newest snapshot's position; None until the store is asked
        self.saves = 0
        self.last_bytes = 0
        self.last_copy_s = 0.0
        self.last_save_s = 0.0
        self._task: asyncio.Task[None] | None = None

    def folded(self, name: str, position: int) -> None:
        if name not in self.names:
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
        with tempfile.TemporaryDirectory(prefix="llmgw-replay-snapshot-") as tmp:
            state = await dump(self.store, self.backend, self.projections, Path(tmp) / "replay.db")
        self.last_copy_s = loop.time() - started
        if state is None or state.position <= (self.saved_at or 0):
            return
        # Level 0: the database in the state is deflated already; a second deflate gained 15% and cost a
        # replay 0.1 s of inflating (16 MB at a million events), and each save 0.3 s more.
        self.last_bytes = await snapshots.save(
            snapshot_name(state.position), FORMAT, state.position, encode_state(state), level=0
        )
        self.last_save_s = loop.time() - started
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
    store: EventStore, path: Path, position: int, projections: Sequence[Projection]
) -> ReplayStart | None:
    """Write to ``path`` the database of the newest replay snapshot at or before ``position`` and return
    where each projection goes on from; None (and no file) when there is none to trust."""
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
        state = decode_state(found[1])
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning(
            "a replay snapshot that does not decode is ignored; replaying from 0", snapshot=name, error=f"{exc}"
        )
        return None
    reason = await _untrusted(store, state, projections)
    if reason is not None:
        log.warning(f"a replay snapshot {reason} is ignored; replaying from 0", snapshot=name)
        return None
    try:
        await asyncio.to_thread(_inflate, state.database, path, projections)
    except (zlib.error, sqlite3.DatabaseError, ValueError, OSError) as exc:
        log.warning(
            "a replay snapshot whose database does not load is ignored; replaying from 0", snapshot=name, error=str(exc)
        )
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return ReplayStart(
        position=state.position,
        recorded=state.recorded,
        after={a.name: a.checkpoint for a in state.projections},
    )


async def _untrusted(store: EventStore, state: ReplayState, projections: Sequence[Projection]) -> str | None:
    """Why ``state`` cannot be trusted for this log and these projections; None when it can."""
    versions = {a.name: a.version for a in state.projections}
    if versions != {p.name: p.version for p in projections}:
        return f"of other projection versions ({versions})"
    if state.recorded is None or await stamp_of(store, state.position) != state.recorded:
        return "of another log (its position is stamped otherwise now)"
    return None


__all__ = [
    "EVERY_EVENTS",
    "FORMAT",
    "KEEP_NEWEST",
    "PREFIX",
    "ProjectionAt",
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
