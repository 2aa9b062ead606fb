"""One budget, many routers, many requests at once: spend never passes a budget, and the book
reconciles with the usage records to the cent (issue "Trust": the budget test)."""

from __future__ import annotations

import asyncio
from collections import Counter
from pathlib import Path

import aiohttp
import pytest

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import access as A
from llmgw.events.schema.usage import UsageRecord
from llmgw.services.router.budgets import BudgetBook
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, usage_records, wait_until
from tests.test_gateway import FAST_ROUTER, GATEWAY, make_key, make_tenant, set_event

pytestmark = [pytest.mark.timeout(600)]

REQUESTS = 1000


async def test_a_thousand_requests_through_three_routers_never_pass_any_budget_and_the_book_reconciles(
    store: EventStore, nats: NatsServer, tmp_path: Path
) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    fleets = [await Fleet(store, nats.url, tmp_path / "a").start(services=GATEWAY, router=FAST_ROUTER)]
    try:
        for name in ("b", "c"):
            fleets.append(await Fleet(store, nats.url, tmp_path / name).start(services=("router",), router=FAST_ROUTER))
        fleets[0].agent("n1")
        tenant = await make_tenant(store)
        key, key_id = await make_key(store, tenant)
        # $1 a token in and out: a request ("hi", max_tokens 2) may cost a few dollars, costs less.
        await set_event(
            store, A.PRICE_AGGREGATE, "tiny", A.PriceSet(model="tiny", input_usd_per_m=1e6, output_usd_per_m=1e6)
        )
        budgets = {
            f"org:{tenant.org}": 2000.0,
            f"team:{tenant.team}": 1500.0,
            f"project:{tenant.project}": 1200.0,
            f"key:{key_id}": 1000.0,
        }
        for scope, usd in budgets.items():
            await set_event(store, A.BUDGET_AGGREGATE, scope, A.BudgetSet(scope=scope, usd=usd, period="day"))
        await fleets[0].add_model("tiny", tiny)
        await fleets[0].wait_ready("tiny", 1)
        for f in fleets:
            await f.router_caught_up()

        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        headers = {"Authorization": f"Bearer {key}"}
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=300)) as s:

            async def one(i: int) -> int:
                port = fleets[i % 3].port
                async with s.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers) as r:
                    await r.read()
                    return r.status

            statuses = Counter(await asyncio.gather(*(one(i) for i in range(REQUESTS))))
        # Every request answered, served or refused for its budget: none failed on the book's contention.
        assert set(statuses) <= {200, 429}, statuses
        assert statuses[200] > 0 and statuses[429] > 0, statuses

        async def recorded() -> list[UsageRecord] | None:
            found = await usage_records(store, tenant.project)
            return found if len(found) == REQUESTS else None

        records = await wait_until(recorded, deadline_s=120, what="a usage record for every request")
        assert Counter(r.status for r in records) == statuses
        billed = sum(r.cost_usd for r in records)
        book = BudgetBook(store.js)
        for scope, usd in budgets.items():
            spent = await book.spent(scope, "day")
            assert spent <= usd + 1e-9, f"{scope} spent {spent} of {usd}"
            assert round(spent, 2) == round(billed, 2), f"{scope}: the book says {spent}, the records {billed}"
    finally:
        for f in reversed(fleets):
            await f.stop()
