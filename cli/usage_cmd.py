"""`llmgw ctl usage` and `llmgw ctl request ID` (SPEC USE-2, GW-8): read back what the accountant stored."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import click

from llmgw.cli.client import Session, run
from llmgw.cli.ctl import ctl
from llmgw.cli.events_cmd import parse_since

BY = ("model", "key", "project", "team", "org")


def _num(n: int) -> str:
    return f"{n:,}"


def _secs(s: float | None) -> str:
    return "-" if s is None else f"{s:.3f}s"


def usage_table(body: dict[str, Any]) -> list[str]:
    """The lines `ctl usage` prints: a heading, one row per group, a total."""
    scope = body.get("scope") or "everything"
    if body.get("scope_id") and body["scope_id"] not in scope:
        scope += f" (id {body['scope_id']})"
    lines = [f"usage of {scope} since {body['since']}, by {body['by']}"]
    if not body["groups"]:
        lines.append("no requests in that time")
        return lines
    head = f"{body['by'].upper():<36} {'REQUESTS':>9} {'ERRORS':>7} {'TOKENS IN':>11} {'TOKENS OUT':>11}"
    lines.append(f"{head} {'COST USD':>11} {'MEAN LATENCY':>13}")

    def row(name: str, t: dict[str, Any]) -> str:
        return (
            f"{name:<36} {_num(t['requests']):>9} {_num(t['errors']):>7} {_num(t['tokens_in']):>11} "
            f"{_num(t['tokens_out']):>11} {t['cost_usd']:>11.4f} {_secs(t['mean_latency_s']):>13}"
        )

    for g in body["groups"]:
        lines.append(row(g.get("name") or (g["group"] if g["group"] not in (None, "") else "(none)"), g))
    if len(body["groups"]) > 1:
        lines.append(row("TOTAL", body["total"]))
    return lines


def request_lines(r: dict[str, Any]) -> list[str]:
    """The lines `ctl request ID` prints: one field per line."""
    served = r["model_served"] or "-"
    fields = [
        ("request", r["request_id"]),
        ("client id", r.get("client_request_id") or "-"),
        ("at", r["at"]),
        ("status", f"{r['status']}" + (f" ({r['error']})" if r.get("error") else "")),
        ("model", f"asked {r['model_asked'] or '-'}, served {served}"),
        ("replica", f"{r['replica_id'] or '-'} on node {r['node_id'] or '-'}"),
        ("endpoint", f"{r['endpoint'] or '-'}" + (" (stream)" if r["stream"] else "")),
        ("tokens", f"{_num(r['tokens_in'])} in, {_num(r['tokens_out'])} out"),
        ("queue", _secs(r["queue_s"])),
        ("ttft", _secs(r["ttft_s"])),
        ("total", _secs(r["total_s"])),
        ("cost", f"${r['cost_usd']:.6f}"),
        ("key", r.get("key_name") or r["key_id"] or "-"),
        ("project", r.get("project_name") or r["project_id"] or "-"),
        ("team / org", f"{r.get('team_name') or r['team_id'] or '-'} / {r.get('org_name') or r['org_id'] or '-'}"),
        ("user", r["user"] or "-"),
        ("router", r["router"] or "-"),
    ]
    lines = [f"{name:<11} {value}" for name, value in fields]
    if r.get("same_client_request_id"):
        others = r["same_client_request_id"]
        lines.append(
            f"{len(others)} other request(s) carried the same client id; by the gateway's id: " + ", ".join(others[:10])
        )
    return lines


@ctl.command("usage")
@click.option("--scope", help="project:acme/ml/chat, team:acme/ml, org:acme, key:ID, model:NAME (ids work too).")
@click.option("--since", default="24h", show_default=True, help="A duration back (30m, 1h, 2d) or an ISO time.")
@click.option("--by", "by", type=click.Choice(BY), default="model", show_default=True, help="One row per …")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def usage(ctx: click.Context, scope: str | None, since: str, by: str, as_json: bool) -> None:
    """Requests, errors, tokens, cost and mean latency from the per-minute rollups."""
    since_at = parse_since(since)

    async def go(s: Session) -> None:
        params = {"since": since_at.isoformat(), "by": by}
        if scope:
            params["scope"] = scope
        body = await s.api("GET", "/api/v1/usage", params=params)
        if as_json:
            click.echo(json.dumps(body, indent=2))
            return
        for line in usage_table(body):
            click.echo(line)

    run(ctx, go)


@ctl.command("request")
@click.argument("request_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def request(ctx: click.Context, request_id: str, as_json: bool) -> None:
    """One request's usage record: status, models, replica, tokens, timings, cost, key, project.

    REQUEST_ID is the gateway's id (its x-request-id header) or the client's own X-Request-Id."""

    async def go(s: Session) -> None:
        body = await s.api("GET", f"/api/v1/requests/{quote(request_id, safe='')}")
        if as_json:
            click.echo(json.dumps(body, indent=2))
            return
        for line in request_lines(body):
            click.echo(line)

    run(ctx, go)
