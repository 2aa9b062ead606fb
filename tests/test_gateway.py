"""The gateway end to end: the official `openai` client, real engines, keys, limits, budgets, usage."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats.js.errors
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import access as A
from llmgw.events.schema import models as M
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.subjects import event_subject
from llmgw.events.schema.usage import UsageRecord
from llmgw.services.router.app import RouterConfig
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, usage_records, wait_until

pytestmark = [pytest.mark.timeout(240)]

GATEWAY = ("catalog", "fleet", "scheduler", "projections", "api", "router")
FAST_ROUTER = RouterConfig(activation_s=30.0, first_token_s=20.0, idle_s=20.0, total_s=60.0)


class Tenant(msgspec.Struct):
    org: str
    team: str
    project: str


async def make_tenant(store: EventStore, name: str = "acme") -> Tenant:
    t = Tenant(org=f"o-{name}", team=f"t-{name}", project=f"p-{name}")
    subject = event_subject(T.AGGREGATE, T.TREE_ID)
    await store.append(
        subject,
        [
            NewEvent(payload=T.OrgCreated(org_id=t.org, name=name), actor="user:test"),
            NewEvent(payload=T.TeamCreated(team_id=t.team, org_id=t.org, name="ml"), actor="user:test"),
            NewEvent(payload=T.ProjectCreated(project_id=t.project, team_id=t.team, name="chat"), actor="user:test"),
        ],
    )
    return t


async def make_key(store: EventStore, tenant: Tenant, **fields) -> tuple[str, str]:
    key, prefix, digest = A.make_api_key()
    key_id = f"key_{prefix}"
    await store.append(
        event_subject(A.KEY_AGGREGATE, key_id),
        [
            NewEvent(
                payload=A.KeyCreated(
                    key_id=key_id, prefix=prefix, secret_sha256=digest, project_id=tenant.project, name="test", **fields
                ),
                actor="user:test",
            )
        ],
    )
    return key, key_id


async def set_event(store: EventStore, aggregate: str, agg_id: str, payload: msgspec.Struct) -> int:
    return (
        await store.append(event_subject(aggregate, agg_id), [NewEvent(payload=payload, actor="user:test")])
    ).last_seq


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
async def gw(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=GATEWAY, router=FAST_ROUTER)
    f.agent("n1")
    yield f
    await f.stop()


async def router_caught_up(gw: Fleet, seq: int = 0) -> None:
    await gw.router_caught_up()


def client(gw: Fleet, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=key, max_retries=0)


async def ready_model(gw: Fleet, tiny: Path, name: str = "tiny", **kw) -> None:
    await gw.add_model(name, tiny, **kw)
    await gw.wait_ready(name, kw.get("min_", 1))


async def test_the_openai_client_works_unchanged(gw: Fleet, tiny: Path) -> None:
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    await ready_model(gw, tiny, aliases=["tiny-alias"])
    await gw.add_model("tiny-embed", tiny, args=["--embeddings"], route="embedding")
    await gw.wait_ready("tiny-embed", 1)
    await router_caught_up(gw, 0)
    c = client(gw, key)
    models = await c.models.list()
    assert {m.id for m in models.data} == {"tiny", "tiny-embed"}
    assert (await c.models.retrieve("tiny")).id == "tiny"
    assert (await c.models.retrieve("tiny-alias")).id == "tiny"  # an alias names its model
    with pytest.raises(openai.NotFoundError) as missing:
        await c.models.retrieve("nope")
    assert missing.value.code == "model_not_found" and "model 'nope' does not exist" in missing.value.message

    chat = await c.chat.completions.create(
        model="tiny-alias", messages=[{"role": "user", "content": "hi"}], max_tokens=5
    )
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert chat.usage.prompt_tokens > 0 and 0 < chat.usage.completion_tokens <= 5

    chunks = [
        ch
        async for ch in await c.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello there"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    ]
    usage = [ch.usage for ch in chunks if ch.usage]
    assert usage and usage[-1].completion_tokens > 0
    assert any(ch.choices and ch.choices[0].finish_reason for ch in chunks)

    comp = await c.completions.create(model="tiny", prompt="once upon a time", max_tokens=4)
    assert comp.usage.completion_tokens > 0

    emb = await c.embeddings.create(model="tiny-embed", input=["a", "b"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 0

    with pytest.raises(openai.NotFoundError) as nf:
        await c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "model 'nope' does not exist" in nf.value.message
    with pytest.raises(openai.AuthenticationError):
        await client(gw, "llmgw-aaaaaaaa-" + "x" * 43).models.list()
    with pytest.raises(openai.AuthenticationError):
        await client(gw, "llmgw-aaaaaaaa-" + "x" * 43).models.retrieve("tiny")


async def test_the_gateway_makes_its_own_request_id_and_echoes_the_clients(gw: Fleet, tiny: Path) -> None:
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    await router_caught_up(gw, 0)
    url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        async with s.post(
            url, data=b"{not json", headers={"Authorization": f"Bearer {key}", "X-Request-Id": "req-123"}
        ) as r:
            assert r.status == 400 and r.headers["x-client-request-id"] == "req-123"  # the client's, echoed
            assert len(r.headers["x-request-id"]) == 36  # and the gateway's own
            body = await r.json()
            assert body["error"]["type"] == "invalid_request_error" and "not valid JSON" in body["error"]["message"]
        async with s.post(
            url,
            json={"model": "x", "messages": []},
            headers={"Authorization": f"Bearer {key}", "X-Request-Id": "bad id\u00e9" * 30},
        ) as r:
            assert r.status == 400 and len(r.headers["x-request-id"]) == 36
            assert "x-client-request-id" not in r.headers  # not a plain id: not echoed


async def test_statuses_case_by_case(gw: Fleet, tiny: Path) -> None:
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant, models=["tiny"])
    await ready_model(gw, tiny)
    await gw.add_model("other", tiny, min_=1)
    await gw.wait_ready("other", 1)
    await router_caught_up(gw, 0)
    url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
    auth = {"Authorization": f"Bearer {key}"}
    msg = [{"role": "user", "content": "hi"}]
    big = "x" * (FAST_ROUTER.max_body_bytes + 10)
    cases = [
        ("no key is 401", {}, {"model": "tiny", "messages": msg}, 401),
        ("a wrong type is 400", auth, {"model": "tiny", "messages": "hi"}, 400),
        ("max_tokens zero is 400", auth, {"model": "tiny", "messages": msg, "max_tokens": 0}, 400),
        ("a model the key may not use is 403", auth, {"model": "other", "messages": msg}, 403),
        ("an unknown model is 404", auth, {"model": "ghost", "messages": msg}, 404),
        (
            "a body past the size limit is 413",
            auth,
            {"model": "tiny", "messages": [{"role": "user", "content": big}]},
            413,
        ),
        (
            "unknown fields are passed through",
            auth,
            {"model": "tiny", "messages": msg, "max_tokens": 2, "x_vendor_field": {"a": 1}},
            200,
        ),
    ]
    async with aiohttp.ClientSession() as s:
        for description, headers, body, status in cases:
            async with s.post(url, json=body, headers=headers) as r:
                assert r.status == status, f"{description}: got {r.status} {await r.text()}"
                if status >= 400:
                    assert (await r.json())["error"]["message"], description


async def test_limits_at_each_level_with_their_headers(gw: Fleet, tiny: Path) -> None:
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant, rpm=5)
    await set_event(gw.store, A.LIMIT_AGGREGATE, f"team:{tenant.team}", A.LimitSet(scope=f"team:{tenant.team}", rpm=3))
    await set_event(
        gw.store, A.LIMIT_AGGREGATE, f"org:{tenant.org}", A.LimitSet(scope=f"org:{tenant.org}", rpm=100, tpm=100_000)
    )
    await ready_model(gw, tiny)
    await router_caught_up(gw, 0)
    url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    seen = []
    async with aiohttp.ClientSession() as s:
        for _ in range(4):
            async with s.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
                seen.append((r.status, dict(r.headers)))
    # The team's 3 per minute is the level with least left: its figures are the ones advertised.
    assert [st for st, _ in seen] == [200, 200, 200, 429]
    assert [h["x-ratelimit-remaining-requests"] for _, h in seen[:3]] == ["2", "1", "0"]
    assert all(h["x-ratelimit-limit-requests"] == "3" for _, h in seen[:3])
    assert seen[0][1]["x-ratelimit-limit-tokens"] == "100000"
    refused = seen[3][1]
    assert int(refused["Retry-After"]) >= 1
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        err = (await r.json())["error"]
        assert r.status == 429 and f"team:{tenant.team} is at its limit of 3 requests per minute" in err["message"]
    with pytest.raises(openai.RateLimitError):
        await client(gw, key).chat.completions.create(**body)


async def test_two_routers_share_one_limit(store: EventStore, nats: NatsServer, tmp_path: Path, tiny: Path) -> None:
    f1 = await Fleet(store, nats.url, tmp_path / "a").start(services=GATEWAY, router=FAST_ROUTER)
    f2 = await Fleet(store, nats.url, tmp_path / "b").start(services=("router",), router=FAST_ROUTER)
    try:
        f1.agent("n1")
        tenant = await make_tenant(store)
        key, _ = await make_key(store, tenant)
        await set_event(
            store, A.LIMIT_AGGREGATE, f"project:{tenant.project}", A.LimitSet(scope=f"project:{tenant.project}", rpm=6)
        )
        await f1.add_model("tiny", tiny)
        await f1.wait_ready("tiny", 1)
        await router_caught_up(f1, 0)
        await f2.router_caught_up()
        scope = f"project:{tenant.project}"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        statuses = []
        async with aiohttp.ClientSession() as s:
            for i in range(10):
                port = (f1 if i % 2 == 0 else f2).port
                async with s.post(
                    f"http://127.0.0.1:{port}/v1/chat/completions",
                    json=body,
                    headers={"Authorization": f"Bearer {key}"},
                ) as r:
                    statuses.append(r.status)
                # Sequential requests: the next goes out once both routers count every admission so far.
                admitted = statuses.count(200)
                await wait_until(
                    lambda n=admitted: all(_used(f, scope) == n for f in (f1, f2)), what="both routers to agree"
                )
        assert statuses.count(200) == 6 and statuses.count(429) == 4
        # The router-only process is scraped like any other: its own counts on its admin port,
        # and no admin API there (that runs with the `api` service).
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{f2.admin_port}/metrics") as r:
                text = await r.text()
            assert r.status == 200
            assert 'llmgw_gateway_requests_total{model="tiny",status="200"} 3.0' in text
            assert 'llmgw_gateway_requests_total{model="tiny",status="429"} 2.0' in text
            assert 'llmgw_pool_saturation{model="tiny"} 0.0' in text, "nothing in flight once all were answered"
            async with s.get(f"http://127.0.0.1:{f2.admin_port}/api/v1/models") as r:
                assert r.status == 404
    finally:
        await f2.stop()
        await f1.stop()


def _used(fleet: Fleet, scope: str) -> int:
    """Requests the fleet's router counts against ``scope`` in the last minute (its own and gossiped)."""
    window = fleet.handles["router"].limiter.requests.get(scope)
    return window.used(time.time()) if window else 0


