"""`ctl restart --model M` end to end (SCHED-6): agents as processes, real llama.cpp engines, a client
sending requests through the gateway all along."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest

from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import models as M
from llmgw.events.schema import replicas as R
from llmgw.events.schema.subjects import event_subject
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, wait_until
from tests.test_gateway import FAST_ROUTER, GATEWAY, client, make_key, make_tenant

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]


@pytest.fixture
async def gw(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=GATEWAY, router=FAST_ROUTER)
    f.agent("n1")
    f.agent("n2")
    yield f
    await f.stop()


async def ctl(fleet: Fleet, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "llmgw"), "--nats", fleet.nats_url,
        "--api", f"http://127.0.0.1:{fleet.admin_port}", "ctl", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=fleet.cli_env(),
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_restarting_a_model_under_steady_traffic_fails_no_request_and_replaces_every_replica(
    gw: Fleet, tmp_path: Path
) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    key, _ = await make_key(gw.store, await make_tenant(gw.store))
    await gw.add_model("tiny", tiny, min_=2)
    before = {r["id"] for r in await gw.wait_ready("tiny", 2)}
    await gw.router_caught_up()

    code, _, err = await ctl(gw, "restart", "--model", "nope")
    assert code == 2 and "there is no model 'nope' (models: tiny)" in err

    answered, failed = 0, []
    stop = asyncio.Event()

    async def steady() -> None:
        nonlocal answered
        c = client(gw, key)
        while not stop.is_set():
            try:
                chat = await c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                assert chat.usage is not None and chat.usage.completion_tokens > 0
                answered += 1
            except (openai.APIError, AssertionError) as exc:
                failed.append(repr(exc))

    sender = asyncio.create_task(steady())
    await wait_until(lambda: answered >= 3, what="the client's first answers")
    code, out, err = await ctl(gw, "restart", "--model", "tiny", "--reason", "new weights")
    assert code == 0, err
    assert out.count("restarts: a new copy starts first, then it stops") == 2

    async def replaced() -> bool:
        ready = {r["id"] for r in await gw.ready("tiny")}
        active = {r["id"] for r in await gw.active("tiny")}
        return len(ready) == 2 and ready == active and not ready & before

    await wait_until(replaced, deadline_s=90, what="both replicas replaced by new ones")
    at_end = answered
    await wait_until(lambda: answered >= at_end + 3, what="answers from the new replicas")
    stop.set()
    await sender

    assert failed == [], f"{len(failed)} of {answered + len(failed)} requests failed during the restart"
    # Each old replica was replaced first (surge), then stopped naming its replacement.
    events = [e.payload for e in await gw.store.read(f"llmgw.evt.{R.AGGREGATE}.>")]
    replacing = {p.replaces: p.replica_id for p in events if isinstance(p, R.ReplicaPlaced) and p.replaces}
    assert set(replacing) == before
    stops = {p.replica_id: p.reason for p in events if isinstance(p, R.ReplicaStopRequested)}
    assert stops == {old: f"restarted: replaced by {new}" for old, new in replacing.items()}
    asked = [p for p in events if isinstance(p, R.ReplicaRestartRequested)]
    assert sorted(p.replica_id for p in asked) == sorted(before) and {p.reason for p in asked} == {"new weights"}
    code, out, _ = await ctl(gw, "replicas", "--json")
    assert code == 0 and '"restart"' in out


async def test_ctl_restart_names_what_runs_when_refused_and_ctl_replicas_shows_the_restart_queued(
    store: EventStore, nats: NatsServer, tmp_path: Path
) -> None:
    # No scheduler: the request stays queued for the views to show.
    fleet = await Fleet(store, nats.url, tmp_path).start(services=("catalog", "fleet", "projections", "api"))
    try:
        await fleet.add_model("m", "/models/m.gguf")
        placed = R.ReplicaPlaced(
            replica_id="m-1", model="m", node_id="n1", source="/models/m.gguf", profile=M.Profile(), spec_hash=""
        )
        ready = R.ReplicaReady(replica_id="m-1", node_id="n1", pid=7, port=20000, url="http://n1:20000")
        await store.append(
            event_subject(R.AGGREGATE, "m-1"), [NewEvent(payload=p, actor="node:n1") for p in (placed, ready)]
        )

        code, _, err = await ctl(fleet, "restart", "m-9")
        assert code == 2 and "there is no running replica 'm-9' (running: m-1)" in err
        code, _, err = await ctl(fleet, "restart")
        assert code == 2 and "name the replicas, or give --model MODEL, or --all" in err
        code, out, err = await ctl(fleet, "restart", "m-1", "--reason", "new weights")
        assert code == 0 and "replica m-1 (m) restarts: a new copy starts first, then it stops" in out, err

        async def shown() -> str | None:
            code, out, _ = await ctl(fleet, "replicas")
            return out if code == 0 and "(restart queued)" in out else None

        assert "m-1" in await wait_until(shown, what="ctl replicas to show the restart")
        code, out, _ = await ctl(fleet, "restart", "--all")
        assert code == 0 and "replica m-1 (m) is already restarting (queued)" in out
    finally:
        await fleet.stop()
