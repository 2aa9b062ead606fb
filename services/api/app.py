"""The admin HTTP API (``/api/v1/...``) over projections and the log, plus health and metrics.

Reads are consistent with what was acknowledged before them: a view first waits (bounded) for
its projection to reach the log's current position for the subjects it folds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from llmgw.events.commands.roles import CLUSTER, Need
from llmgw.events.runtime.follower import FollowerRegistry, health_body
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import nodes as N
from llmgw.events.schema import scheduler as SCH
from llmgw.events.schema import subjects as S
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent, utc_now
from llmgw.events.schema.subjects import encode_token, event_subject
from llmgw.projections.access import scope_path, tenancy_paths
from llmgw.projections.apply import ProjectionError
from llmgw.projections.backends import Backend
from llmgw.projections.eventlog import matching
from llmgw.projections.rebuild import rebuild, verify
from llmgw.projections.runner import ProjectionRunner
from llmgw.projections.usage import (
    GROUPS,
    PERIODS,
    ScopeError,
    UnknownScope,
    add_up,
    minute_of,
    parse_since,
    period_start,
    request_record,
    resolve_scope,
    spend,
    usage_totals,
)
from llmgw.services.api.identity_views import IdentityViews
from llmgw.services.api.manage import ROUTE_PREFIX, Manage, bearer_token
from llmgw.services.api.mcp_views import McpViews
from llmgw.services.api.openapi import OPENAPI_PATH, served
from llmgw.services.api.replay import cluster_at, parse_keys_cursor
from llmgw.services.api.signin import Identity, Refused, SignIn
from llmgw.services.api.views import (
    ACCESS_COLUMNS,
    FLEET_COLUMNS,
    KEYS_LIMIT,
    KEYS_LIMIT_MAX,
    shape_key,
    shape_model,
    shape_node,
)
from llmgw.services.console import session as SES
from llmgw.services.identity.scim import PREFIX as SCIM_PREFIX
from llmgw.services.identity.scim import ScimApi
from llmgw.services.identity.sso import OPEN_PREFIX as SSO_OPEN_PREFIX
from llmgw.services.identity.sso import Sso

log = structlog.get_logger("llmgw.services.api")

READ_WAIT_S = 5.0
OPEN_PATHS = ("/api/v1/login", OPENAPI_PATH)  # the calls under /api/v1 that need no token
IDENTITY = web.RequestKey("identity", Identity)  # who the request was authenticated as


class LoginRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    user: str
    password: str
    provider: str = ""  # an LDAP directory's name: it checks the password ("" : this server does)


def _tenant_of(request: web.Request) -> tuple[str, str] | None:
    """The one tenant a view is asked about (``/keys?project=``, ``/usage?scope=``), as (kind, path)."""
    if request.path == "/api/v1/keys" and request.query.get("project"):
        return "project", request.query["project"].removeprefix("project:")
    if request.path.startswith("/api/v1/usage") and request.query.get("scope"):
        kind, _, path = request.query["scope"].partition(":")
        if kind in ("org", "team", "project") and path:
            return kind, path
    return None


def error(status: int, message: str, code: str = "error") -> web.Response:
    return web.json_response({"error": {"message": message, "code": code}}, status=status)


def _via(granted: tuple[str, str, str] | None) -> dict[str, str] | None:
    """Which provider's group mapping granted a role (None: granted by hand)."""
    if granted is None:
        return None
    provider, group, mapping = granted
    return {"provider": provider, "group": group, "mapping": mapping}


