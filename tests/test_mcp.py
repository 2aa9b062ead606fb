"""MCP servers behind the gateway (issue 26): the `mcp` SDK's client against `/mcp`, in front of
`mcp-server-time` (a stdio server the router runs) and a server written with the SDK over streamable HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from mcp.client.session import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError

from llmgw.events.commands.client import CommandClient
from llmgw.events.folds.mcp import McpCatalog
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import access as A
from llmgw.events.schema import mcp as P
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject
from llmgw.events.schema.usage import UsageRecord
from llmgw.services.mcp import rules
from llmgw.services.mcp.service import McpService
from llmgw.services.router.app import Router, RouterConfig
from llmgw.services.router.mcp import refusal_of, split_name
from llmgw.services.router.state import KeyInfo
from tests.mcp.notes_server import TOKEN
from tests.support import free_port, stop_process, usage_records, wait_for_port, wait_until

pytestmark = [pytest.mark.timeout(180)]

PROJECT, OTHER = "p-chat", "p-other"
ROOT = Path(__file__).resolve().parent.parent


# -- the decisions, pure ---------------------------------------------------------------------------


def _recorded(seq: int, payload: msgspec.Struct, subject: str) -> RecordedEvent:
    env = Envelope(id=f"e{seq}", type="x", v=1, at=datetime(2026, 1, 1, tzinfo=UTC), actor="user:test")
    return RecordedEvent(envelope=env, payload=payload, subject=subject, seq=seq)


def _state(*payloads: msgspec.Struct) -> rules.McpState:
    state = rules.McpState()
    tree = event_subject(T.AGGREGATE, T.TREE_ID)
    base = [
        (T.OrgCreated(org_id="o-acme", name="acme"), tree),
        (T.TeamCreated(team_id="t-ml", org_id="o-acme", name="ml"), tree),
        (T.ProjectCreated(project_id=PROJECT, team_id="t-ml", name="chat"), tree),
        (T.ProjectCreated(project_id=OTHER, team_id="t-ml", name="other"), tree),
        (
            A.KeyCreated(key_id="key_aaaa", prefix="aaaaaaaa", secret_sha256="0" * 64, project_id=PROJECT),
            event_subject(A.KEY_AGGREGATE, "key_aaaa"),
        ),
    ]
    for i, (p, subject) in enumerate([*base, *((p, event_subject(P.AGGREGATE, "x")) for p in payloads)], 1):
        state.apply(_recorded(i, p, subject))
    return state


def _decide(state: rules.McpState, command: P.McpCommand) -> list[msgspec.Struct]:
    decision = rules.decide(state, command, datetime(2026, 1, 1, tzinfo=UTC))
    for i, p in enumerate(decision.payloads, 1000):
        state.apply(_recorded(i, p, decision.subject))
    return decision.payloads


def _refused(state: rules.McpState, command: P.McpCommand) -> Rejected:
    with pytest.raises(Rejected) as caught:
        rules.decide(state, command, datetime(2026, 1, 1, tzinfo=UTC))
    return caught.value


def _key(key_id: str = "key_aaaa", project: str = PROJECT) -> KeyInfo:
    return KeyInfo(id=key_id, prefix="aaaaaaaa", secret_sha256="0" * 64, project_id=project)


def test_a_server_is_kept_with_the_names_of_its_header_variables_never_their_values() -> None:
    state = _state()
    header = P.Header(name="Authorization", env="GITHUB_MCP_TOKEN")
    [event] = _decide(state, P.AddServer(name="github", url="https://mcp.example.com/mcp", headers=(header,)))
    assert isinstance(event, P.ServerSet) and event.headers == (header,)
    assert b"GITHUB_MCP_TOKEN" in msgspec.json.encode(event)
    why = _refused(state, P.AddServer(name="leaky", url="https://user:pw@mcp.example.com/mcp"))
    assert "--header NAME=env:VARIABLE" in why.reason
    why = _refused(state, P.AddServer(name="x", url="https://a/mcp", headers=(P.Header(name="A", env="not a var"),)))
    assert "NAME=env:VARIABLE" in why.reason


def test_a_server_is_reached_by_a_url_or_a_command_and_named_so_its_tools_split_back() -> None:
    state = _state()
    assert "one of them" in _refused(state, P.AddServer(name="both", url="https://a/mcp", command=("x",))).reason
    assert "one of them" in _refused(state, P.AddServer(name="none")).reason
    assert "NAME__TOOL" in _refused(state, P.AddServer(name="my_time", command=("x",))).reason
    _decide(state, P.AddServer(name="time", command=("uvx", "mcp-server-time")))
    assert split_name("time__get_current_time") == ("time", "get_current_time")
    assert split_name("time__convert__time") == ("time", "convert__time")
    assert split_name("get_current_time") is None


def test_allowing_tools_adds_them_to_the_grant_and_disallowing_takes_them_away() -> None:
    state = _state(P.ServerSet(name="time", command=("t",)))
    _decide(state, P.Allow(server="time", project="acme/ml/chat", tools=("get_current_time",)))
    _decide(state, P.Allow(server="time", project="acme/ml/chat", tools=("convert_time",)))
    grant = state.catalog.servers["time"].grants[(PROJECT, "")]
    assert grant.tools == ("get_current_time", "convert_time")
    _decide(state, P.Disallow(server="time", project="acme/ml/chat", tools=("convert_time",)))
    assert state.catalog.servers["time"].grants[(PROJECT, "")].tools == ("get_current_time",)
    _decide(state, P.Disallow(server="time", project="acme/ml/chat"))
    assert state.catalog.servers["time"].grants == {}
    assert "no project" in _refused(state, P.Allow(server="time", project="acme/ml/nope")).reason
    assert "no live key" in _refused(state, P.Allow(server="time", project="acme/ml/other", key="key_aaaa")).reason


def test_a_key_is_allowed_by_its_projects_grant_or_its_own_and_a_refusal_names_the_allow_list() -> None:
    state = _state(P.ServerSet(name="time", command=("t",)))
    catalog: McpCatalog = state.catalog
    _decide(state, P.Allow(server="time", project="acme/ml/chat", tools=("get_current_time",)))
    _decide(state, P.Allow(server="time", project="acme/ml/chat", key="llmgw-aaaaaaaa", tools=("convert_time",)))
    assert refusal_of(catalog, "time__get_current_time", _key(), "acme/ml/chat") is None
    assert refusal_of(catalog, "time__convert_time", _key(), "acme/ml/chat") is None
    other_key = _key("key_bbbb")
    why = refusal_of(catalog, "time__convert_time", other_key, "acme/ml/chat")
    assert why is not None
    assert "project acme/ml/chat: get_current_time" in why
    assert "`llmgw ctl mcp allow time --project acme/ml/chat --tool convert_time`" in why
    why = refusal_of(catalog, "time__get_current_time", _key(project=OTHER), "acme/ml/other")
    assert why is not None and "its allow-list there is none" in why


def test_servers_are_the_cluster_admins_and_grants_a_projects_team_admins() -> None:
    assert rules.need(P.AddServer(name="time", command=("t",))).role == "cluster-admin"
    need = rules.need(P.Allow(server="time", project="acme/ml/chat"))
    assert (need.role, need.kind, need.tenant) == ("team-admin", "project", "acme/ml/chat")


# -- end to end: the SDK's client against /mcp -----------------------------------------------------


class Gateway(msgspec.Struct):
    url: str
    key: str
    other_key: str
    limited_key: str
    router: Any
    send: Any


@pytest.fixture
def notes_server() -> Iterator[str]:
    """The SDK-written server, over streamable HTTP on a free port."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.mcp.notes_server", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, 30.0, proc)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        stop_process(proc)


