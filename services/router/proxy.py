"""Upstream: sending a request to a replica's engine, retrying elsewhere while nothing has reached the
client, and passing the answer back whole or streamed (docs/gateway.md, steps 9 and 10).

An engine that refuses the request itself (a 4xx, or 501 for an endpoint its model does not serve)
is answered at once as the client's error (:func:`engine_refusal`); an engine that fails before the
first byte reaches the client is tried again on another replica (or a fresh connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from llmgw.events.runtime.secrets import engine_key
from llmgw.services.router.config import RouterConfig
from llmgw.services.router.errors import ApiError, id_headers
from llmgw.services.router.metrics import RouterMetrics
from llmgw.services.router.state import ReplicaInfo
from llmgw.services.router.tracing import Tracing
from llmgw.services.router.usage_record import Call

_dec = msgspec.json.Decoder()


class Target(msgspec.Struct, frozen=True, kw_only=True):
    """Where a request goes instead of a replica's engine: an external provider (GW-12). Its secrets
    (the provider's key) are taken out of any text of the provider's that is passed on or recorded."""

    url: str  # the whole URL of the request
    authorization: str
    label: str  # how errors name it: "provider api.example.com"
    secrets: tuple[str, ...] = ()

    def redact(self, text: str) -> str:
        for s in self.secrets:
            if s:
                text = text.replace(s, "[key]")
        return text


class RetryElsewhere(Exception):
    """The replica failed before the first byte reached the client: another may be tried."""


class ClientGone(Exception):
    """Writing to the client failed: it went away mid-answer."""


class Upstream:
    """The engines, as the router reaches them: pooled connections, the engine key, in-flight counts."""

    def __init__(self, cfg: RouterConfig, metrics: RouterMetrics) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.outstanding: dict[str, int] = {}  # replica id -> requests in flight there
        self.on_release: Callable[[str], None] | None = None  # told the model whenever a request leaves a replica
        self.tracing = Tracing(None)  # the router's own replaces this (off until then)
        self.secret = b""
        self._engine_auth: dict[str, str] = {}  # replica id -> its engine's Authorization header
        self._timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.connect_s)
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None

    def open(self, secret: bytes) -> None:
        self.secret = secret
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300), auto_decompress=False
        )
        # Retries go out on new connections: a pooled keep-alive connection the engine had closed
        # (llama.cpp closes one after each streamed answer) fails before any byte is sent, and with
        # one replica every retry could otherwise draw another such connection.
        self._fresh = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True), auto_decompress=False
        )

    async def close(self) -> None:
        if self._session:
            await self._session.close()
        if self._fresh:
            await self._fresh.close()

    async def attempt(
        self,
        request: web.Request,
        call: Call,
        ranked: list[ReplicaInfo],
        payload: bytes,
        limit_headers: dict[str, str],
    ) -> tuple[web.StreamResponse | None, ApiError | None]:
        """Try the replicas in order (cycling, at least ``max_attempts`` tries): the answer and the
        replica's id in ``call.replica``, or (None, why the last one failed)."""
        assert call.model is not None
        model = call.model
        last: ApiError | None = None
        # Cycle through the replicas: with one replica, a retry still gets a fresh connection
        # (a pooled keep-alive connection the engine had closed fails before any byte is sent).
        attempts = [ranked[i % len(ranked)] for i in range(max(self.cfg.max_attempts, len(ranked)))]
        for n, replica in enumerate(attempts):
            if n:
                self.metrics.retries_of(model.name).inc()
            call.replica = replica
            with self.tracing.attempt(replica.replica_id, n + 1, model.name) as span:
                try:
                    return await self.send(request, call, replica, payload, limit_headers, fresh=n > 0), None
                except RetryElsewhere as exc:
                    last = ApiError(502, f"replica {replica.replica_id} of {model.name} failed: {exc}", "engine_error")
                    if span is not None:
                        span.set_attribute("llmgw.retry_elsewhere", str(exc))
        return None, last

    async def send(
        self,
        request: web.Request,
        call: Call,
        replica: ReplicaInfo,
        payload: bytes,
        limit_headers: dict[str, str],
        fresh: bool = False,
        target: Target | None = None,
    ) -> web.StreamResponse:
        """One try at ``replica``'s engine, or at ``target`` (an external provider) when given."""
        assert self._session is not None and (replica.url or target)
        rid = replica.replica_id
        if target is None:
            url, label = f"{replica.url}{call.endpoint}", f"replica {rid}"
            headers = {
                "Authorization": self._engine_authorization(rid),
                "Content-Type": "application/json",
                "X-Request-Id": call.request_id,
            }
            self.tracing.inject(headers)  # the engine joins the request's trace (traceparent)
        else:
            # A provider gets the request and its key, nothing of the cluster's (no trace context); and
            # plain bytes, since answers pass through undecoded and their usage is read.
            url, label = target.url, target.label
            headers = {
                "Authorization": target.authorization,
                "Content-Type": "application/json",
                "Accept-Encoding": "identity",
                "X-Request-Id": call.request_id,
            }
        self.outstanding[rid] = self.outstanding.get(rid, 0) + 1
        gauge = self.metrics.in_flight_of(replica.model, rid)
        gauge.inc()
        try:
            try:
                session = self._fresh if fresh and self._fresh else self._session
                upstream_cm = session.post(url, data=payload, headers=headers, timeout=self._timeout)
                async with asyncio.timeout(self.cfg.first_token_s):
                    upstream = await upstream_cm.__aenter__()
            except TimeoutError as exc:
                raise ApiError(
                    504,
                    f"{label} did not answer within {self.cfg.first_token_s:.0f}s (first_token timeout)",
                    "timeout_first_token",
                ) from exc
            except (aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError, OSError) as exc:
                raise RetryElsewhere(str(exc) or type(exc).__name__) from exc
            try:
                if upstream.status >= 400:
                    try:
                        async with asyncio.timeout(self.cfg.idle_s):
                            text = (await upstream.read())[:1000].decode(errors="replace")
                    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
                        why = str(exc) or type(exc).__name__
                        raise RetryElsewhere(f"the engine failed while answering {upstream.status}: {why}") from exc
                    if target is not None:
                        text = target.redact(text)
                        if upstream.status in (401, 403, 408, 429) or upstream.status >= 500:
                            # Its key refused, its limits reached or itself failing: another provider may answer.
                            raise RetryElsewhere(f"it answered {upstream.status}: {text[:300]}")
                    refusal = engine_refusal(upstream.status, text, replica.model, call.endpoint)
                    if refusal is None:
                        raise RetryElsewhere(f"engine answered {upstream.status}: {text[:300]}")
                    raise refusal  # the request's fault: the same on every replica, so not retried
                if call.stream and upstream.status == 200:
                    return await self._stream(request, call, upstream, limit_headers)
                return await self._whole(call, upstream, limit_headers)
            finally:
                await upstream_cm.__aexit__(None, None, None)
        finally:
            self.outstanding[rid] -= 1
            gauge.dec()
            if self.on_release is not None:
                self.on_release(replica.model)  # a slot freed: the queue serves its next request

    def _engine_authorization(self, replica_id: str) -> str:
        """The Authorization header for a replica's engine: an HMAC, so computed once per replica."""
        auth = self._engine_auth.get(replica_id)
        if auth is None:
            if len(self._engine_auth) >= 4096:
                self._engine_auth.clear()  # replicas come and go: keep the cache bounded
            auth = self._engine_auth[replica_id] = f"Bearer {engine_key(self.secret, replica_id)}"
        return auth

    async def _whole(self, call: Call, upstream: aiohttp.ClientResponse, limit_headers: dict[str, str]) -> web.Response:
        try:
            async with asyncio.timeout(self.cfg.total_s):
                data = await upstream.read()
        except TimeoutError as exc:
            raise ApiError(
                504, f"the engine did not finish within {self.cfg.total_s:.0f}s (total timeout)", "timeout_total"
            ) from exc
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise ApiError(502, f"the engine failed mid-answer: {exc}", "engine_error") from exc
        call.status = upstream.status
        if upstream.status == 200:
            _count(call, data)
        elif upstream.status >= 400:
            call.error = data[:300].decode(errors="replace")
        call.ttft_s = time.monotonic() - call.started
        headers = {**id_headers(call.request_id, call.client_request_id), **limit_headers}
        return web.Response(
            body=data, status=upstream.status, headers=headers, content_type=upstream.content_type or "application/json"
        )

    async def _stream(
        self, request: web.Request, call: Call, upstream: aiohttp.ClientResponse, limit_headers: dict[str, str]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **id_headers(call.request_id, call.client_request_id),
                **limit_headers,
            },
        )
        content = upstream.content
        try:
            lines, rest = await _read_lines(content, b"", self.cfg.first_token_s)
        except TimeoutError as exc:
            raise ApiError(
                504, f"no first token within {self.cfg.first_token_s:.0f}s (first_token timeout)", "timeout_first_token"
            ) from exc
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            raise RetryElsewhere(f"the engine closed before its first byte: {exc}") from exc
        if not lines:
            raise RetryElsewhere("the engine closed before its first byte")
        call.status = 200
        await resp.prepare(request)
        call.ttft_s = time.monotonic() - call.started
        deadline = call.started + self.cfg.total_s
        try:
            while lines:
                # Every line the engine has sent so far goes on in one write (one chunk, one send):
                # the same bytes as line by line, never held back waiting for more.
                for line in lines.split(b"\n"):
                    if line.startswith(b"data: {"):
                        if b'"usage"' in line:
                            _count_chunk(call, line)
                        elif b'"content"' in line or b'"text"' in line:
                            call.tokens_out += 1  # one chunk per token, until the usage chunk says exactly
                try:
                    await resp.write(lines)
                except ConnectionError as exc:
                    # "Connection lost" while waiting for a client that stopped reading, or a reset.
                    raise ClientGone(str(exc)) from exc
                idle = min(self.cfg.idle_s, deadline - time.monotonic())
                if idle <= 0:
                    call.status, call.error = 504, "total timeout mid-stream"
                    break
                try:
                    lines, rest = await _read_lines(content, rest, idle)
                except TimeoutError:
                    call.status, call.error = 504, f"no token for {self.cfg.idle_s:.0f}s (idle timeout)"
                    break
        except (ClientGone, asyncio.CancelledError) as exc:
            # The client went away: leaving this block closes the engine connection, which stops its work.
            call.status, call.error = 499, "client closed the connection mid-stream"
            if isinstance(exc, ClientGone):
                raise ConnectionResetError(str(exc)) from exc
            raise
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            call.status, call.error = 502, f"the engine failed mid-stream: {exc}"
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp


