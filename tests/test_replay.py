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

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import access as A
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import utc_now
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


async def replay(fleet: Fleet, until: str, **more: str) -> tuple[int, dict[str, Any]]:
    url = f"http://127.0.0.1:{fleet.admin_port}/api/v1/replay"
    params = {"until": until, **more}
    async with aiohttp.ClientSession(headers=fleet.api_headers()) as s, s.get(url, params=params) as r:
        return r.status, await r.json()


async def cli(fleet: Fleet, *args: str) -> str:
    proc = await asyncio.create_subprocess_exec(
        LLMGW, "--nats", fleet.nats_url, "--api", f"http://127.0.0.1:{fleet.admin_port}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=fleet.cli_env(),
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return out.decode()


async def test_the_cluster_is_shown_as_it_was_before_later_changes(tenants_fleet: Fleet, tmp_path: Path) -> None:
    fleet = tenants_fleet
    for kind, path in (("org", "acme"), ("team", "acme/ml"), ("project", "acme/ml/chat")):
        await fleet.command("create", T.CreateScope(kind=kind, path=path), service=T.SERVICE)
    _, prefix, digest = A.make_api_key()
    await fleet.command(
        "key.create", A.CreateKey(project="acme/ml/chat", prefix=prefix, secret_sha256=digest, name="ci"), A.SERVICE
    )
    quota = Q.SetQuota(scope="team:acme/ml", guarantee=Q.Resources(cores=2), limit=Q.Resources(cores=4))
    await fleet.command("quota_set", quota, service=T.SERVICE)
    fleet.agent("n1")
    await fleet.add_model("tiny", write_tiny_gguf(tmp_path / "tiny.gguf"), owner="acme/ml")
    [replica] = await fleet.wait_ready("tiny", 1)
    then = utc_now()

    # Later: the key is revoked, the node cordoned, the model removed.
    await fleet.command("key.revoke", A.RevokeKey(key=prefix, reason="leaked"), A.SERVICE)
    await fleet.command("cordon", N.CordonNode(node_id="n1", reason="maintenance"), N.SERVICE)
    await fleet.command("remove", M.RemoveModel(name="tiny"))
    await fleet.command("quota_clear", Q.ClearQuota(scope="acme/ml"), service=T.SERVICE)
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
    # Capacity quotas and who held what (SCHED-8): the team's one-core replica against its quota.
    assert past["quotas"] == [
        {
            "scope": "team:acme/ml",
            "guarantee": {"gpus": None, "cores": 2, "memory_bytes": None},
            "limit": {"gpus": None, "cores": 4, "memory_bytes": None},
            "holds": {"gpus": 0, "cores": 1, "memory_bytes": int(0.05 * 1024**3)},
        }
    ]
    assert 0 < past["position"] and past["last_event_at"] <= then.isoformat()

    status, now = await replay(fleet, utc_now().isoformat())
    assert status == 200
    assert now["models"] == [] and now["replicas"] == [] and now["quotas"] == []
    assert [(n["id"], n["cordoned"]) for n in now["nodes"]] == [("n1", 1)]
    assert [k["state"] for k in now["keys"]] == ["revoked"]
    assert now["position"] > past["position"]

    status, before = await replay(fleet, (then - timedelta(days=1)).isoformat())
    assert status == 200 and before["position"] == 0 and before["nodes"] == before["models"] == before["keys"] == []

    # The CLI prints the same moment.
    text = await cli(fleet, "events", "replay", "--until", then.isoformat())
    assert "tiny" in text and "1/1 ready" in text and "serving" in text and f"{prefix}" in text and "active" in text
    assert "team:acme/ml" in text and "holds 1 cores" in text and "guarantee 2 cores; limit 4 cores" in text


async def test_keys_at_a_moment_are_all_counted_by_state_and_listed_a_page_at_a_time(tenants_fleet: Fleet) -> None:
    fleet = tenants_fleet
    for kind, path in (("org", "acme"), ("team", "acme/ml"), ("project", "acme/ml/chat")):
        await fleet.command("create", T.CreateScope(kind=kind, path=path), service=T.SERVICE)
    ends = utc_now() + timedelta(seconds=1)
    prefixes = {}
    for name, expires in (("a", None), ("b", None), ("c", None), ("d", ends)):
        _, prefixes[name], digest = A.make_api_key()
        create = A.CreateKey(
            project="acme/ml/chat", prefix=prefixes[name], secret_sha256=digest, name=name, expires_at=expires
        )
        await fleet.command("key.create", create, A.SERVICE)
    await fleet.command("key.revoke", A.RevokeKey(key=prefixes["a"]), A.SERVICE)
    await wait_until(lambda: utc_now() > ends, deadline_s=10, what="key d's expiry to pass")
    until = utc_now().isoformat()

    status, first = await replay(fleet, until, keys_limit="2")
    assert status == 200, first
    assert first["counts"]["keys"] == {"total": 4, "active": 2, "revoked": 1, "expired": 1}
    assert [(k["name"], k["state"]) for k in first["keys"]] == [("a", "revoked"), ("b", "active")]
    assert first["keys_next"]
    status, rest = await replay(fleet, until, keys_limit="2", keys_after=first["keys_next"])
    assert status == 200, rest
    assert [(k["name"], k["state"]) for k in rest["keys"]] == [("c", "active"), ("d", "expired")]
    assert rest["keys_next"] is None and rest["counts"] == first["counts"]
    status, counted = await replay(fleet, until, keys_limit="0")
    assert status == 200 and counted["keys"] == [] and counted["counts"] == first["counts"]

    # The CLI prints the counts and the page, and says how to see the next one.
    text = await cli(fleet, "events", "replay", "--until", until, "--keys-limit", "2")
    assert "keys (4: 2 active, 1 revoked, 1 expired; 2 listed)" in text, text
    assert prefixes["b"] in text and prefixes["c"] not in text
    assert f"--keys-limit 2 --keys-after {first['keys_next']}" in text, text
    text = await cli(
        fleet, "events", "replay", "--until", until, "--keys-limit", "2", "--keys-after", first["keys_next"]
    )
    assert prefixes["c"] in text and prefixes["d"] in text and prefixes["b"] not in text and "--keys-after" not in text


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


@pytest.mark.parametrize(
    ("page", "says"),
    [({"keys_limit": "many"}, "not a whole number"), ({"keys_after": "not-a-cursor"}, "give the keys_next")],
)
async def test_a_page_of_keys_that_is_not_one_is_refused_with_what_to_give(
    tenants_fleet: Fleet, page: dict[str, str], says: str
) -> None:
    status, body = await replay(tenants_fleet, "1h", **page)
    assert status == 400 and says in body["error"]["message"] and body["error"]["code"] == "invalid"
