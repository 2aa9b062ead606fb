"""`llmgw ctl user …`, `llmgw ctl token …`, `llmgw login` and `llmgw logout` (SPEC TEN-1, TEN-3).

A password is asked for on the terminal (or read from stdin with ``--password-stdin``, for
scripts), hashed here with argon2id and sent as its hash: it never crosses the bus. A personal
access token is made here and shown once; only its hash is sent.
"""

from __future__ import annotations

import asyncio
import json
import sys
from datetime import UTC, datetime, timedelta
from urllib.parse import quote

import click

from llmgw.cli.client import Session, run
from llmgw.cli.credentials import forget_token, save_token
from llmgw.cli.ctl import ctl
from llmgw.cli.table import table
from llmgw.events.commands import roles as R
from llmgw.events.commands.errors import CommandError, CommandRejectedError
from llmgw.events.schema import people as P


def _new_password(from_stdin: bool) -> str:
    """A new password, from stdin (one line) or asked twice on the terminal; refused if too weak."""
    from llmgw.services.people.passwords import password_problem  # beside argon2: imported only when one is set

    if from_stdin:
        password = sys.stdin.readline().rstrip("\n")
    else:
        password = click.prompt("New password", hide_input=True, confirmation_prompt=True)
    problem = password_problem(password)
    if problem is not None:
        raise click.ClickException(problem)
    return password


def _hashed(password: str) -> str:
    """``password`` hashed with argon2id, as the people service keeps it (imported only when one is set)."""
    from llmgw.services.people.passwords import hash_password

    return hash_password(password)


def _send(ctx: click.Context, verb: str, payload: P.PeopleCommand) -> None:
    """Send one people command and print what the service answered."""

    async def go(s: Session) -> None:
        click.echo((await s.command(P.SERVICE, verb, payload)).message)

    run(ctx, go)


@ctl.group()
def user() -> None:
    """People who may sign in: add, list, disable, enable, change a password."""


@user.command("add")
@click.argument("name")
@click.option("--display-name", default="", help="How the person is shown (default: the name).")
@click.option("--password-stdin", is_flag=True, help="Read the password from stdin (one line) instead of asking.")
@click.pass_context
def user_add(ctx: click.Context, name: str, display_name: str, password_stdin: bool) -> None:
    """Add a person who may sign in with `llmgw login`."""
    password_hash = _hashed(_new_password(password_stdin))

    async def go(s: Session) -> None:
        add = P.AddUser(name=name, password_hash=password_hash, display_name=display_name)
        out = await s.command(P.SERVICE, "user.add", add)
        click.echo(f"{out.message}: they sign in with `llmgw login --user {name}`")

    run(ctx, go)


@user.command("passwd")
@click.argument("name")
@click.option("--password-stdin", is_flag=True, help="Read the password from stdin (one line) instead of asking.")
@click.pass_context
def user_passwd(ctx: click.Context, name: str, password_stdin: bool) -> None:
    """Set a person's password (their sessions and tokens go on working)."""
    password_hash = _hashed(_new_password(password_stdin))

    _send(ctx, "user.passwd", P.SetPassword(name=name, password_hash=password_hash))


@user.command("disable")
@click.argument("name")
@click.option("--reason", default="", help="Why, for the audit log and the person's refusals.")
@click.pass_context
def user_disable(ctx: click.Context, name: str, reason: str) -> None:
    """Stop a person signing in; their tokens stop working at once."""

    _send(ctx, "user.disable", P.DisableUser(name=name, reason=reason))


@user.command("enable")
@click.argument("name")
@click.pass_context
def user_enable(ctx: click.Context, name: str) -> None:
    """Let a disabled person sign in again."""

    _send(ctx, "user.enable", P.EnableUser(name=name))


@user.command("language")
@click.argument("name")
@click.argument("language", metavar="LANG")
@click.pass_context
def user_language(ctx: click.Context, name: str, language: str) -> None:
    """Set the language a person reads the console in: en or de ("" follows their browser)."""

    _send(ctx, "user.language", P.SetLanguage(name=name, language=language))


@user.command("grant")
@click.argument("name")
@click.argument("role", type=click.Choice(R.ROLES))
@click.argument("scope")
@click.pass_context
def user_grant(ctx: click.Context, name: str, role: str, scope: str) -> None:
    """Give a person a role over a scope: cluster, org:ACME, team:ACME/ML or project:ACME/ML/CHAT."""

    _send(ctx, "role.grant", P.GrantRole(name=name, role=role, scope=scope))


@user.command("revoke")
@click.argument("name")
@click.argument("role", type=click.Choice(R.ROLES))
@click.argument("scope")
@click.pass_context
def user_revoke(ctx: click.Context, name: str, role: str, scope: str) -> None:
    """Take a role over a scope back from a person."""

    _send(ctx, "role.revoke", P.RevokeRole(name=name, role=role, scope=scope))


