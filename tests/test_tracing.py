"""Traces of gateway requests (GW-9): the gateway sends OTLP/HTTP spans to a collector, here a receiver
that decodes real OTLP protobuf (opentelemetry-proto's ExportTraceServiceRequest), in front of a real
llama.cpp engine."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from llmgw.events.runtime.store import EventStore
from llmgw.services.router.tracing import Tracing
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, free_port, wait_until
from tests.test_gateway import FAST_ROUTER, GATEWAY, make_key, make_tenant

pytestmark = [pytest.mark.asyncio, pytest.mark.timeout(180)]

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP traces endpoint: each POST's protobuf body decoded into spans."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.posts = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1/traces"

    async def receive(self, request: web.Request) -> web.Response:
        assert request.headers["Content-Type"] == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        self.posts += 1
        for resource_spans in message.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for s in scope_spans.spans:
                    self.spans.append(
                        {
                            "name": s.name,
                            "trace": s.trace_id.hex(),
                            "id": s.span_id.hex(),
                            "parent": s.parent_span_id.hex(),
                            "attributes": {a.key: _value(a.value) for a in s.attributes},
                            "service": resource.get("service.name"),
                        }
                    )
        return web.Response(status=200, content_type="application/x-protobuf", body=b"")


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    c = Collector()
    app = web.Application()
    app.router.add_post("/v1/traces", c.receive)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", c.port).start()
    yield c
    await runner.cleanup()


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return write_tiny_gguf(tmp_path / "tiny.gguf")


@pytest.fixture
async def untraced(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=GATEWAY, router=FAST_ROUTER)
    f.agent("n1")
    yield f
    await f.stop()


@pytest.fixture
async def traced(store: EventStore, nats: NatsServer, tmp_path: Path, collector: Collector) -> AsyncIterator[Fleet]:
    router = msgspec.structs.replace(FAST_ROUTER, trace_endpoint=collector.url, trace_export_delay_s=0.1)
    f = await Fleet(store, nats.url, tmp_path).start(services=GATEWAY, router=router)
    f.agent("n1")
    yield f
    await f.stop()


async def traced_chat(gw: Fleet, tiny: Path) -> str:
    """One chat request that carries the client's ``traceparent``, answered 200: its request id."""
    key, _ = await make_key(gw.store, await make_tenant(gw.store))
    await gw.add_model("tiny", tiny)
    await gw.wait_ready("tiny", 1)
    await gw.router_caught_up()
    headers = {"Authorization": f"Bearer {key}", "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with (
        aiohttp.ClientSession() as s,
        s.post(f"http://127.0.0.1:{gw.port}/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status == 200
        return r.headers["X-Request-Id"]


async def test_a_request_is_one_trace_continuing_the_client_s_with_a_span_per_stage(
    traced: Fleet, collector: Collector, tiny: Path
) -> None:
    request_id = await traced_chat(traced, tiny)

    def mine() -> list[dict[str, Any]] | None:
        spans = [s for s in collector.spans if s["trace"] == CLIENT_TRACE]
        return spans if any(s["name"] == "POST /v1/chat/completions" for s in spans) else None

    spans = await wait_until(mine, what="the request's spans at the collector")
    by_name = {s["name"]: s for s in spans}
    root = by_name["POST /v1/chat/completions"]
    assert root["parent"] == CLIENT_SPAN, "the gateway's span continues the client's trace"
    assert root["service"] == "llmgw-gateway"
    assert root["attributes"]["llmgw.request_id"] == request_id
    assert root["attributes"]["http.response.status_code"] == 200
    assert root["attributes"]["llmgw.model"] == "tiny" and root["attributes"]["llmgw.tokens_out"] > 0
    assert {"admission", "engine attempt", "usage publish"} <= set(by_name)
    for stage in ("admission", "engine attempt", "usage publish"):
        assert by_name[stage]["parent"] == root["id"], f"{stage} is a child of the request's span"
    [replica] = await traced.ready("tiny")
    attempt = by_name["engine attempt"]["attributes"]
    assert (attempt["llmgw.replica"], attempt["llmgw.attempt"]) == (replica["id"], 1)


async def test_with_tracing_off_nothing_is_sent_and_requests_are_answered(
    untraced: Fleet, collector: Collector, tiny: Path
) -> None:
    await traced_chat(untraced, tiny)
    assert not untraced.handles["router"].tracing.enabled
    assert collector.posts == 0


async def test_the_engine_is_handed_the_trace_of_its_attempt(collector: Collector) -> None:
    tracing = Tracing(collector.url, 1.0, export_delay_s=0.1)
    try:
        started = tracing.start_request({}, "POST /v1/chat/completions", {"llmgw.request_id": "r-1"})
        with tracing.span("engine attempt", **{"llmgw.replica": "tiny-1"}) as span:
            headers: dict[str, str] = {}
            tracing.inject(headers)
            context = span.get_span_context()
        tracing.end_request(started, 200, {})
        version, trace_id, span_id, flags = headers["traceparent"].split("-")
        assert version == "00" and int(flags, 16) & 1, "sampled"
        assert trace_id == f"{context.trace_id:032x}" and span_id == f"{context.span_id:016x}"
        assert await asyncio.to_thread(tracing.flush)
        assert {s["name"] for s in collector.spans} == {"POST /v1/chat/completions", "engine attempt"}
    finally:
        tracing.shutdown()


async def test_a_sample_ratio_of_zero_or_no_endpoint_turns_tracing_off() -> None:
    for off in (Tracing(None), Tracing("http://127.0.0.1:9/v1/traces", 0.0)):
        assert not off.enabled and off.start_request({}, "x", {}) is None
        with off.span("admission") as span:
            assert span is None
        headers: dict[str, str] = {}
        off.inject(headers)
        assert headers == {}
