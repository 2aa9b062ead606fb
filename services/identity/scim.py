"""SCIM 2.0 provisioning at ``/scim/v2`` (RFC 7643, RFC 7644; SPEC ID-4), on the admin API's port.

An identity provider (Okta, Entra ID, …) creates, changes, deactivates and deletes people and groups
here with a bearer token made for it (``llmgw ctl scim token create``; only its hash is on the log).
Every change is a command signed by the ``scim`` service with actor ``svc:scim``, so the log names
SCIM: a User is a person of the people service (ProvisionUser, RemoveUser), a Group is the identity
service's (SetScimGroup, RemoveScimGroup), and whoever joins or leaves a group has their roles made
to follow their groups' mappings (SyncRoles, provider ``scim``). Each answer is the resource as the
admin API's own fold shows it once the change is read there, so a deactivated person's sessions and
tokens stop working by the time the identity provider hears back.

What is kept and published is in :mod:`.scim_resources`; filters and PATCH paths in :mod:`.scim_filter`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

import msgspec
import structlog
from aiohttp import web

from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.errors import CommandError, CommandRejectedError
from llmgw.events.folds.identity import Identity, ScimGroup, ScimToken
from llmgw.events.folds.people import People, Person
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import identity as I
from llmgw.events.schema import people as P
from llmgw.events.schema.ids import new_id
from llmgw.services.api.signin import SignIn
from llmgw.services.identity import scim_resources as R
from llmgw.services.identity.mapping import grants_for
from llmgw.services.identity.scim_filter import AttrInfo, Filter, FilterError, check, matches, parse_filter

log = structlog.get_logger("llmgw.services.identity.scim")

PREFIX = "/scim/v2"
SERVICE = "scim"  # the service its commands are signed as
ACTOR = "svc:scim"
CONTENT_TYPE = "application/scim+json"
TOKEN_HINT = "make one for the identity provider with `llmgw ctl scim token create`"


# -- pure decisions ------------------------------------------------------------------------------------


def authenticate(identity: Identity, authorization: str) -> ScimToken | R.ScimError:
    """The SCIM token an ``Authorization`` header carries, or the 401 to answer (pure)."""
    scheme, _, token = authorization.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        return R.ScimError(401, f"send Authorization: Bearer TOKEN with a SCIM token: {TOKEN_HINT}")
    if P.token_prefix(token) is not None:
        return R.ScimError(401, f"this is a person's token, not a SCIM token: {TOKEN_HINT}")
    prefix = I.scim_token_prefix(token)
    held = identity.scim_tokens_by_prefix.get(prefix) if prefix else None
    if held is None or not hmac.compare_digest(held.secret_sha256, hashlib.sha256(token.encode()).hexdigest()):
        return R.ScimError(401, f"this SCIM token is unknown or was revoked: {TOKEN_HINT}")
    return held


def page(query: Mapping[str, Any]) -> tuple[int, int]:
    """(startIndex, count) of a list request (RFC 7644 §3.4.2.4): 1-based; count at most MAX_RESULTS."""

    def number(name: str, default: int) -> int:
        raw = query.get(name)
        if raw is None or raw == "":
            return default
        try:
            return int(raw)
        except (TypeError, ValueError):
            raise R.ScimError(400, f"{name} must be a whole number, not {str(raw)[:20]!r}", "invalidValue") from None

    start = max(number("startIndex", 1), 1)
    count = min(max(number("count", R.DEFAULT_COUNT), 0), R.MAX_RESULTS)
    return start, count


def parsed_filter(text: str | None, attributes: Mapping[str, AttrInfo]) -> Filter | None:
    if text is None or not str(text).strip():
        return None
    if not isinstance(text, str):
        raise R.ScimError(400, "filter must be a string", "invalidFilter")
    try:
        f = parse_filter(text)
        check(f, attributes)
    except FilterError as exc:
        detail = f"the filter {text[:100]!r} is not one this server reads: {exc.detail}"
        raise R.ScimError(400, detail, exc.scim_type) from exc
    return f


def user_fields_of(person: Person) -> R.UserFields:
    return R.UserFields(
        user_name=person.login or person.name,
        display_name=person.display_name,
        email=person.email,
        external_id=person.external_id,
        active=not person.disabled,
    )


def group_fields_of(group: ScimGroup) -> R.GroupFields:
    return R.GroupFields(display_name=group.display_name, external_id=group.external_id, members=group.members)


def scim_people(people: People) -> list[Person]:
    """The people SCIM made, oldest first (the order pages are cut in)."""
    return sorted((p for p in people.by_name.values() if p.source == I.SCIM), key=lambda p: (p.added_at, p.name))


def groups_by_person(identity: Identity) -> dict[str, list[tuple[str, str]]]:
    out: dict[str, list[tuple[str, str]]] = {}
    for g in identity.scim_groups.values():
        for m in g.members:
            out.setdefault(m, []).append((g.group_id, g.display_name))
    return out


def roles_lag(person: Person, groups: tuple[str, ...], grants: Sequence[P.MappedGrant]) -> bool:
    """Whether ``person``'s roles from SCIM are not yet what ``groups`` grant (pure): the groups last
    recorded differ, a role granted is not held, or a role SCIM granted is no longer granted."""
    wanted = {(g.role, g.scope) for g in grants}
    from_scim = {(r, s) for r, s in person.roles if (person.via(r, s) or ("",))[0] == I.SCIM}
    held = set(person.roles)
    return person.groups.get(I.SCIM, ()) != groups or not wanted <= held or not from_scim <= wanted


def refused(exc: CommandError) -> R.ScimError:
    """A command's refusal as the SCIM answer a provider can act on."""
    if not isinstance(exc, CommandRejectedError):
        return R.ScimError(503, f"the change could not be recorded ({exc}); nothing may have been done: try again")
    if exc.code in ("local_account", "exists", "taken", "provider_account"):
        return R.ScimError(409, exc.reason, "uniqueness")
    if exc.code == "not_found":
        return R.ScimError(404, exc.reason)
    if exc.code == "unavailable":
        return R.ScimError(503, exc.reason)
    return R.ScimError(400, exc.reason, "invalidValue")


