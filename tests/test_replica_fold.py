"""One replica lifecycle and one count of start failures, whoever folds them.

The scheduler, the routers, the agents and the ``fleet`` projection (what `ctl models` and
`ctl replicas` read) all follow replicas. They once folded them each their own way and drifted: a
replica of an older definition becoming ready reset the failure count in `ctl models` while the
scheduler, rightly, kept counting towards parking. Now they call the folds of
``events/folds/replicas.py``, and a property test holds the SQL projection's rows, the scheduler's
state and the router's state to one another over generated event sequences.
"""

from __future__ import annotations

import asyncio
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmgw.events.folds import replicas as F
from llmgw.events.runtime.store import NewEvent
from llmgw.events.schema import models as M
from llmgw.events.schema import replicas as R
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.subjects import event_subject
from llmgw.projections.apply import commit_batch, create_tables
from llmgw.projections.backends import open_backend
from llmgw.projections.fleet import FleetProjection
from llmgw.services.router.state import RouterState
from llmgw.services.scheduler.state import ClusterState
from tests.fleet import Fleet
from tests.support import wait_until

T0 = 1_700_000_000.0
REGISTRY = default_registry()


def spec(name: str = "m", memory_gb: float = 1.0, lo: int = 1) -> M.ModelSpec:
    return M.ModelSpec(
        name=name, source="/m.gguf", scaling=M.Scaling(min=lo), profiles=[M.Profile(min_memory_gb=memory_gb)]
    )


def placed(rid: str, model: str = "m", spec_hash: str = "", replaces: str = "") -> R.ReplicaPlaced:
    return R.ReplicaPlaced(
        replica_id=rid,
        model=model,
        node_id="n1",
        source="/m.gguf",
        profile=M.Profile(),
        spec_hash=spec_hash,
        replaces=replaces,
    )


def ready(rid: str) -> R.ReplicaReady:
    return R.ReplicaReady(replica_id=rid, node_id="n1", pid=7, port=20000, url="http://n1:20000")


def failed(rid: str, reason: str = "exit 1", node_lost: bool = False) -> R.ReplicaFailed:
    return R.ReplicaFailed(replica_id=rid, node_id="n1", reason=reason, node_lost=node_lost)


def replay(*payloads: msgspec.Struct) -> tuple[dict[str, F.Replica], F.StartFailures]:
    """Fold one model's events and its replicas' in order, as every reader does: replicas and failures."""
    replicas: dict[str, F.Replica] = {}
    starts = F.StartFailures()
    for i, p in enumerate(payloads):
        rid = getattr(p, "replica_id", None)
        before = replicas.get(rid) if rid is not None else None
        if rid is not None and (after := F.fold_replica(before, p, T0 + i)) is not None:
            replicas[rid] = after
        starts = F.fold_start_failures(starts, p, T0 + i, before)
    return replicas, starts


# -- the fold itself ------------------------------------------------------------------------------

H1 = M.spec_hash(spec(memory_gb=1.0))
H2 = M.spec_hash(spec(memory_gb=2.0))


def test_a_late_ready_does_not_undo_a_stop_request() -> None:
    r = replay(placed("r1"), R.ReplicaStopRequested(replica_id="r1", reason="scale down"), ready("r1"))[0]["r1"]
    assert r.state == "draining" and r.url is None


def test_a_stopped_replica_stays_stopped_and_keeps_why_it_was_stopped() -> None:
    replicas, _ = replay(
        placed("r1"),
        R.ReplicaStopRequested(replica_id="r1", reason="model removed"),
        R.ReplicaStopped(replica_id="r1", node_id="n1"),
        failed("r1"),
        ready("r1"),
    )
    assert (replicas["r1"].state, replicas["r1"].reason) == ("stopped", "model removed")


def test_a_replica_is_placed_once() -> None:
    r = replay(placed("r1", spec_hash=H1), ready("r1"), placed("r1", spec_hash=H2))[0]["r1"]
    assert (r.state, r.spec_hash) == ("ready", H1)


def test_start_failures_count_in_a_row_and_a_lost_node_is_not_the_models_fault() -> None:
    _, s = replay(M.ModelAdded(spec=spec()), placed("r1", spec_hash=H1), failed("r1", "exit 1"))
    assert (s.count, s.last_error, s.last_failure_at) == (1, "exit 1", T0 + 2)
    _, s = replay(M.ModelAdded(spec=spec()), placed("r1", spec_hash=H1), failed("r1", node_lost=True))
    assert s.count == 0


def test_a_ready_replica_fails_later_without_counting_as_a_failed_start() -> None:
    _, s = replay(M.ModelAdded(spec=spec()), placed("r1", spec_hash=H1), ready("r1"), failed("r1"))
    assert s.count == 0


