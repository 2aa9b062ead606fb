"""`llmgw ctl sso …`, `llmgw ctl ldap …` and `llmgw ctl scim …`: where people sign in from (SPEC ID-1 to ID-4).

Each change is one signed command to the identity service, as the other `ctl` groups send theirs; the
lists come from the admin API. A provider's secret never leaves the server it is kept on: these commands
name the environment variable the server reads it from. A SCIM token is made here and shown once;
only its hash is sent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import click

from llmgw.cli.client import Session, run
from llmgw.cli.ctl import ctl
from llmgw.cli.table import table
from llmgw.events.commands import roles as R
from llmgw.events.schema import identity as I

DEFAULT_SCOPES = ("openid", "profile", "email")
AD_USER_FILTER = "(sAMAccountName={user})"


def _send(ctx: click.Context, verb: str, payload: I.IdentityCommand) -> None:
    """Send one identity command and print what the service answered."""

    async def go(s: Session) -> None:
        out = await s.command(I.SERVICE, verb, payload)
        click.echo(out.message)
        if out.result.get("mapping") and verb == "idp.map":
            click.echo(f"mapping id: {out.result['mapping']}")

    run(ctx, go)


def _listing(
    ctx: click.Context,
    path: str,
    *,
    as_json: bool,
    empty: str,
    headers: list[str],
    row: Callable[[dict[str, Any]], list[Any]],
    params: dict[str, str] | None = None,
    right: tuple[int, ...] = (),
) -> None:
    """Print what the admin API lists at ``path``: as JSON, as a table, or ``empty`` when there is nothing."""

    async def go(s: Session) -> None:
        found = await s.api("GET", path, params=params)
        if as_json:
            click.echo(json.dumps(found, indent=2))
        elif not found:
            click.echo(empty)
        else:
            for line in table(headers, [row(item) for item in found], right=right):
                click.echo(line)

    run(ctx, go)


# -- OpenID Connect --------------------------------------------------------------------------------


@ctl.group()
def sso() -> None:
    """Identity providers people sign in with (OpenID Connect; LDAP with `ctl ldap`), and their groups' roles."""


@sso.command("add")
@click.argument("name")
@click.option("--issuer", required=True, help="The issuer URL, exactly as its discovery document names it (https://).")
@click.option("--client-id", required=True, help="The client id the provider gave this server.")
@click.option(
    "--client-secret-env",
    default="",
    metavar="VAR",
    help="The environment variable holding the client secret on the server (never the secret itself).",
)
@click.option("--groups-claim", default="groups", show_default=True, help="The claim listing the person's groups.")
@click.option(
    "--username-claim",
    default="preferred_username",
    show_default=True,
    help="The claim a person's user name here is made from.",
)
@click.option(
    "--scope",
    "scopes",
    multiple=True,
    metavar="S",
    help="A scope to ask for; repeat it (default: openid profile email).",
)
@click.option("--display-name", default="", help="What the sign-in button says (default: the name).")
@click.option("--ca-file", default="", metavar="F", help="The CA that signed the provider's certificate.")
@click.pass_context
def sso_add(
    ctx: click.Context,
    name: str,
    issuer: str,
    client_id: str,
    client_secret_env: str,
    groups_claim: str,
    username_claim: str,
    scopes: tuple[str, ...],
    display_name: str,
    ca_file: str,
) -> None:
    """Add an OpenID Connect provider, or change one (the settings given replace its settings)."""
    settings = I.OidcSettings(
        issuer=issuer,
        client_id=client_id,
        client_secret_env=client_secret_env,
        groups_claim=groups_claim,
        username_claim=username_claim,
        scopes=tuple(dict.fromkeys(scopes)) if scopes else DEFAULT_SCOPES,
        ca_file=ca_file,
    )
    _send(ctx, "idp.set", I.SetProvider(name=name, kind="oidc", display_name=display_name, oidc=settings))


