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

from llmgw.events.commands import roles as R
from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.errors import CommandError
from llmgw.events.folds.people import People
from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.runtime.follower import Follower, FollowerRegistry
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import people as P
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.subjects import EVENTS_ROOT, event_subject
from llmgw.services.people.passwords import PasswordChecker
from llmgw.services.people.throttle import LoginThrottle

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

    async def _notify(self) -> None:
        async with self._folded:
            self._folded.notify_all()

    def start(self) -> None:
        self.fold.start()
        self.tree_fold.start()

    async def close(self) -> None:
        await self.fold.close()
        await self.tree_fold.close()

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

    async def login(self, name: str, password: str, address: str) -> tuple[str, datetime]:
        """A new session token for ``name`` and when it expires; raises :class:`Refused`."""
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
            raise Refused(401, "invalid_login", "the user name or the password is wrong")
        if person.disabled:
            raise Refused(403, "user_disabled", f"user {person.name} is disabled" + _why(person.disabled_reason))
        self.throttle.succeeded(address)
        expires = self.now() + timedelta(hours=self.session_hours)
        token, issue = P.issue(person.name, "session", label=f"login from {address}", expires_at=expires)
        prefix = issue.prefix
        try:
            await self.client.send(P.SERVICE, "token.issue", issue, actor=f"user:{person.name}")
        except CommandError as exc:
            raise Refused(503, "unavailable", f"the session could not be recorded: {exc}; try again") from exc
        # Usable on return: the fold reads the token within milliseconds of its recording.
        await self.folded(lambda: prefix in self.people.by_prefix)
        return token, expires

    async def folded(self, condition: Callable[[], bool], deadline_s: float = VISIBLE_WAIT_S) -> bool:
        """Wait (bounded) until the people as folded meet ``condition`` — a change the caller just made,
        read back before it answers — woken by each batch the fold applies; whether they do."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(deadline_s), self._folded:
                await self._folded.wait_for(condition)
        return condition()
