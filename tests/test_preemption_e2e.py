"""Preemption end to end (SCHED-7): an agent as a process, real llama.cpp engines on the tiny GGUF, the
gateway in front. A critical model that fits nowhere takes an opportunistic model's room; the
gateway answers for it; `ctl models` says whom the other gave room to."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import models as M
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import tenancy as T
from tests.fleet import FAST, Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, wait_until
from tests.test_gateway import FAST_ROUTER, GATEWAY, client, make_key, make_tenant

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(240)]

# Replicas of any age may give way here: the five minutes a real fleet waits would make a slow test.
PREEMPTING = msgspec.structs.replace(FAST, preempt_min_age_s=0.0, preempt_grace_s=2.0)


@pytest.fixture
async def gw(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=GATEWAY, router=FAST_ROUTER, scheduler=PREEMPTING)
    f.agent("n1")  # eight cores offered: one 8-core model fills it
    yield f
    await f.stop()


async def models(fleet: Fleet) -> dict[str, dict[str, Any]]:
    async with (
        aiohttp.ClientSession(headers=fleet.api_headers()) as s,
        s.get(f"{fleet.admin_url}/api/v1/models") as r,
    ):
        assert r.status == 200
        return {m["name"]: m for m in (await r.json())["models"]}


async def test_a_critical_model_takes_an_opportunistic_model_s_room_and_the_gateway_answers_for_it(
    gw: Fleet, tmp_path: Path
) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    key, _ = await make_key(gw.store, await make_tenant(gw.store))
    await gw.add_model("batch", tiny, cores=8, capacity_class="opportunistic")
    [victim] = await gw.wait_ready("batch", 1)

    await gw.add_model("chat", tiny, cores=8, capacity_class="critical")
    await gw.wait_ready("chat", 1)
    gone = (await gw.replicas())[victim["id"]]
    assert gone["state"] == "stopped", "the opportunistic replica gave its room"

    await gw.router_caught_up()
    chat = await client(gw, key).chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert chat.usage is not None and chat.usage.completion_tokens > 0

    preempted = [
        e.payload for e in await gw.store.read("llmgw.evt.model.batch") if isinstance(e.payload, M.ModelPreempted)
    ]
    assert [(p.replicas, p.for_model, p.for_class, p.capacity_class) for p in preempted] == [
        ([victim["id"]], "chat", "critical", "opportunistic")
    ]

    async def said() -> dict[str, Any] | None:
        m = (await models(gw))["batch"]
        return m if m["preemptions"] == 1 else None

    batch = await wait_until(said, what="the fleet projection to fold the preemption")
    # The model that gave way cannot come back (the node is full): it says why, naming the winner
    # while its hold lasts, and no node has room after.
    assert "gave room to chat (critical) on n1" in batch["gave_room_to"]
    assert batch["ready"] == 0
    assert "gave room to chat" in batch["status"] or batch["status"].startswith("unplaceable")


@pytest.fixture
async def teams(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(
        services=(*GATEWAY, "tenancy"), router=FAST_ROUTER, scheduler=PREEMPTING
    )
    for kind, path in (("org", "acme"), ("team", "acme/ml"), ("org", "beta"), ("team", "beta/ml")):
        await f.command("create", T.CreateScope(kind=kind, path=path), service=T.SERVICE)
    await f.command("quota_set", Q.SetQuota(scope="team:acme/ml", guarantee=Q.Resources(cores=8)), service=T.SERVICE)
    f.agent("n1")  # eight cores: one 8-core model fills it
    yield f
    await f.stop()


async def test_capacity_another_team_borrowed_is_taken_back_when_its_owner_needs_it(
    teams: Fleet, tmp_path: Path
) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    key, _ = await make_key(teams.store, await make_tenant(teams.store))
    # beta/ml has no guarantee: what its standard model holds, it holds on loan.
    await teams.add_model("beta-chat", tiny, cores=8, owner="beta/ml")
    [lent] = await teams.wait_ready("beta-chat", 1)

    # acme/ml is guaranteed 8 cores and holds none: its model, though only opportunistic, takes them back.
    await teams.add_model("acme-batch", tiny, cores=8, capacity_class="opportunistic", owner="acme/ml")
    await teams.wait_ready("acme-batch", 1)
    assert (await teams.replicas())[lent["id"]]["state"] == "stopped"

    [taken] = [
        e.payload
        for e in await teams.store.read("llmgw.evt.model.beta-chat")
        if isinstance(e.payload, M.ModelPreempted)
    ]
    assert taken.for_model == "acme-batch" and "borrowed beyond its scope's guarantee" in taken.reason

    await teams.router_caught_up()
    answer = await client(teams, key).chat.completions.create(
        model="acme-batch", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert answer.usage is not None and answer.usage.completion_tokens > 0
