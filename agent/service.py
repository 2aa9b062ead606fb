"""The node agent: reports what the node has and runs, and runs what the log places on it.

Report facts, let the scheduler decide: the agent publishes heartbeats, folds the replica events
for its node, and acts on them through a pure plan (:mod:`.plan`). What it observes of its engines
— starting, ready, failed with the last log lines, stopped — it writes as replica events.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections import deque
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import structlog

from llmgw.agent import discovery
from llmgw.agent.engines import metrics as EM
from llmgw.agent.engines.health import EngineStartError
from llmgw.agent.plan import Desired, ReportFailed, ReportStopped, Start, StopEngine, plan
from llmgw.agent.supervisor import Supervisor, SupervisorConfig, tail
from llmgw.agent.weights.cache import WeightsCache, WeightsError
from llmgw.agent.weights.local import MAX_FILES, ModelDirs
from llmgw.events.folds import replicas as F
from llmgw.events.runtime.follower import Follower, FollowerRegistry
from llmgw.events.runtime.secrets import engine_key, engine_key_secret, mirror_token
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.runtime.subscriber import Subscriber
from llmgw.events.runtime.tasks import cancel_and_wait
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.events.schema import subjects as S
from llmgw.events.schema.agent_rpc import (
    LogsReply,
    LogsRequest,
    WeightsReply,
    WeightsRequest,
    logs_subject,
    weights_subject,
)
from llmgw.events.schema.envelope import RecordedEvent, sanitize_actor
from llmgw.events.schema.subjects import encode_token, event_subject

log = structlog.get_logger("llmgw.agent")

VERSION = "0.1.0"


class AgentConfig(msgspec.Struct, frozen=True, kw_only=True):
    node_id: str
    data_dir: Path
    labels: dict[str, str] = {}
    address: str = ""
    heartbeat_s: float = 5.0
    port_range: tuple[int, int] = (20000, 20999)
    llamacpp_threads: int | None = None
    cpus: int | None = None  # the CPUs this node offers to replicas (None: those the agent may run on)
    startup_timeout_s: float = 120.0
    host: str = "127.0.0.1"
    advertise_host: str = "127.0.0.1"
    llama_server_binary: str | None = None
    mirror_url: str | None = None  # the mirror's file server, for `mirror:` sources (FLEET-8)
    model_dirs: tuple[Path, ...] = ()  # where this node keeps weights outside its cache (FLEET-8)


class EngineWatch(msgspec.Struct, kw_only=True):
    """What the agent last read of one engine's load (SCHED-9), and how its scrapes have gone."""

    last: EM.Signals | None = None
    rates: tuple[float | None, float | None] = (None, None)  # prompt, generation tokens/s
    read_at: datetime | None = None
    failures: int = 0  # scrapes failed in a row
    error: str = ""


class LogRing:
    """The agent's own recent log lines, for `ctl logs NODE` (a structlog processor)."""

    def __init__(self, size: int = 1000) -> None:
        self.lines: deque[str] = deque(maxlen=size)

    def __call__(self, logger: object, name: str, event: dict[str, Any]) -> dict[str, Any]:
        self.lines.append(msgspec.json.encode({k: str(v) for k, v in event.items()}).decode())
        return event


