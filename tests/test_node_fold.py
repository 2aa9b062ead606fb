"""One fold of a node's registration, loss, cordon and drain, whoever reads it.

The fleet service (which decides `ctl cordon|uncordon|drain`), the scheduler (which places and
drains) and the ``fleet`` projection (what `ctl nodes` shows) each folded node events their own
way. They drifted: draining a node cordoned "for a disk swap" made `ctl nodes` say it was cordoned
for "draining", while the scheduler kept the person's reason and said so when it could not place.
Now they call ``events/folds/nodes.py``, and a property test holds them to one another.
"""

from __future__ import annotations

import asyncio
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from llmgw.events.folds import nodes as NF
from llmgw.events.runtime.store import NewEvent
from llmgw.events.schema import nodes as N
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject
from llmgw.projections.apply import commit_batch, create_tables
from llmgw.projections.backends import open_backend
from llmgw.projections.fleet import FleetProjection
from llmgw.services.fleet.rules import decide_node
from llmgw.services.scheduler.state import ClusterState
from tests.fleet import Fleet
from tests.support import wait_until

T0 = 1_700_000_000.0
REGISTRY = default_registry()
CAPACITY = N.NodeCapacity(address="10.0.0.1", cpus=8, memory_total_bytes=16 << 30)


def registered(node: str = "n1") -> N.NodeRegistered:
    return N.NodeRegistered(node_id=node, capacity=CAPACITY)


def replay(*payloads: msgspec.Struct) -> NF.Node | None:
    node: NF.Node | None = None
    for i, p in enumerate(payloads):
        node = NF.fold_node(node, p, T0 + i)
    return node


# -- the fold itself ------------------------------------------------------------------------------


def test_draining_a_cordoned_node_keeps_the_reason_it_was_cordoned_for() -> None:
    node = replay(registered(), N.NodeCordoned(node_id="n1", reason="disk swap"), N.NodeDrainRequested(node_id="n1"))
    assert node is not None and (node.cordoned, node.draining, node.cordon_reason) == (True, True, "disk swap")
    drained = replay(registered(), N.NodeDrainRequested(node_id="n1"))
    assert drained is not None and drained.cordon_reason == "draining"


def test_a_second_drain_changes_the_grace_but_not_when_the_grace_started() -> None:
    node = replay(registered(), N.NodeDrainRequested(node_id="n1", grace_s=60), N.NodeDrainRequested(node_id="n1"))
    assert node is not None and (node.drain_grace_s, node.drain_requested_at) == (300.0, T0 + 1)


def test_uncordoning_ends_the_cordon_and_the_drain_and_a_lost_node_returns() -> None:
    node = replay(
        registered(),
        N.NodeCordoned(node_id="n1", reason="x"),
        N.NodeDrainRequested(node_id="n1"),
        N.NodeLost(node_id="n1", last_seen=datetime.fromtimestamp(T0, UTC), silent_s=30),
        N.NodeUncordoned(node_id="n1"),
    )
    assert node is not None and (node.cordoned, node.draining, node.cordon_reason, node.state) == (
        False,
        False,
        "",
        "lost",
    )
    assert node.drain_requested_at is None
    returned = NF.fold_node(node, N.NodeReturned(node_id="n1"), T0)
    assert returned.state == "ready"


def test_the_fleet_service_refuses_what_the_folded_node_already_is() -> None:
    cordoned = replay(registered(), N.NodeCordoned(node_id="n1"))
    refusals = [
        (None, N.CordonNode(node_id="n1"), "not_found"),
        (cordoned, N.CordonNode(node_id="n1"), "unchanged"),
        (replay(registered()), N.UncordonNode(node_id="n1"), "unchanged"),
        (replay(registered(), N.NodeDrainRequested(node_id="n1")), N.DrainNode(node_id="n1"), "unchanged"),
    ]
    for node, command, code in refusals:
        with pytest.raises(Rejected) as refused:
            decide_node(node, command)
        assert refused.value.code == code, refused.value.reason
    decision = decide_node(cordoned, N.DrainNode(node_id="n1", grace_s=10))
    assert decision.payloads == [N.NodeDrainRequested(node_id="n1", grace_s=10)]


# -- every reader agrees --------------------------------------------------------------------------


def recorded(payloads: list[msgspec.Struct]) -> list[RecordedEvent]:
    out = []
    for seq, p in enumerate(payloads, 1):
        env = Envelope(
            id=f"e{seq}", type=REGISTRY.type_of(p).name, at=datetime.fromtimestamp(T0 + seq, UTC), actor="user:test"
        )
        out.append(RecordedEvent(envelope=env, payload=p, subject=event_subject(N.AGGREGATE, p.node_id), seq=seq))
    return out