def test_only_a_ready_replica_of_the_current_definition_ends_a_run_of_failures() -> None:
    story = [
        M.ModelAdded(spec=spec(memory_gb=1.0)),
        placed("old", spec_hash=H1),
        M.ModelChanged(spec=spec(memory_gb=2.0)),
        placed("new", spec_hash=H2),
        failed("new", "out of memory"),
    ]
    _, starts = replay(*story, ready("old"))
    assert starts.count == 1, "a replica of the old definition says nothing about whether the new one starts"
    _, starts = replay(*story, ready("old"), placed("new2", spec_hash=H2), ready("new2"))
    assert starts.count == 0


def test_a_new_definition_and_a_retry_start_counting_again() -> None:
    base = [M.ModelAdded(spec=spec()), placed("r1", spec_hash=H1), failed("r1")]
    assert replay(*base, M.ModelChanged(spec=spec(memory_gb=2.0)))[1].count == 0
    _, s = replay(*base, M.ModelParked(reason="5 failed starts", failures=5), M.ModelRetried())
    assert (s.count, s.last_error) == (0, "5 failed starts")


# -- every reader agrees --------------------------------------------------------------------------


def recorded(events: list[tuple[str, str, msgspec.Struct]]) -> list[RecordedEvent]:
    out = []
    for seq, (aggregate, agg_id, payload) in enumerate(events, 1):
        env = Envelope(
            id=f"e{seq}",
            type=REGISTRY.type_of(payload).name,
            at=datetime.fromtimestamp(T0 + seq, UTC),
            actor="user:test",
        )
        out.append(RecordedEvent(envelope=env, payload=payload, subject=event_subject(aggregate, agg_id), seq=seq))
    return out


async def projected(events: list[RecordedEvent], db: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The fleet projection's models and replicas rows after ``events``, applied as the runner applies a batch."""
    projection = FleetProjection()
    backend = await open_backend(f"sqlite:///{db}")
    try:
        async with backend.transaction(projection) as tx:
            await create_tables(tx, projection)
        await commit_batch(backend, projection, events)
        models = await backend.query(projection, "SELECT name, failures, last_error, spec_hash FROM {models}")
        replicas = await backend.query(projection, "SELECT id, state, pid, port, url, reason, restart FROM {replicas}")
    finally:
        await backend.close()
    return {m[0]: tuple(m[1:]) for m in models}, {r[0]: tuple(r[1:]) for r in replicas}


def scheduler_view(events: list[RecordedEvent]) -> tuple[ClusterState, dict[str, Any], dict[str, Any]]:
    state = ClusterState()
    for e in events:
        state.apply(e)
    models = {n: (m.failures, m.last_error, m.spec_hash) for n, m in state.models.items()}
    replicas = {r.id: (r.state, r.pid, r.port, r.url, r.reason, r.restart) for r in state.replicas.values()}
    return state, models, replicas


SPECS = [spec(memory_gb=1.0), spec(memory_gb=2.0)]
HASHES = [M.spec_hash(s) for s in SPECS]
RIDS = ["r1", "r2", "r3", "r4"]
REASONS = ["exit 1", "out of memory", "health probe timed out"]

model_events = st.one_of(
    st.builds(M.ModelAdded, spec=st.sampled_from(SPECS)),
    st.builds(M.ModelChanged, spec=st.sampled_from(SPECS)),
    st.builds(M.ModelParked, reason=st.sampled_from(REASONS), failures=st.just(5)),
    st.just(M.ModelRetried()),
    st.just(M.ModelRemoved()),
)
replica_events = st.one_of(
    st.builds(lambda rid, h: placed(rid, spec_hash=h), st.sampled_from(RIDS), st.sampled_from(HASHES)),
    # a restart's replacement (SCHED-6), and the request
    st.builds(
        lambda rid, h, old: placed(rid, spec_hash=h, replaces=old),
        st.sampled_from(RIDS),
        st.sampled_from(HASHES),
        st.sampled_from(RIDS),
    ),
    st.builds(lambda rid: R.ReplicaRestartRequested(replica_id=rid), st.sampled_from(RIDS)),
    st.builds(
        lambda rid, pid: R.ReplicaStarting(replica_id=rid, node_id="n1", pid=pid, port=20000 + pid),
        st.sampled_from(RIDS),
        st.integers(1, 9),
    ),
    st.builds(
        lambda rid, pid: R.ReplicaReady(
            replica_id=rid, node_id="n1", pid=pid, port=20000 + pid, url=f"http://n1:{pid}"
        ),
        st.sampled_from(RIDS),
        st.integers(1, 9),
    ),
    st.builds(failed, st.sampled_from(RIDS), st.sampled_from(REASONS), st.booleans()),
    st.builds(
        R.ReplicaStopRequested, replica_id=st.sampled_from(RIDS), reason=st.sampled_from(["scale down", "drain"])
    ),
    st.builds(
        R.ReplicaStopped, replica_id=st.sampled_from(RIDS), node_id=st.just("n1"), reason=st.sampled_from(["", "gone"])
    ),
)


def as_log(payloads: list[msgspec.Struct]) -> list[tuple[str, str, msgspec.Struct]]:
    """Payloads as events on their subjects; replica ids are unique on a real log, so each is placed once."""
    out, seen = [], set()
    for p in payloads:
        if isinstance(p, R.ReplicaPlaced):
            if p.replica_id in seen:
                continue
            seen.add(p.replica_id)
        aggregate, agg_id = (R.AGGREGATE, p.replica_id) if hasattr(p, "replica_id") else (M.AGGREGATE, "m")
        out.append((aggregate, agg_id, p))
    return out


# The defect: a replica of the old definition becomes ready after one of the new definition failed.
DIVERGED = [
    M.ModelAdded(spec=SPECS[0]),
    placed("r1", spec_hash=HASHES[0]),
    M.ModelChanged(spec=SPECS[1]),
    placed("r2", spec_hash=HASHES[1]),
    failed("r2", "out of memory"),
    ready("r1"),
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.one_of(model_events, replica_events), max_size=30))
@example(DIVERGED[1:])  # the generated part comes after a ModelAdded
def test_the_projection_the_scheduler_and_the_router_fold_replicas_alike(payloads: list[msgspec.Struct]) -> None:
    events = recorded(as_log([M.ModelAdded(spec=SPECS[0]), *payloads]))
    state, s_models, s_replicas = scheduler_view(events)
    with tempfile.TemporaryDirectory() as tmp:
        p_models, p_replicas = asyncio.run(projected(events, Path(tmp) / "projections.db"))
    assert p_models == s_models, "`ctl models` and the scheduler disagree about a model's start failures"
    assert p_replicas == s_replicas, "`ctl replicas` and the scheduler disagree about a replica"

    router = RouterState()
    for e in events:
        router.apply(e)
    live = {rid: r.state for rid, r in state.replicas.items() if r.state not in ("failed", "stopped")}
    assert {rid: r.state for rid, r in router.replicas.items()} == live
    ready_now = {rid for rid, s in live.items() if s == "ready"}
    assert {rid for group in router.ready_by_model.values() for rid in group} == ready_now


