"""The admin HTTP API (``/api/v1/...``) over projections and the log, plus health and metrics.

Reads are consistent with what was acknowledged before them: a view first waits (bounded) for
its projection to reach the log's current position for the subjects it folds.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmgw.events import tenancy as T
from llmgw.events.store import EventStore
from llmgw.events.subjects import event_subject
from llmgw.projections.backends import Backend
from llmgw.projections.rebuild import rebuild, verify
from llmgw.projections.runner import ProjectionRunner

log = structlog.get_logger("llmgw.services.api")

READ_WAIT_S = 5.0


def error(status: int, message: str, code: str = "error") -> web.Response:
    return web.json_response({"error": {"message": message, "code": code}}, status=status)


class AdminApi:
    def __init__(
        self, store: EventStore, backend: Backend, runner: ProjectionRunner, registry: CollectorRegistry
    ) -> None:
        self.store = store
        self.backend = backend
        self.runner = runner
        self.registry = registry

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/api/v1/tree", self.tree)
        app.router.add_get("/api/v1/events/{id}", self.event)
        app.router.add_get("/api/v1/projections", self.projections)
        app.router.add_post("/api/v1/projections/rebuild", self.rebuild)
        app.router.add_post("/api/v1/projections/verify", self.verify)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status >= 400:
                return error(exc.status, exc.reason or "error")
            raise
        except Exception as exc:
            log.exception("admin API request failed", path=request.path)
            return error(500, f"internal error: {exc}; see the server log", "internal")

    async def healthz(self, request: web.Request) -> web.Response:
        connected = self.store.nc.is_connected
        body = {"status": "ok" if connected else "degraded", "nats": "connected" if connected else "disconnected"}
        return web.json_response(body, status=200 if connected else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        await self.runner.refresh_lag()
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _caught_up(self, projection: str, position: int) -> None:
        if not await self.runner.wait_until(projection, position, timeout=READ_WAIT_S):
            log.warning("read served from a lagging projection", projection=projection, position=position)

    async def tree(self, request: web.Request) -> web.Response:
        await self._caught_up("tenancy", await self.store.last_seq(event_subject(T.AGGREGATE, T.TREE_ID)))
        rows = await self.backend.query(
            "tenancy", "SELECT id, kind, name, parent_id, created_at, created_by FROM {scopes} ORDER BY name"
        )
        nodes = {
            r[0]: {"id": r[0], "kind": r[1], "name": r[2], "created_at": r[4], "created_by": r[5], "children": []}
            for r in rows
        }
        roots: list[dict] = []
        for r in rows:
            parent = r[3]
            (nodes[parent]["children"] if parent in nodes else roots).append(nodes[r[0]])
        for n in nodes.values():
            if n["kind"] == "project":
                del n["children"]
        return web.json_response({"orgs": roots})

    async def event(self, request: web.Request) -> web.Response:
        await self._caught_up("eventlog", await self.store.stream_last_seq())
        eid = request.match_info["id"]
        cols = "id, seq, type, subject, actor, at, causation, correlation"
        names = cols.split(", ")
        rows = await self.backend.query("eventlog", f"SELECT {cols} FROM {{events}} WHERE id = ?", eid)
        effects = await self.backend.query(
            "eventlog", f"SELECT {cols} FROM {{events}} WHERE causation = ? ORDER BY seq", eid
        )
        if not rows and not effects:
            return error(404, f"no event or command with id {eid}; `llmgw events tail` lists recent ones", "not_found")
        found: dict[str, Any] = dict(zip(names, rows[0], strict=True)) if rows else {"id": eid, "seq": None}
        found["effects"] = [dict(zip(names, r, strict=True)) for r in effects]
        cause_id = found.get("causation")
        if cause_id:
            cause = await self.backend.query("eventlog", f"SELECT {cols} FROM {{events}} WHERE id = ?", cause_id)
            found["cause"] = dict(zip(names, cause[0], strict=True)) if cause else None
        return web.json_response(found)

    async def projections(self, request: web.Request) -> web.Response:
        await self.runner.refresh_lag()
        return web.json_response({"projections": self.runner.status()})

    def _selected(self, request: web.Request) -> list[Any]:
        name = request.query.get("name")
        chosen = [p for p in self.runner.projections if name in (None, "", p.name)]
        if not chosen:
            known = ", ".join(p.name for p in self.runner.projections)
            raise web.HTTPNotFound(reason=f"no projection named {name!r} (known: {known})")
        return chosen

    async def rebuild(self, request: web.Request) -> web.Response:
        results = []
        for projection in self._selected(request):
            result = await rebuild(self.store, self.backend, projection, runner=self.runner)
            results.append({"name": projection.name, **result})
        return web.json_response({"rebuilt": results})

    async def verify(self, request: web.Request) -> web.Response:
        results = []
        for projection in self._selected(request):
            result = await verify(self.store, self.backend, projection, runner=self.runner)
            results.append({"name": projection.name, **result})
        return web.json_response({"verified": results, "identical": all(r["identical"] for r in results)})
