"""The cluster as it was at a moment (SPEC EVT-2): `GET /api/v1/replay` and `llmgw events replay`."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmgw.events import access as A
from llmgw.events import models as M
from llmgw.events import nodes as N
from llmgw.events import tenancy as T
from llmgw.events.envelope import utc_now
from llmgw.events.store import EventStore
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, wait_until

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

LLMGW = str(Path(sys.executable).parent / "llmgw")
SERVICES = ("tenancy", "access", "catalog", "fleet", "scheduler", "projections", "api")


@pytest.fixture
async def tenants_fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    """conftest's fleet plus the tenancy and access services (keys and the tree are replayed too)."""
    f = await Fleet(store, nats.url, tmp_path).start(services=SERVICES)
    try:
        yield f
    finally:
        await f.stop()


async def replay(fleet: Fleet, until: str) -> tuple[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{fleet.admin_port}/api/v1/replay"
    async with aiohttp.ClientSession(headers=fleet.api_headers()) as s, s.get(url, params={"until": until}) as r:
        return r.status, await r.json()


async def test_the_cluster_is_shown_as_it_was_before_later_changes(tenants_fleet: Fleet, tmp_path: Path) -> None:
    fleet = tenants_fleet
    for kind, path in (("org", "acme"), ("team", "acme/ml"), ("project", "acme/ml/chat")):
        await fleet.command("create", T.CreateScope(kind=kind, path=path), service=T.SERVICE)
    _, prefix, digest = A.make_api_key()
    await fleet.command(
        "key.create", A.CreateKey(project="acme/ml/chat", prefix=prefix, secret_sha256=digest, name="ci"), A.SERVICE
    )
    fleet.agent("n1")
    await fleet.add_model("tiny", write_tiny_gguf(tmp_path / "tiny.gguf"))
    [replica] = await fleet.wait_ready("tiny", 1)
    then = utc_now()

    # Later: the key is revoked, the node cordoned, the model removed.
    await fleet.command("key.revoke", A.RevokeKey(key=prefix, reason="leaked"), A.SERVICE)
    await fleet.command("cordon", N.CordonNode(node_id="n1", reason="maintenance"), N.SERVICE)
    await fleet.command("remove", M.RemoveModel(name="tiny"))
    await wait_until(lambda: _stopped(fleet, replica["id"]), deadline_s=60, what="the replica to stop")

    status, past = await replay(fleet, then.isoformat())
    assert status == 200, past
    assert [(m["name"], m["ready"], m["status"]) for m in past["models"]] == [("tiny", 1, "serving")]
    assert [(r["id"], r["node_id"], r["state"]) for r in past["replicas"]] == [(replica["id"], "n1", "ready")]
    assert [(n["id"], n["state"], n["cordoned"], n["replicas"]) for n in past["nodes"]] == [("n1", "ready", 0, 1)]
    assert [(k["prefix"], k["project"], k["name"], k["state"]) for k in past["keys"]] == [
        (prefix, "acme/ml/chat", "ci", "active")
    ]
    assert [s["path"] for s in past["scopes"]] == ["acme", "acme/ml", "acme/ml/chat"]
    assert 0 < past["position"] and past["last_event_at"] <= then.isoformat()

    status, now = await replay(fleet, utc_now().isoformat())
    assert status == 200
    assert now["models"] == [] and now["replicas"] == []
    assert [(n["id"], n["cordoned"]) for n in now["nodes"]] == [("n1", 1)]
    assert [k["state"] for k in now["keys"]] == ["revoked"]
    assert now["position"] > past["position"]

    status, before = await replay(fleet, (then - timedelta(days=1)).isoformat())
    assert status == 200 and before["position"] == 0 and before["nodes"] == before["models"] == before["keys"] == []

    # The CLI prints the same moment.
    proc = await asyncio.create_subprocess_exec(
        LLMGW, "--nats", fleet.nats_url, "--api", f"http://127.0.0.1:{fleet.admin_port}",
        "events", "replay", "--until", then.isoformat(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=fleet.cli_env(),
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 0, err.decode()
    assert "tiny" in text and "1/1 ready" in text and "serving" in text and f"{prefix}" in text and "active" in text


async def _stopped(fleet: Fleet, replica_id: str) -> bool:
    return (await fleet.replicas())[replica_id]["state"] == "stopped"


@pytest.mark.parametrize(
    ("until", "says"),
    [("", "say when"), ("yesterday-ish", "neither a duration"), ("2999-01-01T00:00:00Z", "in the future")],
)
async def test_a_moment_that_is_not_one_is_refused_with_what_to_give(
    tenants_fleet: Fleet, until: str, says: str
) -> None:
    status, body = await replay(tenants_fleet, until)
    assert status == 400 and says in body["error"]["message"] and body["error"]["code"] == "invalid"
