"""The gateway: an OpenAI-compatible API in front of the fleet (SPEC GW-1 to GW-8, SCHED-5, SCHED-12).

The request path is a fixed sequence of layers, each able to answer early:

    request id → key → body → model → servable? → limits → budget → replica → proxy → usage

This module is the wiring and that sequence; each layer's decisions are elsewhere (docs/gateway.md
has the table): the body in :mod:`.validation`, admission in :mod:`.admission` (pure verdicts),
the replica order in :mod:`.routing`, the engines in :mod:`.proxy`, the usage record in
:mod:`.usage_record`, limit gossip in :mod:`.gossip`. Everything a layer needs is in memory,
folded from the log (:mod:`.state`); the only network calls on the path are the engine itself and,
for scopes with a budget, one compare-and-set on the budget book. Usage records and limit gossip
leave the path through queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec
import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry

from llmgw.events.runtime import log_context
from llmgw.events.runtime.follower import Follower, FollowerRegistry, health_body
from llmgw.events.runtime.secrets import engine_key_secret
from llmgw.events.runtime.snapshots import EVERY_EVENTS, EVERY_S, SnapshotPlan
from llmgw.events.runtime.store import EventStore
from llmgw.events.runtime.subscriber import Subscriber
from llmgw.events.schema import scheduler as SCH
from llmgw.events.schema import subjects as S
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.nodes import NodeHeartbeat
from llmgw.services.router import admission as adm
from llmgw.services.router.budgets import BudgetBook, BudgetExceeded
from llmgw.services.router.config import RouterConfig
from llmgw.services.router.errors import ApiError, http_error, id_headers
from llmgw.services.router.external import Providers
from llmgw.services.router.gossip import SUBJECT as GOSSIP_SUBJECT
from llmgw.services.router.gossip import LimitGossip
from llmgw.services.router.journal import JournalError
from llmgw.services.router.limits import Limiter
from llmgw.services.router.mcp import McpGateway
from llmgw.services.router.metrics import PoolSaturation, QueueDepth, RouterMetrics, UsageMetrics, pool_loads
from llmgw.services.router.proxy import Upstream, engine_refusal
from llmgw.services.router.queue import PROJECT_FULL, ClientLeft, Gate, QueueRefused
from llmgw.services.router.responses import ResponsesApi
from llmgw.services.router.routing import (
    ENGINE_STALE_S,
    Affinity,
    EngineLoad,
    engine_loads,
    order,
    prefix_key,
    round_robin,
    shuffled,
    slots_of,
)
from llmgw.services.router.state import SNAPSHOT_NAME, SNAPSHOT_VERSION, KeyInfo, ModelInfo, ReplicaInfo, RouterState
from llmgw.services.router.tool_choice import named_tool_as_required
from llmgw.services.router.tracing import Tracing
from llmgw.services.router.usage import StopReport, UsageConfig, UsagePublisher
from llmgw.services.router.usage_record import Call, call_cost, usage_record
from llmgw.services.router.validation import Invalid, RequestLimits, check_body, check_depth

# Re-exported: where the CLI and the tests have always found them.
__all__ = ["GOSSIP_SUBJECT", "ApiError", "Call", "Router", "RouterConfig", "engine_refusal"]

log = structlog.get_logger("llmgw.router")
access_log = structlog.get_logger("llmgw.access")

_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,128}$")
_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()
DEMAND_ROOT = f"{S.PREFIX}.demand"
DEMAND_EVERY_S = 1.0  # how often a held request says again that its model is wanted


def _bounded_output(body: dict[str, Any], raw: bytes, call: Call, endpoint: str) -> tuple[dict[str, Any], bytes]:
    """The request held to its model's output bound (``max_output`` in the catalog): one without
    ``max_tokens`` gets it as its default (an engine left alone may generate until its context is
    full); one asking for more is refused naming the bound. Untouched when the model sets none."""
    bound = call.model.spec.max_output if call.model is not None else None
    if not bound or endpoint not in ("/v1/chat/completions", "/v1/completions"):
        return body, raw
    for field in ("max_completion_tokens", "max_tokens"):
        asked = body.get(field)
        if asked is not None:
            if asked > bound:
                raise ApiError(
                    400,
                    f"`{field}` is {asked}; model {call.model.name} answers at most {bound} tokens",  # type: ignore[union-attr]
                    "max_tokens_too_large",
                    param=field,
                )
            return body, raw
    body = {**body, "max_tokens": bound}
    return body, _enc.encode(body)


def _span_attributes(call: Call) -> dict[str, Any]:
    """What a request's span says once it is answered (None values are left out)."""
    return {
        "llmgw.model": call.model.name if call.model is not None else None,
        "llmgw.project_id": call.key.project_id if call.key is not None else None,
        "llmgw.replica": call.replica.replica_id if call.replica is not None else None,
        "llmgw.tokens_in": call.tokens_in or None,
        "llmgw.tokens_out": call.tokens_out or None,
        "llmgw.queue_s": call.queue_s or None,
        "llmgw.error": call.error or None,
    }


