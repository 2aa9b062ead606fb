"""The management API: every command the CLI sends, as an endpoint under ``/api/v1`` (docs/api.md).

:data:`ENDPOINTS` is the one table: path, method, service, verb, payload type, and which of the
payload's fields come from the path or the query (the rest are the JSON body). Each call runs through
:func:`~llmgw.services.api.act.act`, signed with the bearer token the request was authenticated by, so
the command is the one the CLI sends and its actor is that person; the command service decides
whether they may. The answer is the command's :class:`~llmgw.services.api.act.Outcome`, with the
status ``act`` maps (200 applied; a refusal by its code). An ``Idempotency-Key`` header names the
command (:func:`~llmgw.services.api.act.command_id_for`).

A body is decoded strictly into a type derived from the payload's (its fields less those from the path
and query, unknown fields refused), so a body that does not fit is a 400 naming the field. Where the
CLI makes something on the caller's machine — a key's or a token's secret, a password's hash — the
server makes it here the same way; a secret is answered once, in ``result.secret``, and never logged.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType
from typing import Annotated, Any

import msgspec
from aiohttp import web

from llmgw.events.commands.roles import Need as RoleNeed
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import access as A
from llmgw.events.schema import identity as I
from llmgw.events.schema import jobs as J
from llmgw.events.schema import mcp as MCP
from llmgw.events.schema import mirror as E
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import people as P
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import replicas as R
from llmgw.events.schema import tenancy as T
from llmgw.services.api.act import BadIdempotencyKey, Outcome, act, command_id_for

ROUTE_PREFIX = "manage."  # the aiohttp route names of the management endpoints (app.py's _authorize reads it)
# A time with its zone: the services compare it with the aware "now" (a naive one could not be).
AwareDatetime = Annotated[datetime, msgspec.Meta(tz=True)]


class ErrorDetail(msgspec.Struct, kw_only=True, omit_defaults=True):
    message: str
    code: str
    field: str | None = None  # the body, path or query field a 400 is about


class ErrorBody(msgspec.Struct, kw_only=True):
    """How the admin API answers what it did not carry out before a command was sent."""

    error: ErrorDetail


# -- bodies of the commands whose secrets or hashes the server makes, as the CLI does --------------


class CreateKeyBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A key for a project; the server makes its secret (answered once) and sends only its prefix and hash."""

    project: str
    name: str = ""
    user: str | None = None
    rpm: int | None = None
    tpm: int | None = None
    models: list[str] = []
    expires_at: AwareDatetime | None = None
    external: bool = False


class IssueTokenBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A personal access token; the server makes it (answered once) and sends only its prefix, hash and key."""

    label: str = ""
    expires_at: AwareDatetime | None = None


class AddUserBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A person; the server hashes the password (argon2id) and sends only the hash."""

    name: str
    password: str
    display_name: str = ""


class SetPasswordBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    password: str


