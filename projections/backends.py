"""The database under the projections: SQLite (default) or PostgreSQL, from one SQL dialect subset.

Projection SQL is written once, with ``?`` placeholders and tables as ``{logical}`` names. The
backend renders it per target — ``{items}`` becomes ``inventory_items`` for the live tables or
``inventory_items__shadow`` for a rebuild's shadow, and ``?`` becomes ``$1..$n`` for asyncpg —
and caches the rendering, so the hot path does no string work after the first batch.

A :class:`Transaction` can *buffer* writes: ``execute`` calls are queued and consecutive runs of
the same statement are sent as one ``executemany`` (one round trip on asyncpg, one thread hop on
aiosqlite) when the transaction next reads, flushes or commits. Reads always see the buffered
writes first, so a handler that reads what an earlier event wrote gets the right answer.

- SQLite: one writer connection (WAL, ``synchronous=NORMAL``) behind an asyncio lock, because
  SQLite has one writer anyway and one connection keeps transactions from interleaving; a
  second, read-only connection serves queries so readers never wait for a batch.
- PostgreSQL: a small asyncpg pool; each transaction holds one connection.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar

from llmgw.projections.base import Projection, Row

# A quoted string or identifier (kept as is), a {logical} table name, or a ? placeholder.
_TOKENS = re.compile(r"'(?:[^']|'')*'|\"(?:[^\"]|\"\")*\"|\{([A-Za-z_][A-Za-z0-9_]*)\}|\?")

# Buffered rows before a transaction flushes on its own: bounds memory, keeps executemany calls large.
MAX_BUFFERED_ROWS = 5000


class BackendError(Exception):
    """The projection database refused or could not do something; the message says what to check."""


def render(sql: str, tables: dict[str, str] | None, dollar: bool) -> str:
    """``sql`` with ``{logical}`` names replaced from ``tables`` and ``?`` as ``$n`` when ``dollar``."""
    n = 0

    def sub(m: re.Match[str]) -> str:
        nonlocal n
        text = m.group(0)
        if text == "?":
            n += 1
            return f"${n}" if dollar else "?"
        logical = m.group(1)
        if logical is None:
            return text  # a quoted literal or identifier
        if tables is None:
            raise BackendError(f"table {{{logical}}} used outside a projection: name the projection")
        try:
            return tables[logical]
        except KeyError:
            known = ", ".join(sorted(tables)) or "none"
            raise BackendError(f"unknown table {{{logical}}} (this projection has: {known})") from None

    return _TOKENS.sub(sub, sql)


def table_map(projection: Projection | str, shadow: bool = False) -> dict[str, str] | _AnyTable:
    """Logical → physical names for a projection; for a bare name, any ``{x}`` maps to ``<name>_<x>``."""
    if isinstance(projection, str):
        return _AnyTable(projection, shadow)
    return {t: projection.table_name(t, shadow) for t in projection.tables}


class _AnyTable(dict):
    """A table map for a projection known only by name (the admin API's reads)."""

    def __init__(self, name: str, shadow: bool) -> None:
        super().__init__()
        self.name = name
        self.suffix = "__shadow" if shadow else ""

    def __missing__(self, logical: str) -> str:
        return f"{self.name}_{logical}{self.suffix}"


Groups = list[tuple[str, list[Sequence[Any]]]]  # buffered writes: (rendered SQL, rows of arguments), in order


class Transaction(abc.ABC):
    """One transaction (implements :class:`~llmgw.projections.base.Tx`), bound to one projection's tables.

    With ``buffered``, writes are queued and sent in runs (see the module docstring); an error in a
    buffered write surfaces at the next read, flush or commit, not at the ``execute`` call.
    """

    def __init__(self, backend: Backend, target: Projection | str | None, shadow: bool, buffered: bool) -> None:
        self._backend = backend
        self._key = (target.name if isinstance(target, Projection) else target, shadow)
        self._tables = None if target is None else table_map(target, shadow)
        self._buffered = buffered
        self._pending: Groups = []
        self._pending_rows = 0

    def sql(self, sql: str) -> str:
        return self._backend.rendered(sql, self._key, self._tables)

    # -- the Tx protocol ---------------------------------------------------------------------

    async def execute(self, sql: str, *args: Any) -> None:
        await self._queue(self.sql(sql), [args])

    async def executemany(self, sql: str, rows: Iterable[Sequence[Any]]) -> None:
        rows = list(rows)
        if rows:
            await self._queue(self.sql(sql), rows)

    async def fetchone(self, sql: str, *args: Any) -> Row | None:
        rows = await self._read(self._take(), self.sql(sql), args, True)
        return rows[0] if rows else None

    async def fetchall(self, sql: str, *args: Any) -> list[Row]:
        return await self._read(self._take(), self.sql(sql), args, False)

    # -- more --------------------------------------------------------------------------------

    async def execute_count(self, sql: str, *args: Any) -> int:
        """Run one statement now (after any buffered writes) and return how many rows it changed."""
        return await self._count(self._take(), self.sql(sql), args)

    async def flush(self) -> None:
        """Send the buffered writes, in order."""
        pending = self._take()
        if pending:
            await self._write(pending)

    async def columns(self, table: str) -> list[str]:
        """The column names of a physical table, in order (none when it does not exist)."""
        await self.flush()
        return await self._columns(table)

    async def _queue(self, q: str, rows: list[Sequence[Any]]) -> None:
        if not self._buffered:
            await self._write([(q, rows)])
            return
        if self._pending and self._pending[-1][0] == q:
            self._pending[-1][1].extend(rows)
        else:
            self._pending.append((q, rows))
        self._pending_rows += len(rows)
        if self._pending_rows >= MAX_BUFFERED_ROWS:
            await self.flush()

    def _take(self) -> Groups:
        pending, self._pending, self._pending_rows = self._pending, [], 0
        return pending

    # -- per backend: each call sends the buffered ``groups`` first, in the same round trip where it can

    @abc.abstractmethod
    async def _write(self, groups: Groups) -> None: ...

    @abc.abstractmethod
    async def _read(self, groups: Groups, q: str, args: Sequence[Any], one: bool) -> list[Row]: ...

    @abc.abstractmethod
    async def _count(self, groups: Groups, q: str, args: Sequence[Any]) -> int: ...

    @abc.abstractmethod
    async def _columns(self, table: str) -> list[str]: ...


class Backend(abc.ABC):
    """A projection database. Open one with :func:`open_backend`; close it with :meth:`close`."""

    kind: ClassVar[str]
    dollar: ClassVar[bool]

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self._rendered: dict[tuple[str, str | None, bool], str] = {}
        self._shadow_locks: dict[str, asyncio.Lock] = {}

    def shadow_lock(self, projection: str) -> asyncio.Lock:
        """Held by a rebuild or verify while it owns the projection's shadow tables (one at a time)."""
        return self._shadow_locks.setdefault(projection, asyncio.Lock())

    def gone(self) -> bool:
        """True when the database was deleted or replaced under the open connections (a SQLite file)."""
        return False

    async def reopen(self) -> None:
        """Open the connections again, on what the DSN names now (after :meth:`gone`)."""
        raise BackendError(f"a {self.kind} database is not reopened in place: restart the server")

    def is_transient(self, exc: BaseException) -> bool:
        """True for errors worth retrying later (connection lost, database busy), not for bad SQL."""
        return isinstance(exc, (OSError, TimeoutError))

    def rendered(self, sql: str, key: tuple[str | None, bool], tables: dict[str, str] | None) -> str:
        """``sql`` rendered for one projection's live or shadow tables, cached per (sql, projection, shadow)."""
        cache_key = (sql, key[0], key[1])
        q = self._rendered.get(cache_key)
        if q is None:
            q = render(sql, tables, self.dollar)
            if len(self._rendered) < 10_000:  # SQL built per call (with literals) must not grow this forever
                self._rendered[cache_key] = q
        return q

    @abc.abstractmethod
    def transaction(
        self, projection: Projection | str | None = None, *, shadow: bool = False, buffered: bool = False
    ) -> contextlib.AbstractAsyncContextManager[Transaction]:
        """A read-write transaction; ``{x}`` names resolve to ``projection``'s live (or shadow) tables.

        Commits when the block ends, rolls back when it raises (cancellation included).
        """

    @abc.abstractmethod
    def snapshot(self) -> contextlib.AbstractAsyncContextManager[Transaction]:
        """A read-only transaction that sees one consistent state of the whole database."""

    @abc.abstractmethod
    async def fetchall(self, sql: str, *args: Any, projection: Projection | str | None = None) -> list[Row]:
        """Read committed rows outside any projection transaction (``{x}`` names live tables of ``projection``)."""

    async def fetchone(self, sql: str, *args: Any, projection: Projection | str | None = None) -> Row | None:
        rows = await self.fetchall(sql, *args, projection=projection)
        return rows[0] if rows else None

    async def query(self, projection: Projection | str, sql: str, *args: Any) -> list[Row]:
        """Rows from one projection's live tables: ``{x}`` is its table ``x``. For the admin API and tools."""
        return await self.fetchall(sql, *args, projection=projection)

    @abc.abstractmethod
    async def close(self) -> None: ...


# -- SQLite --------------------------------------------------------------------------------------


def _sqlite_write(db: Any, groups: Groups) -> None:
    for q, rows in groups:
        if len(rows) == 1:
            db.execute(q, rows[0])
        else:
            db.executemany(q, rows)


def _sqlite_read(db: Any, groups: Groups, q: str, args: Sequence[Any], one: bool) -> list[Row]:
    _sqlite_write(db, groups)
    cursor = db.execute(q, args)
    try:
        if one:
            row = cursor.fetchone()
            return [] if row is None else [tuple(row)]
        return [tuple(r) for r in cursor.fetchall()]
    finally:
        cursor.close()


def _sqlite_count(db: Any, groups: Groups, q: str, args: Sequence[Any]) -> int:
    _sqlite_write(db, groups)
    cursor = db.execute(q, args)
    try:
        return cursor.rowcount
    finally:
        cursor.close()


def _sqlite_columns(db: Any, table: str) -> list[str]:
    return [r[1] for r in db.execute(f'PRAGMA table_info("{table}")').fetchall()]


class _SqliteTx(Transaction):
    def __init__(self, backend: Backend, conn: Any, target: Projection | str | None, shadow: bool, buffered: bool):
        super().__init__(backend, target, shadow, buffered)
        self._conn = conn

    async def _on_thread(self, fn: Any, *args: Any) -> Any:
        # Each aiosqlite call is a hop to its thread and back (~50-100 µs), which would dominate a
        # batch. `_execute` is aiosqlite's own primitive for running a callable on that thread:
        # the buffered writes and the read that needs them go over in one hop.
        conn = self._conn
        return await conn._execute(lambda: fn(conn._conn, *args))

    async def _write(self, groups: Groups) -> None:
        await self._on_thread(_sqlite_write, groups)

    async def _read(self, groups: Groups, q: str, args: Sequence[Any], one: bool) -> list[Row]:
        return await self._on_thread(_sqlite_read, groups, q, args, one)

    async def _count(self, groups: Groups, q: str, args: Sequence[Any]) -> int:
        return await self._on_thread(_sqlite_count, groups, q, args)

    async def _columns(self, table: str) -> list[str]:
        return await self._on_thread(_sqlite_columns, table)


class SqliteBackend(Backend):
    kind = "sqlite"
    dollar = False

    def __init__(self, dsn: str, path: Path) -> None:
        super().__init__(dsn)
        self.path = path
        self._writer: Any = None
        self._reader: Any = None
        self._write_lock = asyncio.Lock()
        self._read_lock = asyncio.Lock()
        self._file: tuple[int, int] | None = None  # (device, inode) of the file the connections opened

    async def _connect(self, *, read_only: bool = False) -> Any:
        import aiosqlite

        # isolation_level=None: we issue BEGIN/COMMIT ourselves, so DDL and reads are inside too.
        conn = await aiosqlite.connect(self.path, isolation_level=None)
        await conn.execute("PRAGMA busy_timeout = 10000")
        if read_only:
            await conn.execute("PRAGMA query_only = 1")
        else:
            await conn.execute("PRAGMA journal_mode = WAL")
            # NORMAL under WAL: a power cut may lose the last commits, never corrupt; the log replays them.
            await conn.execute("PRAGMA synchronous = NORMAL")
        return conn

    async def open(self) -> SqliteBackend:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._writer = await self._connect()
            self._reader = await self._connect(read_only=True)
        except Exception as exc:
            await self.close()
            raise BackendError(f"cannot open SQLite database {self.path}: {exc}") from exc
        self._file = self._identity()
        return self

    def _identity(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return st.st_dev, st.st_ino

    def gone(self) -> bool:
        # Open connections keep working on a deleted file, but every new connection (a verify's
        # snapshot, the next start) would see another, empty database.
        return self._file is not None and self._identity() != self._file

    async def reopen(self) -> None:
        async with self._write_lock, self._read_lock:
            await self.close()  # the last close also removes the deleted file's -wal, so it is not replayed
            await self.open()

    def is_transient(self, exc: BaseException) -> bool:
        import sqlite3

        if isinstance(exc, sqlite3.OperationalError):
            text = str(exc).lower()
            return "locked" in text or "busy" in text or "disk i/o" in text
        return super().is_transient(exc)

    @contextlib.asynccontextmanager
    async def transaction(
        self, projection: Projection | str | None = None, *, shadow: bool = False, buffered: bool = False
    ) -> AsyncIterator[Transaction]:
        async with self._write_lock:
            conn = self._writer
            if conn.in_transaction:  # a rollback cut short by a second cancellation: finish it first
                await conn.execute("ROLLBACK")
            await conn.execute("BEGIN IMMEDIATE")
            tx = _SqliteTx(self, conn, projection, shadow, buffered)
            try:
                yield tx
                await tx.flush()
                await conn.execute("COMMIT")
            except BaseException:
                # Queued on the connection's thread before any later statement, even if we are cancelled here.
                with contextlib.suppress(Exception):
                    await conn.execute("ROLLBACK")
                raise

    @contextlib.asynccontextmanager
    async def snapshot(self) -> AsyncIterator[Transaction]:
        # A connection of its own: a long verify must not hold up the readers' connection.
        conn = await self._connect(read_only=True)
        try:
            await conn.execute("BEGIN")
            yield _SqliteTx(self, conn, None, False, False)
        finally:
            with contextlib.suppress(Exception):
                await conn.execute("ROLLBACK")
            await conn.close()

    async def fetchall(self, sql: str, *args: Any, projection: Projection | str | None = None) -> list[Row]:
        tables = None if projection is None else table_map(projection)
        name = projection.name if isinstance(projection, Projection) else projection
        q = self.rendered(sql, (name, False), tables)
        async with self._read_lock:
            return [tuple(r) for r in await self._reader.execute_fetchall(q, args)]

    async def close(self) -> None:
        for conn in (self._reader, self._writer):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()
        self._reader = self._writer = None


# -- PostgreSQL ----------------------------------------------------------------------------------


class _PgTx(Transaction):
    def __init__(self, backend: Backend, conn: Any, target: Projection | str | None, shadow: bool, buffered: bool):
        super().__init__(backend, target, shadow, buffered)
        self._conn = conn

    async def _write(self, groups: Groups) -> None:
        for q, rows in groups:
            if len(rows) == 1:
                await self._conn.execute(q, *rows[0])
            else:
                await self._conn.executemany(q, rows)  # pipelined by asyncpg: one round trip for the run

    async def _read(self, groups: Groups, q: str, args: Sequence[Any], one: bool) -> list[Row]:
        await self._write(groups)
        if one:
            r = await self._conn.fetchrow(q, *args)
            return [] if r is None else [tuple(r)]
        return [tuple(r) for r in await self._conn.fetch(q, *args)]

    async def _count(self, groups: Groups, q: str, args: Sequence[Any]) -> int:
        await self._write(groups)
        status = await self._conn.execute(q, *args)
        # "UPDATE 3", "INSERT 0 1", "DELETE 0": the last word is the row count; DDL has none.
        last = status.rsplit(" ", 1)[-1] if status else ""
        return int(last) if last.isdigit() else 0

    async def _columns(self, table: str) -> list[str]:
        rows = await self._conn.fetch(
            "SELECT column_name FROM information_schema.columns"
            " WHERE table_schema = current_schema() AND table_name = $1 ORDER BY ordinal_position",
            table,
        )
        return [r[0] for r in rows]


class PostgresBackend(Backend):
    kind = "postgresql"
    dollar = True

    def __init__(self, dsn: str, *, min_size: int = 1, max_size: int = 8) -> None:
        super().__init__(dsn)
        self._pool: Any = None
        self._min_size = min_size
        self._max_size = max_size

    async def open(self) -> PostgresBackend:
        import asyncpg

        try:
            self._pool = await asyncpg.create_pool(
                self.dsn, min_size=self._min_size, max_size=self._max_size, command_timeout=300
            )
        except (OSError, asyncpg.PostgresError) as exc:
            raise BackendError(f"cannot connect to PostgreSQL at {_redact(self.dsn)}: {exc}") from exc
        return self

    def is_transient(self, exc: BaseException) -> bool:
        import asyncpg

        transient = (
            asyncpg.PostgresConnectionError,
            asyncpg.InterfaceError,
            asyncpg.CannotConnectNowError,
            asyncpg.TooManyConnectionsError,
            asyncpg.SerializationError,
            asyncpg.DeadlockDetectedError,
            asyncpg.AdminShutdownError,
        )
        return isinstance(exc, transient) or super().is_transient(exc)

    @contextlib.asynccontextmanager
    async def transaction(
        self, projection: Projection | str | None = None, *, shadow: bool = False, buffered: bool = False
    ) -> AsyncIterator[Transaction]:
        async with self._pool.acquire() as conn, conn.transaction():
            tx = _PgTx(self, conn, projection, shadow, buffered)
            yield tx
            await tx.flush()

    @contextlib.asynccontextmanager
    async def snapshot(self) -> AsyncIterator[Transaction]:
        async with self._pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
            yield _PgTx(self, conn, None, False, False)

    async def fetchall(self, sql: str, *args: Any, projection: Projection | str | None = None) -> list[Row]:
        tables = None if projection is None else table_map(projection)
        name = projection.name if isinstance(projection, Projection) else projection
        q = self.rendered(sql, (name, False), tables)
        return [tuple(r) for r in await self._pool.fetch(q, *args)]

    async def close(self) -> None:
        if self._pool is not None:
            try:
                async with asyncio.timeout(10):  # not wait_for: on 3.11 it can swallow a cancel
                    await self._pool.close()
            except Exception:
                self._pool.terminate()  # connections still busy after 10 s: cut them
            self._pool = None


def _redact(dsn: str) -> str:
    return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", dsn)


async def open_backend(dsn: str, *, pool_size: int = 8) -> Backend:
    """The backend a DSN names, opened.

    ``sqlite:///abs/path.db`` or a plain file path → SQLite; ``postgresql://…`` or
    ``postgres://…`` → PostgreSQL (a pool of up to ``pool_size`` connections: one per projection
    applying a batch, plus rebuilds, verifies and readers).
    """
    if dsn.startswith(("postgresql://", "postgres://")):
        return await PostgresBackend(dsn, max_size=pool_size).open()
    if dsn.startswith("sqlite://"):
        path = dsn.removeprefix("sqlite://")
        if not path.startswith("/"):
            raise BackendError(f"SQLite DSN {dsn!r} needs an absolute path: sqlite:///abs/path.db")
    elif "://" in dsn:
        scheme = dsn.split("://", 1)[0]
        raise BackendError(f"database scheme {scheme!r} is not supported; use sqlite:///path.db or postgresql://…")
    else:
        path = dsn
    if path in ("", ":memory:", "/:memory:"):
        raise BackendError("an in-memory SQLite database cannot be shared by the writer and readers; give a file")
    return await SqliteBackend(dsn, _sqlite_path(path)).open()


def _sqlite_path(path: str) -> Path:
    return Path(path).expanduser().resolve()
