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
NAME_RE = re.compile(r"^[a-z][a-z0-9._-]{0,62}$")
TOKEN_KINDS = ("session", "personal")
_TOKEN_TAGS = {"session": "ses", "personal": "pat"}
# The languages the console speaks (services/console/i18n.py reads them here, so the rules that check a
# person's choice need not import the console); "" in a person's choice: follow the browser's.
LANGUAGES = ("en", "de")


class UserAdded(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    display_name: str = ""


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


class RoleRevoked(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    role: str
    scope: str


class TokenIssued(msgspec.Struct, frozen=True, kw_only=True):
    name: str  # whose
    token_id: str
    prefix: str  # the lookup prefix (llmgw-pat-<prefix>-…)
    secret_sha256: str
    kind: str  # session | personal
    label: str = ""
    expires_at: datetime | None = None
    signing_key: str = ""  # the Ed25519 public key the token's commands are checked with (events/commands/signing.py)


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


PeopleCommand = (
    AddUser | SetPassword | DisableUser | EnableUser | GrantRole | RevokeRole | IssueToken | RevokeToken | SetLanguage
)


# -- the token format, shared by whoever makes tokens and the admin API that checks them ----------


def make_token(kind: str) -> tuple[str, str, str]:
    """(token, lookup prefix, sha256 of the token) for a ``session`` or ``personal`` token."""
    alphabet = string.ascii_lowercase + string.digits
    prefix = "".join(secrets.choice(alphabet) for _ in range(8))
    token = f"llmgw-{_TOKEN_TAGS[kind]}-{prefix}-{secrets.token_urlsafe(32)}"
    return token, prefix, hash_token(token)


def issue(
    name: str, kind: str, *, label: str = "", expires_at: datetime | None = None, token: str | None = None
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
