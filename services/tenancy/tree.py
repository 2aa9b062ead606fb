"""The tenancy tree as state folded from events, and the pure decisions over it (SPEC TEN-1).

Organisations hold teams; teams hold projects. A scope is named by its path (``acme``,
``acme/ml``, ``acme/ml/chat``) or its id; renames keep ids, so keys and quotas that name a
scope by id survive a rename.

The tree itself — its fold and the queries over it — is ``events/folds/tenancy.py``, shared with
the access service and the routers; this module holds the tenancy service's rules over it.
"""

from __future__ import annotations

import re

import msgspec

from llmgw.events.commands import roles as R
from llmgw.events.commands.shell import Decision
from llmgw.events.folds.tenancy import Scope, TenancyTree
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject

MAX_NAME = 63
_NAME = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")
RESERVED = frozenset({"all", "none", "system", "llmgw", "unknown"})
DEPTH = {"org": 1, "team": 2, "project": 3}
SUBJECT = event_subject(T.AGGREGATE, T.TREE_ID)  # the one tree: every tenancy event is on it


# -- decisions: pure functions of (tree, command) → payloads (decide: a Decision), or a refusal ------


def check_name(kind: str, name: str) -> None:
    """Refuse a name a path, a metric label or a URL could not carry, saying what would do."""
    why = (
        "names are lower-case letters, digits and single hyphens, start with a letter and are at most "
        f"{MAX_NAME} characters, because they appear in paths (acme/ml/chat), URLs and metric labels"
    )
    if not name:
        raise Rejected(f"a {kind} needs a name: {why}", "invalid_name")
    if len(name) > MAX_NAME:
        raise Rejected(f"{kind} name {name[:20]!r}… is {len(name)} characters long: {why}", "invalid_name")
    if not _NAME.match(name):
        suggestion = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
        hint = f"; try {suggestion!r}" if suggestion and _NAME.match(suggestion) else ""
        raise Rejected(f"{kind} name {name!r} is not allowed: {why}{hint}", "invalid_name")
    if name in RESERVED:
        raise Rejected(
            f"{kind} name {name!r} is reserved (reserved: {', '.join(sorted(RESERVED))}); choose another",
            "invalid_name",
        )


def _split(kind: str, path: str) -> list[str]:
    parts = path.strip().split("/")
    want = DEPTH[kind]
    if len(parts) != want:
        example = {"org": "acme", "team": "acme/ml", "project": "acme/ml/chat"}[kind]
        raise Rejected(
            f"{kind} path {path!r} has {len(parts)} part(s); a {kind} is named like {example!r}", "invalid_path"
        )
    return parts


def _check_kind(kind: str) -> None:
    if kind not in DEPTH:
        raise Rejected(f"unknown scope kind {kind!r}: use org, team or project", "invalid_kind")


def _require(tree: TenancyTree, kind: str, path: str) -> Scope:
    scope = tree.find(kind, path)
    if scope is None:
        listing = ", ".join(tree.path(s) for s in tree.scopes.values() if s.kind == kind)
        known = f" (known: {listing})" if listing and len(listing) < 300 else ""
        raise Rejected(f"there is no {kind} {path!r}{known}", "not_found")
    return scope


def decide_create(tree: TenancyTree, kind: str, path: str) -> list[msgspec.Struct]:
    _check_kind(kind)
    parts = _split(kind, path)
    name = parts[-1]
    check_name(kind, name)
    parent: Scope | None = None
    if kind != "org":
        parent_kind = "org" if kind == "team" else "team"
        parent_path = "/".join(parts[:-1])
        parent = tree.find(parent_kind, parent_path)
        if parent is None:
            create = f"llmgw ctl {parent_kind} create {parent_path}"
            raise Rejected(
                f"{kind} {path!r} needs {parent_kind} {parent_path!r}, which does not exist: `{create}` first",
                "parent_missing",
            )
    siblings = tree.children(parent.id if parent else None)
    if any(s.name == name for s in siblings):
        raise Rejected(f"{kind} {path!r} already exists", "exists")
    sid = new_id()
    if kind == "org":
        return [T.OrgCreated(org_id=sid, name=name)]
    if kind == "team":
        return [T.TeamCreated(team_id=sid, org_id=parent.id, name=name)]  # type: ignore[union-attr]
    return [T.ProjectCreated(project_id=sid, team_id=parent.id, name=name)]  # type: ignore[union-attr]


