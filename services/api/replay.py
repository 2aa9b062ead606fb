"""``GET /api/v1/replay?until=TIME`` (SPEC EVT-2): nodes, models, replicas, the tenancy tree and
keys as they were at a moment, folded from the log into a scratch SQLite database that is
deleted afterwards. The live projections are not touched.

It starts from the newest replay snapshot at or before that moment (the three projections' rows,
saved every 10,000 events by the process that runs them: :mod:`llmgw.projections.replay_snapshots`)
and folds only the events after it; with none to trust it folds the log from 0, which costs what a
rebuild of those projections costs (minutes at a million events, against seconds from a snapshot:
docs/benchmarks.md, "Replay to a moment"). The answer's ``from_snapshot`` says which it did.

The answer is bounded: nodes, models, active replicas and scopes are the fleet's and the tree's size,
but keys only grow (a revoked key stays on the books: 150,000 at a million events), so the answer
counts them all, by state, and lists one page of them (``keys_limit``, oldest first) with the cursor
that asks for the next (``keys_next``; ``keys_after`` takes it back).
"""

from __future__ import annotations

import base64
import contextlib
import tempfile
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec

from llmgw.events.runtime.store import EventStore
from llmgw.projections.access import tenancy_paths
from llmgw.projections.backends import Backend, open_backend
from llmgw.projections.replay import position_at, replay_into
from llmgw.projections.replay_fold import TailFold
from llmgw.projections.replay_snapshots import replay_projections, start_from_snapshot
from llmgw.services.api.views import (
    ACCESS_COLUMNS,
    ACTIVE_STATES,
    FLEET_COLUMNS,
    KEYS_LIMIT,
    key_expired,
    shape_key,
    shape_model,
    shape_node,
)


class Replayed(msgspec.Struct, kw_only=True):
    """The projections folded up to a moment, in a scratch database open while the block lasts."""

    backend: Backend
    until: datetime
    position: int  # the last event folded: the last one stamped at or before ``until``; 0 for none
    last_event_at: datetime | None
    from_snapshot: int | None  # the snapshot the fold started from; None when it folded from 0
    events_folded: int


def keys_cursor(created_at: str, key_id: str) -> str:
    """The opaque cursor that asks for the keys after this one (in the order pages list them)."""
    return base64.urlsafe_b64encode(msgspec.json.encode([created_at, key_id])).decode().rstrip("=")


