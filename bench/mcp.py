"""An MCP tool call through the gateway's ``/mcp`` against the same call made to the server directly.

``.venv/bin/python -m llmgw.bench.mcp [--rounds 6] [--per-round 100]``

One MCP server written with the SDK (streamable HTTP, a tool that says its text back) runs in a process
of its own; a router runs in this one, on a nats-server of the bench's own, with a key whose project
may use the server. Two SDK client sessions stay open, one to the server, one to ``/mcp``; rounds
alternate between them (so both see the same machine), and each figure is the median of the rounds'
medians of one call's latency. The ratio is taken within the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

from llmgw.bench.backbone import nats_server
from llmgw.events.folds.mcp import McpCatalog
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import access as A
from llmgw.events.schema import mcp as P
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.subjects import event_subject

SERVER = """
import sys
from mcp.server.mcpserver import MCPServer
server = MCPServer("bench", log_level="WARNING")

@server.tool()
def echo(text: str) -> str:
    return text

server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
"""


class McpBenchResult(msgspec.Struct, kw_only=True):
    rounds: int
    per_round: int
    direct_ms: list[float]  # each round's median, straight to the server
    gateway_ms: list[float]  # each round's median, through /mcp

    @property
    def ratio(self) -> float:
        return statistics.median(self.gateway_ms) / statistics.median(self.direct_ms)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", SERVER, str(port)], stderr=subprocess.DEVNULL)


def _stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
    if proc.poll() is None:
        proc.kill()


async def _wait_port(port: int, proc: subprocess.Popen, deadline_s: float = 30.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the bench's MCP server exited ({proc.returncode}) before listening on {port}")
        with contextlib.suppress(OSError):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        await asyncio.sleep(0.05)
    raise SystemExit(f"the bench's MCP server did not listen on {port} within {deadline_s:.0f} s")


@contextlib.asynccontextmanager
async def _session(url: str, key: str | None = None) -> AsyncIterator[Any]:
    import httpx2
    from mcp.client.session import ClientSession
    from mcp.client.streamable_http import streamable_http_client

    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with (
        httpx2.AsyncClient(headers=headers, timeout=60.0) as http,
        streamable_http_client(url, http_client=http) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


async def _round(session: Any, tool: str, n: int) -> float:
    times = []
    for i in range(n):
        started = time.perf_counter()
        result = await session.call_tool(tool, {"text": f"call {i}"})
        times.append((time.perf_counter() - started) * 1000)
        if result.is_error:
            raise SystemExit(f"the call of {tool} failed: {result.content}")
    return statistics.median(times)


async def run(rounds: int, per_round: int) -> McpBenchResult:
    from aiohttp import web

    from llmgw.services.router.app import Router, RouterConfig

    with tempfile.TemporaryDirectory() as tmp, nats_server(Path(tmp) / "nats", durable=True) as nats:
        port = _free_port()
        proc = _start_server(port)
        store = await EventStore.connect(nats.url, default_registry())
        runner: web.AppRunner | None = None
        router: Router | None = None
        try:
            await store.ensure_streams()
            await _wait_port(port, proc)
            url = f"http://127.0.0.1:{port}/mcp"
            tree = event_subject(T.AGGREGATE, T.TREE_ID)
            await store.append(
                tree,
                [
                    NewEvent(payload=T.OrgCreated(org_id="o-b", name="bench"), actor="user:bench"),
                    NewEvent(payload=T.TeamCreated(team_id="t-b", org_id="o-b", name="ml"), actor="user:bench"),
                    NewEvent(
                        payload=T.ProjectCreated(project_id="p-b", team_id="t-b", name="chat"), actor="user:bench"
                    ),
                ],
            )
            key, prefix, digest = A.make_api_key()
            created = A.KeyCreated(key_id=f"key_{prefix}", prefix=prefix, secret_sha256=digest, project_id="p-b")
            await store.append(
                event_subject(A.KEY_AGGREGATE, created.key_id), [NewEvent(payload=created, actor="user:bench")]
            )
            await store.append(
                event_subject(P.AGGREGATE, "bench"),
                [
                    NewEvent(payload=P.ServerSet(name="bench", url=url), actor="user:bench"),
                    NewEvent(payload=P.Allowed(server="bench", project_id="p-b"), actor="user:bench"),
                ],
            )
            router = Router(store, RouterConfig())
            await router.start()
            runner = web.AppRunner(router.app())
            await runner.setup()
            gw_port = _free_port()
            await web.TCPSite(runner, "127.0.0.1", gw_port).start()
            catalog: McpCatalog = router.mcp.catalog
            end = time.monotonic() + 30
            while not (
                catalog.servers.get("bench") and catalog.servers["bench"].grants and prefix in router.state.keys
            ):
                if time.monotonic() > end:
                    raise SystemExit("the router did not read the bench's server and key within 30 s")
                await asyncio.sleep(0.05)
            direct_ms: list[float] = []
            gateway_ms: list[float] = []
            async with _session(url) as direct, _session(f"http://127.0.0.1:{gw_port}/mcp", key) as gateway:
                await _round(direct, "echo", 10)  # warm both: sessions, connections, the router's own session
                await _round(gateway, "bench__echo", 10)
                for _ in range(rounds):
                    direct_ms.append(await _round(direct, "echo", per_round))
                    gateway_ms.append(await _round(gateway, "bench__echo", per_round))
            return McpBenchResult(rounds=rounds, per_round=per_round, direct_ms=direct_ms, gateway_ms=gateway_ms)
        finally:
            if runner is not None:
                await runner.cleanup()
            if router is not None:
                await router.stop()
            await store.close()
            _stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--per-round", type=int, default=100)
    args = parser.parse_args()
    result = asyncio.run(run(args.rounds, args.per_round))
    direct, gateway = statistics.median(result.direct_ms), statistics.median(result.gateway_ms)
    print(f"direct:  {direct:.2f} ms per call (rounds: {' '.join(f'{x:.2f}' for x in result.direct_ms)})")
    print(f"gateway: {gateway:.2f} ms per call (rounds: {' '.join(f'{x:.2f}' for x in result.gateway_ms)})")
    print(f"ratio:   {result.ratio:.2f}x  (added: {gateway - direct:.2f} ms)")


if __name__ == "__main__":
    main()