_ENDPOINT_WORDS = {
    "/v1/chat/completions": "chat completions",
    "/v1/completions": "text completions",
    "/v1/embeddings": "embeddings",
}


# llama.cpp answers 500, not 400, for messages or tools it cannot parse (an assistant's `custom` tool
# call) and for images, audio or video sent to a model without a projector (`--mmproj`).
_REQUEST_FAULT = re.compile(
    r"Failed to parse (messages|tools|tool call arguments)|(image|audio|video) input is not supported"
)


def engine_refusal(status: int, text: str, model: str, endpoint: str) -> ApiError | None:
    """What the client is told when an engine refuses a request, or None when the engine failed.

    An engine's 4xx is about the request and 501 says the model does not serve this endpoint: both
    would be the same on every replica, so they go back to the client as 400s (never 5xx, never
    retried). 401/403 are the engine refusing the gateway's own key and every other 5xx is the
    engine failing: those are retried elsewhere."""
    if status == 501:
        what = _ENDPOINT_WORDS.get(endpoint, endpoint)
        enabled = "with embeddings enabled" if endpoint == "/v1/embeddings" else f"that serves {what}"
        return ApiError(
            400,
            f"the model {model} does not serve {what}; use a model {enabled}",
            "model_not_supported",
        )
    if status == 500 and _REQUEST_FAULT.search(text):
        status = 400  # llama.cpp's 500 for a request it cannot take: the same on every replica
    if status >= 500 or status in (401, 403):
        return None
    message = text
    error: Any = None
    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):
        error = _dec.decode(text.encode()).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    message = str(message or text).strip()[:500] or f"the engine answered {status}"
    if isinstance(error, dict) and (
        error.get("type") == "exceed_context_size_error" or "n_ctx" in error or "context" in message.lower()
    ):
        # llama.cpp's own shape (a numeric code, n_ctx, n_prompt_tokens) said in OpenAI's words.
        n_ctx, n_prompt = error.get("n_ctx"), error.get("n_prompt_tokens")
        size = f" ({n_prompt} prompt tokens; the context holds {n_ctx})" if n_ctx and n_prompt else ""
        return ApiError(
            400,
            f"the request is longer than model {model}'s context{size}: shorten the messages or lower max_tokens",
            "context_length_exceeded",
        )
    code = "request_too_large" if status == 413 else "engine_refused"
    return ApiError(413 if status == 413 else 400, f"the model {model} refused the request: {message}", code)