class IssueScimTokenBody(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A SCIM bearer token for an identity provider; the server makes it (answered once) and sends only its hash."""

    label: str = ""


class Invalid(Exception):
    """Client input that cannot make a command: a 400 naming the field."""

    def __init__(self, message: str, field: str | None = None, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message, self.field, self.code = message, field, code


@dataclass(frozen=True)
class Made:
    """A payload, and the secret made for it (or None), to answer only if the command made it."""

    payload: msgspec.Struct
    secret: str | None = None
    prefix: str | None = None


Maker = Callable[["Manage", web.Request, msgspec.Struct, dict[str, Any]], Awaitable[Made]]
# Whether the request's person holds a role the people service asks (services/people/rules.py need):
# a hint that spares hashing a password for a command the service will refuse; the service decides.
MayHint = Callable[[web.Request, RoleNeed], bool]


@dataclass(frozen=True)
class Endpoint:
    """One command over HTTP. ``path`` is an aiohttp route: ``{field}`` is a payload field taken from the
    path (``{field:.+}`` one that may hold ``/``, as tenant paths do); ``query`` names fields taken from
    the query; the rest is the JSON body (``body``, derived from the payload type unless given with a
    ``make`` that builds the payload)."""

    method: str
    path: str
    service: str
    verb: str
    payload: type[msgspec.Struct]
    summary: str
    query: tuple[str, ...] = ()
    body: type[msgspec.Struct] | None = None
    make: Maker | None = None
    timeout: float = 15.0

    @property
    def path_fields(self) -> tuple[str, ...]:
        return tuple(re.findall(r"\{(\w+)", self.path))

    @property
    def slashed_fields(self) -> tuple[str, ...]:
        """The path fields that may hold a '/' (``{path:.+}``)."""
        return tuple(re.findall(r"\{(\w+):", self.path))

    @property
    def openapi_path(self) -> str:
        return re.sub(r"\{(\w+):[^}]*\}", r"{\1}", self.path)

    @property
    def route_name(self) -> str:
        # aiohttp allows no keyword as a part of a name ("class"): service and verb make one part
        return ROUTE_PREFIX + re.sub(r"\W", "_", f"{self.service}.{self.verb}")

    @property
    def operation_id(self) -> str:
        return f"{self.service}.{self.verb}"

    def field_type(self, name: str) -> Any:
        return next(f.type for f in msgspec.structs.fields(self.payload) if f.name == name)

    def required(self, name: str) -> bool:
        return next(f.required for f in msgspec.structs.fields(self.payload) if f.name == name)


def derived_body(ep: Endpoint) -> type[msgspec.Struct]:
    """The JSON body ``ep`` takes: its payload's fields less those from the path and the query."""
    if ep.body is not None:
        return ep.body
    taken = {*ep.path_fields, *ep.query}
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for f in msgspec.structs.fields(ep.payload):
        if f.name in taken:
            continue
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, f.type, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, f.type))
    name = "".join(part.capitalize() for part in re.split(r"[.\-_]", f"{ep.service}-{ep.verb}")) + "Body"
    return msgspec.defstruct(name, fields, kw_only=True, frozen=True, forbid_unknown_fields=True, module=__name__)  # type: ignore[no-any-return]


# -- the payloads made here ----------------------------------------------------------------------


async def _make_key(manage: Manage, request: web.Request, body: msgspec.Struct, values: dict[str, Any]) -> Made:
    assert isinstance(body, CreateKeyBody)
    secret, prefix, digest = A.make_api_key()
    fields = msgspec.structs.asdict(body)
    return Made(payload=A.CreateKey(prefix=prefix, secret_sha256=digest, **fields), secret=secret, prefix=prefix)


async def _make_token(manage: Manage, request: web.Request, body: msgspec.Struct, values: dict[str, Any]) -> Made:
    assert isinstance(body, IssueTokenBody)
    secret, issue = P.issue(values["name"], "personal", label=body.label, expires_at=body.expires_at)
    return Made(payload=issue, secret=secret, prefix=issue.prefix)


async def _hashed(manage: Manage, request: web.Request, draft: P.AddUser | P.SetPassword, password: str) -> Made:
    """``draft`` with the argon2id hash of ``password``; unhashed when the person may not send it (the
    service refuses it, forbidden, before it looks at the hash: an argon2id hash costs 64 MiB and a
    core's second, not to be spent on a refusal)."""
    from llmgw.services.people.passwords import password_problem  # argon2: only when one is set
    from llmgw.services.people.rules import need

    problem = password_problem(password)
    if problem is not None:
        raise Invalid(f"{problem}: choose another", field="password", code="weak_password")
    needed = need(f"user:{manage.person_of(request)}", draft)
    if needed is not None and manage.may is not None and not manage.may(request, needed):
        return Made(payload=draft)
    digest = await manage.hash_password(password)  # the sign-in's bounded, low-priority slots
    return Made(payload=msgspec.structs.replace(draft, password_hash=digest))