async def projected(events: list[RecordedEvent], db: Path) -> dict[str, Any]:
    """The fleet projection's node rows after ``events``, applied as the runner applies a batch."""
    projection = FleetProjection()
    backend = await open_backend(f"sqlite:///{db}")
    try:
        async with backend.transaction(projection) as tx:
            await create_tables(tx, projection)
        await commit_batch(backend, projection, events)
        rows = await backend.query(
            projection, "SELECT id, state, cordoned, draining, cordon_reason, address, cpus FROM {nodes}"
        )
    finally:
        await backend.close()
    return {r[0]: tuple(r[1:]) for r in rows}


NODES = ["n1", "n2"]
node_events = st.one_of(
    st.builds(registered, st.sampled_from(NODES)),
    st.builds(
        N.NodeLost,
        node_id=st.sampled_from(NODES),
        last_seen=st.just(datetime.fromtimestamp(T0, UTC)),
        silent_s=st.just(30.0),
    ),
    st.builds(N.NodeReturned, node_id=st.sampled_from(NODES)),
    st.builds(N.NodeCordoned, node_id=st.sampled_from(NODES), reason=st.sampled_from(["", "disk swap", "kernel"])),
    st.builds(N.NodeUncordoned, node_id=st.sampled_from(NODES)),
    st.builds(N.NodeDrainRequested, node_id=st.sampled_from(NODES), grace_s=st.sampled_from([0.0, 60.0, 300.0])),
)


def as_log(payloads: list[msgspec.Struct]) -> list[msgspec.Struct]:
    """A node's events come after it registered (the fleet service and the scheduler act on known nodes)."""
    seen: set[str] = set()
    out = []
    for p in payloads:
        if isinstance(p, N.NodeRegistered):
            seen.add(p.node_id)
        if p.node_id in seen:  # type: ignore[attr-defined]
            out.append(p)
    return out


# The defect: `ctl nodes` said "draining" where the scheduler kept the person's reason.
DIVERGED = [registered(), N.NodeCordoned(node_id="n1", reason="disk swap"), N.NodeDrainRequested(node_id="n1")]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(node_events, max_size=25))
@example(DIVERGED)
def test_the_projection_the_scheduler_and_the_fleet_service_fold_nodes_alike(payloads: list[msgspec.Struct]) -> None:
    events = recorded(as_log(payloads))
    scheduler = ClusterState()
    fleet: dict[str, NF.Node] = {}
    for e in events:
        scheduler.apply(e)
        fleet[e.payload.node_id] = NF.fold_node(fleet.get(e.payload.node_id), e.payload, e.envelope.at.timestamp())
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(projected(events, Path(tmp) / "projections.db"))
    assert {n.id: n.fact for n in scheduler.nodes.values()} == fleet, "the fleet service and the scheduler disagree"
    shown = {
        n.id: (n.state, int(n.cordoned), int(n.draining), n.cordon_reason, CAPACITY.address, CAPACITY.cpus)
        for n in fleet.values()
    }
    assert rows == shown, "`ctl nodes` and the scheduler disagree about a node"


# -- the defect as a user saw it ------------------------------------------------------------------


async def test_ctl_nodes_shows_the_reason_a_node_was_cordoned_for_after_it_is_drained(fleet: Fleet) -> None:
    """Cordoned "for a disk swap", then drained: `ctl nodes` said "draining" while the scheduler said
    "cordoned (disk swap)" when it could not place on the node."""
    scheduler = fleet.handles["scheduler"]
    await fleet.store.append(event_subject(N.AGGREGATE, "n9"), [NewEvent(payload=registered("n9"), actor="node:n9")])
    await wait_until(lambda: "n9" in scheduler.state.nodes, what="the scheduler to fold the node")
    await fleet.command("cordon", N.CordonNode(node_id="n9", reason="disk swap"), service=N.SERVICE)
    await fleet.command("drain", N.DrainNode(node_id="n9", grace_s=5), service=N.SERVICE)
    await wait_until(lambda: scheduler.state.nodes["n9"].draining, what="the scheduler to fold the drain")
    assert scheduler.state.nodes["n9"].cordon_reason == "disk swap"

    async def shown() -> dict[str, Any] | None:
        async with aiohttp.ClientSession(headers=fleet.api_headers()) as http:
            async with http.get(f"http://127.0.0.1:{fleet.admin_port}/api/v1/nodes") as resp:
                nodes = {n["id"]: n for n in (await resp.json())["nodes"]}
        node = nodes.get("n9")
        return node if node is not None and node["draining"] else None

    node = await wait_until(shown, what="the admin API to show the node draining")
    assert (bool(node["cordoned"]), node["cordon_reason"]) == (True, "disk swap")
