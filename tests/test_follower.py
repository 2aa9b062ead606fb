"""The supervised follower (events/runtime/follower.py), broken on purpose against a real nats-server.

Each test breaks one thing a process's fold lives through — its consumer deleted, the server
restarted or paused, an event its handler raises on, a handler that blocks — and checks what a
user of that process would notice: every event applied once and in order afterwards, and a
``/healthz`` that says 503 naming the fold while it is not live, then 200 again by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import openai
import pytest
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from llmgw.events.runtime.follower import Follower, FollowerRegistry, Observation, judge
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import access as A
from llmgw.events.schema import subjects as S
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.services.api.app import AdminApi
from llmgw.services.router.state import RouterState
from tests.fleet import Fleet
from tests.support import NatsServer, wait_until
from tests.test_gateway import FAST_ROUTER, GATEWAY, make_key, make_tenant, set_event

SUBJECT = f"{S.EVENTS_ROOT}.{A.KEY_AGGREGATE}.>"


class Revocations:
    """A fold that records which keys were revoked, in the order it saw them (and every sequence it applied)."""

    def __init__(self) -> None:
        self.position = 0
        self.revoked: list[str] = []
        self.seqs: list[int] = []

    def apply(self, e: RecordedEvent) -> None:
        assert isinstance(e.payload, A.KeyRevoked)
        if e.payload.reason == "poison":
            raise ValueError(f"cannot fold key {e.payload.key_id}")
        self.revoked.append(e.payload.key_id)
        self.seqs.append(e.seq)
        self.position = e.seq


async def revoke(store: EventStore, *keys: str, reason: str = "") -> list[int]:
    seqs = []
    for k in keys:
        result = await store.append(
            S.event_subject(A.KEY_AGGREGATE, k),
            [NewEvent(payload=A.KeyRevoked(key_id=k, reason=reason), actor="system:test")],
        )
        seqs.append(result.last_seq)
    return seqs


@contextlib.asynccontextmanager
async def health_server(store: EventStore, folds: FollowerRegistry) -> AsyncIterator[str]:
    """A process's admin ``/healthz`` over a fold registry; yields its URL."""
    api = AdminApi(store, None, None, folds.metrics)  # type: ignore[arg-type]  # /healthz reads neither
    api.folds = folds
    server = TestServer(api.app(full=False))
    await server.start_server()
    try:
        yield str(server.make_url("/healthz"))
    finally:
        await server.close()


@pytest.fixture
async def healthz(store: EventStore) -> AsyncIterator[tuple[FollowerRegistry, str]]:
    """A process's admin ``/healthz`` over a fold registry: (the registry, the URL)."""
    folds = FollowerRegistry()
    async with health_server(store, folds) as url:
        yield folds, url


