"""MCP servers and their allow-lists folded from their events: the one place both are computed.

The mcp service decides on it, the routers answer ``/mcp`` from it, the admin API lists it.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from llmgw.events.schema import mcp as P
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of


class Grant(msgspec.Struct, frozen=True, kw_only=True):
    project_id: str
    key_id: str = ""  # "" : every key of the project
    tools: tuple[str, ...] = ()  # () : every tool

    def covers(self, tool: str) -> bool:
        return not self.tools or tool in self.tools


class Server(msgspec.Struct, kw_only=True):
    name: str
    url: str = ""
    command: tuple[str, ...] = ()
    headers: tuple[P.Header, ...] = ()
    env: tuple[P.EnvVar, ...] = ()
    timeout_s: float = 30.0
    grants: dict[tuple[str, str], Grant] = {}  # (project id, key id) -> its grant
    added_at: datetime
    changed_at: datetime

    @property
    def transport(self) -> str:
        return "http" if self.url else "stdio"

    @property
    def where(self) -> str:
        return self.url or " ".join(self.command)


class Access(msgspec.Struct, frozen=True, kw_only=True):
    """Whether a key may use a server's tool, and the grants that were looked at (for the refusal)."""

    allowed: bool
    grants: tuple[Grant, ...] = ()


class McpCatalog(msgspec.Struct, kw_only=True):
    servers: dict[str, Server] = {}
    position: int = 0

    @staticmethod
    def subject() -> str:
        return f"{EVENTS_ROOT}.{P.AGGREGATE}.>"

    def grants_for(self, server: str, project_id: str, key_id: str) -> tuple[Grant, ...]:
        """The grants of ``server`` that reach a key: its project's and its own."""
        s = self.servers.get(server)
        if s is None:
            return ()
        return tuple(g for (p, k), g in s.grants.items() if p == project_id and k in ("", key_id))

    def access(self, server: str, tool: str, project_id: str, key_id: str) -> Access:
        grants = self.grants_for(server, project_id, key_id)
        return Access(allowed=any(g.covers(tool) for g in grants), grants=grants)

    def usable(self, project_id: str, key_id: str) -> list[Server]:
        """The servers a key may use at least one tool of, by name."""
        return [s for name, s in sorted(self.servers.items()) if self.grants_for(name, project_id, key_id)]

    def apply(self, event: RecordedEvent) -> None:
        """Fold one event of ``llmgw.evt.mcp.>`` (others are ignored)."""
        self.position = max(self.position, event.seq)
        try:
            aggregate, _ = aggregate_of(event.subject)
        except ValueError:
            return
        if aggregate != P.AGGREGATE:
            return
        p, at = event.payload, event.envelope.at
        if isinstance(p, P.ServerSet):
            old = self.servers.get(p.name)
            self.servers[p.name] = Server(
                name=p.name,
                url=p.url,
                command=p.command,
                headers=p.headers,
                env=p.env,
                timeout_s=p.timeout_s,
                grants=old.grants if old else {},
                added_at=old.added_at if old else at,
                changed_at=at,
            )
        elif isinstance(p, P.ServerRemoved):
            self.servers.pop(p.name, None)
        elif isinstance(p, P.Allowed):
            s = self.servers.get(p.server)
            if s is not None:
                s.grants[(p.project_id, p.key_id)] = Grant(project_id=p.project_id, key_id=p.key_id, tools=p.tools)
        elif isinstance(p, P.Disallowed):
            s = self.servers.get(p.server)
            if s is not None:
                s.grants.pop((p.project_id, p.key_id), None)
