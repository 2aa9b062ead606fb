"""Identity providers (SPEC ID-1 to ID-4): where people sign in from, and which of their groups hold which roles.

One aggregate per provider (``llmgw.evt.idp.<name>``): an OpenID Connect provider or an LDAP / Active
Directory directory, with the group mappings that grant roles to its people. The provider ``scim``
is the SCIM 2.0 endpoint: its aggregate holds the bearer tokens made for identity providers (their
hash only) and the mappings of SCIM groups; each SCIM group is its own aggregate
(``llmgw.evt.scimgroup.<id>``). A provider's secret (an OIDC client secret, an LDAP bind password)
never travels nor is kept: the log names the environment variable the server reads it from.

People themselves stay in ``user`` (events/schema/people.py): a person a provider made or changed is
a ``user.*`` event whose actor names the provider (``idp:corp``, ``svc:scim``).
"""

from __future__ import annotations

import re

import msgspec

from llmgw.events.schema.registry import EventType

AGGREGATE = "idp"
SCIM_GROUP_AGGREGATE = "scimgroup"
SERVICE = "identity"
SCIM = "scim"  # the provider name of the SCIM endpoint (its tokens and its groups' mappings)
KINDS = ("oidc", "ldap")
NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")


class OidcSettings(msgspec.Struct, frozen=True, kw_only=True):
    """An OpenID Connect provider, as `llmgw ctl sso add` sets it."""

    issuer: str  # https://… (http:// only on a loopback address)
    client_id: str
    client_secret_env: str = ""  # the environment variable holding the client secret ("" : a public client)
    groups_claim: str = "groups"  # the ID token's (or userinfo's) claim that lists the person's groups
    username_claim: str = "preferred_username"  # the claim a person's name here is made from
    scopes: tuple[str, ...] = ("openid", "profile", "email")
    ca_file: str = ""  # the CA that signed the provider's certificate ("" : the system's)


class LdapSettings(msgspec.Struct, frozen=True, kw_only=True):
    """An LDAP directory or Active Directory, as `llmgw ctl ldap add` sets it."""

    url: str  # ldaps://host:636, or ldap://host:389 with start_tls (or allow_plain)
    start_tls: bool = False  # upgrade ldap:// by StartTLS
    allow_plain: bool = False  # plain ldap:// without TLS: only when asked for by name (--insecure-plain-ldap)
    ca_file: str = ""  # the CA that signed the directory's certificate ("" : the system's)
    user_dn: str = ""  # a template binding as the person: "uid={user},ou=people,dc=example,dc=org" or "{user}@corp"
    user_base: str = ""  # else search here for the person…
    user_filter: str = "(uid={user})"  # …with this filter (Active Directory: "(sAMAccountName={user})")
    bind_dn: str = ""  # who searches for people when user_dn is empty ("" : anonymous)
    bind_password_env: str = ""  # the environment variable holding bind_dn's password
    group_base: str = ""  # where the groups are ("" : the person's memberOf only)
    group_filter: str = "(|(objectClass=groupOfNames)(objectClass=group)(objectClass=groupOfUniqueNames))"
    active_directory: bool = False  # nested groups by LDAP_MATCHING_RULE_IN_CHAIN; else walked level by level
    username_attr: str = "uid"  # Active Directory: sAMAccountName
    display_name_attr: str = "cn"
    email_attr: str = "mail"
    timeout_s: float = 10.0


class ExternalIdentity(msgspec.Struct, frozen=True, kw_only=True):
    """A person as a provider vouched for them at a sign-in (not an event: what the sign-in acts on)."""

    provider: str  # the provider's name here (``corp``)
    subject: str  # their stable id at the provider (OIDC ``sub``, the entry's DN)
    username: str  # their user name there (preferred_username, uid, sAMAccountName)
    email: str = ""
    display_name: str = ""
    groups: tuple[str, ...] = ()  # group names (OIDC) or DNs (LDAP)


# -- events ------------------------------------------------------------------------------------


