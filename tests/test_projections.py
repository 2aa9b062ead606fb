"""The projection runner, rebuild and verify: one contract suite, run on SQLite and on PostgreSQL.

Two test-only projections over test-only event types: ``counters`` counts events per key (so an
event applied twice shows as a wrong count) and ``inventory`` keeps items plus a per-name tally
that needs read-modify-write (so buffered writes must be visible to later reads).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import subjects as S
from llmgw.events.schema.catalog import all_event_types
from llmgw.events.schema.codec import encode_envelope
from llmgw.events.schema.envelope import Envelope, RecordedEvent, utc_now
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.registry import EventRegistry, EventType
from llmgw.events.schema.tenancy import OrgCreated
from llmgw.projections.apply import (
    claim_checkpoint,
    commit_batch,
    create_tables,
    ensure_checkpoints,
    read_checkpoint,
    set_checkpoint,
)
from llmgw.projections.backends import Backend, Transaction, open_backend
from llmgw.projections.base import Projection, Tx
from llmgw.projections.metrics import ProjectionMetrics
from llmgw.projections.rebuild import rebuild, verify
from llmgw.projections.runner import ProjectionFailed, ProjectionRunner
from tests.support import NatsServer, wait_until

ACTOR = "svc:test"

# -- test events ---------------------------------------------------------------------------------


class Counted(msgspec.Struct, frozen=True, kw_only=True):
    key: str
    amount: int = 1


class ItemSet(msgspec.Struct, frozen=True, kw_only=True):
    item_id: str
    name: str
    qty: int


class ItemBumped(msgspec.Struct, frozen=True, kw_only=True):
    item_id: str
    by: int


class ItemDeleted(msgspec.Struct, frozen=True, kw_only=True):
    item_id: str


TEST_TYPES = [
    EventType("test.counted", 1, Counted),
    EventType("test.item.set", 1, ItemSet),
    EventType("test.item.bumped", 1, ItemBumped),
    EventType("test.item.deleted", 1, ItemDeleted),
]


def ctr(key: str) -> str:
    return S.event_subject("testctr", key)


def item(item_id: str) -> str:
    return S.event_subject("testitem", item_id)


# -- test projections ----------------------------------------------------------------------------

_COUNT = (
    "INSERT INTO {counts} (key, n, total, last_seq) VALUES (?, 1, ?, ?) ON CONFLICT (key) DO UPDATE"
    " SET n = {counts}.n + 1, total = {counts}.total + excluded.total, last_seq = excluded.last_seq"
)


class Counters(Projection):
    """Counts events per key. ``stop_at`` names a key whose event stops the batch mid-way."""

    name = "counters"
    subject = f"{S.EVENTS_ROOT}.testctr.>"
    tables = {"counts": "key TEXT NOT NULL, n BIGINT NOT NULL, total BIGINT NOT NULL, last_seq BIGINT NOT NULL"}
    primary_keys = {"counts": ["key"]}
    handlers = {"test.counted": "counted"}

    def __init__(self, stop_at: str | None = None, how: str = "raise") -> None:
        self.stop_at = stop_at
        self.how = how  # raise: the handler fails; hang: it waits until the runner is killed
        self.in_tx_totals: list[int] = []  # rows counted inside the transaction when it stopped
        self.stopped = asyncio.Event()

    async def counted(self, tx: Tx, event: RecordedEvent) -> None:
        p = event.payload
        await tx.execute(_COUNT, p.key, p.amount, event.seq)
        if p.key == self.stop_at:
            # Reading flushes the buffered writes: the batch's rows are now really in the transaction.
            row = await tx.fetchone("SELECT SUM(n) FROM {counts}")
            assert row is not None
            self.in_tx_totals.append(int(row[0]))
            self.stopped.set()
            if self.how == "hang":
                await asyncio.Event().wait()  # until the runner is stopped (cancelled) around us
            raise RuntimeError(f"simulated crash at {event.seq}")


class Inventory(Projection):
    name = "inventory"
    subject = f"{S.EVENTS_ROOT}.testitem.>"
    version = 1
    tables = {
        "items": "item_id TEXT NOT NULL, name TEXT NOT NULL, qty BIGINT NOT NULL, updated_seq BIGINT NOT NULL",
        "names": "name TEXT NOT NULL, items BIGINT NOT NULL",
    }
    primary_keys = {"items": ["item_id"], "names": ["name"]}
    indexes = {"items": [["name"]]}
    handlers = {"test.item.set": "item_set", "test.item.bumped": "bumped", "test.item.deleted": "deleted"}

    async def _tally(self, tx: Tx, name: str, by: int) -> None:
        await tx.execute(
            "INSERT INTO {names} (name, items) VALUES (?, ?) ON CONFLICT (name) DO UPDATE"
            " SET items = {names}.items + excluded.items",
            name,
            by,
        )
        await tx.execute("DELETE FROM {names} WHERE name = ? AND items = 0", name)

    async def item_set(self, tx: Tx, e: RecordedEvent) -> None:
        p = e.payload
        old = await tx.fetchone("SELECT name FROM {items} WHERE item_id = ?", p.item_id)
        await tx.execute(
            "INSERT INTO {items} (item_id, name, qty, updated_seq) VALUES (?, ?, ?, ?) ON CONFLICT (item_id)"
            " DO UPDATE SET name = excluded.name, qty = excluded.qty, updated_seq = excluded.updated_seq",
            p.item_id,
            p.name,
            p.qty,
            e.seq,
        )
        if old is None or old[0] != p.name:
            if old is not None:
                await self._tally(tx, old[0], -1)
            await self._tally(tx, p.name, 1)

    async def bumped(self, tx: Tx, e: RecordedEvent) -> None:
        p = e.payload
        await tx.execute("UPDATE {items} SET qty = qty + ?, updated_seq = ? WHERE item_id = ?", p.by, e.seq, p.item_id)

    async def deleted(self, tx: Tx, e: RecordedEvent) -> None:
        old = await tx.fetchone("SELECT name FROM {items} WHERE item_id = ?", e.payload.item_id)
        if old is not None:
            await tx.execute("DELETE FROM {items} WHERE item_id = ?", e.payload.item_id)
            await self._tally(tx, old[0], -1)


class InventoryV2(Inventory):
    """The same fold with a new column: a new version, so the runner rebuilds it on start."""

    version = 2
    tables = {**Inventory.tables, "items": Inventory.tables["items"] + ", note TEXT"}


class InventoryModel:
    """What the inventory tables must hold, folded in plain Python."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[str, int]] = {}

    def events(self, rng: random.Random, n: int, ids: int = 150) -> list[tuple[str, NewEvent]]:
        out: list[tuple[str, NewEvent]] = []
        for _ in range(n):
            item_id = f"item-{rng.randrange(ids)}"
            roll = rng.random()
            if item_id in self.items and roll < 0.35:
                by = rng.randint(-5, 9)
                name, qty = self.items[item_id]
                self.items[item_id] = (name, qty + by)
                payload: msgspec.Struct = ItemBumped(item_id=item_id, by=by)
            elif item_id in self.items and roll < 0.55:
                del self.items[item_id]
                payload = ItemDeleted(item_id=item_id)
            else:
                name, qty = f"name-{rng.randrange(12)}", rng.randint(0, 100)
                self.items[item_id] = (name, qty)
                payload = ItemSet(item_id=item_id, name=name, qty=qty)
            out.append((item(item_id), NewEvent(payload=payload, actor=ACTOR)))
        return out

    def rows(self) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        items = sorted((k, name, qty) for k, (name, qty) in self.items.items())
        tally: dict[str, int] = {}
        for name, _ in self.items.values():
            tally[name] = tally.get(name, 0) + 1
        return items, sorted(tally.items())


