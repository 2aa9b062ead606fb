"""`llmgw ctl …`: operate the system. Commands go over the bus; views come from the admin API."""

from __future__ import annotations

import json

import click

from llmgw.cli.client import Session, run
from llmgw.cli.lazy_group import LazyCommand, LazyGroup
from llmgw.events.schema import tenancy as T

# The modules holding `ctl`'s other subcommands, and the names each adds to `ctl` (or adds to: `ctl
# model`'s subcommands live in three). Each adds its own as it is imported (they import `ctl` from here),
# so they are imported when `ctl` is asked for one of their names, not with this module: `ctl models`
# imports only fleet_cmd, and importing one of them first never finds the others half-made.
# tests/test_cli_imports.py holds these names to what each module adds.
SUBCOMMAND_MODULES = {
    "llmgw.cli.access_cmd": ("budget", "key", "keys", "limit", "price"),
    "llmgw.cli.audit_cmd": ("audit",),
    "llmgw.cli.capacity_cmd": ("bench", "model"),  # `ctl bench` and `ctl model target`
    "llmgw.cli.fleet_cmd": (
        "cordon",
        "drain",
        "explain",
        "logs",
        "model",
        "models",
        "node",
        "nodes",
        "replicas",
        "restart",
        "retry",
        "uncordon",
        "weights",
    ),
    "llmgw.cli.identity_cmd": ("ldap", "scim", "sso"),
    "llmgw.cli.jobs_cmd": ("job", "model"),  # `ctl job` and `ctl model serve`
    "llmgw.cli.mcp_cmd": ("mcp",),
    "llmgw.cli.nats_cmd": ("nats",),
    "llmgw.cli.people_cmd": ("token", "user"),
    "llmgw.cli.quota_cmd": ("quota",),
    "llmgw.cli.usage_cmd": ("request", "usage"),
}


@click.group(
    cls=LazyGroup,
    registering=SUBCOMMAND_MODULES,
    lazy={
        # needs nothing from a running system, nor from this module
        "cert": LazyCommand(
            "llmgw.cli.cert_cmd:cert",
            "The installation's CA and its certificates: HTTPS for the gateway and admin API, NATS TLS.",
        )
    },
)
def ctl() -> None:
    """Operate the system: tenancy, keys, limits, prices, budgets, models, nodes."""


def _scope_group(kind: str, example: str) -> click.Group:
    @click.group(name=kind, help=f"Create, rename and delete {kind}s (named like {example!r}).")
    def group() -> None:
        pass

    @group.command("create", help=f"Create a {kind}, e.g. `llmgw ctl {kind} create {example}`.")
    @click.argument("path")
    @click.pass_context
    def create(ctx: click.Context, path: str) -> None:
        async def go(s: Session) -> None:
            out = await s.command(T.SERVICE, "create", T.CreateScope(kind=kind, path=path))
            click.echo(f"{out.message} (id {out.result.get('id', '?')})")

        run(ctx, go)

    @group.command("rename", help=f"Rename a {kind}: `llmgw ctl {kind} rename {example} NEW-NAME`.")
    @click.argument("path")
    @click.argument("new_name")
    @click.pass_context
    def rename(ctx: click.Context, path: str, new_name: str) -> None:
        async def go(s: Session) -> None:
            out = await s.command(T.SERVICE, "rename", T.RenameScope(kind=kind, path=path, name=new_name))
            click.echo(out.message)

        run(ctx, go)

    @group.command("delete", help=f"Delete an empty {kind}.")
    @click.argument("path")
    @click.pass_context
    def delete(ctx: click.Context, path: str) -> None:
        async def go(s: Session) -> None:
            out = await s.command(T.SERVICE, "delete", T.DeleteScope(kind=kind, path=path))
            click.echo(out.message)

        run(ctx, go)

    return group


ctl.add_command(_scope_group("org", "acme"))
ctl.add_command(_scope_group("team", "acme/ml"))
ctl.add_command(_scope_group("project", "acme/ml/chat"))


@ctl.command("tree")
@click.option("--json", "as_json", is_flag=True, help="Print the tree as JSON.")
@click.pass_context
def tree(ctx: click.Context, as_json: bool) -> None:
    """Show organisations, their teams and their projects."""

    async def go(s: Session) -> None:
        body = await s.api("GET", "/api/v1/tree")
        if as_json:
            click.echo(json.dumps(body["orgs"], indent=2))
            return
        if not body["orgs"]:
            click.echo("no organisations yet: `llmgw ctl org create NAME`")
            return
        for line in render_tree(body["orgs"]):
            click.echo(line)

    run(ctx, go)


def render_tree(orgs: list[dict]) -> list[str]:
    lines: list[str] = []

    def walk(nodes: list[dict], depth: int) -> None:
        for n in nodes:
            label = "  " * depth + n["name"]
            lines.append(f"{label:<40} {n['kind']:<8} {n['id']}")
            walk(n.get("children", []), depth + 1)

    walk(orgs, 0)
    return lines
