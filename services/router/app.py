"""The gateway: an OpenAI-compatible API in front of the fleet (SPEC GW-1 to GW-8, SCHED-5, SCHED-12).

The request path is a fixed sequence of layers, each able to answer early:

    request id → body → key → model → servable? → limits → budget → replica → proxy → usage

Everything a layer needs is in memory, folded from the log (:mod:`.state`); the only network
calls on the path are the engine itself and, for scopes with a budget, one compare-and-set on the
budget book. Usage records and limit gossip leave the path through queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import random
import re
import time
from datetime import UTC, datetime
from typing import Any

import aiohttp
import msgspec
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from llmgw.events import access as A
from llmgw.events import subjects as S
from llmgw.events.envelope import RecordedEvent
from llmgw.events.ids import new_id
from llmgw.events.retry import keep_running
from llmgw.events.secrets import engine_key, engine_key_secret
from llmgw.events.store import EventStore
from llmgw.events.usage import UsageRecord
from llmgw.services.router.budgets import BudgetBook, BudgetExceeded, cost, max_cost
from llmgw.services.router.journal import JournalError
from llmgw.services.router.limits import Level, Limiter
from llmgw.services.router.metrics import PoolSaturation, RouterMetrics, UsageMetrics, pool_loads
from llmgw.services.router.routing import Affinity, order, prefix_key
from llmgw.services.router.state import KeyInfo, ModelInfo, ReplicaInfo, RouterState
from llmgw.services.router.usage import StopReport, UsageConfig, UsagePublisher
from llmgw.services.router.validation import (
    Invalid,
    RequestLimits,
    check_body,
    check_depth,
    max_prompt_tokens,
    prompt_text,
)

log = structlog.get_logger("llmgw.router")
access_log = structlog.get_logger("llmgw.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()
GOSSIP_SUBJECT = f"{S.PREFIX}.gossip.limits"
DEMAND_ROOT = f"{S.PREFIX}.demand"


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True):
    first_token_s: float = 60.0
    idle_s: float = 30.0
    total_s: float = 600.0
    connect_s: float = 5.0
    max_body_bytes: int = 4 * 1024 * 1024
    activation_s: float = 60.0  # how long a request waits for an on-demand replica
    default_max_tokens: int = 4096  # what a request without max_tokens may cost, for budgets
    saturation: int = 4  # in-flight requests at which prefix affinity lets go (llama.cpp slots)
    gossip_s: float = 0.1
    max_attempts: int = 3
    # Limits on what reaches an engine (docs/gateway.md, "Limits on requests").
    max_messages: int = 2048  # messages (or batched prompts/inputs) in one request
    max_json_depth: int = 64  # how deeply arrays and objects in a body may nest
    max_prompt_tokens: int = 1_048_576  # the prompt's upper-bound estimate: one token per byte + 16 per message
    max_output_tokens: int = 131_072  # max_tokens / max_completion_tokens above this are refused
    # A connection that has not sent a whole request head within header_s is closed (also the idle
    # keep-alive timeout); a body that has not arrived within body_s is answered 408.
    header_s: float = 10.0
    body_s: float = 30.0
    # usage records the bus has not acknowledged go to this directory (None: memory only, see docs/usage.md)
    usage_journal: str | None = None
    usage_memory_records: int = 10_000  # held in memory before they go to the journal
    usage_ack_timeout_s: float = 5.0  # a usage record not acknowledged within this is retried


class ApiError(Exception):
    """An answer in OpenAI's error shape."""

    TYPES = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
    }

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        headers: dict[str, str] | None = None,
        param: str | None = None,
    ) -> None:
        self.status = status
        self.message = message
        self.code = code
        self.headers = headers or {}
        self.param = param
        super().__init__(message)

    def response(self, request_id: str) -> web.Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error"),
                "param": self.param,
                "code": self.code,
            }
        }
        headers = {"x-request-id": request_id, **self.headers}
        close = headers.pop("Connection", None) == "close"
        resp = web.Response(
            body=_enc.encode(body), status=self.status, headers=headers, content_type="application/json"
        )
        if close:
            resp.force_close()  # the rest of the body cannot be read: the client must not reuse the connection
        return resp


