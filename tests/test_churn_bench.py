"""An hour of simulated churn on a small fleet (tests/bench/churn.py: 20 nodes, 10 tenants whose
guarantees sum to 75% of it, about 60 models of every class, loaded past the fleet at times), held to
what a user would notice. The day-long run and its figures are in docs/benchmarks.md."""

from __future__ import annotations

from functools import cache

from tests.bench.churn import Params, Report, simulate

# The causes under which a tenant is below its guarantee because preemption is giving it room: the
# victims' drain is the price of the rule, not a failure of it.
UNDER_WAY = {"preempting", "victims draining"}


@cache
def hour() -> Report:
    return simulate(Params(scenario="enough", hours=1, nodes=20, seed=7))


def test_no_node_is_given_more_cores_memory_or_gpus_than_it_has_at_any_pass() -> None:
    assert hour().overcommits == []


def test_the_hour_has_preemptions_and_every_one_was_needed() -> None:
    r = hour()
    assert r.preemptions > 0, "the fleet is loaded past what it holds at times: something must give way"
    assert r.needed == r.preemptions, "a preemption whose winner would have been placed without it"


def test_every_preemptions_winner_is_placed_within_its_hold() -> None:
    r = hour()
    assert r.wasted == 0, r.wasted_why[:5]


def test_no_tenant_with_enough_capacity_is_below_its_guarantee_but_while_preemption_makes_it_room() -> None:
    r = hour()
    beyond = {
        row.tenant: {cause: s for cause, s in row.causes.items() if cause not in UNDER_WAY}
        for row in r.tenant_rows
        if set(row.causes) - UNDER_WAY
    }
    assert beyond == {}
