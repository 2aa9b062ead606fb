"""The scheduler's shell: leadership, folding the cluster, running passes, appending decisions.

Every instance folds the same state (so a standby takes over warm) and answers `explain`; only
the leader decides. Leadership is a JetStream KV lease with a TTL; the new leader appends
``scheduler.elected`` and fences every later append on that event's sequence, so a stale leader's
decisions are refused by the server itself (SCHED-13).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

import msgspec
import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue
from prometheus_client import CollectorRegistry

from llmgw.events.runtime.buckets import open_bucket
from llmgw.events.runtime.connection import StoreError
from llmgw.events.runtime.follower import Follower, FollowerRegistry
from llmgw.events.runtime.retry import is_transient, keep_running, retrying
from llmgw.events.runtime.snapshots import EVERY_EVENTS, EVERY_S, SnapshotPlan
from llmgw.events.runtime.store import AppendConflict, EventStore, NewEvent
from llmgw.events.runtime.subscriber import Subscriber
from llmgw.events.runtime.tasks import cancel_and_wait
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import scheduler as SCH
from llmgw.events.schema import subjects as S
from llmgw.events.schema.envelope import RecordedEvent, utc_now
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.subjects import event_subject
from llmgw.services.scheduler.explain import explain
from llmgw.services.scheduler.headroom import headroom
from llmgw.services.scheduler.metrics import FleetCollector
from llmgw.services.scheduler.quota import quota_view
from llmgw.services.scheduler.reconcile import reconcile
from llmgw.services.scheduler.state import SNAPSHOT_NAME, SNAPSHOT_VERSION, ClusterState
from llmgw.services.scheduler.vocabulary import (
    Autoscale,
    Blocked,
    Clock,
    Config,
    Decision,
    MarkLost,
    Park,
    Place,
    Preempt,
    Stop,
    Waiting,
    event_of,
)

log = structlog.get_logger("llmgw.services.scheduler")

LEASE_BUCKET = "llmgw_leases"
LEASE_KEY = "scheduler"
BLOCKED_REPEAT_S = 600.0
FORGET_EVERY_S = 60.0  # how often long-inactive replicas are dropped from the state (a full scan)
FOLDED = ("model", "node", "replica", "tenancy", "quota")  # tenancy and quota: capacity quotas (SCHED-8)


class SchedulerService:
    def __init__(
        self,
        store: EventStore,
        *,
        config: Config | None = None,
        instance: str | None = None,
        lease_ttl_s: float = 6.0,
        tick_s: float = 1.0,
        registry: CollectorRegistry | None = None,
        folds: FollowerRegistry | None = None,
        snapshot_every_events: int = EVERY_EVENTS,
        snapshot_every_s: float = EVERY_S,
    ) -> None:
        self.store = store
        self.cfg = config or Config()
        self.instance = instance or f"sched-{new_id()[-12:]}"
        self.actor = "svc:scheduler"
        self.lease_ttl_s = lease_ttl_s
        self.tick_s = tick_s
        self.state = ClusterState()
        self.started = time.monotonic()
        self.leader = False
        self._blocked_now: list[str] = []  # models the last pass could not place (for the metrics)
        if registry is not None:
            registry.register(
                FleetCollector(
                    self.instance, lambda: self.state, lambda: self.leader, lambda: self._blocked_now, self.cfg
                )
            )
        self.term = 0
        self.fence_seq = 0
        self.passes = 0
        self._forgot_at = float("-inf")
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._seen_position = asyncio.Condition()
        self._blocked: dict[str, tuple[str, float]] = {}
        self._placed_total = 0
        # The view of the fleet, kept current by the process's one supervised fold of the log. The
        # leader saves the folded cluster every so many events or seconds; every instance starts from
        # the newest snapshot plus the log after it (0 turns a trigger off; both 0: no snapshots).
        snapshots = SnapshotPlan(
            name=SNAPSHOT_NAME,
            schema_version=SNAPSHOT_VERSION,
            decode=ClusterState.decode,
            encode=lambda: self.state.encode(),
            adopt=self._adopt,
            every_events=snapshot_every_events,
            every_s=snapshot_every_s,
            live=lambda: self.leader and self.fold.caught_up.is_set(),  # one writer: identical folds agree anyway
        )
        self.fold = Follower(
            store,
            f"{S.EVENTS_ROOT}.>",
            self._apply,
            name="scheduler",
            after=0,
            registry=folds,
            on_batch=self._folded,
            snapshot=snapshots,
        )
        # What it follows on the bus beside the log, each under the same supervision as the fold.
        self._heartbeat = msgspec.json.Decoder(N.NodeHeartbeat)
        self._queues = msgspec.json.Decoder(SCH.RouterQueues)
        nc, registry = store.nc, self.fold.registry
        self.subscribers = [
            Subscriber(
                nc, f"{S.TELEMETRY_ROOT}.node.*", self._on_heartbeat, name="scheduler-heartbeats", registry=registry
            ),
            Subscriber(nc, f"{S.PREFIX}.demand.*", self._on_demand, name="scheduler-demand", registry=registry),
            Subscriber(nc, f"{SCH.QUEUE_ROOT}.*", self._on_queues, name="scheduler-queues", registry=registry),
            # `ctl quota list`, `ctl explain`, `ctl model headroom`: any instance answers (a queue group).
            Subscriber(
                nc, Q.QUOTAS_SUBJECT, self._on_quotas, name="scheduler-quotas", queue="scheduler", registry=registry
            ),
            Subscriber(
                nc,
                SCH.EXPLAIN_SUBJECT,
                self._on_explain,
                name="scheduler-explain",
                queue="scheduler",
                registry=registry,
            ),
            Subscriber(
                nc,
                SCH.HEADROOM_SUBJECT,
                self._on_headroom,
                name="scheduler-headroom",
                queue="scheduler",
                registry=registry,
            ),
        ]

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        await self.fold.restore()  # from the newest snapshot, before heartbeats or passes see the state
        tasks = [
            asyncio.create_task(self._follow_events(), name="scheduler-events"),
            *(asyncio.create_task(s.run(), name=s.name) for s in self.subscribers),
            asyncio.create_task(self._lead(), name="scheduler-lead"),
        ]
        try:
            await self._stop.wait()
        finally:
            await cancel_and_wait(tasks)
            for s in self.subscribers:
                await s.close()

    def stop(self) -> None:
        self._stop.set()
        self.fold.stop()

    # -- folding -----------------------------------------------------------------------------

    async def _follow_events(self) -> None:
        await self.fold.run()

    @property
    def snapshot_every(self) -> tuple[int, float]:
        """(events, seconds) between two snapshots of its state, as configured (0: that trigger is off)."""
        plan = self.fold.snapshot
        assert plan is not None
        return plan.every_events, plan.every_s

    def _adopt(self, state: ClusterState) -> None:
        """A snapshot's state becomes the scheduler's (``_apply`` folds into ``self.state``: the fold stays)."""
        self.state = state

    def _closed(self) -> bool:
        return self.store.nc.is_closed

    def _apply(self, e: RecordedEvent) -> None:
        if e.subject.split(".")[2] in FOLDED:
            self.state.apply(e)

    async def _folded(self) -> None:
        # Events the scheduler does not fold move its position too: _wait_folded waits on it.
        self.state.position = max(self.state.position, self.fold.position)
        now = time.monotonic()
        if now - self._forgot_at >= min(FORGET_EVERY_S, self.cfg.forget_after_s):
            # Leader and standby alike: otherwise the state (and its snapshot) keeps every replica ever placed.
            self.state.forget_inactive(self.cfg.forget_after_s, time.time())
            self._forgot_at = now
        async with self._seen_position:
            self._seen_position.notify_all()
        self._wake.set()

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = self._heartbeat.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("heartbeat ignored", subject=msg.subject, error=str(exc))
            return
        known = self.state.nodes.get(hb.node_id)
        first = known is None or known.heartbeat is None
        self.state.observe(hb, time.monotonic())
        if first:
            self._wake.set()

    async def _wait_folded(self, seq: int, timeout: float = 10.0) -> None:
        """Until our own appends are folded: the next pass must see them, or it would place twice."""
        async with self._seen_position:
            await asyncio.wait_for(self._seen_position.wait_for(lambda: self.state.position >= seq), timeout)

    # -- leadership --------------------------------------------------------------------------

    async def _lease(self) -> KeyValue:
        config = KeyValueConfig(bucket=LEASE_BUCKET, ttl=self.lease_ttl_s, storage=StorageType.FILE, history=1)
        return await open_bucket(self.store.js, config, self.store.replicas)

    async def _lead(self) -> None:
        # An election or a lost node fails the lease's requests for a while: stand by, then try again.
        await keep_running("scheduler leadership", self._lead_once, stop=self._stop, closed=self._closed)

    async def _lead_once(self) -> None:
        kv = await self._lease()
        revision = 0
        while not self._stop.is_set():
            if not self.leader:
                try:
                    revision = await kv.create(LEASE_KEY, self.instance.encode())
                except (nats.js.errors.KeyWrongLastSequenceError, nats.js.errors.APIError, nats.errors.TimeoutError):
                    await asyncio.sleep(self.lease_ttl_s / 4)
                    continue
                await self._become_leader(revision)
                pass_task = asyncio.create_task(self._passes())
                try:
                    while self.leader and not self._stop.is_set():
                        await asyncio.sleep(self.lease_ttl_s / 3)
                        if pass_task.done():
                            # The passes ended on an error of their own: stand down, let a leader start afresh.
                            log.warning("scheduler passes ended; standing down", instance=self.instance)
                            self.leader = False
                            break
                        try:
                            revision = await kv.update(LEASE_KEY, self.instance.encode(), last=revision)
                        except (
                            nats.js.errors.KeyWrongLastSequenceError,
                            nats.js.errors.APIError,
                            nats.errors.Error,
                            TimeoutError,
                        ) as exc:
                            log.warning("scheduler lost its lease", instance=self.instance, error=str(exc))
                            self.leader = False
                finally:
                    self.leader = False
                    await cancel_and_wait([pass_task])
            else:
                await asyncio.sleep(self.lease_ttl_s / 4)

    async def _become_leader(self, revision: int) -> None:
        subject = event_subject(SCH.AGGREGATE, SCH.LEADER_ID)
        result = await self.store.append(
            subject, [NewEvent(payload=SCH.LeaderElected(instance=self.instance, term=revision), actor=self.actor)]
        )
        self.term, self.fence_seq, self.leader = revision, result.last_seq, True
        self.started = time.monotonic()  # nodes get a full grace period before a new leader calls them lost
        log.info("scheduler leads", instance=self.instance, term=revision, fence=self.fence_seq)
        self._wake.set()

    # -- passes ------------------------------------------------------------------------------

    async def _passes(self) -> None:
        last = await retrying("scheduler position", self.store.stream_last_seq, stop=self._stop)
        await self._wait_folded(last, timeout=60.0)
        # The folded cluster lives as long as the process: keep it out of later collections, which at
        # 5,000 nodes cost a third of a placing pass (docs/benchmarks.md, Scheduler).
        gc.collect()
        gc.freeze()
        while self.leader:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.tick_s)
            self._wake.clear()
            if not self.leader:
                return
            try:
                await self.reconcile_once()
            except AppendConflict as exc:
                if exc.subject == event_subject(SCH.AGGREGATE, SCH.LEADER_ID):
                    log.warning("another scheduler leads now; standing down", instance=self.instance)
                    self.leader = False
                    return
                log.warning("reconcile conflict; deciding again", error=str(exc))
            except (StoreError, TimeoutError, nats.errors.Error) as exc:
                # NATS away for a while (an election, a lost node): the next pass decides again.
                log.log(30 if is_transient(exc) else 40, "reconcile pass failed", error=str(exc))

    async def reconcile_once(self) -> list[Decision]:
        clock = Clock(monotonic=time.monotonic(), epoch=time.time(), started=self.started)
        decisions = reconcile(self.state, clock, self.cfg)
        self.passes += 1
        items = self._events(decisions, clock)
        if items:
            result = await self.store.append_fenced(
                items, fence_subject=event_subject(SCH.AGGREGATE, SCH.LEADER_ID), fence_seq=self.fence_seq
            )
            await self._wait_folded(result.last_seq)
        self._blocked_now = [d.model for d in decisions if isinstance(d, Blocked)]
        waits = [d.until for d in decisions if isinstance(d, Waiting)]
        if waits:
            # Wake when the earliest backoff ends, not a tick later.
            delay = max(min(waits) - clock.epoch, 0.0)
            asyncio.get_running_loop().call_later(delay, self._wake.set)
        return decisions

    def _events(self, decisions: list[Decision], clock: Clock) -> list[tuple[str, NewEvent]]:
        out: list[tuple[str, NewEvent]] = []

        def add(aggregate: str, agg_id: str, payload: msgspec.Struct) -> None:
            out.append((event_subject(aggregate, agg_id), NewEvent(payload=payload, actor=self.actor)))

        for d in decisions:
            if isinstance(d, Blocked):
                last = self._blocked.get(d.model)
                if last is None or last[0] != d.reason or clock.monotonic - last[1] >= BLOCKED_REPEAT_S:
                    self._blocked[d.model] = (d.reason, clock.monotonic)
                    add(M.AGGREGATE, d.model, SCH.PlacementBlocked(model=d.model, reason=d.reason, wanted=d.wanted))
                    log.warning("no placement", model=d.model, reason=d.reason, wanted=d.wanted)
                continue
            rid = f"{d.model}-{new_id()[-12:]}" if isinstance(d, Place) else ""
            seen = None
            if isinstance(d, MarkLost):
                n = self.state.nodes[d.node_id]
                seen = n.heartbeat.at if n.heartbeat else None
            found = event_of(d, self.state, replica_id=rid, term=self.term, last_seen=seen or utc_now())
            if found is None:
                continue
            add(*found)
            match d:
                case MarkLost():
                    log.warning("node lost", node=d.node_id, silent_s=d.silent_s)
                case Park():
                    log.warning("model parked", model=d.model, reason=d.reason)
                case Place():
                    self._blocked.pop(d.model, None)
                    log.info("replica placed", model=d.model, node=d.node_id, replica=rid, why=d.why)
                case Stop(short=True):
                    log.warning("replica stopped without a replacement", replica=d.replica_id, reason=d.reason)
                case Autoscale():  # every step logged with the load that caused it (SCHED-9)
                    log.info("model autoscaled", model=d.model, replicas_from=d.from_, to=d.to, reason=d.reason)
                case Preempt():
                    log.warning(
                        "replicas preempted",
                        model=d.model,
                        replicas=d.replicas,
                        node=d.node_id,
                        for_model=d.for_model,
                        reason=d.reason,
                    )
        return out

    async def _on_demand(self, msg: Msg) -> None:
        """Routers say when a model is asked for: an on-demand model gets a replica, and every request
        for an unservable model triggers a fresh pass (SCHED-5, SCHED-12)."""
        token = msg.subject.rsplit(".", 1)[1]
        with contextlib.suppress(ValueError):
            model = S.decode_token(token)
            first = model not in self.state.demand
            self.state.demand[model] = time.time()
            m = self.state.models.get(model)
            if first or (m is not None and (m.min == 0 or m.parked is None)):
                self._wake.set()

    async def _on_queues(self, msg: Msg) -> None:
        """Routers' queues are load the engines cannot see: it joins the models' load (SCHED-9)."""
        try:
            q = self._queues.decode(msg.data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("router queue report ignored", subject=msg.subject, error=str(exc))
            return
        self.state.observe_queue(q.router, q.waiting, time.monotonic())

    # -- explain: `ctl explain` and `ctl model headroom`, from the folded state (any instance can) --

    async def _on_explain(self, msg: Msg) -> None:
        name = msg.data.decode()
        clock = Clock(monotonic=time.monotonic(), epoch=time.time(), started=self.started)
        body = explain(self.state, name, self.cfg, leader=self.instance if self.leader else None, clock=clock)
        await msg.respond(msgspec.json.encode(body))

    async def _on_headroom(self, msg: Msg) -> None:
        name = msg.data.decode()
        clock = Clock(monotonic=time.monotonic(), epoch=time.time(), started=self.started)
        body = headroom(self.state, name, clock, self.cfg)
        await msg.respond(msgspec.json.encode({**body, "answered_by": self.instance}))

    async def _on_quotas(self, msg: Msg) -> None:  # `ctl quota list` (SCHED-8)
        body = quota_view(self.state)
        await msg.respond(msgspec.json.encode({**body, "answered_by": self.instance}))
