"""The ``fleet`` projection's model rows (what `ctl models` and the admin API show) are the shared folds'.

The projection once folded model events again by hand in SQL, beside ``fold_model``, which the
catalog service, the scheduler and the routers call. Now each model event goes through
``fold_model`` (and ``fold_start_failures``) and the row is written from the result; this property
test holds every column of every row to those folds over generated event sequences, applied as the
runner applies a batch, on SQLite.
"""

from __future__ import annotations

import asyncio
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.events.folds import models as MF
from llmgw.events.folds import replicas as F
from llmgw.events.schema import models as M
from llmgw.events.schema import replicas as R
from llmgw.events.schema import scheduler as SCH
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.subjects import aggregate_of, event_subject
from llmgw.projections.apply import commit_batch, create_tables
from llmgw.projections.backends import open_backend
from llmgw.projections.fleet import FleetProjection

T0 = 1_700_000_000.0
REGISTRY = default_registry()
MODELS = ["m", "n"]
RIDS = ["r1", "r2", "r3"]
REASONS = ["exit 1", "out of memory"]
COLUMNS = [
    "name",
    "spec",
    "declared",
    "min_replicas",
    "max_replicas",
    "stopped",
    "parked",
    "failures",
    "last_error",
    "unplaceable",
    "spec_hash",
    "gave_room_to",
    "held_until",
    "preemptions",
    "updated_at",
    "measured",
    "folded",
]


def spec(name: str, memory_gb: float = 1.0, lo: int = 1, slo: M.Slo | None = None) -> M.ModelSpec:
    return M.ModelSpec(
        name=name,
        source=f"/{name}.gguf",
        scaling=M.Scaling(min=lo),
        profiles=[M.Profile(min_memory_gb=memory_gb)],
        slo=slo,
    )


def specs(name: str) -> st.SearchStrategy[M.ModelSpec]:
    return st.builds(
        spec,
        st.just(name),
        st.sampled_from([1.0, 2.0]),
        st.integers(0, 2),
        st.sampled_from([None, M.Slo(ttft_p95_s=1.5)]),
    )


def model_payloads(name: str) -> st.SearchStrategy[msgspec.Struct]:
    """Every kind of model event (``M.MODEL_EVENTS``), for the model ``name``."""
    counts = st.integers(0, 3)
    return st.one_of(
        st.builds(M.ModelAdded, spec=specs(name), declared=st.booleans()),
        st.builds(M.ModelChanged, spec=specs(name)),
        st.builds(M.ModelScaled, min=counts, max=counts),
        st.builds(M.ModelStopped, saved_min=counts, saved_max=counts),
        st.builds(M.ModelStarted, min=counts, max=counts),
        st.just(M.ModelRemoved()),
        st.builds(M.ModelParked, reason=st.sampled_from(["5 failed starts", "bad file"]), failures=st.just(5)),
        st.just(M.ModelRetried()),
        st.builds(
            M.ModelPreempted,
            replicas=st.lists(st.sampled_from(RIDS), max_size=2),
            node_id=st.just("n1"),
            capacity_class=st.just("default"),
            for_model=st.just("w"),
            for_class=st.just("high"),
            reason=st.sampled_from(["gave room to w", "gave room to w (below its minimum)"]),
            at=st.just(T0),
            held_until=st.sampled_from([T0 + 60, T0 + 300.5]),
        ),
        st.builds(M.ModelAutoscaled, from_=counts, to=counts, added=counts, reason=st.just("load"), at=st.just(T0)),
        st.builds(
            M.ModelMeasured,
            profile=st.sampled_from(["default", "big"]),
            shape=st.sampled_from([M.NodeShape(cpus=16), M.NodeShape(cpus=16, gpu="NVIDIA H200", gpus=1)]),
            node_id=st.just("n1"),
            replica_id=st.just("r1"),
            concurrency=st.integers(1, 8),
            tokens_per_s=st.sampled_from([12.5, 80.0]),
            ttft_p95_s=st.just(0.4),
            request_tokens_per_s=st.just(10.0),
            basis=st.sampled_from(["slo", "knee"]),
            slo=st.sampled_from([None, M.Slo(ttft_p95_s=1.5)]),
            requests=st.just(40),
            at=st.just(T0),
        ),
    )


