"""The gateway against hostile clients: client input never gets a 500, engine refusals are client
errors and are not retried, and what reaches an engine is bounded (count, depth, size, time)."""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
import struct
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import nats.js.errors
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.agent.engines.commands import prompt_cache_mib, with_prompt_cache_bound
from llmgw.agent.engines.xllama_server import ServerArgs, build_params
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.usage import UsageRecord
from llmgw.services.router.app import RouterConfig, engine_refusal
from llmgw.services.router.validation import json_depth
from tests.fleet import Fleet
from tests.support import NatsServer, wait_until
from tests.test_gateway import GATEWAY, Tenant, make_key, make_tenant, ready_model, tiny  # noqa: F401

pytestmark = [pytest.mark.timeout(300)]

# Small limits, so each refusal is reached with a small body; short header and body timeouts, so a
# slow client is dealt with quickly. The defaults are checked in test_the_default_limits_are_sensible.
HOSTILE_ROUTER = RouterConfig(
    activation_s=30.0,
    first_token_s=20.0,
    idle_s=20.0,
    total_s=60.0,
    max_messages=64,
    max_json_depth=16,
    max_prompt_tokens=8192,
    max_output_tokens=512,
    header_s=1.0,
    body_s=1.0,
)
CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


class Gateway(msgspec.Struct):
    fleet: Fleet
    key: str
    tenant: Tenant

    @property
    def port(self) -> int:
        return self.fleet.port

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.fleet.port}{path}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}


@pytest.fixture
async def hostile(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Gateway]:
    """A gateway with a tenant and a key, and no node: tests that need an engine start an agent."""
    f = await Fleet(store, nats.url, tmp_path).start(services=GATEWAY, router=HOSTILE_ROUTER)
    try:
        tenant = await make_tenant(store)
        key, _ = await make_key(store, tenant)
        await f.router_caught_up()
        yield Gateway(fleet=f, key=key, tenant=tenant)
    finally:
        await f.stop()


async def with_engine(gw: Gateway, tiny: Path, name: str = "tiny") -> None:  # noqa: F811
    if "n1" not in gw.fleet.agents:
        gw.fleet.agent("n1")
    await ready_model(gw.fleet, tiny, name=name)
    await gw.fleet.router_caught_up()


def assert_openai_error(status: int, headers: dict[str, str] | aiohttp.typedefs.LooseHeaders, body: bytes) -> dict:
    """The body is OpenAI's error shape and the answer carries a request id; returns the error."""
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["message"] and err["code"], err
    assert {k.lower() for k in headers} >= {"x-request-id"}, headers
    return err


async def post(gw: Gateway, body: object, path: str = CHAT, **headers: str) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(gw.url(path), data=json.dumps(body).encode(), headers={**gw.auth, **headers}) as r,
    ):
        data = await r.read()
        if r.status >= 400:
            return r.status, assert_openai_error(r.status, r.headers, data)
        return r.status, json.loads(data)


async def raw_exchange(port: int, request: bytes, half_close: bool = False) -> tuple[int | None, dict[str, str], bytes]:
    """Send ``request`` as it is on a new connection and read until the server closes it.

    Returns the status (None when the server closed without answering), the headers (names in lower
    case) and the body as sent (not de-chunked)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        if half_close:
            writer.write_eof()
        data = await asyncio.wait_for(reader.read(-1), 30)
    finally:
        writer.close()
    if not data:
        return None, {}, b""
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


def http_request(method: str, path: str, port: int, headers: list[tuple[bytes, bytes]], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1".encode(), f"Host: 127.0.0.1:{port}".encode(), b"Connection: close"]
    lines += [name + b": " + value for name, value in headers]
    return b"\r\n".join(lines) + b"\r\n\r\n" + body


async def usage_record(gw: Gateway, client_request_id: str) -> UsageRecord | None:
    """The project's newest usage record, if it is that of the request the test sent with this X-Request-Id."""
    try:
        msg = await gw.fleet.store.js.get_last_msg("LLMGW_USAGE", f"llmgw.usage.{gw.tenant.project}", direct=True)
    except nats.js.errors.NotFoundError:
        return None
    rec = msgspec.json.decode(msg.data, type=UsageRecord)
    return rec if rec.client_request_id == client_request_id else None