# -- the endpoint --------------------------------------------------------------------------------------


class KeyedLocks:
    """A lock per key, kept only while someone holds or waits for it (so bounded by the requests in flight)."""

    def __init__(self) -> None:
        self._held: dict[str, tuple[asyncio.Lock, int]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._held.get(key, (asyncio.Lock(), 0))
        self._held[key] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._held[key]
            if users == 1:
                del self._held[key]
            else:
                self._held[key] = (lock, users - 1)

    def __len__(self) -> int:
        return len(self._held)


class ScimApi:
    """``/scim/v2``: its own bearer tokens, its own error shape, every change sent as svc:scim."""

    def __init__(self, store: EventStore, signin: Callable[[], SignIn | None]) -> None:
        self.store = store
        self._signin_of = signin
        self.client = CommandClient.for_service(store, SERVICE)
        # One change at a time per resource in this process: identity providers send changes to one group
        # in parallel (Entra ID does), and each is read, changed and written whole.
        self.locks = KeyedLocks()

    def app(self) -> web.Application:
        """The sub-application mounted at :data:`PREFIX` (its middlewares answer every error SCIM's way)."""
        app = web.Application(middlewares=[self._errors, self._authenticate])
        r = app.router
        r.add_get("/ServiceProviderConfig", self.service_provider_config)
        r.add_get("/ResourceTypes", self.resource_types)
        r.add_get("/ResourceTypes/{id}", self.resource_type)
        r.add_get("/Schemas", self.schemas)
        r.add_get("/Schemas/{id}", self.schema)
        r.add_get("/Users", self.list_users)
        r.add_post("/Users", self.create_user)
        r.add_post("/Users/.search", self.search_users)
        r.add_get("/Users/{id}", self.get_user)
        r.add_put("/Users/{id}", self.replace_user)
        r.add_patch("/Users/{id}", self.patch_user)
        r.add_delete("/Users/{id}", self.delete_user)
        r.add_get("/Groups", self.list_groups)
        r.add_post("/Groups", self.create_group)
        r.add_post("/Groups/.search", self.search_groups)
        r.add_get("/Groups/{id}", self.get_group)
        r.add_put("/Groups/{id}", self.replace_group)
        r.add_patch("/Groups/{id}", self.patch_group)
        r.add_delete("/Groups/{id}", self.delete_group)
        r.add_post("/.search", self.search_all)
        app.cleanup_ctx.append(self._following_mappings)
        return app

    async def _following_mappings(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self.follow_mappings(), name="scim-mappings")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def follow_mappings(self) -> None:
        """A SCIM group mapped to a role (or unmapped) reaches its members at once, not at the group's next
        change: each time the mappings of ``scim`` change, every SCIM member's roles are brought in line.
        Every admin API process does it; the second to send a sync is answered "so already"."""
        seen: tuple[str, ...] | None = None
        while True:
            signin = self._signin_of()
            if signin is None:
                return
            current = tuple(m.mapping_id for m in signin.identity.mappings_of(I.SCIM))
            if current != seen:
                if seen is not None or current:
                    members = {name for g in signin.identity.scim_groups.values() for name in g.members}
                    try:
                        await self.sync_roles(members)
                    except Exception:  # the next change tries again; a failed sync is healed by touching a group
                        log.exception("SCIM members' roles could not follow a changed mapping")
                seen = current

            def changed(then: tuple[str, ...] = current, s: SignIn = signin) -> bool:
                return tuple(m.mapping_id for m in s.identity.mappings_of(I.SCIM)) != then

            await signin.folded(changed, deadline_s=60.0)

    # -- plumbing ----------------------------------------------------------------------------------

    @staticmethod
    def answer(body: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
        return web.Response(body=msgspec.json.encode(body), status=status, content_type=CONTENT_TYPE, headers=headers)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        try:
            return await handler(request)
        except R.ScimError as exc:
            headers = {"WWW-Authenticate": 'Bearer realm="llmgw-scim"'} if exc.status == 401 else None
            return self.answer(exc.body(), exc.status, headers)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            detail = {
                404: f"there is nothing at {request.path[:200]}: SCIM serves {PREFIX}/Users, {PREFIX}/Groups "
                f"and discovery ({PREFIX}/ServiceProviderConfig, /ResourceTypes, /Schemas)",
                405: f"{request.method} is not allowed on {request.path[:200]}",
                413: "the body is too large",
            }.get(exc.status, exc.reason or "error")
            headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
            return self.answer(R.ScimError(exc.status, detail).body(), exc.status, headers)
        except Exception as exc:  # never the client's doing: logged, and said as little as is useful
            log.exception("SCIM request failed", path=request.path, method=request.method)
            return self.answer(
                R.ScimError(500, f"internal error ({type(exc).__name__}); see the server log").body(), 500
            )

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        got = authenticate(self.signin().identity, request.headers.get("authorization", ""))
        if isinstance(got, R.ScimError):
            raise got
        return await handler(request)

    def signin(self) -> SignIn:
        signin = self._signin_of()
        if signin is None:
            raise R.ScimError(503, "SCIM is not served by this process: it runs where the admin API runs")
        return signin

    @staticmethod
    def base(request: web.Request) -> str:
        return f"{request.scheme}://{request.host}{PREFIX}"

    @staticmethod
    async def body(request: web.Request) -> Any:
        raw = await request.read()
        if not raw.strip():
            raise R.ScimError(400, "the request has no body: send the resource as JSON", "invalidSyntax")
        try:
            return msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise R.ScimError(400, f"the body is not JSON: {exc}", "invalidSyntax") from exc
        except RecursionError as exc:  # msgspec's answer to JSON nested thousands deep
            raise R.ScimError(400, "the body nests too deep to be a SCIM resource", "invalidSyntax") from exc

    async def send(self, service: str, verb: str, payload: msgspec.Struct) -> int:
        """Send one command as svc:scim; the log position of its last event (0: it changed nothing)."""
        try:
            done = await self.client.send(service, verb, payload, actor=ACTOR)
        except CommandError as exc:
            raise refused(exc) from exc
        return done.last_seq

    async def seen(self, condition: Callable[[], bool], what: str) -> None:
        """Wait (bounded) until the admin API's fold shows a change just made; a 503 if it does not in time."""
        if not await self.signin().folded(condition):
            raise R.ScimError(503, f"{what} was recorded but is not readable here yet: read it again in a moment")

    async def people_at(self, seq: int) -> None:
        if seq:
            await self.seen(lambda: self.signin().people.position >= seq, "the change")

    @staticmethod
    def selection(request: web.Request, body: Mapping[str, Any] | None = None) -> tuple[list[str], list[str]]:
        source: Mapping[str, Any] = body if body is not None else request.query
        attributes, excluded = source.get("attributes"), source.get("excludedAttributes")
        if isinstance(attributes, list):
            attributes = ",".join(str(a) for a in attributes)
        if isinstance(excluded, list):
            excluded = ",".join(str(a) for a in excluded)
        return R.attribute_list(str(attributes or "")), R.attribute_list(str(excluded or ""))

    def shaped(self, request: web.Request, resource: dict[str, Any], status: int = 200) -> web.Response:
        attributes, excluded = self.selection(request)
        headers = {"Location": resource["meta"]["location"]} if status == 201 else None
        return self.answer(R.select(resource, attributes, excluded), status, headers)

    # -- discovery ---------------------------------------------------------------------------------

    async def service_provider_config(self, request: web.Request) -> web.Response:
        return self.answer(R.service_provider_config(self.base(request)))

    async def resource_types(self, request: web.Request) -> web.Response:
        found = R.resource_types(self.base(request))
        return self.answer(R.list_response(found, len(found), 1))

    async def resource_type(self, request: web.Request) -> web.Response:
        wanted = request.match_info["id"]
        found = next((t for t in R.resource_types(self.base(request)) if t["id"] == wanted), None)
        if found is None:
            raise R.ScimError(404, f"there is no resource type {wanted[:60]!r}: they are User and Group")
        return self.answer(found)

    async def schemas(self, request: web.Request) -> web.Response:
        found = R.schemas(self.base(request))
        return self.answer(R.list_response(found, len(found), 1))

    async def schema(self, request: web.Request) -> web.Response:
        wanted = request.match_info["id"]
        found = next((s for s in R.schemas(self.base(request)) if s["id"] == wanted), None)
        if found is None:
            raise R.ScimError(
                404, f"there is no schema {wanted[:100]!r}: they are {R.USER_SCHEMA} and {R.GROUP_SCHEMA}"
            )
        return self.answer(found)

    async def search_all(self, request: web.Request) -> web.Response:
        raise R.ScimError(501, f"search one resource type at a time: {PREFIX}/Users/.search or /Groups/.search")

    # -- users -------------------------------------------------------------------------------------

    def user_resource(self, request: web.Request, person: Person, groups: Sequence[tuple[str, str]]) -> dict[str, Any]:
        return R.render_user(
            name=person.name,
            fields=user_fields_of(person),
            created=person.added_at,
            modified=person.changed_at,
            groups=groups,
            base=self.base(request),
        )

    def scim_person(self, name: str) -> Person:
        person = self.signin().people.by_name.get(name)
        if person is None or person.source != I.SCIM:
            raise R.ScimError(404, f"there is no SCIM user {name[:80]!r}")
        return person

    def user_now(self, request: web.Request, name: str) -> dict[str, Any]:
        person = self.scim_person(name)
        groups = [(g.group_id, g.display_name) for g in self.signin().identity.scim_groups_of(person.name)]
        return self.user_resource(request, person, groups)

    async def get_user(self, request: web.Request) -> web.Response:
        return self.shaped(request, self.user_now(request, request.match_info["id"]))

    async def list_users(self, request: web.Request) -> web.Response:
        return self.user_list(request, request.query)

    async def search_users(self, request: web.Request) -> web.Response:
        return self.user_list(request, R.body_object(await self.body(request), "a SearchRequest"), searched=True)

    def user_list(self, request: web.Request, query: Mapping[str, Any], searched: bool = False) -> web.Response:
        start, count = page(query)
        f = parsed_filter(query.get("filter"), R.USER_FILTERS)
        signin = self.signin()
        memberships = groups_by_person(signin.identity)
        rendered = (self.user_resource(request, p, memberships.get(p.name, [])) for p in scim_people(signin.people))
        return self.listed(request, rendered, f, R.USER_FILTERS, start, count, query if searched else None)

    def listed(
        self,
        request: web.Request,
        resources: Iterable[dict[str, Any]],
        f: Filter | None,
        attributes: Mapping[str, AttrInfo],
        start: int,
        count: int,
        body: Mapping[str, Any] | None,
    ) -> web.Response:
        hits = [r for r in resources if f is None or matches(f, r, attributes)]
        chosen, excluded = self.selection(request, body)
        shown = [R.select(r, chosen, excluded) for r in hits[start - 1 : start - 1 + count]]
        return self.answer(R.list_response(shown, len(hits), start))

    def _clash(self, user_name: str, name: str | None) -> None:
        """409 when ``user_name`` is someone else's already (ignoring case)."""
        people = self.signin().people
        other = people.by_provider_login(user_name)
        if other is not None and other.name != name:
            via = "" if other.source == I.SCIM else f", who signs in through {other.source}"
            raise R.ScimError(409, f"the userName {user_name!r} belongs to {other.name}{via}", "uniqueness")

    async def create_user(self, request: web.Request) -> web.Response:
        fields = R.user_fields(await self.body(request))
        async with self.locks.hold(f"login:{fields.user_name.lower()}"):
            return await self._create_user(request, fields)

    async def _create_user(self, request: web.Request, fields: R.UserFields) -> web.Response:
        self._clash(fields.user_name, None)
        people = self.signin().people
        local = people.by_name.get(P.person_name(fields.user_name))
        # A person added here with a password keeps their name: the people service refuses (local_account).
        hint = local.name if local is not None and not local.source else ""
        try:
            done = await self.client.send(P.SERVICE, "user.provision", self._provision(fields, hint), actor=ACTOR)
        except CommandError as exc:
            raise refused(exc) from exc
        name = str((done.result or {}).get("user", ""))
        await self.seen(lambda: name in people.by_name and people.position >= done.last_seq, f"user {name}")
        return self.shaped(request, self.user_now(request, name), 201)

    @staticmethod
    def _provision(fields: R.UserFields, name: str) -> P.ProvisionUser:
        return P.ProvisionUser(
            source=I.SCIM,
            login=fields.user_name,
            name=name,
            display_name=fields.display_name,
            email=fields.email,
            external_id=fields.external_id,
            active=fields.active,
        )

    async def _change_user(self, request: web.Request, person: Person, fields: R.UserFields) -> web.Response:
        if fields != user_fields_of(person):
            self._clash(fields.user_name, person.name)
            await self.people_at(await self.send(P.SERVICE, "user.provision", self._provision(fields, person.name)))
        return self.shaped(request, self.user_now(request, person.name))

    async def replace_user(self, request: web.Request) -> web.Response:
        body = await self.body(request)
        async with self.locks.hold(f"user:{request.match_info['id']}"):
            person = self.scim_person(request.match_info["id"])
            return await self._change_user(request, person, R.user_fields(body, user_fields_of(person)))

    async def patch_user(self, request: web.Request) -> web.Response:
        ops = R.operations(await self.body(request))
        async with self.locks.hold(f"user:{request.match_info['id']}"):
            person = self.scim_person(request.match_info["id"])
            return await self._change_user(request, person, R.patch_user(user_fields_of(person), ops))

    async def delete_user(self, request: web.Request) -> web.Response:
        async with self.locks.hold(f"user:{request.match_info['id']}"):
            return await self._delete_user(self.scim_person(request.match_info["id"]))

    async def _delete_user(self, person: Person) -> web.Response:
        identity = self.signin().identity
        # Out of their groups first: a name freed here must not inherit a membership later.
        for group_id in [g.group_id for g in identity.scim_groups_of(person.name)]:
            async with self.locks.hold(f"group:{group_id}"):
                g = identity.scim_groups.get(group_id)
                if g is not None and person.name in g.members:
                    members = tuple(m for m in g.members if m != person.name)
                    await self._set_group(group_id, msgspec.structs.replace(group_fields_of(g), members=members))
        seq = await self.send(P.SERVICE, "user.remove", P.RemoveUser(name=person.name))
        people = self.signin().people
        await self.seen(lambda: person.name not in people.by_name and people.position >= seq, f"removing {person.name}")
        return web.Response(status=204)

    # -- groups ------------------------------------------------------------------------------------

    def group_resource(self, request: web.Request, group: ScimGroup) -> dict[str, Any]:
        return R.render_group(
            group_id=group.group_id,
            fields=group_fields_of(group),
            created=group.created_at,
            modified=group.updated_at,
            base=self.base(request),
        )

    def scim_group(self, group_id: str) -> ScimGroup:
        group = self.signin().identity.scim_groups.get(group_id)
        if group is None:
            raise R.ScimError(404, f"there is no SCIM group {group_id[:80]!r}")
        return group

    async def get_group(self, request: web.Request) -> web.Response:
        return self.shaped(request, self.group_resource(request, self.scim_group(request.match_info["id"])))

    async def list_groups(self, request: web.Request) -> web.Response:
        return self.group_list(request, request.query)

    async def search_groups(self, request: web.Request) -> web.Response:
        return self.group_list(request, R.body_object(await self.body(request), "a SearchRequest"), searched=True)

    def group_list(self, request: web.Request, query: Mapping[str, Any], searched: bool = False) -> web.Response:
        start, count = page(query)
        f = parsed_filter(query.get("filter"), R.GROUP_FILTERS)
        groups = sorted(self.signin().identity.scim_groups.values(), key=lambda g: (g.created_at, g.group_id))
        rendered = (self.group_resource(request, g) for g in groups)
        return self.listed(request, rendered, f, R.GROUP_FILTERS, start, count, query if searched else None)

    def _check_members(self, members: Iterable[str]) -> None:
        people = self.signin().people
        unknown = [m for m in members if (p := people.by_name.get(m)) is None or p.source != I.SCIM]
        if unknown:
            shown = ", ".join(repr(m[:60]) for m in unknown[:5])
            raise R.ScimError(400, f"no SCIM user has the id {shown}: a member is a User's id here", "invalidValue")

    def _check_name(self, fields: R.GroupFields, group_id: str) -> None:
        taken = next(
            (
                g
                for g in self.signin().identity.scim_groups.values()
                if g.group_id != group_id and g.display_name.lower() == fields.display_name.lower()
            ),
            None,
        )
        if taken is not None:
            raise R.ScimError(409, f"a group named {fields.display_name!r} exists (id {taken.group_id})", "uniqueness")

    async def _set_group(self, group_id: str, fields: R.GroupFields) -> None:
        identity = self.signin().identity
        await self.send(
            I.SERVICE,
            "scim.group-set",
            I.SetScimGroup(
                group_id=group_id,
                display_name=fields.display_name,
                external_id=fields.external_id,
                members=fields.members,
            ),
        )

        def shown() -> bool:
            g = identity.scim_groups.get(group_id)
            return g is not None and group_fields_of(g) == fields

        await self.seen(shown, f"group {fields.display_name}")

    async def _write_group(
        self, request: web.Request, group_id: str, old: ScimGroup | None, fields: R.GroupFields
    ) -> web.Response:
        before = old.members if old else ()
        self._check_name(fields, group_id)
        self._check_members(m for m in fields.members if m not in before)
        if old is None or group_fields_of(old) != fields:
            await self._set_group(group_id, fields)
        await self.sync_roles({*before, *fields.members})
        group = self.scim_group(group_id)
        return self.shaped(request, self.group_resource(request, group), 201 if old is None else 200)

    async def create_group(self, request: web.Request) -> web.Response:
        return await self._write_group(request, new_id(), None, R.group_fields(await self.body(request)))

    async def replace_group(self, request: web.Request) -> web.Response:
        fields = R.group_fields(await self.body(request))
        async with self.locks.hold(f"group:{request.match_info['id']}"):
            old = self.scim_group(request.match_info["id"])
            return await self._write_group(request, old.group_id, old, fields)

    async def patch_group(self, request: web.Request) -> web.Response:
        ops = R.operations(await self.body(request))
        async with self.locks.hold(f"group:{request.match_info['id']}"):
            old = self.scim_group(request.match_info["id"])
            return await self._write_group(request, old.group_id, old, R.patch_group(group_fields_of(old), ops))

    async def delete_group(self, request: web.Request) -> web.Response:
        async with self.locks.hold(f"group:{request.match_info['id']}"):
            group = self.scim_group(request.match_info["id"])
            identity = self.signin().identity
            await self.send(I.SERVICE, "scim.group-remove", I.RemoveScimGroup(group_id=group.group_id))
            await self.seen(lambda: group.group_id not in identity.scim_groups, f"removing group {group.display_name}")
            await self.sync_roles(group.members)
        return web.Response(status=204)

    async def sync_roles(self, names: Iterable[str]) -> None:
        """Make the roles of each of ``names`` follow their SCIM groups' mappings, as folded now: those who
        joined or left a group, those of a group renamed, and any whose roles lag (a sync that failed, a
        mapping made since), so touching a group heals its members."""
        signin = self.signin()
        identity, people = signin.identity, signin.people
        last = 0
        for name in sorted(set(names)):
            person = people.by_name.get(name)
            if person is None or person.source != I.SCIM:
                continue
            groups = tuple(sorted(g.display_name for g in identity.scim_groups_of(name)))
            grants = grants_for(identity.mappings_of(I.SCIM), groups)
            if not roles_lag(person, groups, grants):
                continue
            command = P.SyncRoles(name=name, provider=I.SCIM, groups=groups, grants=grants)
            try:
                last = max(last, await self.send(P.SERVICE, "user.sync-roles", command))
            except R.ScimError as exc:  # the group changed; the roles' refusal is the log's to show, not the IdP's
                log.warning("a SCIM member's roles could not follow their groups", user=name, reason=exc.detail)
        await self.people_at(last)
