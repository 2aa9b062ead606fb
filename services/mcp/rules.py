"""The mcp service's decisions: pure functions over the folded servers and the tenancy tree (with its keys)."""

from __future__ import annotations

import math
import re
from datetime import datetime
from urllib.parse import urlsplit

from llmgw.events.commands import roles as R
from llmgw.events.commands.shell import Decision
from llmgw.events.folds.mcp import McpCatalog, Server
from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.schema import access as A
from llmgw.events.schema import mcp as P
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of, event_subject

TREE = event_subject(T.AGGREGATE, T.TREE_ID)
SUBJECTS = {
    McpCatalog.subject(): "mcp",
    TREE: "mcp-tenancy",
    f"{EVENTS_ROOT}.{A.KEY_AGGREGATE}.>": "mcp-keys",
}
MAX_TEXT = 500
MAX_ARGS = 64
MAX_HEADERS = 32
MAX_TOOLS = 256
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_HEADER = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,128}$")  # an HTTP token
_TOOL = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")  # what MCP clients accept in a tool's name


class McpState:
    """The servers and the tenancy tree (with its keys) a grant is resolved in, folded together."""

    def __init__(self) -> None:
        self.catalog = McpCatalog()
        self.tree = TenancyTree()

    def apply(self, event: RecordedEvent) -> None:
        aggregate, _ = aggregate_of(event.subject)
        if aggregate == P.AGGREGATE:
            self.catalog.apply(event)
        elif aggregate == T.AGGREGATE:
            self.tree.apply(event)
        else:
            self.tree.apply_key(event)


def decide(state: McpState, c: P.McpCommand, now: datetime) -> Decision:
    """Pure: an mcp command over the state → its :class:`Decision`, or a refusal."""
    catalog, tree = state.catalog, state.tree
    match c:
        case P.AddServer():
            return _add(catalog, c)
        case P.RemoveServer():
            server = _server(catalog, c.name)
            return Decision(
                subject=event_subject(P.AGGREGATE, server.name),
                payloads=[P.ServerRemoved(name=server.name)],
                message=f"MCP server {server.name} removed with its {len(server.grants)} grant(s)",
                result={"server": server.name},
            )
        case P.Allow() | P.Disallow():
            return _grant(catalog, tree, c)
    raise Rejected(f"unknown mcp command {type(c).__name__}", "unknown")  # pragma: no cover - a closed union


def _add(catalog: McpCatalog, c: P.AddServer) -> Decision:
    name = c.name.strip()
    if not P.NAME_RE.match(name):
        raise Rejected(
            f"{name[:40]!r} is not an MCP server name: lower-case letters, digits and '-', starting with a letter, "
            "at most 32 (its tools are shown as NAME__TOOL)",
            "invalid_name",
        )
    if bool(c.url) == bool(c.command):
        raise Rejected(
            "an MCP server is reached either by --url URL or by --command 'CMD ARGS…', one of them", "invalid"
        )
    if c.url:
        _check_url(c.url)
        if c.env:
            raise Rejected("--env is for a stdio server (--command); an HTTP server takes --header", "invalid")
    else:
        if len(c.command) > MAX_ARGS or any(not a or len(a) > MAX_TEXT or not a.isprintable() for a in c.command):
            raise Rejected(f"the command is at most {MAX_ARGS} printable, non-empty arguments", "invalid_command")
        if c.headers:
            raise Rejected("--header is for an HTTP server (--url); a stdio server takes --env", "invalid")
    if len(c.headers) + len(c.env) > MAX_HEADERS:
        raise Rejected(f"at most {MAX_HEADERS} headers and environment variables", "invalid")
    for h in c.headers:
        if not _HEADER.match(h.name):
            raise Rejected(f"{h.name[:40]!r} is not an HTTP header name", "invalid_header")
    for item in (*c.headers, *c.env):
        if not _ENV.match(item.env):
            raise Rejected(
                f"{item.env[:40]!r} is not an environment variable's name; write NAME=env:VARIABLE "
                "(the value is read from the routers' environment, never sent)",
                "invalid_env",
            )
    for e in c.env:
        if not _ENV.match(e.name):
            raise Rejected(f"{e.name[:40]!r} is not an environment variable's name", "invalid_env")
    if not (math.isfinite(c.timeout_s) and 0 < c.timeout_s <= 600):
        raise Rejected("the timeout is more than 0 and at most 600 seconds", "invalid_timeout")
    old = catalog.servers.get(name)
    event = P.ServerSet(name=name, url=c.url, command=c.command, headers=c.headers, env=c.env, timeout_s=c.timeout_s)
    if old is not None and (old.url, old.command, old.headers, old.env, old.timeout_s) == (
        c.url,
        c.command,
        c.headers,
        c.env,
        c.timeout_s,
    ):
        return Decision(message=f"MCP server {name} is so already", result={"server": name})
    where = c.url or " ".join(c.command)
    return Decision(
        subject=event_subject(P.AGGREGATE, name),
        payloads=[event],
        message=f"MCP server {name} ({where}) {'changed' if old else 'added'}"
        + ("" if old and old.grants else f"; let a project use it: `llmgw ctl mcp allow {name} --project O/T/P`"),
        result={"server": name},
    )


