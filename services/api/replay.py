"""``GET /api/v1/replay?until=TIME`` (SPEC EVT-2): nodes, models, replicas, the tenancy tree and
keys as they were at a moment, folded from the log into a scratch SQLite database that is
deleted afterwards. The live projections are not touched.

It folds the whole log up to that moment, so it costs what a rebuild of those three projections
costs (docs/benchmarks.md: about 40 s per million events on SQLite); it is an audit tool, not a
view to poll.
"""

from __future__ import annotations

import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from llmgw.events.store import EventStore
from llmgw.projections.access import AccessProjection, tenancy_paths
from llmgw.projections.backends import Backend, open_backend
from llmgw.projections.fleet import FleetProjection
from llmgw.projections.replay import position_at, replay_into
from llmgw.projections.tenancy import TenancyProjection
from llmgw.services.api.views import ACCESS_COLUMNS, ACTIVE_STATES, FLEET_COLUMNS, shape_key, shape_model, shape_node


async def cluster_at(store: EventStore, when: datetime) -> dict[str, Any]:
    """The cluster at ``when``, as the admin API's live views show it now (heartbeat figures aside:
    they are telemetry, not events)."""
    position, stamped = await position_at(store, when)
    with tempfile.TemporaryDirectory(prefix="llmgw-replay-") as tmp:
        backend = await open_backend(f"sqlite:///{Path(tmp) / 'replay.db'}")
        try:
            folded = await replay_into(
                store, backend, position, [TenancyProjection(), FleetProjection(), AccessProjection()]
            )
            return {
                "until": when.isoformat(),
                "position": position,
                "last_event_at": stamped.isoformat() if stamped else None,
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
    replicas = await rows("fleet", "replicas", FLEET_COLUMNS["replicas"], "ORDER BY model, placed_at")
    active = [r for r in replicas if r["state"] in ACTIVE_STATES]
    nodes = [shape_node(n, active) for n in nodes]
    models = [shape_model(m, active) for m in models]
    paths = await tenancy_paths(backend)
    keys = [
        shape_key(k, paths, when)
        for k in await rows("access", "keys", ACCESS_COLUMNS["keys"], "ORDER BY created_at, id")
    ]
    by_path = sorted(paths.items(), key=lambda item: item[1][1])
    scopes = [{"id": sid, "kind": kind, "path": path} for sid, (kind, path) in by_path]
    return {"nodes": nodes, "models": models, "replicas": active, "scopes": scopes, "keys": keys}