async def _make_user(manage: Manage, request: web.Request, body: msgspec.Struct, values: dict[str, Any]) -> Made:
    assert isinstance(body, AddUserBody)
    draft = P.AddUser(name=body.name, password_hash="", display_name=body.display_name)
    return await _hashed(manage, request, draft, body.password)


async def _make_password(manage: Manage, request: web.Request, body: msgspec.Struct, values: dict[str, Any]) -> Made:
    assert isinstance(body, SetPasswordBody)
    return await _hashed(manage, request, P.SetPassword(name=values["name"], password_hash=""), body.password)


async def _make_scim_token(manage: Manage, request: web.Request, body: msgspec.Struct, values: dict[str, Any]) -> Made:
    assert isinstance(body, IssueScimTokenBody)
    secret, prefix, digest = I.make_scim_token()
    issue = I.IssueScimToken(prefix=prefix, secret_sha256=digest, label=body.label)
    return Made(payload=issue, secret=secret, prefix=prefix)


V = "/api/v1"
ENDPOINTS: tuple[Endpoint, ...] = (
    # the catalog
    Endpoint("POST", f"{V}/models", M.SERVICE, "add", M.AddModel, "Add a model (`ctl model add`)."),
    Endpoint("PUT", f"{V}/models/{{name}}/scale", M.SERVICE, "scale", M.ScaleModel, "Set a model's replicas."),
    Endpoint(
        "PUT", f"{V}/models/{{name}}/resources", M.SERVICE, "resources", M.SetResources, "Set what a replica reserves."
    ),
    Endpoint("POST", f"{V}/models/{{name}}/stop", M.SERVICE, "stop", M.StopModel, "Stop a model; it keeps its files."),
    Endpoint("POST", f"{V}/models/{{name}}/start", M.SERVICE, "start", M.StartModel, "Start a stopped model."),
    Endpoint("POST", f"{V}/models/{{name}}/retry", M.SERVICE, "retry", M.RetryModel, "Place a parked model again."),
    Endpoint(
        "DELETE",
        f"{V}/models/{{name}}",
        M.SERVICE,
        "remove",
        M.RemoveModel,
        "Remove a model; `?purge=true` deletes its mirror files and the nodes' copies too.",
        query=("purge",),
    ),
    Endpoint("PUT", f"{V}/models/{{name}}/class", M.SERVICE, "class", M.SetClass, "Set a model's capacity class."),
    Endpoint("PUT", f"{V}/models/{{name}}/owner", M.SERVICE, "owner", M.SetOwner, "Set the scope a model counts to."),
    Endpoint("PUT", f"{V}/models/{{name}}/slo", M.SERVICE, "slo", M.SetSlo, "Set a model's SLO."),
    Endpoint(
        "PUT",
        f"{V}/models/{{name}}/measured",
        M.SERVICE,
        "measured",
        M.SaveMeasurement,
        "Record what a benchmark measured (`ctl bench --save`).",
    ),
    # the fleet
    Endpoint(
        "POST", f"{V}/nodes/{{node_id}}/cordon", N.SERVICE, "cordon", N.CordonNode, "Place nothing new on a node."
    ),
    Endpoint(
        "POST", f"{V}/nodes/{{node_id}}/uncordon", N.SERVICE, "uncordon", N.UncordonNode, "Let a node take replicas."
    ),
    Endpoint("POST", f"{V}/nodes/{{node_id}}/drain", N.SERVICE, "drain", N.DrainNode, "Move a node's replicas away."),
    Endpoint(
        "POST",
        f"{V}/replicas/{{replica_id}}/restart",
        N.SERVICE,
        "restart",
        R.RestartReplica,
        "Restart a replica, a new copy first.",
    ),
    # tenancy and quotas
    Endpoint("POST", f"{V}/tenants", T.SERVICE, "create", T.CreateScope, "Create an org, a team or a project."),
    Endpoint(
        "PATCH",
        f"{V}/tenants/{{kind}}/{{path:.+}}",
        T.SERVICE,
        "rename",
        T.RenameScope,
        "Rename a tenant (the last part of its path).",
    ),
    Endpoint("DELETE", f"{V}/tenants/{{kind}}/{{path:.+}}", T.SERVICE, "delete", T.DeleteScope, "Delete an empty one."),
    Endpoint("PUT", f"{V}/quotas/{{scope:.+}}", T.SERVICE, "quota-set", Q.SetQuota, "Set a scope's capacity quota."),
    Endpoint("DELETE", f"{V}/quotas/{{scope:.+}}", T.SERVICE, "quota-clear", Q.ClearQuota, "Remove a scope's quota."),
    # access
    Endpoint(
        "POST",
        f"{V}/keys",
        A.SERVICE,
        "key.create",
        A.CreateKey,
        "Make an API key for a project; its secret is in `result.secret`, shown this once.",
        body=CreateKeyBody,
        make=_make_key,
    ),
    Endpoint(
        "DELETE", f"{V}/keys/{{key}}", A.SERVICE, "key.revoke", A.RevokeKey, "Revoke a key (id or prefix).", ("reason",)
    ),
    Endpoint("PUT", f"{V}/limits/{{scope:.+}}", A.SERVICE, "limit.set", A.SetLimit, "Set a scope's rpm/tpm limits."),
    Endpoint("PUT", f"{V}/prices/{{model}}", A.SERVICE, "price.set", A.SetPrice, "Set a model's price per million."),
    Endpoint("PUT", f"{V}/budgets/{{scope:.+}}", A.SERVICE, "budget.set", A.SetBudget, "Set a scope's budget."),
    # people
    Endpoint(
        "POST",
        f"{V}/users",
        P.SERVICE,
        "user.add",
        P.AddUser,
        "Add a person; the server hashes the password.",
        body=AddUserBody,
        make=_make_user,
    ),
    Endpoint(
        "PUT",
        f"{V}/users/{{name}}/password",
        P.SERVICE,
        "user.passwd",
        P.SetPassword,
        "Set a person's password (one's own, or as a cluster admin).",
        body=SetPasswordBody,
        make=_make_password,
    ),
    Endpoint("POST", f"{V}/users/{{name}}/disable", P.SERVICE, "user.disable", P.DisableUser, "Stop a person."),
    Endpoint("POST", f"{V}/users/{{name}}/enable", P.SERVICE, "user.enable", P.EnableUser, "Let a person in again."),
    Endpoint(
        "PUT", f"{V}/users/{{name}}/language", P.SERVICE, "user.language", P.SetLanguage, "Set a console language."
    ),
    Endpoint("POST", f"{V}/users/{{name}}/roles", P.SERVICE, "role.grant", P.GrantRole, "Grant a role over a scope."),
    Endpoint(
        "DELETE",
        f"{V}/users/{{name}}/roles/{{role}}/{{scope:.+}}",
        P.SERVICE,
        "role.revoke",
        P.RevokeRole,
        "Take a role back.",
    ),
    Endpoint(
        "POST",
        f"{V}/users/{{name}}/tokens",
        P.SERVICE,
        "token.issue",
        P.IssueToken,
        "Make a personal access token; it is in `result.secret`, shown this once.",
        body=IssueTokenBody,
        make=_make_token,
    ),
    Endpoint(
        "DELETE",
        f"{V}/users/{{name}}/tokens/{{token}}",
        P.SERVICE,
        "token.revoke",
        P.RevokeToken,
        "Revoke a token (id or prefix).",
        query=("reason",),
    ),
    # the company's identity: providers, their groups' roles, SCIM tokens (cluster admins')
    Endpoint(
        "POST",
        f"{V}/identity/providers",
        I.SERVICE,
        "idp.set",
        I.SetProvider,
        "Add or change an identity provider (OIDC or LDAP); a secret only by its environment variable's name.",
    ),
    Endpoint(
        "DELETE", f"{V}/identity/providers/{{name}}", I.SERVICE, "idp.remove", I.RemoveProvider, "Remove a provider."
    ),
    Endpoint(
        "POST",
        f"{V}/identity/providers/{{provider}}/mappings",
        I.SERVICE,
        "idp.map",
        I.MapGroup,
        "Map a provider's group (or `scim`'s) to a role over a scope.",
    ),
    Endpoint(
        "DELETE",
        f"{V}/identity/providers/{{provider}}/mappings/{{mapping}}",
        I.SERVICE,
        "idp.unmap",
        I.UnmapGroup,
        "Remove a group mapping (by its id).",
    ),
    Endpoint(
        "POST",
        f"{V}/scim-tokens",
        I.SERVICE,
        "scim.token-issue",
        I.IssueScimToken,
        "Make a SCIM bearer token for an identity provider; it is in `result.secret`, shown this once.",
        body=IssueScimTokenBody,
        make=_make_scim_token,
    ),
    Endpoint(
        "DELETE",
        f"{V}/scim-tokens/{{token}}",
        I.SERVICE,
        "scim.token-revoke",
        I.RevokeScimToken,
        "Revoke a SCIM token (id or prefix).",
    ),
    # the MCP servers behind /mcp (cluster admins'), and who may use them (a project's team admins')
    Endpoint(
        "POST",
        f"{V}/mcp/servers",
        MCP.SERVICE,
        "mcp.add",
        MCP.AddServer,
        "Add or change an MCP server (a URL or a command); a header's value only by its environment variable's name.",
    ),
    Endpoint(
        "DELETE", f"{V}/mcp/servers/{{name}}", MCP.SERVICE, "mcp.remove", MCP.RemoveServer, "Remove an MCP server."
    ),
    Endpoint(
        "POST",
        f"{V}/mcp/servers/{{server}}/grants",
        MCP.SERVICE,
        "mcp.allow",
        MCP.Allow,
        "Let a project (or one of its keys) use a server's tools: all, or those named (added to its grant).",
    ),
    Endpoint(
        "POST",
        f"{V}/mcp/servers/{{server}}/grants/withdraw",
        MCP.SERVICE,
        "mcp.disallow",
        MCP.Disallow,
        "Take tools from a project's (or key's) grant, or the whole grant when none are named.",
    ),
    # jobs and the mirror
    Endpoint(
        "POST",
        f"{V}/serve",
        J.SERVICE,
        "serve",
        J.ServeModel,
        "Serve a model from the hub (`ctl model serve`); `result.job` names the job.",
        timeout=30.0,
    ),
    Endpoint(
        "POST", f"{V}/mirror", E.SERVICE, "fetch", E.MirrorFetch, "Fetch a repository into the mirror.", timeout=60.0
    ),
    Endpoint(
        "DELETE",
        f"{V}/mirror/{{model}}",
        E.SERVICE,
        "remove",
        E.MirrorRemove,
        "Delete a model's mirror files: one `?version=`, or all.",
        query=("version",),
    ),
)

