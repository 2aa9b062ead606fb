"""`llmgw ctl` for access (SPEC TEN-2, GW-4, GW-5): keys, limits, prices, budgets.

Keys are made here, on the caller's machine (:func:`~llmgw.events.schema.access.make_api_key`): only
the lookup prefix and the SHA-256 of the key travel, and the key is printed once.
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from typing import Any

import click

from llmgw.cli.client import Session, run
from llmgw.cli.ctl import ctl
from llmgw.cli.table import table
from llmgw.events.schema import access as A

_DURATION = re.compile(r"^(\d+)([mhdw])$")
_UNITS = {"m": "minutes", "h": "hours", "d": "days", "w": "weeks"}


def parse_expiry(text: str, now: datetime) -> datetime:
    """A duration from ``now`` (``90m``, ``12h``, ``30d``, ``2w``) or an ISO 8601 date or time (UTC if no zone)."""
    t = text.strip()
    m = _DURATION.match(t)
    if m:
        return now + timedelta(**{_UNITS[m.group(2)]: int(m.group(1))})
    try:
        when = datetime.fromisoformat(t.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is neither a duration (90m, 12h, 30d, 2w) nor a date (2026-01-31 or 2026-01-31T12:00Z)",
            param_hint="--expires",
        ) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


def _csv(text: str | None) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()] if text else []


def _dash(value: Any) -> str:
    return "-" if value is None or value == "" or value == [] else str(value)


# -- keys ------------------------------------------------------------------------------------------


@ctl.group()
def key() -> None:
    """Create, list and revoke API keys (a key belongs to a project; shown once, stored hashed)."""


@key.command("create")
@click.option("--project", required=True, help="The key's project: ORG/TEAM/PROJECT (e.g. acme/ml/chat) or its id.")
@click.option("--name", default="", help="What the key is for (ci, web, …), shown in lists.")
@click.option("--user", help="The person the key is for.")
@click.option("--rpm", type=int, help="The key's own requests per minute.")
@click.option("--tpm", type=int, help="The key's own tokens per minute.")
@click.option("--models", help="Models the key may call, comma-separated (default: every model).")
@click.option("--expires", help="When the key stops working: 90m, 12h, 30d, 2w, or a date (UTC).")
@click.option(
    "--allow-external",
    "allow_external",
    is_flag=True,
    help="The key may call models served by providers outside the cluster (its prompts leave the cluster).",
)
@click.pass_context
def key_create(
    ctx: click.Context,
    project: str,
    name: str,
    user: str | None,
    rpm: int | None,
    tpm: int | None,
    models: str | None,
    expires: str | None,
    allow_external: bool,
) -> None:
    """Make a key for a project and print it once: only its prefix and hash are stored."""
    expires_at = parse_expiry(expires, datetime.now(UTC)) if expires else None
    secret, prefix, digest = A.make_api_key()
    command = A.CreateKey(
        project=project,
        prefix=prefix,
        secret_sha256=digest,
        name=name,
        user=user,
        rpm=rpm,
        tpm=tpm,
        models=_csv(models),
        expires_at=expires_at,
        external=allow_external,
    )

    async def go(s: Session) -> None:
        out = await s.command(A.SERVICE, "key.create", command)
        click.echo(out.message, err=True)
        click.echo(secret)
        click.echo("This key is shown only now and will not be shown again: store it somewhere safe.", err=True)

    run(ctx, go)


@key.command("list")
@click.option("--project", help="Only this project's keys (ORG/TEAM/PROJECT or id).")
@click.option("--json", "as_json", is_flag=True, help="Print the keys as JSON.")
@click.pass_context
def key_list(ctx: click.Context, project: str | None, as_json: bool) -> None:
    """Keys with their prefix, project, limits and state; never a secret."""

    async def go(s: Session) -> None:
        body = await s.api("GET", "/api/v1/keys", params={"project": project} if project else None)
        keys = body["keys"]
        if as_json:
            click.echo(json.dumps(keys, indent=2))
            return
        if not keys:
            click.echo("no keys yet: `llmgw ctl key create --project ORG/TEAM/PROJECT`")
            return
        rows = [
            [
                k["id"],
                k["display"],
                k["project"],
                _dash(k["name"]),
                _dash(k["user"]),
                _dash(k["rpm"]),
                _dash(k["tpm"]),
                _dash(",".join(k["models"])) + (" +external" if k.get("external") else ""),
                _dash(k["expires_at"] and k["expires_at"][:16]),
                k["state"],
            ]
            for k in keys
        ]
        header = ["ID", "KEY", "PROJECT", "NAME", "USER", "RPM", "TPM", "MODELS", "EXPIRES", "STATE"]
        for line in table(header, rows):
            click.echo(line)

    run(ctx, go)


@key.command("revoke")
@click.argument("key_ref", metavar="ID-OR-PREFIX")
@click.option("--reason", default="", help="Why, for the audit log.")
@click.pass_context
def key_revoke(ctx: click.Context, key_ref: str, reason: str) -> None:
    """Revoke a key; every router refuses it within seconds."""

    async def go(s: Session) -> None:
        out = await s.command(A.SERVICE, "key.revoke", A.RevokeKey(key=key_ref, reason=reason))
        click.echo(out.message)

    run(ctx, go)


# SPEC TEN-2 spells it `ctl keys create|list|revoke`: the same commands, under a hidden second name.
ctl.add_command(click.Group("keys", commands=dict(key.commands), help="Same as `llmgw ctl key`.", hidden=True))


# -- limits --------------------------------------------------------------------------------------


@ctl.group()
def limit() -> None:
    """Requests and tokens per minute for an org, team, project or key (SPEC GW-4)."""


@limit.command("set")
@click.argument("scope")
@click.option("--rpm", type=int, help="Requests per minute.")
@click.option("--tpm", type=int, help="Tokens (prompt + completion) per minute.")
@click.option("--clear", is_flag=True, help="Remove the scope's limits.")
@click.pass_context
def limit_set(ctx: click.Context, scope: str, rpm: int | None, tpm: int | None, clear: bool) -> None:
    """Set SCOPE's limits (SCOPE: org:acme, team:acme/ml, project:acme/ml/chat or key:ID); unset: no limit."""
    if clear and (rpm is not None or tpm is not None):
        raise click.UsageError("give --rpm/--tpm or --clear, not both")
    if not clear and rpm is None and tpm is None:
        raise click.UsageError("give --rpm N and/or --tpm N (or --clear to remove the limits)")

    async def go(s: Session) -> None:
        out = await s.command(A.SERVICE, "limit.set", A.SetLimit(scope=scope, rpm=rpm, tpm=tpm))
        click.echo(out.message)

    run(ctx, go)


