"""The sign-in page (SPEC ID-1 to ID-4): where people sign in from, which of their groups hold which roles,
and the SCIM tokens identity providers provision people with.

Cluster viewers see it; cluster admins get its forms: add or change an OpenID Connect provider, add an
LDAP directory or Active Directory, remove one; map a group to a role and unmap it; create a SCIM token
(shown once; only its hash is sent) and revoke one. Each is the command `llmgw ctl sso|ldap|scim` sends.
A provider's secret is never typed here: the forms take the name of the environment variable the server
reads it from. The login page's buttons and directory choice come from :func:`login_choices`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from llmgw.events.commands import roles as R
from llmgw.events.folds.identity import Identity, Provider
from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.schema import identity as I
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.services.api.act import Outcome
from llmgw.services.console.forms import BadInput
from llmgw.services.console.page import Ctx, Page
from llmgw.services.console.pages.tenants import choices

if TYPE_CHECKING:
    from llmgw.services.api.signin import SignIn

DEFAULT_SCOPES = "openid profile email"
TLS_CHOICES = ("ldaps", "start_tls", "plain")  # how an LDAP form reaches its directory


# -- what is shown ---------------------------------------------------------------------------------


def provider_row(p: Provider, identity: Identity, tree: TenancyTree) -> dict[str, Any]:
    """One provider as the page lists it (pure): never a secret, only the variable it is read from."""
    row: dict[str, Any] = {
        "name": p.name,
        "kind": p.kind,
        "shown": p.shown,
        "display_name": p.display_name,
        "where": p.oidc.issuer if p.oidc else p.ldap.url if p.ldap else "",
        "secret_env": p.oidc.client_secret_env if p.oidc else p.ldap.bind_password_env if p.ldap else "",
        "mappings": mapping_rows(identity, p.name, tree),
        "changed_at": p.changed_at,
    }
    if p.oidc is not None:
        row["details"] = {"client_id": p.oidc.client_id, "groups_claim": p.oidc.groups_claim}
    elif p.ldap is not None:
        how = p.ldap.user_dn or f"{p.ldap.user_base} {p.ldap.user_filter}"
        row["details"] = {"user": how, "active_directory": p.ldap.active_directory, "start_tls": p.ldap.start_tls}
    return row


def mapping_rows(identity: Identity, provider: str, tree: TenancyTree) -> list[dict[str, Any]]:
    return [
        {"id": m.mapping_id, "provider": m.provider, "group": m.group, "role": m.role, "scope": tree.label(m.scope)}
        for m in identity.mappings_of(provider)
    ]


def login_choices(signin: SignIn | None) -> dict[str, list[dict[str, str]]]:
    """What the login page offers (pure over the fold): a button per OIDC provider, a choice of directories."""
    providers = sorted(signin.identity.providers.values(), key=lambda p: p.name) if signin is not None else []
    return {
        "sso_providers": [{"name": p.name, "shown": p.shown} for p in providers if p.kind == "oidc"],
        "directories": [{"name": p.name, "shown": p.shown} for p in providers if p.kind == "ldap"],
    }


async def _identity(ctx: Ctx) -> Identity:
    """The providers now (the sign-in's live fold), or folded from the log up to the moment shown."""
    signin = ctx.api.signin
    if ctx.at is None and signin is not None:
        return signin.identity
    identity = Identity()
    if ctx.source.position <= 0:
        return identity
    for subject in Identity.subjects():
        async for batch in ctx.api.store.subscribe(subject, follow=False, until=ctx.source.position):
            for event in batch:
                if isinstance(event, RecordedEvent) and event.seq <= ctx.source.position:
                    identity.apply(event)
    return identity


async def gather(ctx: Ctx) -> dict[str, Any]:
    identity = await _identity(ctx)
    tree = await ctx.source.tree()
    providers = [provider_row(p, identity, tree) for p in sorted(identity.providers.values(), key=lambda p: p.name)]
    may_admin = ctx.at is None and ctx.can("cluster-admin")
    scopes: list[str] = []
    if may_admin:
        now_tree = await ctx.now.tree()
        scopes = ["cluster", *sorted(f"{s.kind}:{now_tree.path(s)}" for s in now_tree.scopes.values())]
    return {
        "providers": providers,
        "scim_mappings": mapping_rows(identity, I.SCIM, tree),
        "scim_tokens": sorted(identity.scim_tokens_by_prefix.values(), key=lambda t: t.issued_at),
        "may_admin": may_admin,
        "roles": R.ROLES,
        "map_providers": [p["name"] for p in providers] + [I.SCIM],
        "scope_choices": choices(scopes),
        "tls_options": [{"value": v, "label": ctx.t(f"identity.ldap.tls.{v}")} for v in TLS_CHOICES],
        "default_scopes": DEFAULT_SCOPES,
        "scim_base": f"{ctx.request.scheme}://{ctx.request.host}/scim/v2",
    }


# -- acting ------------------------------------------------------------------------------------------


def _text(form: Mapping[str, str], name: str) -> str:
    return (form.get(name) or "").strip()


def _required(form: Mapping[str, str], name: str, what: str) -> str:
    value = _text(form, name)
    if not value:
        raise BadInput(f"{what} must not be empty")
    return value


def oidc_command(form: Mapping[str, str]) -> I.SetProvider:
    """The command an OIDC form makes (pure); :class:`BadInput` naming a field left empty."""
    scopes = tuple(dict.fromkeys((_text(form, "scopes") or DEFAULT_SCOPES).split()))
    settings = I.OidcSettings(
        issuer=_required(form, "issuer", "the issuer"),
        client_id=_required(form, "client_id", "the client id"),
        client_secret_env=_text(form, "client_secret_env"),
        groups_claim=_text(form, "groups_claim") or "groups",
        username_claim=_text(form, "username_claim") or "preferred_username",
        scopes=scopes,
        ca_file=_text(form, "ca_file"),
    )
    name = _required(form, "name", "the name")
    return I.SetProvider(name=name, kind="oidc", display_name=_text(form, "display_name"), oidc=settings)


def ldap_command(form: Mapping[str, str]) -> I.SetProvider:
    """The command an LDAP form makes (pure); :class:`BadInput` naming what is missing or contradictory."""
    tls = _text(form, "tls") or "ldaps"
    if tls not in TLS_CHOICES:
        raise BadInput(f"how to reach the directory: one of {', '.join(TLS_CHOICES)}")
    user_dn, user_base = _text(form, "user_dn"), _text(form, "user_base")
    if user_dn and user_base:
        raise BadInput("give a DN template (bind as the person) or a search base (search for them), not both")
    active_directory = form.get("active_directory") in ("on", "true", "1")
    more: dict[str, Any] = {}
    if _text(form, "user_filter"):
        more["user_filter"] = _text(form, "user_filter")
    elif active_directory:
        more["user_filter"] = "(sAMAccountName={user})"
    if active_directory:
        more["username_attr"] = "sAMAccountName"
    settings = I.LdapSettings(
        url=_required(form, "url", "the directory's URL"),
        start_tls=tls == "start_tls",
        allow_plain=tls == "plain",
        ca_file=_text(form, "ca_file"),
        user_dn=user_dn,
        user_base=user_base,
        bind_dn=_text(form, "bind_dn"),
        bind_password_env=_text(form, "bind_password_env"),
        group_base=_text(form, "group_base"),
        active_directory=active_directory,
        **more,
    )
    name = _required(form, "name", "the name")
    return I.SetProvider(name=name, kind="ldap", display_name=_text(form, "display_name"), ldap=settings)


async def set_oidc(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    return await ctx.act(I.SERVICE, "idp.set", oidc_command(form))


async def set_ldap(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    return await ctx.act(I.SERVICE, "idp.set", ldap_command(form))


async def remove_provider(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    return await ctx.act(I.SERVICE, "idp.remove", I.RemoveProvider(name=_required(form, "name", "the provider")))


async def map_group(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    role = _text(form, "role")
    if role not in R.ROLES:
        raise BadInput(f"the role: one of {', '.join(R.ROLES)}")
    mapping = I.MapGroup(
        provider=_required(form, "provider", "the provider"),
        group=_required(form, "group", "the group"),
        role=role,
        scope=_required(form, "scope", "the scope (cluster, org:…, team:…, project:…)"),
    )
    return await ctx.act(I.SERVICE, "idp.map", mapping)


async def unmap_group(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    unmap = I.UnmapGroup(
        provider=_required(form, "provider", "the provider"), mapping=_required(form, "mapping", "the mapping")
    )
    return await ctx.act(I.SERVICE, "idp.unmap", unmap)


async def create_scim_token(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    """A SCIM token made here, as `llmgw ctl scim token create` makes it: only its hash is sent; the token is
    handed back once in the outcome, with the base URL to give the identity provider."""
    secret, prefix, digest = I.make_scim_token()
    out = await ctx.act(
        I.SERVICE, "scim.token-issue", I.IssueScimToken(prefix=prefix, secret_sha256=digest, label=_text(form, "label"))
    )
    if out.applied and out.result.get("prefix") == prefix:  # not a first outcome answered again
        base = f"{ctx.request.scheme}://{ctx.request.host}/scim/v2"
        out.result = {**out.result, "secret": secret}
        out.message = ctx.t("identity.scim.token_made", message=out.message, base=base)
    return out


async def revoke_scim_token(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    return await ctx.act(I.SERVICE, "scim.token-revoke", I.RevokeScimToken(token=_required(form, "token", "the token")))


PAGES = [
    Page(
        path="/console/identity",
        name="identity",
        title="identity.nav",
        template="identity.html",
        gather=gather,
        actions={
            "oidc_set": set_oidc,
            "ldap_set": set_ldap,
            "provider_remove": remove_provider,
            "map": map_group,
            "unmap": unmap_group,
            "scim_token_create": create_scim_token,
            "scim_token_revoke": revoke_scim_token,
        },
        live=(I.AGGREGATE, I.SCIM_GROUP_AGGREGATE, "tenancy"),
    )
]