_MAX_LINE = 1 << 17  # a longer line is passed on in pieces rather than buffered whole


async def _read_lines(content: aiohttp.StreamReader, rest: bytes, timeout_s: float) -> tuple[bytes, bytes]:
    """Every complete line the engine has sent, and the incomplete rest after them.

    Waits (at most ``timeout_s``, else ``TimeoutError``) only while not one complete line has
    arrived, so a timer is armed only when there is something to wait for. At the end of the
    stream the rest counts as a line (as ``readline`` returns it); ``b""`` is the end.
    """
    data = rest + content.read_nowait()
    if b"\n" not in data and len(data) < _MAX_LINE:
        async with asyncio.timeout(timeout_s):
            while True:
                more = await content.readany()
                if not more:
                    return data, b""
                data += more
                if b"\n" in more or len(data) >= _MAX_LINE:
                    break
        data += content.read_nowait()
    cut = data.rfind(b"\n") + 1
    if cut == 0:
        return data, b""
    return data[:cut], data[cut:]


class _Usage(msgspec.Struct):
    """An answer's ``usage`` alone: the rest (the choices, their text) is skipped, not built."""

    usage: Any = None


_usage_dec = msgspec.json.Decoder(_Usage)


def _count(call: Call, data: bytes) -> None:
    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):  # ValidationError is a DecodeError
        usage = _usage_dec.decode(data).usage or {}
        call.tokens_in = int(usage.get("prompt_tokens", call.tokens_in) or 0)
        call.tokens_out = int(usage.get("completion_tokens", 0) or 0)


def _count_chunk(call: Call, line: bytes) -> None:
    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError, ValueError):
        usage = _usage_dec.decode(line[6:]).usage
        if usage:
            call.tokens_in = int(usage.get("prompt_tokens", call.tokens_in) or 0)
            call.tokens_out = int(usage.get("completion_tokens", call.tokens_out) or 0)