async def test_a_budget_is_never_overshot_by_concurrent_streaming_requests(gw: Fleet, tiny: Path) -> None:
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    # $1 per million tokens in and out; each request may cost up to (prompt×2 + 8 out) tokens.
    await set_event(
        gw.store,
        A.PRICE_AGGREGATE,
        "tiny",
        A.PriceSet(model="tiny", input_usd_per_m=1_000_000, output_usd_per_m=1_000_000),
    )
    budget = 200.0
    await set_event(
        gw.store,
        A.BUDGET_AGGREGATE,
        f"project:{tenant.project}",
        A.BudgetSet(scope=f"project:{tenant.project}", usd=budget, period="day"),
    )
    await ready_model(gw, tiny)
    await router_caught_up(gw, 0)
    c = client(gw, key)

    async def one() -> float | str:
        try:
            stream = await c.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hi there"}], max_tokens=8, stream=True
            )
            async for _ in stream:
                pass
            return "ok"
        except openai.RateLimitError as exc:
            # The scope by its path, as a person knows it, not its id.
            assert "project:acme/ml/chat has spent" in exc.message and tenant.project not in exc.message
            return "refused"

    results = await asyncio.gather(*(one() for _ in range(40)))
    assert "ok" in results and "refused" in results
    from llmgw.services.router.budgets import BudgetBook

    spent = await BudgetBook(gw.store.js).spent(f"project:{tenant.project}", "day")
    assert 0 < spent <= budget


