"""Rebuild a projection from the log into shadow tables and swap it in; or verify the live tables against one.

Both fold the log into ``<projection>_<table>__shadow`` tables with the projection's own code.

- :func:`rebuild` folds most of the log while the live projection keeps serving, then pauses the
  live runner (if it is in this process), catches the shadow up to the log's end and, in one
  transaction, replaces the live rows with the shadow's and sets the checkpoint to the shadow's
  position. Readers see the old rows or the new ones, never a mix.
- :func:`verify` folds the shadow up to the live checkpoint and diffs the two by primary key,
  reading the live rows and their checkpoint from one consistent snapshot; if the live
  projection moved on meanwhile it catches the shadow up and compares again (a bounded number
  of times; the last try pauses a runner in this process). The shadow is dropped afterwards.

A shadow belongs to one rebuild or verify at a time per backend (in-process lock).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import msgspec
import structlog

from llmgw.events.runtime.store import EventStore
from llmgw.projections.apply import (
    CHECKPOINTS,
    ProjectionError,
    commit_batch,
    create_tables,
    drop_tables,
    ensure_checkpoints,
    read_checkpoint,
    set_checkpoint,
)
from llmgw.projections.backends import Backend, Transaction
from llmgw.projections.base import Projection, Row
from llmgw.projections.reader import read_log

log = structlog.get_logger("llmgw.projections.rebuild")


class LiveRunner(Protocol):
    """What :func:`rebuild` and :func:`verify` need of the live runner in their process
    (:class:`~llmgw.projections.runner.ProjectionRunner`): whether it runs the projection, to hold it
    between batches, and to adopt the swapped-in checkpoint. Named by what it does, not imported: the
    runner imports this module, to rebuild a projection whose version changed."""

    def __contains__(self, name: object) -> bool: ...

    def paused(self, name: str) -> contextlib.AbstractAsyncContextManager[None]: ...

    async def note_checkpoint(self, name: str, position: int) -> None: ...


SWAP_TRIES = 5
VERIFY_TRIES = 5
DIFF_ROWS_MAX = 10_000  # differing rows fetched per side and table; beyond it the report says "truncated"


class _Result(msgspec.Struct, frozen=True):
    """A result that also reads as a mapping of JSON-ready values (``{**result}``, ``result["x"]``)."""

    def keys(self) -> tuple[str, ...]:
        return self.__struct_fields__

    def __getitem__(self, key: str) -> Any:
        if key not in self.__struct_fields__:
            raise KeyError(key)
        return msgspec.to_builtins(getattr(self, key))

    def as_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


class RebuildResult(_Result, frozen=True, kw_only=True):
    projection: str
    position: int  # the checkpoint the swapped-in tables stand at
    events: int  # events folded into the shadow
    seconds: float


class RowChange(msgspec.Struct, frozen=True):
    """A key present on both sides with different values."""

    key: tuple[Any, ...]
    live: tuple[Any, ...]
    rebuilt: tuple[Any, ...]


class TableDiff(msgspec.Struct, frozen=True, kw_only=True):
    """How one live table differs from its rebuild. Rows are tuples in ``columns`` order."""

    columns: tuple[str, ...]
    only_live: list[tuple[Any, ...]] = []
    only_rebuilt: list[tuple[Any, ...]] = []
    changed: list[RowChange] = []
    truncated: bool = False  # more rows differ than were fetched
    note: str | None = None  # e.g. the live table's columns differ from the rebuild's

    @property
    def count(self) -> int:
        return len(self.only_live) + len(self.only_rebuilt) + len(self.changed)


class VerifyResult(_Result, frozen=True, kw_only=True):
    projection: str
    position: int  # both sides were compared at this checkpoint
    identical: bool
    differences: dict[str, TableDiff] = {}  # logical table → how it differs (only tables that do)
    attempts: int = 1

    def lines(self) -> list[str]:
        """A person's reading of the result, one line per differing row."""
        if self.identical:
            return [f"{self.projection}: identical to a rebuild from the log (position {self.position})"]
        out = [f"{self.projection}: DIFFERS from a rebuild from the log (position {self.position})"]
        for table, diff in self.differences.items():
            if diff.note:
                out.append(f"  {table}: {diff.note}")
            out += [f"  {table}: only in live:    {row}" for row in diff.only_live]
            out += [f"  {table}: only in rebuild: {row}" for row in diff.only_rebuilt]
            out += [f"  {table}: key {c.key}: live {c.live} ≠ rebuild {c.rebuilt}" for c in diff.changed]
            if diff.truncated:
                out.append(f"  {table}: … more rows differ than shown")
        return out