async def get_health(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as s, s.get(url) as r:
        return r.status, await r.json()


def test_a_fold_is_live_on_a_quiet_log_and_stalled_only_when_it_has_events_to_read_and_stands_still() -> None:
    live = Observation(
        reading=True,
        caught_up=True,
        position=10,
        head=10,
        behind_since=None,
        head_unknown_since=None,
        head_error=None,
        failure=None,
    )
    assert judge(live, now=1000.0, stall_s=30) == ("live", None)  # quiet for ever: still live
    behind = msgspec.structs.replace(live, head=12, behind_since=990.0)
    assert judge(behind, now=1000.0, stall_s=30)[0] == "live"  # behind, but not for long yet
    state, why = judge(behind, now=1020.0, stall_s=30)
    assert state == "stalled"
    assert why == "the log has events up to 12 but the fold has stood at 10 for 30 s"
    blind = msgspec.structs.replace(live, head_unknown_since=950.0, head_error="NATS does not answer")
    assert judge(blind, now=1000.0, stall_s=30) == (
        "stalled",
        "cannot learn the log's head for 50 s: NATS does not answer",
    )
    failed = msgspec.structs.replace(live, failure="StoreError: the stream is gone")
    assert judge(failed, now=1000.0, stall_s=30) == ("failed", "StoreError: the stream is gone")
    starting = msgspec.structs.replace(live, reading=False, caught_up=False)
    assert judge(starting, now=1000.0, stall_s=30)[0] == "starting"
    catching_up = msgspec.structs.replace(live, caught_up=False, position=4)
    assert judge(catching_up, now=1000.0, stall_s=30) == ("catching_up", "at 4 of 10")


async def test_a_fold_whose_consumer_is_deleted_reads_on_with_nothing_skipped_and_nothing_twice(store: EventStore):
    fold = Revocations()
    live = Follower(store, SUBJECT, fold, name="keys").start()
    try:
        first = await revoke(store, "k1", "k2", "k3")
        assert await live.wait_caught_up(30)
        await wait_until(lambda: fold.seqs == first, what="the first revocations folded")
        for c in await store.js.consumers_info(store.stream):
            await store.js.delete_consumer(store.stream, c.name)
        then = await revoke(store, "k4", "k5")
        await wait_until(lambda: len(fold.seqs) >= 5, deadline_s=60, what="the revocations after the deletion")
        assert fold.revoked == ["k1", "k2", "k3", "k4", "k5"]
        assert fold.seqs == first + then
        await wait_until(lambda: live.health().state == "live", what="the fold live again")
    finally:
        await live.close()


async def test_a_fold_reads_on_after_the_nats_server_restarts(nats: NatsServer, tmp_path: Path):
    store = await EventStore.connect(nats.url, default_registry())
    await store.ensure_streams()
    fold = Revocations()
    live = Follower(store, SUBJECT, fold, name="keys").start()
    try:
        before = await revoke(store, "k1", "k2")
        await wait_until(lambda: fold.seqs == before, what="the revocations before the restart")
        nats.stop()
        nats.start()  # same port, same store: the stream is back, the fold's consumer is not
        after = await wait_until(lambda: _try(revoke(store, "k3", "k4")), deadline_s=30, what="appending again")
        await wait_until(lambda: len(fold.seqs) >= 4, deadline_s=60, what="the revocations after the restart")
        assert fold.revoked == ["k1", "k2", "k3", "k4"]
        assert fold.seqs == before + after
    finally:
        await live.close()
        await store.close()


async def _try(step) -> object:
    try:
        return await step
    except Exception:
        return None


async def test_an_event_the_handler_raises_on_is_quarantined_and_later_events_are_still_applied(
    store: EventStore, healthz: tuple[FollowerRegistry, str]
):
    folds, url = healthz
    fold = Revocations()
    live = Follower(store, SUBJECT, fold, name="keys", registry=folds).start()
    try:
        [bad] = await revoke(store, "k-bad", reason="poison")
        good = await revoke(store, "k1", "k2")
        await wait_until(lambda: fold.seqs == good, what="the revocations after the poisoned event")
        assert fold.revoked == ["k1", "k2"]
        assert folds.metrics.get_sample_value("llmgw_fold_quarantined_total", {"fold": "keys"}) == 1
        kept = await store.js.get_last_msg(S.STREAM_QUARANTINE, f"{S.QUARANTINE_ROOT}.>")
        assert kept.headers["Llmgw-Origin-Seq"] == str(bad)
        assert "cannot fold key k-bad" in kept.headers["Llmgw-Error"]
        # The fold goes on, so the process stays healthy: the event is kept, not lost, and counted.
        _status, body = await wait_until(lambda: _live_health(url), what="/healthz 200")
        assert body["folds"]["keys"]["quarantined"] == 1
    finally:
        await live.close()


async def _live_health(url: str) -> tuple[int, dict] | None:
    status, body = await get_health(url)
    return (status, body) if status == 200 else None


async def _unhealthy(url: str) -> tuple[int, dict] | None:
    status, body = await get_health(url)
    return (status, body) if status == 503 else None


async def test_a_fold_that_cannot_advance_is_stalled_on_healthz_and_recovers_by_itself(
    store: EventStore, healthz: tuple[FollowerRegistry, str]
):
    folds, url = healthz
    gate = asyncio.Event()
    applied: list[int] = []

    async def apply(e: RecordedEvent) -> None:
        if e.payload.reason == "slow":
            await gate.wait()  # a handler stuck on one event: everything after it waits
        applied.append(e.seq)

    live = Follower(store, SUBJECT, apply, name="keys", registry=folds, stall_s=1.0).start()
    try:
        assert await live.wait_caught_up(30)
        await wait_until(lambda: _live_health(url), what="/healthz 200 at first")
        seqs = await revoke(store, "k1", reason="slow") + await revoke(store, "k2")
        _status, body = await wait_until(lambda: _unhealthy(url), deadline_s=30, what="/healthz 503")
        assert body["folds"]["keys"]["state"] == "stalled"
        assert any(r.startswith("keys is stalled") for r in body["unhealthy_folds"])
        assert folds.metrics.get_sample_value("llmgw_fold_healthy", {"fold": "keys"}) == 0
        gate.set()
        await wait_until(lambda: _live_health(url), deadline_s=30, what="/healthz 200 again")
        assert applied == seqs
        assert folds.metrics.get_sample_value("llmgw_fold_healthy", {"fold": "keys"}) == 1
    finally:
        gate.set()
        await live.close()


async def test_a_fold_whose_nats_server_is_paused_is_stalled_then_live_when_it_resumes(
    nats: NatsServer, store: EventStore, healthz: tuple[FollowerRegistry, str]
):
    folds, url = healthz
    fold = Revocations()
    live = Follower(store, SUBJECT, fold, name="keys", registry=folds, stall_s=1.0).start()
    assert nats.proc is not None
    try:
        before = await revoke(store, "k1")
        await wait_until(lambda: fold.seqs == before, what="the first revocation")
        os.kill(nats.proc.pid, signal.SIGSTOP)
        try:
            _status, body = await wait_until(lambda: _unhealthy(url), deadline_s=30, what="/healthz 503")
            assert body["folds"]["keys"]["state"] == "stalled"
            assert "head" in body["folds"]["keys"]["error"]
        finally:
            os.kill(nats.proc.pid, signal.SIGCONT)
        after = await wait_until(lambda: _try(revoke(store, "k2")), deadline_s=30, what="appending again")
        await wait_until(lambda: fold.seqs == before + after, deadline_s=60, what="the revocation after the pause")
        await wait_until(lambda: _live_health(url), deadline_s=30, what="/healthz 200 again")
    finally:
        await live.close()


async def test_a_poisoned_event_before_a_revocation_leaves_the_key_refused_and_a_stalled_router_answers_503(
    store: EventStore, nats: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    # A bug in the router's handler for one event (simulated: it raises on a key named "poison").
    apply = RouterState.apply

    def buggy_apply(self: RouterState, e: RecordedEvent) -> None:
        if isinstance(e.payload, A.KeyCreated) and e.payload.name == "poison":
            raise KeyError("a handler bug")
        apply(self, e)

    monkeypatch.setattr(RouterState, "apply", buggy_apply)
    gw = await Fleet(store, nats.url, tmp_path).start(services=GATEWAY, router=FAST_ROUTER)
    try:
        router = gw.handles["router"]
        router_health = f"http://127.0.0.1:{gw.port}/healthz"
        process_health = f"http://127.0.0.1:{gw.admin_port}/healthz"
        tenant = await make_tenant(store)
        key, key_id = await make_key(store, tenant)
        poison = A.KeyCreated(
            key_id="key_poison", prefix="poison", secret_sha256="0" * 64, project_id=tenant.project, name="poison"
        )
        await set_event(store, A.KEY_AGGREGATE, "key_poison", poison)
        await gw.router_caught_up()
        c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=key, max_retries=0)
        await c.models.list()
        await set_event(store, A.KEY_AGGREGATE, key_id, A.KeyRevoked(key_id=key_id))

        async def refused() -> bool:
            try:
                await c.models.list()
            except openai.AuthenticationError:
                return True
            return False

        await wait_until(refused, what="the revoked key to be refused")
        assert router.fold.health().quarantined == 1
        await wait_until(lambda: _live_health(router_health), what="the router's /healthz 200")

        # The router's fold cannot advance (its NATS server paused): both /healthz answers say so.
        router.fold.stall_s, router.fold.check_s = 1.0, 0.2
        assert nats.proc is not None
        os.kill(nats.proc.pid, signal.SIGSTOP)
        try:
            _status, body = await wait_until(lambda: _unhealthy(router_health), deadline_s=30, what="router 503")
            assert body["folds"]["router"]["state"] == "stalled"
            _status, body = await wait_until(lambda: _unhealthy(process_health), deadline_s=30, what="process 503")
            assert any(r.startswith("router is stalled") for r in body["unhealthy_folds"])
        finally:
            os.kill(nats.proc.pid, signal.SIGCONT)
        await wait_until(lambda: _live_health(router_health), deadline_s=30, what="the router's /healthz 200 again")
    finally:
        await gw.stop()


async def test_a_fold_started_before_its_stream_exists_is_stalled_then_reads_once_the_stream_is_made(nats: NatsServer):
    store = await EventStore.connect(nats.url, default_registry())  # nobody has made the streams yet
    folds = FollowerRegistry()
    fold = Revocations()
    live = Follower(store, SUBJECT, fold, name="keys", registry=folds, stall_s=1.0).start()
    try:
        async with health_server(store, folds) as url:
            # 503 at once (starting), then stalled: the fold cannot learn what the log holds.
            status, body = await wait_until(lambda: _in_state(url, "stalled"), deadline_s=30, what="a stalled fold")
            assert status == 503
            assert body["unhealthy_folds"][0].startswith("keys is stalled: cannot learn the log's head")
            await store.ensure_streams()
            seqs = await revoke(store, "k1")
            await wait_until(lambda: fold.seqs == seqs, deadline_s=30, what="the revocation folded")
            await wait_until(lambda: _live_health(url), deadline_s=30, what="/healthz 200")
    finally:
        await live.close()
        await store.close()


async def _in_state(url: str, state: str) -> tuple[int, dict] | None:
    status, body = await get_health(url)
    return (status, body) if body["folds"]["keys"]["state"] == state else None


async def test_a_fold_turning_live_at_start_is_a_debug_line_and_live_again_after_stalling_is_told_to_a_person(
    store: EventStore,
):
    gate = asyncio.Event()

    async def apply(e: RecordedEvent) -> None:
        await gate.wait()  # stuck until released: the fold stalls

    with capture_logs() as logs:
        live = Follower(store, SUBJECT, apply, name="keys", stall_s=1.0).start()
        try:
            assert await live.wait_caught_up(30)
            await wait_until(lambda: live.health().state == "live", what="the fold live at start")
            await revoke(store, "k1")
            await wait_until(lambda: live.health().state == "stalled", deadline_s=30, what="the fold stalled")
            gate.set()
            await wait_until(lambda: live.health().state == "live", deadline_s=30, what="the fold live again")
        finally:
            gate.set()
            await live.close()
    told = [(e["log_level"], e["event"]) for e in logs if e.get("fold") == "keys"]
    assert told == [
        ("debug", "a fold is live"),  # a process starts dozens: nothing a person at a terminal needs
        ("error", "a fold is not live"),
        ("info", "a fold is live again"),
    ]
