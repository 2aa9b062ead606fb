"""Models served outside the cluster (GW-12): a real gateway in front of small OpenAI-compatible
providers started here, which check their own keys and record which key each request used."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats.js.errors
import pytest
from aiohttp import web

from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.folds import models as MF
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import models as M
from llmgw.events.schema.usage import UsageRecord
from llmgw.services.catalog.rules import Catalog, decide
from llmgw.services.router import external as X
from llmgw.services.router.state import ModelInfo
from tests.fleet import Fleet
from tests.support import NatsServer, free_port, usage_records, wait_until
from tests.test_gateway import FAST_ROUTER, GATEWAY, client, make_key, make_tenant, set_event

pytestmark = [pytest.mark.timeout(120)]

KEY_A = "sk-provider-alpha-7f3c9d1e2b4a6f8091a2b3c4"
KEY_B = "sk-provider-bravo-0e9d8c7b6a5f4e3d2c1b0a99"
OTHER = "sk-provider-other-55aa55aa55aa55aa55aa55aa"


class Provider:
    """An OpenAI-compatible API on a free port: chat completions, whole and streamed, for the keys it
    holds; it records the key and the model name of every request it answered."""

    def __init__(self, keys: tuple[str, ...], status: int = 200) -> None:
        self.keys = keys
        self.status = status  # what it answers a request with a good key (503: it is failing)
        self.port = free_port()
        self.used: list[str] = []  # the key of each request it answered
        self.models: list[str] = []
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> Provider:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.chat)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def chat(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        key = auth.removeprefix("Bearer ")
        if key not in self.keys:
            return web.json_response({"error": {"message": f"Incorrect API key provided: {key}"}}, status=401)
        if self.status != 200:
            return web.json_response({"error": {"message": "overloaded"}}, status=self.status)
        body = await request.json()
        self.used.append(key)
        self.models.append(body["model"])
        usage = {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14}
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "chatcmpl-1",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": body["model"],
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": "Hi there!"}, "finish_reason": "stop"}
                    ],
                    "usage": usage,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)

        def chunk(**fields: Any) -> bytes:
            base = {"id": "chatcmpl-2", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
            return f"data: {json.dumps({**base, **fields})}\n\n".encode()

        for word in ("Hi", " there", "!"):
            delta = {"index": 0, "delta": {"content": word}, "finish_reason": None}
            await resp.write(chunk(choices=[delta]))
        await resp.write(chunk(choices=[{"index": 0, "delta": {}, "finish_reason": "stop"}]))
        if (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(chunk(choices=[], usage=usage))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


@pytest.fixture
async def gw(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    """The gateway without agents: an external model needs no node."""
    f = await Fleet(store, nats.url, tmp_path).start(services=GATEWAY, router=FAST_ROUTER)
    yield f
    await f.stop()


@pytest.fixture
async def providers() -> AsyncIterator[list[Provider]]:
    started: list[Provider] = []
    yield started
    for p in started:
        await p.stop()


@pytest.fixture(autouse=True)
def provider_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    """The router's environment holds the providers' keys: the catalog names only the variables."""
    monkeypatch.setenv("EXT_KEY_A", KEY_A)
    monkeypatch.setenv("EXT_KEY_B", KEY_B)
    monkeypatch.setenv("EXT_KEY_OTHER", OTHER)
    monkeypatch.delenv("EXT_KEY_UNSET", raising=False)


async def add_external(gw: Fleet, name: str, *providers: M.ExternalProvider, **spec: Any) -> None:
    await gw.command("add", M.AddModel(spec=M.ModelSpec(name=name, external=list(providers), **spec)))


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5}


async def post(gw: Fleet, key: str, body: dict[str, Any], request_id: str = "") -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}", **({"X-Request-Id": request_id} if request_id else {})}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        return r.status, await r.json()


async def record_of(gw: Fleet, project: str, client_request_id: str) -> UsageRecord:
    async def found() -> UsageRecord | None:
        return next(
            (r for r in await usage_records(gw.store, project) if r.client_request_id == client_request_id), None
        )

    return await wait_until(found, what=f"the usage record of {client_request_id}")


async def every_message(store: EventStore) -> bytes:
    """Every stored message of every stream (events, commands, usage, telemetry, …), headers and data."""
    out = bytearray()
    streams = await store.js.streams_info()
    for info in streams:
        name = info.config.name
        for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
            with contextlib.suppress(nats.js.errors.NotFoundError):
                msg = await store.js.get_msg(name, seq)
                out += msg.subject.encode() + repr(msg.headers).encode() + (msg.data or b"") + b"\n"
    return bytes(out)


async def test_an_external_model_is_answered_by_its_provider_with_its_keys_in_turn_and_billed_at_its_price(
    gw: Fleet, providers: list[Provider], capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    provider = await Provider((KEY_A, KEY_B)).start()
    providers.append(provider)
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant, external=True)
    await add_external(
        gw,
        "gpt-ext",
        M.ExternalProvider(
            url=provider.url,
            key_env=["EXT_KEY_A", "EXT_KEY_B"],
            model="upstream-name",
            input_usd_per_m=2.0,
            output_usd_per_m=8.0,
        ),
    )
    await gw.router_caught_up()

    c = client(gw, key)
    answer = await c.chat.completions.create(model="gpt-ext", messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content == "Hi there!"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (11, 3)
    stream = await c.chat.completions.create(model="gpt-ext", messages=[{"role": "user", "content": "hi"}], stream=True)
    words = [ch.choices[0].delta.content async for ch in stream if ch.choices and ch.choices[0].delta.content]
    assert "".join(words) == "Hi there!"  # streamed through as the provider sent it
    status, _ = await post(gw, key, chat("gpt-ext"), request_id="ext-3")
    assert status == 200

    assert sorted(set(provider.used)) == sorted({KEY_A, KEY_B})  # both keys, in turn
    assert provider.used[0] != provider.used[1]
    assert set(provider.models) == {"upstream-name"}  # the model under the provider's name for it

    rec = await record_of(gw, tenant.project, "ext-3")
    assert (rec.model_asked, rec.model_served, rec.status) == ("gpt-ext", "gpt-ext", 200)
    assert (rec.tokens_in, rec.tokens_out) == (11, 3)  # the provider's count
    assert rec.cost_usd == pytest.approx((11 * 2.0 + 3 * 8.0) / 1e6)  # at the provider's price
    assert rec.replica_id == f"external:127.0.0.1:{provider.port}" and rec.node_id == "external"
    streamed = await wait_until(
        lambda: _streamed(usage_records(gw.store, tenant.project)), what="the streamed request's usage record"
    )
    assert (streamed.tokens_in, streamed.tokens_out) == (11, 3)

    async with aiohttp.ClientSession() as s, s.get(gw.admin_url + "/api/v1/models", headers=gw.api_headers()) as r:
        [row] = (await r.json())["models"]
    assert row["external"] == [f"127.0.0.1:{provider.port}"] and row["status"].startswith("external, ready")

    # The keys are nowhere but in the router's environment: not on any stream, not in any log line.
    logged = await every_message(gw.store)
    out, err = capfd.readouterr()
    assert "ext-3" in out + err + caplog.text  # the request's own log lines were captured
    for secret in (KEY_A, KEY_B):
        assert secret.encode() not in logged
        assert secret not in out and secret not in err and secret not in caplog.text
    assert b"EXT_KEY_A" in logged  # the catalog names the variable


async def _streamed(records: Any) -> UsageRecord | None:
    return next((r for r in await records if r.stream and r.status == 200), None)


async def test_a_key_not_allowed_external_models_is_refused_403_saying_how_to_get_one(
    gw: Fleet, providers: list[Provider]
) -> None:
    provider = await Provider((KEY_A,)).start()
    providers.append(provider)
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)  # no `external`
    await add_external(gw, "gpt-ext", M.ExternalProvider(url=provider.url, key_env=["EXT_KEY_A"]))
    await gw.router_caught_up()
    status, body = await post(gw, key, chat("gpt-ext"))
    assert status == 403
    error = body["error"]
    assert error["code"] == "external_not_allowed" and error["type"] == "permission_error"
    assert "outside the cluster" in error["message"] and "--allow-external" in error["message"]
    assert provider.used == []  # the prompt never left
    models = await client(gw, key).models.list()
    assert "gpt-ext" not in {m.id for m in models.data}  # nor is it listed for this key


async def test_a_parked_local_model_falls_back_to_its_external_model(gw: Fleet, providers: list[Provider]) -> None:
    provider = await Provider((KEY_A,)).start()
    providers.append(provider)
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant, external=True)
    local, _ = await make_key(gw.store, tenant)
    await add_external(
        gw, "ext", M.ExternalProvider(url=provider.url, key_env=["EXT_KEY_A"], input_usd_per_m=1, output_usd_per_m=1)
    )
    await gw.add_model("local", "/nowhere/model.gguf", fallbacks=["ext"])
    await set_event(gw.store, M.AGGREGATE, "local", M.ModelParked(reason="5 failed starts in a row", failures=5))
    await gw.router_caught_up()

    status, body = await post(gw, key, chat("local"), request_id="fb-ext")
    assert status == 200, body
    rec = await record_of(gw, tenant.project, "fb-ext")
    assert (rec.model_asked, rec.model_served) == ("local", "ext")
    assert rec.cost_usd == pytest.approx(14 / 1e6)

    # A key without the allowlist never reaches the external fallback: it gets the local model's reason.
    status, body = await post(gw, local, chat("local"))
    assert status == 503 and body["error"]["code"] == "model_parked"
    assert provider.used == [KEY_A]


async def test_an_on_demand_local_model_with_no_replica_falls_back_to_its_external_model_at_once_and_is_still_wanted(
    gw: Fleet, providers: list[Provider]
) -> None:
    provider = await Provider((KEY_A,)).start()
    providers.append(provider)
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant, external=True)
    await add_external(gw, "ext", M.ExternalProvider(url=provider.url, key_env=["EXT_KEY_A"]))
    await gw.add_model("local", "/nowhere/model.gguf", min_=0, fallbacks=["ext"])  # no node: none will start
    wanted: list[str] = []

    async def on_demand(msg: Any) -> None:
        wanted.append(msg.subject)

    sub = await gw.store.nc.subscribe("llmgw.demand.local", cb=on_demand)
    await gw.router_caught_up()
    # Without the fallback it would be held for an on-demand replica (activation_s); with one it is answered.
    status, body = await post(gw, key, chat("local"), request_id="od-1")
    assert status == 200, body
    rec = await record_of(gw, tenant.project, "od-1")
    assert (rec.model_asked, rec.model_served) == ("local", "ext")
    assert rec.queue_s == 0  # never held for the replica
    await wait_until(lambda: wanted, what="the local model's demand signal")  # a replica is still asked for
    await sub.unsubscribe()


async def test_a_provider_that_is_down_passes_the_request_to_the_next_by_price(
    gw: Fleet, providers: list[Provider]
) -> None:
    failing = await Provider((KEY_A,), status=503).start()
    dear = await Provider((OTHER,)).start()
    providers += [failing, dear]
    down = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant, external=True)
    await add_external(
        gw,
        "ext",
        # Listed dearest first: the routers try them cheapest first.
        M.ExternalProvider(url=dear.url, key_env=["EXT_KEY_OTHER"], input_usd_per_m=10, output_usd_per_m=30),
        M.ExternalProvider(url=down, key_env=["EXT_KEY_A"], input_usd_per_m=0.1, output_usd_per_m=0.2),
        M.ExternalProvider(url=failing.url, key_env=["EXT_KEY_A"], input_usd_per_m=1, output_usd_per_m=2),
    )
    await gw.router_caught_up()
    status, body = await post(gw, key, chat("ext"), request_id="next-1")
    assert status == 200, body
    assert failing.used == [] and dear.used == [OTHER]
    rec = await record_of(gw, tenant.project, "next-1")
    assert rec.replica_id == f"external:127.0.0.1:{dear.port}"
    assert rec.cost_usd == pytest.approx((11 * 10 + 3 * 30) / 1e6)  # the price of the one that served


async def test_a_provider_down_with_no_other_is_a_502_naming_its_host(gw: Fleet, providers: list[Provider]) -> None:
    strict = await Provider((KEY_A,)).start()
    providers.append(strict)
    port = free_port()
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant, external=True)
    await add_external(gw, "ext", M.ExternalProvider(url=f"http://127.0.0.1:{port}/v1", key_env=["EXT_KEY_A"]))
    await add_external(gw, "nokey", M.ExternalProvider(url=f"http://127.0.0.1:{port}/v1", key_env=["EXT_KEY_UNSET"]))
    await add_external(gw, "refuses", M.ExternalProvider(url=strict.url, key_env=["EXT_KEY_B"]))
    await gw.router_caught_up()
    status, body = await post(gw, key, chat("ext"), request_id="down-1")
    assert status == 502
    assert body["error"]["code"] == "provider_error" and body["error"]["type"] == "api_error"
    assert f"127.0.0.1:{port}" in body["error"]["message"]
    status, body = await post(gw, key, chat("nokey"))
    assert status == 502 and "EXT_KEY_UNSET" in body["error"]["message"]  # what to set, and where
    # A provider that refuses the key and echoes it back: the answer names the refusal, never the key.
    status, body = await post(gw, key, chat("refuses"), request_id="refused-1")
    assert status == 502 and "answered 401" in body["error"]["message"], body
    assert KEY_B not in body["error"]["message"]
    refused = await record_of(gw, tenant.project, "refused-1")
    assert refused.error and "answered 401" in refused.error and KEY_B not in refused.error
    rec = await record_of(gw, tenant.project, "down-1")
    assert rec.status == 502 and rec.cost_usd == 0


async def test_the_catalog_refuses_a_key_given_as_its_variable_without_repeating_it(gw: Fleet) -> None:
    bad = M.ExternalProvider(url="https://api.example.com/v1", key_env=[KEY_A])
    with pytest.raises(CommandRejectedError) as refused:
        await add_external(gw, "ext", bad)
    assert "never the key itself" in str(refused.value) and KEY_A not in str(refused.value)
    with pytest.raises(CommandRejectedError) as refused:
        await add_external(gw, "ext", M.ExternalProvider(url=f"https://u:{KEY_A}@api.example.com/v1", key_env=["K"]))
    assert "credentials" in str(refused.value) and KEY_A not in str(refused.value)


# -- pure rules -----------------------------------------------------------------------------------


def _external(*providers: M.ExternalProvider) -> ModelInfo:
    spec = M.ModelSpec(name="ext", external=list(providers))
    return ModelInfo(name="ext", status=MF.ModelStatus(spec=spec))


def test_providers_are_tried_cheapest_first_each_with_the_key_whose_turn_it_is() -> None:
    cheap = M.ExternalProvider(url="https://a/v1", key_env=["A", "B"], input_usd_per_m=1, output_usd_per_m=1)
    dear = M.ExternalProvider(url="https://b/v1", key_env=["C"], input_usd_per_m=5, output_usd_per_m=5)
    model = _external(dear, cheap)
    env = {"A": "ka", "B": "kb", "C": "kc"}
    assert [a.provider.url for a in X.attempts(model, env, {})] == ["https://a/v1", "https://b/v1"]
    assert [X.attempts(model, env, {"https://a/v1": n})[0].secret for n in range(3)] == ["ka", "kb", "ka"]
    assert X.attempts(model, {"B": "kb"}, {})[0].secrets == ("kb",)  # an unset variable is passed over
    assert X.attempts(model, {}, {})[1].secret is None
    assert X.dearest(model, None) == X.price_of(dear, None)


def test_a_provider_url_keeps_the_endpoint_past_v1() -> None:
    assert X.request_url("https://api.example.com/v1/", "/v1/chat/completions") == (
        "https://api.example.com/v1/chat/completions"
    )


def test_an_external_model_runs_nothing_so_the_catalog_refuses_a_source_or_profiles() -> None:
    provider = M.ExternalProvider(url="https://api.example.com/v1", key_env=["K"])
    spec = M.ModelSpec(name="ext", source="/m.gguf", external=[provider])
    with pytest.raises(Exception, match="runs nothing here"):
        decide(Catalog(), M.AddModel(spec=spec))
    decision = decide(Catalog(), M.AddModel(spec=M.ModelSpec(name="ext", external=[provider])))
    [added] = decision.payloads
    assert decision.result == {"model": "ext"} and isinstance(added, M.ModelAdded)


def test_the_scheduler_holds_no_external_model() -> None:
    from datetime import UTC, datetime

    from llmgw.events.schema.envelope import Envelope, RecordedEvent
    from llmgw.services.scheduler.state import ClusterState

    spec = M.ModelSpec(name="ext", external=[M.ExternalProvider(url="https://x/v1", key_env=["K"])])
    state = ClusterState()
    env = Envelope(id="e1", type="model.added", v=1, at=datetime.now(UTC), actor="user:test", data=msgspec.Raw(b"{}"))
    state.apply(RecordedEvent(envelope=env, payload=M.ModelAdded(spec=spec), seq=1, subject="llmgw.evt.model.ext"))
    assert state.models == {}  # nothing to place, hold or preempt
    from llmgw.services.scheduler.explain import explain
    from llmgw.services.scheduler.headroom import headroom
    from llmgw.services.scheduler.vocabulary import Clock, Config

    clock = Clock(monotonic=0.0, epoch=0.0, started=0.0)
    for answer in (explain(state, "ext", Config()), headroom(state, "ext", clock, Config())):
        assert "served outside the cluster (by x)" in answer["error"]  # said, not "no model named"
    restored = ClusterState.decode(state.encode())  # a scheduler started from a snapshot knows it too
    assert restored.external == {"ext": ["x"]} and restored.models == {}


async def test_ctl_adds_an_external_model_and_a_key_that_may_call_it(
    store: EventStore, nats: NatsServer, tmp_path: Path, providers: list[Provider]
) -> None:
    provider = await Provider((KEY_A,)).start()
    providers.append(provider)
    services = (*GATEWAY, "access", "tenancy")
    f = await Fleet(store, nats.url, tmp_path).start(services=services, router=FAST_ROUTER)
    try:
        await make_tenant(store)

        async def ctl(*args: str) -> tuple[int, str, str]:
            proc = await asyncio.create_subprocess_exec(
                str(Path(sys.executable).parent / "llmgw"), "--nats", f.nats_url, "ctl", *args,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env=f.cli_env(LLMGW_API_URL=f.admin_url),
            )  # fmt: skip
            out, err = await asyncio.wait_for(proc.communicate(), 60)
            return proc.returncode or 0, out.decode(), err.decode()

        code, _, err = await ctl("model", "add", "ext", "--external", provider.url, "--key-env", KEY_A)
        assert code == 2 and "never the key itself" in err and KEY_A not in err  # refused before the bus
        code, _, err = await ctl(
            "model", "add", "ext", "--external", provider.url, "--key-env", "EXT_KEY_A",
            "--price-in", "1", "--price-out", "2", "--upstream-model", "their-name",
        )  # fmt: skip
        assert code == 0, err
        code, out, err = await ctl("models")
        assert code == 0 and "external, ready" in out, out + err
        code, key, err = await ctl("key", "create", "--project", "acme/ml/chat", "--allow-external")
        assert code == 0 and "may call external models" in err, err
        code, out, err = await ctl("key", "list")
        assert code == 0 and "+external" in out, out + err
        await f.router_caught_up()
        status, body = await post(f, key.strip(), chat("ext"))
        assert status == 200, body
        assert provider.models == ["their-name"]
        assert KEY_A.encode() not in await every_message(store)
    finally:
        await f.stop()
