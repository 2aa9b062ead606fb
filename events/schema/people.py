"""People (SPEC TEN-1, TEN-3): who may sign in, with what password, and the tokens they sign in with.

One aggregate per person (``llmgw.evt.user.<name>``). A password never travels nor is stored: the
CLI hashes it (argon2id) and sends the hash; the admin API checks a login against it. A token is
made where it is handed out (the admin API at a login, the CLI for a personal access token) and
only its lookup prefix and SHA-256 are written, as for API keys: the log holds nothing a reader
could sign in with.

Tokens look like ``llmgw-pat-<8 chars>-<43 chars>`` (personal, for automation) or
``llmgw-ses-<8>-<43>`` (a login's session); API keys (``llmgw-<8>-<43>``) are another thing, for
the gateway only.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import string
from datetime import datetime

import msgspec

from llmgw.events.commands import signing
from llmgw.events.schema.registry import EventType

AGGREGATE = "user"
SERVICE = "people"
NAME_RE = re.compile(r"^[a-z][a-z0-9._@-]{0,62}$")
LOCAL = ""  # the source of a person added here, with a password
TOKEN_KINDS = ("session", "personal")
_TOKEN_TAGS = {"session": "ses", "personal": "pat"}
# The languages the console speaks (services/console/i18n.py reads them here, so the rules that check a
# person's choice need not import the console); "" in a person's choice: follow the browser's.
LANGUAGES = ("en", "de")


class UserAdded(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    display_name: str = ""
    source: str = LOCAL  # "": added here, with a password; ``idp:NAME`` / ``scim``: made by that provider
    login: str = ""  # the user name at the provider, exactly as it says it ("" : the name)
    email: str = ""
    external_id: str = ""  # the provider's own id for them (SCIM externalId)


class ProfileSet(msgspec.Struct, frozen=True, kw_only=True):
    """What a provider now says of a person it made (SCIM replace or patch, a sign-in's claims)."""

    name: str
    login: str
    display_name: str = ""
    email: str = ""
    external_id: str = ""


class UserRemoved(msgspec.Struct, frozen=True, kw_only=True):
    """A person deleted by their provider (SCIM DELETE): gone with their tokens; the log keeps their past."""

    name: str


class GroupsSeen(msgspec.Struct, frozen=True, kw_only=True):
    """The groups a provider said a person is in, at a sign-in or a SCIM change."""

    name: str
    provider: str
    groups: tuple[str, ...] = ()


class PasswordSet(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    password_hash: str  # argon2id, in its PHC string form ($argon2id$v=19$m=…,t=…,p=…$salt$hash)


class UserDisabled(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    reason: str = ""


class UserEnabled(msgspec.Struct, frozen=True, kw_only=True):
    name: str


class RoleGranted(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    role: str  # one of ROLES
    scope: str  # ``cluster``, or ``org:<id>`` / ``team:<id>`` / ``project:<id>`` (ids: renames keep it)
    provider: str = ""  # "" : granted by hand; else the provider whose group mapping granted it…
    group: str = ""  # …the group…
    mapping: str = ""  # …and the mapping's id (events/schema/identity.py)


class RoleRevoked(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    role: str
    scope: str
    provider: str = ""  # the provider whose groups no longer grant it ("" : revoked by hand)


class TokenIssued(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # whose
    token_id: str
    prefix: str  # the lookup prefix (llmgw-pat-<prefix>-…)
    secret_sha256: str
    kind: str  # session | personal
    label: str = ""
    expires_at: datetime | None = None
    signing_key: str = ""  # the Ed25519 public key the token's commands are checked with (events/commands/signing.py)
    method: str = ""  # how its holder signed in: password, oidc:NAME, ldap:NAME, device:NAME ("" : not a sign-in)


class TokenRevoked(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    token_id: str
    reason: str = ""


class LanguageSet(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    language: str  # one of LANGUAGES, or "" (the browser's Accept-Language decides)


EVENTS = (
    EventType("user.added", 1, UserAdded, "A person who may sign in (TEN-1)."),
    EventType("user.password_set", 1, PasswordSet, "A person's password, as an argon2id hash (never the password)."),
    EventType("user.disabled", 1, UserDisabled, "A person may no longer sign in; their tokens stop working at once."),
    EventType("user.enabled", 1, UserEnabled, "A disabled person may sign in again."),
    EventType("user.role_granted", 1, RoleGranted, "A person holds a role over a scope (the cluster or a tenant)."),
    EventType("user.role_revoked", 1, RoleRevoked, "A person no longer holds a role over a scope."),
    EventType(
        "user.token_issued", 1, TokenIssued, "A login's session token or a personal access token; only its hash."
    ),
    EventType("user.token_revoked", 1, TokenRevoked, "A token no longer signs anyone in."),
    EventType(
        "user.language_set", 1, LanguageSet, "The language a person reads the console in (empty: the browser's)."
    ),
    EventType("user.profile_set", 1, ProfileSet, "What a provider says of a person it made: login, name, email."),
    EventType("user.removed", 1, UserRemoved, "A person deleted by their provider; their tokens go with them."),
    EventType("user.groups_seen", 1, GroupsSeen, "The groups a provider said a person is in (sign-in or SCIM)."),
)


class AddUser(msgspec.Struct, frozen=True, kw_only=True, tag="user-add", forbid_unknown_fields=True):
    name: str
    password_hash: str
    display_name: str = ""


class SetPassword(msgspec.Struct, frozen=True, kw_only=True, tag="user-passwd", forbid_unknown_fields=True):
    name: str
    password_hash: str


class DisableUser(msgspec.Struct, frozen=True, kw_only=True, tag="user-disable", forbid_unknown_fields=True):
    name: str
    reason: str = ""


class EnableUser(msgspec.Struct, frozen=True, kw_only=True, tag="user-enable", forbid_unknown_fields=True):
    name: str


class IssueToken(msgspec.Struct, frozen=True, kw_only=True, tag="token-issue", forbid_unknown_fields=True):
    name: str
    prefix: str
    secret_sha256: str
    kind: str = "personal"
    label: str = ""
    expires_at: datetime | None = None
    signing_key: str = ""  # events/signing.token_public_key of the token
    method: str = ""  # how the person signed in, for a session (password, oidc:NAME, ldap:NAME, device:NAME)


class RevokeToken(msgspec.Struct, frozen=True, kw_only=True, tag="token-revoke", forbid_unknown_fields=True):
    name: str
    token: str  # its id or its prefix
    reason: str = ""


class GrantRole(msgspec.Struct, frozen=True, kw_only=True, tag="role-grant", forbid_unknown_fields=True):
    name: str
    role: str
    scope: str  # ``cluster``, ``org:acme``, ``team:acme/ml``, ``project:acme/ml/chat`` (paths or ids)


class RevokeRole(msgspec.Struct, frozen=True, kw_only=True, tag="role-revoke", forbid_unknown_fields=True):
    name: str
    role: str
    scope: str


class SetLanguage(msgspec.Struct, frozen=True, kw_only=True, tag="user-language", forbid_unknown_fields=True):
    name: str
    language: str  # one of LANGUAGES, or "" to follow the browser's


class ProvisionUser(msgspec.Struct, frozen=True, kw_only=True, tag="user-provision", forbid_unknown_fields=True):
    """A person as a provider says they are: made when new (no password), their profile kept up to date,
    disabled or enabled with ``active``. ``name`` empty: the one made from ``login`` (person_name)."""

    source: str  # idp:NAME or scim
    login: str
    name: str = ""
    display_name: str = ""
    email: str = ""
    external_id: str = ""
    active: bool = True


class RemoveUser(msgspec.Struct, frozen=True, kw_only=True, tag="user-remove", forbid_unknown_fields=True):
    name: str


class MappedGrant(msgspec.Struct, frozen=True, kw_only=True):
    role: str
    scope: str  # as the log keeps it
    group: str
    mapping: str


class SyncRoles(msgspec.Struct, frozen=True, kw_only=True, tag="user-sync-roles", forbid_unknown_fields=True):
    """A person's roles made to follow their groups at a provider: the grants their groups map to are
    held, and what that provider's mappings granted before and no longer do is revoked. Roles granted
    by hand are never touched."""

    name: str
    provider: str
    groups: tuple[str, ...] = ()
    grants: tuple[MappedGrant, ...] = ()


PeopleCommand = (
    AddUser
    | SetPassword
    | DisableUser
    | EnableUser
    | GrantRole
    | RevokeRole
    | IssueToken
    | RevokeToken
    | SetLanguage
    | ProvisionUser
    | RemoveUser
    | SyncRoles
)


def person_name(login: str) -> str:
    """The name here of a person a provider calls ``login``: lower case, other characters as '-', starting
    with a letter (pure; the people service makes it unique when two logins come to the same name)."""
    text = "".join(c if c in _NAME_CHARS else "-" for c in login.strip().lower())
    if not text or not text[0].isalpha() or not text[0].isascii():
        text = "u" + text
    return text[:63]


_NAME_CHARS = frozenset(string.ascii_lowercase + string.digits + "._@-")


# -- the token format, shared by whoever makes tokens and the admin API that checks them ----------


def make_token(kind: str) -> tuple[str, str, str]:
    """(token, lookup prefix, sha256 of the token) for a ``session`` or ``personal`` token."""
    alphabet = string.ascii_lowercase + string.digits
    prefix = "".join(secrets.choice(alphabet) for _ in range(8))
    token = f"llmgw-{_TOKEN_TAGS[kind]}-{prefix}-{secrets.token_urlsafe(32)}"
    return token, prefix, hash_token(token)


def issue(
    name: str,
    kind: str,
    *,
    label: str = "",
    expires_at: datetime | None = None,
    token: str | None = None,
    method: str = "",
) -> tuple[str, IssueToken]:
    """A new token of ``kind`` for ``name`` (or ``token``, made before) and the command that records it:
    its prefix, its hash and the public key its commands are checked with, never the token."""
    if token is None:
        token = make_token(kind)[0]
    prefix = token_prefix(token)
    if prefix is None:
        raise ValueError("not a token llmgw made")
    return token, IssueToken(
        name=name,
        prefix=prefix,
        secret_sha256=hash_token(token),
        kind=kind,
        label=label,
        expires_at=expires_at,
        signing_key=signing.token_public_key(token),
        method=method,
    )


def token_prefix(token: str) -> str | None:
    """The lookup prefix of a well-formed session or personal token, else None."""
    parts = token.split("-", 3)
    if len(parts) != 4 or parts[0] != "llmgw" or parts[1] not in _TOKEN_TAGS.values():
        return None
    if len(parts[2]) != 8 or len(parts[3]) < 20:
        return None
    return parts[2]


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()