async def metrics(gw: Gateway) -> str:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{gw.fleet.admin_port}/metrics") as r,
    ):
        return await r.text()


async def answers_normally(gw: Gateway) -> None:
    status, body = await post(gw, {"model": "tiny", "messages": HI, "max_tokens": 2})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] > 0


# -- pure: depth without recursion ----------------------------------------------------------------


def test_json_depth_counts_brackets_outside_strings_without_recursion() -> None:
    assert json_depth(b'{"a": [1, {"b": []}]}') == 4
    assert json_depth(b'{"a": "[[[[{{{{"}') == 1, "brackets inside strings do not count"
    assert json_depth(b'{"a": "\\"[[[["}') == 1, "an escaped quote does not end the string"
    assert json_depth(b"[" * 100_000) == 100_000  # far past any recursion limit
    assert json_depth(b'"[[[' + b"\\" * 3) == 0, "an unterminated string hides what follows"
    assert json_depth(b"") == 0


def _reference_depth(value: object) -> int:
    if isinstance(value, list):
        return 1 + max((_reference_depth(v) for v in value), default=0)
    if isinstance(value, dict):
        return 1 + max((_reference_depth(v) for v in value.values()), default=0)
    return 0


@settings(max_examples=200, deadline=None)
@given(
    value=st.recursive(
        st.none() | st.integers() | st.text(alphabet='[]{}"\\ab', max_size=8),
        lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text('[]{}"\\', max_size=4), children),
        max_leaves=20,
    )
)
def test_json_depth_agrees_with_the_decoded_structure(value: object) -> None:
    assert json_depth(json.dumps(value).encode()) == _reference_depth(value)


def test_engine_refusals_are_client_errors_and_engine_failures_are_retried() -> None:
    unsupported = engine_refusal(501, '{"error": {"message": "not supported"}}', "tiny", "/v1/embeddings")
    assert unsupported is not None and (unsupported.status, unsupported.code) == (400, "model_not_supported")
    assert unsupported.message == "the model tiny does not serve embeddings; use a model with embeddings enabled"
    chat = engine_refusal(501, "", "emb", "/v1/chat/completions")
    assert chat is not None and "does not serve chat completions" in chat.message
    too_long = engine_refusal(400, '{"error": {"code": 400, "message": "exceeds the context size"}}', "tiny", CHAT)
    assert too_long is not None and (too_long.status, too_long.code) == (400, "context_length_exceeded")
    assert too_long.message == (
        "the request is longer than model tiny's context: shorten the messages or lower max_tokens"
    )
    other = engine_refusal(400, '{"error": {"code": 400, "message": "bad grammar"}}', "tiny", CHAT)
    assert other is not None and other.message == "the model tiny refused the request: bad grammar"
    large = engine_refusal(413, "too big", "tiny", CHAT)
    assert large is not None and large.status == 413
    for status in (500, 502, 503, 401, 403):
        assert engine_refusal(status, "", "tiny", CHAT) is None, f"{status} is the engine's failure: retried"


def test_the_default_limits_are_sensible() -> None:
    cfg = RouterConfig()
    assert cfg.max_messages >= 1024 and cfg.max_json_depth >= 32
    assert cfg.header_s > 0 and cfg.body_s > 0
    assert cfg.max_prompt_tokens >= 128_000 and cfg.max_output_tokens >= 16_384


# -- each reproduction ------------------------------------------------------------------------------


async def test_stream_options_that_are_not_an_object_are_refused_with_400(hostile: Gateway, tiny: Path) -> None:  # noqa: F811
    await with_engine(hostile, tiny)
    for junk in ("x", [1], 5):
        status, err = await post(hostile, {"model": "tiny", "messages": HI, "stream": True, "stream_options": junk})
        assert status == 400, err
        assert "stream_options" in err["message"] and err["param"] == "stream_options"
    await answers_normally(hostile)