def _check_url(url: str) -> None:
    if len(url) > MAX_TEXT or not url.isprintable():
        raise Rejected(f"the URL is at most {MAX_TEXT} printable characters", "invalid_server_url")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise Rejected(f"{url[:80]!r} is not an http(s):// URL of a streamable-HTTP MCP server", "invalid_server_url")
    if parts.username or parts.password:
        raise Rejected(
            "a URL must not hold credentials (they would be on the log): send them with --header NAME=env:VARIABLE",
            "invalid_server_url",
        )


def _server(catalog: McpCatalog, name: str) -> Server:
    server = catalog.servers.get(name.strip())
    if server is None:
        known = ", ".join(sorted(catalog.servers)[:20]) or "none"
        raise Rejected(
            f"there is no MCP server {name.strip()[:40]!r} (there are: {known}); add it with `llmgw ctl mcp add`",
            "not_found",
        )
    return server


def _grant(catalog: McpCatalog, tree: TenancyTree, c: P.Allow | P.Disallow) -> Decision:
    server = _server(catalog, c.server)
    raw = c.project.strip().removeprefix("project:")
    project = tree.find("project", raw)
    if project is None:
        raise Rejected(f"there is no project {raw[:80]!r}; name it ORG/TEAM/PROJECT (e.g. acme/ml/chat)", "not_found")
    path = tree.path(project)
    key_id, who = "", f"project {path}"
    if c.key.strip():
        wanted = c.key.strip().removeprefix("key:").removeprefix(f"{A.KEY_PREFIX}-")
        key = next((k for k in tree.keys.values() if wanted in (k.id, k.prefix) and not k.revoked), None)
        if key is None or key.project_id != project.id:
            raise Rejected(
                f"project {path} has no live key {c.key.strip()[:40]!r}; see `llmgw ctl key list`", "not_found"
            )
        key_id, who = key.id, f"key {A.KEY_PREFIX}-{key.prefix} of project {path}"
    if len(c.tools) > MAX_TOOLS or any(not _TOOL.match(t) for t in c.tools):
        raise Rejected(
            f"a tool is named as its server names it (letters, digits, '_', '.', '-'), at most {MAX_TOOLS}",
            "invalid_tool",
        )
    old = server.grants.get((project.id, key_id))
    subject = event_subject(P.AGGREGATE, server.name)
    result = {"server": server.name, "project": path, "key": key_id}
    if isinstance(c, P.Allow):
        if not c.tools:
            tools: tuple[str, ...] = ()
        elif old is not None and not old.tools:
            return Decision(message=f"{who} may use every tool of {server.name} already", result=result)
        else:
            tools = tuple(dict.fromkeys((*(old.tools if old else ()), *c.tools)))
        if old is not None and old.tools == tools:
            return Decision(message=f"{who} may use {_shown(tools)} of {server.name} already", result=result)
        return Decision(
            subject=subject,
            payloads=[P.Allowed(server=server.name, project_id=project.id, key_id=key_id, tools=tools)],
            message=f"{who} may use {_shown(tools)} of MCP server {server.name}",
            result=result,
        )
    if old is None:
        return Decision(message=f"{who} has no grant on {server.name}; nothing to withdraw", result=result)
    if c.tools and old.tools:
        kept = tuple(t for t in old.tools if t not in c.tools)
        if kept:
            return Decision(
                subject=subject,
                payloads=[P.Allowed(server=server.name, project_id=project.id, key_id=key_id, tools=kept)],
                message=f"{who} may use {_shown(kept)} of MCP server {server.name}",
                result=result,
            )
    elif c.tools:
        raise Rejected(
            f"{who} may use every tool of {server.name}; withdraw the whole grant (no --tool), "
            "then allow the tools it keeps",
            "invalid",
        )
    return Decision(
        subject=subject,
        payloads=[P.Disallowed(server=server.name, project_id=project.id, key_id=key_id)],
        message=f"{who} may no longer use MCP server {server.name}",
        result=result,
    )


def _shown(tools: tuple[str, ...]) -> str:
    return "every tool" if not tools else "tool(s) " + ", ".join(tools)


_VERBS = {
    P.AddServer: "adding MCP server",
    P.RemoveServer: "removing MCP server",
    P.Allow: "granting MCP server",
    P.Disallow: "withdrawing MCP server",
}


def need(c: P.McpCommand) -> R.Need:
    """Servers are the cluster admins' (they run on the routers' hosts, with their secrets); a grant is
    the project's team admins', as its limits and budgets are."""
    match c:
        case P.Allow() | P.Disallow():
            what = f"{_VERBS[type(c)]} {c.server.strip()[:40]} to {c.project.strip()[:80]}"
            return R.Need(
                role="team-admin", what=what, kind="project", tenant=c.project.strip().removeprefix("project:")
            )
        case _:
            return R.cluster_admin(f"{_VERBS[type(c)]} {c.name.strip()[:40]}")