async def test_requests_that_share_a_client_request_id_are_each_billed_and_never_overshoot_a_budget(
    gw: Fleet, tiny: Path
) -> None:
    # A client that sends one X-Request-Id with every request used to be billed once (the records were
    # de-duplicated on it) and its concurrent requests overwrote each other's budget hold.
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    await set_event(
        gw.store,
        A.PRICE_AGGREGATE,
        "tiny",
        A.PriceSet(model="tiny", input_usd_per_m=1_000_000, output_usd_per_m=1_000_000),
    )
    budget = 150.0
    scope = f"project:{tenant.project}"
    await set_event(gw.store, A.BUDGET_AGGREGATE, scope, A.BudgetSet(scope=scope, usd=budget, period="day"))
    await ready_model(gw, tiny)
    await router_caught_up(gw, 0)
    url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 8}
    headers = {"Authorization": f"Bearer {key}", "X-Request-Id": "same-1"}

    async with aiohttp.ClientSession() as s:

        async def one() -> tuple[int, str]:
            async with s.post(url, json=body, headers=headers) as r:
                assert r.headers["x-client-request-id"] == "same-1"
                await r.read()
                return r.status, r.headers["x-request-id"]

        answers = await asyncio.gather(*(one() for _ in range(30)))
    statuses = [status for status, _ in answers]
    assert 200 in statuses and 429 in statuses, statuses  # the budget ran out part way
    assert len({rid for _, rid in answers}) == 30  # each its own id

    async def all_recorded() -> list[UsageRecord] | None:
        found = [r for r in await usage_records(gw.store, tenant.project) if r.client_request_id == "same-1"]
        return found if len(found) == 30 else None

    records = await wait_until(all_recorded, what="a usage record for each of the 30 requests")
    assert sorted(r.request_id for r in records) == sorted(rid for _, rid in answers)
    assert sorted(r.status for r in records) == sorted(statuses)
    from llmgw.services.router.budgets import BudgetBook

    spent = await BudgetBook(gw.store.js).spent(scope, "day")
    billed = sum(r.cost_usd for r in records)
    assert 0 < spent <= budget
    assert round(spent, 2) == round(billed, 2)  # the budget book reconciles with the records

    # `ctl request same-1` finds the newest, and names the others by the gateway's ids.
    runner = gw.handles["runner"]
    assert await runner.wait_until("usage", (await gw.store.js.stream_info("LLMGW_USAGE")).state.last_seq, timeout=60)
    async with (
        aiohttp.ClientSession(headers=gw.api_headers()) as s,
        s.get(f"http://127.0.0.1:{gw.admin_port}/api/v1/requests/same-1") as r,
    ):
        assert r.status == 200, await r.text()
        found = await r.json()
    assert found["client_request_id"] == "same-1"
    assert sorted([found["request_id"], *found["same_client_request_id"]]) == sorted(rid for _, rid in answers)


