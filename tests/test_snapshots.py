"""Snapshots: a router or a scheduler starts from the newest snapshot and reads only the log after it,
reaching the state a fold from 0 reaches; a snapshot it cannot trust is ignored, logged, and the fold
starts from 0. Real nats-server; the log is the cold-start benchmark's realistic mix."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
import random
import subprocess
import sys
import zlib
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner
from structlog.testing import capture_logs

from llmgw.bench.coldstart import realistic_log
from llmgw.cli.main import main
from llmgw.events.runtime import snapshots as snapshots_module
from llmgw.events.runtime.follower import Follower
from llmgw.events.runtime.snapshots import CODEC, Snapshot, SnapshotStore, Snapshotter, encode_snapshot
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import access as A
from llmgw.events.schema import replicas as R
from llmgw.events.schema import subjects as S
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.services.router import state as RS
from llmgw.services.router.app import Router
from llmgw.services.router.config import RouterConfig
from llmgw.services.scheduler import state as SS
from llmgw.services.scheduler.service import FOLDED, SchedulerService
from llmgw.services.scheduler.vocabulary import Config
from tests.support import wait_until

LLMGW = str(Path(sys.executable).parent / "llmgw")
LOG = 3_000  # events before the snapshot
EVERY = 1_000


@pytest.fixture
async def routers() -> AsyncIterator[list[Router]]:
    started: list[Router] = []
    yield started
    for r in started:
        await r.stop()


async def _router(store: EventStore, started: list[Router], every_events: int = EVERY) -> Router:
    router = Router(store, RouterConfig(), snapshot_every_events=every_events, snapshot_every_s=0)
    started.append(router)
    await router.start()
    return router


def _counting(monkeypatch: pytest.MonkeyPatch, cls: type) -> list[int]:
    """The sequences of the events ``cls.apply`` folds from now on (the real apply runs)."""
    seen: list[int] = []
    real = cls.apply

    def apply(self: object, e: RecordedEvent) -> None:
        seen.append(e.seq)
        real(self, e)

    monkeypatch.setattr(cls, "apply", apply)
    return seen


async def _folded_from_0(store: EventStore, fold: RS.RouterState | SS.ClusterState) -> None:
    await _folded_to(store, fold, await store.stream_last_seq())


async def _folded_to(store: EventStore, fold: RS.RouterState | SS.ClusterState, until: int) -> None:
    async for batch in store.subscribe(f"{S.EVENTS_ROOT}.>", after=0, follow=False, until=until):
        for e in batch:
            if e.seq > until:
                break
            if isinstance(e, RecordedEvent) and (isinstance(fold, RS.RouterState) or e.subject.split(".")[2] in FOLDED):
                fold.apply(e)
            fold.position = max(fold.position, e.seq)


async def _tail(store: EventStore) -> tuple[str, str]:
    """Events after the snapshot: a key made, one revoked, a replica stopped. (new prefix, revoked prefix)"""
    await store.append_many(
        [
            (
                S.event_subject("key", "key-new"),
                NewEvent(
                    payload=A.KeyCreated(
                        key_id="key-new", prefix="sk-new", secret_sha256="0" * 64, project_id="proj-1"
                    ),
                    actor="test",
                ),
            ),
            (S.event_subject("key", "key-0000001"), NewEvent(payload=A.KeyRevoked(key_id="key-0000001"), actor="test")),
            (
                S.event_subject(R.AGGREGATE, "rep-00000000"),
                NewEvent(payload=R.ReplicaStopped(replica_id="rep-00000000", node_id="node-0000"), actor="test"),
            ),
        ]
    )
    return "sk-new", "sk-000000001"


async def test_a_router_started_after_a_snapshot_reaches_the_state_folded_from_0_reading_only_the_tail(
    store: EventStore, routers: list[Router], monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.append_many(list(realistic_log(LOG)))
    logged = await store.stream_last_seq()
    first = await _router(store, routers)
    await wait_until(
        lambda: first.fold.snapshotter is not None and first.fold.snapshotter.saves >= 1, what="a snapshot saved"
    )
    saved = await (await SnapshotStore.open(store.js)).load(RS.SNAPSHOT_NAME, RS.SNAPSHOT_VERSION)
    assert saved is not None
    at = saved[0]
    assert at == logged
    new, revoked = await _tail(store)
    assert revoked in RS.RouterState.decode(saved[1]).keys  # live in the snapshot: only the tail revokes it
    head = await store.stream_last_seq()

    applied = _counting(monkeypatch, RS.RouterState)
    second = await _router(store, routers)
    await wait_until(lambda: second.state.position >= head, what="the second router to read the tail")

    assert applied == list(range(at + 1, head + 1))  # the tail, and nothing before it
    assert new in second.state.keys and revoked not in second.state.keys
    monkeypatch.undo()
    reference = RS.RouterState()
    await _folded_from_0(store, reference)
    assert second.state.encode() == reference.encode()
    assert second.state.aliases == reference.aliases
    assert {m: [r.replica_id for r in second.state.ready(m)] for m in reference.models} == {
        m: [r.replica_id for r in reference.ready(m)] for m in reference.models
    }


async def test_the_scheduler_fold_started_from_its_snapshot_reaches_the_state_folded_from_0_reading_only_the_tail(
    store: EventStore,
) -> None:
    await store.append_many(list(realistic_log(LOG)))
    snapshots = await SnapshotStore.open(store.js)
    state = SS.ClusterState()
    saver = Snapshotter(
        snapshots, SS.SNAPSHOT_NAME, SS.SNAPSHOT_VERSION, state.encode, lambda: state.position, every_events=1
    )
    await _folded_from_0(store, state)
    saver.folded()
    await saver.flush()
    assert saver.saves == 1
    await _tail(store)
    head = await store.stream_last_seq()

    restored = await snapshots.restore(SS.SNAPSHOT_NAME, SS.SNAPSHOT_VERSION, SS.ClusterState.decode, head)
    assert restored is not None and restored.position == state.position
    started = restored.state
    applied: list[int] = []

    def apply(e: RecordedEvent) -> None:
        applied.append(e.seq)
        if e.subject.split(".")[2] in FOLDED:
            started.apply(e)

    fold = Follower(store, f"{S.EVENTS_ROOT}.>", apply, name="scheduler-test", after=restored.position).start()
    try:
        assert await fold.wait_caught_up(30)
    finally:
        await fold.close()
    started.position = fold.position

    assert applied == list(range(restored.position + 1, head + 1))
    assert started.replicas["rep-00000000"].state == "stopped"
    reference = SS.ClusterState()
    await _folded_from_0(store, reference)
    assert started.encode() == reference.encode()
    assert [r.id for r in started.replicas_on("node-0001")] == [r.id for r in reference.replicas_on("node-0001")]


async def test_a_scheduler_started_after_its_leaders_snapshot_reaches_the_state_folded_from_0_reading_only_the_tail(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.append_many(list(realistic_log(LOG)))
    first = SchedulerService(store, instance="first", lease_ttl_s=2.0, snapshot_every_events=EVERY, snapshot_every_s=0)
    running = asyncio.create_task(first.run())
    try:
        await wait_until(
            lambda: first.fold.snapshotter is not None and first.fold.snapshotter.saves >= 1,
            deadline_s=30,
            what="the leader's snapshot saved",
        )
    finally:
        first.stop()
        await running
    saved = await (await SnapshotStore.open(store.js)).load(SS.SNAPSHOT_NAME, SS.SNAPSHOT_VERSION)
    assert saved is not None
    at = saved[0]
    await _tail(store)
    head = await store.stream_last_seq()

    applied = _counting(monkeypatch, SS.ClusterState)
    # It saves nothing of its own (a trigger that never fires): what it folds is the only thing checked.
    second = SchedulerService(store, instance="second", lease_ttl_s=2.0, snapshot_every_events=2**40)
    running = asyncio.create_task(second.run())
    try:
        await wait_until(lambda: second.state.position >= head, deadline_s=30, what="the second to read the tail")
    finally:
        second.stop()
        await running

    assert applied and min(applied) > at  # only events after the snapshot were folded…
    assert second.state.replicas["rep-00000000"].state == "stopped"  # …the tail among them
    monkeypatch.undo()
    reference = SS.ClusterState()
    await _folded_to(store, reference, second.fold.position)
    assert second.state.encode() == reference.encode()


async def _started_from_0(store: EventStore, routers: list[Router], monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Start a router; assert it folded the whole log (it knows the log's keys); return the warnings."""
    head = await store.stream_last_seq()
    applied = _counting(monkeypatch, RS.RouterState)
    with capture_logs() as logs:
        router = await _router(store, routers)
    await wait_until(lambda: router.state.position >= head, what="the router to read the log")
    assert applied[0] == 1 and applied[-1] == head
    assert "sk-000000001" in router.state.keys  # made at the log's start: a fold from 0 knows it
    return [e for e in logs if e["log_level"] == "warning"]