async def test_a_body_nested_past_the_limit_is_refused_naming_the_limit(hostile: Gateway) -> None:
    deep_field = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 5000
    deep_field += b"]" * 5000 + b"}"
    for raw in (b"[" * 1000, deep_field, b'{"model": "tiny", "messages": ' + b"[" * 17 + b"]" * 17 + b"}"):
        async with aiohttp.ClientSession() as s, s.post(hostile.url(CHAT), data=raw, headers=hostile.auth) as r:
            assert r.status == 400, await r.text()
            err = assert_openai_error(r.status, r.headers, await r.read())
            assert err["code"] == "too_deeply_nested"
            assert "the limit is 16" in err["message"], err


async def test_a_compressed_body_that_does_not_decompress_is_refused_with_400(hostile: Gateway, tiny: Path) -> None:  # noqa: F811
    await with_engine(hostile, tiny)
    valid = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 2}).encode()
    async with aiohttp.ClientSession() as s:
        for encoding, good in (("gzip", gzip.compress(valid)), ("deflate", zlib.compress(valid))):
            headers = {**hostile.auth, "Content-Encoding": encoding, "Content-Type": "application/json"}
            async with s.post(hostile.url(CHAT), data=good, headers=headers) as r:
                assert r.status == 200, f"{encoding}: {await r.text()}"
            async with s.post(hostile.url(CHAT), data=b"\x1f\x8b not " + encoding.encode(), headers=headers) as r:
                assert r.status == 400, f"{encoding}: {r.status} {await r.text()}"
                err = assert_openai_error(r.status, r.headers, await r.read())
                assert encoding in err["message"] and err["code"] == "invalid_encoding"


async def test_an_authorization_header_that_is_not_utf8_is_a_401_on_every_route(hostile: Gateway) -> None:
    prefix = hostile.key[:40].encode()  # a real key's lookup prefix, then bytes that are not UTF-8
    for method, path in (("GET", "/v1/models"), ("POST", CHAT), ("POST", "/v1/embeddings")):
        body = json.dumps({"model": "tiny", "messages": HI, "input": "x"}).encode()
        headers = [
            (b"Authorization", b"Bearer " + prefix + b"\xff\xfe\xc3"),
            (b"Content-Type", b"application/json"),
            (b"Content-Length", str(len(body) if method == "POST" else 0).encode()),
        ]
        req = http_request(method, path, hostile.port, headers, body if method == "POST" else b"")
        status, got, data = await raw_exchange(hostile.port, req)
        assert status == 401, f"{method} {path}: {status} {data[:300]!r}"
        err = assert_openai_error(status, got, data)
        assert err["code"] == "invalid_api_key"


async def test_unknown_routes_and_methods_answer_in_openai_shape(hostile: Gateway) -> None:
    async with aiohttp.ClientSession() as s:
        async with s.get(hostile.url(CHAT), headers=hostile.auth) as r:
            assert r.status == 405
            err = assert_openai_error(r.status, r.headers, await r.read())
            assert "POST" in err["message"] and CHAT in err["message"]
        async with s.post(hostile.url("/v1/nothing-here"), headers=hostile.auth, data=b"{}") as r:
            assert r.status == 404
            err = assert_openai_error(r.status, r.headers, await r.read())
            assert "/v1/nothing-here" in err["message"] and "/v1/chat/completions" in err["message"]


async def test_too_many_messages_are_refused_naming_the_limit_and_the_count(hostile: Gateway) -> None:
    status, err = await post(hostile, {"model": "tiny", "messages": HI * 65})
    assert status == 413 and err["code"] == "too_many_messages"
    assert "65 messages" in err["message"] and "64" in err["message"]
    status, err = await post(hostile, {"model": "tiny", "messages": HI * 50_000})
    assert status == 413 and "50000 messages" in err["message"]


async def test_max_tokens_above_the_limit_is_refused_naming_it(hostile: Gateway) -> None:
    for field in ("max_tokens", "max_completion_tokens"):
        status, err = await post(hostile, {"model": "tiny", "messages": HI, field: 513})
        assert status == 400 and err["code"] == "max_tokens_too_large" and err["param"] == field
        assert "513" in err["message"] and "512" in err["message"]


