"""`llmgw ctl quota set|list|clear`: capacity quotas over the tenancy tree (SPEC SCHED-8)."""

from __future__ import annotations

import json
from typing import Any

import click
import msgspec

from llmgw.cli.client import Session, run
from llmgw.cli.ctl import ctl
from llmgw.cli.table import table
from llmgw.events.commands.errors import Unreachable
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import tenancy as T

GiB = 1024**3


@ctl.group()
def quota() -> None:
    """Capacity quotas: what a scope is guaranteed and what it may not exceed (GPUs, cores, memory)."""


def _bytes(gb: float | None) -> int | None:
    return None if gb is None else int(gb * GiB)


@quota.command("set")
@click.argument("scope")
@click.option("--gpus", type=int, help="GPUs guaranteed: its replicas within it are never taken for others.")
@click.option("--cores", type=int, help="Cores guaranteed.")
@click.option("--memory", "memory_gb", type=float, help="Memory guaranteed, in GB.")
@click.option("--limit-gpus", type=int, help="GPUs it may not exceed: no replica is placed beyond.")
@click.option("--limit-cores", type=int, help="Cores it may not exceed.")
@click.option("--limit-memory", "limit_memory_gb", type=float, help="Memory it may not exceed, in GB.")
@click.pass_context
def quota_set(
    ctx: click.Context,
    scope: str,
    gpus: int | None,
    cores: int | None,
    memory_gb: float | None,
    limit_gpus: int | None,
    limit_cores: int | None,
    limit_memory_gb: float | None,
) -> None:
    """Set SCOPE's quota (org:acme, team:acme/ml, project:acme/ml/chat, or a path). What is left out is unset."""
    payload = Q.SetQuota(
        scope=scope,
        guarantee=Q.Resources(gpus=gpus, cores=cores, memory_bytes=_bytes(memory_gb)),
        limit=Q.Resources(gpus=limit_gpus, cores=limit_cores, memory_bytes=_bytes(limit_memory_gb)),
    )

    async def go(s: Session) -> None:
        out = await s.command(T.SERVICE, "quota-set", payload)
        click.echo(out.message)

    run(ctx, go)


@quota.command("clear")
@click.argument("scope")
@click.pass_context
def quota_clear(ctx: click.Context, scope: str) -> None:
    """Remove SCOPE's quota: no guarantee, no limit."""

    async def go(s: Session) -> None:
        out = await s.command(T.SERVICE, "quota-clear", Q.ClearQuota(scope=scope))
        click.echo(out.message)

    run(ctx, go)


def _cell(amounts: dict[str, Any] | None) -> str:
    """``2 GPUs, 16 cores, 64 GB`` for what is set; ``-`` for nothing."""
    if not amounts:
        return "-"
    parts = []
    if amounts.get("gpus") is not None:
        parts.append(f"{amounts['gpus']} GPUs")
    if amounts.get("cores") is not None:
        parts.append(f"{amounts['cores']} cores")
    if amounts.get("memory_gb") is not None:
        parts.append(f"{amounts['memory_gb']:g} GB")
    return ", ".join(parts) or "-"


@quota.command("list")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def quota_list(ctx: click.Context, as_json: bool) -> None:
    """Each scope with a quota or holdings: guarantee, limit, what it holds now (asked of a scheduler)."""

    async def go(s: Session) -> None:
        store = await s.store()
        import nats.errors  # loaded with the store

        try:
            msg = await store.nc.request(Q.QUOTAS_SUBJECT, b"", timeout=10)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError) as exc:
            raise Unreachable("no scheduler answered: is the scheduler service running?") from exc
        body = msgspec.json.decode(msg.data)
        if as_json:
            click.echo(json.dumps(body, indent=2))
            return
        rows = body["scopes"]
        if not rows:
            click.echo("no quotas yet: `llmgw ctl quota set team:acme/ml --gpus 4 --limit-gpus 8`")
        else:
            lines = table(
                ["SCOPE", "GUARANTEE", "LIMIT", "HOLDS", "PROTECTED", "BORROWED"],
                [
                    [
                        r["scope"],
                        _cell(r["guarantee"]),
                        _cell(r["limit"]),
                        _cell(r["holds"]),
                        r["protected_replicas"],
                        r["borrowed_replicas"],
                    ]
                    for r in rows
                ],
                right={4, 5},
            )
            for line in lines:
                click.echo(line)
        for model, why in body.get("unresolved_owners", {}).items():
            click.echo(f"note: model {model}: {why}")

    run(ctx, go)
