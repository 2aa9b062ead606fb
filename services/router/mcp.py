"""``/mcp`` on the gateway's port (issue 26): one MCP endpoint for a gateway key, in front of the MCP
servers its project may use.

The endpoint speaks MCP's streamable HTTP with JSON answers (no server-sent stream is ever needed:
the gateway sends no request of its own to the client): ``initialize``, ``ping``, ``tools/list`` and
``tools/call``. Tools are shown as ``<server>__<tool>`` (MCP clients accept ``[A-Za-z0-9_.-]`` in a
tool's name; a server's name has no ``_``, so the first ``__`` splits it back).

Behind it, each router keeps one MCP client session per server (the SDK's ``streamablehttp`` or
``stdio`` client; a stdio server is a process of this router's host), opened at the first use and
opened again after it dies. Every tool call counts as a request against the key's rate limits and
leaves a usage record (its ``tool_call``: server, tool, bytes, outcome), refused or not.

Deciding what a key may see and call is pure (:func:`visible`, :func:`refusal_of`); the rest is I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import msgspec
import structlog
from aiohttp import web

from llmgw.events.folds.mcp import Access, Grant, McpCatalog, Server
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.followers import Followers
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import access as A
from llmgw.events.schema import mcp as P
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.usage import ToolCall, UsageRecord
from llmgw.services.router import admission as adm
from llmgw.services.router.limits import Level, Limiter
from llmgw.services.router.state import KeyInfo, RouterState

log = structlog.get_logger("llmgw.services.router.mcp")

# The handshake versions this endpoint speaks (the answers are the same in each); a client asking for
# another gets the newest, as the protocol says.
PROTOCOL_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
MAX_BODY = 4 * 1024 * 1024
SESSION_START_S = 30.0  # how long a server may take to start and answer initialize
STOP_S = 5.0

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
REFUSED = -32001  # the gateway's own refusals: key, limits, usage not kept
CONNECTION_CLOSED = -32000  # the SDK's client: the server's stream ended (a stdio server that exited)


# -- pure decisions --------------------------------------------------------------------------------


def split_name(name: str) -> tuple[str, str] | None:
    """``time__get_current_time`` → (``time``, ``get_current_time``); None when it names no server."""
    server, sep, tool = name.partition(P.SEPARATOR)
    return (server, tool) if sep and server and tool else None


def visible(catalog: McpCatalog, key: KeyInfo) -> dict[str, tuple[Grant, ...]]:
    """The servers a key may use, each with the grants that say which of its tools it may see."""
    return {s.name: catalog.grants_for(s.name, key.project_id, key.id) for s in catalog.usable(key.project_id, key.id)}


def describe_grants(access: Access, project: str, key: KeyInfo) -> str:
    """The allow-list a refusal names: the key's and its project's grants on the server."""
    if not access.grants:
        return "none"
    parts = []
    for g in access.grants:
        who = f"key {A.KEY_PREFIX}-{key.prefix}" if g.key_id else f"project {project}"
        parts.append(f"{who}: {', '.join(g.tools) if g.tools else 'every tool'}")
    return "; ".join(parts)


def refusal_of(catalog: McpCatalog, name: str, key: KeyInfo, project: str) -> str | None:
    """Why a key may not call the tool ``name`` (a sentence naming the allow-list), or None when it may."""
    split = split_name(name)
    if split is None:
        return f"{name[:80]!r} is not a tool of this gateway: tools are named SERVER__TOOL (see tools/list)"
    server, tool = split
    if server not in catalog.servers:
        return f"there is no MCP server {server!r} behind this gateway (see tools/list)"
    access = catalog.access(server, tool, key.project_id, key.id)
    if access.allowed:
        return None
    return (
        f"key {A.KEY_PREFIX}-{key.prefix} may not call {tool!r} of MCP server {server}: its allow-list there is "
        f"{describe_grants(access, project, key)}; a team admin of {project} grants it with "
        f"`llmgw ctl mcp allow {server} --project {project} --tool {tool}`"
    )


class ServerDown(Exception):
    """An MCP server could not be reached or started, or its session died (the sentence says which)."""


def _config(server: Server) -> tuple[Any, ...]:
    return (server.url, server.command, server.headers, server.env)


def _from_env(
    items: tuple[P.Header, ...] | tuple[P.EnvVar, ...], server: str, what: str, environ: Mapping[str, str]
) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        value = environ.get(item.env)
        if value is None:
            raise ServerDown(
                f"MCP server {server}'s {what} {item.name} is read from the environment variable {item.env}, "
                "which this router's environment lacks: set it where the routers run, and restart them"
            )
        out[item.name] = value
    return out


# -- one server's session ----------------------------------------------------------------------------


class Upstream:
    """One MCP server's client session, opened by its own task (the SDK's transports are context
    managers that must be left in the task that entered them) and opened again after it dies."""

    def __init__(self, server: Server, environ: Mapping[str, str]) -> None:
        self.server = server
        self.config = _config(server)
        self.environ = environ
        self._lock = asyncio.Lock()
        self._session: Any = None
        self._task: asyncio.Task | None = None
        self._closing: asyncio.Event | None = None

    async def session(self) -> Any:
        async with self._lock:
            if self._session is not None and self._task is not None and not self._task.done():
                return self._session
            await self._stop()
            ready: asyncio.Future = asyncio.get_running_loop().create_future()
            self._closing = asyncio.Event()
            self._task = asyncio.create_task(self._run(ready, self._closing), name=f"mcp-{self.server.name}")
            try:
                self._session = await asyncio.wait_for(asyncio.shield(ready), SESSION_START_S)
            except TimeoutError as exc:
                await self._stop()
                raise ServerDown(
                    f"MCP server {self.server.name} ({self.server.where}) did not answer initialize "
                    f"within {SESSION_START_S:.0f} s"
                ) from exc
            except ServerDown:
                await self._stop()
                raise
            return self._session

    async def _run(self, ready: asyncio.Future, closing: asyncio.Event) -> None:
        from mcp.client.session import ClientSession

        s = self.server
        try:
            async with contextlib.AsyncExitStack() as stack:
                if s.url:
                    import httpx2
                    from mcp.client.streamable_http import streamable_http_client

                    headers = _from_env(s.headers, s.name, "header", self.environ)
                    client = httpx2.AsyncClient(
                        headers=headers, timeout=httpx2.Timeout(30.0, read=max(300.0, s.timeout_s + 5))
                    )
                    await stack.enter_async_context(client)
                    read, write = await stack.enter_async_context(streamable_http_client(s.url, http_client=client))
                else:
                    from mcp.client.stdio import StdioServerParameters, stdio_client

                    env = _from_env(s.env, s.name, "environment variable", self.environ)
                    params = StdioServerParameters(command=s.command[0], args=list(s.command[1:]), env=env or None)
                    read, write = await stack.enter_async_context(stdio_client(params))
                session = await stack.enter_async_context(ClientSession(read, write))
                await session.initialize()
                ready.set_result(session)
                await closing.wait()
        except asyncio.CancelledError:
            raise
        except ServerDown as exc:
            if not ready.done():
                ready.set_exception(exc)
        except Exception as exc:  # the SDK's task groups raise exception groups (of Exceptions)
            if not ready.done():
                ready.set_exception(ServerDown(f"MCP server {s.name} ({s.where}) could not be reached: {_reason(exc)}"))
            else:
                log.warning("mcp session ended", server=s.name, error=_reason(exc))
        finally:
            self._session = None

    def dead(self) -> None:
        """The session failed a call: the next use opens a new one."""
        self._session = None
        if self._closing is not None:
            self._closing.set()

    async def _stop(self) -> None:
        task, self._task, self._session = self._task, None, None
        if self._closing is not None:
            self._closing.set()
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), STOP_S)
            except (TimeoutError, Exception):
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def close(self) -> None:
        async with self._lock:
            await self._stop()


def _reason(exc: BaseException) -> str:
    """The innermost sentence of an error (the SDK wraps them in exception groups)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    text = str(exc) or type(exc).__name__
    return text[:300]