class AdminApi:
    def __init__(
        self, store: EventStore, backend: Backend, runner: ProjectionRunner, registry: CollectorRegistry
    ) -> None:
        self.store = store
        self.backend = backend
        self.runner = runner
        self.registry = registry
        self._recreating = asyncio.Lock()
        # Set where a router runs in this process: its usage backlog (a UsageBacklog) joins /healthz.
        self.usage_backlog: Callable[[], Any] | None = None
        # The process's followers (events/runtime/follower.py): any not live makes /healthz 503, naming it.
        self.folds: FollowerRegistry | None = None
        # Signing people in (services/api/signin.py): set where the API runs.
        self.signin: SignIn | None = None
        # Where people reach this API and the console (admin.public_url): OpenID redirect URIs are made from it.
        self.public_url = ""

    def app(self, *, full: bool = True) -> web.Application:
        """The admin API; with ``full=False`` only ``/healthz`` and ``/metrics``, which every process
        serves on its admin port (a router-only or mirror-only process is scraped like the others)."""
        if not full:
            app = web.Application(middlewares=[self._errors])
            app.router.add_get("/healthz", self.healthz)
            app.router.add_get("/metrics", self.metrics)
            return app
        from llmgw.services.console.app import Console  # the console's templates load only where it is served

        console = Console(self)
        app = web.Application(middlewares=[self._errors, console.headers, self._authenticate])
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/metrics", self.metrics)
        console.routes(app)
        Sso(self, console, public_url=self.public_url).routes(app)  # signing in through an OpenID provider
        app.router.add_post("/api/v1/login", self.login)
        app.router.add_get("/api/v1/whoami", self.whoami)
        app.router.add_get("/api/v1/users", self.users)
        app.router.add_get("/api/v1/tree", self.tree)
        app.router.add_get("/api/v1/events/{id}", self.event)
        app.router.add_get("/api/v1/replay", self.replay)
        app.router.add_get("/api/v1/audit", self.audit)
        app.router.add_get("/api/v1/nodes", self.nodes)
        app.router.add_get("/api/v1/nodes/{id}", self.node)
        app.router.add_get("/api/v1/models", self.models)
        app.router.add_get("/api/v1/models/{name}/headroom", self.headroom)
        app.router.add_get("/api/v1/replicas", self.replicas)
        app.router.add_get("/api/v1/keys", self.keys)
        app.router.add_get("/api/v1/limits", self.limits)
        app.router.add_get("/api/v1/prices", self.prices)
        app.router.add_get("/api/v1/budgets", self.budgets)
        app.router.add_get("/api/v1/projections", self.projections)
        app.router.add_post("/api/v1/projections/rebuild", self.rebuild)
        app.router.add_post("/api/v1/projections/verify", self.verify)
        app.router.add_get("/api/v1/usage", self.usage)
        app.router.add_get("/api/v1/usage/spend", self.usage_spend)
        app.router.add_get("/api/v1/requests/{id}", self.request_usage)
        app.router.add_get(OPENAPI_PATH, self.openapi)
        IdentityViews(lambda: self._signin().identity, lambda scope: self._signin().label(scope)).routes(app)
        McpViews(self.store, lambda scope: self._signin().label(scope)).routes(app)
        # Every command the CLI sends, signed with the caller's token (services/api/manage.py).
        Manage(
            self.store,
            lambda request: request[IDENTITY].name,
            self._token,
            self._may,
            hash_password=lambda password: self._signin().checker.hash(password),
        ).routes(app)
        # SCIM 2.0 for identity providers: outside /api/v1, so its own bearer tokens, not people's, let it in.
        app.add_subapp(SCIM_PREFIX, ScimApi(self.store, lambda: self.signin).app())
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

    # -- people ------------------------------------------------------------------------------

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        """Every call under ``/api/v1`` but the login is someone's: no token, no answer (401), before
        anything is read or done. Health and metrics stay open (probes and Prometheus)."""
        open_path = request.path in OPEN_PATHS or request.path.startswith(SSO_OPEN_PREFIX)
        if not request.path.startswith("/api/v1/") or open_path:
            return await handler(request)
        who = self._identity(request)
        if isinstance(who, web.Response):
            return who
        request[IDENTITY] = who
        refused = self._authorize(request, who)
        if refused is not None:
            return error(refused.status, refused.message, refused.code)
        return await handler(request)

    def _authorize(self, request: web.Request, who: Identity) -> Refused | None:
        """The role a call needs (docs/people.md has the table): a command (services/api/manage.py), none
        here — the command's service checks the role it needs; any other change (the projections'),
        cluster admin; a view of one tenant's keys or usage, viewer of that tenant; any other view,
        viewer of the cluster."""
        signin = self._signin()
        what = f"{request.method} {request.path}"
        if request.path == "/api/v1/whoami":
            return None
        if (request.match_info.route.name or "").startswith(ROUTE_PREFIX):
            return None
        if request.method != "GET":
            return signin.authorize(who, "cluster-admin", [CLUSTER], CLUSTER, what)
        tenant = _tenant_of(request)
        if tenant is not None:
            chain, label = signin.chain(*tenant)
            return signin.authorize(who, "viewer", chain, label, what)
        return signin.authorize(who, "viewer", [CLUSTER], CLUSTER, what)

    def _signin(self) -> SignIn:
        if self.signin is None:
            raise web.HTTPServiceUnavailable(reason="signing in is not set up in this process")
        return self.signin

    def _identity(self, request: web.Request) -> Identity | web.Response:
        authorization = request.headers.get("authorization", "")
        cookie = request.cookies.get(SES.COOKIE)
        if not authorization and cookie:
            # A browser signed in to the console: its cookie is a session token, but a change needs the
            # CSRF token its pages carry too, or any site could make the browser send one.
            if request.method not in ("GET", "HEAD", "OPTIONS") and not SES.csrf_valid(
                cookie, request.headers.get(SES.CSRF_HEADER)
            ):
                return error(403, "a change made with the console's cookie needs its X-CSRF-Token header", "csrf")
            authorization = f"Bearer {cookie}"
        got = self._signin().identify(authorization)
        if isinstance(got, Refused):
            return error(got.status, got.message, got.code)
        return got

    def _may(self, request: web.Request, need: Need) -> bool:
        """Whether the request's person holds ``need`` now (a hint the management API acts on; the command's
        service decides)."""
        signin = self._signin()
        chain, label = signin.chain(need.kind, need.tenant)
        return signin.authorize(request[IDENTITY], need.role, chain, label, need.what) is None

    def _token(self, request: web.Request) -> str:
        """The token the request was authenticated by (as ``_identity`` chose it): a command is signed with it."""
        if request.headers.get("authorization"):
            return bearer_token(request)
        return request.cookies.get(SES.COOKIE, "")

    async def login(self, request: web.Request) -> web.Response:
        """``POST /api/v1/login`` ``{"user", "password"}``: a session token (12 h) for a person."""
        try:
            body = msgspec.json.decode(await request.read(), type=LoginRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return error(400, f'send {{"user": NAME, "password": PASSWORD}} as JSON: {exc}', "invalid_request")
        try:
            token, expires, name = await self._signin().login(
                body.user, body.password, request.remote or "unknown", provider=body.provider
            )
        except Refused as exc:
            resp = error(exc.status, exc.message, exc.code)
            if exc.retry_after_s:
                resp.headers["Retry-After"] = str(exc.retry_after_s)
            return resp
        return web.json_response({"token": token, "user": name, "expires_at": expires.isoformat()})

    async def openapi(self, request: web.Request) -> web.Response:
        """This API's OpenAPI 3.1 document (services/api/openapi.py), open to anyone: it holds no data."""
        return web.Response(body=served(), content_type="application/json")

    async def whoami(self, request: web.Request) -> web.Response:
        who: Identity = request[IDENTITY]
        return web.json_response({"user": who.name, "token": who.kind, "token_id": who.token_id})

    async def users(self, request: web.Request) -> web.Response:
        """Every person: name, whether disabled, live tokens (never a hash)."""
        people = self._signin().people
        return web.json_response(
            [
                {
                    "name": p.name,
                    "display_name": p.display_name,
                    "disabled": p.disabled,
                    "language": p.language or None,  # the console's language they chose (None: their browser's)
                    "added_at": p.added_at.isoformat(),
                    # "" : added here, with a password; idp:NAME or scim: made by that provider
                    "source": p.source,
                    "login": p.login or None,
                    "email": p.email or None,
                    "roles": [
                        {"role": role, "scope": self._signin().label(scope), "via": _via(p.via(role, scope))}
                        for role, scope in p.roles
                    ],
                    "tokens": [
                        {
                            "id": t.token_id,
                            "prefix": t.prefix,
                            "kind": t.kind,
                            "method": t.method or None,
                            "label": t.label,
                            "expires_at": t.expires_at.isoformat() if t.expires_at else None,
                        }
                        for t in p.tokens.values()
                    ],
                }
                for p in sorted(people.by_name.values(), key=lambda p: p.name)
            ]
        )

    async def healthz(self, request: web.Request) -> web.Response:
        connected = self.store.nc.is_connected
        body: dict[str, Any] = {"nats": "connected" if connected else "disconnected"}
        ok = connected
        if self.usage_backlog is not None:
            usage = self.usage_backlog()
            body["usage"] = msgspec.to_builtins(usage)
            ok = ok and usage.refusing is None  # refusing billable requests: usage cannot be kept
        if self.folds is not None:
            folds = self.folds.health()
            body.update(health_body(folds))
            ok = ok and all(h.live for h in folds)  # a fold not live answers from stale state
        body = {"status": "ok" if ok else "degraded", **body}
        return web.json_response(body, status=200 if ok else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        await self.runner.refresh_lag()
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def audit(self, request: web.Request) -> web.Response:
        """Who changed what (TEN-4), newest last: ``?actor=`` (exact, or a prefix ending in ``:``),
        ``?since=`` (ISO or 30m/2h/1d), ``?type=``, ``?limit=`` (default 50, at most 1000). Without
        ``actor``, people only (``user:…``): services and nodes write most events, on their behalf."""
        q = request.query
        try:
            limit = min(max(int(q.get("limit", "50")), 1), 1000)
        except ValueError:
            return error(400, f"limit {q.get('limit')!r} is not a whole number", "invalid")
        where, args = [], []
        actor = q.get("actor", "").strip() or "user:"
        clause, bounds = matching("actor", actor, ":")  # a kind of actor (user:, node:, svc:) or one
        where.append(clause)
        args += bounds
        if q.get("since"):
            try:
                since = parse_since(q["since"], utc_now())
            except ValueError as exc:
                return error(400, str(exc), "invalid")
            where.append("at >= ?")
            args.append(since.isoformat())
        if q.get("type"):
            where.append("type = ?")
            args.append(q["type"])
        await self._caught_up("eventlog", await self.store.stream_last_seq())
        cols = ["id", "seq", "type", "subject", "actor", "at", "causation", "correlation"]
        rows = await self.backend.query(
            "eventlog",
            f"SELECT {', '.join(cols)} FROM {{events}} WHERE {' AND '.join(where)} ORDER BY seq DESC LIMIT {limit}",
            *args,
        )
        found = [dict(zip(cols, r, strict=True)) for r in reversed(rows)]
        # The data itself is in the log, not the index: read each by its sequence (None once it is gone).
        events = await asyncio.gather(*(self.store.get(row["seq"]) for row in found))
        for row, event in zip(found, events, strict=True):
            row["data"] = msgspec.json.decode(event.envelope.data) if isinstance(event, RecordedEvent) else None
        return web.json_response({"events": found})

    async def replay(self, request: web.Request) -> web.Response:
        """The cluster as it was at ``?until=`` (an ISO time, or ``30m``/``2h``/``1d`` ago), from the log;
        keys counted and paged: ``?keys_limit=`` (default 100, at most 1000), ``?keys_after=`` (a ``keys_next``)."""
        q = request.query
        try:
            keys_limit = min(max(int(q.get("keys_limit", str(KEYS_LIMIT))), 0), KEYS_LIMIT_MAX)
        except ValueError:
            return error(400, f"keys_limit {q.get('keys_limit')!r} is not a whole number", "invalid")
        keys_after = q.get("keys_after") or None
        if keys_after is not None:
            try:
                parse_keys_cursor(keys_after)  # refused before the fold, not after it
            except ValueError as exc:
                return error(400, str(exc), "invalid")
        until = request.query.get("until", "").strip()
        if not until:
            return error(400, "say when: ?until=2026-11-29T20:00:00Z, or a duration back such as 2h", "invalid")
        try:
            when = parse_since(until, utc_now())
        except ValueError as exc:
            return error(400, str(exc).replace("since", "until", 1), "invalid")
        if when > utc_now():
            return error(400, f"until {when.isoformat()} is in the future; the log holds the past only", "invalid")
        return web.json_response(await cluster_at(self.store, when, keys_limit=keys_limit, keys_after=keys_after))

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

    # -- fleet -------------------------------------------------------------------------------

    async def _fleet_rows(self, table: str, sql_tail: str = "", *args: Any) -> list[dict[str, Any]]:
        await self._caught_up("fleet", await self.store.stream_last_seq())
        cols = FLEET_COLUMNS[table]
        rows = await self.backend.query("fleet", f"SELECT {', '.join(cols)} FROM {{{table}}} {sql_tail}", *args)
        return [dict(zip(cols, r, strict=True)) for r in rows]

    async def _heartbeat(self, node_id: str) -> dict[str, Any] | None:
        subject = f"{S.TELEMETRY_ROOT}.node.{encode_token(node_id)}"
        try:
            msg = await self.store.js.get_last_msg(S.STREAM_TELEMETRY, subject, direct=True)
        except nats.js.errors.NotFoundError:
            return None
        try:
            return msgspec.to_builtins(msgspec.json.decode(msg.data or b"", type=N.NodeHeartbeat))
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    async def nodes(self, request: web.Request) -> web.Response:
        rows = await self._fleet_rows("nodes", "ORDER BY id")
        replicas = await self._fleet_rows("replicas", "WHERE state IN ('placed','starting','ready','draining')")
        for n in rows:
            shape_node(n, replicas)
            hb = await self._heartbeat(n["id"])
            n["memory_available_bytes"] = hb["memory_available_bytes"] if hb else None
            n["last_heartbeat"] = hb["at"] if hb else None
        return web.json_response({"nodes": rows})

    async def node(self, request: web.Request) -> web.Response:
        node_id = request.match_info["id"]
        rows = await self._fleet_rows("nodes", "WHERE id = ?", node_id)
        if not rows:
            return error(404, f"no node {node_id!r}: `llmgw ctl nodes` lists them", "not_found")
        node = rows[0]
        node["gpus"] = msgspec.json.decode(node["gpus"] or "[]")
        node["labels"] = msgspec.json.decode(node["labels"] or "{}")
        node["engines"] = [x for x in (node["engines"] or "").split(",") if x]
        node["heartbeat"] = await self._heartbeat(node_id)
        node["replicas"] = await self._fleet_rows(
            "replicas", "WHERE node_id = ? AND state IN ('placed','starting','ready','draining') ORDER BY id", node_id
        )
        return web.json_response(node)

    async def models(self, request: web.Request) -> web.Response:
        models = await self._fleet_rows("models", "ORDER BY name")
        replicas = await self._fleet_rows("replicas", "WHERE state IN ('placed','starting','ready','draining')")
        return web.json_response({"models": [shape_model(m, replicas) for m in models]})

    async def headroom(self, request: web.Request) -> web.Response:
        """How many more replicas of a model fit now (SCHED-11): asked of a scheduler over the bus."""
        name = request.match_info["name"]
        try:
            msg = await self.store.nc.request(SCH.HEADROOM_SUBJECT, name.encode(), timeout=10)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return error(503, "no scheduler answered: is the scheduler service running?", "unavailable")
        body = msgspec.json.decode(msg.data)
        if body.get("error"):
            return error(404, body["error"], "not_found")
        return web.json_response(body)

    async def replicas(self, request: web.Request) -> web.Response:
        model = request.query.get("model")
        show_all = request.query.get("all") in ("1", "true")
        where, args = [], []
        if model:
            where.append("model = ?")
            args.append(model)
        if not show_all:
            where.append("state IN ('placed','starting','ready','draining')")
        tail = ("WHERE " + " AND ".join(where) if where else "") + " ORDER BY model, placed_at"
        rows = await self._fleet_rows("replicas", tail, *args)
        hashes = {m["name"]: m["spec_hash"] for m in await self._fleet_rows("models")}
        for r in rows:
            r["stale"] = r["state"] == "ready" and r["model"] in hashes and r["spec_hash"] != hashes[r["model"]]
        return web.json_response({"replicas": rows})

    # -- access (SPEC TEN-2, GW-4, GW-5) -----------------------------------------------------

    async def _access_rows(
        self, table: str, sql_tail: str = "", *args: Any
    ) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str]]]:
        """Rows of an access table as dicts, and the tenancy paths (id -> kind, path) to name scopes with."""
        await self._caught_up("tenancy", await self.store.last_seq(event_subject(T.AGGREGATE, T.TREE_ID)))
        await self._caught_up("access", await self.store.stream_last_seq())
        cols = ACCESS_COLUMNS[table]
        rows = await self.backend.query("access", f"SELECT {', '.join(cols)} FROM {{{table}}} {sql_tail}", *args)
        return [dict(zip(cols, r, strict=True)) for r in rows], await tenancy_paths(self.backend)

    async def _key_names(self) -> dict[str, str]:
        return {r[0]: r[1] for r in await self.backend.query("access", "SELECT id, name FROM {keys}")}

    async def keys(self, request: web.Request) -> web.Response:
        """Every key (revoked ones too), never its secret or hash; ``?project=PATH-or-ID`` narrows."""
        rows, paths = await self._access_rows("keys", "ORDER BY created_at, id")
        project = request.query.get("project", "").strip().removeprefix("project:")
        if project:
            found = [sid for sid, (kind, path) in paths.items() if kind == "project" and project in (sid, path)]
            if not found:
                known = sorted(path for kind, path in paths.values() if kind == "project")
                listing = f" (projects: {', '.join(known[:10])})" if known else ""
                return error(404, f"there is no project {project!r}{listing}", "not_found")
            rows = [r for r in rows if r["project_id"] == found[0]]
        now = utc_now()
        return web.json_response({"keys": [shape_key(r, paths, now) for r in rows]})

    async def limits(self, request: web.Request) -> web.Response:
        rows, paths = await self._access_rows("limits")
        names = await self._key_names()
        for r in rows:
            r["path"] = scope_path(r["scope"], paths, names)
        return web.json_response({"limits": sorted(rows, key=lambda r: r["path"])})

    async def prices(self, request: web.Request) -> web.Response:
        rows, _ = await self._access_rows("prices", "ORDER BY model")
        return web.json_response({"prices": rows})

    async def budgets(self, request: web.Request) -> web.Response:
        rows, paths = await self._access_rows("budgets")
        names = await self._key_names()
        for r in rows:
            r["path"] = scope_path(r["scope"], paths, names)
        return web.json_response({"budgets": sorted(rows, key=lambda r: r["path"])})

    async def _recreate_if_gone(self) -> str | None:
        """The projection database deleted under the running system: open a new one and fold the log
        into it again (the log is the truth); what happened, in a sentence, or None."""
        async with self._recreating:
            if not self.backend.gone():
                return None
            running = self.runner.running
            if running:
                await self.runner.stop()
            await self.backend.reopen()
            if running:
                await self.runner.start()
                for p in self.runner.projections:
                    head = await self.store.on_stream(p.stream).stream_last_seq()
                    with contextlib.suppress(ProjectionError):
                        await self.runner.wait_until(p.name, head, timeout=60.0)
            note = "the projection database was deleted while running: recreated it and rebuilt it from the log"
            log.warning(note, dsn=self.backend.dsn)
            return note

    async def projections(self, request: web.Request) -> web.Response:
        recreated = await self._recreate_if_gone()
        await self.runner.refresh_lag()
        return web.json_response({"projections": self.runner.status(), "recreated": recreated})

    def _selected(self, request: web.Request) -> list[Any]:
        name = request.query.get("name")
        chosen = [p for p in self.runner.projections if name in (None, "", p.name)]
        if not chosen:
            known = ", ".join(p.name for p in self.runner.projections)
            raise web.HTTPNotFound(reason=f"no projection named {name!r} (known: {known})")
        return chosen

    async def rebuild(self, request: web.Request) -> web.Response:
        selected = self._selected(request)
        recreated = await self._recreate_if_gone()
        results = []
        for projection in selected:
            result = await rebuild(self.store, self.backend, projection, runner=self.runner)
            results.append({"name": projection.name, **result})
        return web.json_response({"rebuilt": results, "recreated": recreated})

    async def verify(self, request: web.Request) -> web.Response:
        selected = self._selected(request)
        recreated = await self._recreate_if_gone()
        results = []
        for projection in selected:
            result = await verify(self.store, self.backend, projection, runner=self.runner)
            results.append({"name": projection.name, **result})
        identical = all(r["identical"] for r in results)
        return web.json_response({"verified": results, "identical": identical, "recreated": recreated})

    # -- usage (SPEC USE-1, USE-2, GW-8) -----------------------------------------------------

    async def _usage_caught_up(self) -> None:
        # Usage positions are sequences of the usage stream, not of the event log.
        await self._caught_up("usage", await self.store.on_stream(S.STREAM_USAGE).stream_last_seq())

    async def _usage_scope(self, request: web.Request, required: bool = False) -> tuple[str, str] | None:
        scope = request.query.get("scope", "").strip()
        if not scope:
            if required:
                raise ScopeError("give a scope: ?scope=project:acme/ml/chat (or org:, team:, key:<id>, model:)")
            return None
        if scope.split(":", 1)[0] in ("org", "team", "project"):
            # A path is resolved through the tree: read it as of now, like `tree` does.
            await self._caught_up("tenancy", await self.store.last_seq(event_subject(T.AGGREGATE, T.TREE_ID)))
        return await resolve_scope(self.backend, scope)

    async def usage(self, request: web.Request) -> web.Response:
        """Sums over the per-minute rollups: ?scope=KIND:ID-OR-PATH&since=1h|ISO&by=model|key|project|team|org."""
        by = request.query.get("by", "model")
        if by not in GROUPS:
            return error(400, f"by={by!r}: group by one of {', '.join(GROUPS)}", "invalid")
        now = utc_now()
        try:
            since = parse_since(request.query.get("since") or "24h", now)
            scope = await self._usage_scope(request)
        except UnknownScope as exc:
            return error(404, str(exc), "not_found")
        except ValueError as exc:
            return error(400, str(exc), "invalid")
        await self._usage_caught_up()
        totals = await usage_totals(self.backend, by, scope, since)
        groups = [g.as_dict() for g in totals]
        if by in ("key", "project", "team", "org"):  # each group named as people know it, beside its id
            paths, names = await tenancy_paths(self.backend), await self._key_names()
            for g in groups:
                g["name"] = scope_path(f"{by}:{g['group']}", paths, names) if g["group"] else None
        return web.json_response(
            {
                "scope": request.query.get("scope") or None,
                "scope_kind": scope[0] if scope else None,
                "scope_id": scope[1] if scope else None,
                "since": minute_of(since),
                "by": by,
                "groups": groups,
                "total": add_up(totals).as_dict(),
            }
        )

    async def usage_spend(self, request: web.Request) -> web.Response:
        """What a scope has spent in its budget period: ?scope=project:acme/ml/chat&period=day|month."""
        period = request.query.get("period", "month")
        if period not in PERIODS:
            return error(400, f"period={period!r}: budgets run per {' or '.join(PERIODS)}", "invalid")
        now = utc_now()
        try:
            scope = await self._usage_scope(request, required=True)
            assert scope is not None
            await self._usage_caught_up()
            usd = await spend(self.backend, scope, period, now)
        except UnknownScope as exc:
            return error(404, str(exc), "not_found")
        except ScopeError as exc:
            return error(400, str(exc), "invalid")
        return web.json_response(
            {
                "scope": request.query["scope"],
                "scope_kind": scope[0],
                "scope_id": scope[1],
                "period": period,
                "since": period_start(period, now).isoformat(),
                "usd": usd,
            }
        )

    async def request_usage(self, request: web.Request) -> web.Response:
        """One request's usage record, as stored (GW-8: `ctl request ID`)."""
        rid = request.match_info["id"]
        await self._usage_caught_up()
        found = await request_record(self.backend, rid)
        if found is None:
            return error(
                404,
                f"no usage record for request {rid}: a record is written when the request ends; "
                "check the id in the gateway's x-request-id header or access log (the client's own id, "
                "echoed as x-client-request-id, finds it too)",
                "not_found",
            )
        # The key and the tenants named as people know them, beside their ids.
        paths, names = await tenancy_paths(self.backend), await self._key_names()
        for kind in ("key", "project", "team", "org"):
            sid = found.get(f"{kind}_id")
            found[f"{kind}_name"] = scope_path(f"{kind}:{sid}", paths, names) if sid else None
        return web.json_response(found)