# -- the defect as a user saw it ------------------------------------------------------------------


def _append(fleet: Fleet, rid: str, payload: msgspec.Struct) -> Any:
    return fleet.store.append(event_subject(R.AGGREGATE, rid), [NewEvent(payload=payload, actor="node:n1")])


async def test_ctl_models_shows_the_failures_the_scheduler_counts_after_an_old_definition_becomes_ready(
    fleet: Fleet,
) -> None:
    """A replica of the old definition becoming ready after the new one failed to start: `ctl models`
    said 0 failures while the scheduler, one failure nearer to parking the model, said 1."""
    scheduler = fleet.handles["scheduler"]
    await fleet.add_model("m", "/models/m.gguf", min_=2, memory_gb=1.0)
    await wait_until(lambda: "m" in scheduler.state.models, what="the scheduler to fold the model")
    old_hash = scheduler.state.models["m"].spec_hash
    await _append(
        fleet,
        "old",
        R.ReplicaPlaced(
            replica_id="old", model="m", node_id="n1", source="/models/m.gguf", profile=M.Profile(), spec_hash=old_hash
        ),
    )
    await fleet.command("resources", M.SetResources(name="m", memory_gb=2.0))
    await wait_until(lambda: scheduler.state.models["m"].spec_hash != old_hash, what="the new definition")
    new_hash = scheduler.state.models["m"].spec_hash
    await _append(
        fleet,
        "new",
        R.ReplicaPlaced(
            replica_id="new", model="m", node_id="n1", source="/models/m.gguf", profile=M.Profile(), spec_hash=new_hash
        ),
    )
    await _append(fleet, "new", failed("new", "out of memory"))
    await _append(fleet, "old", ready("old"))

    await wait_until(
        lambda: scheduler.state.replicas["old"].state == "ready", what="the scheduler to fold the ready replica"
    )
    assert scheduler.state.models["m"].failures == 1

    async def shown() -> dict[str, Any] | None:
        async with aiohttp.ClientSession(headers=fleet.api_headers()) as http:
            async with http.get(f"http://127.0.0.1:{fleet.admin_port}/api/v1/replicas") as resp:
                replicas = {r["id"]: r for r in (await resp.json())["replicas"]}
            async with http.get(f"http://127.0.0.1:{fleet.admin_port}/api/v1/models") as resp:
                models = {m["name"]: m for m in (await resp.json())["models"]}
        return models["m"] if replicas.get("old", {}).get("state") == "ready" else None

    model = await wait_until(shown, what="the admin API to show the old replica ready")
    assert (model["failures"], model["last_error"]) == (1, "out of memory")
