"""The B2B prefix-routing benchmark (tests/bench/b2b.py): its baselines order replicas as named, its
workload is the same for every policy, and a tiny run through a real fleet yields figures for all three."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from llmgw.services.router.routing import POLICIES, round_robin, shuffled
from llmgw.services.router.state import ReplicaInfo
from tests.bench.b2b import Workload, bench, documents, plan, summarize, table


def replicas(*ids: str) -> list[ReplicaInfo]:
    return [ReplicaInfo(replica_id=i, model="m", node_id="n", state="ready") for i in ids]


@pytest.mark.parametrize(
    ("turn", "first"),
    [(0, "a"), (1, "b"), (2, "c"), (3, "a"), (4, "b")],
)
def test_round_robin_starts_each_turn_at_the_next_replica_by_id(turn: int, first: str) -> None:
    ranked = round_robin(replicas("c", "a", "b"), turn)
    assert ranked[0].replica_id == first
    assert sorted(r.replica_id for r in ranked) == ["a", "b", "c"]  # the rest follow: every replica is tried


def test_round_robin_of_no_replicas_is_empty() -> None:
    assert round_robin([], 7) == []


def test_random_order_is_the_same_for_the_same_seed_whatever_order_the_replicas_come_in() -> None:
    one = [r.replica_id for r in shuffled(replicas("a", "b", "c", "d"), 42)]
    two = [r.replica_id for r in shuffled(replicas("d", "c", "b", "a"), 42)]
    assert one == two and sorted(one) == ["a", "b", "c", "d"]


def test_random_order_differs_between_seeds() -> None:
    orders = {tuple(r.replica_id for r in shuffled(replicas("a", "b", "c", "d"), seed)) for seed in range(50)}
    assert len(orders) > 1
    firsts = {o[0] for o in orders}
    assert firsts == {"a", "b", "c", "d"}  # every replica comes first for some seed


def test_every_policy_is_sent_the_same_arrivals_with_documents_of_its_own() -> None:
    w = Workload(tenants=3, seconds=20, rate_from=1, rate_to=4)
    assert plan(w, 0) == plan(w, 0) and plan(w, 0) != plan(w, 1)
    docs = {p: documents(w, 0, p) for p in POLICIES}
    assert len({d for ds in docs.values() for d in ds}) == 3 * len(POLICIES)  # no prefix shared across rounds
    assert len({len(d.split()) for ds in docs.values() for d in ds}) == 1  # each as long as the others
    at = [p.at for p in plan(w, 0)]
    assert at == sorted(at) and all(0 <= t < w.seconds for t in at)
    assert sum(t < 10 for t in at) < sum(t >= 10 for t in at)  # the rate ramps up


@pytest.mark.timeout(240)
async def test_a_tiny_run_yields_figures_for_every_policy(tmp_path: Path) -> None:
    w = Workload(tenants=2, users=2, prefix_words=20, max_tokens=4, seconds=2.0, rate_from=2.0, rate_to=2.0)
    out = await bench(tmp_path, 1, w, cache_mib=8, width=64, layers=2)
    assert set(out) == set(POLICIES)
    for policy, rounds in out.items():
        assert len(rounds) == 1 and rounds[0], policy
        assert [r.error for r in rounds[0] if r.error] == [], policy
        s = summarize(rounds)
        assert s.requests == len(plan(w, 0)) and s.errors == 0
        assert not math.isnan(s.ttft_p90_ms) and s.tokens_per_s > 0 and s.prompt_tokens > 0
    report = table({p: summarize(r) for p, r in out.items()})
    assert "round_robin / llmgw: TTFT p90" in report and "random / llmgw: TTFT p90" in report
