"""Autoscaling end to end (SCHED-9): a real agent as a process, real llama.cpp engines with one slot on
the tiny GGUF. More requests than the slot serves make the engine queue them; its /metrics says so in
the heartbeats; the scheduler adds a replica, and removes it once the load is gone. An engine that
stops answering is reported unreachable before its node is lost."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import scheduler as SCH
from llmgw.events.schema import subjects as S
from tests.fleet import FAST, Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, wait_until

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]

# The windows shortened from a minute and ten to seconds: the rules are the product's.
SCALING = msgspec.structs.replace(FAST, scale_up_after_s=2.0, scale_down_after_s=4.0)


@pytest.fixture
async def fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=("catalog", "fleet", "scheduler"), scheduler=SCALING)
    f.agent("n1")
    yield f
    await f.stop()


async def add_one_slot_model(fleet: Fleet, source: Path, *, min_: int, max_: int) -> None:
    profile = M.Profile(engine="llamacpp", cpu_cores=1, min_memory_gb=0.05, ctx_size=1024, parallel=1)
    spec = M.ModelSpec(name="m", source=str(source), scaling=M.Scaling(min=min_, max=max_), profiles=[profile])
    await fleet.command("add", M.AddModel(spec=spec))


class Heartbeats:
    """The latest heartbeat of each node, as the telemetry carries it."""

    def __init__(self) -> None:
        self.latest: dict[str, N.NodeHeartbeat] = {}

    async def follow(self, store: EventStore) -> Any:
        decoder = msgspec.json.Decoder(N.NodeHeartbeat)

        async def on_msg(msg: Any) -> None:
            hb = decoder.decode(msg.data)
            self.latest[hb.node_id] = hb

        return await store.nc.subscribe(f"{S.TELEMETRY_ROOT}.node.*", cb=on_msg)

    def report(self, replica_id: str) -> N.ReplicaReport | None:
        for hb in self.latest.values():
            for r in hb.replicas:
                if r.replica_id == replica_id:
                    return r
        return None


async def autoscaled(fleet: Fleet) -> list[M.ModelAutoscaled]:
    return [e.payload for e in await fleet.store.read("llmgw.evt.model.m") if isinstance(e.payload, M.ModelAutoscaled)]


async def test_sustained_load_past_the_engines_slots_adds_a_replica_and_its_end_removes_it(
    fleet: Fleet, tmp_path: Path
) -> None:
    await add_one_slot_model(fleet, write_tiny_gguf(tmp_path / "tiny.gguf"), min_=1, max_=2)
    [first] = await fleet.wait_ready("m", 1)
    key = await fleet.key(first["id"])
    stop = asyncio.Event()

    async def worker(session: aiohttp.ClientSession) -> None:
        # Long completions, one after another: four workers on one slot keep three waiting.
        body = {"prompt": "hi", "max_tokens": 900, "ignore_eos": True}
        while not stop.is_set():
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.post(
                    f"{first['url']}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
                ) as resp:
                    await resp.read()

    async with aiohttp.ClientSession() as session:
        load = [asyncio.create_task(worker(session)) for _ in range(4)]
        try:
            await fleet.wait_ready("m", 2, deadline_s=90)
        finally:
            stop.set()
            await asyncio.gather(*load, return_exceptions=True)

    [up] = await autoscaled(fleet)
    assert (up.from_, up.to, up.added) == (1, 2, 1)
    assert "waiting on 1 ready replica, " in up.reason, up.reason

    # The load is gone: after the (shortened) quiet window, the replica the load added goes.
    async def back_to_one() -> list[M.ModelAutoscaled] | None:
        steps = await autoscaled(fleet)
        return steps if len(steps) == 2 else None

    steps = await wait_until(back_to_one, deadline_s=60, what="the model to scale back to 1")
    assert (steps[1].from_, steps[1].to, steps[1].added) == (2, 1, 0)
    assert steps[1].reason.startswith("nothing waiting for"), steps[1].reason
    await fleet.wait_ready("m", 1, deadline_s=60)


async def test_an_engine_that_stops_answering_is_reported_unreachable_before_its_node_is_lost(
    fleet: Fleet, store: EventStore, tmp_path: Path
) -> None:
    beats = Heartbeats()
    sub = await beats.follow(store)
    try:
        await add_one_slot_model(fleet, write_tiny_gguf(tmp_path / "tiny.gguf"), min_=1, max_=1)
        [replica] = await fleet.wait_ready("m", 1)

        def answering() -> bool:
            r = beats.report(replica["id"])
            return r is not None and r.metrics_at is not None and not r.unreachable and r.slots == 1

        await wait_until(answering, deadline_s=30, what="the engine's metrics in the heartbeat")
        os.kill(replica["pid"], signal.SIGSTOP)  # alive, but answering nothing
        try:

            def unreachable() -> N.ReplicaReport | None:
                r = beats.report(replica["id"])
                return r if r is not None and r.unreachable else None

            r = await wait_until(unreachable, deadline_s=30, what="the replica reported unreachable")
            assert r.metrics_error, "the report says why"
            lost = [e for e in await store.read("llmgw.evt.node.>") if isinstance(e.payload, N.NodeLost)]
            assert lost == [], "the node still reports in: only the engine is unreachable"
        finally:
            os.kill(replica["pid"], signal.SIGCONT)
        await wait_until(answering, deadline_s=30, what="the engine answering again")
    finally:
        await sub.unsubscribe()


async def test_a_routers_queue_reported_on_the_bus_adds_a_replica(fleet: Fleet, tmp_path: Path) -> None:
    # The gateway holds what its replicas cannot take: the engine idles, the router's queue is the load.
    await add_one_slot_model(fleet, write_tiny_gguf(tmp_path / "tiny.gguf"), min_=1, max_=2)
    await fleet.wait_ready("m", 1)
    report = msgspec.json.encode(SCH.RouterQueues(router="gw-1", waiting={"m": 2}))

    async def queued() -> list[M.ModelAutoscaled] | None:
        await fleet.store.nc.publish(f"{SCH.QUEUE_ROOT}.gw-1", report)
        steps = await autoscaled(fleet)
        return steps or None

    [up] = await wait_until(queued, deadline_s=60, what="the router's queue to add a replica")
    assert (up.from_, up.to) == (1, 2) and up.reason.startswith("2 requests waiting on 1 ready replica"), up.reason
    await fleet.wait_ready("m", 2, deadline_s=60)
