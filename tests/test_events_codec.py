"""The codec, the registry and subject tokens: what goes on the log comes back the same."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.events.schema.catalog import all_event_types, default_registry
from llmgw.events.schema.codec import EventDecodeError, decode_event, encode_envelope
from llmgw.events.schema.envelope import Envelope, UnknownPayload, is_valid_actor, sanitize_actor
from llmgw.events.schema.ids import id_time_ms, new_id
from llmgw.events.schema.registry import EventRegistry, EventType
from llmgw.events.schema.replicas import ReplicaFailed
from llmgw.events.schema.subjects import aggregate_of, decode_token, encode_token, event_subject
from llmgw.events.schema.tenancy import OrgCreated, TeamCreated

NATS_FORBIDDEN = set(".*> \t\r\n")


@given(st.text())
def test_any_id_becomes_one_valid_subject_token_and_back(value: str) -> None:
    token = encode_token(value)
    assert token, "an empty token is not a valid subject"
    assert not (set(token) & NATS_FORBIDDEN)
    assert token.isascii()
    assert decode_token(token) == value


@given(st.text(min_size=1), st.text(min_size=1))
def test_distinct_ids_never_share_a_subject(a: str, b: str) -> None:
    if a != b:
        assert encode_token(a) != encode_token(b)


def test_a_model_name_with_dots_is_one_token_of_its_subject() -> None:
    subject = event_subject("model", "qwen2.5-7b.q4")
    assert subject.count(".") == 3
    assert aggregate_of(subject) == ("model", "qwen2.5-7b.q4")


@pytest.mark.parametrize("bad", ["~", "~4", "~zz", "a.b", "a b", "~2"])
def test_a_malformed_token_is_refused_not_guessed(bad: str) -> None:
    if bad == "~":
        assert decode_token(bad) == ""
        return
    with pytest.raises(ValueError):
        decode_token(bad)


payloads = st.builds(OrgCreated, org_id=st.text(max_size=40), name=st.text(max_size=40)) | st.builds(
    TeamCreated, team_id=st.text(max_size=40), org_id=st.text(max_size=40), name=st.text(max_size=40)
)


@given(payloads, st.text(max_size=30), st.one_of(st.none(), st.text(max_size=30)))
def test_every_registered_event_round_trips_through_the_codec(payload, actor, causation) -> None:
    registry = default_registry()
    etype = registry.type_of(payload)
    env = Envelope(
        id=new_id(),
        type=etype.name,
        v=etype.v,
        at=datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        actor=actor,
        causation=causation,
        data=msgspec.Raw(msgspec.json.encode(payload)),
    )
    back = decode_event(registry, encode_envelope(env), "llmgw.evt.tenancy.tree", 7)
    assert back.payload == payload
    assert back.envelope.actor == actor and back.envelope.causation == causation
    assert back.seq == 7


def _env(type_: str, v: int, data: bytes) -> bytes:
    return msgspec.json.encode(
        {
            "id": new_id(),
            "type": type_,
            "v": v,
            "at": "2026-01-01T00:00:00Z",
            "actor": "user:a",
            "data": msgspec.Raw(data),
        }
    )


def test_an_unknown_event_type_stays_raw_so_folds_skip_it() -> None:
    got = decode_event(default_registry(), _env("gpu.melted", 1, b'{"x":1}'), "s", 1)
    assert isinstance(got.payload, UnknownPayload)
    assert not got.known
    assert msgspec.json.decode(got.payload.raw) == {"x": 1}


def test_a_newer_version_than_the_reader_knows_stays_raw() -> None:
    got = decode_event(default_registry(), _env("org.created", 9, b'{"org_id":"o","name":"n"}'), "s", 1)
    assert isinstance(got.payload, UnknownPayload)


def test_an_old_version_is_upcast_to_the_current_shape() -> None:
    class Renamed(msgspec.Struct, frozen=True):
        org_id: str
        display_name: str
        source: str

    registry = EventRegistry([EventType("org.labelled", 3, Renamed)])
    registry.add_upcaster("org.labelled", 1, lambda d: {"org_id": d["org"], "display_name": d["label"]})
    registry.add_upcaster("org.labelled", 2, lambda d: {**d, "source": "upcast"})
    got = decode_event(registry, _env("org.labelled", 1, b'{"org":"o1","label":"Acme"}'), "s", 1)
    assert got.payload == Renamed(org_id="o1", display_name="Acme", source="upcast")


@pytest.mark.parametrize(
    ("reason", "node_lost"),
    [("node n1 lost: no heartbeat for 31s", True), ("node n2 lost", True), ("engine exited with 1", False)],
)
def test_a_replica_failure_written_before_v2_says_whether_its_node_was_lost(reason: str, node_lost: bool) -> None:
    data = msgspec.json.encode({"replica_id": "r1", "node_id": "n1", "reason": reason})
    got = decode_event(default_registry(), _env("replica.failed", 1, data), "s", 1)
    assert got.payload == ReplicaFailed(replica_id="r1", node_id="n1", reason=reason, node_lost=node_lost)


def test_added_optional_fields_are_ignored_by_an_older_reader() -> None:
    got = decode_event(default_registry(), _env("org.created", 1, b'{"org_id":"o","name":"n","colour":"red"}'), "s", 1)
    assert got.payload == OrgCreated(org_id="o", name="n")


@pytest.mark.parametrize(
    "data",
    [b"not json", b'{"type":"org.created"}', _env("org.created", 1, b'{"org_id": 5}')],
    ids=["garbage", "envelope without fields", "payload of the wrong shape"],
)
def test_bytes_that_are_not_an_event_raise_a_decode_error(data: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_event(default_registry(), data, "s", 1)


def test_every_event_type_is_registered_once_and_documented() -> None:
    names = [t.name for t in all_event_types()]
    assert len(names) == len(set(names))
    assert all(t.doc for t in all_event_types())


def test_ids_are_time_ordered_uuid7() -> None:
    a, b = new_id(), new_id()
    assert a[14] == "7" and len(a) == 36
    assert id_time_ms(a) <= id_time_ms(b)


@pytest.mark.parametrize(
    ("kind", "name", "expected"),
    [
        ("user", "Alice", "user:alice"),
        ("user", "DOMAIN\\bob smith", "user:domain-bob-smith"),
        ("user", "", "user:unknown"),
        ("user", "x" * 200, "user:" + "x" * 64),
        ("node", "cpu-03.rack1", "node:cpu-03.rack1"),
    ],
)
def test_actors_are_sanitised_never_free_text(kind: str, name: str, expected: str) -> None:
    actor = sanitize_actor(kind, name)
    assert actor == expected
    assert is_valid_actor(actor)


def test_a_tail_line_keeps_its_columns_whatever_the_length_of_an_aggregate_or_actor() -> None:
    from llmgw.cli.events_cmd import one_line
    from llmgw.events.schema.envelope import RecordedEvent

    def line(actor: str, aggregate_id: str) -> str:
        env = Envelope(
            id="e1", type="org.created", at=datetime(2026, 1, 1, tzinfo=UTC), actor=actor, causation="c1",
            data=msgspec.json.encode(OrgCreated(org_id="o1", name="acme")),
        )  # fmt: skip
        payload = OrgCreated(org_id="o1", name="acme")
        subject = event_subject("tenancy", aggregate_id)
        return one_line(RecordedEvent(subject=subject, seq=7, envelope=env, payload=payload))

    short, long = line("user:a", "tree"), line("user:" + "x" * 60, "t" * 80)
    assert short.index("by c1") == long.index("by c1"), (short, long)
    assert "…" in long and long.split()[:2] == ["7", "e1"]


def test_a_cli_table_keeps_its_columns_whatever_the_length_of_a_name() -> None:
    from llmgw.cli.table import table

    lines = table(
        ["MODEL", "READY", "STATUS"],
        [["tiny", "1/1", "serving"], ["a-model-name-of-forty-characters-or-so-x", "10/12", ""]],
        right={1},
    )
    assert lines[0].index("READY") + len("READY") == lines[1].index("1/1") + 3 == lines[2].index("10/12") + 5
    assert lines[1].index("serving") == lines[2].rindex("-") == lines[0].index("STATUS"), "an empty cell is a dash"
    assert all(line == line.rstrip() for line in lines)
