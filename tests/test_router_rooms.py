"""The router's layers one by one: admission in the documented order, budget holds settled in the
period they were taken in (a real router on a real nats-server, a real llama.cpp engine), and
table tests for the pure parts — the sliding window, the limiter, replica order and affinity."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import msgspec
import nats.js.errors
import pytest
from aiohttp import web

from llmgw.events.folds import models as MF
from llmgw.events.runtime.secrets import engine_key, engine_key_secret
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import access as A
from llmgw.events.schema import models as M
from llmgw.events.schema import replicas as R
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.subjects import event_subject
from llmgw.services.router import admission as adm
from llmgw.services.router.app import Router, RouterConfig
from llmgw.services.router.budgets import BUCKET, BudgetExceeded, Entry
from llmgw.services.router.limits import Level, Limiter, Window
from llmgw.services.router.routing import Affinity, order, prefix_key
from llmgw.services.router.state import KeyInfo, ModelInfo, Price, ReplicaInfo
from llmgw.services.router.usage_record import Call, call_cost, usage_record
from tests.gguf_tiny import write_tiny_gguf
from tests.support import free_port, wait_until

PROJECT = "p-rooms"
SCOPE = f"project:{PROJECT}"


class Clock:
    """The router's wall clock, moved by the test: no real waiting for midnight."""

    def __init__(self, at: datetime) -> None:
        self.now = at.timestamp()

    def __call__(self) -> float:
        return self.now


async def _append(store: EventStore, aggregate: str, agg_id: str, *payloads: msgspec.Struct) -> None:
    await store.append(event_subject(aggregate, agg_id), [NewEvent(payload=p, actor="user:test") for p in payloads])


async def _tenant_and_key(store: EventStore, **key_fields) -> str:
    await _append(
        store,
        T.AGGREGATE,
        T.TREE_ID,
        T.OrgCreated(org_id="o-rooms", name="rooms"),
        T.TeamCreated(team_id="t-rooms", org_id="o-rooms", name="ml"),
        T.ProjectCreated(project_id=PROJECT, team_id="t-rooms", name="chat"),
    )
    key, prefix, digest = A.make_api_key()
    created = A.KeyCreated(
        key_id=f"key_{prefix}", prefix=prefix, secret_sha256=digest, project_id=PROJECT, name="t", **key_fields
    )
    await _append(store, A.KEY_AGGREGATE, f"key_{prefix}", created)
    return key


def _spec(name: str) -> M.ModelSpec:
    profile = M.Profile(engine="llamacpp", ctx_size=1024, parallel=2)
    return M.ModelSpec(name=name, source=f"test:{name}", scaling=M.Scaling(min=1), profiles=[profile])


class Served(msgspec.Struct):
    router: Router
    url: str


@pytest.fixture
async def served() -> AsyncIterator[list[tuple[Served, web.AppRunner]]]:
    """Routers started by a test (``_start``), each on its own port; stopped afterwards."""
    started: list[tuple[Served, web.AppRunner]] = []
    yield started
    for s, runner in started:
        await runner.cleanup()
        await s.router.stop()


