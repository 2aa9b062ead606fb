"""Usage as tables (SPEC USE-1, USE-2, GW-8): one row per request, and per-minute sums by scope and model.

The projection reads ``LLMGW_USAGE``, not the event log. Each message there is one
:class:`~llmgw.events.schema.usage.UsageRecord` as JSON, published by a router with ``Nats-Msg-Id`` = the
request id, so JetStream keeps a retried publish once within its duplicate window. A record sent
again past that window is a second message; ``requests`` is keyed by request id and the rollups are
only added to when the request row is new, so a request is stored once and counted once whatever the
stream holds. Rows, sums and the checkpoint move in one transaction (the runner's).

``rollups`` holds, per minute (UTC, of the request's arrival) and model, the sums for each dimension a
record has — key, project, team, org, model. A row also carries its value's place in the tree (the
ids at and above its level: a key row names its key, project, team and org), so usage under a scope
can be grouped by a finer or a coarser level: keys of a project, projects of an org, a key's project.
Cost and time are summed as integers (nano-USD, microseconds): exact, so sums never drift, a batch
can be added up before it is written, and a rebuild matches the live tables bit for bit.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec

from llmgw.events.schema.codec import EventDecodeError
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.registry import EventRegistry
from llmgw.events.schema.subjects import STREAM_USAGE, USAGE_ROOT
from llmgw.events.schema.usage import UsageRecord
from llmgw.projections.backends import Backend
from llmgw.projections.base import Projection, Tx

RECORD_TYPE = "usage.record"  # the type the records are given as events (they carry none on the wire)
RECORD_ACTOR = "svc:router"
LEVELS = ("key", "project", "team", "org")  # the tree, finest first
DIMENSIONS = (*LEVELS, "model")
GROUPS = ("model", *LEVELS)  # what `--by` may group by
SCOPE_KINDS = (*LEVELS, "model")
PERIODS = ("day", "month")

REQUEST_COLUMNS = (
    "request_id",
    "client_request_id",
    "seq",
    "at",
    "status",
    "key_id",
    "project_id",
    "team_id",
    "org_id",
    "user_name",
    "model_asked",
    "model_served",
    "replica_id",
    "node_id",
    "endpoint",
    "stream",
    "tokens_in",
    "tokens_out",
    "queue_s",
    "ttft_s",
    "total_s",
    "cost_usd",
    "error",
    "router",
)
SUMS = ("requests", "errors", "tokens_in", "tokens_out", "cost_nano_usd", "total_us")
NANO_USD = 1_000_000_000  # rollups keep cost in nano-USD (the router rounds to 1e-8 USD)
MICROS = 1_000_000  # and time in microseconds (the router rounds to 1e-6 s)

_INSERT_REQUEST = (
    f"INSERT INTO {{requests}} ({', '.join(REQUEST_COLUMNS)}) VALUES ({', '.join('?' * len(REQUEST_COLUMNS))}) "
    "ON CONFLICT (request_id) DO NOTHING"
)
_ADD_ROLLUP = (
    "INSERT INTO {rollups} (minute, dimension, value, model, key_id, project_id, team_id, org_id, "
    "requests, errors, tokens_in, tokens_out, cost_nano_usd, total_us) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
    "ON CONFLICT (minute, dimension, value, model) DO UPDATE SET requests = {rollups}.requests + excluded.requests, "
    "errors = {rollups}.errors + excluded.errors, tokens_in = {rollups}.tokens_in + excluded.tokens_in, "
    "tokens_out = {rollups}.tokens_out + excluded.tokens_out, "
    "cost_nano_usd = {rollups}.cost_nano_usd + excluded.cost_nano_usd, "
    "total_us = {rollups}.total_us + excluded.total_us"
)

_SCOPE_BY_NAME = "SELECT id, parent_id FROM {scopes} WHERE kind = ? AND name = ?"  # the tenancy projection's

_record_decoder = msgspec.json.Decoder(UsageRecord)
_envelope_decoder = msgspec.json.Decoder(Envelope)


class ScopeError(ValueError):
    """A scope written in a way this system cannot read; the message says how to write one."""


class UnknownScope(ScopeError):
    """A scope path that names no organisation, team or project."""


# -- time ------------------------------------------------------------------------------------------


def _utc(at: datetime) -> datetime:
    return at.astimezone(UTC) if at.tzinfo else at.replace(tzinfo=UTC)


def minute_of(at: datetime) -> str:
    """The rollup minute of a time: ``2026-11-29T20:22:00Z`` (fixed width, so text order is time order)."""
    return _utc(at).strftime("%Y-%m-%dT%H:%M:00Z")


def stamp(at: datetime) -> str:
    """A request's time as stored: UTC, microseconds, fixed width."""
    return _utc(at).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_since(value: str, now: datetime) -> datetime:
    """``30m``, ``1h``, ``2d`` before ``now``, or an ISO time (UTC when it names no zone)."""
    m = re.fullmatch(r"(\d+)([smhd])", value.strip())
    if m:
        n, unit = int(m.group(1)), m.group(2)
        try:
            return _utc(now) - timedelta(seconds=n * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit])
        except OverflowError:  # before the calendar's start: a client's typo, never a 500
            raise ValueError(f"since {value!r} reaches back past the year 1; give a shorter duration") from None
    try:
        return _utc(datetime.fromisoformat(value.strip()))
    except ValueError:
        raise ValueError(f"since {value!r} is neither a duration (30m, 1h, 2d) nor an ISO time") from None