async def test_a_snapshot_of_an_older_schema_version_is_ignored_and_the_router_folds_from_0(
    store: EventStore, routers: list[Router], monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.append_many(list(realistic_log(LOG)))
    head = await store.stream_last_seq()
    snapshots = await SnapshotStore.open(store.js)
    # An empty state at the head: trusted, it would know no key at all.
    await snapshots.save(RS.SNAPSHOT_NAME, RS.SNAPSHOT_VERSION - 1, head, RS.RouterState().encode())

    warnings = await _started_from_0(store, routers, monkeypatch)

    assert any("another schema version" in w["event"] for w in warnings), warnings


class _EarlierSnapshot(msgspec.Struct, kw_only=True):
    """A snapshot as written before states were compressed: the state's msgpack inline, no codec."""

    name: str
    schema_version: int
    position: int
    taken_at: float
    state: msgspec.Raw


def _snapshot_with(state: bytes, codec: str = CODEC) -> bytes:
    """A snapshot at the router's schema whose (compressed) state is ``state`` as given."""
    name, version = RS.SNAPSHOT_NAME, RS.SNAPSHOT_VERSION
    snap = Snapshot(name=name, schema_version=version, position=10, taken_at=0.0, codec=codec, state=state)
    return msgspec.msgpack.encode(snap)


_STATE = RS.RouterState().encode()  # an empty state: trusted, a router would know no key at all


@pytest.mark.parametrize(
    ("data", "why"),
    [
        pytest.param(b"\x93not a snapshot", "does not decode", id="bytes-that-are-no-snapshot"),
        pytest.param(
            encode_snapshot(RS.SNAPSHOT_NAME, RS.SNAPSHOT_VERSION, 10, msgspec.msgpack.encode({"keys": 3})),
            "does not decode",
            id="a-state-that-does-not-decode",
        ),
        pytest.param(
            msgspec.msgpack.encode(
                _EarlierSnapshot(
                    name=RS.SNAPSHOT_NAME,
                    schema_version=RS.SNAPSHOT_VERSION,
                    position=10,
                    taken_at=0.0,
                    state=msgspec.Raw(_STATE),
                )
            ),
            "does not decode",
            id="a-snapshot-of-the-earlier-uncompressed-format",
        ),
        pytest.param(_snapshot_with(b"not zlib at all"), "does not decompress", id="a-state-that-is-not-zlib"),
        pytest.param(
            _snapshot_with(zlib.compress(_STATE, 1)[:-8]), "does not decompress", id="a-compressed-state-cut-short"
        ),
        pytest.param(_snapshot_with(_STATE, codec="lz4"), "unknown codec", id="a-state-of-an-unknown-codec"),
    ],
)
async def test_a_corrupt_snapshot_is_ignored_logged_and_the_router_folds_from_0(
    store: EventStore, routers: list[Router], monkeypatch: pytest.MonkeyPatch, data: bytes, why: str
) -> None:
    await store.append_many(list(realistic_log(LOG)))
    snapshots = await SnapshotStore.open(store.js)
    await snapshots.objects.put(RS.SNAPSHOT_NAME, data)

    warnings = await _started_from_0(store, routers, monkeypatch)

    assert any(why in w["event"] for w in warnings), warnings


async def test_a_snapshot_of_many_chunks_is_stored_compressed_and_read_back_whole(store: EventStore) -> None:
    snapshots = await SnapshotStore.open(store.js)
    # Random bytes do not compress: the object is several of the store's chunks, read back in order.
    state = random.Random(7).randbytes(3 * 1024 * 1024)
    compressible = b"key-0000001 sk-000000001 proj-1 " * 100_000

    assert await snapshots.save("many", 1, 5, state) > 3 * 1024 * 1024
    assert (await snapshots.objects.get_info("many")).chunks > 1
    assert await snapshots.save("small", 1, 6, compressible) < len(compressible) // 10

    with capture_logs() as logs:
        assert await snapshots.load("many", 1) == (5, state)
        assert await snapshots.load("small", 1) == (6, compressible)
    assert not [e for e in logs if "direct read failed" in e["event"]], "read by direct gets, not again by get"


async def test_a_direct_read_whose_bytes_do_not_match_the_objects_digest_is_refused(store: EventStore) -> None:
    snapshots = await SnapshotStore.open(store.js)
    await snapshots.save("snap", 1, 5, b"state" * 1000)
    info = await snapshots.objects.get_info("snap")
    other = base64.urlsafe_b64encode(hashlib.sha256(b"other bytes").digest()).decode()

    assert await snapshots._read_direct(info)  # as stored: read
    with pytest.raises(ValueError, match="digest"):
        await snapshots._read_direct(dataclasses.replace(info, digest=f"SHA-256={other}"))


async def test_a_snapshot_whose_direct_read_fails_is_read_again_through_the_object_stores_get(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    snapshots = await SnapshotStore.open(store.js)
    state = random.Random(8).randbytes(2 * 1024 * 1024)
    await snapshots.save("snap", 1, 5, state)

    async def behind(self: SnapshotStore, info: object) -> bytes:
        raise ValueError("a replica behind: a chunk not found")

    monkeypatch.setattr(SnapshotStore, "_read_direct", behind)
    said: list[str] = []

    class Log:  # the module's logger, recorded whatever level an earlier test configured logging at
        def info(self, event: str, **_: object) -> None:
            said.append(event)

        warning = info

    monkeypatch.setattr(snapshots_module, "log", Log())
    assert await snapshots.load("snap", 1) == (5, state)
    assert any("direct read failed" in e for e in said), said


async def test_a_snapshot_past_the_logs_head_is_ignored_and_the_router_folds_from_0(
    store: EventStore, routers: list[Router], monkeypatch: pytest.MonkeyPatch
) -> None:
    await store.append_many(list(realistic_log(LOG)))
    snapshots = await SnapshotStore.open(store.js)
    # Saved over a log since deleted and begun again: its position is beyond this log's head.
    await snapshots.save(RS.SNAPSHOT_NAME, RS.SNAPSHOT_VERSION, LOG * 10, RS.RouterState().encode())

    warnings = await _started_from_0(store, routers, monkeypatch)

    assert any("past the log's head" in w["event"] for w in warnings), warnings


def test_bench_coldstart_prints_each_services_start_from_0_and_from_a_snapshot(tmp_path: Path) -> None:
    args = ["bench", "coldstart", "--events", "400", "--dir", str(tmp_path), "--json"]
    result = subprocess.run([LLMGW, *args], capture_output=True, text=True, timeout=240)

    assert result.returncode == 0, result.stderr
    (run,) = json.loads(result.stdout)["runs"]
    assert run["events"] == 400
    assert [s["service"] for s in run["starts"]] == ["router", "scheduler"]
    # 400 events is less than one snapshot interval: the snapshot is at 0 and the tail the whole log.
    assert all(s["tail_events"] == 400 and s["snapshot_bytes"] > 0 for s in run["starts"])
    assert not list(tmp_path.iterdir()), "the temporary server and its store are gone after the run"


def test_bench_coldstart_refuses_event_counts_that_are_not_numbers() -> None:
    result = CliRunner().invoke(main, ["bench", "coldstart", "--events", "lots"])

    assert result.exit_code == 2
    assert "--events takes event counts separated by commas, not 'lots'" in result.output


async def test_the_snapshot_store_is_listed_with_the_streams_whose_replicas_an_operator_sets(
    store: EventStore, routers: list[Router]
) -> None:
    await _router(store, routers)

    assert ("OBJ_llmgw_snapshots", 1) in await store.replica_counts()


async def test_a_scheduler_forgets_replicas_that_stopped_or_failed_long_ago_and_keeps_the_rest(
    store: EventStore,
) -> None:
    await store.append_many(list(realistic_log(LOG)))
    await _tail(store)  # rep-00000000 stopped
    reference = SS.ClusterState()
    await _folded_from_0(store, reference)
    inactive = {r.id for r in reference.replicas.values() if not r.active and r.state != "draining"}
    assert "rep-00000000" in inactive

    scheduler = SchedulerService(store, config=Config(forget_after_s=0.0), snapshot_every_events=0, snapshot_every_s=0)
    task = asyncio.create_task(scheduler.run())
    try:
        head = await store.stream_last_seq()
        await wait_until(lambda: scheduler.state.position >= head, deadline_s=30, what="the scheduler caught up")
        kept = set(scheduler.state.replicas)
        assert not kept & inactive
        assert {r.id for r in reference.replicas.values() if r.active} <= kept
    finally:
        scheduler.stop()
        await asyncio.wait_for(task, 30)