async def test_a_prompt_over_the_token_limit_is_refused_naming_the_limit(hostile: Gateway) -> None:
    big = "word " * 2000  # 10,000 bytes: up to 10,000 tokens, over the 8,192 allowed
    for path, body in (
        (CHAT, {"model": "tiny", "messages": [{"role": "user", "content": big}]}),
        ("/v1/completions", {"model": "tiny", "prompt": big}),
        ("/v1/embeddings", {"model": "tiny", "input": [big]}),
    ):
        status, err = await post(hostile, body, path=path)
        assert status == 413 and err["code"] == "prompt_too_long", err
        assert "8192" in err["message"]


async def test_an_engine_that_does_not_serve_the_endpoint_is_a_400_naming_the_model_and_is_not_retried(
    hostile: Gateway,
    tiny: Path,  # noqa: F811
) -> None:
    await with_engine(hostile, tiny)
    status, err = await post(
        hostile, {"model": "tiny", "input": "hello"}, path="/v1/embeddings", **{"X-Request-Id": "emb-1"}
    )
    assert status == 400, err
    assert err["code"] == "model_not_supported"
    assert "the model tiny does not serve embeddings" in err["message"]
    assert "embeddings enabled" in err["message"]
    text = await metrics(hostile)
    assert "llmgw_gateway_retries_total{" not in text, "a client error is not retried"
    rec = await wait_until(lambda: usage_record(hostile, "emb-1"), what="the refused request's usage record")
    assert rec.status == 400
    await answers_normally(hostile)


async def test_a_client_that_stops_reading_and_resets_mid_stream_is_recorded_as_499(
    hostile: Gateway,
    tiny: Path,  # noqa: F811
) -> None:
    await with_engine(hostile, tiny)
    body = json.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "go on"}],
            "max_tokens": 480,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 200,  # about 10 KB a token, 5 MB in all: far more than the socket buffers hold
        }
    ).encode()
    headers = [
        (b"Authorization", f"Bearer {hostile.key}".encode()),
        (b"Content-Type", b"application/json"),
        (b"Content-Length", str(len(body)).encode()),
        (b"X-Request-Id", b"stalled-1"),
    ]
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", hostile.port))
    await loop.sock_sendall(sock, http_request("POST", CHAT, hostile.port, headers, body))
    first = await loop.sock_recv(sock, 1024)
    assert first.startswith(b"HTTP/1.1 200"), first
    router = hostile.fleet.handles["router"]
    [replica] = await hostile.fleet.ready("tiny")
    engine_key = await hostile.fleet.key(replica["id"])

    async def engine_done_gateway_still_writing() -> bool:
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"{replica['url']}/slots", headers={"Authorization": f"Bearer {engine_key}"}) as r,
        ):
            idle = not any(slot["is_processing"] for slot in await r.json())
        return idle and router.outstanding.get(replica["id"], 0) == 1

    # The client reads no more: the engine finishes, the gateway waits to write what the client
    # does not take. Then the client resets the connection (SO_LINGER 0: an RST, not a FIN).
    await wait_until(engine_done_gateway_still_writing, deadline_s=60, what="the gateway to wait on the client")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()
    rec = await wait_until(lambda: usage_record(hostile, "stalled-1"), what="the stalled request's usage record")
    assert rec.status == 499, rec
    assert 'status="500"' not in await metrics(hostile)


async def test_a_connection_that_never_finishes_its_headers_is_closed(hostile: Gateway) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", hostile.port)
    try:
        writer.write(b"POST /v1/chat/comp")  # half a request line, then nothing
        await writer.drain()
        # The server closes it after its header timeout (1 s here): EOF well before this deadline.
        assert await asyncio.wait_for(reader.read(-1), 30) == b""
    finally:
        writer.close()


async def test_a_body_that_never_arrives_is_answered_408(hostile: Gateway) -> None:
    headers = [
        (b"Authorization", f"Bearer {hostile.key}".encode()),
        (b"Content-Type", b"application/json"),
        (b"Content-Length", b"1000"),
    ]
    reader, writer = await asyncio.open_connection("127.0.0.1", hostile.port)
    try:
        writer.write(http_request("POST", CHAT, hostile.port, headers, b'{"model": '))  # 10 of 1000 bytes
        await writer.drain()
        data = await asyncio.wait_for(reader.read(-1), 30)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data[:300]
    err = json.loads(body)["error"]
    assert err["code"] == "body_timeout" and "1s" in err["message"]


