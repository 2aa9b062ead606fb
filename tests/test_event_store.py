"""The event store against a real nats-server: appends, conflicts, duplicates, reads, poison."""

from __future__ import annotations

import asyncio

import pytest

from llmgw.events.runtime import reader
from llmgw.events.runtime.connection import Quarantined
from llmgw.events.runtime.store import AppendConflict, EventStore, NewEvent
from llmgw.events.runtime.waiter import EventWaiter
from llmgw.events.schema import subjects as S
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import event_subject
from llmgw.events.schema.tenancy import OrgCreated, OrgRenamed
from tests.support import NatsServer, wait_until

pytestmark = pytest.mark.asyncio


def org(i: int, **kw) -> NewEvent:
    return NewEvent(payload=OrgCreated(org_id=f"o{i}", name=f"org-{i}"), actor="user:test", **kw)


async def test_streams_are_created_idempotently(store: EventStore) -> None:
    await store.ensure_streams()
    await store.ensure_streams()
    names = {s.config.name for s in await store.js.streams_info()}
    assert {S.STREAM_EVENTS, S.STREAM_COMMANDS, S.STREAM_USAGE, S.STREAM_TELEMETRY, S.STREAM_QUARANTINE} <= names
    info = await store.js.stream_info(S.STREAM_EVENTS)
    assert info.config.num_replicas == 1


async def test_an_append_with_a_stale_expected_sequence_raises_a_conflict(store: EventStore) -> None:
    subject = event_subject("tenancy", "t1")
    first = await store.append(subject, [org(1)], expected=0)
    with pytest.raises(AppendConflict) as caught:
        await store.append(subject, [org(2)], expected=0)
    assert caught.value.actual == first.last_seq
    assert "re-read" in str(caught.value)
    # Re-read and re-decide: the append with the right expectation goes through.
    await store.append(subject, [org(2)], expected=await store.last_seq(subject))
    assert [e.payload.org_id for e in await store.read(subject)] == ["o1", "o2"]


async def test_a_conflict_on_a_multi_event_append_writes_none_of_them(store: EventStore) -> None:
    subject = event_subject("tenancy", "t2")
    await store.append(subject, [org(1)], expected=0)
    with pytest.raises(AppendConflict):
        await store.append(subject, [org(2), org(3), org(4)], expected=0)
    assert len(await store.read(subject)) == 1


async def test_a_duplicate_append_is_stored_once(store: EventStore) -> None:
    subject = event_subject("tenancy", "t3")
    event = org(1)
    a = await store.append(subject, [event])
    b = await store.append(subject, [event])
    assert b.duplicate and b.last_seq == a.last_seq
    batch = [org(2), org(3)]
    await store.append(subject, batch)
    again = await store.append(subject, batch)
    assert again.duplicate
    assert [e.payload.org_id for e in await store.read(subject)] == ["o1", "o2", "o3"]


async def test_an_aggregate_history_is_read_in_order_with_its_envelopes(store: EventStore) -> None:
    subject = event_subject("tenancy", "t4")
    other = event_subject("tenancy", "t5")
    await store.append(subject, [org(1, causation="cmd-1", correlation="req-1")])
    await store.append(other, [org(9)])
    await store.append(
        subject, [NewEvent(payload=OrgRenamed(org_id="o1", old_name="org-1", name="acme"), actor="user:b")]
    )
    history = await store.read(subject)
    assert [e.type for e in history] == ["org.created", "org.renamed"]
    assert history[0].envelope.causation == "cmd-1" and history[0].envelope.correlation == "req-1"
    assert history[1].envelope.actor == "user:b"
    assert history[0].seq < history[1].seq
    assert await store.read(event_subject("tenancy", "never-written")) == []
    assert [e.type for e in await store.read(subject, after=history[0].seq)] == ["org.renamed"]


async def test_a_subscriber_from_a_sequence_gets_what_follows_and_then_what_arrives(store: EventStore) -> None:
    subject = event_subject("tenancy", "t6")
    r = await store.append_many([(subject, org(i)) for i in range(10)])
    got: list[int] = []

    async def follow() -> None:
        async for batch in store.subscribe(after=r - 5):
            got.extend(e.seq for e in batch)
            if len(got) >= 7:
                return

    task = asyncio.create_task(follow())
    await store.append(subject, [org(100), org(101)])
    await asyncio.wait_for(task, 15)
    assert got == list(range(r - 4, r + 3))