async def test_a_request_without_a_key_is_answered_401_before_its_body_is_judged(gw: Fleet) -> None:
    url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
    async with aiohttp.ClientSession() as s:
        for data in (b"{not json", b"x" * (5 * 1024 * 1024)):  # malformed, and past the 4 MiB limit
            async with s.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
                assert r.status == 401, (r.status, await r.text())
                assert (await r.json())["error"]["code"] in ("missing_api_key", "invalid_api_key")


async def test_a_replica_killed_before_the_first_byte_is_retried_on_another(gw: Fleet, tiny: Path) -> None:
    gw.agent("n2")
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    await ready_model(gw, tiny, min_=2)
    await router_caught_up(gw, 0)
    replicas = await gw.ready("tiny")
    victim = replicas[0]
    # Stop the engine without telling anyone: the router still believes it is ready.
    os.killpg(victim["pid"], signal.SIGSTOP)
    os.killpg(victim["pid"], signal.SIGKILL)
    c = client(gw, key)
    for _ in range(4):  # whichever replica is tried first, every request is answered
        chat = await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert chat.usage.completion_tokens > 0


async def test_a_client_that_disconnects_mid_stream_is_recorded_as_499(gw: Fleet, tiny: Path) -> None:
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    await ready_model(gw, tiny)
    await router_caught_up(gw, 0)
    url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": 400,
        "ignore_eos": True,  # llama.cpp: generate all 400 unless stopped, so a short count proves the stop
        "stream": True,
    }
    [engine] = await gw.ready("tiny")
    async with aiohttp.ClientSession() as s:
        r = await s.post(url, json=body, headers={"Authorization": f"Bearer {key}", "X-Request-Id": "gone-1"})
        assert r.status == 200
        await r.content.readline()
        await r.content.readline()
        # The engine is paused while the client goes away, so the stream cannot finish first (the tiny
        # engine writes all 400 tokens in a tenth of a second); it resumes into a closed connection.
        os.killpg(engine["pid"], signal.SIGSTOP)
        try:
            r.close()  # the client goes away mid-stream
        finally:
            os.killpg(engine["pid"], signal.SIGCONT)

    async def record() -> UsageRecord | None:
        try:
            msg = await gw.store.js.get_last_msg("LLMGW_USAGE", f"llmgw.usage.{tenant.project}", direct=True)
        except nats.js.errors.NotFoundError:
            return None
        rec = msgspec.json.decode(msg.data, type=UsageRecord)
        return rec if rec.client_request_id == "gone-1" else None

    rec = await wait_until(record, what="the usage record of the disconnected request")
    assert rec.status == 499
    # The tokens it got: the tiny engine is fast enough to finish all 400 before the close reaches
    # it, so the count only says the record holds what was streamed, not that the engine was cut short.
    assert 0 < rec.tokens_out <= 400
    [replica] = await gw.ready("tiny")
    key = await gw.key(replica["id"])

    async def engine_idle() -> bool:
        return not await _slots_busy(replica, key)

    await wait_until(engine_idle, what="the engine to stop generating for the departed client")


