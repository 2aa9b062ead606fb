"""The gateway's HTTP surface. For now health only; the OpenAI-compatible API lands here (GW-1)."""

from __future__ import annotations

from aiohttp import web

from llmgw.events.store import EventStore


def build_gateway_app(store: EventStore) -> web.Application:
    async def healthz(request: web.Request) -> web.Response:
        connected = store.nc.is_connected
        body = {"status": "ok" if connected else "degraded", "nats": "connected" if connected else "disconnected"}
        return web.json_response(body, status=200 if connected else 503)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    return app
