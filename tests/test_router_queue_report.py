"""What waits in a gateway's queue is told to the schedulers (SCHED-9): requests held there never reach
an engine's metrics, yet they are the model's load. A real engine with one slot, held busy."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from llmgw.events.schema import models as M
from llmgw.events.schema import scheduler as SCH
from tests.fleet import Fleet
from tests.support import wait_until
from tests.test_gateway import gw, make_key, make_tenant, router_caught_up, tiny  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]


async def test_a_router_reports_what_waits_in_its_queue_while_it_waits_and_once_more_when_none_does(
    gw: Fleet,  # noqa: F811
    tiny: Path,  # noqa: F811
) -> None:
    key, _ = await make_key(gw.store, await make_tenant(gw.store))
    profile = M.Profile(engine="llamacpp", cpu_cores=1, min_memory_gb=0.05, ctx_size=1024, parallel=1)
    await gw.command("add", M.AddModel(spec=M.ModelSpec(name="one", source=str(tiny), profiles=[profile])))
    [replica] = await gw.wait_ready("one", 1)
    await router_caught_up(gw, 0)
    router = gw.handles["router"]
    reports: list[SCH.RouterQueues] = []
    decoder = msgspec.json.Decoder(SCH.RouterQueues)

    async def on_msg(msg: Any) -> None:
        reports.append(decoder.decode(msg.data))

    sub = await gw.store.nc.subscribe(f"{SCH.QUEUE_ROOT}.*", cb=on_msg)
    rid = replica["id"]
    router.outstanding[rid] = router.outstanding.get(rid, 0) + 1  # the one slot is busy: requests wait
    body = {"model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    try:
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:

            async def ask() -> int:
                async with s.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", json=body) as r:
                    return r.status

            waiting = [asyncio.create_task(ask()) for _ in range(2)]
            await wait_until(
                lambda: any(r.waiting == {"one": 2} for r in reports), what="a report of two requests waiting"
            )
            assert {r.router for r in reports} == {router.instance}
            router.outstanding[rid] -= 1
            router.gate.released("one")
            assert await asyncio.gather(*waiting) == [200, 200]
        await wait_until(lambda: reports[-1].waiting == {}, what="one more report once nothing waits")
    finally:
        await sub.unsubscribe()