# Each endpoint's body type, made once (by route name): the handlers decode into these, the document shows them.
BODIES: Mapping[str, type[msgspec.Struct]] = MappingProxyType({ep.route_name: derived_body(ep) for ep in ENDPOINTS})

_FIELD = re.compile(r"`\$\.([^`\[]+)|field `([^`]+)`")


def field_of(exc: msgspec.ValidationError) -> str | None:
    """The field msgspec's message names (``at `$.min```, ``unknown field `x```), or None."""
    m = _FIELD.search(str(exc))
    return (m.group(1) or m.group(2)) if m else None


def invalid(message: str, field: str | None = None, code: str = "invalid_request") -> web.Response:
    detail = ErrorDetail(message=message, code=code, field=field)
    return web.json_response(msgspec.to_builtins(ErrorBody(error=detail)), status=400)


def bearer_token(request: web.Request) -> str:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


async def _hash_now(password: str) -> str:
    """A password's hash off the event loop, for a Manage without the sign-in's bounded checker."""
    from llmgw.services.people.passwords import hash_password  # argon2: only when one is set

    return await asyncio.to_thread(hash_password, password)


class Manage:
    """The management endpoints of one admin API: each sends its command as the request's person."""

    def __init__(
        self,
        store: EventStore,
        person_of: Callable[[web.Request], str],
        token_of: Callable[[web.Request], str] = bearer_token,
        may: MayHint | None = None,
        hash_password: Callable[[str], Awaitable[str]] | None = None,
    ) -> None:
        self.store = store
        self.person_of = person_of  # the authenticated person's name (the admin API's middleware set it)
        self.token_of = token_of  # the token that authenticated the request: the command is signed with it
        self.may = may
        self.hash_password = hash_password or _hash_now

    def routes(self, app: web.Application) -> None:
        for ep in ENDPOINTS:
            app.router.add_route(ep.method, ep.path, self._handler(ep), name=ep.route_name)

    def _handler(self, ep: Endpoint) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handle(request: web.Request) -> web.Response:
            return await self.handle(ep, request)

        return handle

    async def handle(self, ep: Endpoint, request: web.Request) -> web.Response:
        token = self.token_of(request)
        if not token:
            detail = ErrorDetail(message="send Authorization: Bearer TOKEN to change anything here", code="unsigned")
            return web.json_response(msgspec.to_builtins(ErrorBody(error=detail)), status=401)
        person = self.person_of(request)
        command_id = None
        key = request.headers.get("Idempotency-Key")
        if key is not None:
            try:
                command_id = command_id_for(person, key)
            except BadIdempotencyKey as exc:
                return invalid(str(exc), "Idempotency-Key")
        try:
            made = await self.made(ep, request)
        except Invalid as exc:
            return invalid(exc.message, exc.field, exc.code)
        outcome = await act(
            self.store, token, ep.service, ep.verb, made.payload, command_id=command_id, timeout=ep.timeout
        )
        return web.json_response(msgspec.to_builtins(answered(outcome, made)), status=outcome.status)

    async def made(self, ep: Endpoint, request: web.Request) -> Made:
        """The command's payload from the request's path, query and body; raises :class:`Invalid`."""
        raw = await request.read()
        try:
            body = msgspec.json.decode(raw if raw.strip() else b"{}", type=BODIES[ep.route_name])
        except msgspec.ValidationError as exc:
            raise Invalid(f"the body does not fit {ep.method} {ep.openapi_path}: {exc}", field_of(exc)) from exc
        except msgspec.DecodeError as exc:
            raise Invalid(f"the body is not JSON ({exc}): send an object of the fields, or nothing") from exc
        values: dict[str, Any] = {name: request.match_info[name] for name in ep.path_fields}
        values.update({name: request.query[name] for name in ep.query if name in request.query})
        if ep.make is not None:
            return await ep.make(self, request, body, values)
        try:
            # Path and query give text: converted leniently ("true" a bool); the body was decoded strictly.
            return Made(payload=msgspec.convert({**msgspec.to_builtins(body), **values}, ep.payload, strict=False))
        except msgspec.ValidationError as exc:
            name = field_of(exc)
            where = "query" if name in ep.query else "path"
            raise Invalid(f"{where} field {name}: {exc}", name) from exc


def answered(outcome: Outcome, made: Made) -> Outcome:
    """The outcome, with the secret made for it when this command made it: a command named by an
    Idempotency-Key that ran before answers its first outcome, whose key (another prefix) this secret
    is not — then no secret is answered (it was, once, the first time)."""
    if made.secret is None or not outcome.applied or outcome.result.get("prefix") != made.prefix:
        return outcome
    return msgspec.structs.replace(outcome, result={**outcome.result, "secret": made.secret})
