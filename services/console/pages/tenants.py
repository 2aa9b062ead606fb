"""The tenants page (issue 24, item 4): the tree, keys (created and shown once, revoked), limits,
budgets with their spend, quotas with what their scopes hold.

A person sees the tenants they may view (a team admin: its team's projects and keys) and a control
only where the command it sends would be allowed (the services' own ``need`` rules); the service
decides all the same. In the past (the time slider) every table is the replay's, marked against now.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import msgspec
from babel.numbers import get_decimal_symbol, get_group_symbol
from markupsafe import Markup, escape

from llmgw.events.commands import roles as R
from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.schema import access as A
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import utc_now
from llmgw.projections.access import scope_path
from llmgw.projections.usage import NANO_USD, minute_of, period_start
from llmgw.services.access.rules import AccessState
from llmgw.services.access.rules import need as access_need
from llmgw.services.api.act import Outcome
from llmgw.services.api.replay import quota_holdings
from llmgw.services.api.views import ACCESS_COLUMNS, ACTIVE_STATES, key_expired, shape_key, shape_model
from llmgw.services.console.forms import BadInput, refused
from llmgw.services.console.page import Ctx, Page
from llmgw.services.console.source import Source, marked
from llmgw.services.tenancy.quotas import need_quota
from llmgw.services.tenancy.tree import need as tree_need

KEYS_PER_PAGE = 50
ROWS_PER_PAGE = 50  # limits and budgets
TREE_PROJECTS = 200  # past this many projects the tree lists a team's projects when it is opened
GiB = 1024**3
MAX_NUMBER = 10**12  # more than any limit, budget or quota means; past it a form's number is a mistake
_DURATION = re.compile(r"^(\d+)([mhdw])$")
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}
KINDS = ("org", "team", "project")


# -- small pieces the other pages of this area share ------------------------------------------------


def whole(form: Mapping[str, str], name: str, *, minimum: int = 0) -> int | None:
    """A form's whole-number field, None when left blank."""
    text = (form.get(name) or "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        raise BadInput(f"{name} {text!r} is not a whole number: write one such as 60, or leave it blank") from None
    if not minimum <= value <= MAX_NUMBER:
        raise BadInput(f"{name} must be from {minimum} to {MAX_NUMBER:g}")
    return value


def decimal(form: Mapping[str, str], name: str) -> float | None:
    """A form's number field (``12.5``), None when left blank."""
    text = (form.get(name) or "").strip()
    if not text:
        return None
    try:
        value = float(text)
    except ValueError:
        raise BadInput(f"{name} {text!r} is not a number: write one such as 12.5, or leave it blank") from None
    if not 0 <= value <= MAX_NUMBER:  # NaN fails this too
        raise BadInput(f"{name} must be a number from 0 to {MAX_NUMBER:g}")
    return value


def parse_expiry(text: str, now: datetime) -> datetime | None:
    """A duration from ``now`` (``90m``, ``12h``, ``30d``, ``2w``) or an ISO date or time (UTC if no zone)."""
    t = text.strip()
    if not t:
        return None
    m = _DURATION.match(t)
    if m:
        try:
            return now + timedelta(**{_UNITS[m.group(2)]: int(m.group(1))})
        except OverflowError:
            raise BadInput(f"expires {text!r} is further off than a calendar reaches: give a nearer time") from None
    try:
        when = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise BadInput(
            f"expires {text!r} is neither a duration (90m, 12h, 30d, 2w) nor a date (2026-01-31 or 2026-01-31T12:00Z)"
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def paged(
    rows: list[dict[str, Any]], query: Mapping[str, str], name: str, size: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One page of ``rows`` (``?NAME=N``, from 1) and what a pager shows: its name, the page, the pages,
    the rows in all, and the query to keep."""
    try:
        page = max(int(query.get(name, "1")), 1)
    except ValueError:
        page = 1
    pages = max((len(rows) + size - 1) // size, 1)
    page = min(page, pages)
    keep = {k: v for k, v in query.items() if k != name}
    return rows[(page - 1) * size : page * size], {
        "name": name,
        "page": page,
        "pages": pages,
        "total": len(rows),
        "keep": keep,
    }


class Numbers:
    """Numbers in the reader's form, made with the language's symbols once: a chart and its table write
    hundreds of figures, and Babel's own formatting costs a fraction of a millisecond each."""

    def __init__(self, lang: str) -> None:
        self.lang = lang
        self.group, self.decimal = get_group_symbol(lang), get_decimal_symbol(lang)

    def _local(self, text: str) -> str:
        return text.replace(",", "\0").replace(".", self.decimal).replace("\0", self.group)

    def integer(self, x: float) -> str:
        return self._local(f"{round(x):,}")

    def usd(self, x: float) -> str:
        text = self._local(f"{x:,.4f}" if x < 1 else f"{x:,.2f}")
        return f"${text}" if self.lang == "en" else f"{text} $"


def choices(values: Iterable[str]) -> Markup:
    """A datalist's options, escaped and joined here: a thousand of them through the template took 50 ms."""
    return Markup("".join(f'<option value="{escape(v)}">' for v in values))


class May:
    """``ctx.may`` with the cluster admins' answer known at once: a cluster admin may send any command, so
    the thousands of tenants a page offers are not each walked up the tree for them."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.admin = ctx.can("cluster-admin")

    def __call__(self, need: R.Need | None) -> bool:
        return self.admin or self.ctx.may(need)


class Visible:
    """Which tenants the signed-in person may view, answered once per tenant (a page asks per row)."""

    def __init__(self, ctx: Ctx) -> None:
        self.ctx = ctx
        self.everything = ctx.can("viewer")
        self._seen: dict[tuple[str, str], bool] = {}

    def __call__(self, kind: str, tenant: str) -> bool:
        if self.everything:
            return True
        if kind not in KINDS or not tenant:
            return False
        found = self._seen.get((kind, tenant))
        if found is None:
            found = self._seen[(kind, tenant)] = self.ctx.can("viewer", kind, tenant)
        return found

    def scope(self, scope: str, key_projects: Mapping[str, str]) -> bool:
        """A scope as on the log (``team:<id>``, ``key:<id>``): a key's is its project's."""
        kind, _, sid = scope.partition(":")
        if kind == "key":
            return self(("project"), key_projects.get(sid, ""))
        return self(kind, sid)


def tree_rows(
    tree: TenancyTree, visible: Visible, live_keys: Mapping[str, int], open_team: str = ""
) -> list[dict[str, Any]]:
    """The tree as rows (depth first), each scope the person may view with those above it for context;
    ``live_keys``: the active keys of each project, by its id. Past :data:`TREE_PROJECTS` projects, a
    team's projects are listed only when it is opened (``open_team``, its id): its row counts them."""
    shown: set[str] = set()
    for s in tree.scopes.values():
        if visible(s.kind, s.id):
            shown.add(s.id)
            parent = s.parent_id
            while parent is not None and parent in tree.scopes:
                shown.add(parent)
                parent = tree.scopes[parent].parent_id
    rows: list[dict[str, Any]] = []
    children: dict[str | None, list[Any]] = {}
    for s in sorted((tree.scopes[sid] for sid in shown), key=lambda s: s.name):
        children.setdefault(s.parent_id, []).append(s)  # once: tree.children sorts every scope per call

    projects = sum(1 for sid in shown if tree.scopes[sid].kind == "project")
    folded = projects > TREE_PROJECTS

    def walk(parent: str | None, depth: int) -> None:
        for s in children.get(parent, []):
            if s.kind == "project" and folded and parent != open_team:
                continue
            rows.append(
                {
                    "id": s.id,
                    "kind": s.kind,
                    "name": s.name,
                    "path": tree.path(s),
                    "depth": depth,
                    "context_only": not visible(s.kind, s.id),
                    "live_keys": live_keys.get(s.id, 0) if s.kind == "project" else None,
                    "projects": len(children.get(s.id, [])) if s.kind == "team" else None,
                    "folded": folded and s.kind == "team" and s.id != open_team,
                }
            )
            walk(s.id, depth + 1)

    walk(None, 0)
    return rows


# -- reading --------------------------------------------------------------------------------------


INDEX = ("id", "name", "project_id", "revoked", "expires_at")


async def _key_index(source: Source) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
    """Every key, newest first, as the few columns a page filters and counts by (the rows themselves are
    read a page at a time: 10,000 whole rows cost more than the page), and the tenancy paths."""
    _, paths = await source.access("keys", "WHERE 0 = 1")  # waits for the projections to catch up, once
    found = await source.backend.query(
        "access", f"SELECT {', '.join(INDEX)} FROM {{keys}} ORDER BY created_at DESC, id DESC"
    )
    return [dict(zip(INDEX, r, strict=True)) for r in found], paths


async def _key_rows(source: Source, ids: list[str]) -> dict[str, dict[str, Any]]:
    """The whole rows of the keys ``ids``, by id."""
    if not ids:
        return {}
    cols = ACCESS_COLUMNS["keys"]
    marks = ", ".join("?" * len(ids))
    found = await source.backend.query("access", f"SELECT {', '.join(cols)} FROM {{keys}} WHERE id IN ({marks})", *ids)
    return {r[0]: dict(zip(cols, r, strict=True)) for r in found}


KEY_FIELDS = ("state", "name", "rpm", "tpm", "expires_at")  # what a key's mark in the past compares


def _mark_key(
    then: dict[str, Any] | None, now: dict[str, Any] | None, paths: dict[str, tuple[str, str]], when: datetime
) -> dict[str, Any]:
    """A key as it was at ``when``, shaped and marked against the same key now (or marked added, or gone)."""
    if then is None:
        assert now is not None
        return {**shape_key(dict(now), paths, utc_now()), "_diff": "added", "_changed": []}
    current = [shape_key(dict(now), paths, utc_now())] if now is not None else []
    return marked([shape_key(dict(then), paths, when)], current, fields=KEY_FIELDS)[0]


class Scoped:
    """A page of an access table keyed by scope (limits, budgets): every scope read, the person's kept
    and named by path, one page of them read whole (10,000 key limits: the page, not the book), and in
    the past each marked against now."""

    def __init__(
        self,
        ctx: Ctx,
        visible: Visible,
        key_projects: Mapping[str, str],
        paths: dict[str, tuple[str, str]],
        names: dict[str, str],
    ) -> None:
        self.ctx, self.visible, self.key_projects, self.paths, self.names = ctx, visible, key_projects, paths, names

    async def _scopes(self, source: Source, table: str) -> list[str]:
        found = await source.backend.query("access", f"SELECT scope FROM {{{table}}}")
        if self.visible.everything:
            return [r[0] for r in found]
        return [r[0] for r in found if self.visible.scope(r[0], self.key_projects)]

    async def _whole(self, source: Source, table: str, scopes: list[str]) -> dict[str, dict[str, Any]]:
        if not scopes:
            return {}
        marks = ", ".join("?" * len(scopes))
        rows = await _rows(source, table, f"WHERE scope IN ({marks})", *scopes)
        return {r["scope"]: r for r in rows}

    async def page(self, table: str, name: str, fields: tuple[str, ...]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        ctx = self.ctx
        scopes = await self._scopes(ctx.source, table)
        added: set[str] = set()
        if ctx.at is not None:
            then = set(scopes)
            added = {sc for sc in await self._scopes(ctx.now, table) if sc not in then}
            scopes += sorted(added)
        named = sorted((scope_path(sc, self.paths, self.names), sc) for sc in scopes)
        shown, paging = paged([{"path": p, "id": sc} for p, sc in named], ctx.query, name, ROWS_PER_PAGE)
        ids = [r["id"] for r in shown]
        then_rows = await self._whole(ctx.source, table, [i for i in ids if i not in added])
        if ctx.at is None:
            return [{**then_rows[r["id"]], **r} for r in shown if r["id"] in then_rows], paging
        now_rows = await self._whole(ctx.now, table, ids)
        out = []
        for r in shown:
            then_row, now_row = then_rows.get(r["id"]), now_rows.get(r["id"])
            if then_row is None and now_row is not None:
                out.append({**now_row, **r, "_diff": "added", "_changed": []})
            elif then_row is not None:
                now = [{**now_row, **r}] if now_row is not None else []
                out.append(marked([{**then_row, **r}], now, fields=fields)[0])
        return out, paging


async def _rows(source: Source, table: str, tail: str = "", *args: Any) -> list[dict[str, Any]]:
    """An access table's rows, read after :func:`_keys` (which waits for the projections to catch up), without
    the tenancy paths ``Source.access`` works out again each time (1,000 projects: 20 ms a call)."""
    cols = ACCESS_COLUMNS[table]
    found = await source.backend.query("access", f"SELECT {', '.join(cols)} FROM {{{table}}} {tail}", *args)
    return [dict(zip(cols, r, strict=True)) for r in found]


def _active(row: Mapping[str, Any], when: datetime) -> bool:
    return not row["revoked"] and not key_expired(row["expires_at"], when)


async def _spent(ctx: Ctx, scope: str, period: str, when: datetime) -> float:
    """What ``scope`` (as on the log) spent in its budget period up to ``when``, from the live rollups."""
    kind, _, value = scope.partition(":")
    since = minute_of(period_start(period, when))
    rows = await ctx.api.backend.query(
        "usage",
        "SELECT SUM(cost_nano_usd) FROM {rollups} WHERE dimension = ? AND value = ? AND minute >= ? AND minute <= ?",
        kind,
        value,
        since,
        minute_of(when),
    )
    return int((rows[0][0] if rows else 0) or 0) / NANO_USD


async def _quotas(source: Source, paths: dict[str, tuple[str, str]]) -> list[dict[str, Any]]:
    quotas = await _rows(source, "quotas", "ORDER BY scope")
    if not quotas:
        return []
    states = ", ".join(f"'{s}'" for s in ACTIVE_STATES)
    active = await source.fleet("replicas", f"WHERE state IN ({states})")
    of_model: dict[str, list[dict[str, Any]]] = {}
    for r in active:  # each model handed only its own replicas: all of them each, 1,000 × 5,000 took seconds
        of_model.setdefault(r["model"], []).append(r)
    models = [shape_model(m, of_model.get(m["name"], [])) for m in await source.fleet("models")]
    held = quota_holdings(quotas, paths, models, active)
    for q, row in zip(held, quotas, strict=True):
        q["id"] = row["scope"]  # as on the log: what the marks compare by
    return held


def _by_id(need: R.Need, tenant_id: str) -> R.Need:
    """The same need over the same tenant named by its id: found at once, where a path walks the tree."""
    return need if need.kind == R.CLUSTER else msgspec.structs.replace(need, tenant=tenant_id)


def _tenant_options(tree: TenancyTree) -> list[dict[str, str]]:
    """Every tenant as a form offers it (``project:acme/ml/chat``), by path, each path worked out once."""
    out = []
    for s in tree.scopes.values():
        path = tree.path(s)
        out.append({"value": f"{s.kind}:{path}", "kind": s.kind, "path": path, "id": s.id})
    return sorted(out, key=lambda o: o["value"])


async def gather(ctx: Ctx) -> dict[str, Any]:
    when = ctx.at or utc_now()
    visible = Visible(ctx)
    tree = await ctx.source.tree()
    keys, paths = await _key_index(ctx.source)
    names = {k["id"]: k["name"] for k in keys}  # every key, before the person's view narrows them
    key_projects = {k["id"]: k["project_id"] for k in keys}
    project = (ctx.query.get("project") or "").strip()
    keys = [k for k in keys if visible("project", k["project_id"])]
    live_keys: dict[str, int] = {}
    for k in keys:
        if _active(k, when):
            live_keys[k["project_id"]] = live_keys.get(k["project_id"], 0) + 1
    quotas = [q for q in await _quotas(ctx.source, paths) if visible.scope(q["id"], key_projects)]
    if ctx.at is not None:  # the past, each row marked against now
        found, now_paths = await _key_index(ctx.now)
        then_ids = {k["id"] for k in keys}
        made_since = [k for k in found if k["id"] not in then_ids and visible("project", k["project_id"])]
        keys = keys + [{**k, "_added": True} for k in made_since]
        now_quotas = [q for q in await _quotas(ctx.now, now_paths) if visible.scope(q["id"], key_projects)]
        quotas = marked(quotas, now_quotas, fields=("guarantee", "limit"))
    if project:
        keys = [k for k in keys if project in (k["project_id"], paths.get(k["project_id"], ("", ""))[1])]
    # Pages of rows, not the book: at 10,000 keys and a budget per project the page stays small and fast.
    shown_keys, keys_paging = paged(keys, ctx.query, "keys_page", KEYS_PER_PAGE)
    ids = [k["id"] for k in shown_keys]
    then_rows = await _key_rows(ctx.source, [k["id"] for k in shown_keys if not k.get("_added")])
    if ctx.at is None:
        shown_keys = [shape_key(then_rows[i], paths, when) for i in ids if i in then_rows]
    else:
        now_rows = await _key_rows(ctx.now, ids)
        shown_keys = [
            _mark_key(then_rows.get(i), now_rows.get(i), paths, when) for i in ids if i in then_rows or i in now_rows
        ]
    scoped = Scoped(ctx, visible, key_projects, paths, names)
    limits, limits_paging = await scoped.page("limits", "limits_page", ("rpm", "tpm"))
    budgets, budgets_paging = await scoped.page("budgets", "budgets_page", ("usd", "period"))
    for r in budgets:  # the spend of the budgets shown only: one look-up each
        if r.get("_diff") == "added":  # not a budget at the moment shown
            r["spent"], r["share"], r["state"] = None, None, ""
            continue
        r["spent"] = await _spent(ctx, r["scope"], r["period"], when)
        r["share"] = r["spent"] / r["usd"] if r["usd"] else None
        r["state"] = "over" if r["usd"] is not None and r["spent"] >= r["usd"] else "within"
    live_tree = await ctx.now.tree()
    open_team = (ctx.query.get("team") or "").strip()
    tree = tree_rows(tree, visible, live_keys, open_team)
    if ctx.at is not None:  # scopes renamed, deleted or made since, marked in words
        tree = marked(tree, tree_rows(live_tree, visible, {}, open_team), fields=("name", "path"))
    controls = ctx.at is None
    may = May(ctx)
    options = _tenant_options(live_tree) if controls else []
    st = AccessState()
    st.tree = live_tree
    key_projects_options = [
        o
        for o in options
        if o["kind"] == "project"
        if controls and (may.admin or may(access_need(st, A.CreateKey(project=o["id"], prefix="", secret_sha256=""))))
    ]
    limit_options = [
        o
        for o in options
        if controls and (may.admin or may(access_need(st, A.SetLimit(scope=f"{o['kind']}:{o['id']}"))))
    ]
    quota_options = [
        o
        for o in options
        if controls and (may.admin or may(need_quota(live_tree, Q.ClearQuota(scope=f"{o['kind']}:{o['id']}"))))
    ]
    create_options = [
        {"kind": kind, "parent": o["path"]}
        for kind, parent_kind in (("team", "org"), ("project", "team"))
        for o in options
        if o["kind"] == parent_kind
        if controls and (may.admin or may(_by_id(tree_need(T.CreateScope(kind=kind, path=f"{o['path']}/x")), o["id"])))
    ]
    may_create_org = controls and may(tree_need(T.CreateScope(kind="org", path="x")))
    for k in shown_keys:
        k["may_revoke"] = (
            controls
            and k.get("_diff") is None
            and k["state"] == "active"
            and may(R.Need(role="member", what="revoking a key", kind="project", tenant=k["project_id"]))
        )
    settable, clearable = {o["id"] for o in limit_options}, {o["id"] for o in quota_options}
    for r in [*limits, *budgets]:
        r["may_set"] = controls and r["id"].partition(":")[2] in settable
    for q in quotas:
        q["may_clear"] = controls and q["id"].partition(":")[2] in clearable
    return {
        "tree": tree,
        "keys": shown_keys,
        "keys_total": len(keys),
        "keys_paging": keys_paging,
        "limits_paging": limits_paging,
        "budgets_paging": budgets_paging,
        "project": project,
        "limits": limits,
        "budgets": budgets,
        "quotas": sorted(quotas, key=lambda q: q["scope"]),
        "key_projects": key_projects_options,
        "limit_scopes": limit_options,
        "project_choices": choices(o["value"] for o in key_projects_options),
        "scope_choices": choices(sorted({o["value"] for o in [*limit_options, *quota_options]})),
        "quota_scopes": quota_options,
        "create_scopes": create_options,
        "may_create_org": may_create_org,
        "periods": A.PERIODS,
        "controls": controls,
        "GiB": GiB,
        "money": Numbers(ctx.lang).usd,
    }


# -- acting ---------------------------------------------------------------------------------------


async def create_key(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    """Make a key here, as `llmgw ctl key create` does: only its prefix and hash travel; the secret is
    handed back once in the outcome's result, never written to the log."""
    kind = f"{A.SERVICE}.key.create"
    project = (form.get("project") or "").strip()
    if not project:
        return refused(kind, "choose the key's project")
    try:
        rpm, tpm = whole(form, "rpm", minimum=1), whole(form, "tpm", minimum=1)
        expires_at = parse_expiry(form.get("expires") or "", datetime.now(UTC))
    except BadInput as exc:
        return refused(kind, str(exc))
    models = [m.strip() for m in (form.get("models") or "").split(",") if m.strip()]
    secret, prefix, digest = A.make_api_key()
    command = A.CreateKey(
        project=project,
        prefix=prefix,
        secret_sha256=digest,
        name=(form.get("name") or "").strip(),
        user=(form.get("user") or "").strip() or None,
        rpm=rpm,
        tpm=tpm,
        models=models,
        expires_at=expires_at,
        external=form.get("external") in ("on", "true", "1"),
    )
    out = await ctx.act(A.SERVICE, "key.create", command)
    if out.applied:
        out.result = {**out.result, "secret": secret, "prefix": prefix}
    return out


async def revoke_key(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    key = (form.get("key") or "").strip()
    if not key:
        return refused(f"{A.SERVICE}.key.revoke", "say which key: its id or prefix")
    return await ctx.act(A.SERVICE, "key.revoke", A.RevokeKey(key=key, reason=(form.get("reason") or "").strip()))


async def set_limit(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    kind = f"{A.SERVICE}.limit.set"
    scope = (form.get("scope") or "").strip()
    if not scope:
        return refused(kind, "choose a scope: an org, team, project or key")
    try:
        rpm, tpm = whole(form, "rpm", minimum=1), whole(form, "tpm", minimum=1)
    except BadInput as exc:
        return refused(kind, str(exc))
    if form.get("clear") not in ("on", "true", "1") and rpm is None and tpm is None:
        return refused(kind, "give requests and/or tokens per minute, or tick clear to remove the limits")
    if form.get("clear") in ("on", "true", "1"):
        rpm = tpm = None
    return await ctx.act(A.SERVICE, "limit.set", A.SetLimit(scope=scope, rpm=rpm, tpm=tpm))


async def set_budget(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    kind = f"{A.SERVICE}.budget.set"
    scope = (form.get("scope") or "").strip()
    period = (form.get("period") or "month").strip()
    clear = form.get("clear") in ("on", "true", "1")
    if not scope:
        return refused(kind, "choose a scope: an org, team, project or key")
    if period not in A.PERIODS:
        return refused(kind, f"period {period!r}: budgets run per {' or '.join(A.PERIODS)}")
    try:
        usd = decimal(form, "usd")
    except BadInput as exc:
        return refused(kind, str(exc))
    if clear == (usd is not None):
        return refused(kind, "give a budget in US dollars, or tick clear to remove the budget")
    return await ctx.act(A.SERVICE, "budget.set", A.SetBudget(scope=scope, usd=usd, period=period))


async def set_quota(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    kind = f"{T.SERVICE}.quota-set"
    scope = (form.get("scope") or "").strip()
    if not scope:
        return refused(kind, "choose a scope: an org, team or project")
    try:
        g_mem, l_mem = decimal(form, "memory_gb"), decimal(form, "limit_memory_gb")
        payload = Q.SetQuota(
            scope=scope,
            guarantee=Q.Resources(
                gpus=whole(form, "gpus"),
                cores=whole(form, "cores"),
                memory_bytes=None if g_mem is None else int(g_mem * GiB),
            ),
            limit=Q.Resources(
                gpus=whole(form, "limit_gpus"),
                cores=whole(form, "limit_cores"),
                memory_bytes=None if l_mem is None else int(l_mem * GiB),
            ),
        )
    except BadInput as exc:
        return refused(kind, str(exc))
    return await ctx.act(T.SERVICE, "quota-set", payload)


async def clear_quota(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    scope = (form.get("scope") or "").strip()
    if not scope:
        return refused(f"{T.SERVICE}.quota-clear", "choose a scope: an org, team or project")
    return await ctx.act(T.SERVICE, "quota-clear", Q.ClearQuota(scope=scope))


async def create_scope(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    kind = (form.get("kind") or "").strip()
    path = (form.get("path") or "").strip().strip("/")
    parent = (form.get("parent") or "").strip().strip("/")
    name = (form.get("name") or "").strip()
    if parent and name:
        path = f"{parent}/{name}"
    if kind not in KINDS or not path:
        return refused(f"{T.SERVICE}.create", "choose org, team or project and give its name")
    return await ctx.act(T.SERVICE, "create", T.CreateScope(kind=kind, path=path))


PAGES = [
    Page(
        path="/console/tenants",
        name="tenants",
        title="tenants.nav",
        template="tenants.html",
        gather=gather,
        actions={
            "key_create": create_key,
            "key_revoke": revoke_key,
            "limit_set": set_limit,
            "budget_set": set_budget,
            "quota_set": set_quota,
            "quota_clear": clear_quota,
            "scope_create": create_scope,
        },
        live=("tenancy", "key", "limit", "budget", "quota"),
        scope="tenant",
    )
]
