"""Everything that follows the bus is supervised and visible, each kind broken on purpose against a real nats-server.

A scheduler's heartbeat, demand, queue-report and explain subscribers, a router's heartbeat
subscriber, a subscription the server refuses, a projection whose handler raises and one whose
database cannot be written: each is broken, and the process's ``/healthz`` (the admin API's, over
the process's registry; the gateway's too for the router) must answer 503 naming it — and
``llmgw_fold_healthy`` say 0 — then 200 again once the cause is gone.
"""

from __future__ import annotations

import asyncio
import signal
import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client as NATS
from structlog.testing import capture_logs

from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.store import EventStore
from llmgw.events.runtime.subscriber import Subscriber, SubscriberObservation, judge_subscriber
from llmgw.events.schema import nodes as N
from llmgw.events.schema import scheduler as SCH
from llmgw.events.schema import subjects as S
from llmgw.infra.nats_permissions import NatsUser, Permissions, SubjectRules
from llmgw.infra.natsd import NatsConfig, NatsProcess, write_authorization
from llmgw.projections.backends import open_backend
from llmgw.projections.runner import ProjectionRunner, slot_health
from llmgw.services.router.gossip import SUBJECT as GOSSIP_SUBJECT
from llmgw.services.scheduler.service import SchedulerService
from tests.fleet import Fleet
from tests.support import NatsServer, free_port, wait_until
from tests.test_follower import get_health, health_server
from tests.test_gateway import FAST_ROUTER
from tests.test_projections import Counters, count_events, es  # noqa: F401  (es: the fixture)


class Breakable:
    """A bug in a subscriber's handler, simulated: the handler itself, raising while ``broken``."""

    def __init__(self, handler: Callable[[Any], Awaitable[None]]) -> None:
        self.handler = handler
        self.broken = True

    async def __call__(self, msg: Any) -> None:
        if self.broken:
            raise RuntimeError("a handler bug")
        await self.handler(msg)


def heartbeat(node: str) -> bytes:
    now = datetime.now(UTC)
    return msgspec.json.encode(
        N.NodeHeartbeat(node_id=node, at=now, agent_version="test", agent_started_at=now, address="127.0.0.1")
    )


# What reaches each subscriber of the scheduler: (subject, message). Explain requests ask for a reply.
MESSAGES: dict[str, tuple[str, bytes]] = {
    "heartbeats": (f"{S.TELEMETRY_ROOT}.node.n1", heartbeat("n1")),
    "demand": (f"{S.PREFIX}.demand.{S.encode_token('m1')}", b""),
    "queues": (f"{SCH.QUEUE_ROOT}.r1", msgspec.json.encode(SCH.RouterQueues(router="r1", waiting={"m1": 2}))),
    "explain": (SCH.EXPLAIN_SUBJECT, b"m1"),
}


async def send(nc: NATS, kind: str) -> bool:
    """One message to the scheduler's ``kind`` subscriber; for explain, True once it was answered."""
    subject, data = MESSAGES[kind]
    if kind != "explain":
        await nc.publish(subject, data)
        await nc.flush()
        return True
    try:
        await nc.request(subject, data, timeout=2.0)
    except TimeoutError:
        return False  # not answered (yet): asked again by the caller's wait
    return True


async def health_is(url: str, status: int) -> tuple[int, dict] | None:
    got, body = await get_health(url)
    return (got, body) if got == status else None


@pytest.fixture
async def scheduler(store: EventStore) -> AsyncIterator[tuple[SchedulerService, FollowerRegistry, str]]:
    """A scheduler on an empty log (no snapshots), its registry, and a /healthz over that registry."""
    folds = FollowerRegistry()
    s = SchedulerService(store, instance="s1", folds=folds, snapshot_every_events=0, snapshot_every_s=0)
    running = asyncio.create_task(s.run())
    try:
        async with health_server(store, folds) as url:
            yield s, folds, url
    finally:
        s.stop()
        await running