# -- fixtures and helpers ------------------------------------------------------------------------


@pytest.fixture
async def es(nats: NatsServer) -> AsyncIterator[EventStore]:
    """An event store whose registry also knows the test event types."""
    store = await EventStore.connect(nats.url, EventRegistry(all_event_types() + TEST_TYPES))
    await store.ensure_streams()
    yield store
    await store.close()


@pytest.fixture
async def backend(db_dsn: str) -> AsyncIterator[Backend]:
    b = await open_backend(db_dsn)
    yield b
    await b.close()


def runner_for(es: EventStore, backend: Backend, *projections: Projection, **kwargs: Any) -> ProjectionRunner:
    kwargs.setdefault("metrics", ProjectionMetrics(CollectorRegistry()))
    return ProjectionRunner(es, backend, list(projections), lag_interval_s=None, **kwargs)


async def count_events(es: EventStore, keys: list[str], amount: int = 1) -> int:
    """One ``test.counted`` per key, in order; the last sequence."""
    return await es.append_many([(ctr(k), NewEvent(payload=Counted(key=k, amount=amount), actor=ACTOR)) for k in keys])


async def counts(backend: Backend) -> dict[str, int]:
    return {k: int(n) for k, n in await backend.query("counters", "SELECT key, n FROM {counts}")}