async def _slots_busy(replica: dict, key: str) -> bool:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{replica['url']}/slots", headers={"Authorization": f"Bearer {key}"}) as r,
    ):
        assert r.status == 200
        return any(slot["is_processing"] for slot in await r.json())


async def test_a_revoked_key_is_refused(gw: Fleet, tiny: Path) -> None:
    tenant = await make_tenant(gw.store)
    key, key_id = await make_key(gw.store, tenant)
    await router_caught_up(gw, 0)
    c = client(gw, key)
    await c.models.list()
    await set_event(gw.store, A.KEY_AGGREGATE, key_id, A.KeyRevoked(key_id=key_id))

    async def refused() -> bool:
        try:
            await c.models.list()
        except openai.AuthenticationError:
            return True
        return False

    await wait_until(refused, deadline_s=2.0, what="the revoked key to be refused within 2 s")


async def test_a_usage_record_published_twice_is_stored_once(gw: Fleet) -> None:
    rec = UsageRecord(
        request_id="dup-1",
        at=msgspec.convert("2026-01-01T00:00:00Z", type=__import__("datetime").datetime),
        status=200,
        project_id="p",
    )
    for _ in range(2):
        await gw.store.js.publish("llmgw.usage.p", msgspec.json.encode(rec), headers={"Nats-Msg-Id": "dup-1"})
    info = await gw.store.js.stream_info("LLMGW_USAGE")
    assert info.state.messages == 1