@user.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print the people as JSON.")
@click.pass_context
def user_list(ctx: click.Context, as_json: bool) -> None:
    """Every person: whether they may sign in, and their live tokens."""

    async def go(s: Session) -> None:
        people = await s.api("GET", "/api/v1/users")
        if as_json:
            click.echo(json.dumps(people, indent=2))
            return
        rows = [
            [
                p["name"],
                p["display_name"] or "-",
                p.get("source") or "here",
                "disabled" if p["disabled"] else "active",
                ", ".join(_role_text(r) for r in p.get("roles", [])) or "-",
                str(len(p["tokens"])),
                p["added_at"][:19],
            ]
            for p in people
        ]
        for line in table(["NAME", "DISPLAY NAME", "FROM", "STATE", "ROLES", "TOKENS", "ADDED"], rows):
            click.echo(line)

    run(ctx, go)


def _role_text(role: dict) -> str:
    """``team-admin of team:acme/ml``, and ``(corp: ml-admins)`` when a provider's group mapping granted it."""
    via = role.get("via")
    return f"{role['role']} of {role['scope']}" + (f" ({via['provider']}: {via['group']})" if via else "")


@ctl.group()
def token() -> None:
    """Personal access tokens, for scripts and automation."""


@token.command("create")
@click.option("--user", "name", required=True, help="Whose token it is.")
@click.option("--label", default="", help="What it is for (ci, backup…), shown in lists.")
@click.option("--days", type=click.IntRange(min=1), help="Days until it stops working (default: never).")
@click.pass_context
def token_create(ctx: click.Context, name: str, label: str, days: int | None) -> None:
    """Make a personal access token: shown once, only its hash is kept."""
    expires = datetime.now(UTC) + timedelta(days=days) if days else None
    secret, issue = P.issue(name, "personal", label=label, expires_at=expires)

    async def go(s: Session) -> None:
        out = await s.command(P.SERVICE, "token.issue", issue)
        click.echo(f"{out.message}; it is shown only this once:", err=True)
        click.echo(secret)

    run(ctx, go)


@token.command("revoke")
@click.argument("name")
@click.argument("token_ref", metavar="ID-OR-PREFIX")
@click.option("--reason", default="", help="Why, for the audit log.")
@click.pass_context
def token_revoke(ctx: click.Context, name: str, token_ref: str, reason: str) -> None:
    """Revoke one of a person's tokens (a session or a personal token)."""

    _send(ctx, "token.revoke", P.RevokeToken(name=name, token=token_ref, reason=reason))


@click.command("login")
@click.option("--user", "name", default="", help="Your user name (asked for when not given).")
@click.option("--password-stdin", is_flag=True, help="Read the password from stdin (one line) instead of asking.")
@click.option(
    "--provider", default="", metavar="NAME", help="An LDAP directory that checks the password (`llmgw ctl sso list`)."
)
@click.option(
    "--sso", default="", metavar="NAME", help="Sign in through an OpenID provider in a browser (the device flow)."
)
@click.pass_context
def login(ctx: click.Context, name: str, password_stdin: bool, provider: str, sso: str) -> None:
    """Sign in to the admin API: the session token (12 h) is kept for it in your config directory (0600)."""
    if sso:
        run(ctx, lambda s: _login_sso(s, sso))
        return
    name = name or click.prompt("User")
    password = sys.stdin.readline().rstrip("\n") if password_stdin else click.prompt("Password", hide_input=True)

    async def go(s: Session) -> None:
        body = {"user": name, "password": password, **({"provider": provider} if provider else {})}
        got = await s.api("POST", "/api/v1/login", json=body)
        assert s.target.api_url is not None  # s.api answered
        where = save_token(s.target.api_url, got["token"])
        click.echo(f"signed in as {got['user']} until {got['expires_at'][:16]} UTC (token kept in {where})")

    run(ctx, go)


async def _login_sso(s: Session, provider: str) -> None:
    """The device flow (RFC 8628) through the admin API: the person signs in at the provider in any browser
    while this polls at the interval the provider asks for; the client secret stays on the server."""
    started = await s.api("POST", f"/api/v1/login/sso/{quote(provider, safe='')}/device", json={})
    click.echo(f"open {started['verification_uri']} and enter the code {started['user_code']}")
    if started.get("verification_uri_complete"):
        click.echo(f"or open {started['verification_uri_complete']}")
    interval = float(started.get("interval") or 5)
    while True:
        await asyncio.sleep(interval)  # RFC 8628 §3.5: poll no faster than the interval
        got = await s.api("POST", "/api/v1/login/sso/device/poll", json={"handle": started["handle"]})
        if "token" in got:
            assert s.target.api_url is not None  # s.api answered
            where = save_token(s.target.api_url, got["token"])
            click.echo(f"signed in as {got['user']} until {got['expires_at'][:16]} UTC (token kept in {where})")
            return
        interval = float(got.get("interval") or interval)


@click.command("logout")
@click.pass_context
def logout(ctx: click.Context) -> None:
    """Forget this admin API's session token here and revoke it."""

    async def go(s: Session) -> int:
        if not s.target.api_url or forget_token(s.target.api_url) is None:
            click.echo("not signed in to this admin API")
            return 0
        try:
            who = await s.api("GET", "/api/v1/whoami")
            await s.command(P.SERVICE, "token.revoke", P.RevokeToken(name=who["user"], token=who["token_id"]))
        except (CommandError, CommandRejectedError) as exc:
            click.echo(f"signed out here; the session could not be revoked ({exc}): it expires by itself", err=True)
            return 0
        click.echo("signed out")
        return 0

    run(ctx, go)