async def checkpoint(backend: Backend, name: str) -> int:
    found = await read_checkpoint(backend, name)
    return 0 if found is None else found.position


def raw_envelope(event_type: str, data: dict[str, Any], v: int = 1) -> bytes:
    env = Envelope(
        id=new_id(), type=event_type, v=v, at=utc_now(), actor=ACTOR, data=msgspec.Raw(msgspec.json.encode(data))
    )
    return encode_envelope(env)


def sample(metrics: ProjectionMetrics, name: str, projection: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"projection": projection})


async def inventory_rows(backend: Backend) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
    items = await backend.query("inventory", "SELECT item_id, name, qty FROM {items} ORDER BY item_id")
    names = await backend.query("inventory", "SELECT name, items FROM {names} ORDER BY name")
    return [(a, b, int(c)) for a, b, c in items], [(a, int(b)) for a, b in names]


# -- the runner ----------------------------------------------------------------------------------


async def test_the_runner_applies_events_and_its_checkpoint_reaches_the_last_sequence(
    es: EventStore, backend: Backend
) -> None:
    keys = [f"k{i % 7}" for i in range(700)]
    metrics = ProjectionMetrics(CollectorRegistry())
    async with runner_for(es, backend, Counters(), batch_size=100, metrics=metrics) as runner:
        # Asked before the events exist: it returns once they are applied, not before.
        waiter = asyncio.create_task(runner.wait_until("counters", 700, timeout=15))
        last = await count_events(es, keys)
        assert last == 700
        assert await waiter is True
        assert runner.position("counters") == last
        assert await checkpoint(backend, "counters") == last
        assert await counts(backend) == {f"k{i}": 100 for i in range(7)}

        # A position not reached yet: False at the deadline, without an error.
        assert await runner.wait_until("counters", last + 1, timeout=0.2) is False
        # A position whose event is on a subject the projection does not read: already there.
        other = await es.append_many([(item("x"), NewEvent(payload=ItemDeleted(item_id="x"), actor=ACTOR))])
        assert await runner.wait_until("counters", other, timeout=5) is True

        await runner.refresh_lag()
        assert sample(metrics, "llmgw_projection_position", "counters") == last
        assert sample(metrics, "llmgw_projection_applied_events_total", "counters") == 700
        assert sample(metrics, "llmgw_projection_lag_events", "counters") == 0
        assert sample(metrics, "llmgw_projection_errors_total", "counters") == 0
        state = runner.state("counters")
        assert (state.status, state.position, state.error) == ("running", last, None)


async def test_a_runner_killed_mid_transaction_resumes_without_applying_anything_twice(
    es: EventStore, db_dsn: str
) -> None:
    keys = [f"k{i % 5}" for i in range(100)] + ["stop"] + [f"k{i % 5}" for i in range(40)]
    last = await count_events(es, keys)
    backend = await open_backend(db_dsn)
    hanging = Counters(stop_at="stop", how="hang")
    runner = runner_for(es, backend, hanging, batch_size=30)
    await runner.start()
    await asyncio.wait_for(hanging.stopped.wait(), 15)
    committed = await counts(backend)
    # Rows were written in the open transaction beyond what is committed: the kill lands in between.
    assert hanging.in_tx_totals[0] > sum(committed.values())
    assert sum(committed.values()) == await checkpoint(backend, "counters")
    await runner.stop()  # the kill: the task is cancelled inside the transaction
    await backend.close()

    # A new process on the same database carries on from the checkpoint.
    backend = await open_backend(db_dsn)
    try:
        async with runner_for(es, backend, Counters(), batch_size=30) as runner:
            assert await runner.wait_until("counters", last, timeout=15)
        assert await counts(backend) == {**{f"k{i}": 28 for i in range(5)}, "stop": 1}
        assert await checkpoint(backend, "counters") == last
    finally:
        await backend.close()


