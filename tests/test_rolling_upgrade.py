"""A rolling upgrade (OPS-5): for a while an older and a newer version read and write the same log.

Two versions of the event registry stand for the two releases: the newer one knows an event type
the older does not, and a second version of a type the older knows at v1. With a real nats-server:
what the newer writes, the older passes over without failing (kept raw, never lost: the log holds
the bytes); the newer reads what the older wrote, upcast; and a snapshot the older saved after
passing over events it could not read is not where the newer starts, or it would never fold them.
"""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from llmgw.events.runtime.follower import Follower
from llmgw.events.runtime.snapshots import SnapshotStore
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema.catalog import all_event_types, default_registry
from llmgw.events.schema.envelope import RecordedEvent, UnknownPayload
from llmgw.events.schema.registry import EventRegistry, EventType
from llmgw.events.schema.subjects import event_subject
from tests.support import NatsServer

pytestmark = pytest.mark.asyncio


class NodeNamed(msgspec.Struct, frozen=True, kw_only=True):
    """A type only the newer release has."""

    node_id: str
    name: str


class NoteV1(msgspec.Struct, frozen=True, kw_only=True):
    text: str


class NoteV2(msgspec.Struct, frozen=True, kw_only=True):
    """The newer release's shape of ``test.note``: the text split in two."""

    title: str
    body: str = ""


def _note_v1_to_v2(data: dict[str, Any]) -> dict[str, Any]:
    title, _, body = data["text"].partition("\n")
    return {"title": title, "body": body}


def older() -> EventRegistry:
    return EventRegistry([*all_event_types(), EventType("test.note", 1, NoteV1, "a note")])


def newer() -> EventRegistry:
    registry = EventRegistry(
        [*all_event_types(), EventType("test.note", 2, NoteV2, "a note"), EventType("test.node_named", 1, NodeNamed)]
    )
    registry.add_upcaster("test.note", 1, _note_v1_to_v2)
    return registry


SUBJECT = event_subject("test", "one")


class Seen:
    """A fold that keeps what it was handed."""

    def __init__(self) -> None:
        self.payloads: list[msgspec.Struct] = []
        self.position = 0

    def apply(self, event: RecordedEvent) -> None:
        self.payloads.append(event.payload)


async def fold_all(store: EventStore, name: str, fold: Seen, **kw: Any) -> Follower:
    live = Follower(store, "llmgw.evt.test.>", fold, name=name, **kw).start()
    assert await live.wait_caught_up(20), f"the {name} fold caught up"
    return live


async def test_events_of_a_newer_release_are_passed_over_by_an_older_one_and_read_by_the_newer(
    nats: NatsServer,
) -> None:
    old = await EventStore.connect(nats.url, older())
    new = await EventStore.connect(nats.url, newer())
    try:
        await old.ensure_streams()
        await old.append(SUBJECT, [NewEvent(payload=NoteV1(text="hello\nworld"), actor="user:old")])
        await new.append(
            SUBJECT,
            [
                NewEvent(payload=NoteV2(title="hi", body="there"), actor="user:new"),
                NewEvent(payload=NodeNamed(node_id="n1", name="rack-1"), actor="user:new"),
            ],
        )
        old_fold, new_fold = Seen(), Seen()
        old_live = await fold_all(old, "old", old_fold)
        new_live = await fold_all(new, "new", new_fold)
        try:
            # The older release folds what it knows and passes over the rest, kept raw, without failing.
            assert old_fold.payloads[0] == NoteV1(text="hello\nworld")
            assert [type(p) for p in old_fold.payloads[1:]] == [UnknownPayload, UnknownPayload]
            assert old_live.quarantined == 0 and old_live.unread == {"test.note@2", "test.node_named@1"}
            assert msgspec.json.decode(old_fold.payloads[2].raw) == {"node_id": "n1", "name": "rack-1"}
            # The newer reads all of it: the older's v1 note upcast to its v2 shape.
            assert new_fold.payloads == [
                NoteV2(title="hello", body="world"),
                NoteV2(title="hi", body="there"),
                NodeNamed(node_id="n1", name="rack-1"),
            ]
            assert new_live.unread == set()
        finally:
            await old_live.close()
            await new_live.close()
    finally:
        await old.close()
        await new.close()


async def test_a_snapshot_saved_by_an_older_release_that_passed_over_newer_events_is_not_where_the_newer_starts(
    nats: NatsServer,
) -> None:
    old = await EventStore.connect(nats.url, older())
    new = await EventStore.connect(nats.url, newer())
    try:
        await old.ensure_streams()
        await new.append(SUBJECT, [NewEvent(payload=NodeNamed(node_id="n1", name="rack-1"), actor="user:new")])
        old_live = await fold_all(old, "old", Seen())
        snapshots = await SnapshotStore.open(old.js)
        await snapshots.save("test", 1, old_live.position, b"state", unread=old_live.unread)
        await old_live.close()

        # Another older process starts from it, and carries on knowing what is still unread.
        again = await snapshots.restore("test", 1, lambda b: b, reads=older().reads)
        assert again is not None and again.position == old_live.position and again.unread == ["test.node_named@1"]
        # The newer reads that event: starting past it would never fold it, so it folds from 0.
        assert await snapshots.restore("test", 1, lambda b: b, reads=newer().reads) is None
        # Once a newer process has saved its own, that one is used.
        await snapshots.save("test", 1, old_live.position, b"newer state", unread=())
        mine = await snapshots.restore("test", 1, lambda b: b, reads=newer().reads)
        assert mine is not None and mine.state == b"newer state"
    finally:
        await old.close()
        await new.close()


async def test_the_registry_says_which_kinds_of_event_it_reads() -> None:
    registry = default_registry()
    assert registry.reads("model.added@1") and registry.reads("replica.failed@1") and registry.reads("replica.failed@2")
    assert not registry.reads("replica.failed@3") and not registry.reads("model.renamed@1")
    assert not registry.reads("garbage")
