"""``GET /api/v1/replay?until=TIME`` (SPEC EVT-2): nodes, models, replicas, the tenancy tree and
keys as they were at a moment, folded from the log into a scratch SQLite database that is
deleted afterwards. The live projections are not touched.

It starts from the newest replay snapshot at or before that moment (the three projections' rows,
saved every 10,000 events by the process that runs them: :mod:`llmgw.projections.replay_snapshots`)
and folds only the events after it; with none to trust it folds the log from 0, which costs what a
rebuild of those projections costs (minutes at a million events, against seconds from a snapshot:
docs/benchmarks.md, "Replay to a moment"). The answer's ``from_snapshot`` says which it did.
"""

from __future__ import annotations

import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from llmgw.events.store import EventStore
from llmgw.projections.access import tenancy_paths
from llmgw.projections.backends import Backend, open_backend
from llmgw.projections.replay import position_at, replay_into
from llmgw.projections.replay_snapshots import replay_projections, start_from_snapshot
from llmgw.services.api.views import ACCESS_COLUMNS, ACTIVE_STATES, FLEET_COLUMNS, shape_key, shape_model, shape_node


async def cluster_at(store: EventStore, when: datetime, *, from_snapshots: bool = True) -> dict[str, Any]:
    """The cluster at ``when``, as the admin API's live views show it now (heartbeat figures aside:
    they are telemetry, not events). ``from_snapshots=False`` folds from 0 whatever is saved."""
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
            folded = await replay_into(store, backend, position, projections, after)
            return {
                "until": when.isoformat(),
                "position": position,
                "last_event_at": stamped.isoformat() if stamped else None,
                "from_snapshot": start.position if start is not None else None,
                "events_folded": folded,
                **await _views(backend, when),
            }
        finally:
            await backend.close()


async def _views(backend: Backend, when: datetime) -> dict[str, Any]:
    async def rows(projection: str, table: str, columns: list[str], tail: str = "") -> list[dict[str, Any]]:
        found = await backend.query(projection, f"SELECT {', '.join(columns)} FROM {{{table}}} {tail}")
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
    keys = [
        shape_key(k, paths, when)
        for k in await rows("access", "keys", ACCESS_COLUMNS["keys"], "ORDER BY created_at, id")
    ]
    by_path = sorted(paths.items(), key=lambda item: item[1][1])
    scopes = [{"id": sid, "kind": kind, "path": path} for sid, (kind, path) in by_path]
    return {"nodes": nodes, "models": models, "replicas": active, "scopes": scopes, "keys": keys}
