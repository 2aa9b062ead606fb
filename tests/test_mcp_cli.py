"""`llmgw ctl mcp add|list|allow|disallow|remove` end to end: the CLI as a subprocess, signed with the
tester's token, against the mcp service and the admin API on a real nats-server."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import tenancy as T
from tests.fleet import Fleet
from tests.support import NatsServer, wait_until

pytestmark = [pytest.mark.timeout(180)]

LLMGW = str(Path(sys.executable).parent / "llmgw")


@pytest.fixture
async def fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=("tenancy", "people", "mcp", "projections", "api"))
    for kind, path in (("org", "acme"), ("team", "acme/ml"), ("project", "acme/ml/chat")):
        await f.command("create", T.CreateScope(kind=kind, path=path), service=T.SERVICE)
    yield f
    await f.stop()


async def llmgw(fleet: Fleet, *args: str) -> subprocess.CompletedProcess[str]:
    env = fleet.cli_env(LLMGW_NATS_URL=fleet.nats_url, LLMGW_API_URL=fleet.admin_url)
    return await asyncio.to_thread(subprocess.run, [LLMGW, *args], capture_output=True, text=True, env=env, timeout=60)


async def listed(fleet: Fleet, until: object) -> list[dict]:
    async def attempt() -> list[dict] | None:
        done = await llmgw(fleet, "ctl", "mcp", "list", "--json")
        assert done.returncode == 0, done.stderr
        found = json.loads(done.stdout)
        return found if until(found) else None  # type: ignore[operator]

    return await wait_until(attempt, what="`llmgw ctl mcp list` to show the change")


async def test_a_server_added_allowed_and_removed_with_the_cli_is_listed_with_its_header_variable_never_a_value(
    fleet: Fleet,
) -> None:
    added = await llmgw(
        fleet,
        *("ctl", "mcp", "add", "github", "--url", "https://mcp.example.com/mcp"),
        *("--header", "Authorization=env:GITHUB_MCP_TOKEN"),
    )
    assert added.returncode == 0, added.stderr
    assert "MCP server github (https://mcp.example.com/mcp) added" in added.stdout
    stdio = await llmgw(fleet, "ctl", "mcp", "add", "time", "--command", "uvx mcp-server-time --local-timezone UTC")
    assert stdio.returncode == 0, stdio.stderr
    allowed = await llmgw(
        fleet, "ctl", "mcp", "allow", "time", "--project", "acme/ml/chat", "--tool", "get_current_time"
    )
    assert allowed.returncode == 0, allowed.stderr
    assert "project acme/ml/chat may use tool(s) get_current_time of MCP server time" in allowed.stdout

    found = await listed(fleet, lambda f: len(f) == 2 and f[1]["grants"])
    github, time_ = found
    assert github["headers"] == [{"name": "Authorization", "env": "GITHUB_MCP_TOKEN"}]
    assert time_["command"] == ["uvx", "mcp-server-time", "--local-timezone", "UTC"]
    assert time_["grants"][0]["project"] == "acme/ml/chat" and time_["grants"][0]["tools"] == ["get_current_time"]
    table = await llmgw(fleet, "ctl", "mcp", "list")
    assert "Authorization=env:GITHUB_MCP_TOKEN" in table.stdout and "acme/ml/chat: get_current_time" in table.stdout

    refused = await llmgw(fleet, "ctl", "mcp", "allow", "nope", "--project", "acme/ml/chat")
    assert refused.returncode != 0 and "there is no MCP server 'nope'" in refused.stderr
    literal = await llmgw(fleet, "ctl", "mcp", "add", "x", "--url", "https://a/mcp", "--header", "Authorization=abc")
    assert literal.returncode != 0 and "NAME=env:VARIABLE" in literal.stderr

    withdrawn = await llmgw(fleet, "ctl", "mcp", "disallow", "time", "--project", "acme/ml/chat")
    assert withdrawn.returncode == 0 and "may no longer use MCP server time" in withdrawn.stdout
    removed = await llmgw(fleet, "ctl", "mcp", "remove", "github")
    assert removed.returncode == 0, removed.stderr
    found = await listed(fleet, lambda f: len(f) == 1 and not f[0]["grants"])
    assert found[0]["name"] == "time"