@sso.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the providers as JSON.")
@click.pass_context
def sso_list(ctx: click.Context, as_json: bool) -> None:
    """Every provider (OIDC and LDAP): where it is, the variable its secret is read from, its mappings."""
    _listing(
        ctx,
        "/api/v1/identity/providers",
        as_json=as_json,
        empty="no identity providers yet: `llmgw ctl sso add NAME --issuer URL --client-id ID`",
        headers=["NAME", "KIND", "BUTTON", "ISSUER / URL", "SECRET FROM", "MAPPINGS"],
        row=lambda p: [
            p["name"],
            p["kind"],
            p["shown"],
            p["where"],
            p["secret_env"] and f"${p['secret_env']}",
            p["mappings"],
        ],
        right=(5,),
    )


@sso.command("remove")
@click.argument("name")
@click.pass_context
def sso_remove(ctx: click.Context, name: str) -> None:
    """Remove a provider (OIDC or LDAP) and its mappings; the people it made stay."""

    _send(ctx, "idp.remove", I.RemoveProvider(name=name))


def _map_options(fn: click.decorators.FC) -> click.decorators.FC:
    fn = click.option(
        "--scope", required=True, help="Over what: cluster, org:ACME, team:ACME/ML or project:ACME/ML/CHAT."
    )(fn)
    return click.option("--role", required=True, type=click.Choice(R.ROLES), help="The role the group grants.")(fn)


@sso.command("map")
@click.argument("provider")
@click.argument("group")
@_map_options
@click.pass_context
def sso_map(ctx: click.Context, provider: str, group: str, role: str, scope: str) -> None:
    """Grant a role to a provider's group (an OIDC group, an LDAP group's DN or its cn) at each sign-in."""

    _send(ctx, "idp.map", I.MapGroup(provider=provider, group=group, role=role, scope=scope))


@sso.command("unmap")
@click.argument("provider")
@click.argument("mapping_id")
@click.pass_context
def sso_unmap(ctx: click.Context, provider: str, mapping_id: str) -> None:
    """Remove a group mapping (its id is in `llmgw ctl sso mappings`): people lose its role at their next sign-in."""

    _send(ctx, "idp.unmap", I.UnmapGroup(provider=provider, mapping=mapping_id))


@sso.command("mappings")
@click.argument("provider", required=False, default="")
@click.option("--json", "as_json", is_flag=True, help="Print the mappings as JSON.")
@click.pass_context
def sso_mappings(ctx: click.Context, provider: str, as_json: bool) -> None:
    """Groups mapped to roles: every provider's, or one's (`scim` for SCIM groups)."""
    _listing(
        ctx,
        "/api/v1/identity/mappings",
        as_json=as_json,
        empty=f"no group mappings yet: `llmgw ctl sso map {provider or 'PROVIDER'} GROUP --role R --scope S`",
        headers=["PROVIDER", "ID", "GROUP", "ROLE", "SCOPE"],
        row=lambda m: [m["provider"], m["id"], m["group"], m["role"], m["scope_label"]],
        params={"provider": provider} if provider else None,
    )


# -- LDAP / Active Directory -----------------------------------------------------------------------


@ctl.group()
def ldap() -> None:
    """LDAP directories and Active Directory people sign in to with their directory password."""


