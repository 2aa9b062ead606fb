"""One fold of the tenancy tree, whoever reads it.

The tenancy service, the access service and the routers (which charge a request to its key's
project, team and org) all follow the tree; the routers used to keep their own map of parents,
which never forgot a deleted scope. Now they all fold ``events/folds/tenancy.py``, and a property
test holds the ``tenancy`` projection's rows (what `ctl tree` shows) and the router's scope chain
to the tree.
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

from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.subjects import event_subject
from llmgw.projections.apply import commit_batch, create_tables
from llmgw.projections.backends import open_backend
from llmgw.projections.tenancy import TenancyProjection
from llmgw.services.router.state import KeyInfo, RouterState

T0 = 1_700_000_000.0
REGISTRY = default_registry()
TREE = event_subject(T.AGGREGATE, T.TREE_ID)
KEY = KeyInfo(id="k1", prefix="abcd1234", secret_sha256="0" * 64, project_id="p1")


def recorded(payloads: list[msgspec.Struct]) -> list[RecordedEvent]:
    return [
        RecordedEvent(
            envelope=Envelope(
                id=f"e{seq}", type=REGISTRY.type_of(p).name, at=datetime.fromtimestamp(T0 + seq, UTC), actor="user:t"
            ),
            payload=p,
            subject=TREE,
            seq=seq,
        )
        for seq, p in enumerate(payloads, 1)
    ]


def folded(*payloads: msgspec.Struct) -> tuple[TenancyTree, RouterState]:
    tree, router = TenancyTree(), RouterState()
    for e in recorded(list(payloads)):
        tree.apply(e)
        router.apply(e)
    return tree, router


ORG = T.OrgCreated(org_id="o1", name="acme")
TEAM = T.TeamCreated(team_id="t1", org_id="o1", name="ml")
PROJECT = T.ProjectCreated(project_id="p1", team_id="t1", name="chat")


def test_a_keys_scopes_are_its_project_team_and_org_most_specific_first() -> None:
    tree, router = folded(ORG, TEAM, PROJECT)
    assert router.scopes_of(KEY) == ["key:k1", "project:p1", "team:t1", "org:o1"]
    assert tree.scopes_above("p1") == ["team:t1", "org:o1"]


def test_a_key_of_a_project_deleted_meanwhile_is_still_held_to_its_team_and_org() -> None:
    """The one race left (a key made as its project is deleted) must not let the key escape the
    limits and budgets of the team and org above it."""
    tree, router = folded(ORG, TEAM, PROJECT, T.ProjectDeleted(project_id="p1", name="chat"))
    assert "p1" not in tree.scopes
    assert router.scopes_of(KEY) == ["key:k1", "project:p1", "team:t1", "org:o1"]


def test_a_renamed_scope_keeps_its_place_in_the_chain() -> None:
    _, router = folded(ORG, TEAM, PROJECT, T.TeamRenamed(team_id="t1", old_name="ml", name="research"))
    assert router.scopes_of(KEY) == ["key:k1", "project:p1", "team:t1", "org:o1"]


# -- every reader agrees --------------------------------------------------------------------------


async def projected(events: list[RecordedEvent], db: Path) -> dict[str, Any]:
    projection = TenancyProjection()
    backend = await open_backend(f"sqlite:///{db}")
    try:
        async with backend.transaction(projection) as tx:
            await create_tables(tx, projection)
        await commit_batch(backend, projection, events)
        rows = await backend.query(projection, "SELECT id, kind, name, parent_id FROM {scopes}")
    finally:
        await backend.close()
    return {r[0]: tuple(r[1:]) for r in rows}


NAMES = st.sampled_from(["acme", "ml", "chat", "ops"])
tree_events = st.one_of(
    st.builds(T.OrgCreated, org_id=st.sampled_from(["o1", "o2"]), name=NAMES),
    st.builds(T.TeamCreated, team_id=st.sampled_from(["t1", "t2"]), org_id=st.sampled_from(["o1", "o2"]), name=NAMES),
    st.builds(T.ProjectCreated, project_id=st.just("p1"), team_id=st.sampled_from(["t1", "t2"]), name=NAMES),
    st.builds(T.OrgRenamed, org_id=st.sampled_from(["o1", "o2"]), old_name=st.just(""), name=NAMES),
    st.builds(T.TeamRenamed, team_id=st.sampled_from(["t1", "t2"]), old_name=st.just(""), name=NAMES),
    st.builds(T.ProjectRenamed, project_id=st.just("p1"), old_name=st.just(""), name=NAMES),
    st.builds(T.OrgDeleted, org_id=st.sampled_from(["o1", "o2"]), name=st.just("")),
    st.builds(T.TeamDeleted, team_id=st.sampled_from(["t1", "t2"]), name=st.just("")),
    st.builds(T.ProjectDeleted, project_id=st.just("p1"), name=st.just("")),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(tree_events, max_size=20))
def test_the_projection_and_the_router_follow_the_tenancy_tree(payloads: list[msgspec.Struct]) -> None:
    events = recorded(payloads)
    tree, router = TenancyTree(), RouterState()
    for e in events:
        tree.apply(e)
        router.apply(e)
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(projected(events, Path(tmp) / "projections.db"))
    assert rows == {s.id: (s.kind, s.name, s.parent_id) for s in tree.scopes.values()}, "`ctl tree` differs"
    assert router.scopes_of(KEY) == ["key:k1", "project:p1", *tree.scopes_above("p1")]
    if "p1" in tree.scopes:  # a live project's chain is its path in the tree
        chain, parent = [], tree.scopes["p1"].parent_id
        while parent in tree.scopes:
            chain.append(f"{tree.scopes[parent].kind}:{parent}")
            parent = tree.scopes[parent].parent_id
        assert tree.scopes_above("p1")[: len(chain)] == chain