async def test_two_runners_on_one_database_never_apply_an_event_twice(es: EventStore, db_dsn: str) -> None:
    """Two processes running the same projection: the checkpoint's compare-and-set lets one win each batch."""
    keys = [f"k{i % 3}" for i in range(900)]
    first, second = await open_backend(db_dsn), await open_backend(db_dsn)
    try:
        async with (
            runner_for(es, first, Counters(), batch_size=50) as a,
            runner_for(es, second, Counters(), batch_size=50) as b,
        ):
            last = await count_events(es, keys)
            assert await a.wait_until("counters", last, timeout=30)
            assert await b.wait_until("counters", last, timeout=30)
            assert a.state("counters").applied + b.state("counters").applied >= len(keys)
        assert await counts(first) == {"k0": 300, "k1": 300, "k2": 300}
        assert await checkpoint(first, "counters") == last
    finally:
        await first.close()
        await second.close()


async def test_a_handler_error_stops_the_projection_visibly_and_a_fixed_runner_resumes_exactly(
    es: EventStore, backend: Backend
) -> None:
    keys = [f"k{i % 4}" for i in range(80)] + ["stop"] + [f"k{i % 4}" for i in range(20)]
    last = await count_events(es, keys)
    stop_seq = 81
    metrics = ProjectionMetrics(CollectorRegistry())
    failing = Counters(stop_at="stop")
    async with runner_for(es, backend, failing, batch_size=25, metrics=metrics) as runner:
        with pytest.raises(ProjectionFailed, match="simulated crash at 81"):
            await runner.wait_until("counters", last, timeout=15)
        state = runner.state("counters")
        assert state.status == "failed"
        assert state.failed_seq == stop_seq
        assert "simulated crash" in (state.error or "")
        # Rows of the failing batch were in its transaction, and none of them stayed.
        assert failing.in_tx_totals and max(failing.in_tx_totals) > state.position
        assert state.position < stop_seq
        assert sum((await counts(backend)).values()) == state.position == await checkpoint(backend, "counters")
        assert (sample(metrics, "llmgw_projection_errors_total", "counters") or 0) >= 1
        assert sample(metrics, "llmgw_projection_failed", "counters") == 1

    # The handler is fixed: a new runner resumes from the checkpoint and every count is exact.
    async with runner_for(es, backend, Counters(), batch_size=25) as runner:
        assert await runner.wait_until("counters", last, timeout=15)
    assert await counts(backend) == {**{f"k{i}": 25 for i in range(4)}, "stop": 1}


async def test_a_poison_message_is_quarantined_while_the_next_good_event_is_applied(
    es: EventStore, backend: Backend
) -> None:
    async with runner_for(es, backend, Counters()) as runner:
        first = await count_events(es, ["a"])
        poison = await es.publish_raw(ctr("a"), b"\x00 this is not an event {")
        bad_payload = await es.publish_raw(ctr("a"), raw_envelope("test.counted", {"key": 5}))
        good = await count_events(es, ["a"])
        assert first < poison < bad_payload < good
        assert await runner.wait_until("counters", good, timeout=15)
        assert await counts(backend) == {"a": 2}
        assert runner.state("counters").status == "running"

    info = await es.js.stream_info(S.STREAM_QUARANTINE)
    assert info.state.messages == 2
    kept = await es.js.get_msg(S.STREAM_QUARANTINE, info.state.first_seq)
    assert kept.data == b"\x00 this is not an event {"
    assert kept.headers["Llmgw-Origin-Seq"] == str(poison)