def parse_keys_cursor(cursor: str) -> tuple[str, str]:
    """(created_at, id) of the key a cursor names; ValueError naming what to give when it is not one."""
    try:
        created_at, key_id = msgspec.json.decode(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        if isinstance(created_at, str) and isinstance(key_id, str):
            return created_at, key_id
    except (ValueError, TypeError, msgspec.DecodeError):
        pass
    raise ValueError(f"keys_after {cursor!r} is not a cursor; give the keys_next of the page before, as it came")


@contextlib.asynccontextmanager
async def replayed(store: EventStore, when: datetime, *, from_snapshots: bool = True) -> AsyncIterator[Replayed]:
    """The projections folded up to ``when`` (from the newest replay snapshot before it, unless
    ``from_snapshots`` is false), in a scratch database deleted when the block ends."""
    position, stamped = await position_at(store, when)
    projections = replay_projections()
    with tempfile.TemporaryDirectory(prefix="llmgw-replay-") as tmp:
        database = Path(tmp) / "replay.db"
        start = None
        if from_snapshots and position > 0:
            start = await start_from_snapshot(store, database, position, projections)
        backend = await open_backend(f"sqlite:///{database}")
        try:
            after = start.after if start is not None else None
            async with TailFold(database) as fold:
                folded = await replay_into(store, backend, position, projections, after, commit=fold.commit)
            yield Replayed(
                backend=backend,
                until=when,
                position=position,
                last_event_at=stamped,
                from_snapshot=start.position if start is not None else None,
                events_folded=folded,
            )
        finally:
            await backend.close()


async def cluster_at(
    store: EventStore,
    when: datetime,
    *,
    from_snapshots: bool = True,
    keys_limit: int | None = KEYS_LIMIT,
    keys_after: str | None = None,
) -> dict[str, Any]:
    """The cluster at ``when``, as the admin API's live views show it now (heartbeat figures aside:
    they are telemetry, not events), with one page of keys. ``from_snapshots=False`` folds from 0
    whatever is saved; ``keys_limit=None`` lists every key (for comparisons, not for answers)."""
    async with replayed(store, when, from_snapshots=from_snapshots) as moment:
        return await answer(moment, keys_limit=keys_limit, keys_after=keys_after)


async def answer(
    moment: Replayed, *, keys_limit: int | None = KEYS_LIMIT, keys_after: str | None = None
) -> dict[str, Any]:
    """The API's answer for a replayed moment: where it is on the log, how it was folded, the views."""
    return {
        "until": moment.until.isoformat(),
        "position": moment.position,
        "last_event_at": moment.last_event_at.isoformat() if moment.last_event_at else None,
        "from_snapshot": moment.from_snapshot,
        "events_folded": moment.events_folded,
        **await _views(moment.backend, moment.until, keys_limit, keys_after),
    }


async def _views(backend: Backend, when: datetime, keys_limit: int | None, keys_after: str | None) -> dict[str, Any]:
    async def rows(projection: str, table: str, columns: list[str], tail: str = "", *args: Any) -> list[dict[str, Any]]:
        found = await backend.query(projection, f"SELECT {', '.join(columns)} FROM {{{table}}} {tail}", *args)
        return [dict(zip(columns, r, strict=True)) for r in found]

    nodes = await rows("fleet", "nodes", FLEET_COLUMNS["nodes"], "ORDER BY id")
    models = await rows("fleet", "models", FLEET_COLUMNS["models"], "ORDER BY name")
    # Only the active ones from SQL, sorted here: at a million events the table holds 267,000 replicas and
    # 5,000 are active; an ORDER BY there walked the model index over all of them (0.9 s against 0.1 s).
    states = ", ".join(f"'{state}'" for state in sorted(ACTIVE_STATES))
    found = await rows("fleet", "replicas", FLEET_COLUMNS["replicas"], f"WHERE state IN ({states})")
    active = sorted(found, key=lambda r: (r["model"], r["placed_at"] or ""))
    # Each node and model is handed only its own replicas (what the shapers count anyway): handed them
    # all, 1,000 nodes by 5,000 replicas took seconds.
    on_node: dict[str, list[dict[str, Any]]] = {}
    of_model: dict[str, list[dict[str, Any]]] = {}
    for r in active:
        on_node.setdefault(r["node_id"], []).append(r)
        of_model.setdefault(r["model"], []).append(r)
    nodes = [shape_node(n, on_node.get(n["id"], [])) for n in nodes]
    models = [shape_model(m, of_model.get(m["name"], [])) for m in models]
    paths = await tenancy_paths(backend)
    by_path = sorted(paths.items(), key=lambda item: item[1][1])
    scopes = [{"id": sid, "kind": kind, "path": path} for sid, (kind, path) in by_path]
    keys, keys_next = await _keys_page(backend, paths, when, keys_limit, keys_after)
    quotas = await rows("access", "quotas", ACCESS_COLUMNS["quotas"], "ORDER BY scope")
    held = quota_holdings(quotas, paths, models, active)
    counts = {"nodes": len(nodes), "models": len(models), "replicas": len(active), "scopes": len(scopes)}
    return {
        "counts": {**counts, "keys": await _keys_count(backend, when)},
        "nodes": nodes,
        "models": models,
        "replicas": active,
        "scopes": scopes,
        "quotas": held,
        "keys": keys,
        "keys_next": keys_next,
    }


def quota_holdings(
    quotas: list[dict[str, Any]],
    paths: dict[str, tuple[str, str]],
    models: list[dict[str, Any]],
    active: list[dict[str, Any]],
) -> list[dict[str, Any]]:
    """Each quota at the moment, named by path, with what its scope held then: the reservations of the
    active replicas of models whose owner is the scope or below it (SCHED-8). Pure."""
    owner_of = {m["name"]: (m.get("owner") or "").split(":", 1)[-1].strip("/") for m in models}
    out = []
    for q in quotas:
        kind, _, sid = q["scope"].partition(":")
        found = paths.get(sid)
        path = found[1] if found is not None else ""
        holds = {"gpus": 0, "cores": 0, "memory_bytes": 0}
        for r in active:
            owner = owner_of.get(r["model"], "")
            if path and owner and (owner == path or owner.startswith(path + "/")):
                holds["gpus"] += r.get("gpus") or 0
                holds["cores"] += r.get("cores") or 0
                holds["memory_bytes"] += r.get("memory_bytes") or 0
        out.append(
            {
                "scope": f"{kind}:{path}" if path else f"{q['scope']} (deleted)",
                "guarantee": {k: q[f"guarantee_{k}"] for k in ("gpus", "cores", "memory_bytes")},
                "limit": {k: q[f"limit_{k}"] for k in ("gpus", "cores", "memory_bytes")},
                "holds": holds,
            }
        )
    return out


async def _keys_page(
    backend: Backend, paths: dict[str, tuple[str, str]], when: datetime, limit: int | None, after: str | None
) -> tuple[list[dict[str, Any]], str | None]:
    """Keys oldest first, ``limit`` of them after the cursor ``after``, and the cursor for the next page."""
    if limit == 0:
        return [], None  # counts only
    columns = ACCESS_COLUMNS["keys"]
    where, args = "", []
    if after is not None:
        where, args = "WHERE (created_at, id) > (?, ?)", list(parse_keys_cursor(after))
    more = "" if limit is None else f"LIMIT {limit + 1}"  # one more than asked: is there a next page?
    found = await backend.query(
        "access", f"SELECT {', '.join(columns)} FROM {{keys}} {where} ORDER BY created_at, id {more}", *args
    )
    page = found if limit is None else found[:limit]
    keys = [shape_key(dict(zip(columns, r, strict=True)), paths, when) for r in page]
    following = (
        keys_cursor(keys[-1]["created_at"], keys[-1]["id"]) if limit is not None and len(found) > limit else None
    )
    return keys, following


async def _keys_count(backend: Backend, when: datetime) -> dict[str, int]:
    """Every key at ``when`` counted by the state :func:`shape_key` gives it (total, active, revoked, expired)."""
    [(total, revoked)] = await backend.query("access", "SELECT COUNT(*), COALESCE(SUM(revoked), 0) FROM {keys}")
    ends = await backend.query("access", "SELECT expires_at FROM {keys} WHERE revoked = 0 AND expires_at IS NOT NULL")
    expired = sum(1 for (at,) in ends if key_expired(at, when))
    return {"total": total, "active": total - revoked - expired, "revoked": revoked, "expired": expired}
