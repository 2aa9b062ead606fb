"""Signing people in: a password for a session token at ``POST /api/v1/login``, and a token for an
identity on every later call (SPEC TEN-1, TEN-3).

The people are folded live from the log (:mod:`llmgw.events.folds.people`) by the process's
supervised fold, so a disabled person or a revoked token stops working here as soon as the event
is read. A password is checked by :class:`~llmgw.services.people.passwords.PasswordChecker` (a
bounded number at a time) behind :class:`~llmgw.services.people.throttle.LoginThrottle` (per
address). A login that succeeds issues a session token through the people service, as the person
(actor ``user:NAME``), so the log says who signed in and when.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import msgspec
import structlog

from llmgw.events.commands import roles as R
from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.errors import CommandError, CommandRejectedError
from llmgw.events.folds.identity import Identity as Providers
from llmgw.events.folds.identity import Provider
from llmgw.events.folds.people import People, Person
from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.runtime.follower import Follower, FollowerRegistry
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import identity as I
from llmgw.events.schema import people as P
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.subjects import EVENTS_ROOT, event_subject
from llmgw.services.identity.mapping import grants_for, no_role_refusal
from llmgw.services.people.passwords import PasswordChecker
from llmgw.services.people.throttle import LoginThrottle

log = structlog.get_logger("llmgw.services.api.signin")

SESSION_HOURS = 12
VISIBLE_WAIT_S = 5.0  # the most a login waits for its own token to be folded (it is usable on return)


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """Who a request was authenticated as."""

    name: str
    token_id: str
    kind: str  # session | personal

    @property
    def actor(self) -> str:
        return f"user:{self.name}"


class Refused(Exception):
    """A sign-in that may not go on: an HTTP status, a code and a message a person can act on."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: int = 0) -> None:
        self.status, self.code, self.message, self.retry_after_s = status, code, message, retry_after_s
        super().__init__(message)


def identify(people: People, authorization: str, now: datetime) -> Identity | Refused:
    """The identity a ``Bearer`` token stands for, or why it stands for none (pure)."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return Refused(401, "missing_credential", "sign in first: `llmgw login`, or send Authorization: Bearer TOKEN")
    token = token.strip()
    prefix = P.token_prefix(token)
    found = people.by_prefix.get(prefix) if prefix else None
    person = people.by_name.get(found[0]) if found else None
    held = person.tokens.get(found[1]) if person and found else None
    if person is None or held is None or not hmac.compare_digest(held.secret_sha256, P.hash_token(token)):
        return Refused(401, "invalid_credential", "this token is unknown or was revoked: sign in again (`llmgw login`)")
    if held.expires_at is not None and held.expires_at <= now:
        return Refused(401, "expired_credential", f"this token expired at {held.expires_at.isoformat()}: sign in again")
    if person.disabled:
        return Refused(403, "user_disabled", f"user {person.name} is disabled" + _why(person.disabled_reason))
    return Identity(name=person.name, token_id=held.token_id, kind=held.kind)


def _why(reason: str) -> str:
    return f" ({reason})" if reason else ""


def _roles_besides(person: Person | None, provider: str) -> bool:
    """Whether ``person`` holds a role that ``provider``'s mappings did not grant (by hand, or by SCIM)."""
    if person is None:
        return False
    return any((person.via(role, scope) or ("",))[0] != provider for role, scope in person.roles)


def _profile_changed(person: Person, who: I.ExternalIdentity) -> bool:
    return (person.login, person.display_name, person.email) != (who.username, who.display_name, who.email)


def secret_from_env(variable: str, what: str) -> str:
    """A provider's secret, read from the environment variable the log names (never the log itself)."""
    import os

    if not variable:
        return ""
    value = os.environ.get(variable)
    if value is None:
        raise Refused(503, "misconfigured", f"{what} is read from ${variable}, which is not set on this server: set it")
    return value