# -- properties -------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12,
)
nested = st.integers(1, 3000).map(lambda n: b'{"model": "tiny", "messages": ' + b"[" * n + b"]" * n + b"}")
hostile_bodies = st.one_of(
    st.binary(max_size=300),
    nested,
    st.integers(1, 3000).map(lambda n: b"[" * n),
    st.integers(1, 3000).map(lambda n: b'{"a": ' * n),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.fixed_dictionaries(
        {"model": st.just("tiny") | json_values, "messages": st.just(HI) | json_values},
        optional={
            "stream": st.booleans() | json_values,
            "stream_options": json_values,
            "max_tokens": st.integers(-5, 2**40) | json_values,
            "max_completion_tokens": json_values,
            "prompt": json_values,
            "input": json_values,
            "n": json_values,
        },
    ).map(lambda v: json.dumps(v).encode()),
    st.integers(60, 200).map(lambda n: json.dumps({"model": "tiny", "messages": HI * n}).encode()),
)
header_values = st.binary(max_size=40).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


def _encode(encoding: str, valid: bool, body: bytes) -> bytes:
    if not valid:
        return body
    if encoding == "gzip":
        return gzip.compress(body)
    if encoding == "deflate":
        return zlib.compress(body)
    return body  # no brotli encoder here: a br body is always one the server cannot decode


@st.composite
def hostile_requests(draw: st.DrawFn, key: str, port: int) -> bytes:
    method = draw(st.sampled_from(["POST", "POST", "POST", "GET", "PUT", "DELETE"]))
    path = draw(st.sampled_from([CHAT, "/v1/completions", "/v1/embeddings", "/v1/models", "/v1/nope", "/%ff"]))
    body = draw(hostile_bodies)
    auth = draw(
        st.one_of(
            st.just(f"Bearer {key}".encode()),
            header_values.map(lambda junk: f"Bearer {key[:20]}".encode() + junk),
            header_values.map(lambda junk: b"Bearer " + junk),
            st.just(b""),
        )
    )
    headers = [(b"Authorization", auth)] if auth else []
    encoding = draw(st.sampled_from(["", "gzip", "deflate", "br"]))
    if encoding:
        body = _encode(encoding, draw(st.booleans()), body)
        headers.append((b"Content-Encoding", encoding.encode()))
    headers.append((b"Content-Type", draw(st.sampled_from([b"application/json", b"text/plain", b"\xff"]))))
    headers.append((b"X-Request-Id", draw(header_values)))
    headers.append((b"Content-Length", str(len(body)).encode()))
    return http_request(method, path, port, headers, body)


@st.composite
def hostile_framings(draw: st.DrawFn, key: str, port: int) -> tuple[bytes, bool]:
    body = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 1}).encode()
    headers = [(b"Authorization", f"Bearer {key}".encode()), (b"Content-Type", b"application/json")]
    kind = draw(st.sampled_from(["short", "long", "junk_length", "chunked", "bad_chunks", "both", "two_lengths"]))
    if kind == "short":
        headers.append((b"Content-Length", str(draw(st.integers(0, len(body) - 1))).encode()))
    elif kind == "long":
        headers.append((b"Content-Length", str(len(body) + draw(st.integers(1, 10**6))).encode()))
    elif kind == "junk_length":
        headers.append((b"Content-Length", draw(st.sampled_from([b"-1", b"abc", b"1e3", b"99999999999999999999"]))))
    elif kind == "two_lengths":
        headers += [(b"Content-Length", str(len(body)).encode()), (b"Content-Length", b"3")]
    else:
        headers.append((b"Transfer-Encoding", b"chunked"))
        if kind == "both":
            headers.append((b"Content-Length", str(len(body)).encode()))
        if kind == "bad_chunks":
            size = draw(st.sampled_from([b"zz", b"-5", b"ffffffffffffffffffff", b"5;ext", b"1000"]))
            body = size + b"\r\n" + body + b"\r\n0\r\n\r\n"
        else:
            cut = draw(st.integers(1, len(body) - 1))
            body = b"".join(f"{len(p):x}\r\n".encode() + p + b"\r\n" for p in (body[:cut], body[cut:])) + b"0\r\n\r\n"
    return http_request("POST", CHAT, port, headers, body), draw(st.booleans())


