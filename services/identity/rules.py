"""The identity service's decisions: pure functions over the folded providers and the tenancy tree."""

from __future__ import annotations

import re
from datetime import datetime
from ipaddress import ip_address
from urllib.parse import urlsplit

import msgspec

from llmgw.events.commands import roles as R
from llmgw.events.commands.shell import Decision
from llmgw.events.folds.identity import Identity, Provider
from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.schema import identity as I
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import EVENTS_ROOT, event_subject
from llmgw.services.people.rules import role_scope

_IDENTITY_PREFIXES = (f"{EVENTS_ROOT}.{I.AGGREGATE}.", f"{EVENTS_ROOT}.{I.SCIM_GROUP_AGGREGATE}.")
MAX_TEXT = 200
MAX_MEMBERS = 10_000
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_PREFIX = re.compile(r"^[a-z0-9]{8}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
LOOPBACK_HOSTS = ("localhost",)


class IdentityAndTree:
    """The providers and the tenancy tree a mapping's scope is resolved in, folded together."""

    def __init__(self, identity: Identity | None = None, tree: TenancyTree | None = None) -> None:
        self.identity = identity if identity is not None else Identity()
        self.tree = tree if tree is not None else TenancyTree()

    @staticmethod
    def subjects(name: str) -> dict[str, str]:
        """The subjects to follow, each with the name its follower shows."""
        providers, groups = Identity.subjects()
        return {providers: name, groups: f"{name}-scim-groups", **_tree_subject(name)}

    def apply(self, event: RecordedEvent) -> None:
        if event.subject.startswith(_IDENTITY_PREFIXES):
            self.identity.apply(event)
        else:
            self.tree.apply(event)


def _tree_subject(name: str) -> dict[str, str]:
    return {event_subject(T.AGGREGATE, T.TREE_ID): f"{name}-tenancy"}


def decide(state: IdentityAndTree, c: I.IdentityCommand, now: datetime) -> Decision:
    """Pure: an identity command over the providers → its :class:`Decision`, or a refusal."""
    identity, tree = state.identity, state.tree
    match c:
        case I.SetProvider():
            return _set_provider(identity, c)
        case I.RemoveProvider():
            provider = _provider(identity, c.name)
            mapped = len(identity.mappings_of(provider.name))
            return Decision(
                subject=event_subject(I.AGGREGATE, provider.name),
                payloads=[I.ProviderRemoved(name=provider.name)],
                message=f"identity provider {provider.name} removed with its {mapped} group mapping(s); "
                "the people it made stay, without a way to sign in through it",
                result={"provider": provider.name},
            )
        case I.MapGroup():
            return _map(identity, tree, c)
        case I.UnmapGroup():
            provider = c.provider.strip()
            found = identity.find_mapping(provider, c.mapping.strip())
            if found is None:
                known = ", ".join(f"{m.mapping_id} ({m.group})" for m in identity.mappings_of(provider)[:10]) or "none"
                raise Rejected(
                    f"{provider} has no group mapping {c.mapping.strip()[:40]!r} (its mappings: {known}); "
                    "see `llmgw ctl sso mappings`",
                    "not_found",
                )
            return Decision(
                subject=event_subject(I.AGGREGATE, provider),
                payloads=[I.GroupUnmapped(provider=provider, mapping_id=found.mapping_id)],
                message=f"{provider}'s group {found.group} no longer grants {found.role} of "
                f"{tree.label(found.scope)}: people lose it at their next sign-in",
                result={"mapping": found.mapping_id},
            )
        case I.IssueScimToken():
            if not _PREFIX.match(c.prefix) or not _SHA256.match(c.secret_sha256):
                raise Rejected("the SCIM token's prefix or hash is not in the format llmgw makes", "invalid_token")
            if c.prefix in identity.scim_tokens_by_prefix:
                raise Rejected(f"SCIM token prefix {c.prefix} is taken; make a new token", "taken")
            _check_text("label", c.label)
            token_id = new_id()
            return Decision(
                subject=event_subject(I.AGGREGATE, I.SCIM),
                payloads=[
                    I.ScimTokenIssued(token_id=token_id, prefix=c.prefix, secret_sha256=c.secret_sha256, label=c.label)
                ],
                message=f"SCIM token {c.prefix} issued" + (f" ({c.label})" if c.label else ""),
                result={"token_id": token_id, "prefix": c.prefix},
            )
        case I.RevokeScimToken():
            wanted = c.token.strip()
            token = next((t for t in identity.scim_tokens_by_prefix.values() if wanted in (t.token_id, t.prefix)), None)
            if token is None:
                raise Rejected(f"there is no SCIM token {wanted[:40]!r}: see `llmgw ctl scim token list`", "not_found")
            return Decision(
                subject=event_subject(I.AGGREGATE, I.SCIM),
                payloads=[I.ScimTokenRevoked(token_id=token.token_id)],
                message=f"SCIM token {token.prefix} revoked: it provisions nothing from now on",
                result={"token_id": token.token_id},
            )
        case I.SetScimGroup():
            _check_text("group name", c.display_name, required=True)
            _check_text("external id", c.external_id)
            if len(c.members) > MAX_MEMBERS:
                raise Rejected(f"a SCIM group has at most {MAX_MEMBERS} members", "too_many")
            members = tuple(dict.fromkeys(c.members))
            taken = next(
                (
                    g
                    for g in identity.scim_groups.values()
                    if g.group_id != c.group_id and g.display_name.lower() == c.display_name.lower()
                ),
                None,
            )
            if taken is not None:
                raise Rejected(f"a SCIM group named {c.display_name!r} exists (id {taken.group_id})", "exists")
            old = identity.scim_groups.get(c.group_id)
            if old and (old.display_name, old.external_id, old.members) == (c.display_name, c.external_id, members):
                return Decision(message=f"SCIM group {c.display_name} is so already", result={"group": c.group_id})
            return Decision(
                subject=event_subject(I.SCIM_GROUP_AGGREGATE, c.group_id),
                payloads=[
                    I.ScimGroupSet(
                        group_id=c.group_id, display_name=c.display_name, external_id=c.external_id, members=members
                    )
                ],
                message=f"SCIM group {c.display_name} {'changed' if old else 'created'} ({len(members)} member(s))",
                result={"group": c.group_id},
            )
        case I.RemoveScimGroup():
            group = identity.scim_groups.get(c.group_id)
            if group is None:
                raise Rejected(f"there is no SCIM group {c.group_id[:40]!r}", "not_found")
            return Decision(
                subject=event_subject(I.SCIM_GROUP_AGGREGATE, c.group_id),
                payloads=[I.ScimGroupRemoved(group_id=c.group_id)],
                message=f"SCIM group {group.display_name} removed",
                result={"group": c.group_id},
            )
    raise Rejected(f"unknown identity command {type(c).__name__}", "unknown")  # pragma: no cover - a closed union


def _set_provider(identity: Identity, c: I.SetProvider) -> Decision:
    name = c.name.strip()
    if not I.NAME_RE.match(name) or name == I.SCIM:
        raise Rejected(
            f"{name[:40]!r} is not a provider name: lower-case letters, digits and '-', starting with a letter, "
            f"at most 32 (and not {I.SCIM!r}, which names the SCIM endpoint)",
            "invalid_name",
        )
    _check_text("display name", c.display_name)
    if c.kind == "oidc":
        if c.oidc is None or c.ldap is not None:
            raise Rejected("an oidc provider needs its OpenID settings (issuer, client id) and no LDAP ones", "invalid")
        _check_oidc(c.oidc)
    elif c.kind == "ldap":
        if c.ldap is None or c.oidc is not None:
            raise Rejected("an ldap provider needs its directory settings (url, how to find people) only", "invalid")
        _check_ldap(c.ldap)
    else:
        raise Rejected(f"a provider is one of {', '.join(I.KINDS)}, not {c.kind[:20]!r}", "invalid_kind")
    old = identity.providers.get(name)
    if old is not None and old.kind != c.kind:
        raise Rejected(
            f"{name} is an {old.kind} provider; remove it first (`llmgw ctl sso remove {name}`) to make it {c.kind}",
            "exists",
        )
    event = I.ProviderSet(name=name, kind=c.kind, display_name=c.display_name, oidc=c.oidc, ldap=c.ldap)
    if old is not None and (old.display_name, old.oidc, old.ldap) == (c.display_name, c.oidc, c.ldap):
        return Decision(message=f"identity provider {name} is so already", result={"provider": name})
    where = c.oidc.issuer if c.oidc else c.ldap.url if c.ldap else ""
    return Decision(
        subject=event_subject(I.AGGREGATE, name),
        payloads=[event],
        message=f"{c.kind} provider {name} ({where}) {'changed' if old else 'added'}"
        + ("" if identity.mappings_of(name) else f"; map its groups to roles: `llmgw ctl sso map {name} GROUP ...`"),
        result={"provider": name},
    )


def _check_oidc(s: I.OidcSettings) -> None:
    _check_issuer(s.issuer)
    if not s.client_id.strip() or len(s.client_id) > MAX_TEXT or not s.client_id.isprintable():
        raise Rejected("the client id must be 1 to 200 printable characters, as the provider gave it", "invalid")
    if s.client_secret_env and not _ENV.match(s.client_secret_env):
        raise Rejected(
            f"{s.client_secret_env[:40]!r} is not an environment variable's name: the secret itself is never "
            "sent; name the variable that holds it on the server",
            "invalid_secret_env",
        )
    for what, claim in (("groups claim", s.groups_claim), ("user name claim", s.username_claim)):
        _check_text(what, claim, required=True)
    if "openid" not in s.scopes:
        raise Rejected("the scopes must include openid", "invalid")
    _check_text("CA file", s.ca_file)


def _check_issuer(issuer: str) -> None:
    parts = urlsplit(issuer)
    if parts.scheme == "https" and parts.hostname:
        return
    if parts.scheme == "http" and parts.hostname and _loopback(parts.hostname):
        return
    raise Rejected(
        f"the issuer {issuer[:100]!r} must be an https:// URL (http:// only on a loopback address), exactly as "
        "the provider's discovery document names it",
        "invalid_issuer",
    )


def _loopback(host: str) -> bool:
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ip_address(host).is_loopback
    except ValueError:
        return False


def _check_ldap(s: I.LdapSettings) -> None:
    parts = urlsplit(s.url)
    if parts.scheme not in ("ldap", "ldaps") or not parts.hostname:
        raise Rejected(f"{s.url[:100]!r} is not an LDAP URL: write ldaps://host:636 or ldap://host:389", "invalid_url")
    if parts.scheme == "ldap" and not s.start_tls and not s.allow_plain:
        raise Rejected(
            f"{s.url} is plain text: passwords would cross the network readable; use ldaps://, StartTLS "
            "(--start-tls), or --insecure-plain-ldap if you mean it",
            "insecure",
        )
    if parts.scheme == "ldaps" and s.start_tls:
        raise Rejected("StartTLS is for ldap:// URLs; an ldaps:// URL is TLS already", "invalid")
    if not s.user_dn and not s.user_base:
        raise Rejected(
            "say how to find a person: a DN template (--user-dn 'uid={user},ou=people,dc=example,dc=org') or "
            "a search base (--user-base ou=people,dc=example,dc=org)",
            "invalid",
        )
    if s.user_dn and "{user}" not in s.user_dn:
        raise Rejected("the DN template must contain {user}", "invalid")
    if not s.user_dn and "{user}" not in s.user_filter:
        raise Rejected("the user filter must contain {user}", "invalid")
    if s.bind_password_env and not _ENV.match(s.bind_password_env):
        raise Rejected(
            f"{s.bind_password_env[:40]!r} is not an environment variable's name: name the variable holding the "
            "bind password on the server",
            "invalid_secret_env",
        )
    if not 0 < s.timeout_s <= 120:
        raise Rejected("the timeout must be between 0 and 120 seconds", "invalid")
    for what, value in msgspec.structs.asdict(s).items():
        if isinstance(value, str):
            _check_text(what.replace("_", " "), value, most=1000)


def _map(identity: Identity, tree: TenancyTree, c: I.MapGroup) -> Decision:
    provider = c.provider.strip()
    if provider != I.SCIM:
        provider = _provider(identity, provider).name
    _check_text("group", c.group, required=True, most=1000)
    scope, label = role_scope(c.role, c.scope, tree)
    group = c.group.strip()
    for m in identity.mappings_of(provider):
        if m.group.lower() == group.lower() and (m.role, m.scope) == (c.role, scope):
            return Decision(
                message=f"{provider}'s group {group} grants {R.needs(c.role, label)} already",
                result={"mapping": m.mapping_id},
            )
    mapping_id = new_id()
    return Decision(
        subject=event_subject(I.AGGREGATE, provider),
        payloads=[I.GroupMapped(provider=provider, mapping_id=mapping_id, group=group, role=c.role, scope=scope)],
        message=f"{provider}'s group {group} grants {R.needs(c.role, label)} from each member's next sign-in",
        result={"mapping": mapping_id},
    )


def _provider(identity: Identity, name: str) -> Provider:
    provider = identity.providers.get(name.strip())
    if provider is None:
        known = ", ".join(sorted(identity.providers)) or "none yet"
        raise Rejected(
            f"there is no identity provider {name.strip()[:40]!r} (providers: {known}): add one with "
            "`llmgw ctl sso add` or `llmgw ctl ldap add`",
            "not_found",
        )
    return provider


def _check_text(what: str, value: str, *, required: bool = False, most: int = MAX_TEXT) -> None:
    if required and not value.strip():
        raise Rejected(f"the {what} must not be empty", f"invalid_{what.replace(' ', '_')}")
    if len(value) > most or (value and not value.isprintable()):
        raise Rejected(f"the {what} must be at most {most} printable characters", f"invalid_{what.replace(' ', '_')}")


_VERBS = {
    I.SetProvider: "setting identity provider",
    I.RemoveProvider: "removing identity provider",
    I.MapGroup: "mapping a group of",
    I.UnmapGroup: "removing a group mapping of",
    I.IssueScimToken: "issuing a SCIM token",
    I.RevokeScimToken: "revoking a SCIM token",
    I.SetScimGroup: "changing SCIM group",
    I.RemoveScimGroup: "removing SCIM group",
}


def need(c: I.IdentityCommand) -> R.Need:
    """Every identity command is the cluster admins' (services, such as the SCIM endpoint, act within their rules)."""
    target = getattr(c, "name", "") or getattr(c, "provider", "") or getattr(c, "display_name", "")
    return R.cluster_admin(f"{_VERBS[type(c)]} {target}".strip())
