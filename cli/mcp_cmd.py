"""`llmgw ctl mcp …`: the MCP servers behind the gateway's ``/mcp`` (issue 26), and who may use their tools.

Each change is one signed command to the mcp service, as the other `ctl` groups send theirs; the list
comes from the admin API. A header's (or a stdio server's environment variable's) value never leaves the
routers' hosts: these commands name the environment variable the routers read it from
(``--header Authorization=env:GITHUB_MCP_TOKEN``).
"""

from __future__ import annotations

import json
import shlex

import click

from llmgw.cli.client import Session, run
from llmgw.cli.ctl import ctl
from llmgw.cli.table import table
from llmgw.events.schema import mcp as P

SERVERS_PATH = "/api/v1/mcp/servers"


def _send(ctx: click.Context, verb: str, payload: P.McpCommand) -> None:
    async def go(s: Session) -> None:
        out = await s.command(P.SERVICE, verb, payload)
        click.echo(out.message)

    run(ctx, go)


def parse_from_env(text: str, what: str) -> tuple[str, str]:
    """``NAME=env:VARIABLE`` → (NAME, VARIABLE); anything else is refused, saying how to write it."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip() or not value.startswith("env:") or not value[4:].strip():
        raise click.BadParameter(
            f"write {what} as NAME=env:VARIABLE (e.g. Authorization=env:GITHUB_MCP_TOKEN): its value is read from "
            "the routers' environment, never sent nor kept on the log",
            param_hint=f"'{text[:60]}'",
        )
    return name.strip(), value[4:].strip()


@ctl.group()
def mcp() -> None:
    """MCP servers behind the gateway's /mcp, and which projects (or keys) may use which of their tools."""


@mcp.command("add")
@click.argument("name")
@click.option("--url", default="", help="A streamable-HTTP MCP server's URL (https://…/mcp).")
@click.option(
    "--command", "command", default="", help="A stdio server the routers' hosts run, e.g. 'uvx mcp-server-time'."
)
@click.option(
    "--header",
    "headers",
    multiple=True,
    metavar="NAME=env:VAR",
    help="A header sent to an HTTP server, its value from the routers' environment variable VAR (repeatable).",
)
@click.option(
    "--env",
    "envs",
    multiple=True,
    metavar="NAME=env:VAR",
    help="An environment variable a stdio server starts with, from the routers' variable VAR (repeatable).",
)
@click.option("--timeout", "timeout_s", default=30.0, show_default=True, help="Seconds a tool call may take.")
@click.pass_context
def add(
    ctx: click.Context,
    name: str,
    url: str,
    command: str,
    headers: tuple[str, ...],
    envs: tuple[str, ...],
    timeout_s: float,
) -> None:
    """Add (or change) an MCP server NAME; its tools are shown as NAME__TOOL on /mcp."""
    if bool(url) == bool(command):
        raise click.UsageError("give --url URL or --command 'CMD ARGS…' (one of them)")
    try:
        argv = tuple(shlex.split(command))
    except ValueError as exc:
        raise click.BadParameter(f"the command cannot be split into arguments: {exc}", param_hint="--command") from exc
    payload = P.AddServer(
        name=name,
        url=url,
        command=argv,
        headers=tuple(P.Header(name=k, env=v) for k, v in (parse_from_env(h, "--header") for h in headers)),
        env=tuple(P.EnvVar(name=k, env=v) for k, v in (parse_from_env(e, "--env") for e in envs)),
        timeout_s=timeout_s,
    )
    _send(ctx, "mcp.add", payload)


@mcp.command("remove")
@click.argument("name")
@click.pass_context
def remove(ctx: click.Context, name: str) -> None:
    """Remove the MCP server NAME (its grants go with it)."""
    _send(ctx, "mcp.remove", P.RemoveServer(name=name))


@mcp.command("allow")
@click.argument("server")
@click.option("--project", required=True, help="The project: ORG/TEAM/PROJECT (e.g. acme/ml/chat).")
@click.option("--key", default="", help="Only this key of the project (its id or llmgw-PREFIX).")
@click.option("--tool", "tools", multiple=True, help="Only this tool, as the server names it (repeatable).")
@click.pass_context
def allow(ctx: click.Context, server: str, project: str, key: str, tools: tuple[str, ...]) -> None:
    """Let a project (or one of its keys) use SERVER's tools: every one, or those named with --tool."""
    _send(ctx, "mcp.allow", P.Allow(server=server, project=project, key=key, tools=tools))


@mcp.command("disallow")
@click.argument("server")
@click.option("--project", required=True, help="The project: ORG/TEAM/PROJECT.")
@click.option("--key", default="", help="The key's own grant, not the project's.")
@click.option("--tool", "tools", multiple=True, help="Take only this tool from the grant (repeatable).")
@click.pass_context
def disallow(ctx: click.Context, server: str, project: str, key: str, tools: tuple[str, ...]) -> None:
    """Take tools from a project's (or key's) grant on SERVER, or the whole grant when no --tool is named."""
    _send(ctx, "mcp.disallow", P.Disallow(server=server, project=project, key=key, tools=tools))


@mcp.command("list")
@click.option("--json", "as_json", is_flag=True, help="As JSON.")
@click.pass_context
def list_(ctx: click.Context, as_json: bool) -> None:
    """The MCP servers, how each is reached, and who may use which of its tools."""

    async def go(s: Session) -> None:
        found = await s.api("GET", SERVERS_PATH)
        if as_json:
            click.echo(json.dumps(found, indent=2))
            return
        if not found:
            click.echo("no MCP servers yet: `llmgw ctl mcp add NAME --url URL` or `--command 'CMD ARGS…'`")
            return
        rows = []
        for server in found:
            secrets = [f"{h['name']}=env:{h['env']}" for h in server["headers"] + server["env"]]
            grants = [
                f"{g['project']}{' key ' + g['key_id'] if g['key_id'] else ''}: "
                + (",".join(g["tools"]) if g["tools"] else "every tool")
                for g in server["grants"]
            ]
            where = server["url"] or " ".join(server["command"])
            rows.append(
                [server["name"], server["transport"], where, " ".join(secrets) or "-", "; ".join(grants) or "-"]
            )
        for line in table(["NAME", "TRANSPORT", "WHERE", "SECRETS", "ALLOWED"], rows):
            click.echo(line)

    run(ctx, go)