# -- the endpoint ------------------------------------------------------------------------------------


class McpGateway:
    """``/mcp`` for one router: its own fold of the MCP servers, its sessions, and the handler."""

    def __init__(
        self,
        store: EventStore,
        *,
        state: Callable[[], RouterState],
        limiter: Limiter,
        note: Callable[[list[Level], int, int], None],
        usage_put: Callable[[UsageRecord], None],
        usage_refusal: Callable[[], str | None],
        clock: Callable[[], float],
        instance: str,
        folds: FollowerRegistry | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.catalog = McpCatalog()
        self.fold = Followers(store, {McpCatalog.subject(): "router-mcp"}, self.catalog.apply, registry=folds)
        self._state = state
        self.limiter = limiter
        self._note = note
        self._usage_put = usage_put
        self._usage_refusal = usage_refusal
        self.clock = clock
        self.instance = instance
        self.environ = environ if environ is not None else os.environ
        self.upstreams: dict[str, Upstream] = {}

    def start(self) -> None:
        self.fold.start()

    async def close(self) -> None:
        for up in list(self.upstreams.values()):
            await up.close()
        self.upstreams.clear()
        await self.fold.close()

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/mcp", self.handle)
        app.router.add_get("/mcp", self.no_stream)
        app.router.add_delete("/mcp", self.no_stream)

    async def no_stream(self, request: web.Request) -> web.Response:
        # No server-initiated stream and no session to end: the protocol's answer is 405.
        return web.Response(status=405, headers={"allow": "POST"}, text="POST JSON-RPC messages to /mcp\n")

    def _upstream(self, server: Server) -> Upstream:
        up = self.upstreams.get(server.name)
        if up is None or up.config != _config(server):
            if up is not None:
                task = asyncio.ensure_future(up.close())  # the old settings' session, closed aside
                task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)
            up = self.upstreams[server.name] = Upstream(server, self.environ)
        up.server = server
        return up

    async def handle(self, request: web.Request) -> web.Response:
        state = self._state()
        got = adm.authenticate(request.headers.get("authorization", ""), state.keys, self.clock())
        if isinstance(got, adm.Refusal):
            return _error_response(None, REFUSED, got.message, status=401, headers={"www-authenticate": "Bearer"})
        key = got
        try:
            raw = await request.content.read(MAX_BODY + 1)
        except (ValueError, ConnectionError):
            return _error_response(None, INVALID_REQUEST, "the request body could not be read")
        if len(raw) > MAX_BODY:
            return _error_response(None, INVALID_REQUEST, f"a message is at most {MAX_BODY} bytes", status=413)
        try:
            message = msgspec.json.decode(raw)
        except msgspec.DecodeError:
            return _error_response(None, PARSE_ERROR, "the body is not JSON: send one JSON-RPC 2.0 message")
        if (
            not isinstance(message, dict)
            or message.get("jsonrpc") != "2.0"
            or not isinstance(message.get("method"), str)
        ):
            if isinstance(message, dict) and "method" not in message and ("result" in message or "error" in message):
                return web.Response(status=202)  # a client's answer: the gateway asks nothing, so nothing waits for it
            return _error_response(
                message.get("id") if isinstance(message, dict) else None,
                INVALID_REQUEST,
                'send one JSON-RPC 2.0 message: {"jsonrpc": "2.0", "id": 1, "method": …}',
            )
        if "id" not in message:
            return web.Response(status=202)  # a notification (notifications/initialized, cancelled): taken
        rid, method = message["id"], message["method"]
        params = message.get("params") or {}
        if not isinstance(params, dict):
            return _error_response(rid, INVALID_PARAMS, "params must be an object")
        if method == "initialize":
            asked = params.get("protocolVersion")
            version = asked if asked in PROTOCOL_VERSIONS else PROTOCOL_VERSIONS[-1]
            return _result(
                rid,
                {
                    "protocolVersion": version,
                    "capabilities": {"tools": {"listChanged": False}},
                    "serverInfo": {"name": "llmgw", "version": _version()},
                    "instructions": "The MCP servers your project may use, their tools named SERVER__TOOL.",
                },
            )
        if method == "ping":
            return _result(rid, {})
        if method == "tools/list":
            return _result(rid, {"tools": await self._list(key)})
        if method == "tools/call":
            return await self._call(rid, params, key, len(raw), state)
        return _error_response(
            rid, METHOD_NOT_FOUND, f"{method[:80]!r} is not served here: initialize, ping, tools/list, tools/call"
        )

    async def _list(self, key: KeyInfo) -> list[dict[str, Any]]:
        shown = visible(self.catalog, key)
        servers = [self.catalog.servers[name] for name in shown]
        listed = await asyncio.gather(*(self._tools_of(s) for s in servers))
        out: list[dict[str, Any]] = []
        for s, tools in zip(servers, listed, strict=True):
            for tool in tools:
                if any(g.covers(tool["name"]) for g in shown[s.name]):
                    out.append(
                        {
                            **tool,
                            "name": f"{s.name}{P.SEPARATOR}{tool['name']}",
                            "description": f"[{s.name}] {tool.get('description') or ''}".strip(),
                        }
                    )
        return out

    async def _tools_of(self, server: Server) -> list[dict[str, Any]]:
        """A server's tools; a server that is down lists none (its calls say why), after one fresh try."""
        up = self._upstream(server)
        for attempt in (1, 2):
            try:
                session = await up.session()
                tools: list[dict[str, Any]] = []
                cursor = None
                while True:
                    from mcp_types import PaginatedRequestParams

                    page = await asyncio.wait_for(
                        session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None),
                        server.timeout_s,
                    )
                    tools += [t.model_dump(by_alias=True, exclude_none=True, mode="json") for t in page.tools]
                    cursor = page.next_cursor
                    if not cursor:
                        return tools
            except ServerDown as exc:
                log.warning("mcp server down; its tools are not listed", server=server.name, error=str(exc))
                return []
            except Exception as exc:  # a dead session: one fresh try
                up.dead()
                if attempt == 2:
                    log.warning("mcp server's tools could not be listed", server=server.name, error=_reason(exc))
        return []

    async def _call(
        self, rid: Any, params: dict[str, Any], key: KeyInfo, bytes_in: int, state: RouterState
    ) -> web.Response:
        started, at = time.monotonic(), datetime.fromtimestamp(self.clock(), UTC)
        name, arguments = params.get("name"), params.get("arguments") or {}
        if not isinstance(name, str) or not isinstance(arguments, dict):
            return _error_response(
                rid, INVALID_PARAMS, "tools/call needs params.name (a string) and params.arguments (an object)"
            )
        project = state.tree.label(f"project:{key.project_id}").removeprefix("project:")
        server, _, tool = name.partition(P.SEPARATOR)
        scopes = state.scopes_of(key)

        def record(status: int, outcome: str, response: web.Response, error: str | None = None) -> web.Response:
            body = response.body if isinstance(response.body, bytes) else b""
            self._record(key, scopes, at, started, name, server, tool, status, outcome, bytes_in, len(body), error)
            return response

        usage_refusal = self._usage_refusal()
        if usage_refusal is not None:
            # Nothing is served that cannot be billed: no record either (it could not be kept).
            return _error_response(rid, REFUSED, usage_refusal, status=503, headers={"retry-after": "10"})
        why = refusal_of(self.catalog, name, key, project)
        if why is not None:
            return record(403, "not_allowed", _error_response(rid, INVALID_PARAMS, why), why)
        now = self.clock()
        levels = adm.limit_levels(scopes, state.limits)
        within = adm.within_limits(self.limiter, levels, now, 0)
        if isinstance(within, adm.Refusal):
            labelled = within.message
            for scope in scopes:
                labelled = labelled.replace(scope, state.scope_label(scope, key), 1)
            response = _error_response(
                rid,
                REFUSED,
                labelled,
                headers=dict(within.headers),
                data={"retry_after_s": within.headers.get("retry-after")},
            )
            return record(429, "rate_limited", response, labelled)
        if within.levels:
            self.limiter.admit(within.levels, now)
            self._note(within.levels, 1, 0)
        s = self.catalog.servers[server]
        up = self._upstream(s)
        try:
            session = await up.session()
            result = await asyncio.wait_for(session.call_tool(tool, arguments), s.timeout_s)
        except ServerDown as exc:
            return record(502, "server_down", _tool_error(rid, str(exc)), str(exc))
        except TimeoutError:
            up.dead()  # a session that holds a call past its time may hold the next ones too
            why = (
                f"MCP server {server} did not answer {tool!r} within {s.timeout_s:g} s; try again, or ask a "
                f"cluster admin to raise its timeout (`llmgw ctl mcp add {server} … --timeout S`)"
            )
            return record(504, "timeout", _tool_error(rid, why), why)
        except Exception as exc:
            from mcp.shared.exceptions import MCPError

            if isinstance(exc, MCPError) and exc.code != CONNECTION_CLOSED:  # the server answered, with an error
                why = f"MCP server {server} refused {tool!r}: {exc.message[:500]}"
                return record(502, "server_error", _tool_error(rid, why), why)
            up.dead()
            why = (
                f"MCP server {server} ({s.where}) failed during {tool!r}: {_reason(exc)}; "
                "its session is opened again at the next call"
            )
            return record(502, "server_down", _tool_error(rid, why), why)
        body = result.model_dump(by_alias=True, exclude_none=True, mode="json")
        outcome = "tool_error" if body.get("isError") else "ok"
        return record(200, outcome, _result(rid, body))

    def _record(
        self,
        key: KeyInfo,
        scopes: list[str],
        at: datetime,
        started: float,
        name: str,
        server: str,
        tool: str,
        status: int,
        outcome: str,
        bytes_in: int,
        bytes_out: int,
        error: str | None,
    ) -> None:
        team = next((s.split(":", 1)[1] for s in scopes if s.startswith("team:")), None)
        org = next((s.split(":", 1)[1] for s in scopes if s.startswith("org:")), None)
        total = time.monotonic() - started
        record = UsageRecord(
            request_id=new_id(),
            at=at,
            status=status,
            key_id=key.id,
            project_id=key.project_id,
            team_id=team,
            org_id=org,
            user=key.user,
            model_asked=name[:200],
            endpoint="/mcp",
            total_s=round(total, 6),
            error=error[:1000] if error else None,
            router=self.instance,
            tool_call=ToolCall(
                server=server[:64], tool=tool[:128], bytes_in=bytes_in, bytes_out=bytes_out, outcome=outcome
            ),
        )
        self._usage_put(record)
        log.info(
            "mcp tool call",
            request_id=record.request_id,
            key=key.prefix,
            project=key.project_id,
            server=server,
            tool=tool,
            status=status,
            outcome=outcome,
            total_s=record.total_s,
            bytes_in=bytes_in,
            bytes_out=bytes_out,
        )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("llmgw")
    except PackageNotFoundError:  # pragma: no cover - a source tree not installed
        return "0"


def _result(rid: Any, result: dict[str, Any]) -> web.Response:
    return web.Response(
        body=msgspec.json.encode({"jsonrpc": "2.0", "id": rid, "result": result}), content_type="application/json"
    )


def _tool_error(rid: Any, text: str) -> web.Response:
    """A tool's failure as MCP answers it (``isError``): the client (and its model) reads why."""
    return _result(rid, {"content": [{"type": "text", "text": text}], "isError": True})


def _error_response(
    rid: Any,
    code: int,
    message: str,
    *,
    status: int = 200,
    headers: dict[str, str] | None = None,
    data: Any = None,
) -> web.Response:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return web.Response(
        status=status,
        body=msgspec.json.encode({"jsonrpc": "2.0", "id": rid, "error": error}),
        content_type="application/json",
        headers=headers,
    )