async def test_unknown_event_types_are_skipped_and_the_position_still_advances(
    es: EventStore, backend: Backend
) -> None:
    async with runner_for(es, backend, Counters()) as runner:
        await es.publish_raw(ctr("a"), raw_envelope("test.from.the.future", {"anything": [1, 2]}))
        await es.publish_raw(ctr("a"), raw_envelope("test.counted", {"key": "a", "newer": True}, v=9))
        await es.append_many([(ctr("a"), NewEvent(payload=OrgCreated(org_id="o1", name="acme"), actor=ACTOR))])
        good = await count_events(es, ["a"])
        assert await runner.wait_until("counters", good, timeout=15)
        assert await counts(backend) == {"a": 1}
        # Even when the unknown event is the last one, the checkpoint moves onto it.
        unknown_last = await es.publish_raw(ctr("b"), raw_envelope("test.from.the.future", {}))
        assert await runner.wait_until("counters", unknown_last, timeout=15)
        assert await checkpoint(backend, "counters") == unknown_last
        assert await counts(backend) == {"a": 1}
        assert runner.state("counters").status == "running"


# -- rebuild and verify --------------------------------------------------------------------------


async def test_rebuild_and_verify_agree_with_the_live_tables_after_thousands_of_mixed_events(
    es: EventStore, backend: Backend
) -> None:
    rng = random.Random(7)
    model = InventoryModel()
    last = await es.append_many(model.events(rng, 3000))
    async with runner_for(es, backend, Inventory(), batch_size=500) as runner:
        assert await runner.wait_until("inventory", last, timeout=30)
        assert await inventory_rows(backend) == model.rows()

        result = await verify(es, backend, Inventory(), runner=runner)
        assert result.identical, result.lines()
        assert result.position == last

        # Rebuild while new events keep arriving: the live runner is paused only for the swap.
        more = asyncio.create_task(es.append_many(model.events(rng, 400)))
        rebuilt = await rebuild(es, backend, Inventory(), runner=runner)
        last = await more
        assert rebuilt.position >= 3000 and rebuilt.events >= 3000
        assert await runner.wait_until("inventory", last, timeout=30)
        assert await inventory_rows(backend) == model.rows()
        assert (await verify(es, backend, Inventory(), runner=runner)).identical

        # Tamper with one live row behind the projection's back: verify names exactly that row.
        victim = sorted(model.items)[0]
        async with backend.transaction("inventory") as tx:
            await tx.execute("UPDATE {items} SET qty = qty + 1000 WHERE item_id = ?", victim)
        tampered = await verify(es, backend, Inventory(), runner=runner)
        assert not tampered.identical
        assert list(tampered.differences) == ["items"]
        diff = tampered.differences["items"]
        assert (diff.only_live, diff.only_rebuilt, len(diff.changed)) == ([], [], 1)
        change = diff.changed[0]
        assert change.key == (victim,)
        name, qty = model.items[victim]
        assert change.rebuilt[:3] == (victim, name, qty)
        assert change.live[:3] == (victim, name, qty + 1000)
        # The result also reads as JSON-ready mapping (the admin API sends it as is).
        as_json = {"name": "inventory", **tampered}
        assert list(as_json["differences"]["items"]["changed"][0]["live"][:3]) == [victim, name, qty + 1000]
        assert victim in "\n".join(tampered.lines())

        # A rebuild repairs it; verify's shadow tables are gone afterwards.
        await rebuild(es, backend, Inventory(), runner=runner)
        assert (await verify(es, backend, Inventory(), runner=runner)).identical
    leftovers = await backend.query("inventory", "SELECT COUNT(*) FROM {items}")
    assert int(leftovers[0][0]) == len(model.items)
    async with backend.transaction() as tx:
        assert await tx.columns("inventory_items__shadow") == []


async def test_rebuild_without_a_runner_and_a_new_version_rebuilds_on_start(es: EventStore, backend: Backend) -> None:
    rng = random.Random(11)
    model = InventoryModel()
    last = await es.append_many(model.events(rng, 600))
    result = await rebuild(es, backend, Inventory())
    assert result.position == last
    assert await checkpoint(backend, "inventory") == last
    assert await inventory_rows(backend) == model.rows()

    last = await es.append_many(model.events(rng, 100))
    async with runner_for(es, backend, InventoryV2()) as runner:
        assert await runner.wait_until("inventory", last, timeout=30)
        assert await inventory_rows(backend) == model.rows()
        async with backend.transaction() as tx:
            assert "note" in await tx.columns("inventory_items")
        assert (await read_checkpoint(backend, "inventory")).version == 2  # type: ignore[union-attr]
        assert (await verify(es, backend, InventoryV2(), runner=runner)).identical