async def test_a_poison_message_is_quarantined_and_reading_goes_on(store: EventStore) -> None:
    subject = event_subject("tenancy", "t7")
    await store.append(subject, [org(1)])
    bad_seq = await store.publish_raw(subject, b"\x00 not an event")
    await store.append(subject, [org(2)])
    items = [i async for b in store.subscribe(subject, follow=False) for i in b]
    assert [type(i) for i in items] == [RecordedEvent, Quarantined, RecordedEvent]
    assert items[1].seq == bad_seq
    kept = await store.js.get_last_msg(S.STREAM_QUARANTINE, f"{S.QUARANTINE_ROOT}.llmgw_events")
    assert kept.data == b"\x00 not an event"
    assert kept.headers["Llmgw-Origin-Seq"] == str(bad_seq)
    assert store.metrics.quarantined.labels(stream=S.STREAM_EVENTS)._value.get() == 1
    # A second reader quarantines it again, but it is kept once.
    [i async for b in store.subscribe(subject, follow=False) for i in b]
    info = await store.js.stream_info(S.STREAM_QUARANTINE)
    assert info.state.messages == 1


# -- following with a deadline (events/runtime/waiter.py) ------------------------------------------------


async def test_a_follower_hears_each_subject_from_its_position_and_new_events_as_they_are_written(
    store: EventStore,
) -> None:

    a, b = event_subject("tenancy", "fa"), event_subject("tenancy", "fb")
    first = await store.append(a, [org(1)])
    await store.append(b, [org(2)])
    async with EventWaiter(store, {a: first.last_seq, b: 0}) as follower:
        got = await follower.next(10)
        assert got is not None and got.payload.org_id == "o2", "a's event at its position is not repeated"
        assert await follower.next(0.05) is None, "nothing more was written: the wait ends empty-handed"
        await store.append(a, [org(3)])
        later = await follower.next(10)
        assert later is not None and later.payload.org_id == "o3" and later.subject == a


async def test_a_follower_whose_consumer_vanishes_reads_on_from_where_it_was(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A restarted nats-server keeps no reader consumers (they live in memory), and an operator
    may delete one: the server then never answers the reader, which must notice and read on."""

    monkeypatch.setattr(reader, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(reader, "SILENCE_S", 0.6)
    subject = event_subject("tenancy", "fc")
    await store.append(subject, [org(1)])
    async with EventWaiter(store, {subject: 0}) as follower:
        first = await follower.next(10)
        assert first is not None and first.payload.org_id == "o1"
        consumers = await wait_until(lambda: store.js.consumers_info(store.stream), what="the follower's consumer")
        for c in consumers:
            await store.js.delete_consumer(store.stream, c.name)
        await store.append(subject, [org(2)])
        second = await follower.next(30)
        assert second is not None and second.payload.org_id == "o2", "the event after the loss arrives"
        assert await follower.next(0.3) is None, "and nothing is delivered twice"


async def test_a_follower_reads_on_after_the_nats_server_restarts(
    nats: NatsServer, monkeypatch: pytest.MonkeyPatch
) -> None:

    monkeypatch.setattr(reader, "HEARTBEAT_S", 0.2)
    monkeypatch.setattr(reader, "SILENCE_S", 0.6)
    store = await EventStore.connect(nats.url, default_registry())
    try:
        await store.ensure_streams()
        subject = event_subject("tenancy", "fr")
        await store.append(subject, [org(1)])
        async with EventWaiter(store, {subject: 0}) as follower:
            assert (await follower.next(10)) is not None
            nats.stop()  # its reader consumers lived in memory: the restarted server has none
            nats.start()
            await wait_until(lambda: store.nc.is_connected, deadline_s=30, what="the client to reconnect")
            event = org(2)  # one event, tried until an append goes through: stored once however many tries
            await wait_until(
                lambda: _appended(store, subject, event), deadline_s=30, what="an append after the restart"
            )
            second = await follower.next(30)
            assert second is not None and second.payload.org_id == "o2", "the event written after the restart arrives"
            assert await follower.next(0.3) is None
    finally:
        await store.close()


async def _appended(store: EventStore, subject: str, event: NewEvent) -> bool:
    try:
        await store.append(subject, [event])
    except Exception:
        return False
    return True


async def test_the_position_at_a_moment_is_the_last_event_stamped_at_or_before_it(store: EventStore) -> None:
    from datetime import timedelta

    from llmgw.projections.replay import position_at

    seqs = [(await store.append(event_subject("tenancy", f"p{i}"), [org(i)])).last_seq for i in range(7)]
    stamps = [(await store.js.get_msg(store.stream, s, direct=True)).time for s in seqs]
    for seq, stamped in zip(seqs, stamps, strict=True):
        assert await position_at(store, stamped) == (seq, stamped)
    third = stamps[3]
    if stamps[2] < third:  # two events may share a stamp; then "just before" is the one before both
        assert (await position_at(store, third - timedelta(microseconds=1)))[0] == seqs[2]
    assert await position_at(store, stamps[0] - timedelta(days=1)) == (0, None)
    assert (await position_at(store, stamps[-1] + timedelta(days=1)))[0] == seqs[-1]
