"""What the runner, rebuild and verify share: tables, checkpoints, and applying a batch of events.

The checkpoint table holds, per projection, the stream sequence up to which every event on its
subject has been applied. It is written in the same transaction as the rows, and written as a
compare-and-set on the old position, so two writers (a second process, a rebuild elsewhere)
can never both apply the same batch: the second one finds the position moved and re-reads.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec

from llmgw.events.runtime.connection import Quarantined
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.projections.backends import Backend, Transaction
from llmgw.projections.base import Projection

CHECKPOINTS = "llmgw_checkpoints"
SHADOW_SUFFIX = "__shadow"
_PG_IDENT_MAX = 63


class Checkpoint(msgspec.Struct, frozen=True):
    name: str
    position: int
    version: int


class ProjectionError(Exception):
    """A projection could not be built or kept up; the message names the projection and what to do."""


class HandlerError(ProjectionError):
    """A projection's handler (or the SQL it ran) failed on an event: the event is not skipped."""

    def __init__(self, projection: str, seq: int | None, event_type: str | None, cause: BaseException) -> None:
        self.projection = projection
        self.seq = seq
        self.event_type = event_type
        self.cause = cause
        where = f"event {seq} ({event_type})" if seq is not None else "a batch of events"
        super().__init__(f"projection {projection} failed on {where}: {type(cause).__name__}: {cause}")


class ProjectionSuperseded(Exception):
    """The checkpoint is at another version of the projection than this writer's: a newer release
    rebuilt it (a rolling upgrade). This writer must stop writing it; nothing was applied."""

    def __init__(self, name: str, found: int, mine: int) -> None:
        self.found, self.mine = found, mine
        super().__init__(
            f"projection {name} is at version {found} (written by another release of llmgw); this one writes "
            f"version {mine} and stops writing it"
        )


class CheckpointMoved(Exception):
    """Another writer moved the checkpoint first; nothing was applied."""

    def __init__(self, position: int) -> None:
        self.position = position
        super().__init__(f"checkpoint moved to {position}")


# -- tables --------------------------------------------------------------------------------------


def _index_name(table: str, columns: Sequence[str]) -> str:
    name = re.sub(r"[^A-Za-z0-9_]+", "_", f"ix_{table}_{'_'.join(columns)}")
    if len(name) > _PG_IDENT_MAX:  # PostgreSQL truncates identifiers; keep them unique instead
        digest = hashlib.sha1(name.encode()).hexdigest()[:10]
        name = f"{name[: _PG_IDENT_MAX - 11]}_{digest}"
    return name


_IDENT = re.compile(r"^[a-z][a-z0-9_]*$")


def table_ddl(projection: Projection, logical: str, shadow: bool = False) -> list[str]:
    """``CREATE TABLE`` (with the primary key unless the columns declare one) and its indexes."""
    for ident in (projection.name, logical):
        if not _IDENT.match(ident) or "__" in ident:
            # Names go into SQL unquoted, and "__" is reserved for the shadow suffix.
            raise ProjectionError(f"{ident!r} is not a valid projection or table name: use [a-z][a-z0-9_]*, no '__'")
    physical = projection.table_name(logical, shadow)
    columns = projection.tables[logical].strip()
    keys = projection.primary_keys.get(logical)
    if not keys:
        raise ProjectionError(f"projection {projection.name}: table {logical} has no primary_keys entry")
    if "primary key" not in columns.lower():
        columns = f"{columns}, PRIMARY KEY ({', '.join(keys)})"
    out = [f"CREATE TABLE IF NOT EXISTS {physical} ({columns})"]
    for spec in projection.indexes.get(logical, ()):
        cols = [c.strip() for c in spec.split(",")] if isinstance(spec, str) else list(spec)
        out.append(f"CREATE INDEX IF NOT EXISTS {_index_name(physical, cols)} ON {physical} ({', '.join(cols)})")
    return out


async def create_tables(tx: Transaction, projection: Projection, shadow: bool = False) -> None:
    for logical in projection.tables:
        for statement in table_ddl(projection, logical, shadow):
            await tx.execute(statement)


async def drop_tables(tx: Transaction, projection: Projection, shadow: bool = False) -> None:
    for logical in projection.tables:
        await tx.execute(f"DROP TABLE IF EXISTS {projection.table_name(logical, shadow)}")


# -- checkpoints ---------------------------------------------------------------------------------


