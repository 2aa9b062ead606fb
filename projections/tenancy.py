"""The tenancy tree as a table: one row per org, team and project (read by `ctl tree` and the API)."""

from __future__ import annotations

from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.projections.base import Projection, Tx

_INSERT = (
    "INSERT INTO {scopes} (id, kind, name, parent_id, created_at, created_by, updated_at) "
    "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET name = excluded.name, "
    "parent_id = excluded.parent_id, updated_at = excluded.updated_at"
)
_RENAME = "UPDATE {scopes} SET name = ?, updated_at = ? WHERE id = ?"
_DELETE = "DELETE FROM {scopes} WHERE id = ?"


class TenancyProjection(Projection):
    name = "tenancy"
    subject = f"llmgw.evt.{T.AGGREGATE}.>"
    tables = {
        "scopes": "id TEXT PRIMARY KEY, kind TEXT NOT NULL, name TEXT NOT NULL, parent_id TEXT, "
        "created_at TEXT NOT NULL, created_by TEXT NOT NULL, updated_at TEXT NOT NULL",
    }
    primary_keys = {"scopes": ["id"]}
    indexes = {"scopes": [["parent_id"]]}
    handlers = {
        "org.created": "created",
        "team.created": "created",
        "project.created": "created",
        "org.renamed": "renamed",
        "team.renamed": "renamed",
        "project.renamed": "renamed",
        "org.deleted": "deleted",
        "team.deleted": "deleted",
        "project.deleted": "deleted",
    }

    async def created(self, tx: Tx, e: RecordedEvent) -> None:
        p = e.payload
        at = e.envelope.at.isoformat()
        match p:
            case T.OrgCreated():
                row = (p.org_id, "org", p.name, None)
            case T.TeamCreated():
                row = (p.team_id, "team", p.name, p.org_id)
            case T.ProjectCreated():
                row = (p.project_id, "project", p.name, p.team_id)
            case _:
                return
        await tx.execute(_INSERT, *row, at, e.envelope.actor, at)

    async def renamed(self, tx: Tx, e: RecordedEvent) -> None:
        p = e.payload
        sid = getattr(p, "org_id", None) or getattr(p, "team_id", None) or getattr(p, "project_id", None)
        await tx.execute(_RENAME, p.name, e.envelope.at.isoformat(), sid)

    async def deleted(self, tx: Tx, e: RecordedEvent) -> None:
        p = e.payload
        sid = getattr(p, "org_id", None) or getattr(p, "team_id", None) or getattr(p, "project_id", None)
        await tx.execute(_DELETE, sid)