# -- rebuild -------------------------------------------------------------------------------------


async def rebuild(
    store: EventStore,
    backend: Backend,
    projection: Projection,
    runner: LiveRunner | None = None,
    *,
    batch_size: int = 2000,
) -> RebuildResult:
    """Fold the whole log into a shadow of ``projection`` and swap it in for the live tables.

    With ``runner`` (the live runner in this process), that projection is paused only for the
    final catch-up and the swap, and adopts the new checkpoint afterwards.
    """
    started = time.monotonic()
    name = projection.name
    store = store.on_stream(projection.stream)  # positions are sequences of the projection's stream
    async with _shadow(backend, projection):
        # Most of the log while the live tables keep serving.
        position = await store.stream_last_seq()
        events = await _fold_shadow(store, backend, projection, 0, position, batch_size)
        async with _paused(runner, name):
            for _ in range(SWAP_TRIES):
                end = await store.stream_last_seq()
                events += await _fold_shadow(store, backend, projection, position, end, batch_size)
                position = max(position, end)
                if await _swap(backend, projection, position):
                    break
            else:
                raise ProjectionError(
                    f"projection {name} kept moving ahead of the rebuild (another process runs it?); "
                    "stop the other runners and try again"
                )
            if runner is not None and name in runner:
                await runner.note_checkpoint(name, position)
    seconds = time.monotonic() - started
    log.info("projection rebuilt", projection=name, position=position, events=events, seconds=round(seconds, 3))
    return RebuildResult(projection=name, position=position, events=events, seconds=seconds)


async def _swap(backend: Backend, projection: Projection, position: int) -> bool:
    """Live rows := shadow rows and checkpoint := ``position``, atomically. False if the live one is ahead."""
    name = projection.name
    async with backend.transaction() as tx:
        # Lock the checkpoint row first: a runner in another process waits for the swap, then finds
        # its position moved and re-reads (SQLite's BEGIN IMMEDIATE already serialises writers).
        await tx.execute_count(f"UPDATE {CHECKPOINTS} SET position = position WHERE name = ?", name)
        live = await read_checkpoint(tx, name)
        if live is not None and live.position > position:
            return False
        if live is None or live.version != projection.version:
            # New code, maybe a new shape: the live tables are re-created from the new DDL.
            await drop_tables(tx, projection)
        await create_tables(tx, projection)
        for logical in projection.tables:
            target, shadow = projection.table_name(logical), projection.table_name(logical, shadow=True)
            columns = ", ".join(await tx.columns(shadow))
            await tx.execute(f"DELETE FROM {target}")
            await tx.execute(f"INSERT INTO {target} ({columns}) SELECT {columns} FROM {shadow}")
        await drop_tables(tx, projection, shadow=True)
        await set_checkpoint(tx, name, position, projection.version)
    return True


# -- verify --------------------------------------------------------------------------------------


async def verify(
    store: EventStore,
    backend: Backend,
    projection: Projection,
    runner: LiveRunner | None = None,
    *,
    batch_size: int = 2000,
    limit: int = 100,
) -> VerifyResult:
    """Fold the log into a shadow up to the live checkpoint and diff it with the live tables.

    ``limit`` caps the rows reported per table and kind of difference. Raises
    :class:`ProjectionError` when the projection has never run on this database.
    """
    name = projection.name
    store = store.on_stream(projection.stream)
    async with _shadow(backend, projection):
        folded = 0
        for attempt in range(1, VERIFY_TRIES + 1):
            # The last try holds the live runner (if it is ours) so the comparison can settle.
            pause = _paused(runner, name) if attempt == VERIFY_TRIES else contextlib.nullcontext()
            async with pause:
                live = await read_checkpoint(backend, name)
                if live is None:
                    raise ProjectionError(f"projection {name} has never run on this database: nothing to verify")
                if live.position < folded:
                    # The live one went back (rebuilt elsewhere); the shadow cannot, so it starts over.
                    await _reset_shadow(backend, projection)
                    folded = 0
                await _fold_shadow(store, backend, projection, folded, live.position, batch_size)
                folded = live.position
                async with backend.snapshot() as snap:
                    seen = await read_checkpoint(snap, name)
                    if seen is not None and seen.position == folded:
                        differences = await _diff(snap, projection, limit)
                        result = VerifyResult(
                            projection=name,
                            position=folded,
                            identical=not differences,
                            differences=differences,
                            attempts=attempt,
                        )
                        log.info("projection verified", projection=name, position=folded, identical=result.identical)
                        return result
        raise ProjectionError(
            f"projection {name} kept moving while being verified ({VERIFY_TRIES} tries); try again when quieter"
        )


