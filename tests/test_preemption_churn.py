"""Scheduler bugs found by a day of simulated churn (tests/bench/churn.py), each as a pure story of a few
passes, held fixed here: the room a preemption makes was taken by a model that came earlier in the pass,
and its winner preempted again (2,345 preemptions in a simulated day, 350 of them wasted)."""

from __future__ import annotations

from llmgw.services.scheduler.vocabulary import Place
from tests.scheduler_world import Fact, World, beats, later, model, node, placed, ready, said, stopped
from tests.test_preemption import OLD, preempted


def test_the_room_a_preemption_makes_goes_to_its_winner_not_to_a_model_that_sorts_first() -> None:
    w = World().add(
        node("n", cpus=8, mem_gb=64),
        model("m-low", cores=8, cls="opportunistic"),
        placed("m1", "m-low", "n"),
        ready("m1"),
        later(OLD),
        beats(),
        # Both short, neither fits: a-low may take nobody's room (same class, a minimum), z-crit may.
        model("a-low", cores=8, cls="opportunistic"),
        model("z-crit", cores=8, cls="critical"),
    )
    first = w.step()
    assert preempted(first) == ["m1"], [said(d) for d in first]
    w.add(later(10), beats(), stopped("m1"))  # the victim drained
    second = w.step()
    assert [said(d) for d in second if isinstance(d, Place)] == ["place z-crit on n"]


def two_nodes_each_running_a_low_replica() -> list[Fact]:
    """Nodes x and y, full with one old, ready replica each of the opportunistic model v-low (v1, v2)."""
    return [
        node("x", cpus=8, mem_gb=64),
        node("y", cpus=8, mem_gb=64),
        model("v-low", 2, cores=8, cls="opportunistic"),
        placed("v1", "v-low", "x"),
        ready("v1"),
        placed("v2", "v-low", "y"),
        ready("v2"),
        later(OLD),
        beats(),
    ]


def test_a_model_that_gives_way_to_two_winners_keeps_both_rooms_for_them() -> None:
    w = World().add(
        two_nodes_each_running_a_low_replica(),
        model("c-low", cores=8, cls="opportunistic"),  # short too, sorts first, may take nobody's room
        model("x-crit", cores=8, cls="critical"),
        model("y-crit", cores=8, cls="critical"),
    )
    first = w.step()
    assert preempted(first) == ["v1", "v2"], [said(d) for d in first]
    w.add(later(10), beats(), stopped("v1"), stopped("v2"))
    second = w.step()
    assert sorted(said(d) for d in second if isinstance(d, Place)) == ["place x-crit on x", "place y-crit on y"]


def test_a_winner_short_by_two_keeps_the_room_made_for_its_second_replica() -> None:
    w = World().add(
        two_nodes_each_running_a_low_replica(),
        model("w-crit", 2, cores=8, cls="critical"),
    )
    assert preempted(w.step()) == ["v1"]
    w.add(stopped("v1"), later(10), beats())
    second = w.step()  # the first replica goes where v1 was, and v2 gives way for the second
    assert [said(d) for d in second if isinstance(d, Place)] == ["place w-crit on x"]
    assert preempted(second) == ["v2"]
    w.add(stopped("v2"), later(10), beats())
    third = w.step()
    assert [said(d) for d in third if isinstance(d, Place)] == ["place w-crit on y"]