class Agent:
    def __init__(
        self, store: EventStore, cfg: AgentConfig, ring: LogRing | None = None, folds: FollowerRegistry | None = None
    ) -> None:
        self.store = store
        self.folds = folds if folds is not None else FollowerRegistry()
        self.cfg = cfg
        self.actor = sanitize_actor("node", cfg.node_id)
        self.ring = ring or LogRing()
        self.cpus = cfg.cpus or discovery.cpu_count()
        self.sensors = discovery.SensorReader()
        self.supervisor = Supervisor(
            SupervisorConfig(
                data_dir=cfg.data_dir,
                port_range=cfg.port_range,
                host=cfg.host,
                advertise_host=cfg.advertise_host,
                llamacpp_threads=cfg.llamacpp_threads,
                startup_timeout_s=cfg.startup_timeout_s,
                llama_server_binary=cfg.llama_server_binary,
            ),
            self.cpus,
        )
        self.started_at = datetime.now(UTC)
        self.desired: dict[str, Desired] = {}
        self.placed: dict[str, R.ReplicaPlaced] = {}
        self.grace: dict[str, float] = {}
        self.pending: set[str] = set()
        self._secret = b""
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._stop_engines_too = False  # set by stop(engines=True)
        self._tasks: set[asyncio.Task] = set()
        self._gpus_cache: tuple[float, list[N.GpuInfo]] | None = None
        self._cpu_seen: dict[str, tuple[float, float]] = {}
        self._watch: dict[str, EngineWatch] = {}  # replica id -> its engine's load signals
        self.weights = WeightsCache(cfg.data_dir / "weights", cfg.mirror_url, lambda: mirror_token(self._secret))
        self.weights_in_use: dict[str, str] = {}  # replica id -> the mirror file its engine runs
        self.model_dirs = ModelDirs(cfg.model_dirs)

    def key(self, rid: str) -> str:
        return engine_key(self._secret, rid)

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        self._secret = await engine_key_secret(self.store.js)
        await self.supervisor.adopt(self.key)
        await self.heartbeat()  # register before anything else: the scheduler places on known nodes
        tasks = [
            asyncio.create_task(self._follow().run(), name="agent-follow"),
            asyncio.create_task(self._heartbeats(), name="agent-heartbeats"),
            asyncio.create_task(self._reconcile_loop(), name="agent-reconcile"),
        ]
        # `ctl node logs` and `ctl node weights`, under the same supervision as the fold (and in its registry).
        subscribers = [
            Subscriber(
                self.store.nc, logs_subject(self.cfg.node_id), self._on_logs, name="agent-logs", registry=self.folds
            ),
            Subscriber(
                self.store.nc,
                weights_subject(self.cfg.node_id),
                self._on_weights,
                name="agent-weights",
                registry=self.folds,
            ),
        ]
        tasks += [asyncio.create_task(s.run(), name=s.name) for s in subscribers]
        log.info("agent started", node=self.cfg.node_id, cpus=self.cpus, adopted=len(self.supervisor.engines))
        try:
            await self._stop.wait()
        finally:
            await cancel_and_wait([*tasks, *self._tasks])
            for s in subscribers:
                await s.close()
            if self._stop_engines_too and self._stop.is_set():  # asked to: not a crash
                await self._stop_engines("stopped with llmgw up")

    def stop(self, engines: bool = False) -> None:
        """Stop the agent; its engines keep running, to be adopted by the next agent — or, with
        ``engines`` (`llmgw up` stopping cleanly), stop them too, each recorded as stopped, so the next
        start does not find them dead and call them failed."""
        self._stop_engines_too = self._stop_engines_too or engines
        self._stop.set()

    async def _stop_engines(self, reason: str, grace_s: float = 10.0, record_s: float = 2.0) -> None:
        """Stop every engine and record each replica as stopped: a clean stop is not a failure at the next start.

        Recording is bounded (the bus may be gone: `up` stopping because its nats-server died)."""
        rids = list(self.supervisor.engines)
        await asyncio.gather(*(self.supervisor.stop(rid, grace_s) for rid in rids))
        for rid in rids:
            stopped = R.ReplicaStopped(replica_id=rid, node_id=self.cfg.node_id, reason=reason)
            try:
                async with asyncio.timeout(record_s):
                    await self._append(rid, stopped)
            except Exception as exc:  # the engine is stopped all the same; the next start reports it
                log.warning("could not record a stopped replica", replica=rid, error=str(exc))

    # -- the log -----------------------------------------------------------------------------

    def _follow(self) -> Follower:
        """The replica events, folded by the supervised follower; each batch wakes the reconciler."""
        return Follower(
            self.store,
            f"{S.EVENTS_ROOT}.{R.AGGREGATE}.>",
            self.apply,
            name="agent",
            after=0,
            registry=self.folds,
            on_batch=self._wake.set,
        )

    def apply(self, e: RecordedEvent) -> None:
        p = e.payload
        if isinstance(p, R.ReplicaPlaced):
            if p.node_id == self.cfg.node_id:
                self.placed[p.replica_id] = p
                self.desired[p.replica_id] = Desired(replica_id=p.replica_id, state="placed")
            return
        rid = getattr(p, "replica_id", None)
        if rid is None or rid not in self.desired:
            return
        current = self.desired[rid].state
        if current in ("stopped", "failed"):
            return  # terminal here, whatever the log says next: the engine is gone or going
        # The move is the shared fold's (events/folds/replicas.py), from what this agent already knows,
        # which may be ahead of the log: a late report of our own never undoes a stop request.
        if isinstance(p, R.ReplicaStopRequested):
            self.grace[rid] = p.grace_s  # a later request's grace holds, even for one already draining
        state = F.transition(current, p)
        if state is None:
            return
        self.desired[rid] = Desired(replica_id=rid, state=state)
        if state in ("stopped", "failed"):
            # Keep terminal entries briefly only: the plan needs them to stop strays, not forever.
            self.placed.pop(rid, None)

    async def _append(self, rid: str, payload: msgspec.Struct) -> None:
        await self.store.append(event_subject(R.AGGREGATE, rid), [NewEvent(payload=payload, actor=self.actor)])

    # -- acting ------------------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.5)
            self._wake.clear()
            for rec, code, lines in self.supervisor.exited():
                reason = f"engine exited with code {code}" if code is not None else "engine exited"
                log.warning("engine exited", replica=rec.replica_id, code=code)
                with contextlib.suppress(Exception):
                    await self._append(
                        rec.replica_id,
                        R.ReplicaFailed(
                            replica_id=rec.replica_id,
                            node_id=self.cfg.node_id,
                            reason=reason,
                            exit_code=code,
                            log_tail=lines,
                        ),
                    )
                if rec.replica_id in self.desired:
                    self.desired[rec.replica_id] = Desired(replica_id=rec.replica_id, state="failed")
            running = set(self.supervisor.engines)
            for rid in [r for r in self.weights_in_use if r not in running and r not in self.pending]:
                del self.weights_in_use[rid]
            for action in plan(self.desired, running, self.pending):
                self._spawn_task(action)

    def _spawn_task(self, action: object) -> None:
        rid = action.replica_id  # type: ignore[attr-defined]
        self.pending.add(rid)

        async def go() -> None:
            try:
                match action:
                    case Start():
                        await self._start(rid)
                    case StopEngine():
                        await self.supervisor.stop(rid, self.grace.get(rid, 30.0))
                        if rid in self.desired and self.desired[rid].state not in ("failed",):
                            await self._append(
                                rid, R.ReplicaStopped(replica_id=rid, node_id=self.cfg.node_id, reason=action.reason)
                            )
                            self.desired[rid] = Desired(replica_id=rid, state="stopped")
                    case ReportFailed():
                        await self._append(
                            rid, R.ReplicaFailed(replica_id=rid, node_id=self.cfg.node_id, reason=action.reason)
                        )
                        self.desired[rid] = Desired(replica_id=rid, state="failed")
                    case ReportStopped():
                        await self._append(
                            rid, R.ReplicaStopped(replica_id=rid, node_id=self.cfg.node_id, reason=action.reason)
                        )
                        self.desired[rid] = Desired(replica_id=rid, state="stopped")
            except Exception:
                log.exception("agent action failed", replica=rid, action=type(action).__name__)
            finally:
                self.pending.discard(rid)
                self._wake.set()

        task = asyncio.create_task(go())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, rid: str) -> None:
        placed = self.placed.get(rid)
        if placed is None:
            return
        node = self.cfg.node_id
        model_path: str | None = None
        try:
            ref = M.mirror_ref(placed.source)
            if ref is not None:
                self.weights_in_use[rid] = ref
                model_path = str(await self.weights.ensure(ref))
        except (ValueError, WeightsError) as exc:
            self.weights_in_use.pop(rid, None)
            log.warning("weights not available", replica=rid, source=placed.source, reason=str(exc))
            await self._append(rid, R.ReplicaFailed(replica_id=rid, node_id=node, reason=str(exc)))
            self.desired[rid] = Desired(replica_id=rid, state="failed")
            return
        if self.desired.get(rid, Desired(replica_id=rid, state="")).state != "placed":
            return  # stopped while the weights were fetched
        try:
            rec = self.supervisor.spawn(placed, self.key(rid), model_path=model_path)
        except (EngineStartError, OSError) as exc:
            await self._append(rid, R.ReplicaFailed(replica_id=rid, node_id=node, reason=str(exc)))
            self.desired[rid] = Desired(replica_id=rid, state="failed")
            return
        self.desired[rid] = Desired(replica_id=rid, state="starting")
        await self._append(rid, R.ReplicaStarting(replica_id=rid, node_id=node, pid=rec.pid, port=rec.port))
        try:
            took = await self.supervisor.wait_ready(rid, self.key(rid))
        except EngineStartError as exc:
            code = self.supervisor.exit_code(rid)
            lines = self.supervisor.kill_failed(rid)
            await self._append(
                rid, R.ReplicaFailed(replica_id=rid, node_id=node, reason=str(exc), exit_code=code, log_tail=lines)
            )
            if self.desired.get(rid, Desired(replica_id=rid, state="")).state == "starting":
                self.desired[rid] = Desired(replica_id=rid, state="failed")
            return
        if self.desired.get(rid, Desired(replica_id=rid, state="")).state == "starting":
            self.desired[rid] = Desired(replica_id=rid, state="ready")
        await self._append(
            rid,
            R.ReplicaReady(
                replica_id=rid,
                node_id=node,
                pid=rec.pid,
                port=rec.port,
                url=self.supervisor.url(rec),
                startup_s=round(took, 3),
            ),
        )
        log.info("replica ready", replica=rid, model=placed.model, port=rec.port, startup_s=round(took, 3))

    # -- heartbeats --------------------------------------------------------------------------

    def _gpus(self) -> list[N.GpuInfo]:
        # NVML sensors are sampled at most every 10 s (FLEET-3).
        now = time.monotonic()
        if self._gpus_cache is None or now - self._gpus_cache[0] >= 10.0:
            self._gpus_cache = (now, discovery.gpus())
        return self._gpus_cache[1]

    def heartbeat_payload(self) -> N.NodeHeartbeat:
        mem = discovery.memory()
        gpus = self._gpus()
        reports = []
        now = time.monotonic()
        for rid, rec in sorted(self.supervisor.engines.items()):
            rss, cpu_s = self.supervisor.load(rid)
            cores = None
            if cpu_s is not None:
                prev = self._cpu_seen.get(rid)
                self._cpu_seen[rid] = (now, cpu_s)
                if prev and now > prev[0]:
                    cores = round((cpu_s - prev[1]) / (now - prev[0]), 3)
            watch = self._watch.get(rid, EngineWatch())
            sig = watch.last
            reports.append(
                N.ReplicaReport(
                    replica_id=rid,
                    model=rec.model,
                    pid=rec.pid,
                    port=rec.port,
                    state=rec.state,
                    spec_hash=rec.spec_hash,
                    rss_bytes=rss,
                    cpu_cores_used=cores,
                    requests_running=sig.requests_running if sig else None,
                    requests_waiting=sig.requests_waiting if sig else None,
                    slots=sig.slots if sig else None,
                    kv_cache_usage=sig.kv_cache_usage if sig else None,
                    prompt_tokens_per_s=watch.rates[0],
                    generation_tokens_per_s=watch.rates[1],
                    metrics_at=watch.read_at,
                    metrics_error=watch.error,
                    unreachable=watch.failures >= EM.UNREACHABLE_AFTER,
                )
            )
        return N.NodeHeartbeat(
            node_id=self.cfg.node_id,
            at=datetime.now(UTC),
            agent_version=VERSION,
            agent_started_at=self.started_at,
            address=self.cfg.address or socket.gethostname(),
            labels=dict(self.cfg.labels),
            cpus=self.cpus,
            memory_total_bytes=mem.total,
            memory_available_bytes=mem.available,
            memory_used_bytes=mem.used,
            disk_free_bytes=discovery.disk_free(self.cfg.data_dir),
            gpus=gpus,
            engines=discovery.engines(has_gpus=bool(gpus)),
            replicas=reports,
            sensors=self.sensors.read(),
            weights=self.weights.held() + self.model_dirs.held(),
        )

    async def _scrape_engines(self) -> None:
        """Read each ready engine's load from its own /metrics, all at once, each within a short timeout:
        the heartbeat carries it (SCHED-9). Failures in a row make the replica unreachable, so the
        routers stop sending it requests before the node is called lost."""
        ready = {rid: rec for rid, rec in self.supervisor.engines.items() if rec.state == "ready"}
        for rid in [r for r in self._watch if r not in ready]:
            del self._watch[rid]
        if not ready:
            return
        host = "127.0.0.1" if self.cfg.host in ("", "0.0.0.0", "::") else self.cfg.host

        async def one(session: aiohttp.ClientSession, rid: str, port: int) -> None:
            watch = self._watch.setdefault(rid, EngineWatch())
            try:
                sig = await EM.scrape(session, f"http://{host}:{port}", self.key(rid), time.monotonic())
            except EM.NoMetrics as exc:  # it answers: reachable, only silent about its load
                watch.failures, watch.error = 0, str(exc)
                return
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                watch.failures += 1
                watch.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                if watch.failures == EM.UNREACHABLE_AFTER:
                    log.warning("engine metrics unreachable", replica=rid, error=watch.error)
                return
            watch.rates = EM.rates(watch.last, sig)
            watch.last, watch.read_at, watch.failures, watch.error = sig, datetime.now(UTC), 0, ""

        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(one(session, rid, rec.port) for rid, rec in ready.items()))

    async def heartbeat(self) -> None:
        subject = f"{S.TELEMETRY_ROOT}.node.{encode_token(self.cfg.node_id)}"
        await self._scrape_engines()
        if self.model_dirs.due():
            found = await asyncio.to_thread(self.model_dirs.rescan)
            if len(found) >= MAX_FILES:
                log.warning("model directories hold more weight files than are reported", reported=len(found))
        # A plain publish, not JetStream's: schedulers and routers hear heartbeats by subscription, and the
        # telemetry stream still keeps them; waiting for the stream's acknowledgement held every next
        # heartbeat for up to 10 s while a NATS node was paused, long enough to have the node called lost.
        await self.store.nc.publish(subject, msgspec.json.encode(self.heartbeat_payload()))

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.heartbeat_s)
            try:
                await self.heartbeat()
            except Exception as exc:  # a missed heartbeat is logged; the next one may get through
                log.warning("heartbeat failed", error=str(exc))

    # -- logs --------------------------------------------------------------------------------

    def _weights_request(self, req: WeightsRequest) -> WeightsReply:
        running = {
            ref for rid, ref in self.weights_in_use.items() if rid in self.supervisor.engines or rid in self.pending
        }
        keep = set(req.keep) | running
        if req.action == "collect":
            removed = self.weights.collect(keep)
        elif req.action == "remove":
            removed = self.weights.remove(req.remove, keep)
        elif req.action == "list":
            removed = []
        else:
            return WeightsReply(error=f"unknown weights action {req.action!r} (list, collect, remove)")
        return WeightsReply(held=self.weights.held(), removed=removed)

    async def _on_weights(self, msg: Any) -> None:
        try:
            req = msgspec.json.decode(msg.data, type=WeightsRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await msg.respond(msgspec.json.encode(WeightsReply(error=f"bad weights request: {exc}")))
            return
        try:
            reply = self._weights_request(req)
        except OSError as exc:
            reply = WeightsReply(error=f"node {self.cfg.node_id}: {exc}")
        await msg.respond(msgspec.json.encode(reply))
        with contextlib.suppress(Exception):
            await self.heartbeat()  # what it holds now, without waiting for the next beat

    async def _on_logs(self, msg: Any) -> None:
        try:
            req = msgspec.json.decode(msg.data, type=LogsRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await msg.respond(msgspec.json.encode(LogsReply(error=f"bad logs request: {exc}")))
            return
        n = max(1, min(req.lines, 5000))
        if req.replica:
            path = self.supervisor.log_path(req.replica)
            if not path.exists():
                known = ", ".join(sorted(self.supervisor.engines)) or "none running"
                reply = LogsReply(error=f"node {self.cfg.node_id} has no log for replica {req.replica} ({known})")
            else:
                reply = LogsReply(lines=tail(path, n))
        else:
            reply = LogsReply(lines=list(self.ring.lines)[-n:])
        await msg.respond(msgspec.json.encode(reply))