async def test_a_stopped_model_is_answered_at_once_with_its_reason(gw: Fleet, tiny: Path) -> None:
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    await ready_model(gw, tiny)
    await gw.command("stop", M.StopModel(name="tiny"))
    await router_caught_up(gw, 0)
    url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            url,
            json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": f"Bearer {key}"},
        ) as r,
    ):
        assert r.status == 503
        assert "Retry-After" not in r.headers
        assert "stopped by an administrator" in (await r.json())["error"]["message"]


@contextlib.asynccontextmanager
async def on_demand(
    store: EventStore, nats: NatsServer, base: Path, tiny: Path, idle_s: float
) -> AsyncIterator[tuple[Fleet, str]]:
    """A gateway whose scheduler stops an idle on-demand replica after ``idle_s``, with model ``lazy``
    (min 0, max 1) and a key for it; no agent yet."""
    from tests.fleet import FAST

    sched = msgspec.structs.replace(FAST, idle_s=idle_s)
    gw = await Fleet(store, nats.url, base).start(services=GATEWAY, router=FAST_ROUTER, scheduler=sched)
    try:
        tenant = await make_tenant(store)
        key, _ = await make_key(store, tenant)
        await gw.add_model("lazy", tiny, min_=0, max_=1)
        await router_caught_up(gw, 0)
        yield gw, key
    finally:
        await gw.stop()


def ask_lazy(gw: Fleet, key: str) -> Awaitable[Any]:
    return client(gw, key).chat.completions.create(
        model="lazy", messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )


async def test_an_on_demand_model_starts_on_the_first_request_and_returns_to_zero(
    store: EventStore, nats: NatsServer, tmp_path: Path, tiny: Path
) -> None:
    async with on_demand(store, nats, tmp_path, tiny, idle_s=2.0) as (gw, key):
        gw.agent("n1")
        assert await gw.active("lazy") == []
        chat = await ask_lazy(gw, key)
        assert chat.usage.completion_tokens > 0  # held until a replica was ready, then answered

        async def idle_stopped() -> bool:
            reps = [r for r in (await gw.replicas()).values() if r["model"] == "lazy"]
            return bool(reps) and all(r["state"] == "stopped" for r in reps)

        await wait_until(idle_stopped, deadline_s=30, what="the idle on-demand replica to stop")


async def test_a_request_held_longer_than_the_idle_time_keeps_its_on_demand_replica_until_it_is_served(
    store: EventStore, nats: NatsServer, tmp_path: Path, tiny: Path
) -> None:
    # The request arrives before any node: the replica starts later than idle_s after it. A held
    # request is demand all the while, so the new replica is not stopped as idle before it answers.
    idle_s = 1.0
    async with on_demand(store, nats, tmp_path, tiny, idle_s) as (gw, key):
        asked = asyncio.create_task(ask_lazy(gw, key))
        scheduler = gw.handles["scheduler"]
        await wait_until(lambda: "lazy" in scheduler.state.demand, what="the scheduler to hear of the request")
        first_asked = scheduler.state.demand["lazy"]
        await wait_until(lambda: time.time() - first_asked > 2 * idle_s, what="the idle time to pass")
        gw.agent("n1")
        chat = await asked
        assert chat.usage.completion_tokens > 0


def test_error_bodies_are_in_openai_shape() -> None:
    from llmgw.services.router.app import ApiError

    resp = ApiError(429, "slow down", "rate_limited", {"retry-after": "3"}).response("r1")
    body = json.loads(resp.body)
    assert body == {
        "error": {"message": "slow down", "type": "rate_limit_error", "param": None, "code": "rate_limited"}
    }
    assert resp.headers["retry-after"] == "3"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
