"""People folded from their events: the one place a person's state is computed.

The people service decides commands on it and the admin API signs people in with it; both fold
``llmgw.evt.user.>`` through this module, so what a token may do is computed once.
"""

from __future__ import annotations

from datetime import datetime

import msgspec

from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.schema import people as P
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of, event_subject


class Token(msgspec.Struct, kw_only=True):
    token_id: str
    prefix: str
    secret_sha256: str
    kind: str
    label: str = ""
    issued_at: datetime
    expires_at: datetime | None = None
    signing_key: str = ""  # the public key its commands are checked with; "" for a token made before signing
    method: str = ""  # how a session's holder signed in (password, oidc:NAME, ldap:NAME, device:NAME)


class Person(msgspec.Struct, kw_only=True):
    name: str
    display_name: str = ""
    password_hash: str = ""
    disabled: bool = False
    disabled_reason: str = ""
    added_at: datetime
    changed_at: datetime | None = None  # the time of their last event (SCIM's lastModified)
    tokens: dict[str, Token] = {}  # token id -> token (revoked ones are dropped)
    roles: list[tuple[str, str]] = []  # (role, scope on the log), each once, in the order granted
    language: str = ""  # the console's language they chose ("" : their browser's)
    source: str = ""  # "" : added here; ``idp:NAME`` / ``scim``: made by that provider (no password here)
    login: str = ""  # their user name at the provider ("" : the name)
    email: str = ""
    external_id: str = ""
    groups: dict[str, tuple[str, ...]] = {}  # provider -> the groups it last said they are in
    # "role scope" -> (provider, group, mapping id) of a binding a provider's group mapping granted
    granted_by: dict[str, tuple[str, str, str]] = {}

    def via(self, role: str, scope: str) -> tuple[str, str, str] | None:
        """Which provider, group and mapping granted ``role`` over ``scope``; None: granted by hand."""
        return self.granted_by.get(f"{role} {scope}")


class People(msgspec.Struct, kw_only=True):
    by_name: dict[str, Person] = {}
    by_prefix: dict[str, tuple[str, str]] = {}  # token prefix -> (person, token id)
    by_login: dict[str, str] = {}  # a provider's user name, lower case -> the person's name
    position: int = 0

    def apply(self, event: RecordedEvent) -> None:
        """Fold one event of ``llmgw.evt.user.>`` (others are ignored)."""
        self.position = max(self.position, event.seq)
        try:
            aggregate, name = aggregate_of(event.subject)
        except ValueError:
            return
        if aggregate != P.AGGREGATE:
            return
        p = event.payload
        person = self.by_name.get(name)
        if person is not None:
            person.changed_at = event.envelope.at
        if isinstance(p, P.UserAdded):
            self.by_name[name] = Person(
                name=name,
                display_name=p.display_name,
                added_at=event.envelope.at,
                source=p.source,
                login=p.login,
                email=p.email,
                external_id=p.external_id,
            )
            if p.source:
                self.by_login[(p.login or name).lower()] = name
        elif person is None:
            return  # an event of someone never added: nothing to attach it to
        elif isinstance(p, P.PasswordSet):
            person.password_hash = p.password_hash
        elif isinstance(p, P.UserDisabled):
            person.disabled, person.disabled_reason = True, p.reason
        elif isinstance(p, P.UserEnabled):
            person.disabled, person.disabled_reason = False, ""
        elif isinstance(p, P.RoleGranted):
            if (p.role, p.scope) not in person.roles:
                person.roles.append((p.role, p.scope))
                if p.provider:
                    person.granted_by[f"{p.role} {p.scope}"] = (p.provider, p.group, p.mapping)
        elif isinstance(p, P.RoleRevoked):
            person.roles = [b for b in person.roles if b != (p.role, p.scope)]
            person.granted_by.pop(f"{p.role} {p.scope}", None)
        elif isinstance(p, P.ProfileSet):
            if person.login and self.by_login.get(person.login.lower()) == name:
                del self.by_login[person.login.lower()]
            person.login, person.display_name = p.login, p.display_name
            person.email, person.external_id = p.email, p.external_id
            self.by_login[(p.login or name).lower()] = name
        elif isinstance(p, P.GroupsSeen):
            person.groups[p.provider] = p.groups
        elif isinstance(p, P.UserRemoved):
            del self.by_name[name]
            for token in person.tokens.values():
                self.by_prefix.pop(token.prefix, None)
            if self.by_login.get((person.login or name).lower()) == name:
                del self.by_login[(person.login or name).lower()]
        elif isinstance(p, P.LanguageSet):
            person.language = p.language
        elif isinstance(p, P.TokenIssued):
            person.tokens[p.token_id] = Token(
                token_id=p.token_id,
                prefix=p.prefix,
                secret_sha256=p.secret_sha256,
                kind=p.kind,
                label=p.label,
                issued_at=event.envelope.at,
                expires_at=p.expires_at,
                signing_key=p.signing_key,
                method=p.method,
            )
            self.by_prefix[p.prefix] = (name, p.token_id)
        elif isinstance(p, P.TokenRevoked):
            gone = person.tokens.pop(p.token_id, None)
            if gone is not None:
                self.by_prefix.pop(gone.prefix, None)

    def by_provider_login(self, login: str) -> Person | None:
        """The person a provider's user name stands for (case-insensitive), if any was made or linked."""
        name = self.by_login.get(login.strip().lower())
        return self.by_name.get(name) if name else None

    def find_token(self, person: Person, token: str) -> Token | None:
        """One of ``person``'s tokens by id or prefix."""
        return person.tokens.get(token) or next((t for t in person.tokens.values() if t.prefix == token), None)


class PeopleAndTree:
    """The people and the tenancy tree their roles are bound over, folded together: what the people
    service decides on and what a command verifier authorizes with."""

    def __init__(self, people: People | None = None, tree: TenancyTree | None = None) -> None:
        self.people = people if people is not None else People()
        self.tree = tree if tree is not None else TenancyTree()

    @staticmethod
    def subjects(name: str) -> dict[str, str]:
        """The subjects to follow, each with the name its follower shows (``name``, ``name-tenancy``)."""
        return {f"{EVENTS_ROOT}.{P.AGGREGATE}.>": name, event_subject(T.AGGREGATE, T.TREE_ID): f"{name}-tenancy"}

    def apply(self, event: RecordedEvent) -> None:
        if event.subject.startswith(f"{EVENTS_ROOT}.{P.AGGREGATE}."):
            self.people.apply(event)
        else:
            self.tree.apply(event)
