"""`llmgw projections …`: the read models' positions, and rebuilding or verifying them from the log
(through the admin API)."""

from __future__ import annotations

import json

import click

from llmgw.cli.client import Session, run


@click.group()
def projections() -> None:
    """Rebuild read models from the log, or check them against it."""


@projections.command("status")
@click.pass_context
def projections_status(ctx: click.Context) -> None:
    """Each projection's position and lag."""

    async def go(s: Session) -> None:
        body = await s.api("GET", "/api/v1/projections")
        for p in body["projections"]:
            click.echo(f"{p['name']:<16} position {p['position']:<10} lag {p['lag']:<8} {p.get('error') or ''}")

    run(ctx, go)


@projections.command("rebuild")
@click.argument("name", required=False)
@click.pass_context
def projections_rebuild(ctx: click.Context, name: str | None) -> None:
    """Rebuild NAME (or all) into a shadow from the log, then swap it in."""

    async def go(s: Session) -> None:
        body = await s.api("POST", "/api/v1/projections/rebuild", params={"name": name or ""}, timeout=3600)
        if body.get("recreated"):
            click.echo(body["recreated"], err=True)
        for r in body["rebuilt"]:
            click.echo(f"{r['name']}: rebuilt from {r.get('events', '?')} events up to position {r.get('position')}")

    run(ctx, go)


@projections.command("verify")
@click.argument("name", required=False)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def projections_verify(ctx: click.Context, name: str | None, as_json: bool) -> None:
    """Rebuild NAME (or all) into a shadow and diff with the live tables. Exit 0 when identical."""

    async def go(s: Session) -> int:
        body = await s.api("POST", "/api/v1/projections/verify", params={"name": name or ""}, timeout=3600)
        if body.get("recreated"):
            click.echo(body["recreated"], err=True)
        if as_json:
            click.echo(json.dumps(body, indent=2))
            return 0 if body["identical"] else 1
        for r in body["verified"]:
            if r["identical"]:
                click.echo(f"{r['name']}: identical to a rebuild from the log (position {r.get('position')})")
                continue
            click.echo(f"{r['name']}: DIFFERS from a rebuild from the log (position {r.get('position')})")
            for table, diff in r.get("differences", {}).items():
                for row in diff.get("only_live", []):
                    click.echo(f"  {table}: only in live:    {row}")
                for row in diff.get("only_rebuilt", []):
                    click.echo(f"  {table}: only in rebuild: {row}")
                for pair in diff.get("changed", []):
                    click.echo(f"  {table}: live {pair['live']} ≠ rebuild {pair['rebuilt']}")
        return 0 if body["identical"] else 1

    run(ctx, go)