class SignIn:
    """The admin API's sign-in: folds the people, checks logins and tokens."""

    def __init__(
        self,
        store: EventStore,
        *,
        folds: FollowerRegistry | None = None,
        checker: PasswordChecker | None = None,
        throttle: LoginThrottle | None = None,
        clock: Callable[[], float] = time.time,
        session_hours: float = SESSION_HOURS,
    ) -> None:
        self.store = store
        self.session_hours = session_hours  # how long a login's session token lasts
        self.people = People()
        self.checker = checker or PasswordChecker()
        self.throttle = throttle or LoginThrottle()
        self.clock = clock
        self.client = CommandClient.for_service(store, "api")  # signs for the person it signed in
        self.tree = TenancyTree()  # where a role's scope sits, and how to name it
        tree_subject = event_subject(T.AGGREGATE, T.TREE_ID)
        self.tree_fold = Follower(store, tree_subject, self.tree.apply, name="signin-tenancy", after=0, registry=folds)
        self._folded = asyncio.Condition()  # notified after each batch the fold applied
        self.fold = Follower(
            store,
            f"{EVENTS_ROOT}.{P.AGGREGATE}.>",
            self.people,
            name="signin",
            after=0,
            registry=folds,
            on_batch=self._notify,
        )
        # The identity providers, their group mappings, SCIM's tokens and groups (events/folds/identity.py).
        self.identity = Providers()
        providers, scim_groups = Providers.subjects()
        self.identity_folds = [
            Follower(store, subject, self.identity.apply, name=name, after=0, registry=folds, on_batch=self._notify)
            for subject, name in ((providers, "signin-idp"), (scim_groups, "signin-scim-groups"))
        ]

    async def _notify(self) -> None:
        async with self._folded:
            self._folded.notify_all()

    def start(self) -> None:
        self.fold.start()
        self.tree_fold.start()
        for fold in self.identity_folds:
            fold.start()

    async def close(self) -> None:
        await self.fold.close()
        await self.tree_fold.close()
        for fold in self.identity_folds:
            await fold.close()

    # -- roles -------------------------------------------------------------------------------

    def chain(self, kind: str, path: str) -> tuple[list[str], str]:
        """The scopes a tenant named ``kind:path`` (path or id) sits in, nearest first, and its name."""
        return self.tree.chain(kind, path)

    def label(self, scope: str) -> str:
        return self.tree.label(scope)

    def authorize(self, who: Identity, need: str, chain: list[str], scope_label: str, what: str) -> Refused | None:
        """None when ``who`` may act as ``need`` within ``chain``; else the 403 naming what is needed."""
        person = self.people.by_name.get(who.name)
        refusal = R.refusal(who.name, person.roles if person else [], need, chain, scope_label, what, self.tree.label)
        return None if refusal is None else Refused(403, "forbidden", refusal)

    def now(self) -> datetime:
        return datetime.fromtimestamp(self.clock(), UTC)

    def identify(self, authorization: str) -> Identity | Refused:
        return identify(self.people, authorization, self.now())

    async def login(self, name: str, password: str, address: str, provider: str = "") -> tuple[str, datetime, str]:
        """A new session token, when it expires, and the name of the person signed in (a directory's user
        name may differ from it: ``ALICE`` is alice); raises :class:`Refused`. With ``provider`` (an LDAP
        directory's name here) the directory checks the password, else this server does."""
        if provider:
            return await self.login_ldap(provider, name, password, address)
        verdict = self.throttle.begin(address, self.clock())
        if not verdict.allowed:
            raise Refused(429, "too_many_logins", verdict.reason, verdict.retry_after_s)
        try:
            person = self.people.by_name.get(name)
            ok = await self.checker.verify(person.password_hash if person else None, password)
        finally:
            self.throttle.end(address)
        if not ok or person is None:
            self.throttle.failed(address, self.clock())
            hint = " (people from an identity provider sign in through it)" if self.identity.providers else ""
            raise Refused(401, "invalid_login", f"the user name or the password is wrong{hint}")
        if person.disabled:
            raise Refused(403, "user_disabled", f"user {person.name} is disabled" + _why(person.disabled_reason))
        self.throttle.succeeded(address)
        expires = self.now() + timedelta(hours=self.session_hours)
        if self.identity.providers:  # a local password beside the company's sign-in: the break-glass way in
            log.warning("signed in with a local password (break-glass)", user=person.name, address=address)
        token, expires = await self._session(person.name, address, "password")
        return token, expires, person.name

    async def _session(self, name: str, address: str, method: str) -> tuple[str, datetime]:
        """Issue ``name`` a session token (a command signed for them, so the log says who signed in, when
        and how), usable on return."""
        expires = self.now() + timedelta(hours=self.session_hours)
        token, issue = P.issue(name, "session", label=f"login from {address}", expires_at=expires, method=method)
        prefix = issue.prefix
        person = self.people.by_name.get(name)
        if person is None:  # pragma: no cover - the callers made sure
            raise Refused(503, "unavailable", f"user {name} is not folded yet; try again")
        try:
            await self.client.send(P.SERVICE, "token.issue", issue, actor=f"user:{person.name}")
        except CommandError as exc:
            raise Refused(503, "unavailable", f"the session could not be recorded: {exc}; try again") from exc
        # Usable on return: the fold reads the token within milliseconds of its recording.
        await self.folded(lambda: prefix in self.people.by_prefix)
        return token, expires

    # -- the company's identity (services/identity/) --------------------------------------------

    def provider(self, name: str) -> Provider | None:
        return self.identity.providers.get(name)

    async def login_ldap(self, provider: str, user: str, password: str, address: str) -> tuple[str, datetime, str]:
        """Sign in by binding to an LDAP / Active Directory provider as the person: (token, expiry, name)."""
        from llmgw.services.identity.ldap import LdapDirectory, LdapError

        found = self.provider(provider)
        if found is None or found.ldap is None:
            ldaps = ", ".join(sorted(p.name for p in self.identity.providers.values() if p.kind == "ldap")) or "none"
            raise Refused(
                400 if found is None else 409,
                "unknown_provider",
                f"{provider[:40]!r} is not a directory people sign in to with a password here (directories: {ldaps})"
                + (f"; {found.name} signs in through the browser: `llmgw login --sso {found.name}`" if found else ""),
            )
        verdict = self.throttle.begin(address, self.clock())
        if not verdict.allowed:
            raise Refused(429, "too_many_logins", verdict.reason, verdict.retry_after_s)
        try:
            bind_password = secret_from_env(found.ldap.bind_password_env, f"{found.name}'s bind password")
            directory = LdapDirectory(found.name, found.ldap, bind_password=bind_password)
            who = await directory.authenticate(user, password)
        except LdapError as exc:
            if exc.code == "invalid_login":
                self.throttle.failed(address, self.clock())
                raise Refused(401, "invalid_login", exc.message) from exc
            raise Refused(503, exc.code, f"the directory {found.name} could not sign anyone in: {exc.message}") from exc
        finally:
            self.throttle.end(address)
        self.throttle.succeeded(address)
        return await self.sign_in_external(who, f"ldap:{found.name}", address)

    async def sign_in_external(self, who: I.ExternalIdentity, method: str, address: str) -> tuple[str, datetime, str]:
        """A person a provider vouched for: made here on first sight (no password), their roles made to
        follow their groups, then a session: (token, expiry, their name here). Raises :class:`Refused`."""
        provider = self.provider(who.provider)
        if provider is None:
            raise Refused(400, "unknown_provider", f"there is no identity provider {who.provider!r} any more")
        source = f"idp:{provider.name}"
        person = self._person_for(who, source)
        mappings = self.identity.mappings_of(provider.name)
        grants = grants_for(mappings, who.groups)
        if person is not None and person.disabled:
            raise Refused(403, "user_disabled", f"user {person.name} is disabled" + _why(person.disabled_reason))
        if not grants and not _roles_besides(person, provider.name):
            refusal = Refused(
                403, "no_mapped_group", no_role_refusal(who.username, provider.shown, who.groups, mappings)
            )
            if person is not None and person.roles:  # out of every mapped group: what the groups granted goes first
                await self._sync_roles(person.name, provider.name, who, (), source)
            raise refusal
        try:
            if person is None or (person.source == source and _profile_changed(person, who)):
                done = await self.client.send(
                    P.SERVICE,
                    "user.provision",
                    P.ProvisionUser(
                        source=source,
                        login=who.username,
                        name=person.name if person else "",
                        display_name=who.display_name,
                        email=who.email,
                    ),
                    actor=source,
                )
                name = str(done.result.get("user", "")) if done.result else ""
                name = name or (person.name if person else "")
                await self.folded(lambda: name in self.people.by_name)
            else:
                name = person.name
        except CommandRejectedError as exc:
            status = 409 if exc.code in ("local_account", "exists") else 403 if exc.code == "disabled" else 503
            raise Refused(status, exc.code, exc.reason) from exc
        except CommandError as exc:
            raise Refused(503, "unavailable", f"the sign-in could not be recorded: {exc}; try again") from exc
        await self._sync_roles(name, provider.name, who, grants, source)
        token, expires = await self._session(name, address, method)
        return token, expires, name

    async def _sync_roles(
        self, name: str, provider: str, who: I.ExternalIdentity, grants: tuple[P.MappedGrant, ...], source: str
    ) -> None:
        """Make ``name``'s roles from ``provider``'s mappings exactly ``grants`` (the log names the provider)."""
        try:
            await self.client.send(
                P.SERVICE,
                "user.sync-roles",
                P.SyncRoles(name=name, provider=provider, groups=tuple(who.groups), grants=grants),
                actor=source,
            )
        except CommandRejectedError as exc:
            raise Refused(503, exc.code, exc.reason) from exc
        except CommandError as exc:
            raise Refused(503, "unavailable", f"the sign-in could not be recorded: {exc}; try again") from exc

    def _person_for(self, who: I.ExternalIdentity, source: str) -> Person | None:
        """The person ``who`` is here: the one their provider (or SCIM) made with that user name; a person
        added here with a password, or made by another provider, is never taken over."""
        person = self.people.by_provider_login(who.username)
        if person is None:
            local = self.people.by_name.get(P.person_name(who.username))
            if local is not None and not local.source:
                raise Refused(
                    409,
                    "local_account",
                    f"{local.name} was added here with a password, so {source} may not sign them in: sign in with "
                    "the password, or ask an administrator to remove the local account",
                )
            return None
        if person.source not in (source, "scim"):
            raise Refused(
                409,
                "other_provider",
                f"{person.name} signs in through {person.source}, not {source}: use that provider",
            )
        return person

    async def folded(self, condition: Callable[[], bool], deadline_s: float = VISIBLE_WAIT_S) -> bool:
        """Wait (bounded) until the people as folded meet ``condition`` — a change the caller just made,
        read back before it answers — woken by each batch the fold applies; whether they do."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(deadline_s), self._folded:
                await self._folded.wait_for(condition)
        return condition()