async def _append(store: EventStore, aggregate: str, agg_id: str, *payloads: msgspec.Struct) -> None:
    await store.append(event_subject(aggregate, agg_id), [NewEvent(payload=p, actor="user:test") for p in payloads])


async def _make_key(store: EventStore, project: str, **fields: Any) -> str:
    key, prefix, digest = A.make_api_key()
    created = A.KeyCreated(
        key_id=f"key_{prefix}", prefix=prefix, secret_sha256=digest, project_id=project, name="t", **fields
    )
    await _append(store, A.KEY_AGGREGATE, f"key_{prefix}", created)
    return key


@pytest.fixture
async def gateway(store: EventStore, notes_server: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gateway]:
    monkeypatch.setenv("NOTES_TOKEN", TOKEN)  # the routers' environment: the value never reaches the log
    await _append(
        store,
        T.AGGREGATE,
        T.TREE_ID,
        T.OrgCreated(org_id="o-acme", name="acme"),
        T.TeamCreated(team_id="t-ml", org_id="o-acme", name="ml"),
        T.ProjectCreated(project_id=PROJECT, team_id="t-ml", name="chat"),
        T.ProjectCreated(project_id=OTHER, team_id="t-ml", name="other"),
    )
    key = await _make_key(store, PROJECT)
    other_key = await _make_key(store, OTHER)
    limited_key = await _make_key(store, PROJECT, rpm=2)
    service = McpService(store)
    processor = service.processor()
    task = asyncio.create_task(processor.run())
    client = CommandClient.for_service(store, "tests")

    async def send(command: P.McpCommand) -> str:
        verb = {P.AddServer: "add", P.RemoveServer: "remove", P.Allow: "allow", P.Disallow: "disallow"}[type(command)]
        out = await client.send(P.SERVICE, f"mcp.{verb}", command, actor="user:admin")
        return out.message

    await send(P.AddServer(name="time", command=(sys.executable, "-m", "mcp_server_time", "--local-timezone", "UTC")))
    await send(
        P.AddServer(name="notes", url=notes_server, headers=(P.Header(name="X-Notes-Token", env="NOTES_TOKEN"),))
    )
    await send(P.Allow(server="time", project="acme/ml/chat"))
    await send(P.Allow(server="notes", project="acme/ml/chat", tools=("echo", "slow")))
    router = Router(store, RouterConfig())
    await router.start()
    runner = web.AppRunner(router.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    servers = router.mcp.catalog.servers
    await wait_until(
        lambda: "time" in servers and servers.get("notes") and servers["notes"].grants,
        what="the router to read the servers",
    )
    last = await store.stream_last_seq()
    await wait_until(lambda: router.state.position >= last, what="the router to read the keys")
    try:
        yield Gateway(
            url=f"http://127.0.0.1:{port}/mcp",
            key=key,
            other_key=other_key,
            limited_key=limited_key,
            router=router,
            send=send,
        )
    finally:
        await runner.cleanup()
        await router.stop()
        processor.stop()
        await asyncio.wait_for(task, 10)


@contextlib.asynccontextmanager
async def mcp_client(url: str, key: str) -> AsyncIterator[ClientSession]:
    import httpx2

    async with (
        httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=60.0) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


def _text(result: Any) -> str:
    return "".join(getattr(c, "text", "") for c in result.content)


async def test_the_sdk_client_lists_the_tools_a_projects_grants_reach_namespaced_by_server(gateway: Gateway) -> None:
    async with mcp_client(gateway.url, gateway.key) as session:
        names = {t.name for t in (await session.list_tools()).tools}
    assert {"time__get_current_time", "time__convert_time", "notes__echo", "notes__slow"} <= names
    assert "notes__shout" not in names  # not in the project's allow-list on notes
    async with mcp_client(gateway.url, gateway.other_key) as session:
        assert (await session.list_tools()).tools == []


async def test_a_call_is_answered_by_the_stdio_server_and_by_the_http_server_with_its_header_from_the_environment(
    gateway: Gateway, store: EventStore
) -> None:
    async with mcp_client(gateway.url, gateway.key) as session:
        now = await session.call_tool("time__get_current_time", {"timezone": "UTC"})
        echoed = await session.call_tool("notes__echo", {"text": "hi"})
    assert not now.is_error and '"timezone": "UTC"' in _text(now).replace("'", '"')
    assert not echoed.is_error and _text(echoed) == "echo: hi"
    log = b"".join(msgspec.json.encode(e.payload) for e in await store.read(event_subject(P.AGGREGATE, "notes")))
    assert b"NOTES_TOKEN" in log and TOKEN.encode() not in log


async def test_a_key_whose_project_is_not_allowed_a_tool_is_refused_with_the_allow_list_named(
    gateway: Gateway,
) -> None:
    async with mcp_client(gateway.url, gateway.key) as session:
        with pytest.raises(MCPError) as caught:
            await session.call_tool("notes__shout", {"text": "hi"})
    assert "its allow-list there is project acme/ml/chat: echo, slow" in caught.value.message
    assert "`llmgw ctl mcp allow notes --project acme/ml/chat --tool shout`" in caught.value.message
    async with mcp_client(gateway.url, gateway.other_key) as session:
        with pytest.raises(MCPError) as caught:
            await session.call_tool("time__get_current_time", {"timezone": "UTC"})
    assert "its allow-list there is none" in caught.value.message


async def test_a_server_that_is_down_or_too_slow_answers_a_tool_error_that_says_so(
    gateway: Gateway, store: EventStore
) -> None:
    await gateway.send(P.AddServer(name="gone", url=f"http://127.0.0.1:{free_port()}/mcp"))
    await gateway.send(P.Allow(server="gone", project="acme/ml/chat"))
    await gateway.send(
        P.AddServer(
            name="notes",
            url=gateway.router.mcp.catalog.servers["notes"].url,
            headers=(P.Header(name="X-Notes-Token", env="NOTES_TOKEN"),),
            timeout_s=1.0,
        )
    )
    servers = gateway.router.mcp.catalog.servers
    await wait_until(
        lambda: servers.get("gone") and servers["gone"].grants and servers["notes"].timeout_s == 1.0,
        what="the router to read the changes",
    )
    async with mcp_client(gateway.url, gateway.key) as session:
        down = await session.call_tool("gone__anything", {})
        slow = await session.call_tool("notes__slow", {"seconds": 30})
        after = await session.call_tool("notes__echo", {"text": "still here"})
    assert down.is_error and "MCP server gone" in _text(down) and "could not be reached" in _text(down)
    assert slow.is_error and "did not answer 'slow' within 1 s" in _text(slow)
    assert not after.is_error and _text(after) == "echo: still here"  # its session opened again


async def test_every_call_is_a_usage_record_with_server_tool_duration_bytes_and_outcome(
    gateway: Gateway, store: EventStore
) -> None:
    async with mcp_client(gateway.url, gateway.key) as session:
        await session.call_tool("notes__echo", {"text": "hi"})
        with pytest.raises(MCPError):
            await session.call_tool("notes__shout", {"text": "hi"})

    def calls(records: list[UsageRecord]) -> list[UsageRecord]:
        return [r for r in records if r.endpoint == "/mcp"]

    records = await wait_until(
        lambda: _at_least(store, 2, calls), what="the two tool calls' usage records", deadline_s=30
    )
    by_tool = {r.tool_call.tool: r for r in records if r.tool_call}
    ok, refused = by_tool["echo"], by_tool["shout"]
    assert ok.tool_call is not None and refused.tool_call is not None
    assert (ok.tool_call.server, ok.tool_call.outcome, ok.status) == ("notes", "ok", 200)
    assert ok.tool_call.bytes_in > 0 and ok.tool_call.bytes_out > 0 and ok.total_s > 0
    assert ok.project_id == PROJECT and ok.model_asked == "notes__echo"
    assert (refused.tool_call.outcome, refused.status) == ("not_allowed", 403)
    assert refused.error is not None and "allow-list" in refused.error


async def _at_least(store: EventStore, n: int, pick: Any) -> list[UsageRecord] | None:
    found = pick(await usage_records(store, PROJECT))
    return found if len(found) >= n else None


async def test_tool_calls_count_against_the_keys_rate_limit_and_the_refusal_says_when_to_retry(
    gateway: Gateway,
) -> None:
    async with mcp_client(gateway.url, gateway.limited_key) as session:
        for _ in range(2):
            assert not (await session.call_tool("notes__echo", {"text": "hi"})).is_error
        with pytest.raises(MCPError) as caught:
            await session.call_tool("notes__echo", {"text": "hi"})
    assert "is at its limit of 2 requests per minute; retry in" in caught.value.message
    assert "key:llmgw-" in caught.value.message


async def test_a_request_without_a_gateway_key_is_refused_before_any_server_is_asked(gateway: Gateway) -> None:
    import httpx2

    async with httpx2.AsyncClient() as http:
        answer = await http.post(
            gateway.url,
            json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
            headers={"accept": "application/json, text/event-stream"},
        )
        garbage = await http.post(gateway.url, content=b"{not json", headers={"authorization": f"Bearer {gateway.key}"})
    assert answer.status_code == 401 and answer.json()["error"]["code"] == -32001
    assert garbage.status_code == 200 and garbage.json()["error"]["code"] == -32700


def _time_servers() -> set[int]:
    """The pids of this process's children running mcp-server-time (the router's stdio server)."""
    found = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            cmdline = (proc / "cmdline").read_bytes()
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            if b"mcp_server_time" in cmdline and ppid == os.getpid():
                found.add(int(proc.name))
    return found


async def test_a_stdio_server_that_died_is_started_again_and_the_call_it_missed_says_so(gateway: Gateway) -> None:
    async with mcp_client(gateway.url, gateway.key) as session:
        assert not (await session.call_tool("time__get_current_time", {"timezone": "UTC"})).is_error
        [first] = _time_servers()
        os.kill(first, signal.SIGKILL)
        await wait_until(lambda: first not in _time_servers(), what="the killed time server to be gone")
        missed = await session.call_tool("time__get_current_time", {"timezone": "UTC"})
        again = await session.call_tool("time__get_current_time", {"timezone": "UTC"})
    assert missed.is_error and "MCP server time" in _text(missed) and "opened again at the next call" in _text(missed)
    assert not again.is_error and '"timezone": "UTC"' in _text(again).replace("'", '"')
    assert _time_servers() and first not in _time_servers()


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"[]", -32600),  # a batch: not taken since 2025-06-18
        (b'"text"', -32600),
        (b'{"jsonrpc": "1.0", "id": 1, "method": "ping"}', -32600),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "resources/list"}', -32601),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": []}', -32602),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": 7}}', -32602),
        (b'{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "x", "arguments": 1}}', -32602),
        (b'{"jsonrpc": "2.0", "id": {"a": 1}, "method": "tools/call", "params": {"name": "nosuch__x"}}', -32602),
    ],
)
async def test_a_malformed_message_is_answered_with_its_json_rpc_error_never_a_500(
    gateway: Gateway, body: bytes, code: int
) -> None:
    import httpx2

    async with httpx2.AsyncClient() as http:
        answer = await http.post(
            gateway.url,
            content=body,
            headers={"authorization": f"Bearer {gateway.key}", "content-type": "application/json"},
        )
    assert answer.status_code == 200 and answer.json()["error"]["code"] == code


async def test_the_sdks_high_level_client_in_its_default_mode_falls_back_to_the_handshake_and_calls_a_tool(
    gateway: Gateway,
) -> None:
    import httpx2
    from mcp.client.client import Client

    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {gateway.key}"}, timeout=60.0) as http:
        async with Client(streamable_http_client(gateway.url, http_client=http)) as client:  # mode "auto"
            names = {t.name for t in (await client.list_tools()).tools}
            echoed = await client.call_tool("notes__echo", {"text": "auto"})
    assert "notes__echo" in names and not echoed.is_error and _text(echoed) == "echo: auto"