@limit.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def limit_list(ctx: click.Context, as_json: bool) -> None:
    """Every scope's limits, named by path."""

    async def go(s: Session) -> None:
        rows = (await s.api("GET", "/api/v1/limits"))["limits"]
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        if not rows:
            click.echo("no limits set: `llmgw ctl limit set SCOPE --rpm N --tpm N`")
            return
        cells = [[r["path"], _dash(r["rpm"]), _dash(r["tpm"]), r["updated_at"][:19]] for r in rows]
        for line in table(["SCOPE", "RPM", "TPM", "SET AT"], cells):
            click.echo(line)

    run(ctx, go)


# -- prices --------------------------------------------------------------------------------------


@ctl.group()
def price() -> None:
    """Model prices per million input and output tokens, in US dollars (SPEC GW-5)."""


@price.command("set")
@click.argument("model")
@click.option("--input", "input_usd", type=float, required=True, help="USD per million input (prompt) tokens.")
@click.option("--output", "output_usd", type=float, required=True, help="USD per million output tokens.")
@click.pass_context
def price_set(ctx: click.Context, model: str, input_usd: float, output_usd: float) -> None:
    """Set MODEL's price per million tokens."""

    async def go(s: Session) -> None:
        payload = A.SetPrice(model=model, input_usd_per_m=input_usd, output_usd_per_m=output_usd)
        out = await s.command(A.SERVICE, "price.set", payload)
        click.echo(out.message)

    run(ctx, go)


@price.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def price_list(ctx: click.Context, as_json: bool) -> None:
    """Every model's price per million tokens."""

    async def go(s: Session) -> None:
        rows = (await s.api("GET", "/api/v1/prices"))["prices"]
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        if not rows:
            click.echo("no prices set: `llmgw ctl price set MODEL --input USD --output USD`")
            return
        cells = [[r["model"], f"{r['input_usd_per_m']:g}", f"{r['output_usd_per_m']:g}"] for r in rows]
        for line in table(["MODEL", "INPUT $/M", "OUTPUT $/M"], cells):
            click.echo(line)

    run(ctx, go)


# -- budgets -------------------------------------------------------------------------------------


@ctl.group()
def budget() -> None:
    """Spending budgets per day or month for an org, team, project or key (SPEC GW-5)."""


@budget.command("set")
@click.argument("scope")
@click.option("--usd", type=float, help="The budget in US dollars.")
@click.option("--period", type=click.Choice(A.PERIODS), default="month", show_default=True)
@click.option("--clear", is_flag=True, help="Remove the scope's budget.")
@click.pass_context
def budget_set(ctx: click.Context, scope: str, usd: float | None, period: str, clear: bool) -> None:
    """Set SCOPE's budget (SCOPE: org:acme, team:acme/ml, project:acme/ml/chat or key:ID)."""
    if clear == (usd is not None):
        raise click.UsageError("give --usd N (with --period day|month), or --clear")

    async def go(s: Session) -> None:
        out = await s.command(A.SERVICE, "budget.set", A.SetBudget(scope=scope, usd=usd, period=period))
        click.echo(out.message)

    run(ctx, go)


@budget.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def budget_list(ctx: click.Context, as_json: bool) -> None:
    """Every scope's budget, named by path."""

    async def go(s: Session) -> None:
        rows = (await s.api("GET", "/api/v1/budgets"))["budgets"]
        if as_json:
            click.echo(json.dumps(rows, indent=2))
            return
        if not rows:
            click.echo("no budgets set: `llmgw ctl budget set SCOPE --usd N --period month`")
            return
        cells = [[r["path"], f"{r['usd']:g}", r["period"], r["updated_at"][:19]] for r in rows]
        for line in table(["SCOPE", "USD", "PERIOD", "SET AT"], cells):
            click.echo(line)

    run(ctx, go)
