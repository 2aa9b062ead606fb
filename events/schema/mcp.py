"""MCP servers behind the gateway (issue 26): which servers there are, and who may use which of their tools.

One aggregate per server (``llmgw.evt.mcp.<name>``): reached over streamable HTTP (a URL) or run by each
router's host as a stdio server (a command line). Its credentials never travel nor are kept: a header's
value is named by the environment variable the routers read it from (``Authorization=env:GITHUB_MCP_TOKEN``),
as the identity providers' secrets are. Its allow-list is a grant per project (and optionally per key of
that project), for every tool or for the tools named.
"""

from __future__ import annotations

import re

import msgspec

from llmgw.events.schema.registry import EventType

AGGREGATE = "mcp"
SERVICE = "mcp"
# No '_' in a server's name: a tool is shown as ``<server>__<tool>``, and the first ``__`` splits it back.
NAME_RE = re.compile(r"^[a-z][a-z0-9-]{0,31}$")
SEPARATOR = "__"


class Header(msgspec.Struct, frozen=True, kw_only=True):
    """A header sent to a streamable-HTTP server, its value read from an environment variable of the routers."""

    name: str
    env: str


class EnvVar(msgspec.Struct, frozen=True, kw_only=True):
    """An environment variable a stdio server is started with, its value read from the routers' own."""

    name: str
    env: str


# -- events ------------------------------------------------------------------------------------


class ServerSet(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    url: str = ""  # streamable HTTP; or…
    command: tuple[str, ...] = ()  # …a stdio server the router's host runs (argv)
    headers: tuple[Header, ...] = ()
    env: tuple[EnvVar, ...] = ()
    timeout_s: float = 30.0  # a tool call taking longer is answered as a timeout


class ServerRemoved(msgspec.Struct, frozen=True, kw_only=True):
    name: str


class Allowed(msgspec.Struct, frozen=True, kw_only=True):
    """A grant, as it now stands: replaces the one for the same (project, key)."""

    server: str
    project_id: str
    key_id: str = ""  # "" : every key of the project
    tools: tuple[str, ...] = ()  # () : every tool of the server


class Disallowed(msgspec.Struct, frozen=True, kw_only=True):
    server: str
    project_id: str
    key_id: str = ""


EVENTS = (
    EventType(
        "mcp.set", 1, ServerSet, "An MCP server behind the gateway, added or changed (its secrets by name only)."
    ),
    EventType("mcp.removed", 1, ServerRemoved, "An MCP server no longer reachable through the gateway."),
    EventType(
        "mcp.allowed", 1, Allowed, "A project (or one of its keys) may use a server's tools (all, or those named)."
    ),
    EventType("mcp.disallowed", 1, Disallowed, "A project's (or key's) grant on a server is withdrawn."),
)


# -- commands (the mcp service; cluster admins add servers, a project's team admins grant them) -------


class AddServer(msgspec.Struct, frozen=True, kw_only=True, tag="mcp-add", forbid_unknown_fields=True):
    name: str
    url: str = ""
    command: tuple[str, ...] = ()
    headers: tuple[Header, ...] = ()
    env: tuple[EnvVar, ...] = ()
    timeout_s: float = 30.0


class RemoveServer(msgspec.Struct, frozen=True, kw_only=True, tag="mcp-remove", forbid_unknown_fields=True):
    name: str


class Allow(msgspec.Struct, frozen=True, kw_only=True, tag="mcp-allow", forbid_unknown_fields=True):
    server: str
    project: str  # a path (acme/ml/chat) or id
    key: str = ""  # a key id or prefix of that project ("" : the whole project)
    tools: tuple[str, ...] = ()  # added to the grant; () : every tool


class Disallow(msgspec.Struct, frozen=True, kw_only=True, tag="mcp-disallow", forbid_unknown_fields=True):
    server: str
    project: str
    key: str = ""
    tools: tuple[str, ...] = ()  # taken from the grant; () : the whole grant


McpCommand = AddServer | RemoveServer | Allow | Disallow