@ldap.command("add")
@click.argument("name")
@click.option("--url", required=True, help="ldaps://host:636, or ldap://host:389 with --start-tls.")
@click.option("--start-tls", is_flag=True, help="Upgrade an ldap:// URL to TLS by StartTLS.")
@click.option(
    "--insecure-plain-ldap",
    is_flag=True,
    help="Allow plain ldap:// without TLS: passwords cross the network readable. Only on a network you trust.",
)
@click.option("--ca-file", default="", metavar="F", help="The CA that signed the directory's certificate.")
@click.option(
    "--user-dn",
    default="",
    metavar="TEMPLATE",
    help="Bind as the person by this DN: 'uid={user},ou=people,dc=example,dc=org' or '{user}@corp.example'.",
)
@click.option("--user-base", default="", metavar="DN", help="Else search for the person under this DN…")
@click.option(
    "--user-filter",
    default=None,
    metavar="F",
    help="…with this filter (default '(uid={user})'; with --active-directory '(sAMAccountName={user})').",
)
@click.option("--bind-dn", default="", metavar="DN", help="Who searches for people (default: anonymous).")
@click.option(
    "--bind-password-env",
    default="",
    metavar="VAR",
    help="The environment variable holding --bind-dn's password on the server (never the password itself).",
)
@click.option("--group-base", default="", metavar="DN", help="Where the groups are (default: the person's memberOf).")
@click.option(
    "--active-directory", is_flag=True, help="Active Directory: sAMAccountName, and nested groups in one search."
)
@click.option("--display-name", default="", help="What the sign-in form calls it (default: the name).")
@click.pass_context
def ldap_add(
    ctx: click.Context,
    name: str,
    url: str,
    start_tls: bool,
    insecure_plain_ldap: bool,
    ca_file: str,
    user_dn: str,
    user_base: str,
    user_filter: str | None,
    bind_dn: str,
    bind_password_env: str,
    group_base: str,
    active_directory: bool,
    display_name: str,
) -> None:
    """Add an LDAP directory or Active Directory, or change one; people sign in with `llmgw login --provider NAME`."""
    if user_dn and user_base:
        raise click.UsageError("give --user-dn (bind as the person) or --user-base (search for them), not both")
    more: dict[str, object] = {}
    if user_filter is not None:
        more["user_filter"] = user_filter
    elif active_directory:
        more["user_filter"] = AD_USER_FILTER
    if active_directory:
        more["username_attr"] = "sAMAccountName"
    settings = I.LdapSettings(
        url=url,
        start_tls=start_tls,
        allow_plain=insecure_plain_ldap,
        ca_file=ca_file,
        user_dn=user_dn,
        user_base=user_base,
        bind_dn=bind_dn,
        bind_password_env=bind_password_env,
        group_base=group_base,
        active_directory=active_directory,
        **more,
    )
    _send(ctx, "idp.set", I.SetProvider(name=name, kind="ldap", display_name=display_name, ldap=settings))


# -- SCIM --------------------------------------------------------------------------------------------


@ctl.group()
def scim() -> None:
    """SCIM 2.0 provisioning at /scim/v2: the identity provider's tokens, and its groups' roles."""


@scim.group("token")
def scim_token() -> None:
    """Bearer tokens the identity provider provisions people with."""


@scim_token.command("create")
@click.option("--label", default="", help="Who it is for (okta, entra…), shown in lists.")
@click.pass_context
def scim_token_create(ctx: click.Context, label: str) -> None:
    """Make a SCIM token: shown once, only its hash is kept."""
    secret, prefix, digest = I.make_scim_token()
    issue = I.IssueScimToken(prefix=prefix, secret_sha256=digest, label=label)

    async def go(s: Session) -> None:
        out = await s.command(I.SERVICE, "scim.token-issue", issue)
        base = f"{s.target.api_url.rstrip('/')}/scim/v2" if s.target.api_url else "https://ADMIN-API/scim/v2"
        click.echo(
            f"{out.message}; it is shown only this once. Give the identity provider the SCIM base URL {base} "
            "and this token as its bearer token (HTTP header Authorization: Bearer TOKEN):",
            err=True,
        )
        click.echo(secret)

    run(ctx, go)


@scim_token.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the tokens as JSON.")
@click.pass_context
def scim_token_list(ctx: click.Context, as_json: bool) -> None:
    """The SCIM tokens that work, by prefix (the rest of a token is never kept)."""
    _listing(
        ctx,
        "/api/v1/scim-tokens",
        as_json=as_json,
        empty="no SCIM tokens: `llmgw ctl scim token create --label NAME`",
        headers=["PREFIX", "ID", "LABEL", "ISSUED"],
        row=lambda t: [t["prefix"], t["id"], t["label"], t["issued_at"][:19]],
    )


@scim_token.command("revoke")
@click.argument("token_ref", metavar="ID-OR-PREFIX")
@click.pass_context
def scim_token_revoke(ctx: click.Context, token_ref: str) -> None:
    """Revoke a SCIM token: it provisions nothing from now on."""

    _send(ctx, "scim.token-revoke", I.RevokeScimToken(token=token_ref))


@scim.command("map")
@click.argument("group")
@_map_options
@click.pass_context
def scim_map(ctx: click.Context, group: str, role: str, scope: str) -> None:
    """Grant a role to the members of a SCIM group (by its displayName): `sso map scim GROUP …`."""

    _send(ctx, "idp.map", I.MapGroup(provider=I.SCIM, group=group, role=role, scope=scope))