bodies = st.one_of(
    st.binary(max_size=200),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {"model": json_values | st.just("tiny"), "messages": json_values},
        optional={"stream": json_values, "max_tokens": json_values, "extra": json_values},
    ).map(lambda v: json.dumps(v).encode()),
)


async def test_malformed_requests_never_get_a_500_or_hurt_the_gateway(gw: Fleet, tiny: Path) -> None:
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    await gw.router_caught_up()
    url = f"http://127.0.0.1:{gw.port}"
    statuses: set[int] = set()
    async with aiohttp.ClientSession() as s:

        async def post(path: str, data: bytes) -> None:
            async with s.post(url + path, data=data, headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status < 500 or r.status == 503, f"{path} {data[:100]!r} → {r.status} {await r.text()}"
                statuses.add(r.status)
                if r.status >= 400:
                    assert (await r.json())["error"]["message"]

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]), data=bodies)
        def check(path: str, data: bytes) -> None:
            # Hypothesis drives a synchronous function: it draws the inputs, the loop below sends them.
            pending.append((path, data))

        pending: list[tuple[str, bytes]] = []
        check()
        for path, data in pending:
            await post(path, data)
        async with s.get(url + "/healthz") as r:
            assert r.status == 200
    assert 400 in statuses


async def test_a_model_that_cannot_answer_falls_back_to_the_next(gw: Fleet, tiny: Path) -> None:
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    await ready_model(gw, tiny, name="backup")
    await gw.add_model("primary", tiny, fallbacks=["backup"])
    await gw.wait_ready("primary", 1)
    await gw.command("stop", M.StopModel(name="primary"))
    await gw.router_caught_up()
    url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
    body = {"model": "primary", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with (
        aiohttp.ClientSession() as s,
        s.post(url, json=body, headers={"Authorization": f"Bearer {key}", "X-Request-Id": "fb-1"}) as r,
    ):
        assert r.status == 200, await r.text()

    async def record() -> UsageRecord | None:
        try:
            msg = await gw.store.js.get_last_msg("LLMGW_USAGE", f"llmgw.usage.{tenant.project}", direct=True)
        except nats.js.errors.NotFoundError:
            return None  # not published yet: records leave the request path through a queue
        rec = msgspec.json.decode(msg.data, type=UsageRecord)
        return rec if rec.client_request_id == "fb-1" else None

    rec = await wait_until(record, what="the fallback request's usage record")
    assert (rec.model_asked, rec.model_served) == ("primary", "backup")


async def test_requests_past_the_slots_wait_in_the_gateway_and_are_served_fairly_across_projects(
    gw: Fleet, tiny: Path
) -> None:
    acme, beta = await make_tenant(gw.store, "acme"), await make_tenant(gw.store, "beta")
    key_a, _ = await make_key(gw.store, acme)
    key_b, _ = await make_key(gw.store, beta)
    profile = M.Profile(engine="llamacpp", cpu_cores=1, min_memory_gb=0.05, ctx_size=1024, parallel=1)
    await gw.command("add", M.AddModel(spec=M.ModelSpec(name="one", source=str(tiny), profiles=[profile])))
    [replica] = await gw.wait_ready("one", 1)
    await router_caught_up(gw, 0)
    router = gw.handles["router"]
    rid = replica["id"]
    served: list[str] = []  # the projects of queued requests, in the order the queue let them go
    real_wait = router.gate.wait

    async def wait(model: str, project: str, gone: Any) -> float:
        waited = await real_wait(model, project, gone)
        served.append("acme" if project == acme.project else "beta")
        return waited

    router.gate.wait = wait
    registry = router.metrics.registry
    url = f"http://127.0.0.1:{gw.port}/v1/chat/completions"
    body = {"model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def depth() -> float | None:
        return registry.get_sample_value("llmgw_gateway_queue_depth", {"model": "one"})

    # The one slot is held while the requests line up (the tiny engine answers faster than a test can
    # queue behind a real request): acme's burst of six first, then beta's two.
    router.outstanding[rid] = router.outstanding.get(rid, 0) + 1
    async with aiohttp.ClientSession() as s:

        async def ask(key: str, cid: str) -> tuple[int, dict[str, str], dict[str, Any]]:
            async with s.post(url, json=body, headers={"Authorization": f"Bearer {key}", "X-Request-Id": cid}) as r:
                return r.status, dict(r.headers), await r.json()

        burst = [asyncio.create_task(ask(key_a, f"a{i}")) for i in range(6)]
        await wait_until(lambda: depth() == 6, what="acme's six requests waiting")
        trickle = [asyncio.create_task(ask(key_b, f"b{i}")) for i in range(2)]
        await wait_until(lambda: depth() == 8, what="beta's two waiting behind them")

        # A full queue answers at once, naming the model, with when to come back.
        router.gate.max_per_model = 8
        status, headers, answer = await ask(key_b, "full")
        assert status == 429 and answer["error"]["code"] == "queue_full", answer
        assert "model one's queue is full (8 waiting)" in answer["error"]["message"]
        assert int(headers["Retry-After"]) >= 1
        router.gate.max_per_model = FAST_ROUTER.queue_max_per_model

        # A client that leaves while waiting leaves the queue at once and takes no slot.
        gone = asyncio.create_task(ask(key_b, "gone"))
        await wait_until(lambda: depth() == 9, what="the request that will leave to be waiting")
        gone.cancel()  # the client gives up: its connection closes
        with contextlib.suppress(asyncio.CancelledError):
            await gone
        await wait_until(lambda: depth() == 8, what="the departed request to leave the queue")

        # One that finds no slot within the queue's deadline is answered 503, with when to come back.
        router.gate.wait_s = 0.3
        status, headers, answer = await ask(key_b, "late")
        assert status == 503 and answer["error"]["code"] == "queue_timeout", answer
        assert "model one had no free slot within 0.3 s (8 still waiting)" in answer["error"]["message"]
        assert int(headers["Retry-After"]) >= 1
        router.gate.wait_s = FAST_ROUTER.queue_wait_s

        router.outstanding[rid] -= 1
        router.gate.released("one")
        answers = await asyncio.gather(*burst, *trickle)
    assert [status for status, _, _ in answers] == [200] * 8, answers
    assert served == ["acme", "beta", "acme", "beta", "acme", "acme", "acme", "acme"], served
    assert depth() == 0 and router.gate.granted.get("one", 0) == 0 and router.outstanding[rid] == 0
    assert registry.get_sample_value("llmgw_gateway_queue_wait_seconds_count", {"model": "one"}) == 8
    for reason in ("queue_full", "timeout"):
        rejected = {"model": "one", "reason": reason}
        assert registry.get_sample_value("llmgw_gateway_queue_rejections_total", rejected) == 1

    async def recorded() -> dict[str, UsageRecord] | None:
        got = {
            r.client_request_id: r
            for t in (acme, beta)
            for r in await usage_records(gw.store, t.project)
            if r.client_request_id
        }
        return got if len(got) == 11 else None

    records = await wait_until(recorded, what="a usage record for each request")
    assert all(records[f"a{i}"].queue_s > 0 and records[f"a{i}"].status == 200 for i in range(6))
    left = records["gone"]
    assert (left.status, left.replica_id, left.cost_usd, left.tokens_in) == (499, None, 0.0, 0)
    assert "waited in the queue" in (left.error or "")
    assert (records["full"].status, records["full"].replica_id) == (429, None)
    assert (records["late"].status, records["late"].cost_usd) == (503, 0.0)


async def test_the_gateway_weighs_each_engine_by_the_load_its_agent_reports(gw: Fleet, tiny: Path) -> None:
    await ready_model(gw, tiny)
    [replica] = await gw.ready("tiny")
    router = gw.handles["router"]

    def reported() -> Any:
        return router.engines.get(replica["id"])

    engine = await wait_until(reported, deadline_s=30, what="the agent's heartbeat to carry the engine's load")
    assert not engine.unreachable and engine.waiting == 0
    assert engine.slots == 2, "the engine's own slot count (the profile's parallel), as its agent read it"
