"""The people page (issue 24, item 4): who may sign in, their roles and their tokens; add, disable and
enable people, grant and revoke roles, create (shown once) and revoke personal tokens.

A password is hashed here, on the server, with argon2id as `llmgw ctl user add` hashes it, and only the
hash is sent; a token is made here and only its hash is sent. A team admin sees the people who hold a
role within what it may view.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from llmgw.events.commands import roles as R
from llmgw.events.folds.people import People
from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.schema import people as P
from llmgw.services.api.act import Outcome
from llmgw.services.console.forms import BadInput, refused
from llmgw.services.console.page import Ctx, Page
from llmgw.services.console.pages.tenants import KINDS, May, Visible, choices, whole
from llmgw.services.console.source import marked
from llmgw.services.people.rules import need as people_need


def _rows(people: People, tree: TenancyTree, ctx: Ctx, visible: Visible) -> list[dict[str, Any]]:
    out = []
    for p in sorted(people.by_name.values(), key=lambda p: p.name):
        roles = [
            {"role": role, "scope": scope, "label": tree.label(scope), "via": p.via(role, scope)}
            for role, scope in p.roles
        ]
        mine = f"user:{p.name}" == ctx.who.actor
        if not (visible.everything or mine or any(visible(*_split(r["scope"])) for r in roles)):
            continue
        out.append(
            {
                "id": p.name,
                "name": p.name,
                "display_name": p.display_name,
                "disabled": p.disabled,
                "disabled_reason": p.disabled_reason,
                "source": p.source,  # "" : added here with a password; idp:NAME, scim: made by that provider
                "login": p.login,
                "state": "disabled" if p.disabled else "active",
                "added_at": p.added_at,
                "roles": roles,
                "roles_text": ", ".join(f"{r['role']} of {r['label']}" for r in roles),
                "tokens": sorted(
                    (
                        {
                            "id": t.token_id,
                            "prefix": t.prefix,
                            "kind": t.kind,
                            "label": t.label,
                            "method": t.method,
                            "issued_at": t.issued_at,
                            "expires_at": t.expires_at,
                        }
                        for t in p.tokens.values()
                    ),
                    key=lambda t: t["issued_at"],
                ),
                "token_count": len(p.tokens),
            }
        )
    return out


def _split(scope: str) -> tuple[str, str]:
    kind, _, tenant = scope.partition(":")
    return (kind, tenant) if kind in KINDS else ("", "")


async def gather(ctx: Ctx) -> dict[str, Any]:
    visible = Visible(ctx)
    people = _rows(await ctx.source.people(), await ctx.source.tree(), ctx, visible)
    if ctx.at is not None:
        now = _rows(await ctx.now.people(), await ctx.now.tree(), ctx, visible)
        people = marked(people, now, fields=("state", "roles_text", "token_count", "display_name"))
    controls = ctx.at is None
    may = May(ctx)
    actor = ctx.who.actor
    tree = await ctx.now.tree()
    # The scopes a role may be granted over here: where granting the least role would be allowed.
    scopes = [{"value": "cluster", "label": "cluster"}] if ctx.can("cluster-admin") else []
    for s in sorted(tree.scopes.values(), key=lambda s: (s.kind, tree.path(s))):
        # By id: a path is found by walking the tree's children, an id at once (1,000 projects: 0.5 s against none).
        value = f"{s.kind}:{s.id}"
        if may(people_need(actor, P.GrantRole(name="", role="viewer", scope=value))):
            scopes.append({"value": value, "label": f"{s.kind}:{tree.path(s)}"})
    may_admin = controls and may(people_need(actor, P.AddUser(name="", password_hash="")))
    for p in people:
        own = f"user:{p['name']}" == actor
        p["may_disable"] = may_admin and p.get("_diff") is None and not own
        p["may_tokens"] = (
            controls and p.get("_diff") is None and may(people_need(actor, P.RevokeToken(name=p["name"], token="")))
        )
        p["may_revoke_roles"] = (
            controls
            and p.get("_diff") is None
            and [
                r
                for r in p["roles"]
                if may(people_need(actor, P.RevokeRole(name=p["name"], role=r["role"], scope=r["scope"])))
            ]
        )
    return {
        "people": people,
        "roles": R.ROLES,
        "grant_scopes": scopes if controls else [],
        "grant_choices": choices(o["label"] for o in scopes) if controls else "",
        "may_add": may_admin,
        "controls": controls,
        "me": ctx.who.name,
    }


# -- acting ---------------------------------------------------------------------------------------


async def add_user(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    """Add a person: the password is checked and hashed here (argon2id, off the event loop), never sent."""
    from llmgw.services.people.passwords import password_problem

    kind = f"{P.SERVICE}.user.add"
    name = (form.get("name") or "").strip()
    password = form.get("password") or ""
    if not P.NAME_RE.match(name):
        return refused(kind, f"name {name!r}: lower-case letters, digits, '.', '_' or '-', starting with a letter")
    if password != (form.get("password2") or password):
        return refused(kind, "the two passwords differ: type the same one twice")
    problem = password_problem(password)
    if problem is not None:
        return refused(kind, problem)
    signin = ctx.api.signin
    assert signin is not None  # a signed-in page has one
    password_hash = await signin.checker.hash(password)  # bounded with the sign-ins, at low priority
    add = P.AddUser(name=name, password_hash=password_hash, display_name=(form.get("display_name") or "").strip())
    return await ctx.act(P.SERVICE, "user.add", add)


async def disable_user(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    name = (form.get("name") or "").strip()
    if not name:
        return refused(f"{P.SERVICE}.user.disable", "say whom to disable")
    return await ctx.act(P.SERVICE, "user.disable", P.DisableUser(name=name, reason=(form.get("reason") or "").strip()))


async def enable_user(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    name = (form.get("name") or "").strip()
    if not name:
        return refused(f"{P.SERVICE}.user.enable", "say whom to enable")
    return await ctx.act(P.SERVICE, "user.enable", P.EnableUser(name=name))


def _role_form(form: Mapping[str, str]) -> tuple[str, str, str] | str:
    name, role, scope = ((form.get(f) or "").strip() for f in ("name", "role", "scope"))
    if not name or role not in R.ROLES or not scope:
        return f"give a person, a role ({', '.join(R.ROLES)}) and a scope (cluster, org:…, team:…, project:…)"
    return name, role, scope


async def grant_role(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    got = _role_form(form)
    if isinstance(got, str):
        return refused(f"{P.SERVICE}.role.grant", got)
    name, role, scope = got
    return await ctx.act(P.SERVICE, "role.grant", P.GrantRole(name=name, role=role, scope=scope))


async def revoke_role(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    got = _role_form(form)
    if isinstance(got, str):
        return refused(f"{P.SERVICE}.role.revoke", got)
    name, role, scope = got
    return await ctx.act(P.SERVICE, "role.revoke", P.RevokeRole(name=name, role=role, scope=scope))


async def create_token(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    """A personal access token made here, as `llmgw ctl token create` makes it: only its hash is sent;
    the token is handed back once in the outcome's result."""
    kind = f"{P.SERVICE}.token.issue"
    name = (form.get("name") or "").strip() or ctx.who.name
    try:
        days = whole(form, "days", minimum=1)
        if days is not None and days > 36_500:
            raise BadInput("days: at most 36,500 (a hundred years); leave it blank for a token that never expires")
    except BadInput as exc:
        return refused(kind, str(exc))
    expires = datetime.now(UTC) + timedelta(days=days) if days else None
    secret, issue = P.issue(name, "personal", label=(form.get("label") or "").strip(), expires_at=expires)
    out = await ctx.act(P.SERVICE, "token.issue", issue)
    if out.applied:
        out.result = {**out.result, "secret": secret, "prefix": issue.prefix}
    return out


async def revoke_token(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    name, token = (form.get("name") or "").strip(), (form.get("token") or "").strip()
    if not name or not token:
        return refused(f"{P.SERVICE}.token.revoke", "say whose token and which (its id or prefix)")
    reason = (form.get("reason") or "").strip()
    return await ctx.act(P.SERVICE, "token.revoke", P.RevokeToken(name=name, token=token, reason=reason))


PAGES = [
    Page(
        path="/console/people",
        name="people",
        title="people.nav",
        template="people.html",
        gather=gather,
        actions={
            "user_add": add_user,
            "user_disable": disable_user,
            "user_enable": enable_user,
            "role_grant": grant_role,
            "role_revoke": revoke_role,
            "token_create": create_token,
            "token_revoke": revoke_token,
        },
        live=("user", "tenancy"),
        scope="tenant",
    )
]
