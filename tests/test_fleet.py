"""The fleet end to end: agents as processes, real llama.cpp engines, the scheduler deciding."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import msgspec
import pytest

from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema.subjects import event_subject
from llmgw.services.scheduler.service import SchedulerService
from tests.fleet import FAST, Fleet
from tests.gguf_tiny import corrupt_gguf, write_tiny_gguf
from tests.support import NatsServer, wait_until

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


async def chat(url: str, key: str) -> dict:
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"{url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
            headers={"Authorization": f"Bearer {key}"},
        ) as resp,
    ):
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_a_model_is_placed_and_its_replica_answers(fleet: Fleet, tiny: Path) -> None:
    fleet.agent("n1")
    await fleet.add_model("tiny", tiny)
    [replica] = await fleet.wait_ready("tiny", 1)
    assert replica["node"] == "n1"
    body = await chat(replica["url"], await fleet.key(replica["id"]))
    assert body["usage"]["completion_tokens"] > 0
    async with aiohttp.ClientSession() as s, s.post(f"{replica['url']}/v1/chat/completions", json={}) as resp:
        assert resp.status == 401  # engines refuse requests without their replica's key


async def test_replicas_spread_across_nodes_and_scale_up_and_down(fleet: Fleet, tiny: Path) -> None:
    fleet.agent("n1")
    fleet.agent("n2")
    await wait_until(lambda: _registered(fleet.store, 2), what="two nodes registered")
    await fleet.add_model("tiny", tiny, min_=2)
    ready = await fleet.wait_ready("tiny", 2)
    assert {r["node"] for r in ready} == {"n1", "n2"}
    await fleet.command("scale", M.ScaleModel(name="tiny", min=3))
    await fleet.wait_ready("tiny", 3)
    await fleet.command("scale", M.ScaleModel(name="tiny", min=1))
    [left] = await fleet.wait_ready("tiny", 1)

    async def stopped() -> list[dict]:
        done = [r for r in (await fleet.replicas()).values() if r["state"] == "stopped"]
        return done if len(done) == 2 else []

    gone = await wait_until(stopped, what="two replicas stopped by their agents")
    assert left["id"] not in {r["id"] for r in gone}
    for r in gone:
        with pytest.raises(ProcessLookupError):
            os.kill(r["pid"], 0)  # their engines are gone


async def _registered(store: EventStore, n: int) -> bool:
    events = await store.read("llmgw.evt.node.>")
    return len({e.payload.node_id for e in events if isinstance(e.payload, N.NodeRegistered)}) >= n


async def test_a_lost_node_s_replica_is_placed_on_another_node(fleet: Fleet, tiny: Path) -> None:
    a1 = fleet.agent("n1")
    await fleet.add_model("tiny", tiny)
    [first] = await fleet.wait_ready("tiny", 1)
    fleet.agent("n2")
    await wait_until(lambda: _registered(fleet.store, 2), what="n2 registered")
    lost = fleet.agents[first["node"]]
    lost.kill9()
    lost.kill_engines()  # the machine is gone, not just its agent

    async def failed() -> bool:
        return (await fleet.replicas())[first["id"]]["state"] == "failed"

    await wait_until(failed, deadline_s=30, what="the lost node's replica to be failed")
    [moved] = await fleet.wait_ready("tiny", 1, deadline_s=60)
    assert moved["node"] != first["node"]
    replicas = await fleet.replicas()
    assert replicas[first["id"]]["state"] == "failed"
    assert "lost" in replicas[first["id"]]["reason"]
    assert a1 is not None


async def test_an_agent_killed_and_restarted_adopts_its_engine(fleet: Fleet, tiny: Path) -> None:
    agent = fleet.agent("n1")
    await fleet.add_model("tiny", tiny)
    [replica] = await fleet.wait_ready("tiny", 1)
    before = await _last_heartbeat(fleet.store, "n1")
    agent.kill9()
    agent.start()

    async def adopted() -> bool:
        hb = await _last_heartbeat(fleet.store, "n1")
        return hb.agent_started_at != before.agent_started_at and [
            (r.replica_id, r.pid, r.state) for r in hb.replicas
        ] == [(replica["id"], replica["pid"], "ready")]

    # The new agent reports the old engine as its own, ready, with the same pid.
    # A new agent process on a loaded machine takes a while to start and report: its deadline is a minute.
    await wait_until(adopted, deadline_s=60, what="the restarted agent to report the adopted engine")
    after = (await fleet.replicas())[replica["id"]]
    assert after["state"] == "ready"
    assert after["pid"] == replica["pid"]
    assert after["history"] == ["replica.placed", "replica.starting", "replica.ready"]
    os.kill(replica["pid"], 0)  # the very same engine process still runs
    assert await fleet.ready("tiny") == [after]


async def _last_heartbeat(store: EventStore, node: str) -> N.NodeHeartbeat:
    msg = await store.js.get_last_msg("LLMGW_TELEMETRY", f"llmgw.tel.node.{node}", direct=True)
    return msgspec.json.decode(msg.data, type=N.NodeHeartbeat)


async def test_a_killed_engine_fails_its_replica_and_another_starts(fleet: Fleet, tiny: Path) -> None:
    fleet.agent("n1")
    await fleet.add_model("tiny", tiny)
    [replica] = await fleet.wait_ready("tiny", 1)
    os.killpg(replica["pid"], signal.SIGKILL)

    async def failed() -> bool:
        return (await fleet.replicas())[replica["id"]]["state"] == "failed"

    await wait_until(failed, what="the killed engine's replica to be failed")
    [again] = await fleet.wait_ready("tiny", 1)
    assert again["id"] != replica["id"]
    failed = (await fleet.replicas())[replica["id"]]
    assert failed["state"] == "failed" and "exited" in failed["reason"]


async def test_a_corrupt_model_is_parked_after_five_attempts_and_retry_places_it_again(
    fleet: Fleet, tmp_path: Path
) -> None:
    fleet.agent("n1")
    path = corrupt_gguf(tmp_path / "broken.gguf")
    await fleet.add_model("broken", path)

    async def parked() -> str | None:
        events = await fleet.store.read("llmgw.evt.model.broken")
        return next((e.payload.reason for e in events if isinstance(e.payload, M.ModelParked)), None)

    reason = await wait_until(parked, deadline_s=90, what="the model to be parked")
    assert reason.startswith("5 failed starts in a row")
    failures = [r for r in (await fleet.replicas()).values() if r["model"] == "broken"]
    assert len(failures) == 5 and all(r["state"] == "failed" for r in failures)
    with pytest.raises(CommandRejectedError):
        await fleet.command("retry", M.RetryModel(name="tiny-not-there"))
    write_tiny_gguf(path)  # the operator fixes the file
    await fleet.command("retry", M.RetryModel(name="broken"))
    await fleet.wait_ready("broken", 1)


async def test_a_standby_scheduler_takes_over_and_nothing_is_placed_twice(
    store: EventStore, nats: NatsServer, tmp_path: Path, tiny: Path
) -> None:
    fleet = await Fleet(store, nats.url, tmp_path).start(services=("catalog", "fleet", "projections"))
    schedulers = [SchedulerService(store, config=FAST, instance=f"s{i}", lease_ttl_s=2.0) for i in range(2)]
    tasks = [asyncio.create_task(s.run()) for s in schedulers]
    try:
        fleet.agent("n1")
        fleet.agent("n2")
        leader = await wait_until(lambda: next((s for s in schedulers if s.leader), None), what="a leader")
        await fleet.add_model("tiny", tiny, min_=1)
        await fleet.wait_ready("tiny", 1)
        # The leader dies: its tasks stop at once, its lease runs out.
        tasks[schedulers.index(leader)].cancel()
        standby = next(s for s in schedulers if s is not leader)
        await wait_until(lambda: standby.leader, deadline_s=10, what="the standby to lead")
        await fleet.command("scale", M.ScaleModel(name="tiny", min=2))
        ready = await fleet.wait_ready("tiny", 2)
        assert {r["node"] for r in ready} == {"n1", "n2"}
        placed = [r for r in (await fleet.replicas()).values() if r["model"] == "tiny"]
        assert len(placed) == 2  # nothing placed twice
        assert standby.term > leader.term
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await fleet.stop()


async def test_a_stale_leader_s_decisions_are_refused(store: EventStore, nats: NatsServer, tmp_path: Path) -> None:
    from llmgw.events.runtime.store import AppendConflict, NewEvent
    from llmgw.events.schema.subjects import event_subject

    old = SchedulerService(store, config=FAST, instance="old")
    await old._become_leader(1)
    new = SchedulerService(store, config=FAST, instance="new")
    await new._become_leader(2)
    event = NewEvent(payload=M.ModelRetried(), actor="svc:scheduler")
    with pytest.raises(AppendConflict):
        await store.append_fenced(
            [(event_subject("model", "x"), event)],
            fence_subject=event_subject("scheduler", "leader"),
            fence_seq=old.fence_seq,
        )
    await store.append_fenced(
        [(event_subject("model", "x"), event)],
        fence_subject=event_subject("scheduler", "leader"),
        fence_seq=new.fence_seq,
    )


async def test_headroom_says_how_many_more_fit_through_the_api_and_the_cli(fleet: Fleet, tiny: Path) -> None:
    fleet.agent("n1")
    await fleet.add_model("tiny", tiny, cores=1, memory_gb=0.05)
    await fleet.wait_ready("tiny", 1)
    api = f"http://127.0.0.1:{fleet.admin_port}"
    async with aiohttp.ClientSession(headers=fleet.api_headers()) as s:
        async with s.get(f"{api}/api/v1/models/tiny/headroom") as r:
            body = await r.json()
        assert r.status == 200 and body["current"] == 1
        cores = 8  # the test agents offer eight CPUs (`llmgw agent --cpus 8`, tests/fleet.py); a replica holds one
        assert body["more"] == sum(body["where"].values()) == cores - 1 and set(body["where"]) <= {"n1"}
        assert body["more"] == 0 or body["where"] == {"n1": cores - 1}
        assert "n1" in body["why_not_more"] and "CPU" in body["why_not_more"]
        async with s.get(f"{api}/api/v1/models/nope/headroom") as r:
            assert r.status == 404 and "no model named 'nope'" in (await r.json())["error"]["message"]
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "llmgw"), "--nats", fleet.nats_url, "--api", api,
        "ctl", "model", "headroom", "tiny",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=fleet.cli_env(),
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    assert f"tiny: 1 running; {cores - 1} more would fit now" in out.decode()


async def test_a_model_added_without_memory_reserves_what_its_gguf_is_sized_to_and_says_so(
    fleet: Fleet, tiny: Path
) -> None:
    from llmgw.events.schema import jobs as J
    from llmgw.modelfiles.gguf_header import read_header_file
    from llmgw.modelfiles.sizing import estimate_memory

    async def add(*args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "llmgw"), "--nats", fleet.nats_url, "ctl", "model", "add", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=fleet.cli_env(),
        )  # fmt: skip
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        return proc.returncode or 0, err.decode()

    code, said = await add("sized", "--source", str(tiny), "--min", "0")
    want = estimate_memory(read_header_file(tiny), tiny.stat().st_size, J.DEFAULT_CTX_POOL)
    assert code == 0 and f"each replica reserves {want.total_gb:.2f} GB" in said, said
    # A file only the nodes have cannot be sized here: the catalog then asks for the figure.
    code, said = await add("elsewhere", "--source", "/models/on-the-nodes.gguf", "--min", "0")
    assert code == 2 and "is not on this machine" in said and "--memory-gb N" in said

    async def sized() -> float | None:
        events = await fleet.store.read(event_subject(M.AGGREGATE, "sized"))
        return events[0].payload.spec.profiles[0].min_memory_gb if events else None

    assert await wait_until(sized, what="the model added") == want.total_gb