def decide_rename(tree: TenancyTree, kind: str, path: str, new_name: str) -> list[msgspec.Struct]:
    _check_kind(kind)
    scope = _require(tree, kind, path)
    check_name(kind, new_name)
    if new_name == scope.name:
        raise Rejected(f"{kind} {path!r} is already called {new_name!r}", "unchanged")
    if any(s.name == new_name for s in tree.children(scope.parent_id)):
        parent = tree.path(tree.scopes[scope.parent_id]) + "/" if scope.parent_id else ""
        raise Rejected(f"{kind} {parent}{new_name} already exists; choose another name", "exists")
    if kind == "org":
        return [T.OrgRenamed(org_id=scope.id, old_name=scope.name, name=new_name)]
    if kind == "team":
        return [T.TeamRenamed(team_id=scope.id, old_name=scope.name, name=new_name)]
    return [T.ProjectRenamed(project_id=scope.id, old_name=scope.name, name=new_name)]


def decide_delete(tree: TenancyTree, kind: str, path: str) -> list[msgspec.Struct]:
    _check_kind(kind)
    scope = _require(tree, kind, path)
    children = tree.children(scope.id)
    if children:
        what = "team" if kind == "org" else "project"
        names = ", ".join(c.name for c in children[:10]) + (" …" if len(children) > 10 else "")
        plural = "s" if len(children) != 1 else ""
        raise Rejected(
            f"{kind} {tree.path(scope)} still holds {len(children)} {what}{plural} ({names}); "
            f"delete {'them' if plural else 'it'} first",
            "not_empty",
        )
    keys = tree.live_keys.get(scope.id, {})
    if keys:
        names = sorted(keys.values())
        shown = ", ".join(names[:10]) + (" …" if len(names) > 10 else "")
        plural = "s" if len(names) != 1 else ""
        where = tree.path(scope)
        raise Rejected(
            f"{kind} {where} still holds {len(names)} key{plural} ({shown}); revoke {'them' if plural else 'it'} "
            f"first (`llmgw ctl key list --project {where}`, `llmgw ctl key revoke ID`)",
            "has_keys",
        )
    if kind == "org":
        return [T.OrgDeleted(org_id=scope.id, name=scope.name)]
    if kind == "team":
        return [T.TeamDeleted(team_id=scope.id, name=scope.name)]
    return [T.ProjectDeleted(project_id=scope.id, name=scope.name)]


def decide(tree: TenancyTree, command: T.TenancyCommand) -> Decision:
    """The tree's events for ``command`` (on the one tree subject), or a refusal."""
    match command:
        case T.CreateScope():
            payloads = decide_create(tree, command.kind, command.path)
        case T.RenameScope():
            payloads = decide_rename(tree, command.kind, command.path, command.name)
        case T.DeleteScope():
            payloads = decide_delete(tree, command.kind, command.path)
        case _:
            raise Rejected(f"unknown tenancy command {type(command).__name__}")
    return Decision(subject=SUBJECT, payloads=payloads, message=describe(command), result={"id": scope_id(payloads[0])})


def describe(command: T.TenancyCommand) -> str:
    match command:
        case T.CreateScope():
            return f"{command.kind} {command.path} created"
        case T.RenameScope():
            return f"{command.kind} {command.path} renamed to {command.name}"
        case T.DeleteScope():
            return f"{command.kind} {command.path} deleted"
    return "done"


def scope_id(payload: msgspec.Struct) -> str:
    for field in ("project_id", "team_id", "org_id"):  # most specific first: a team names its org too
        if hasattr(payload, field):
            return getattr(payload, field)
    return ""


# The role over the parent each kind of tenant is managed by: orgs by the cluster's admins, a team by its
# org's admins, a project by its team's admins.
_MANAGED_BY = {"org": ("cluster-admin", "cluster"), "team": ("org-admin", "org"), "project": ("team-admin", "team")}


def need(c: T.TenancyCommand) -> R.Need:
    """The role a person needs to send ``c`` (pure): an admin of the tenant's parent, named by path.

    A new tenant is checked against its parent's path; a rename or delete against the tenant itself,
    whose chain reaches its parent (an id works there too)."""
    verb = {T.CreateScope: "creating", T.RenameScope: "renaming", T.DeleteScope: "deleting"}[type(c)]
    role, parent_kind = _MANAGED_BY.get(c.kind, ("cluster-admin", "cluster"))
    what = f"{verb} {c.kind} {c.path}"
    if parent_kind == "cluster":
        return R.Need(role=role, what=what)
    if isinstance(c, T.CreateScope):
        return R.Need(role=role, what=what, kind=parent_kind, tenant=c.path.rpartition("/")[0])
    return R.Need(role=role, what=what, kind=c.kind, tenant=c.path)