async def _diff(snap: Transaction, projection: Projection, limit: int) -> dict[str, TableDiff]:
    out: dict[str, TableDiff] = {}
    for logical in projection.tables:
        live_t, shadow_t = projection.table_name(logical), projection.table_name(logical, shadow=True)
        columns = await snap.columns(shadow_t)
        live_columns = await snap.columns(live_t)
        if live_columns != columns:
            out[logical] = TableDiff(
                columns=tuple(columns), note=f"live columns {live_columns} differ from the rebuild's {columns}"
            )
            continue
        cols = ", ".join(columns)
        cap = f" LIMIT {DIFF_ROWS_MAX + 1}"
        live_rows = await snap.fetchall(f"SELECT {cols} FROM {live_t} EXCEPT SELECT {cols} FROM {shadow_t}{cap}")
        rebuilt_rows = await snap.fetchall(f"SELECT {cols} FROM {shadow_t} EXCEPT SELECT {cols} FROM {live_t}{cap}")
        if not live_rows and not rebuilt_rows:
            continue
        truncated = len(live_rows) > DIFF_ROWS_MAX or len(rebuilt_rows) > DIFF_ROWS_MAX
        key_at = [columns.index(k) for k in projection.primary_keys[logical]]

        def key(row: Row, key_at: list[int] = key_at) -> tuple[Any, ...]:
            return tuple(row[i] for i in key_at)

        live_by_key = {key(r): r for r in live_rows}
        rebuilt_by_key = {key(r): r for r in rebuilt_rows}
        both = _sorted(live_by_key.keys() & rebuilt_by_key.keys())
        changed = [RowChange(k, live_by_key[k], rebuilt_by_key[k]) for k in both]
        only_live = [live_by_key[k] for k in _sorted(live_by_key.keys() - rebuilt_by_key.keys())]
        only_rebuilt = [rebuilt_by_key[k] for k in _sorted(rebuilt_by_key.keys() - live_by_key.keys())]
        truncated = truncated or max(len(changed), len(only_live), len(only_rebuilt)) > limit
        out[logical] = TableDiff(
            columns=tuple(columns),
            only_live=only_live[:limit],
            only_rebuilt=only_rebuilt[:limit],
            changed=changed[:limit],
            truncated=truncated,
        )
    return out


def _sorted(keys: Any) -> list[tuple[Any, ...]]:
    # Keys of one column share a type on PostgreSQL; SQLite may mix them, so sort by type first.
    return sorted(keys, key=lambda k: tuple((v is None, type(v).__name__, v) for v in k))


# -- shared --------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _shadow(backend: Backend, projection: Projection) -> AsyncIterator[None]:
    """The projection's shadow tables, empty and this process's alone, dropped when done."""
    await ensure_checkpoints(backend)
    async with backend.shadow_lock(projection.name):
        try:
            await _reset_shadow(backend, projection)
            yield
        finally:
            with contextlib.suppress(Exception):
                await _drop_shadow(backend, projection)


async def _reset_shadow(backend: Backend, projection: Projection) -> None:
    async with backend.transaction() as tx:
        await drop_tables(tx, projection, shadow=True)
        await create_tables(tx, projection, shadow=True)


async def _drop_shadow(backend: Backend, projection: Projection) -> None:
    async with backend.transaction() as tx:
        await drop_tables(tx, projection, shadow=True)


async def _fold_shadow(
    store: EventStore, backend: Backend, projection: Projection, after: int, until: int, batch_size: int
) -> int:
    """Apply the events on the projection's subject in (``after``, ``until``] to its shadow tables."""
    if until <= after:
        return 0
    if await store.last_seq(projection.subject) <= after:
        return 0  # nothing new on the subject: skip the reader's wait for "caught up"
    folded = 0
    batches = read_log(
        store,
        projection.subject,
        after=after,
        follow=False,
        until=until,
        batch_size=batch_size,
        decode=projection.decode,
    )
    async with contextlib.aclosing(batches):
        async for batch in batches:
            await commit_batch(backend, projection, batch, shadow=True)
            folded += len(batch)
    return folded


@contextlib.asynccontextmanager
async def _paused(runner: LiveRunner | None, name: str) -> AsyncIterator[None]:
    if runner is None or name not in runner:
        yield
        return
    async with runner.paused(name):
        yield