def period_start(period: str, now: datetime) -> datetime:
    """When the budget period holding ``now`` began: midnight UTC (day) or the 1st at midnight UTC (month)."""
    now = _utc(now)
    day = now.replace(hour=0, minute=0, second=0, microsecond=0)
    if period == "day":
        return day
    if period == "month":
        return day.replace(day=1)
    raise ValueError(f"budget period {period!r} is not one of {', '.join(PERIODS)}")


# -- decoding ----------------------------------------------------------------------------------------


def decode_usage(data: bytes) -> UsageRecord:
    """A usage record from the bytes on ``LLMGW_USAGE``. Raises :class:`EventDecodeError` (quarantined).

    The record as JSON is the format; a record inside an event envelope is read too, so a publisher
    that wraps it is not quarantined wholesale.
    """
    try:
        return _record_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        try:
            return _record_decoder.decode(_envelope_decoder.decode(data).data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            raise EventDecodeError(f"not a usage record: {exc}") from exc


# -- the fold ----------------------------------------------------------------------------------------


NOT_SERVED = "(none)"  # the model row of requests refused before a catalog model was chosen


def served_model(r: UsageRecord) -> str:
    """The model a request is counted under: the catalog model that served it (or would have, for a
    request refused by its limits); :data:`NOT_SERVED` when none was chosen — a name the client made
    up (``gpt-4o``) or may not use is kept in the request's record, never made a row of its own."""
    return r.model_served or NOT_SERVED


def rollup_keys(r: UsageRecord) -> list[tuple[str, str, str | None, str | None, str | None, str | None]]:
    """``(dimension, value, key_id, project_id, team_id, org_id)`` for each rollup row a record adds to.

    A level the record lacks (no key on an anonymous request) gets no row; each row names the ids
    at and above its own level, none below (a project row names no key).
    """
    ids = {"key": r.key_id or None, "project": r.project_id or None, "team": r.team_id or None, "org": r.org_id or None}
    out: list[tuple[str, str, str | None, str | None, str | None, str | None]] = []
    for i, level in enumerate(LEVELS):
        value = ids[level]
        if value is None:
            continue
        above = {lv: ids[lv] for lv in LEVELS[i:]}
        out.append((level, value, above.get("key"), above.get("project"), above.get("team"), above.get("org")))
    out.append(("model", served_model(r), None, None, None, None))
    return out


class UsageProjection(Projection):
    name = "usage"
    # 2: the client's X-Request-Id kept beside the gateway's own (requests.client_request_id)
    # 3: rows by model are by the model served; requests no catalog model took are counted under "(none)"
    version = 3
    stream = STREAM_USAGE
    subject = f"{USAGE_ROOT}.>"
    tables = {
        "requests": "request_id TEXT NOT NULL, client_request_id TEXT, seq BIGINT NOT NULL, at TEXT NOT NULL, "
        "status INTEGER NOT NULL, "
        "key_id TEXT, project_id TEXT, team_id TEXT, org_id TEXT, user_name TEXT, model_asked TEXT NOT NULL, "
        "model_served TEXT, replica_id TEXT, node_id TEXT, endpoint TEXT NOT NULL, stream INTEGER NOT NULL, "
        "tokens_in BIGINT NOT NULL, tokens_out BIGINT NOT NULL, queue_s DOUBLE PRECISION NOT NULL, "
        "ttft_s DOUBLE PRECISION, total_s DOUBLE PRECISION NOT NULL, cost_usd DOUBLE PRECISION NOT NULL, "
        "error TEXT, router TEXT NOT NULL",
        "rollups": "minute TEXT NOT NULL, dimension TEXT NOT NULL, value TEXT NOT NULL, model TEXT NOT NULL, "
        "key_id TEXT, project_id TEXT, team_id TEXT, org_id TEXT, requests BIGINT NOT NULL, errors BIGINT NOT NULL, "
        "tokens_in BIGINT NOT NULL, tokens_out BIGINT NOT NULL, cost_nano_usd BIGINT NOT NULL, "
        "total_us BIGINT NOT NULL",
    }
    primary_keys = {"requests": ["request_id"], "rollups": ["minute", "dimension", "value", "model"]}
    indexes = {
        "requests": [["at"], ["project_id", "at"], ["key_id", "at"], ["client_request_id", "at"]],
        "rollups": [["dimension", "value", "minute"]],  # the key, which starts with the minute, serves the rest
    }
    handlers = {}  # one type, folded a batch at a time (apply_batch)

    def decode(self, registry: EventRegistry, data: bytes, subject: str, seq: int) -> RecordedEvent:
        # Records carry no envelope on the wire: give each one, so the runner's machinery applies as it is.
        record = decode_usage(data)
        envelope = Envelope(
            id=record.request_id, type=RECORD_TYPE, at=record.at, actor=RECORD_ACTOR, correlation=record.request_id
        )
        return RecordedEvent(envelope=envelope, payload=record, subject=subject, seq=seq)

    async def apply(self, tx: Tx, event: RecordedEvent) -> None:
        await self.apply_batch(tx, [event])

    async def apply_batch(self, tx: Tx, events: Sequence[RecordedEvent]) -> None:
        """Store the batch's new requests and add them to the rollups; a request stored before adds nothing.

        A few statements per batch rather than per record: one look-up of which ids are stored, the
        inserts as one run, then one upsert per rollup row the batch touches (not one per record).
        The sums are integers, so they come out the same however the log is cut into batches — a
        rebuild matches the live tables exactly.
        """
        first: dict[str, tuple[int, UsageRecord]] = {}  # request id → its first copy in the batch
        for e in events:
            if e.known and e.type == RECORD_TYPE and isinstance(e.payload, UsageRecord):
                first.setdefault(e.payload.request_id, (e.seq, e.payload))
        if not first:
            return
        stored = await _stored_ids(tx, list(first))
        new = [(seq, r) for rid, (seq, r) in first.items() if rid not in stored]
        for seq, r in new:
            await tx.execute(_INSERT_REQUEST, *_request_row(seq, r))
        # Integer sums: adding up the batch first gives exactly what record-by-record upserts would.
        sums: dict[tuple[str, str, str, str], list[Any]] = {}
        for _, r in new:
            minute, model = minute_of(r.at), served_model(r)
            add = (1, int(r.status >= 400), r.tokens_in, r.tokens_out, nano_usd(r.cost_usd), micros(r.total_s))
            for dimension, value, *tree in rollup_keys(r):
                row = sums.get((minute, dimension, value, model))
                if row is None:
                    sums[(minute, dimension, value, model)] = [*tree, *add]  # the tree as the first record names it
                else:
                    for i, v in enumerate(add, start=4):
                        row[i] += v
        for key, row in sums.items():
            await tx.execute(_ADD_ROLLUP, *key, *row)


def nano_usd(usd: float) -> int:
    return round(usd * NANO_USD)


def micros(seconds: float) -> int:
    return round(seconds * MICROS)


def _request_row(seq: int, r: UsageRecord) -> tuple[Any, ...]:
    return (
        r.request_id,
        r.client_request_id,
        seq,
        stamp(r.at),
        r.status,
        r.key_id,
        r.project_id,
        r.team_id,
        r.org_id,
        r.user,
        r.model_asked,
        r.model_served,
        r.replica_id,
        r.node_id,
        r.endpoint,
        int(r.stream),
        r.tokens_in,
        r.tokens_out,
        r.queue_s,
        r.ttft_s,
        r.total_s,
        r.cost_usd,
        r.error,
        r.router,
    )


_LOOKUP_SIZES = (1, 16, 128, 500)  # few distinct statements (each is prepared and cached), none over SQLite's limit


async def _stored_ids(tx: Tx, ids: list[str]) -> set[str]:
    """Which of ``ids`` have a request row already."""
    found: set[str] = set()
    for start in range(0, len(ids), _LOOKUP_SIZES[-1]):
        chunk = ids[start : start + _LOOKUP_SIZES[-1]]
        size = next(n for n in _LOOKUP_SIZES if n >= len(chunk))
        padded = chunk + [chunk[-1]] * (size - len(chunk))  # a repeated id changes nothing in IN (...)
        marks = ", ".join("?" * size)
        rows = await tx.fetchall(f"SELECT request_id FROM {{requests}} WHERE request_id IN ({marks})", *padded)
        found.update(r[0] for r in rows)
    return found


# -- reading: scopes, sums, one request -----------------------------------------------------------------


class Totals(msgspec.Struct, frozen=True, kw_only=True):
    """Sums over some rollup rows (a group of ``ctl usage``)."""

    group: str | None
    requests: int = 0
    errors: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    cost_usd: float = 0.0
    total_s: float = 0.0

    @property
    def mean_latency_s(self) -> float | None:
        return self.total_s / self.requests if self.requests else None

    def as_dict(self) -> dict[str, Any]:
        return {**msgspec.to_builtins(self), "mean_latency_s": self.mean_latency_s}


def parse_scope(scope: str) -> tuple[str, str]:
    """``kind:value`` → (kind, value); kinds are key, project, team, org and model."""
    kind, sep, value = scope.partition(":")
    if not sep or kind not in SCOPE_KINDS or not value:
        raise ScopeError(
            f"scope {scope!r} is not KIND:ID-OR-PATH with KIND one of {', '.join(SCOPE_KINDS)} "
            "(e.g. project:acme/ml/chat, org:acme, key:<id>, model:<name>)"
        )
    return kind, value


async def resolve_scope(backend: Backend, scope: str) -> tuple[str, str]:
    """(kind, id as stored in records) for a scope written by id or, for org/team/project, by path.

    Looked up in the tenancy projection's ``scopes``; an id it does not know (a deleted project,
    whose usage stays) is taken as it is, while a path that names nothing is an error.
    """
    kind, value = parse_scope(scope)
    if kind not in ("org", "team", "project"):
        return kind, value
    if await backend.query("tenancy", "SELECT id FROM {scopes} WHERE id = ? AND kind = ?", value, kind):
        return kind, value
    names = value.strip("/").split("/")
    if len(names) == ("org", "team", "project").index(kind) + 1:
        parent: str | None = None
        for level, name in zip(("org", "team", "project"), names, strict=False):
            rows = await backend.query("tenancy", _SCOPE_BY_NAME, level, name)
            found = [r[0] for r in rows if r[1] == parent]
            if not found:
                break
            parent = found[0]
        else:
            assert parent is not None
            return kind, parent
    if "/" in value:
        raise UnknownScope(f"no {kind} at {value!r}; `llmgw ctl tree` lists organisations, teams and projects")
    return kind, value  # an id the tree does not (or no longer) know


def usage_query(by: str, scope: tuple[str, str] | None, since_minute: str) -> tuple[str, list[Any]]:
    """The SQL (over ``{rollups}``) and arguments for sums since a minute, within a scope, grouped ``by``.

    Rows are read at the finer of the scope's and the grouping's levels, where both ids are present:
    keys of a project read key rows filtered by project; a key's project reads that key's rows.
    """
    if by not in GROUPS:
        raise ValueError(f"group by {by!r}: choose one of {', '.join(GROUPS)}")
    kind, value = scope if scope is not None else (None, None)
    where, args = ["minute >= ?"], [since_minute]
    if by == "model":
        dimension, group = (kind if kind in LEVELS else "model"), "model"
    elif kind in LEVELS:
        dimension, group = LEVELS[min(LEVELS.index(by), LEVELS.index(kind))], f"{by}_id"
    else:
        dimension, group = by, f"{by}_id"
    if kind == dimension:
        where.append("value = ?")  # the scope's own rows: the (dimension, value, minute) index
    elif kind in LEVELS:
        where.append(f"{kind}_id = ?")
    elif kind == "model":
        where.append("model = ?")
    if kind is not None:
        args.append(value)
    where.append("dimension = ?")
    args.append(dimension)
    sums = ", ".join(f"SUM({c})" for c in SUMS)
    sql = f"SELECT {group}, {sums} FROM {{rollups}} WHERE {' AND '.join(where)} GROUP BY {group} ORDER BY {group}"
    return sql, args


def _totals(group: str | None, row: Sequence[Any]) -> Totals:
    # PostgreSQL sums BIGINT as NUMERIC (Decimal): plain numbers for JSON.
    return Totals(
        group=group,
        requests=int(row[0] or 0),
        errors=int(row[1] or 0),
        tokens_in=int(row[2] or 0),
        tokens_out=int(row[3] or 0),
        cost_usd=int(row[4] or 0) / NANO_USD,
        total_s=int(row[5] or 0) / MICROS,
    )


def add_up(groups: Iterable[Totals]) -> Totals:
    """One :class:`Totals` for several (the TOTAL line)."""
    out = Totals(group=None)
    for g in groups:
        out = Totals(
            group=None,
            requests=out.requests + g.requests,
            errors=out.errors + g.errors,
            tokens_in=out.tokens_in + g.tokens_in,
            tokens_out=out.tokens_out + g.tokens_out,
            cost_usd=out.cost_usd + g.cost_usd,
            total_s=out.total_s + g.total_s,
        )
    return out


async def usage_totals(backend: Backend, by: str, scope: tuple[str, str] | None, since: datetime) -> list[Totals]:
    """Sums per ``by`` group since ``since`` (rounded down to its minute), within ``scope`` (kind, id)."""
    sql, args = usage_query(by, scope, minute_of(since))
    rows = await backend.query("usage", sql, *args)
    return [_totals(r[0], r[1:]) for r in rows]


async def request_record(backend: Backend, request_id: str) -> dict[str, Any] | None:
    """One stored request, with the record's field names (``user``, ``stream`` as a bool), found by the
    gateway's id or else by the client's ``X-Request-Id``. A client may send one id with several
    requests: the newest is answered, and ``same_client_request_id`` lists the gateway's ids of the
    others (newest first)."""
    columns = ", ".join(REQUEST_COLUMNS)
    rows = await backend.query("usage", f"SELECT {columns} FROM {{requests}} WHERE request_id = ?", request_id)
    others: list[str] = []
    if not rows:
        rows = await backend.query(
            "usage",
            f"SELECT {columns} FROM {{requests}} WHERE client_request_id = ? ORDER BY at DESC, seq DESC",
            request_id,
        )
        others = [r[0] for r in rows[1:]]
    if not rows:
        return None
    out = dict(zip(REQUEST_COLUMNS, rows[0], strict=True))
    out["user"] = out.pop("user_name")
    out["stream"] = bool(out["stream"])
    if others:
        out["same_client_request_id"] = others
    return out


# -- budgets ---------------------------------------------------------------------------------------------


class RollupCost(msgspec.Struct, frozen=True):
    """The part of a rollup row that budgets read."""

    minute: str
    dimension: str
    value: str
    cost_nano_usd: int


def budget_spend(rows: Iterable[RollupCost], scope: tuple[str, str], period: str, now: datetime) -> float:
    """What ``scope`` (kind, id) has spent in the budget ``period`` holding ``now``: its rollups' cost since then."""
    kind, value = scope
    since = minute_of(period_start(period, now))
    nano = sum(r.cost_nano_usd for r in rows if r.dimension == kind and r.value == value and r.minute >= since)
    return nano / NANO_USD


async def spend(backend: Backend, scope: tuple[str, str], period: str, now: datetime) -> float:
    """:func:`budget_spend` over the rollups of ``scope`` read from the database."""
    kind, value = scope
    if kind not in DIMENSIONS:
        raise ScopeError(f"budgets are per {', '.join(DIMENSIONS)}, not {kind!r}")
    since = minute_of(period_start(period, now))
    rows = await backend.query(
        "usage",
        "SELECT minute, dimension, value, cost_nano_usd FROM {rollups} "
        "WHERE dimension = ? AND value = ? AND minute >= ?",
        kind,
        value,
        since,
    )
    return budget_spend((RollupCost(r[0], r[1], r[2], int(r[3])) for r in rows), scope, period, now)


def retention_cutoff(now: datetime, retention_days: float) -> datetime:
    return _utc(now) - timedelta(days=retention_days)