class Call(msgspec.Struct, kw_only=True):
    """One request's facts, filled in layer by layer, ending as its usage record."""

    request_id: str
    started: float
    at: datetime
    endpoint: str
    key: KeyInfo | None = None
    model_asked: str = ""
    model: ModelInfo | None = None
    replica: ReplicaInfo | None = None
    stream: bool = False
    status: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    queue_s: float = 0.0
    ttft_s: float | None = None
    error: str | None = None
    levels: list[Level] = []
    holds: list[tuple[str, str, float]] = []  # (scope, period, usd) reserved
    cost_usd: float = 0.0
    billed: bool = True  # False: refused before admission because usage could not be kept


class Router:
    def __init__(
        self,
        store: EventStore,
        cfg: RouterConfig | None = None,
        registry: CollectorRegistry | None = None,
        instance: str | None = None,
    ) -> None:
        self.store = store
        self.cfg = cfg or RouterConfig()
        self.instance = instance or f"router-{new_id()[-12:]}"
        self.state = RouterState()
        self.limiter = Limiter()
        self.affinity = Affinity()
        self.metrics = RouterMetrics(registry)
        self.metrics.registry.register(PoolSaturation(self._pool_loads))
        self.usage = UsagePublisher(
            store.js,
            store.nc,
            UsageConfig(
                journal_dir=self.cfg.usage_journal,
                memory_records=self.cfg.usage_memory_records,
                ack_timeout_s=self.cfg.usage_ack_timeout_s,
            ),
            UsageMetrics(self.metrics.registry, self._usage_gauges),
        )
        self.budgets = BudgetBook(store.js)
        self.outstanding: dict[str, int] = {}
        self._secret = b""
        self._engine_auth: dict[str, str] = {}  # replica id -> its engine's Authorization header
        self._upstream_timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.cfg.connect_s)
        self._session: aiohttp.ClientSession | None = None
        self._fresh: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        self._gossip: dict[str, list[int]] = {}  # scope -> [requests, tokens] admitted here since last sync
        self._demand_sent: dict[str, float] = {}
        self._caught_up = asyncio.Event()
        self._rng = random.Random()
        self._request_limits = RequestLimits(
            max_messages=self.cfg.max_messages,
            max_json_depth=self.cfg.max_json_depth,
            max_prompt_tokens=self.cfg.max_prompt_tokens,
            max_output_tokens=self.cfg.max_output_tokens,
        )

    def _usage_gauges(self) -> tuple[int, float | None, bool]:
        b = self.usage.backlog()
        return b.records, b.oldest_s, b.refusing is not None

    def _pool_loads(self) -> list[tuple[str, float]]:
        ready = {m: [r.replica_id for r in self.state.ready(m)] for m in self.state.models}
        return pool_loads(ready, self.outstanding, self.cfg.saturation)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self._secret = await engine_key_secret(self.store.js)
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            auto_decompress=False,
        )
        # Retries go out on new connections: a pooled keep-alive connection the engine had closed
        # (llama.cpp closes one after each streamed answer) fails before any byte is sent, and with
        # one replica every retry could otherwise draw another such connection.
        self._fresh = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True), auto_decompress=False
        )
        try:
            await self.usage.start()  # publishes what an earlier run left in the journal
        except JournalError as exc:
            raise SystemExit(f"error: {exc}") from exc
        target = await self.store.stream_last_seq()
        self._tasks.append(asyncio.create_task(self._follow(target), name="router-follow"))
        self._tasks.append(asyncio.create_task(self._gossip_loop(), name="router-gossip"))
        await self.store.nc.subscribe(GOSSIP_SUBJECT, cb=self._on_gossip)
        await asyncio.wait_for(self._caught_up.wait(), 60)
        # Start-up objects live as long as the process: keep them out of every collection, so the
        # collector only ever walks per-request garbage (LiteLLM's p99 was full collections).
        gc.collect()
        gc.freeze()

    async def stop(self) -> StopReport:
        """Stop; usage records not yet acknowledged are published (bounded) or journaled, and what
        neither took is logged and reported."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        report = await self.usage.stop()
        if self._session:
            await self._session.close()
        if self._fresh:
            await self._fresh.close()
        return report

    async def _follow(self, target: int) -> None:
        if target == 0:
            self._caught_up.set()

        async def follow_once() -> None:
            # From where the fold is: a reader started again never applies an event twice.
            async for batch in self.store.subscribe(f"{S.EVENTS_ROOT}.>", after=self.state.position, follow=True):
                for e in batch:
                    if isinstance(e, RecordedEvent):
                        self.state.apply(e)
                    else:
                        self.state.position = max(self.state.position, e.seq)
                if self.state.position >= target:
                    self._caught_up.set()

        # The reader rides out NATS trouble itself; any other failure starts it again, logged, so the
        # router's view of the fleet never silently stops moving. Cancelled by stop().
        await keep_running("router log", follow_once, stop=asyncio.Event(), closed=lambda: self.store.nc.is_closed)

    # -- limit gossip ------------------------------------------------------------------------

    async def _gossip_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.gossip_s)
            if not self._gossip:
                continue
            deltas, self._gossip = self._gossip, {}
            msg = {"from": self.instance, "at": time.time(), "deltas": deltas}
            with contextlib.suppress(Exception):
                await self.store.nc.publish(GOSSIP_SUBJECT, _enc.encode(msg))

    async def _on_gossip(self, msg: Any) -> None:
        try:
            body = _dec.decode(msg.data)
            if body.get("from") == self.instance:
                return
            at = float(body["at"])
            for scope, (reqs, toks) in body["deltas"].items():
                self.limiter.merge(scope, at, int(reqs), int(toks))
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            log.warning("malformed limit gossip ignored")

    def _note(self, levels: list[Level], requests: int, tokens: int) -> None:
        for lv in levels:
            entry = self._gossip.setdefault(lv.scope, [0, 0])
            entry[0] += requests
            entry[1] += tokens

    # -- the app -----------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.cfg.max_body_bytes,
            middlewares=[self._errors],
            # aiohttp arms this timer when a connection opens and again after each answer, and closes
            # the connection if no whole request head has arrived by then: the header-read timeout
            # (a slow-header client cannot hold a connection) and the idle keep-alive timeout in one.
            handler_args={"keepalive_timeout": self.cfg.header_s},
        )
        app.router.add_get("/healthz", self.healthz)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        return app

    async def healthz(self, request: web.Request) -> web.Response:
        usage = self.usage.backlog()
        # Refusing billable requests is 503, so a load balancer sends them to a router that can bill;
        # a backlog kept in the journal is not: requests are still billed.
        ok = self.store.nc.is_connected and self._caught_up.is_set() and usage.refusing is None
        body = {
            "status": "ok" if ok else "degraded",
            "nats": "connected" if self.store.nc.is_connected else "disconnected",
            "models": len(self.state.models),
            "usage": msgspec.to_builtins(usage),
        }
        return web.json_response(body, status=200 if ok else 503)

    def _admit_billable(self, call: Call) -> None:
        """Refuse a billable request while its usage record could not be kept (GW-8: never serve unbilled)."""
        reason = self.usage.refusal()
        if reason is not None:
            call.billed = False  # nothing was served: no record to keep
            if self.usage.metrics:
                self.usage.metrics.refused.inc()
            raise ApiError(503, reason, "usage_unavailable", {"retry-after": "10"})

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every answer in OpenAI's error shape with a request id: aiohttp's own (no such route, a
        method not allowed) and, for a fault in the gateway itself, a logged 500."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return _http_error(exc, request).response(self._request_id(request))
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as exc:
            rid = self._request_id(request)
            log.exception("request failed", request_id=rid, path=request.path)
            return ApiError(
                500,
                f"internal error in the gateway ({type(exc).__name__}); request id {rid} is in the gateway's log",
                "internal_error",
            ).response(rid)

    def _request_id(self, request: web.Request) -> str:
        given = request.headers.get("x-request-id")
        return given if given and _REQUEST_ID.match(given) else new_id()

    def _authenticate(self, request: web.Request) -> KeyInfo:
        auth = request.headers.get("authorization", "")
        if not auth.lower().startswith("bearer "):
            raise ApiError(
                401,
                "no API key: send `Authorization: Bearer <key>` (make one with "
                "`llmgw ctl key create --project ORG/TEAM/PROJECT`)",
                "missing_api_key",
            )
        secret = auth[7:].strip()
        if not secret.isascii():
            # aiohttp passes bytes that are not UTF-8 through as surrogates; a key is plain ASCII.
            raise ApiError(401, "invalid API key: it has characters no key has", "invalid_api_key")
        prefix = A.key_prefix(secret)
        key = self.state.keys.get(prefix) if prefix else None
        if key is None or not hmac.compare_digest(key.secret_sha256, A.hash_api_key(secret)):
            raise ApiError(401, "invalid API key: it is unknown or was revoked", "invalid_api_key")
        if key.expires_at is not None and key.expires_at <= time.time():
            raise ApiError(401, f"API key {key.prefix} expired; make a new one", "expired_api_key")
        return key

    async def list_models(self, request: web.Request) -> web.Response:
        rid = self._request_id(request)
        try:
            key = self._authenticate(request)
        except ApiError as exc:
            return exc.response(rid)
        data = []
        for m in sorted(self.state.models.values(), key=lambda m: m.name):
            if key.models and m.name not in key.models:
                continue
            data.append(
                {"id": m.name, "object": "model", "created": 0, "owned_by": "llmgw", "aliases": list(m.spec.aliases)}
            )
        return web.json_response({"object": "list", "data": data}, headers={"x-request-id": rid})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/completions")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/embeddings")

    # -- one request -------------------------------------------------------------------------

    async def _serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        call = Call(
            request_id=self._request_id(request), started=time.monotonic(), at=datetime.now(UTC), endpoint=endpoint
        )
        response: web.StreamResponse | None = None
        try:
            body, raw = await self._body(request, endpoint)
            call.key = self._authenticate(request)
            self._admit_billable(call)
            call.model_asked = body["model"]
            call.stream = bool(body.get("stream", False))
            model = self._model(call.key, call.model_asked)
            call.model = model
            prompt = prompt_text(body, endpoint)
            call.tokens_in = max(1, len(prompt) // 4)  # an estimate until the engine counts
            limit_headers = self._limits(call, body)
            await self._reserve(call, body)
            response = await self._route(request, call, body, raw, prompt, limit_headers)
            return response
        except ApiError as exc:
            call.status, call.error = exc.status, exc.message
            return exc.response(call.request_id)
        except (asyncio.CancelledError, ConnectionError):
            # The client went away (ConnectionError covers aiohttp's "Connection lost" on a write
            # waiting for the client to read, as well as a reset).
            call.status = 499
            raise
        except Exception as exc:
            log.exception("request failed", request_id=call.request_id)
            call.status, call.error = 500, f"internal error: {exc}"
            return ApiError(
                500,
                f"internal error in the gateway ({type(exc).__name__}); request id "
                f"{call.request_id} is in the gateway's log",
                "internal_error",
            ).response(call.request_id)
        finally:
            await self._finish(call)

    async def _body(self, request: web.Request, endpoint: str) -> tuple[dict[str, Any], bytes]:
        encoding = request.headers.get("content-encoding", "identity")
        try:
            async with asyncio.timeout(self.cfg.body_s):
                raw = await request.read()
        except TimeoutError as exc:
            raise ApiError(
                408,
                f"the request body did not arrive within {self.cfg.body_s:g}s; send it whole",
                "body_timeout",
                {"Connection": "close"},
            ) from exc
        except web.HTTPRequestEntityTooLarge as exc:
            raise ApiError(
                413, f"request body is larger than {self.cfg.max_body_bytes} bytes", "body_too_large"
            ) from exc
        except web.RequestPayloadError as exc:
            # A compressed body that does not decompress, or a chunked body cut short or malformed.
            raise ApiError(
                400,
                f"the body could not be read (Content-Encoding: {encoding}): {exc.__cause__ or exc}",
                "invalid_encoding",
                {"Connection": "close"},
            ) from exc
        limits = self._request_limits
        try:
            check_depth(raw, limits)
            try:
                decoded = _dec.decode(raw)
            except RecursionError as exc:  # past the decoder's own stack, should the depth limit be raised
                raise Invalid(400, "the body nests too deeply to decode", "too_deeply_nested") from exc
            except msgspec.DecodeError as exc:
                raise Invalid(400, f"the body is not valid JSON: {exc}", "invalid_json") from exc
            body = check_body(decoded, endpoint, limits)
        except Invalid as exc:
            raise ApiError(exc.status, exc.message, exc.code, param=exc.param) from exc
        return body, raw

    def _model(self, key: KeyInfo, asked: str) -> ModelInfo:
        model = self.state.resolve(asked)
        if model is None:
            names = ", ".join(sorted(m for m in self.state.models if not key.models or m in key.models)[:20])
            raise ApiError(
                404, f"model {asked!r} does not exist" + (f" (models: {names})" if names else ""), "model_not_found"
            )
        if key.models and model.name not in key.models and asked not in key.models:
            raise ApiError(
                403,
                f"this key may not use model {model.name} (allowed: {', '.join(sorted(key.models))})",
                "model_not_allowed",
            )
        return model

    def _limits(self, call: Call, body: dict[str, Any]) -> dict[str, str]:
        key = call.key
        assert key is not None
        levels = []
        for scope in self.state.scopes_of(key):
            lim = self.state.limits.get(scope)
            if lim and (lim[0] is not None or lim[1] is not None):
                levels.append(Level(scope=scope, rpm=lim[0], tpm=lim[1]))
        if not levels:
            return {}
        now = time.time()
        verdict = self.limiter.check(levels, now, call.tokens_in)
        if not verdict.allowed:
            raise ApiError(
                429, verdict.reason, "rate_limited", {"retry-after": str(verdict.retry_after_s), **verdict.headers}
            )
        self.limiter.admit(levels, now)
        self._note(levels, 1, 0)
        call.levels = levels
        return verdict.headers

    async def _reserve(self, call: Call, body: dict[str, Any]) -> None:
        assert call.key is not None and call.model is not None
        price = self.state.prices.get(call.model.name)
        if price is None:
            return
        scopes = [s for s in self.state.scopes_of(call.key) if s in self.state.budgets]
        if not scopes:
            return
        out = (
            body.get("max_tokens")
            or body.get("max_completion_tokens")
            or call.model.spec.max_output
            or self.cfg.default_max_tokens
        )
        amount = max_cost(
            max_prompt_tokens(body, call.endpoint), int(out), price.input_usd_per_m, price.output_usd_per_m
        )
        for scope in scopes:
            b = self.state.budgets[scope]
            try:
                await self.budgets.reserve(scope, b.usd, b.period, call.request_id, amount)
            except BudgetExceeded as exc:
                raise ApiError(429, str(exc), "budget_exceeded", {"retry-after": "3600"}) from exc
            call.holds.append((scope, b.period, amount))

    # -- choosing a replica and proxying -------------------------------------------------------

    def _demand(self, model: str) -> None:
        """Tell the scheduler someone wants this model (on-demand start; fresh placement attempt)."""
        now = time.monotonic()
        if now - self._demand_sent.get(model, 0.0) < 1.0:
            return
        self._demand_sent[model] = now
        task = asyncio.ensure_future(self.store.nc.publish(f"{DEMAND_ROOT}.{S.encode_token(model)}", b""))
        task.add_done_callback(lambda t: t.exception() if not t.cancelled() else None)

    async def _replicas(self, call: Call, model: ModelInfo) -> list[ReplicaInfo]:
        if model.stopped:
            raise ApiError(503, f"model {model.name} was stopped by an administrator", "model_stopped")
        if model.parked:
            self._demand(model.name)
            raise ApiError(
                503,
                f"model {model.name} is parked: {model.parked}; an administrator can "
                f"`llmgw ctl retry {model.name}` once it is fixed",
                "model_parked",
            )
        ready = self.state.ready(model.name)
        if model.on_demand or ready:
            self._demand(model.name)  # keeps an on-demand replica from going idle
        if ready:
            return ready
        starting = self.state.starting(model.name)
        if model.unplaceable and not starting:
            self._demand(model.name)
            raise ApiError(503, f"model {model.name} cannot be placed: {model.unplaceable}", "model_unplaceable")
        if not model.on_demand and not starting:
            self._demand(model.name)
            raise ApiError(
                503, f"model {model.name} has no ready replica and none is starting", "no_replica", {"retry-after": "5"}
            )
        # Hold the request until a replica is ready, within the activation window.
        t0 = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.state.ready_event(model.name).wait(), self.cfg.activation_s)
        call.queue_s += time.monotonic() - t0
        ready = self.state.ready(model.name)
        if not ready:
            raise ApiError(
                503,
                f"model {model.name} has no ready replica yet ({self.state.starting(model.name)} "
                "starting); retry shortly",
                "model_starting",
                {"retry-after": "10"},
            )
        return ready

    async def _route(
        self,
        request: web.Request,
        call: Call,
        body: dict[str, Any],
        raw: bytes,
        prompt: str,
        limit_headers: dict[str, str],
    ) -> web.StreamResponse:
        assert call.model is not None
        models = [call.model] + [m for m in (self.state.resolve(f) for f in call.model.spec.fallbacks) if m]
        last: ApiError | None = None
        payload = raw
        if call.stream:
            # Always ask the engine for usage, so every streamed request is counted.
            body = {**body, "stream_options": {**(body.get("stream_options") or {}), "include_usage": True}}
            payload = _enc.encode(body)
        pkey = prefix_key(prompt)
        for model in models:
            try:
                replicas = await self._replicas(call, model)
            except ApiError as exc:
                last = exc
                continue
            preferred = self.affinity.get(pkey)
            ranked = order(replicas, self.outstanding, preferred, self.cfg.saturation, self._rng.getrandbits(16))
            # Cycle through the replicas: with one replica, a retry still gets a fresh connection
            # (a pooled keep-alive connection the engine had closed fails before any byte is sent).
            attempts = [ranked[i % len(ranked)] for i in range(max(self.cfg.max_attempts, len(ranked)))]
            for attempt, replica in enumerate(attempts):
                if attempt:
                    self.metrics.retries_of(model.name).inc()
                call.replica, call.model = replica, model
                try:
                    resp = await self._proxy(request, call, replica, payload, limit_headers, fresh=attempt > 0)
                except _RetryElsewhere as exc:
                    last = ApiError(502, f"replica {replica.replica_id} of {model.name} failed: {exc}", "engine_error")
                    continue
                self.affinity.put(pkey, replica.replica_id)
                return resp
        raise last or ApiError(502, "no replica could answer", "engine_error")

    async def _proxy(
        self,
        request: web.Request,
        call: Call,
        replica: ReplicaInfo,
        payload: bytes,
        limit_headers: dict[str, str],
        fresh: bool = False,
    ) -> web.StreamResponse:
        assert self._session is not None and replica.url
        rid = replica.replica_id
        headers = {
            "Authorization": self._engine_authorization(rid),
            "Content-Type": "application/json",
            "X-Request-Id": call.request_id,
        }
        self.outstanding[rid] = self.outstanding.get(rid, 0) + 1
        gauge = self.metrics.in_flight_of(replica.model, rid)
        gauge.inc()
        try:
            try:
                session = self._fresh if fresh and self._fresh else self._session
                upstream_cm = session.post(
                    replica.url + call.endpoint, data=payload, headers=headers, timeout=self._upstream_timeout
                )
                async with asyncio.timeout(self.cfg.first_token_s):
                    upstream = await upstream_cm.__aenter__()
            except TimeoutError as exc:
                raise ApiError(
                    504,
                    f"replica {rid} did not answer within {self.cfg.first_token_s:.0f}s (first_token timeout)",
                    "timeout_first_token",
                ) from exc
            except (aiohttp.ClientConnectionError, aiohttp.ServerDisconnectedError, OSError) as exc:
                raise _RetryElsewhere(str(exc) or type(exc).__name__) from exc
            try:
                if upstream.status >= 400:
                    try:
                        async with asyncio.timeout(self.cfg.idle_s):
                            text = (await upstream.read())[:1000].decode(errors="replace")
                    except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, TimeoutError) as exc:
                        why = str(exc) or type(exc).__name__
                        raise _RetryElsewhere(f"the engine failed while answering {upstream.status}: {why}") from exc
                    refusal = engine_refusal(upstream.status, text, replica.model, call.endpoint)
                    if refusal is None:
                        raise _RetryElsewhere(f"engine answered {upstream.status}: {text[:300]}")
                    raise refusal  # the request's fault: the same on every replica, so not retried
                if call.stream and upstream.status == 200:
                    return await self._stream(request, call, upstream, limit_headers)
                return await self._whole(call, upstream, limit_headers)
            finally:
                await upstream_cm.__aexit__(None, None, None)
        finally:
            self.outstanding[rid] -= 1
            gauge.dec()

    def _engine_authorization(self, replica_id: str) -> str:
        """The Authorization header for a replica's engine: an HMAC, so computed once per replica."""
        auth = self._engine_auth.get(replica_id)
        if auth is None:
            if len(self._engine_auth) >= 4096:
                self._engine_auth.clear()  # replicas come and go: keep the cache bounded
            auth = self._engine_auth[replica_id] = f"Bearer {engine_key(self._secret, replica_id)}"
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
        headers = {"x-request-id": call.request_id, **limit_headers}
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
                "x-request-id": call.request_id,
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
            raise _RetryElsewhere(f"the engine closed before its first byte: {exc}") from exc
        if not lines:
            raise _RetryElsewhere("the engine closed before its first byte")
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
                    raise _ClientGone(str(exc)) from exc
                idle = min(self.cfg.idle_s, deadline - time.monotonic())
                if idle <= 0:
                    call.status, call.error = 504, "total timeout mid-stream"
                    break
                try:
                    lines, rest = await _read_lines(content, rest, idle)
                except TimeoutError:
                    call.status, call.error = 504, f"no token for {self.cfg.idle_s:.0f}s (idle timeout)"
                    break
        except (_ClientGone, asyncio.CancelledError) as exc:
            # The client went away: leaving this block closes the engine connection, which stops its work.
            call.status, call.error = 499, "client closed the connection mid-stream"
            if isinstance(exc, _ClientGone):
                raise ConnectionResetError(str(exc)) from exc
            raise
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            call.status, call.error = 502, f"the engine failed mid-stream: {exc}"
        with contextlib.suppress(ConnectionError):
            await resp.write_eof()
        return resp

    # -- after -------------------------------------------------------------------------------

    async def _finish(self, call: Call) -> None:
        now = time.time()
        model = call.model.name if call.model else "unknown"
        price = self.state.prices.get(model) if call.model else None
        if price is not None and call.status in (200, 499, 504, 502):
            call.cost_usd = cost(call.tokens_in, call.tokens_out, price.input_usd_per_m, price.output_usd_per_m)
        for scope, period, _amount in call.holds:
            try:
                await self.budgets.settle(scope, period, call.request_id, call.cost_usd, now)
            except Exception:
                log.exception("budget settle failed; the hold expires on its own", scope=scope)
        if call.levels and (call.tokens_in or call.tokens_out):
            self.limiter.spend_tokens(call.levels, now, call.tokens_in + call.tokens_out)
            self._note(call.levels, 0, call.tokens_in + call.tokens_out)
        total = time.monotonic() - call.started
        key = call.key
        project = key.project_id if key else None
        scopes = self.state.scopes_of(key) if key else []
        team = next((s.split(":", 1)[1] for s in scopes if s.startswith("team:")), None)
        org = next((s.split(":", 1)[1] for s in scopes if s.startswith("org:")), None)
        record = UsageRecord(
            request_id=call.request_id,
            at=call.at,
            status=call.status or 500,
            key_id=key.key_id if key else None,
            project_id=project,
            team_id=team,
            org_id=org,
            user=key.user if key else None,
            model_asked=call.model_asked,
            model_served=model if call.model else None,
            replica_id=call.replica.replica_id if call.replica else None,
            node_id=call.replica.node_id if call.replica else None,
            endpoint=call.endpoint,
            stream=call.stream,
            tokens_in=call.tokens_in if call.status in (200, 499) else 0,
            tokens_out=call.tokens_out,
            queue_s=round(call.queue_s, 6),
            ttft_s=round(call.ttft_s, 6) if call.ttft_s is not None else None,
            total_s=round(total, 6),
            cost_usd=round(call.cost_usd, 8),
            error=call.error,
            router=self.instance,
        )
        if key is not None and call.billed:
            self.usage.put(record)  # unauthenticated noise is logged, not billed
        access_log.info(
            "request",
            request_id=call.request_id,
            model_asked=call.model_asked,
            model_served=record.model_served,
            replica=record.replica_id,
            status=record.status,
            queue_s=record.queue_s,
            ttft_s=record.ttft_s,
            total_s=record.total_s,
            tokens_in=record.tokens_in,
            tokens_out=record.tokens_out,
            key=key.prefix if key else None,
            project=project,
            user=record.user,
        )
        label = model if call.model else "unknown"
        metrics = self.metrics
        metrics.requests_of(label, record.status).inc()
        metrics.latency_of(label).observe(total)
        if call.ttft_s is not None and call.stream:
            metrics.ttft_of(label).observe(call.ttft_s)
        if record.tokens_in:
            metrics.tokens_of(label, "in").inc(record.tokens_in)
        if record.tokens_out:
            metrics.tokens_of(label, "out").inc(record.tokens_out)


