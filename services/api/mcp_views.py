"""The admin API's view of the MCP servers behind the gateway (issue 26): ``GET /api/v1/mcp/servers``.

Folded from the log at each call (a handful of small aggregates), so a server added a moment ago is
listed at once and the API keeps no follower of its own for it. A header's value never reaches the log,
so it cannot reach this view: only the name of the environment variable the routers read it from.
Needs a viewer of the cluster (app.py's ``_authorize``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from llmgw.events.folds.mcp import McpCatalog, Server
from llmgw.events.runtime.store import EventStore

SERVERS_PATH = "/api/v1/mcp/servers"


def server_view(s: Server, label: Callable[[str], str]) -> dict[str, Any]:
    """One server as the view shows it: where it is, the names of its secrets' variables, its grants."""
    return {
        "name": s.name,
        "transport": s.transport,  # http | stdio
        "url": s.url,
        "command": list(s.command),
        "headers": [msgspec.to_builtins(h) for h in s.headers],  # {name, env}: never a value
        "env": [msgspec.to_builtins(e) for e in s.env],
        "timeout_s": s.timeout_s,
        "grants": [
            {
                "project_id": g.project_id,
                "project": label(f"project:{g.project_id}").removeprefix("project:"),
                "key_id": g.key_id,
                "tools": list(g.tools),  # [] : every tool
            }
            for g in sorted(s.grants.values(), key=lambda g: (g.project_id, g.key_id))
        ],
        "added_at": s.added_at.isoformat(),
        "changed_at": s.changed_at.isoformat(),
    }


def servers_view(catalog: McpCatalog, label: Callable[[str], str]) -> list[dict[str, Any]]:
    return [server_view(s, label) for _, s in sorted(catalog.servers.items())]


class McpViews:
    def __init__(self, store: EventStore, label: Callable[[str], str]) -> None:
        self.store = store
        self.label = label

    def routes(self, app: web.Application) -> None:
        app.router.add_get(SERVERS_PATH, self.servers)

    async def servers(self, request: web.Request) -> web.Response:
        """``GET /api/v1/mcp/servers``: every MCP server, how it is reached, and who may use which tools."""
        catalog = McpCatalog()
        for event in await self.store.read(McpCatalog.subject()):
            catalog.apply(event)
        return web.json_response(servers_view(catalog, self.label))