class ProviderSet(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    kind: str  # oidc | ldap
    display_name: str = ""  # what the sign-in page's button says ("" : the name)
    oidc: OidcSettings | None = None
    ldap: LdapSettings | None = None


class ProviderRemoved(msgspec.Struct, frozen=True, kw_only=True):
    name: str


class GroupMapped(msgspec.Struct, frozen=True, kw_only=True):
    provider: str  # a provider's name, or ``scim``
    mapping_id: str
    group: str  # as the provider names it: an OIDC group, an LDAP group DN (or its cn), a SCIM group's displayName
    role: str
    scope: str  # as the log keeps it (``team:<id>``, ``cluster``)


class GroupUnmapped(msgspec.Struct, frozen=True, kw_only=True):
    provider: str
    mapping_id: str


class ScimTokenIssued(msgspec.Struct, frozen=True, kw_only=True):
    token_id: str
    prefix: str  # llmgw-scim-<prefix>-…
    secret_sha256: str
    label: str = ""


class ScimTokenRevoked(msgspec.Struct, frozen=True, kw_only=True):
    token_id: str


class ScimGroupSet(msgspec.Struct, frozen=True, kw_only=True):
    group_id: str
    display_name: str
    external_id: str = ""
    members: tuple[str, ...] = ()  # people's names


class ScimGroupRemoved(msgspec.Struct, frozen=True, kw_only=True):
    group_id: str


EVENTS = (
    EventType("idp.set", 1, ProviderSet, "An identity provider people sign in with, added or changed (no secret)."),
    EventType("idp.removed", 1, ProviderRemoved, "An identity provider no longer signs anyone in."),
    EventType("idp.group_mapped", 1, GroupMapped, "A provider's group grants a role over a scope at each sign-in."),
    EventType("idp.group_unmapped", 1, GroupUnmapped, "A group mapping no longer grants its role."),
    EventType("idp.scim_token_issued", 1, ScimTokenIssued, "A bearer token for SCIM provisioning; only its hash."),
    EventType("idp.scim_token_revoked", 1, ScimTokenRevoked, "A SCIM token no longer provisions anything."),
    EventType("scimgroup.set", 1, ScimGroupSet, "A group provisioned by SCIM, with its members."),
    EventType("scimgroup.removed", 1, ScimGroupRemoved, "A SCIM group deleted by the identity provider."),
)


# -- commands (the identity service; cluster admins, and the SCIM endpoint for its groups) -------------


class SetProvider(msgspec.Struct, frozen=True, kw_only=True, tag="idp-set", forbid_unknown_fields=True):
    name: str
    kind: str
    display_name: str = ""
    oidc: OidcSettings | None = None
    ldap: LdapSettings | None = None


class RemoveProvider(msgspec.Struct, frozen=True, kw_only=True, tag="idp-remove", forbid_unknown_fields=True):
    name: str


class MapGroup(msgspec.Struct, frozen=True, kw_only=True, tag="idp-map", forbid_unknown_fields=True):
    provider: str
    group: str
    role: str
    scope: str  # ``cluster``, ``org:acme``, ``team:acme/ml``… (paths or ids)


class UnmapGroup(msgspec.Struct, frozen=True, kw_only=True, tag="idp-unmap", forbid_unknown_fields=True):
    provider: str
    mapping: str  # its id


class IssueScimToken(msgspec.Struct, frozen=True, kw_only=True, tag="scim-token-issue", forbid_unknown_fields=True):
    prefix: str
    secret_sha256: str
    label: str = ""


class RevokeScimToken(msgspec.Struct, frozen=True, kw_only=True, tag="scim-token-revoke", forbid_unknown_fields=True):
    token: str  # its id or prefix


class SetScimGroup(msgspec.Struct, frozen=True, kw_only=True, tag="scim-group-set", forbid_unknown_fields=True):
    group_id: str
    display_name: str
    external_id: str = ""
    members: tuple[str, ...] = ()


class RemoveScimGroup(msgspec.Struct, frozen=True, kw_only=True, tag="scim-group-remove", forbid_unknown_fields=True):
    group_id: str


IdentityCommand = (
    SetProvider
    | RemoveProvider
    | MapGroup
    | UnmapGroup
    | IssueScimToken
    | RevokeScimToken
    | SetScimGroup
    | RemoveScimGroup
)

SCIM_TOKEN_TAG = "scim"


def make_scim_token() -> tuple[str, str, str]:
    """(token, lookup prefix, sha256) of a new SCIM bearer token, ``llmgw-scim-<8>-<43>``."""
    import hashlib
    import secrets
    import string

    alphabet = string.ascii_lowercase + string.digits
    prefix = "".join(secrets.choice(alphabet) for _ in range(8))
    token = f"llmgw-{SCIM_TOKEN_TAG}-{prefix}-{secrets.token_urlsafe(32)}"
    return token, prefix, hashlib.sha256(token.encode()).hexdigest()


def scim_token_prefix(token: str) -> str | None:
    parts = token.split("-", 3)
    if len(parts) != 4 or parts[0] != "llmgw" or parts[1] != SCIM_TOKEN_TAG or len(parts[2]) != 8 or len(parts[3]) < 20:
        return None
    return parts[2]