def replica_payloads(name: str) -> st.SearchStrategy[msgspec.Struct]:
    """What moves a model's row from outside its own events: its replicas (start failures, a placement
    clearing the scheduler's word) and the scheduler saying it cannot place it."""
    rid = st.sampled_from(RIDS).map(lambda r: f"{name}-{r}")
    hashes = specs(name).map(M.spec_hash)
    return st.one_of(
        st.builds(
            lambda r, h: R.ReplicaPlaced(
                replica_id=r, model=name, node_id="n1", source=f"/{name}.gguf", profile=M.Profile(), spec_hash=h
            ),
            rid,
            hashes,
        ),
        st.builds(lambda r: R.ReplicaReady(replica_id=r, node_id="n1", pid=7, port=20000, url="http://n1:20000"), rid),
        st.builds(
            lambda r, why, lost: R.ReplicaFailed(replica_id=r, node_id="n1", reason=why, node_lost=lost),
            rid,
            st.sampled_from(REASONS),
            st.booleans(),
        ),
        st.builds(
            SCH.PlacementBlocked,
            model=st.just(name),
            reason=st.sampled_from(["no node fits", "quota"]),
            wanted=st.just(1),
        ),
    )


def one_event(name: str) -> st.SearchStrategy[tuple[str, msgspec.Struct]]:
    return st.tuples(st.just(name), st.one_of(model_payloads(name), replica_payloads(name)))


# Each model added first (most of a model's events come while it is in the catalog), then anything.
histories = st.tuples(
    st.tuples(*(st.tuples(st.just(n), st.builds(M.ModelAdded, spec=specs(n))) for n in MODELS)),
    st.lists(st.one_of(*(one_event(n) for n in MODELS)), max_size=40),
).map(lambda h: [*h[0], *h[1]])


def recorded(history: list[tuple[str, msgspec.Struct]]) -> list[RecordedEvent]:
    """The payloads on their subjects, a second apart; a replica id is placed once, as on a real log."""
    out, placed = [], set()
    for name, p in history:
        if isinstance(p, R.ReplicaPlaced):
            if p.replica_id in placed:
                continue
            placed.add(p.replica_id)
        if isinstance(p, M.MODEL_EVENTS):
            subject = event_subject(M.AGGREGATE, name)
        elif isinstance(p, SCH.PlacementBlocked):
            subject = event_subject(SCH.AGGREGATE, "leader")
        else:
            subject = event_subject(R.AGGREGATE, p.replica_id)  # type: ignore[attr-defined]
        seq = len(out) + 1
        at = datetime.fromtimestamp(T0 + seq, UTC)
        env = Envelope(id=f"e{seq}", type=REGISTRY.type_of(p).name, at=at, actor="user:test")
        out.append(RecordedEvent(envelope=env, payload=p, subject=subject, seq=seq))
    return out


class Expected(msgspec.Struct, kw_only=True):
    """One model as the shared folds leave it, and the two things its row adds: the scheduler's word
    (``scheduler.unplaceable``, until a replica of it is placed) and the time of its last edit."""

    status: MF.ModelStatus | None = None
    starts: F.StartFailures = F.StartFailures()
    unplaceable: str | None = None
    updated_at: str | None = None


def folded(events: list[RecordedEvent]) -> dict[str, Expected]:
    models = {n: Expected() for n in MODELS}
    replicas: dict[str, F.Replica] = {}
    for e in events:
        p, at, ts = e.payload, e.envelope.at.isoformat(), e.envelope.at.timestamp()
        if isinstance(p, M.MODEL_EVENTS):
            m = models[aggregate_of(e.subject)[1]]
            m.status = MF.fold_model(m.status, p)
            m.starts = F.fold_start_failures(m.starts, p, ts)
            if isinstance(p, M.ModelAdded):
                m.unplaceable = None
            if not isinstance(p, M.ModelAutoscaled):
                m.updated_at = at
        elif isinstance(p, SCH.PlacementBlocked):
            models[p.model].unplaceable, models[p.model].updated_at = p.reason, at
        else:
            before = replicas.get(p.replica_id)
            after = F.fold_replica(before, p, ts)
            if after is None:
                continue
            replicas[p.replica_id] = after
            m = models[after.model]
            m.starts = F.fold_start_failures(m.starts, p, ts, before)
            if isinstance(p, R.ReplicaPlaced):
                m.unplaceable = None
    return models