async def ensure_checkpoints(backend: Backend) -> None:
    async with backend.transaction() as tx:
        await tx.execute(
            f"CREATE TABLE IF NOT EXISTS {CHECKPOINTS}"
            " (name TEXT PRIMARY KEY, position BIGINT NOT NULL, version INT NOT NULL)"
        )


async def read_checkpoint(reader: Backend | Transaction, name: str) -> Checkpoint | None:
    row = await reader.fetchone(f"SELECT name, position, version FROM {CHECKPOINTS} WHERE name = ?", name)
    return None if row is None else Checkpoint(row[0], int(row[1]), int(row[2]))


async def init_checkpoint(tx: Transaction, name: str, version: int) -> Checkpoint:
    """The projection's checkpoint, created at position 0 if it has none."""
    await tx.execute(
        f"INSERT INTO {CHECKPOINTS} (name, position, version) VALUES (?, 0, ?) ON CONFLICT (name) DO NOTHING",
        name,
        version,
    )
    found = await read_checkpoint(tx, name)
    assert found is not None  # just inserted in this transaction
    return found


async def claim_checkpoint(tx: Transaction, name: str, expected: int, position: int, version: int) -> bool:
    """Move the checkpoint from ``expected`` to ``position``; False when someone else moved it first,
    or when it is at another ``version`` (another release's tables: never written by this one).

    Done first in the batch's transaction: on PostgreSQL it takes the row lock, so a second
    writer waits here, then sees the new position and backs off without applying anything.
    """
    changed = await tx.execute_count(
        f"UPDATE {CHECKPOINTS} SET position = ? WHERE name = ? AND position = ? AND version = ?",
        position,
        name,
        expected,
        version,
    )
    return changed == 1


async def set_checkpoint(tx: Transaction, name: str, position: int, version: int) -> None:
    await tx.execute(
        f"INSERT INTO {CHECKPOINTS} (name, position, version) VALUES (?, ?, ?)"
        " ON CONFLICT (name) DO UPDATE SET position = excluded.position, version = excluded.version",
        name,
        position,
        version,
    )


# -- applying ------------------------------------------------------------------------------------


async def apply_events(tx: Transaction, projection: Projection, events: Sequence[Any], *, whole: bool = False) -> int:
    """Apply each decoded event in order; quarantined positions are passed over. Returns how many were applied.

    Unknown event types, and types the projection has no handler for, reach ``apply`` and are
    skipped there. A handler error becomes :class:`HandlerError` naming the event. With ``whole``,
    a projection that overrides ``apply_batch`` gets the batch at once (its error names no event).
    """
    if whole and type(projection).apply_batch is not Projection.apply_batch:
        batch = [e for e in events if isinstance(e, RecordedEvent)]
        try:
            await projection.apply_batch(tx, batch)
        except Exception as exc:
            raise HandlerError(projection.name, None, None, exc) from exc
        return len(batch)
    applied = 0
    for event in events:
        if isinstance(event, Quarantined):
            continue
        assert isinstance(event, RecordedEvent)
        try:
            await projection.apply(tx, event)
        except Exception as exc:
            raise HandlerError(projection.name, event.seq, event.type, exc) from exc
        applied += 1
    return applied


async def commit_batch(
    backend: Backend,
    projection: Projection,
    events: Sequence[Any],
    *,
    shadow: bool = False,
    before: Callable[[Transaction], Awaitable[None]] | None = None,
    on_retry: Callable[[BaseException], None] | None = None,
) -> int:
    """Apply ``events`` in one transaction (writes buffered); if that fails, once more unbuffered.

    ``before`` runs first in the transaction (the runner's checkpoint claim). The second pass
    names the failing event exactly — a buffered write's error only surfaces at flush — and
    rides out a one-off failure. A second failure is raised: :class:`HandlerError` when a
    handler or its SQL failed, the backend's error when the commit did.
    """
    for buffered in (True, False):
        try:
            async with backend.transaction(projection, shadow=shadow, buffered=buffered) as tx:
                if before is not None:
                    await before(tx)
                # The buffered pass folds a batch at once where the projection can; the retry goes event by event.
                return await apply_events(tx, projection, events, whole=buffered)
        except (CheckpointMoved, ProjectionSuperseded):
            raise
        except Exception as exc:
            if not buffered:
                raise
            if on_retry is not None:
                on_retry(exc)
    raise AssertionError("unreachable")