async def _start(store: EventStore, started: list, clock: Clock | None = None) -> Served:
    cfg = RouterConfig(activation_s=60.0, first_token_s=20.0, idle_s=20.0, total_s=60.0)
    router = Router(store, cfg, clock=clock) if clock else Router(store, cfg)
    await router.start()
    runner = web.AppRunner(router.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    served = Served(router=router, url=f"http://127.0.0.1:{port}")
    started.append((served, runner))
    return served


async def _caught_up(store: EventStore, router: Router) -> None:
    last = await store.stream_last_seq()
    await wait_until(lambda: router.state.position >= last, what="the router to read the log")


async def _book(store: EventStore, day: str) -> Entry | None:
    try:
        kv = await store.js.key_value(BUCKET)
        got = await kv.get(f"{SCOPE.replace(':', '_')}.{day}")
    except (nats.js.errors.BucketNotFoundError, nats.js.errors.KeyNotFoundError):
        return None
    return msgspec.json.decode(got.value or b"{}", type=Entry)


# -- the two defects -------------------------------------------------------------------------------


async def test_a_stopped_model_is_answered_with_its_reason_before_limits_and_budget_are_spent(
    store: EventStore, served: list
) -> None:
    key = await _tenant_and_key(store, rpm=1)
    # Any request costs more than the budget allows: $1 per token against a $0.000001 budget.
    await _append(store, A.PRICE_AGGREGATE, "tiny", A.PriceSet(model="tiny", input_usd_per_m=1e6, output_usd_per_m=1e6))
    await _append(store, A.BUDGET_AGGREGATE, SCOPE, A.BudgetSet(scope=SCOPE, usd=0.000001, period="day"))
    await _append(
        store, M.AGGREGATE, "tiny", M.ModelAdded(spec=_spec("tiny")), M.ModelStopped(saved_min=1, saved_max=1)
    )
    gw = await _start(store, served)
    await _caught_up(store, gw.router)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    seen = []
    async with aiohttp.ClientSession() as s:
        for _ in range(3):
            async with s.post(
                f"{gw.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            ) as r:
                seen.append((r.status, (await r.json())["error"]["code"], dict(r.headers)))
    # The key's 1 request a minute and the budget are untouched: the model's state is the answer.
    assert [(st, code) for st, code, _ in seen] == [(503, "model_stopped")] * 3
    assert all("x-ratelimit-remaining-requests" not in h for _, _, h in seen)
    assert all(w.used(gw.router.clock()) == 0 for w in gw.router.limiter.requests.values())
    today = datetime.fromtimestamp(gw.router.clock(), UTC).strftime("%Y-%m-%d")
    entry = await _book(store, today)
    assert entry is None or (entry.spent == 0 and not entry.holds)


def _launch_engine(tmp_path: Path, replica_id: str, secret: bytes) -> tuple[subprocess.Popen, str]:
    from llmgw.agent.engines.commands import llamacpp_launch

    port = free_port()
    launch = llamacpp_launch(
        str(write_tiny_gguf(tmp_path / "tiny.gguf")),
        host="127.0.0.1",
        port=port,
        threads=1,
        parallel=2,
        ctx_size=1024,
        key=engine_key(secret, replica_id),
        alias="tiny",
        llama_server_binary=None,
        python=sys.executable,
    )
    log = open(tmp_path / "engine.log", "wb")
    proc = subprocess.Popen(launch.argv, env={**os.environ, **launch.env}, stdout=log, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


async def _healthy(url: str) -> bool:
    try:
        async with aiohttp.ClientSession() as s, s.get(url + "/health") as r:
            return r.status == 200
    except aiohttp.ClientError:
        return False


async def test_a_budget_hold_taken_before_midnight_is_settled_in_that_day(
    store: EventStore, served: list, tmp_path: Path
) -> None:
    key = await _tenant_and_key(store)
    await _append(store, A.PRICE_AGGREGATE, "tiny", A.PriceSet(model="tiny", input_usd_per_m=1.0, output_usd_per_m=1.0))
    await _append(store, A.BUDGET_AGGREGATE, SCOPE, A.BudgetSet(scope=SCOPE, usd=100.0, period="day"))
    secret = await engine_key_secret(store.js)
    engine, engine_url = _launch_engine(tmp_path, "r-tiny-1", secret)
    try:
        await wait_until(lambda: _healthy(engine_url), deadline_s=60, what="the llama.cpp engine to answer /health")
        # The replica is placed, not ready: an admitted request waits for it, its budget held.
        profile = _spec("tiny").profiles[0]
        await _append(store, M.AGGREGATE, "tiny", M.ModelAdded(spec=_spec("tiny")))
        placed = R.ReplicaPlaced(
            replica_id="r-tiny-1", model="tiny", node_id="n1", source="test:tiny", profile=profile, spec_hash=""
        )
        await _append(store, R.AGGREGATE, "r-tiny-1", placed)
        clock = Clock(datetime(2026, 12, 1, 23, 59, 59, tzinfo=UTC))
        gw = await _start(store, served, clock)
        await _caught_up(store, gw.router)

        async def ask() -> tuple[int, dict]:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
            async with (
                aiohttp.ClientSession() as s,
                s.post(f"{gw.url}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r,
            ):
                return r.status, await r.json()

        request = asyncio.create_task(ask())
        held = await wait_until(lambda: _book(store, "2026-12-01"), what="the request's hold on 2026-12-01")
        assert len(held.holds) == 1 and held.spent == 0
        clock.now = datetime(2026, 12, 2, 0, 0, 1, tzinfo=UTC).timestamp()  # the request ends the next day
        ready = R.ReplicaReady(replica_id="r-tiny-1", node_id="n1", pid=engine.pid, port=0, url=engine_url)
        await _append(store, R.AGGREGATE, "r-tiny-1", ready)
        status, answer = await asyncio.wait_for(request, 60)
        assert status == 200, answer
        spent = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        day = await wait_until(
            lambda: _settled(store, "2026-12-01"), what="the hold settled against the day it was taken"
        )
        assert day.spent == pytest.approx(spent / 1e6)
        assert await _book(store, "2026-12-02") is None, "the next day is untouched"
    finally:
        engine.terminate()
        engine.wait(10)


async def _settled(store: EventStore, day: str) -> Entry | None:
    entry = await _book(store, day)
    return entry if entry is not None and not entry.holds else None


# -- tables: the pure parts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("adds", "at", "used", "reset_in"),
    [
        ([], 100.0, 0, 0.0),
        ([(100.0, 1)], 100.5, 1, 59.5),
        ([(100.0, 1)], 159.9, 1, pytest.approx(0.1)),
        ([(100.0, 1)], 160.0, 0, 0.0),  # a minute later the second it was counted in has left
        ([(100.0, 2), (100.9, 3)], 101.0, 5, 59.0),  # one bucket per second
        ([(100.0, 1), (130.0, 2)], 140.0, 3, 20.0),
        ([(100.0, 1), (130.0, 2)], 161.0, 2, 29.0),  # the oldest left, the newer still counts
        ([(100.0, 2), (160.0, 3)], 160.0, 3, 60.0),  # the same bucket a minute on starts again
    ],
)
def test_the_sliding_window_counts_the_last_sixty_seconds(
    adds: list[tuple[float, int]], at: float, used: int, reset_in: float
) -> None:
    w = Window()
    for t, n in adds:
        w.add(t, n)
    assert w.used(at) == used
    assert w.reset_in(at) == reset_in


KEY, TEAM = Level(scope="key:k", rpm=5, tpm=None), Level(scope="team:t", rpm=3, tpm=None)
TOKENS = Level(scope="org:o", rpm=None, tpm=100)


@pytest.mark.parametrize(
    ("levels", "admitted", "spent", "tokens", "allowed", "headers", "retry_after"),
    [
        # The level with least left after this request is the one advertised.
        ([KEY, TEAM], 0, 0, 1, True, {"x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "2"}, 0),
        ([KEY, TEAM], 2, 0, 1, True, {"x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "0"}, 0),
        # Full: refused, told to come back when the oldest admission leaves the minute (at 0 + 60).
        ([KEY, TEAM], 3, 0, 1, False, {"x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "0"}, 50),
        ([KEY], 3, 0, 1, True, {"x-ratelimit-limit-requests": "5", "x-ratelimit-remaining-requests": "1"}, 0),
        ([TOKENS], 0, 60, 30, True, {"x-ratelimit-limit-tokens": "100", "x-ratelimit-remaining-tokens": "10"}, 0),
        ([TOKENS], 0, 90, 30, False, {"x-ratelimit-limit-tokens": "100", "x-ratelimit-remaining-tokens": "0"}, 50),
        # A first request larger than the whole minute's tokens still runs: nothing was spent yet.
        ([TOKENS], 0, 0, 500, True, {"x-ratelimit-limit-tokens": "100", "x-ratelimit-remaining-tokens": "0"}, 0),
    ],
)
def test_the_limiter_admits_within_every_level_and_advertises_the_tightest(
    levels: list[Level],
    admitted: int,
    spent: int,
    tokens: int,
    allowed: bool,
    headers: dict[str, str],
    retry_after: int,
) -> None:
    limiter = Limiter()
    for _ in range(admitted):
        limiter.admit(levels, 0.0)
    limiter.spend_tokens(levels, 0.0, spent)
    verdict = limiter.check(levels, 10.0, tokens)
    assert verdict.allowed is allowed
    assert {k: v for k, v in verdict.headers.items() if k in headers} == headers
    assert verdict.retry_after_s == retry_after


def test_gossip_from_another_router_counts_against_the_same_limit() -> None:
    limiter = Limiter()
    limiter.merge("team:t", 0.0, 3, 0)
    assert not limiter.check([TEAM], 1.0, 1).allowed
    assert limiter.check([TEAM], 61.0, 1).allowed, "what was merged leaves the window like the rest"


def _r(rid: str) -> ReplicaInfo:
    return ReplicaInfo(replica_id=rid, model="m", node_id="n", state="ready", url=f"http://{rid}")


@pytest.mark.parametrize(
    ("outstanding", "preferred", "expected"),
    [
        ({"a": 2, "b": 0, "c": 1}, None, ["b", "c", "a"]),  # least outstanding first
        ({"a": 2, "b": 0, "c": 1}, "a", ["a", "b", "c"]),  # the prefix's replica first while it has room
        ({"a": 3, "b": 0, "c": 1}, "a", ["a", "b", "c"]),
        ({"a": 4, "b": 0, "c": 1}, "a", ["b", "c", "a"]),  # saturated (4 in flight): affinity lets go
        ({"a": 9, "b": 0, "c": 1}, "gone", ["b", "c", "a"]),  # a replica no longer there is no preference
    ],
)
def test_replicas_are_tried_least_loaded_first_with_affinity_until_saturation(
    outstanding: dict[str, int], preferred: str | None, expected: list[str]
) -> None:
    for seed in (0, 1, 2, 65535):
        ranked = order([_r("a"), _r("b"), _r("c")], outstanding, preferred, 4, seed)
        assert [r.replica_id for r in ranked] == expected


def test_equally_loaded_replicas_are_spread_by_the_seed() -> None:
    firsts = {order([_r("a"), _r("b"), _r("c")], {}, None, 4, seed)[0].replica_id for seed in range(64)}
    assert firsts == {"a", "b", "c"}


def test_affinity_remembers_the_last_replica_per_prefix_and_forgets_the_oldest() -> None:
    system = "You are a helpful assistant. " * 20  # past the 512 characters a prefix is
    k1, k2 = prefix_key(system + "Why is the sky blue?"), prefix_key(system + "What is rain?")
    assert k1 == k2, "only the first 512 characters count"
    assert prefix_key("short") is None, "too short to share a useful prefix"
    other, third = prefix_key("z" * 40), prefix_key("w" * 40)
    aff = Affinity(size=2)
    assert aff.get(None) is None
    aff.put(k1, "a")
    aff.put(k1, "b")
    assert aff.get(k2) == "b", "the replica that served the prefix last"
    aff.put(other, "c")
    aff.get(k1)  # used: kept, so the other is now the oldest
    aff.put(third, "d")
    assert (aff.get(k1), aff.get(other), aff.get(third)) == ("b", None, "d")


class FakeView:
    """The fold admission reads, as plain data."""

    def __init__(self, key: KeyInfo, models: list[ModelInfo], ready: dict[str, int], starting: dict[str, int]) -> None:
        self.keys = {key.prefix: key}
        self.models = {m.name: m for m in models}
        self.limits: dict[str, tuple[int | None, int | None]] = {f"key:{key.id}": (key.rpm, None)}
        self._ready, self._starting = ready, starting

    def resolve(self, name: str) -> ModelInfo | None:
        return self.models.get(name)

    def ready(self, model: str) -> list[ReplicaInfo]:
        return [_r(f"{model}-{i}") for i in range(self._ready.get(model, 0))]

    def starting(self, model: str) -> int:
        return self._starting.get(model, 0)

    def scopes_of(self, key: KeyInfo) -> list[str]:
        return [f"key:{key.id}", f"project:{key.project_id}"]


def _model(name: str, *, fallbacks: tuple[str, ...] = (), min_: int = 1, **status) -> ModelInfo:
    spec = M.ModelSpec(
        name=name,
        source=f"test:{name}",
        scaling=M.Scaling(min=min_),
        profiles=[M.Profile(engine="llamacpp")],
        fallbacks=list(fallbacks),
    )
    return ModelInfo(name=name, status=MF.ModelStatus(spec=spec, min=min_, **status))


SECRET, PREFIX, DIGEST = A.make_api_key()
FULL_KEY = KeyInfo(id="k", prefix=PREFIX, secret_sha256=DIGEST, project_id="p", rpm=0, models=["m", "b"])
ROOMY_KEY = msgspec.structs.replace(FULL_KEY, rpm=10)


@pytest.mark.parametrize(
    ("auth", "asked", "key", "models", "ready", "usage", "layer", "code"),
    [
        ("", "m", FULL_KEY, [_model("m", stopped=True)], {}, None, "key", "missing_api_key"),
        (f"Bearer {SECRET}x", "m", FULL_KEY, [_model("m", stopped=True)], {}, None, "key", "invalid_api_key"),
        (f"Bearer {SECRET}", "m", FULL_KEY, [_model("m")], {}, "usage cannot be kept", "usage", "usage_unavailable"),
        (f"Bearer {SECRET}", "nope", FULL_KEY, [_model("m", stopped=True)], {}, None, "model", "model_not_found"),
        (f"Bearer {SECRET}", "x", FULL_KEY, [_model("x")], {"x": 1}, None, "model", "model_not_allowed"),
        # Stopped, parked, nothing to run on: the model's state, though the key has no requests left.
        (f"Bearer {SECRET}", "m", FULL_KEY, [_model("m", stopped=True)], {}, None, "servable", "model_stopped"),
        (f"Bearer {SECRET}", "m", FULL_KEY, [_model("m", parked="it crashed")], {}, None, "servable", "model_parked"),
        (f"Bearer {SECRET}", "m", FULL_KEY, [_model("m")], {}, None, "servable", "no_replica"),
        # Servable (ready, on demand, or through a fallback): now the limits speak.
        (f"Bearer {SECRET}", "m", FULL_KEY, [_model("m")], {"m": 1}, None, "limits", "rate_limited"),
        (f"Bearer {SECRET}", "m", FULL_KEY, [_model("m", min_=0)], {}, None, "limits", "rate_limited"),
        (
            f"Bearer {SECRET}",
            "m",
            FULL_KEY,
            [_model("m", fallbacks=("b",), stopped=True), _model("b")],
            {"b": 1},
            None,
            "limits",
            "rate_limited",
        ),
        (f"Bearer {SECRET}", "m", ROOMY_KEY, [_model("m")], {"m": 1}, None, None, None),
    ],
)
def test_admission_refuses_at_the_first_layer_in_the_documented_order(
    auth: str,
    asked: str,
    key: KeyInfo,
    models: list[ModelInfo],
    ready: dict[str, int],
    usage: str | None,
    layer: str | None,
    code: str | None,
) -> None:
    view = FakeView(key, models, ready, {})
    verdict = adm.admit(auth, asked, 10, view, Limiter(), 1000.0, usage)
    got = (verdict.refusal.layer, verdict.refusal.code) if verdict.refusal else (None, None)
    assert got == (layer, code)
    if layer is None:
        assert verdict.levels and verdict.headers["x-ratelimit-remaining-requests"] == "9"


def test_a_model_refused_for_want_of_a_replica_is_asked_for_and_a_stopped_one_is_not() -> None:
    view = FakeView(FULL_KEY, [_model("m", fallbacks=("b",), stopped=True), _model("b")], {}, {})
    verdict = adm.admit(f"Bearer {SECRET}", "m", 1, view, Limiter(), 0.0)
    assert verdict.refusal is not None and verdict.refusal.code == "no_replica", "the last model's reason"
    assert verdict.wanted == ["b"]


def test_an_expired_key_is_refused_by_the_clock_it_is_given() -> None:
    key = msgspec.structs.replace(ROOMY_KEY, expires_at=datetime.fromtimestamp(500.0, UTC))
    assert isinstance(adm.authenticate(f"Bearer {SECRET}", {PREFIX: key}, 499.0), KeyInfo)
    refused = adm.authenticate(f"Bearer {SECRET}", {PREFIX: key}, 500.0)
    assert isinstance(refused, adm.Refusal) and refused.code == "expired_api_key"


@pytest.mark.parametrize(
    ("status", "billed_in", "charged"),
    [
        (200, 1000, 1000 * 1.0 + 10 * 2.0),  # answered: prompt and output
        (499, 1000, 1000 * 1.0 + 10 * 2.0),  # the client left: what the engine did
        (502, 0, 10 * 2.0),  # the engine failed: only what reached the client, no estimated prompt
        (504, 0, 10 * 2.0),
        (429, 0, 0.0),  # refused before any engine: nothing
    ],
)
def test_a_call_is_charged_for_the_tokens_its_record_shows(status: int, billed_in: int, charged: float) -> None:
    call = Call(request_id="r", started=0.0, at=datetime(2026, 12, 1, tzinfo=UTC), endpoint="chat")
    call.model, call.status, call.tokens_in, call.tokens_out = _model("m"), status, 1000, 10
    record = usage_record(call, [], 0.1, "router-1")
    price = Price(input_usd_per_m=1e6, output_usd_per_m=2e6)  # a dollar a prompt token, two an output one
    assert record.tokens_in == billed_in
    assert call_cost(call, price) == pytest.approx(charged)


@pytest.mark.parametrize(
    ("now", "period", "wait"),
    [
        ("2026-03-14T23:59:30", "day", 30),  # the day ends in half a minute
        ("2026-03-14T00:00:00", "day", 86400),
        ("2026-03-31T12:00:00", "month", 12 * 3600),
        ("2026-12-31T23:00:00", "month", 3600),  # December's end is next year's start
        ("2026-02-01T00:00:00", "month", 28 * 86400),
    ],
)
def test_an_exhausted_budget_says_to_retry_when_its_period_ends(now: str, period: str, wait: int) -> None:
    at = datetime.fromisoformat(now).replace(tzinfo=UTC).timestamp()
    exc = BudgetExceeded("project:p", budget=10.0, period=period, spent=9.99, held=0.0, need=0.5)
    refusal = adm.over_budget(exc, at, "project:acme/ml/chat")
    assert (refusal.status, refusal.code) == (429, "budget_exceeded")
    assert refusal.message.startswith(f"project:acme/ml/chat has spent $9.9900 of its $10.00 {period} budget")
    assert refusal.headers["retry-after"] == str(wait)


def test_a_budget_hold_covers_the_whole_prompt_and_every_output_token_it_may_ask_for() -> None:
    body = {
        "model": "m",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}],
        "max_tokens": 10,
    }
    price = Price(input_usd_per_m=1e6, output_usd_per_m=2e6)  # a dollar a prompt token, two an output one
    endpoint = "/v1/chat/completions"
    prompt = "be brief\nhéllo"
    # 15 bytes of text, 16 a message, 16 more: 63 prompt tokens at most; 10 output tokens.
    assert adm.most_it_may_cost(body, endpoint, _model("m"), price, 4096) == 63 + 2 * 10
    assert adm.most_it_may_cost(body, endpoint, _model("m"), price, 4096, prompt) == 63 + 2 * 10, "text found once"
    no_max = {k: v for k, v in body.items() if k != "max_tokens"}
    assert adm.most_it_may_cost(no_max, endpoint, _model("m"), price, 4096, prompt) == 63 + 2 * 4096
    # Three answers are three times the output (an engine honours n); the prompt is read once.
    assert adm.most_it_may_cost({**body, "n": 3}, endpoint, _model("m"), price, 4096, prompt) == 63 + 3 * 2 * 10
    completion = {"model": "m", "prompt": "héllo", "max_tokens": 10, "best_of": 4, "n": 2}
    assert adm.most_it_may_cost(completion, "/v1/completions", _model("m"), price, 4096) == (6 + 16 + 16) + 4 * 2 * 10


def test_a_budget_full_only_of_running_requests_holds_says_to_retry_in_seconds() -> None:
    # $6 spent, $3 held by requests still running, $2 asked: once they settle there is room again.
    exc = BudgetExceeded("project:p", budget=10.0, period="day", spent=6.0, held=3.0, need=2.0)
    refusal = adm.over_budget(exc, datetime(2026, 3, 14, 1, tzinfo=UTC).timestamp(), "project:acme/ml/chat")
    assert refusal.headers["retry-after"] == str(adm.HELD_RETRY_S)