async def test_wait_until_reports_a_stopped_projection_only_after_its_restart_catches_up(
    es: EventStore, backend: Backend
) -> None:
    failing = Counters(stop_at="stop")
    async with runner_for(es, backend, failing) as runner:
        last = await count_events(es, ["a", "stop", "b"])
        with pytest.raises(ProjectionFailed):
            await runner.wait_until("counters", last, timeout=15)
        failing.stop_at = None  # the fix, deployed
        await runner.restart("counters")
        assert await runner.wait_until("counters", last, timeout=15)
        assert await counts(backend) == {"a": 1, "stop": 1, "b": 1}
        await wait_until(lambda: runner.state("counters").status == "running", what="status back to running")


# -- throughput ----------------------------------------------------------------------------------


async def test_batches_applied_again_from_a_reset_checkpoint_give_exact_counts(backend: Backend) -> None:
    """Applying (decoded events → rows + checkpoint, one transaction per batch of 1,000), without the bus.
    Speed is measured by `llmgw bench backbone`, never asserted here."""
    projection = Counters()
    async with backend.transaction() as tx:
        await create_tables(tx, projection)
    at = utc_now()
    n = 10_000
    events = [
        RecordedEvent(
            envelope=Envelope(id=f"e{seq}", type="test.counted", at=at, actor=ACTOR),
            payload=Counted(key=f"k{seq % 500}"),
            subject=ctr(f"k{seq % 500}"),
            seq=seq,
        )
        for seq in range(1, n + 1)
    ]
    await ensure_checkpoints(backend)
    for _ in range(3):  # three times over: each pass starts from a reset table and checkpoint
        async with backend.transaction() as tx:
            await tx.execute("DELETE FROM counters_counts")
            await set_checkpoint(tx, "counters", 0, 1)
        for i in range(0, n, 1000):

            async def claim(tx: Transaction, i: int = i) -> None:
                assert await claim_checkpoint(tx, "counters", i, i + 1000, 1)

            await commit_batch(backend, projection, events[i : i + 1000], before=claim)
        assert await counts(backend) == {f"k{i}": n // 500 for i in range(500)}


def test_the_api_shows_flags_as_booleans_not_the_0_and_1_they_are_stored_as() -> None:
    from llmgw.services.api.views import shape_model, shape_node

    node = shape_node(
        {"id": "n1", "gpus": "[]", "labels": "{}", "engines": "llamacpp", "cordoned": 1, "draining": 0}, []
    )
    assert node["cordoned"] is True and node["draining"] is False
    model = shape_model(
        {
            "name": "m", "spec": '{"source": "/m.gguf"}', "declared": 0, "min_replicas": 1, "max_replicas": 1,
            "stopped": 0, "parked": None, "failures": 0, "last_error": None, "unplaceable": None, "spec_hash": "h",
        },
        [],
    )  # fmt: skip
    assert model["stopped"] is False and model["declared"] is False


async def test_an_older_release_s_runner_stands_down_once_a_newer_one_rebuilt_its_projection(
    es: EventStore, db_dsn: str
) -> None:
    """A rolling upgrade: both releases run the projection on one database for a while. Once the newer
    has rebuilt it at its version, the older writes nothing more to it (its code does not know the new
    tables) and says so; the newer keeps it exact."""
    rng = random.Random(5)
    model = InventoryModel()
    old_db, new_db = await open_backend(db_dsn), await open_backend(db_dsn)
    try:
        async with runner_for(es, old_db, Inventory()) as old:
            last = await es.append_many(model.events(rng, 200))
            assert await old.wait_until("inventory", last, timeout=30)
            async with runner_for(es, new_db, InventoryV2()) as new:
                assert await new.wait_until("inventory", last, timeout=30)
                last = await es.append_many(model.events(rng, 200))
                assert await new.wait_until("inventory", last, timeout=30)
                await wait_until(lambda: old.state("inventory").status == "superseded", what="the older to stand down")
                assert "is at version 2 (written by another release of llmgw)" in str(old.state("inventory").error)
                assert await inventory_rows(new_db) == model.rows()
                assert (await read_checkpoint(new_db, "inventory")).version == 2  # type: ignore[union-attr]
    finally:
        await old_db.close()
        await new_db.close()
