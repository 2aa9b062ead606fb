"""`llmgw ctl audit` (SPEC TEN-4): who changed what, from the event log."""

from __future__ import annotations

import json

import click

from llmgw.cli.client import Session, run
from llmgw.cli.ctl import ctl
from llmgw.cli.events_cmd import one_line, parse_since
from llmgw.events.schema.envelope import RecordedEvent


@ctl.command("audit")
@click.option("--actor", help="user:alice, node:gpu-07, svc:scheduler; or a kind (user:, node:, svc:). Default: user:.")
@click.option("--since", help="Only changes after this time (10m, 2h, 3d, or ISO).")
@click.option("--type", "type_", help="Only events of this type, e.g. key.revoked.")
@click.option("-n", "limit", default=50, show_default=True, help="The newest N changes.")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.pass_context
def audit(
    ctx: click.Context, actor: str | None, since: str | None, type_: str | None, limit: int, as_json: bool
) -> None:
    """Who changed what: each event a person (or the actor named) caused, oldest first, with its data."""
    if since:
        parse_since(since)  # refused here, before any call

    async def go(s: Session) -> None:
        params = {"limit": str(limit)}
        params.update({k: v for k, v in (("actor", actor), ("since", since), ("type", type_)) if v})
        found = (await s.api("GET", "/api/v1/audit", params=params))["events"]
        if not found:
            click.echo(f"no changes by {actor or 'people (user:…)'}" + (f" since {since}" if since else ""))
            return
        store = await s.store()
        for row in found:
            event = await store.get(row["seq"])
            if as_json:
                click.echo(json.dumps(row))
            elif isinstance(event, RecordedEvent):
                click.echo(one_line(event))
            else:
                click.echo(f"{row['seq']:>8}  {row['at']}  {row['actor']:<20} {row['type']}  (no longer in the stream)")

    run(ctx, go)