def _drawn(strategy: st.SearchStrategy, examples: int) -> list:
    """Examples drawn by Hypothesis from a synchronous function; the test sends them afterwards."""
    drawn: list = []

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(strategy)
    def draw(example: object) -> None:
        drawn.append(example)

    draw()
    return drawn


def _server_fault(status: int | None) -> bool:
    # 502/503/504 are the fleet's (no replica, an engine failure or timeout), never a client's doing;
    # anything else from 500 up is the gateway failing on client input.
    return status is not None and status >= 500 and status not in (502, 503, 504)


async def test_hostile_bodies_headers_and_encodings_never_get_a_500(hostile: Gateway, tiny: Path) -> None:  # noqa: F811
    await with_engine(hostile, tiny)
    seen: set[int | None] = set()
    # Two fixed requests first, so every run surely sees a refusal by the key layer and by the body layer.
    valid = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 1}).encode()
    reaches = [
        http_request(
            "POST",
            CHAT,
            hostile.port,
            [(b"Authorization", b"Bearer sk-not-a-key"), (b"Content-Length", str(len(valid)).encode())],
            valid,
        ),
        http_request(
            "POST",
            CHAT,
            hostile.port,
            [(b"Authorization", f"Bearer {hostile.key}".encode()), (b"Content-Length", b"100")],
            b"[" * 100,
        ),
    ]
    for request in reaches + _drawn(hostile_requests(hostile.key, hostile.port), 150):
        status, headers, body = await raw_exchange(hostile.port, request)
        seen.add(status)
        assert not _server_fault(status), f"{request[:300]!r} → {status} {body[:300]!r}"
        if status is not None and status >= 400 and headers.get("content-type", "").startswith("application/json"):
            assert_openai_error(status, headers, body)
    assert 'status="500"' not in await metrics(hostile)
    assert {400, 401} <= seen
    await answers_normally(hostile)


async def test_hostile_framings_never_get_a_500(hostile: Gateway, tiny: Path) -> None:  # noqa: F811
    await with_engine(hostile, tiny)
    for request, half_close in _drawn(hostile_framings(hostile.key, hostile.port), 60):
        status, _, body = await raw_exchange(hostile.port, request, half_close=half_close)
        assert not _server_fault(status), f"{request[:300]!r} → {status} {body[:300]!r}"
    assert 'status="500"' not in await metrics(hostile)
    await answers_normally(hostile)


# -- the engine's prompt cache ------------------------------------------------------------------------


def test_the_prompt_cache_bound_follows_the_memory_reservation_and_a_profile_can_set_its_own() -> None:
    assert prompt_cache_mib(None) == 1024
    assert prompt_cache_mib(16) == 4096, "a quarter of a 16 GiB reservation"
    assert prompt_cache_mib(0.05) == 64 and prompt_cache_mib(1000) == 8192
    assert with_prompt_cache_bound(["--temp", "0"], 4) == ["--temp", "0", "--cache-ram", "1024"]
    assert with_prompt_cache_bound(["--cache-ram", "100"], 4) == ["--cache-ram", "100"]
    assert with_prompt_cache_bound(["--cache-ram=0"], 4) == ["--cache-ram=0"]
    params = build_params(
        ServerArgs(model="m.gguf", host="h", port=1, threads=1, parallel=1, ctx_size=0, extra=["--cache-ram", "64"]),
        "key",
    )
    assert params.cache_ram_mib == 64


async def test_the_engine_runs_with_its_prompt_cache_bounded(hostile: Gateway, tiny: Path) -> None:  # noqa: F811
    await with_engine(hostile, tiny)
    [replica] = await hostile.fleet.ready("tiny")
    # The engine process the agent started was given the bound: the fleet's test profile reserves 0.05 GB.
    argv = Path(f"/proc/{replica['pid']}/cmdline").read_bytes().split(b"\0")
    assert argv[argv.index(b"--cache-ram") + 1] == b"64", argv
    await answers_normally(hostile)