class _RetryElsewhere(Exception):
    """The replica failed before the first byte reached the client: another may be tried."""


class _ClientGone(Exception):
    """Writing to the client failed: it went away mid-answer."""


_ENDPOINT_WORDS = {
    "/v1/chat/completions": "chat completions",
    "/v1/completions": "text completions",
    "/v1/embeddings": "embeddings",
}


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
    if status >= 500 or status in (401, 403):
        return None
    message = text
    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):
        error = _dec.decode(text.encode()).get("error")
        message = error.get("message") if isinstance(error, dict) else error
    message = str(message or text).strip()[:500] or f"the engine answered {status}"
    code = "request_too_large" if status == 413 else "engine_refused"
    return ApiError(413 if status == 413 else 400, f"the model {model} refused the request: {message}", code)


def _http_error(exc: web.HTTPException, request: web.Request) -> ApiError:
    """aiohttp's own refusals (no such route, method not allowed, too large…) in the gateway's words."""
    routes = "/v1/chat/completions, /v1/completions, /v1/embeddings (POST) and /v1/models (GET)"
    if exc.status == 404:
        return ApiError(404, f"no route {request.method} {request.path}: this gateway serves {routes}", "not_found")
    if isinstance(exc, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(exc.allowed_methods))
        return ApiError(
            405,
            f"method {request.method} is not allowed on {request.path} (allowed: {allowed})",
            "method_not_allowed",
            {"Allow": allowed},
        )
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return ApiError(413, f"the request body is too large: {exc.text}", "body_too_large")
    return ApiError(exc.status, exc.reason or f"HTTP {exc.status}", f"http_{exc.status}")


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


def _count(call: Call, data: bytes) -> None:
    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError):
        usage = _dec.decode(data).get("usage") or {}
        call.tokens_in = int(usage.get("prompt_tokens", call.tokens_in) or 0)
        call.tokens_out = int(usage.get("completion_tokens", 0) or 0)


def _count_chunk(call: Call, line: bytes) -> None:
    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError, ValueError):
        usage = _dec.decode(line[6:]).get("usage")
        if usage:
            call.tokens_in = int(usage.get("prompt_tokens", call.tokens_in) or 0)
            call.tokens_out = int(usage.get("completion_tokens", call.tokens_out) or 0)