@pytest.mark.parametrize("kind", ["heartbeats", "demand", "queues", "explain"])
async def test_a_scheduler_subscriber_whose_handler_raises_is_named_on_healthz_until_it_handles_a_message_again(
    scheduler: tuple[SchedulerService, FollowerRegistry, str], store: EventStore, kind: str
) -> None:
    service, folds, url = scheduler
    name = f"scheduler-{kind}"
    sub = next(s for s in service.subscribers if s.name == name)
    bug = Breakable(sub.handler)
    sub.handler = bug
    await wait_until(lambda: health_is(url, 200), deadline_s=30, what="/healthz 200 with every reader live")

    subject, data = MESSAGES[kind]
    await store.nc.publish(subject, data, reply=store.nc.new_inbox())  # a reply to nobody: explain answers it
    _status, body = await wait_until(lambda: health_is(url, 503), deadline_s=30, what=f"/healthz 503 naming {name}")
    assert body["folds"][name]["state"] == "failed"
    assert (
        f"{name} is failed: its handler raised on the last message: RuntimeError: a handler bug"
        in (body["unhealthy_folds"])
    )
    assert folds.metrics.get_sample_value("llmgw_fold_healthy", {"fold": name}) == 0

    bug.broken = False  # the bug fixed: the next message is handled, and the subscriber is live again
    await wait_until(lambda: send(store.nc, kind), deadline_s=30, what=f"a message {name} handles")
    await wait_until(lambda: health_is(url, 200), deadline_s=30, what="/healthz 200 again")
    assert folds.metrics.get_sample_value("llmgw_fold_healthy", {"fold": name}) == 1
    if kind == "heartbeats":
        assert service.state.nodes["n1"].heartbeat is not None
    if kind == "demand":
        assert "m1" in service.state.demand


def probe_server(tmp_path: Path, may_subscribe: tuple[str, ...]) -> NatsConfig:
    """A server with one user, ``probe``, who may publish anything and subscribe to ``may_subscribe``."""
    rules = Permissions(publish=SubjectRules(allow=(">",)), subscribe=SubjectRules(allow=may_subscribe))
    return NatsConfig(
        port=free_port(),
        store_dir=str(tmp_path / "js"),
        durable=False,
        authorization=(NatsUser(user="probe", password="secret", permissions=rules),),
        authorization_file="users.conf",
    )


async def test_a_subscription_the_server_refuses_is_failed_naming_the_refusal_and_live_once_it_is_allowed(
    tmp_path: Path,
) -> None:
    config = probe_server(tmp_path, ("_INBOX.>",))
    server = NatsProcess(config, tmp_path / "nats.conf", tmp_path / "nats.log").start()
    nc = await nats.connect(server.url, user="probe", password="secret", allow_reconnect=False)
    folds = FollowerRegistry()
    got: list[bytes] = []

    async def handler(msg: Any) -> None:
        got.append(msg.data)

    sub = Subscriber(nc, "test.watched", handler, name="watched", registry=folds).start()
    try:
        async with health_server(_Connected(nc), folds) as url:  # type: ignore[arg-type]  # reads nc alone
            await wait_until(lambda: sub.health().state == "failed", deadline_s=30, what="the refusal seen")
            _status, body = await wait_until(lambda: health_is(url, 503), deadline_s=30, what="/healthz 503")
            assert body["folds"]["watched"]["state"] == "failed"
            refusal = 'permissions violation for subscription to "test.watched"'
            assert f"NATS refused the subscription to test.watched: {refusal}" in body["folds"]["watched"]["error"]
            # The operator allows it and reloads the server: the subscriber, trying again, is taken.
            write_authorization(probe_server(tmp_path, ("_INBOX.>", "test.>")), tmp_path)
            assert server.proc is not None
            server.proc.send_signal(signal.SIGHUP)
            await wait_until(lambda: health_is(url, 200), deadline_s=60, what="/healthz 200 once allowed")
            await nc.publish("test.watched", b"hello")
            await wait_until(lambda: got == [b"hello"], deadline_s=30, what="the message handled")
    finally:
        await sub.close()
        await nc.close()
        server.stop()


class _Connected:
    """What the admin API's /healthz reads of an event store: its connection."""

    def __init__(self, nc: NATS) -> None:
        self.nc = nc


