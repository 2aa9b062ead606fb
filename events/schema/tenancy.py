"""Tenancy tree payloads (SPEC TEN-1): organisations → teams → projects.

The whole tree is one aggregate (``llmgw.evt.tenancy.tree``): names are unique among siblings
and a delete must see the children, so every change is decided against the whole tree and
appended with the tree's expected sequence. The tree is small (thousands of scopes at most).
"""

from __future__ import annotations

import msgspec

from llmgw.events.schema.registry import EventType

AGGREGATE = "tenancy"
TREE_ID = "tree"


class OrgCreated(msgspec.Struct, frozen=True, kw_only=True):
    org_id: str
    name: str


class OrgRenamed(msgspec.Struct, frozen=True, kw_only=True):
    org_id: str
    old_name: str
    name: str


class OrgDeleted(msgspec.Struct, frozen=True, kw_only=True):
    org_id: str
    name: str


class TeamCreated(msgspec.Struct, frozen=True, kw_only=True):
    team_id: str
    org_id: str
    name: str


class TeamRenamed(msgspec.Struct, frozen=True, kw_only=True):
    team_id: str
    old_name: str
    name: str


class TeamDeleted(msgspec.Struct, frozen=True, kw_only=True):
    team_id: str
    name: str


class ProjectCreated(msgspec.Struct, frozen=True, kw_only=True):
    project_id: str
    team_id: str
    name: str


class ProjectRenamed(msgspec.Struct, frozen=True, kw_only=True):
    project_id: str
    old_name: str
    name: str


class ProjectDeleted(msgspec.Struct, frozen=True, kw_only=True):
    project_id: str
    name: str


EVENTS = (
    EventType("org.created", 1, OrgCreated, "An organisation was created."),
    EventType("org.renamed", 1, OrgRenamed, "An organisation was renamed; its id stays."),
    EventType("org.deleted", 1, OrgDeleted, "An empty organisation was deleted."),
    EventType("team.created", 1, TeamCreated, "A team was created in an organisation."),
    EventType("team.renamed", 1, TeamRenamed, "A team was renamed; its id stays."),
    EventType("team.deleted", 1, TeamDeleted, "An empty team was deleted."),
    EventType("project.created", 1, ProjectCreated, "A project was created in a team."),
    EventType("project.renamed", 1, ProjectRenamed, "A project was renamed; its id stays."),
    EventType("project.deleted", 1, ProjectDeleted, "A project was deleted."),
)


# -- commands (strict: an unknown kind or field is refused) --------------------------------------

SERVICE = "tenancy"
SCOPE_KINDS = ("org", "team", "project")


class CreateScope(msgspec.Struct, frozen=True, kw_only=True, tag="create", forbid_unknown_fields=True):
    """Create ``org`` ``acme``, ``team`` ``acme/ml`` or ``project`` ``acme/ml/chat``."""

    kind: str
    path: str


class RenameScope(msgspec.Struct, frozen=True, kw_only=True, tag="rename", forbid_unknown_fields=True):
    """Give the scope at ``path`` the last-segment name ``name``; its id and children stay."""

    kind: str
    path: str
    name: str


class DeleteScope(msgspec.Struct, frozen=True, kw_only=True, tag="delete", forbid_unknown_fields=True):
    kind: str
    path: str


TenancyCommand = CreateScope | RenameScope | DeleteScope