def expected_rows(events: list[RecordedEvent]) -> dict[str, dict[str, Any]]:
    """Every column of every row, each said from the folds."""
    out = {}
    for name, m in folded(events).items():
        s = m.status
        if s is None:
            continue
        pre = s.preempted
        out[name] = {
            "name": name,
            "spec": s.spec,
            "declared": int(s.declared),
            "min_replicas": s.min,
            "max_replicas": s.max,
            "stopped": int(s.stopped),
            "parked": s.parked,
            "failures": m.starts.count,
            "last_error": m.starts.last_error,
            "unplaceable": m.unplaceable,
            "spec_hash": M.spec_hash(s.spec),
            "gave_room_to": pre.reason if pre else None,  # never preempted: NULL, as before the fold
            "held_until": datetime.fromtimestamp(pre.held_until, UTC).isoformat() if pre else None,
            "preemptions": s.preemptions if pre else None,
            "updated_at": m.updated_at,
            "measured": s.measured or None,  # never measured: NULL
            "folded": s,
        }
    return out


async def projected(events: list[RecordedEvent], dsn: str) -> dict[str, dict[str, Any]]:
    """The projection's model rows after ``events``, applied as the runner applies a batch, JSON decoded."""
    projection = FleetProjection()
    backend = await open_backend(dsn)
    try:
        async with backend.transaction(projection) as tx:
            await create_tables(tx, projection)
        await commit_batch(backend, projection, events)
        rows = await backend.query(projection, f"SELECT {', '.join(COLUMNS)} FROM {{models}}")
    finally:
        await backend.close()
    out = {}
    for values in rows:
        row = dict(zip(COLUMNS, values, strict=True))
        row["spec"] = msgspec.json.decode(row["spec"], type=M.ModelSpec)
        row["measured"] = msgspec.json.decode(row["measured"], type=list[M.ModelMeasured]) if row["measured"] else None
        row["folded"] = msgspec.json.decode(row["folded"], type=MF.ModelStatus)
        out[row["name"]] = row
    return out


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories)
def test_every_column_of_a_model_row_is_what_the_shared_folds_make_of_its_events(
    history: list[tuple[str, msgspec.Struct]],
) -> None:
    events = recorded(history)
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(projected(events, f"sqlite:///{Path(tmp) / 'projections.db'}"))
    want = expected_rows(events)
    assert rows.keys() == want.keys(), "`ctl models` lists other models than the catalog's fold holds"
    for name, row in rows.items():
        for column in COLUMNS:
            assert row[column] == want[name][column], f"{name}: column {column}"


def every_kind_of_model_event(name: str = "m") -> list[tuple[str, msgspec.Struct]]:
    """One of each: a model's events, its replicas' and the scheduler's word, in an order that moves every column."""
    rid = f"{name}-r1"
    events: list[msgspec.Struct] = [
        M.ModelAdded(spec=spec(name), declared=True),
        SCH.PlacementBlocked(model=name, reason="no node fits", wanted=1),
        R.ReplicaPlaced(
            replica_id=rid, model=name, node_id="n1", source=f"/{name}.gguf", profile=M.Profile(), spec_hash="h"
        ),
        R.ReplicaFailed(replica_id=rid, node_id="n1", reason="exit 1"),
        M.ModelParked(reason="5 failed starts", failures=5),
        M.ModelScaled(min=2, max=3),
        M.ModelPreempted(
            replicas=[rid],
            node_id="n1",
            capacity_class="default",
            for_model="w",
            for_class="high",
            reason="gave room to w",
            at=T0,
            held_until=T0 + 60,
        ),
        M.ModelAutoscaled(from_=2, to=3, added=1, reason="load", at=T0),
        M.ModelMeasured(
            profile="default",
            shape=M.NodeShape(cpus=16),
            node_id="n1",
            replica_id=rid,
            concurrency=4,
            tokens_per_s=80.0,
            ttft_p95_s=0.4,
            request_tokens_per_s=10.0,
            basis="knee",
            requests=40,
            at=T0,
        ),
        M.ModelStopped(saved_min=2, saved_max=3),
        M.ModelStarted(min=2, max=3),
        M.ModelChanged(spec=spec(name, memory_gb=2.0)),
        M.ModelRetried(),
    ]
    return [(name, p) for p in events]


async def test_a_model_row_holds_the_same_on_sqlite_and_postgresql(db_dsn: str) -> None:
    events = recorded([*every_kind_of_model_event("m"), *every_kind_of_model_event("n"), ("n", M.ModelRemoved())])
    rows = await projected(events, db_dsn)
    want = expected_rows(events)
    assert list(rows) == ["m"] and rows["m"]["preemptions"] == 1 and rows["m"]["measured"]
    assert rows == want