def test_a_subscriber_is_failed_while_it_cannot_subscribe_or_its_handler_fails_and_stalled_after_a_long_disconnect():
    live = SubscriberObservation(subscribed=True, failure=None, handler_error=None, disconnected_since=None)
    assert judge_subscriber(live, now=100.0, stall_s=30) == ("live", None)
    away = msgspec.structs.replace(live, disconnected_since=90.0)
    assert judge_subscriber(away, now=100.0, stall_s=30)[0] == "live"  # a blip is not news
    assert judge_subscriber(away, now=120.0, stall_s=30) == ("stalled", "NATS has been disconnected for 30 s")
    bug = msgspec.structs.replace(live, handler_error="KeyError: 'n1'")
    assert judge_subscriber(bug, now=100.0, stall_s=30) == (
        "failed",
        "its handler raised on the last message: KeyError: 'n1'",
    )
    refused = msgspec.structs.replace(live, subscribed=False, failure="SubscriptionRefused: no")
    assert judge_subscriber(refused, now=100.0, stall_s=30) == ("failed", "SubscriptionRefused: no")
    starting = msgspec.structs.replace(live, subscribed=False)
    assert judge_subscriber(starting, now=100.0, stall_s=30) == ("starting", None)


def test_a_projection_is_failed_when_stopped_on_an_event_and_stalled_only_after_retrying_for_stall_s() -> None:
    assert slot_health("running", None, None, now=100.0, stall_s=30) == ("live", None)
    assert slot_health("failed", "RuntimeError: bad", None, now=100.0, stall_s=30) == ("failed", "RuntimeError: bad")
    assert slot_health("retrying", "disk full", 90.0, now=100.0, stall_s=30) == ("live", "disk full")
    assert slot_health("running", "disk full", 60.0, now=100.0, stall_s=30) == (
        "stalled",
        "failing and retrying for 40 s: disk full",
    )
    assert slot_health("superseded", "a newer release", None, now=100.0, stall_s=30)[0] == "live"
    assert slot_health("starting", None, None, now=100.0, stall_s=30) == ("starting", None)


async def test_a_projection_stopped_by_an_event_is_named_on_healthz_and_live_again_once_restarted_fixed(
    es: EventStore,  # noqa: F811
    tmp_path: Path,
) -> None:
    backend = await open_backend(f"sqlite:///{tmp_path / 'projections.db'}")
    folds = FollowerRegistry()
    counters = Counters(stop_at="stop")
    runner = ProjectionRunner(es, backend, [counters], lag_interval_s=None, folds=folds)
    await runner.start()
    try:
        async with health_server(es, folds) as url:
            last = await count_events(es, ["a", "stop", "b"])
            _status, body = await wait_until(lambda: health_is(url, 503), deadline_s=30, what="/healthz 503")
            assert body["folds"]["projection-counters"]["state"] == "failed"
            assert any(
                r.startswith("projection-counters is failed:") and "simulated crash" in r
                for r in body["unhealthy_folds"]
            )
            assert folds.metrics.get_sample_value("llmgw_fold_healthy", {"fold": "projection-counters"}) == 0
            counters.stop_at = None  # the handler fixed
            await runner.restart("counters")
            assert await runner.wait_until("counters", last, timeout=30)
            await wait_until(lambda: health_is(url, 200), deadline_s=30, what="/healthz 200 again")
    finally:
        await runner.stop()
        await backend.close()
    assert "projection-counters" not in {h.name for h in folds.health()}  # a stopped runner reports nothing


async def test_a_projection_whose_database_cannot_be_written_is_stalled_on_healthz_and_live_once_it_can(
    es: EventStore,  # noqa: F811
    tmp_path: Path,
) -> None:
    path = tmp_path / "projections.db"
    backend = await open_backend(f"sqlite:///{path}")
    folds = FollowerRegistry()
    runner = ProjectionRunner(es, backend, [Counters()], lag_interval_s=0.2, folds=folds, stall_s=1.0)
    await runner.start()
    lock = sqlite3.connect(path, isolation_level=None)
    try:
        async with health_server(es, folds) as url:
            first = await count_events(es, ["a"])
            assert await runner.wait_until("counters", first, timeout=30)
            await wait_until(lambda: health_is(url, 200), deadline_s=30, what="/healthz 200 at first")
            lock.execute(
                "BEGIN EXCLUSIVE"
            )  # another writer holds the database: every write of the runner waits, then fails
            last = await count_events(es, ["b", "c"])
            _status, body = await wait_until(lambda: health_is(url, 503), deadline_s=120, what="/healthz 503")
            assert body["folds"]["projection-counters"]["state"] == "stalled"
            assert "locked" in body["folds"]["projection-counters"]["error"]
            lock.execute("ROLLBACK")
            assert await runner.wait_until("counters", last, timeout=120)
            await wait_until(lambda: health_is(url, 200), deadline_s=30, what="/healthz 200 again")
    finally:
        lock.close()
        await runner.stop()
        await backend.close()