def _client_request_id(request: web.Request) -> str | None:
    """The client's own ``X-Request-Id`` when it is a plain string of reasonable length: kept beside the
    gateway's id and echoed, never used as a key (two requests may carry the same one)."""
    given = request.headers.get("x-request-id")
    return given if given and _REQUEST_ID.match(given) else None


def _model_object(m: ModelInfo) -> dict[str, Any]:
    """A model as OpenAI's models endpoints show it (plus its aliases)."""
    return {"id": m.name, "object": "model", "created": 0, "owned_by": "llmgw", "aliases": list(m.spec.aliases)}


def _refused(refusal: adm.Refusal) -> ApiError:
    return ApiError(refusal.status, refusal.message, refusal.code, dict(refusal.headers))


class Router:
    def __init__(
        self,
        store: EventStore,
        cfg: RouterConfig | None = None,
        registry: CollectorRegistry | None = None,
        instance: str | None = None,
        clock: Callable[[], float] = time.time,
        folds: FollowerRegistry | None = None,
        snapshot_every_events: int = EVERY_EVENTS,
        snapshot_every_s: float = EVERY_S,
    ) -> None:
        self.store = store
        self.cfg = cfg or RouterConfig()
        self.clock = clock  # the wall clock (epoch seconds): limits, budgets' periods, key expiry, records
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
                mode=self.cfg.usage_mode,
                reserve_bytes=self.cfg.usage_reserve_bytes,
            ),
            UsageMetrics(self.metrics.registry, self._usage_gauges),
        )
        self.budgets = BudgetBook(store.js, clock=clock)
        self.upstream = Upstream(self.cfg, self.metrics)
        self.tracing = Tracing(
            self.cfg.trace_endpoint,
            self.cfg.trace_sample_ratio,
            instance=self.instance,
            export_delay_s=self.cfg.trace_export_delay_s,
        )
        self.upstream.tracing = self.tracing
        self.providers = Providers(self.upstream)  # external models' providers (GW-12)
        self.mcp = McpGateway(  # /mcp: the MCP servers a key's project may use (issue 26)
            store,
            state=lambda: self.state,
            limiter=self.limiter,
            note=lambda levels, requests, tokens: self.gossip.note(levels, requests, tokens),
            usage_put=self.usage.put,
            usage_refusal=self.usage.refusal,
            clock=clock,
            instance=self.instance,
            folds=folds,
        )
        self.responses = ResponsesApi(self.cfg, store.js, self._authenticate, clock)  # /v1/responses, stored ones
        self.outstanding = self.upstream.outstanding  # replica id -> requests in flight there
        # replica id -> what its engine last reported in its agent's heartbeat (requests waiting, KV
        # usage, slots, unreachable): routing prefers the least loaded by it (GW-6); replicas without a
        # report are weighed by this router's own in-flight count alone.
        self.engines: dict[str, EngineLoad] = {}
        self._engines_by_node: dict[str, tuple[float, dict[str, EngineLoad]]] = {}
        self.gate = Gate(
            self._slot_load,
            self.cfg.queue_max_per_model,
            self.cfg.queue_max_per_project,
            self.cfg.queue_wait_s,
            on_wait=lambda model, s: self.metrics.queue_wait_of(model).observe(s),
            on_refuse=lambda model, why: self.metrics.queue_rejections_of(model, why).inc(),
        )
        if self.cfg.queue:
            self.upstream.on_release = self.gate.released
        self.metrics.registry.register(QueueDepth(self.gate.depths))
        self.gossip = LimitGossip(store.nc, self.limiter, self.instance, self.cfg.gossip_s, clock)
        self._tasks: list[asyncio.Task] = []
        # Bound once, to the logging set up when the router is made: the module's lazy logger would
        # be bound again on each of its per-request lines.
        self._access = access_log.bind()
        self._demand_sent: dict[str, float] = {}
        # Everything the router answers from is folded by one supervised follower: a handler that
        # raises quarantines its event and the fold goes on (a revocation after it still lands), and a
        # fold that stops advancing makes /healthz 503. Its folded state is saved every so many events
        # or seconds; a start is the newest snapshot plus the log after it (0 turns a trigger off; both
        # 0: no snapshots are read or saved).
        snapshots = SnapshotPlan(
            name=SNAPSHOT_NAME,
            schema_version=SNAPSHOT_VERSION,
            decode=RouterState.decode,
            encode=lambda: self.state.encode(),
            adopt=self._adopt,
            every_events=snapshot_every_events,
            every_s=snapshot_every_s,
        )
        self.fold = Follower(
            store, f"{S.EVENTS_ROOT}.>", self.state, name="router", after=0, registry=folds, snapshot=snapshots
        )
        self._caught_up = self.fold.caught_up
        # The engines' load, from the agents' heartbeats (core NATS), under the same supervision.
        self._heartbeat = msgspec.json.Decoder(NodeHeartbeat)
        self.heartbeats = Subscriber(
            store.nc,
            f"{S.TELEMETRY_ROOT}.node.*",
            self._on_heartbeat,
            name="router-heartbeats",
            registry=self.fold.registry,
        )
        # What the other routers admitted (limit gossip, GW-4): a router that stops hearing it lets a
        # limit overshoot by the others' share, so it is supervised and on /healthz too.
        self.gossip_in = Subscriber(
            store.nc, GOSSIP_SUBJECT, self.gossip.on_message, name="router-gossip", registry=self.fold.registry
        )
        self._rng = random.Random()
        # routing.POLICIES: "llmgw" serves; benchmarks and tests set a baseline here to compare with.
        self.routing_policy = "llmgw"
        self._turn = 0
        self._request_limits = RequestLimits(
            max_messages=self.cfg.max_messages,
            max_json_depth=self.cfg.max_json_depth,
            max_prompt_tokens=self.cfg.max_prompt_tokens,
            max_output_tokens=self.cfg.max_output_tokens,
        )

    def _usage_gauges(self) -> tuple[int, float | None, bool, int]:
        b = self.usage.backlog()
        return b.records, b.oldest_s, b.refusing is not None, b.memory_only

    def _slot_load(self, model: str) -> tuple[int, int]:
        """(requests in flight to the model's ready replicas, the slots they have): the queue's measure."""
        ready = self.state.ready_by_model.get(model)
        if not ready:
            return 0, 0
        out, sat, engines = self.outstanding, self.cfg.saturation, self.engines
        in_flight = slots = 0
        for rid, r in ready.items():
            in_flight += out.get(rid, 0)
            slots += slots_of(r, engines, sat)
        return in_flight, slots

    async def _report_queues(self) -> None:
        """Tell the schedulers what waits in this router's queue (SCHED-9): requests held here never
        reach an engine's metrics, yet they are the model's load. Every ``queue_report_s`` while any
        wait, and once more when none do."""
        subject = f"{SCH.QUEUE_ROOT}.{S.encode_token(self.instance)}"
        told = False
        while True:
            await asyncio.sleep(self.cfg.queue_report_s)
            waiting = {model: n for model, n in self.gate.depths().items() if n}
            if waiting or told:
                with contextlib.suppress(Exception):  # a missed report is only a late scale-up
                    await self.store.nc.publish(
                        subject, _enc.encode(SCH.RouterQueues(router=self.instance, waiting=waiting))
                    )
            told = bool(waiting)

    def _pool_loads(self) -> list[tuple[str, float]]:
        ready = {m: [r.replica_id for r in self.state.ready(m)] for m in self.state.models}
        sat, engines = self.cfg.saturation, self.engines
        slots = {rid: slots_of(r, engines, sat) for rs in self.state.ready_by_model.values() for rid, r in rs.items()}
        return pool_loads(ready, self.outstanding, slots, self.gate.depths())

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.upstream.open(await engine_key_secret(self.store.js))
        await self.responses.start(self.app())
        try:
            await self.usage.start()  # publishes what an earlier run left in the journal
        except JournalError as exc:
            raise SystemExit(f"error: {exc}") from exc
        await self.fold.restore()  # from the newest snapshot, before the fold or anything else runs
        self._tasks.append(asyncio.create_task(self.fold.run(), name="router-follow"))
        self._tasks.append(asyncio.create_task(self.gossip.run(), name="router-gossip"))
        self._tasks.append(asyncio.create_task(self._report_queues(), name="router-queue-report"))
        self.heartbeats.start()
        self.gossip_in.start()
        self.mcp.start()
        await asyncio.wait_for(self._caught_up.wait(), 60)
        # Subscribed before it serves, as before: what the others admit from the first second counts here.
        await asyncio.wait_for(self.gossip_in.subscribed.wait(), 60)
        # Start-up objects live as long as the process: keep them out of every collection, so the
        # collector only ever walks per-request garbage (LiteLLM's p99 was full collections).
        gc.collect()
        gc.freeze()

    async def _on_heartbeat(self, msg: Any) -> None:
        """One agent's heartbeat: its engines' load (a lost one is only a staler figure)."""
        try:
            hb = self._heartbeat.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError):
            return  # the scheduler logs heartbeats it cannot read; here one is just a staler figure
        self.engines_seen(hb, time.monotonic())

    def engines_seen(self, hb: NodeHeartbeat, now: float) -> None:
        """Take one heartbeat's engine loads; nodes silent past ENGINE_STALE_S say nothing any more."""
        self._engines_by_node[hb.node_id] = (now, engine_loads(hb))
        fresh = {n: v for n, v in self._engines_by_node.items() if now - v[0] <= ENGINE_STALE_S}
        self._engines_by_node = fresh
        self.engines = {rid: e for _, loads in fresh.values() for rid, e in loads.items()}

    @property
    def snapshot_every(self) -> tuple[int, float]:
        """(events, seconds) between two snapshots of its state, as configured (0: that trigger is off)."""
        plan = self.fold.snapshot
        assert plan is not None
        return plan.every_events, plan.every_s

    def _adopt(self, state: RouterState) -> RouterState:
        """A snapshot's state becomes the router's, and what its fold folds into from there."""
        self.state = state
        return state

    async def stop(self) -> StopReport:
        """Stop; usage records not yet acknowledged are published (bounded) or journaled, and what
        neither took is logged and reported."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self.heartbeats.close()
        await self.gossip_in.close()
        await self.gate.close()
        report = await self.usage.stop()
        await self.responses.close()
        await self.mcp.close()
        await self.upstream.close()
        await asyncio.to_thread(self.tracing.shutdown)  # the last spans sent (bounded by the exporter's timeout)
        return report

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
        app.router.add_get("/v1/models/{model:.+}", self.retrieve_model)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/embeddings", self.embeddings)
        self.mcp.routes(app)
        self.responses.routes(app)  # /v1/responses and its stored responses
        return app

    async def healthz(self, request: web.Request) -> web.Response:
        usage = self.usage.backlog()
        # Refusing billable requests is 503, so a load balancer sends them to a router that can bill;
        # a backlog kept in the journal is not: requests are still billed.
        # A fold not live answers from stale state (a revoked key would keep working): 503, naming it.
        folds = [self.fold.health(), self.heartbeats.health(), self.gossip_in.health()]
        ok = self.store.nc.is_connected and all(h.live for h in folds) and usage.refusing is None
        body = {
            "status": "ok" if ok else "degraded",
            "nats": "connected" if self.store.nc.is_connected else "disconnected",
            "models": len(self.state.models),
            "usage": msgspec.to_builtins(usage),
            **health_body(folds),
        }
        return web.json_response(body, status=200 if ok else 503)

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """Every answer in OpenAI's error shape with a request id: aiohttp's own (no such route, a
        method not allowed) and, for a fault in the gateway itself, a logged 500."""
        try:
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return http_error(exc, request).response(new_id(), _client_request_id(request))
        except (asyncio.CancelledError, ConnectionError):
            raise
        except Exception as exc:
            rid, cid = new_id(), _client_request_id(request)
            log.exception("request failed", request_id=rid, client_request_id=cid, path=request.path)
            return ApiError(
                500,
                f"internal error in the gateway ({type(exc).__name__}); request id {rid} is in the gateway's log",
                "internal_error",
            ).response(rid, cid)

    def _authenticate(self, request: web.Request) -> KeyInfo:
        got = adm.authenticate(request.headers.get("authorization", ""), self.state.keys, self.clock())
        if isinstance(got, adm.Refusal):
            raise _refused(got)
        return got

    async def list_models(self, request: web.Request) -> web.Response:
        rid, cid = new_id(), _client_request_id(request)
        try:
            key = self._authenticate(request)
        except ApiError as exc:
            return exc.response(rid, cid)
        data = [
            _model_object(m)
            for m in sorted(self.state.models.values(), key=lambda m: m.name)
            if (not key.models or m.name in key.models) and (key.external or not m.spec.external)
        ]
        return web.json_response({"object": "list", "data": data}, headers=id_headers(rid, cid))

    async def retrieve_model(self, request: web.Request) -> web.Response:
        """``GET /v1/models/{id}`` (the SDKs' ``models.retrieve``): a model the key may use, by name or alias."""
        rid, cid = new_id(), _client_request_id(request)
        asked = request.match_info["model"]
        try:
            key = self._authenticate(request)
            chosen = adm.choose_model(key, asked, self.state.resolve(asked), self.state.models)
            if isinstance(chosen, adm.Refusal):
                raise _refused(chosen)
        except ApiError as exc:
            return exc.response(rid, cid)
        return web.json_response(_model_object(chosen), headers=id_headers(rid, cid))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/chat/completions")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/completions")

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, "/v1/embeddings")

    # -- one request: the layers in order ---------------------------------------------------------

    async def _serve(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        call = Call(
            request_id=new_id(),
            client_request_id=_client_request_id(request),
            started=time.monotonic(),
            at=datetime.fromtimestamp(self.clock(), UTC),
            endpoint=endpoint,
        )
        bound = log_context.bind(("request_id", call.request_id), ("client_request_id", call.client_request_id or ""))
        traced = self.tracing.start_request(
            request.headers, f"{request.method} {endpoint}", {"llmgw.request_id": call.request_id}
        )
        try:
            # The key before the body: without one nothing is read, so a stranger learns no more than
            # 401 (not which body would be too large or malformed) and costs no body's read.
            with self.tracing.span("admission"):
                key = self._authenticate(request)
                body, raw, prompt = await self._body(request, endpoint)
                limit_headers = self._admit(call, key, body, prompt)
                body, raw = _bounded_output(body, raw, call, endpoint)
                await self._reserve(call, body, prompt)
            return await self._route(request, call, body, raw, prompt, limit_headers)
        except ApiError as exc:
            call.status, call.error = exc.status, exc.message
            return exc.response(call.request_id, call.client_request_id)
        except (asyncio.CancelledError, ConnectionError):
            # The client went away (ConnectionError covers aiohttp's "Connection lost" on a write
            # waiting for the client to read, as well as a reset).
            call.status = 499
            raise
        except Exception as exc:
            log.exception("request failed", request_id=call.request_id, client_request_id=call.client_request_id)
            call.status, call.error = 500, f"internal error: {exc}"
            return ApiError(
                500,
                f"internal error in the gateway ({type(exc).__name__}); request id "
                f"{call.request_id} is in the gateway's log",
                "internal_error",
            ).response(call.request_id, call.client_request_id)
        finally:
            await self._finish(call)
            if traced is not None:
                self.tracing.end_request(traced, call.status, _span_attributes(call))
            log_context.unbind(bound)

    async def _body(self, request: web.Request, endpoint: str) -> tuple[dict[str, Any], bytes, str]:
        """The body decoded and checked, its bytes, and its prompt's text."""
        encoding = request.headers.get("content-encoding", "identity")
        try:
            # No timer when all of the body came with the head (most do): there is nothing to wait for.
            async with asyncio.timeout(None if request.content.is_eof() else self.cfg.body_s):
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
            body, prompt = check_body(decoded, endpoint, limits)
        except Invalid as exc:
            raise ApiError(exc.status, exc.message, exc.code, param=exc.param) from exc
        return body, raw, prompt

    def _admit(self, call: Call, key: KeyInfo, body: dict[str, Any], prompt: str) -> dict[str, str]:
        """Key → model → servable → limits (:func:`.admission.admit`); admitted, the request counts
        against its limits here and in the gossip. Returns the x-ratelimit-* headers."""
        tokens = max(1, len(prompt) // 4)  # an estimate until the engine counts
        now = self.clock()
        verdict = adm.admit(key, body["model"], tokens, self.state, self.limiter, now, self.usage.refusal())
        call.key, call.model = verdict.key, verdict.model
        call.chain, call.scopes = verdict.chain, verdict.scopes
        refusal = verdict.refusal
        if refusal is not None and refusal.layer == "usage":
            call.billed = False  # nothing was served: no record to keep
            if self.usage.metrics:
                self.usage.metrics.refused.inc()
        if refusal is None or refusal.layer not in ("key", "usage"):
            call.model_asked = body["model"]
            call.stream = bool(body.get("stream", False))
        if verdict.model is not None:
            call.tokens_in = tokens
        for name in verdict.wanted:
            self._demand(name)
        if refusal is not None:
            raise _refused(refusal)
        if verdict.levels:
            self.limiter.admit(verdict.levels, now)
            self.gossip.note(verdict.levels, 1, 0)
            call.levels = verdict.levels
        return verdict.headers

    async def _reserve(self, call: Call, body: dict[str, Any], prompt: str) -> None:
        assert call.key is not None and call.model is not None
        # The dearest model (or provider) that may serve it: a fallback or another provider may be dearer.
        price = adm.price_for_holds(call.chain, self.state.prices)
        if price is None:
            return
        scopes = adm.budget_scopes(call.scopes, self.state.budgets)
        if not scopes:
            return
        amount = adm.most_it_may_cost(body, call.endpoint, call.model, price, self.cfg.default_max_tokens, prompt)
        for scope in scopes:
            b = self.state.budgets[scope]
            try:
                when = await self.budgets.reserve(scope, b.usd, b.period, call.request_id, amount)
            except BudgetExceeded as exc:
                label = self.state.scope_label(scope, call.key)
                raise _refused(adm.over_budget(exc, self.clock(), label)) from exc
            call.holds.append((scope, when, amount))

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
        ready = self.state.ready(model.name)
        refusal = adm.servable(model, len(ready), self.state.starting(model.name) if not ready else 0)
        if refusal is not None:
            if refusal.demand:
                self._demand(model.name)
            raise _refused(refusal)
        if model.on_demand or ready:
            self._demand(model.name)  # keeps an on-demand replica from going idle
        if ready:
            return ready
        # Hold the request until a replica is ready, within the activation window, saying all the while
        # that the model is wanted: a request held is demand, and an on-demand replica that took longer
        # to start than the idle time must not be stopped as idle before it serves the request.
        t0 = time.monotonic()
        deadline = t0 + self.cfg.activation_s
        ready = self.state.ready_event(model.name)
        while not ready.is_set() and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ready.wait(), min(left, DEMAND_EVERY_S))
            self._demand(model.name)
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
        last: ApiError | None = None
        payload = raw
        if (narrowed := named_tool_as_required(body)) is not body:
            body, payload = narrowed, _enc.encode(narrowed)  # llama.cpp takes tool_choice as a string only
        if call.stream:
            # Always ask the engine for usage, so every streamed request is counted.
            body = {**body, "stream_options": {**(body.get("stream_options") or {}), "include_usage": True}}
            payload = _enc.encode(body)
        pkey = prefix_key(prompt)
        chain = call.chain
        for i, model in enumerate(chain):
            if not model.spec.external and adm.fallback_answers_now(model, chain[i + 1 :], self.state):
                # No replica ready yet, but a fallback answers now (GW-12): it does, and the model is
                # still wanted (an on-demand one starts for the requests after).
                self._demand(model.name)
                continue
            if model.spec.external:  # served outside the cluster (GW-12): no replica, no queue
                call.model = model
                table = self.state.prices.get(model.name)
                resp, failed = await self.providers.send(request, call, model, body, limit_headers, table)
                if resp is not None:
                    return resp
                last = failed
                continue
            try:
                replicas = await self._replicas(call, model)
            except ApiError as exc:
                last = exc
                continue
            if self.cfg.queue and not self.gate.passes(model.name):
                await self._queue(request, call, model)
                replicas = self.state.ready(model.name) or replicas  # replicas may have come or gone meanwhile
                self.gate.sent(model.name)  # from here to the send nothing awaits: the slot cannot be taken
            if self.routing_policy == "round_robin":
                self._turn += 1
                ranked = round_robin(replicas, self._turn)
            elif self.routing_policy == "random":
                ranked = shuffled(replicas, self._rng.getrandbits(32))
            else:
                ranked = order(
                    replicas,
                    self.outstanding,
                    self.affinity.get(pkey),
                    self.cfg.saturation,
                    self._rng.getrandbits(16),
                    self.engines,
                )
            call.model = model
            resp, failed = await self.upstream.attempt(request, call, ranked, payload, limit_headers)
            if resp is None:
                last = failed
                continue
            assert call.replica is not None
            self.affinity.put(pkey, call.replica.replica_id)
            return resp
        raise last or ApiError(502, "no replica could answer", "engine_error")

    async def _queue(self, request: web.Request, call: Call, model: ModelInfo) -> None:
        """Wait for a slot of ``model`` in the fair queue; a refusal or a departed client ends the request."""
        assert call.key is not None

        def gone() -> bool:
            transport = request.transport
            return transport is None or transport.is_closing()

        try:
            with self.tracing.span("queue wait", **{"llmgw.model": model.name}):
                call.queue_s += await self.gate.wait(model.name, call.key.project_id, gone)
        except QueueRefused as exc:
            call.tokens_in = 0  # it never reached an engine: nothing to count against token limits
            raise self._queue_refusal(call, model, exc) from exc
        except ClientLeft as exc:
            call.tokens_in = 0
            call.status, call.error = 499, "the client left while its request waited in the queue"
            raise ConnectionResetError(call.error) from exc

    def _queue_refusal(self, call: Call, model: ModelInfo, exc: QueueRefused) -> ApiError:
        assert call.key is not None
        headers = {"retry-after": str(exc.retry_after)}
        cfg = self.cfg
        if exc.reason == PROJECT_FULL:
            project = self.state.scope_label(f"project:{call.key.project_id}")
            return ApiError(
                429,
                f"{project} has {cfg.queue_max_per_project} requests waiting for model {model.name}, its most "
                f"({exc.depth} waiting in all); retry in {exc.retry_after} s",
                "queue_full",
                headers,
            )
        if exc.reason == "timeout":
            return ApiError(
                503,
                f"model {model.name} had no free slot within {self.gate.wait_s:g} s ({exc.depth} still "
                f"waiting); retry in {exc.retry_after} s",
                "queue_timeout",
                headers,
            )
        return ApiError(
            429,
            f"model {model.name}'s queue is full ({exc.depth} waiting); retry in {exc.retry_after} s",
            "queue_full",
            headers,
        )

    # -- after -------------------------------------------------------------------------------

    async def _finish(self, call: Call) -> None:
        now = self.clock()
        table = self.state.prices.get(call.model.name) if call.model else None
        call.cost_usd = call_cost(call, call.price or table)  # an external provider's own price first
        for scope, when, _amount in call.holds:
            try:
                await self.budgets.settle(scope, when, call.request_id, call.cost_usd)
            except Exception:
                log.exception("budget settle failed; the hold expires on its own", scope=scope)
        if call.levels and (call.tokens_in or call.tokens_out):
            self.limiter.spend_tokens(call.levels, now, call.tokens_in + call.tokens_out)
            self.gossip.note(call.levels, 0, call.tokens_in + call.tokens_out)
        total = time.monotonic() - call.started
        key = call.key
        record = usage_record(call, call.scopes, total, self.instance)
        if key is not None and call.billed:
            with self.tracing.span("usage publish"):
                self.usage.put(record)  # unauthenticated noise is logged, not billed
        self._access.info(
            "request",
            request_id=call.request_id,
            client_request_id=call.client_request_id,
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
            project=record.project_id,
            user=record.user,
        )
        label = record.model_served or "unknown"
        metrics = self.metrics
        metrics.requests_of(label, record.status).inc()
        metrics.latency_of(label).observe(total)
        if call.ttft_s is not None and call.stream:
            metrics.ttft_of(label).observe(call.ttft_s)
        if record.tokens_in:
            metrics.tokens_of(label, "in").inc(record.tokens_in)
        if record.tokens_out:
            metrics.tokens_of(label, "out").inc(record.tokens_out)