async def test_a_router_whose_heartbeat_handler_raises_answers_503_on_both_healthz_naming_it_then_200(
    store: EventStore, nats: NatsServer, tmp_path: Path
) -> None:
    gw = await Fleet(store, nats.url, tmp_path).start(services=("router",), router=FAST_ROUTER)
    try:
        router = gw.handles["router"]
        bug = Breakable(router.heartbeats.handler)
        router.heartbeats.handler = bug
        router_health = f"http://127.0.0.1:{gw.port}/healthz"
        process_health = f"http://127.0.0.1:{gw.admin_port}/healthz"
        await wait_until(lambda: health_is(router_health, 200), deadline_s=30, what="the router's /healthz 200")
        subject, data = MESSAGES["heartbeats"]
        await store.nc.publish(subject, data)
        for url in (router_health, process_health):
            _status, body = await wait_until(lambda u=url: health_is(u, 503), deadline_s=30, what=f"{url} 503")
            assert body["folds"]["router-heartbeats"]["state"] == "failed"
            assert any(r.startswith("router-heartbeats is failed") for r in body["unhealthy_folds"])
        bug.broken = False
        await store.nc.publish(subject, data)
        for url in (router_health, process_health):
            await wait_until(lambda u=url: health_is(u, 200), deadline_s=30, what=f"{url} 200 again")
        assert "n1" in router._engines_by_node  # the heartbeat after the fix was taken
    finally:
        await gw.stop()


async def test_a_router_that_cannot_take_the_other_routers_limit_gossip_says_so_on_healthz_then_recovers(
    store: EventStore, nats: NatsServer, tmp_path: Path
) -> None:
    gw = await Fleet(store, nats.url, tmp_path).start(services=("router",), router=FAST_ROUTER)
    try:
        router = gw.handles["router"]
        bug = Breakable(router.gossip_in.handler)
        router.gossip_in.handler = bug
        url = f"http://127.0.0.1:{gw.port}/healthz"
        await wait_until(lambda: health_is(url, 200), deadline_s=30, what="the router's /healthz 200")
        gossip = msgspec.json.encode({"from": "another-router", "at": 0.0, "deltas": {}})
        await store.nc.publish(GOSSIP_SUBJECT, gossip)
        _status, body = await wait_until(lambda: health_is(url, 503), deadline_s=30, what="/healthz 503")
        assert body["folds"]["router-gossip"]["state"] == "failed"
        assert any(r.startswith("router-gossip is failed") for r in body["unhealthy_folds"])
        bug.broken = False
        await store.nc.publish(GOSSIP_SUBJECT, gossip)
        await wait_until(lambda: health_is(url, 200), deadline_s=30, what="/healthz 200 again")
    finally:
        await gw.stop()


async def test_a_starting_server_tells_no_person_that_its_folds_turned_live(
    store: EventStore, nats: NatsServer, tmp_path: Path
) -> None:
    services = ("tenancy", "access", "people", "catalog", "fleet", "scheduler", "projections", "api")
    with capture_logs() as logs:
        server = await Fleet(store, nats.url, tmp_path).start(services=services)
        try:
            url = f"http://127.0.0.1:{server.admin_port}/healthz"
            _status, body = await wait_until(lambda: health_is(url, 200), deadline_s=60, what="/healthz 200")
        finally:
            await server.stop()
    assert len(body["folds"]) > 20  # the folds, subscribers and projections of a control plane
    live = [e for e in logs if str(e.get("event", "")).startswith("a fold is live")]
    assert live  # each said so…
    assert {e["log_level"] for e in live} == {"debug"}  # …below what a terminal shows by default
