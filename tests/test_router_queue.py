"""The gateway's admission queue: the pure fair order and bounds as tables and a property, and the gate's
waiting (slots granted as they free, deadlines, departed clients, cancelled handlers) on a real event loop."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.services.router.app import Router, RouterConfig
from llmgw.services.router.queue import (
    FULL,
    PROJECT_FULL,
    TIMEOUT,
    ClientLeft,
    Gate,
    ModelQueue,
    QueueRefused,
    Waiter,
    retry_after_s,
)
from llmgw.services.router.routing import ENGINE_STALE_S, EngineLoad, engine_loads, order, slots_of
from llmgw.services.router.state import ReplicaInfo
from llmgw.services.router.state import slots_of as slots_of_profile
from tests.support import wait_until


def _queue(arrivals: str) -> ModelQueue:
    """A queue with one request per letter, in order: "aaab" is three of project a, then one of b."""
    q = ModelQueue()
    for i, p in enumerate(arrivals):
        q.push(Waiter(i, p, float(i), 100.0))
    return q


def _served(q: ModelQueue) -> str:
    out = []
    while (w := q.pop()) is not None:
        out.append(w.project)
    return "".join(out)


@pytest.mark.parametrize(
    ("arrivals", "served"),
    [
        ("aaaaab", "abaaaa"),  # a burst, then one request of another project: it goes second, not sixth
        ("abababab", "abababab"),
        ("aaaabbbc", "abcababa"),  # three projects take turns, each its own oldest first
        ("b", "b"),
        ("", ""),
    ],
)
def test_waiting_requests_are_served_round_robin_by_project(arrivals: str, served: str) -> None:
    assert _served(_queue(arrivals)) == served


def test_a_bursty_project_never_starves_a_steady_one() -> None:
    # Project "burst" queues 50 at once; "steady" sends one request after each of the first five served.
    q = _queue("b" * 50)
    order = []
    for n in range(5):
        q.push(Waiter(100 + n, "s", 0.0, 100.0))
        order.append(q.pop().project)  # type: ignore[union-attr]
        order.append(q.pop().project)  # type: ignore[union-attr]
    assert order == ["b", "s"] * 5, "each steady request is behind at most one bursty request"


ops = st.lists(st.one_of(st.sampled_from("abc"), st.just("pop")), max_size=80)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_a_request_is_behind_at_most_one_round_of_any_other_project(steps: list[str]) -> None:
    """A request that joins as the k-th waiting of its project is served after at most k requests of each
    other project — one per round — however many those had queued."""
    q = ModelQueue()
    ahead: dict[int, int] = {}  # waiter id -> its place in its project's line when it joined
    passed: dict[int, dict[str, int]] = {}  # waiter id -> requests of each other project served since
    waiting: dict[int, Waiter] = {}
    for i, step in enumerate(steps):
        if step != "pop":
            w = Waiter(i, step, float(i), 1e9)
            q.push(w)
            ahead[i] = len(q.by_project[step])
            passed[i] = {}
            waiting[i] = w
            continue
        served = q.pop()
        if served is None:
            continue
        waiting.pop(served.id)
        for wid, w in waiting.items():
            if w.project != served.project:
                passed[wid][served.project] = passed[wid].get(served.project, 0) + 1
                assert passed[wid][served.project] <= ahead[wid], (steps, wid)
    assert q.depth == len(waiting)


def test_bounds_per_model_and_per_project() -> None:
    q = _queue("aab")
    assert q.room("a", max_model=4, max_project=2) == PROJECT_FULL, "a has its two"
    assert q.room("b", max_model=4, max_project=2) is None, "b has room in its own share"
    assert q.room("c", max_model=3, max_project=2) == FULL, "the model's queue holds three"
    assert q.room("c", max_model=4, max_project=2) is None


def test_a_request_taken_out_leaves_no_trace_and_its_project_loses_its_turn_when_empty() -> None:
    q = _queue("ab")
    b = q.by_project["b"][0]
    assert q.remove(b) and not q.remove(b), "removed once"
    assert q.depth == 1 and "b" not in q.by_project and list(q.turns) == ["a"]
    assert _served(q) == "a"


def test_expired_requests_are_those_past_their_deadline() -> None:
    q = ModelQueue()
    for i, deadline in enumerate((5.0, 10.0, 7.0)):
        q.push(Waiter(i, "abc"[i], 0.0, deadline))
    assert sorted(w.id for w in q.expired(7.0)) == [0, 2]
    assert q.expired(4.9) == []


@pytest.mark.parametrize(
    ("depth", "drain_s", "wait_s", "expected"),
    [
        (64, None, 30.0, 15),  # nothing drained yet: half the queue's deadline
        (64, 0.05, 30.0, 4),  # 64 waiting, a slot frees every 50 ms: about 3.2 s
        (64, 2.0, 30.0, 30),  # never longer than the deadline: by then everyone waiting is gone
        (1, 0.001, 30.0, 1),  # at least a second
    ],
)
def test_retry_after_is_the_waiting_requests_at_the_drain_rate_seen(
    depth: int, drain_s: float | None, wait_s: float, expected: int
) -> None:
    assert retry_after_s(depth, drain_s, wait_s) == expected


def test_the_drain_rate_follows_slots_freeing_while_requests_wait() -> None:
    q = _queue("ab")
    q.freed(10.0)
    q.freed(10.5)
    assert q.drain_s == 0.5
    q.freed(11.5)
    assert q.drain_s == pytest.approx(0.6)
    q.pop(), q.pop()
    q.freed(50.0)  # nobody waited: an idle gap is not a drain rate
    assert q.drain_s == pytest.approx(0.6)


class Slots:
    """A model's in-flight count and slots, as the router would measure them."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.in_flight = 0

    def load(self, model: str) -> tuple[int, int]:
        return self.in_flight, self.slots


async def _serve_one(gate: Gate, slots: Slots, project: str, served: list[str], done: asyncio.Event) -> None:
    """A request as the router runs it: wait if it must, hold the slot until told to finish."""
    if not gate.passes("m"):
        await gate.wait("m", project, lambda: False)
        gate.sent("m")
    slots.in_flight += 1
    served.append(project)
    await done.wait()
    slots.in_flight -= 1
    gate.released("m")


async def test_the_gate_grants_freed_slots_in_fair_order_and_holds_no_slot_after() -> None:
    slots = Slots(1)
    gate = Gate(slots.load, max_per_model=100, max_per_project=100, wait_s=60.0)
    served: list[str] = []
    finish = {i: asyncio.Event() for i in range(7)}
    # One request in flight, then a burst of five from a and one from b.
    tasks = [asyncio.create_task(_serve_one(gate, slots, "a", served, finish[0]))]
    await wait_until(lambda: served == ["a"], what="the first request to be sent")
    for i in range(1, 6):
        tasks.append(asyncio.create_task(_serve_one(gate, slots, "a", served, finish[i])))
    tasks.append(asyncio.create_task(_serve_one(gate, slots, "b", served, finish[6])))
    await wait_until(lambda: gate.depths() == {"m": 6}, what="six requests waiting")
    for i in (0, 1, 6, 2, 3, 4, 5):  # finish each in the order they are served
        finish[i].set()
        await wait_until(lambda n=len(served): len(served) > n or len(served) == 7, what="the next to be served")
    await asyncio.gather(*tasks)
    assert served == ["a", "a", "b", "a", "a", "a", "a"], "b's one request went second in line, not last"
    assert slots.in_flight == 0 and gate.granted == {"m": 0} and gate.depths() == {"m": 0}


async def test_a_full_queue_refuses_with_its_depth_and_the_reason() -> None:
    slots = Slots(0)  # no slot frees: everyone waits
    rejected: list[tuple[str, str]] = []
    gate = Gate(
        slots.load,
        max_per_model=3,
        max_per_project=2,
        wait_s=60.0,
        on_refuse=lambda m, why: rejected.append((m, why)),
    )
    waits = [asyncio.create_task(gate.wait("m", p, lambda: False)) for p in "aab"]
    await wait_until(lambda: gate.depths() == {"m": 3}, what="three waiting")
    with pytest.raises(QueueRefused) as full:
        await gate.wait("m", "c", lambda: False)
    assert (full.value.reason, full.value.depth) == (FULL, 3) and full.value.retry_after >= 1
    gate.max_per_model = 10
    with pytest.raises(QueueRefused) as mine:
        await gate.wait("m", "a", lambda: False)
    assert mine.value.reason == PROJECT_FULL
    assert rejected == [("m", FULL), ("m", PROJECT_FULL)]
    for t in waits:
        t.cancel()
    await asyncio.gather(*waits, return_exceptions=True)
    assert gate.depths() == {"m": 0} and gate.granted.get("m", 0) == 0, "cancelled waiters leave at once"


async def test_a_request_past_its_deadline_is_refused_and_leaves_the_queue() -> None:
    slots = Slots(0)
    rejected: list[str] = []
    gate = Gate(slots.load, 10, 10, wait_s=0.2, on_refuse=lambda m, why: rejected.append(why))
    with pytest.raises(QueueRefused) as late:
        await gate.wait("m", "a", lambda: False)
    assert late.value.reason == TIMEOUT and rejected == [TIMEOUT] and gate.depths() == {"m": 0}


async def test_a_client_that_leaves_while_waiting_leaves_the_queue_and_takes_no_slot() -> None:
    slots = Slots(1)
    slots.in_flight = 1
    gate = Gate(slots.load, 10, 10, wait_s=60.0)
    left = False
    waiting = asyncio.create_task(gate.wait("m", "a", lambda: left))
    behind = asyncio.create_task(gate.wait("m", "b", lambda: False))
    await wait_until(lambda: gate.depths() == {"m": 2}, what="two waiting")
    left = True
    with pytest.raises(ClientLeft):
        await waiting
    assert gate.depths() == {"m": 1}
    slots.in_flight = 0
    gate.released("m")
    await behind  # the slot went to the one still there
    assert gate.granted == {"m": 1}
    gate.sent("m")
    assert gate.granted == {"m": 0}


async def test_a_handler_cancelled_after_its_grant_gives_the_slot_to_the_next() -> None:
    slots = Slots(1)
    slots.in_flight = 1
    gate = Gate(slots.load, 10, 10, wait_s=60.0)
    first = asyncio.create_task(gate.wait("m", "a", lambda: False))
    second = asyncio.create_task(gate.wait("m", "b", lambda: False))
    await wait_until(lambda: gate.depths() == {"m": 2}, what="two waiting")
    slots.in_flight = 0
    gate.released("m")  # grants the first; it is cancelled before it runs again
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    await second
    assert gate.granted == {"m": 1}, "the second holds the one slot, the first's grant was handed on"


async def test_a_new_replica_lets_waiting_requests_go_without_a_slot_freeing() -> None:
    slots = Slots(1)
    slots.in_flight = 1
    gate = Gate(slots.load, 10, 10, wait_s=60.0)
    waiting = asyncio.create_task(gate.wait("m", "a", lambda: False))
    await wait_until(lambda: gate.depths() == {"m": 1}, what="one waiting")
    slots.slots = 2  # a second replica became ready
    await waiting
    assert gate.granted == {"m": 1}


def _r(rid: str, slots: int | None = None) -> ReplicaInfo:
    return ReplicaInfo(replica_id=rid, model="m", node_id="n", state="ready", url=f"http://{rid}", slots=slots)


@pytest.mark.parametrize(
    ("outstanding", "engines", "preferred", "expected"),
    [
        # No engine reports: this router's own in-flight counts, as before.
        ({"a": 1, "b": 0}, {}, None, ["b", "a"]),
        # b's engine holds 3 waiting from other routers: a, with one of ours in flight, is less loaded.
        ({"a": 1, "b": 0}, {"b": EngineLoad(waiting=3)}, None, ["a", "b"]),
        # Equal load: the engine with less of its KV cache in use first.
        ({}, {"a": EngineLoad(kv_usage=0.9), "b": EngineLoad(kv_usage=0.2)}, None, ["b", "a"]),
        # An engine its agent cannot reach goes last and loses its prefix, however idle it looks.
        ({"b": 3}, {"a": EngineLoad(unreachable=True)}, "a", ["b", "a"]),
        # The prefix's replica keeps it below its slots as its engine reports them (2, under the default 4)…
        ({"a": 1, "b": 0}, {"a": EngineLoad(slots=2)}, "a", ["a", "b"]),
        ({"a": 2, "b": 0}, {"a": EngineLoad(slots=2)}, "a", ["b", "a"]),
        # …and never past `saturation`, however many slots: a shared prefix must not pile onto one replica.
        ({"a": 4, "b": 0}, {"a": EngineLoad(slots=256)}, "a", ["b", "a"]),
    ],
)
def test_replicas_are_ranked_by_what_their_engines_report_where_they_report_it(
    outstanding: dict[str, int], engines: dict[str, EngineLoad], preferred: str | None, expected: list[str]
) -> None:
    for seed in (0, 1, 65535):
        ranked = order([_r("a"), _r("b")], outstanding, preferred, 4, seed, engines)
        assert [r.replica_id for r in ranked] == expected


def test_a_replicas_slots_are_its_engines_report_else_its_profiles_else_the_default() -> None:
    assert slots_of(_r("a", 2), {"a": EngineLoad(slots=6)}, 4) == 6
    assert slots_of(_r("a", 2), {"a": EngineLoad(waiting=1)}, 4) == 2
    assert slots_of(_r("a"), {}, 4) == 4
    placed = M.Profile(engine="vllm")
    assert slots_of_profile(placed) == 256, "vLLM batches hundreds: its default max_num_seqs"
    assert slots_of_profile(M.Profile(parallel=3)) == 3 and slots_of_profile(M.Profile()) is None


def _beat(node: str, *replicas: N.ReplicaReport) -> N.NodeHeartbeat:
    now = datetime.now(UTC)
    return N.NodeHeartbeat(
        node_id=node, at=now, agent_version="t", agent_started_at=now, address="127.0.0.1", replicas=list(replicas)
    )


def _report(rid: str, **signals: object) -> N.ReplicaReport:
    return N.ReplicaReport(replica_id=rid, model="m", pid=1, port=2, state="ready", **signals)  # type: ignore[arg-type]


def test_a_heartbeat_gives_the_load_of_the_engines_that_report_one() -> None:
    hb = _beat(
        "n1",
        _report("a", requests_waiting=2, kv_cache_usage=0.5, slots=4),
        _report("b"),  # an older agent, or no scrape yet: nothing said
        _report("c", unreachable=True, requests_waiting=9),
    )
    assert engine_loads(hb) == {
        "a": EngineLoad(waiting=2, kv_usage=0.5, slots=4),
        "c": EngineLoad(unreachable=True),
    }


class _Store:
    js = nc = None


def test_a_router_forgets_the_engine_loads_of_a_node_gone_silent() -> None:
    router = Router(_Store(), RouterConfig())  # type: ignore[arg-type]
    router.engines_seen(_beat("n1", _report("a", requests_waiting=1)), now=100.0)
    router.engines_seen(_beat("n2", _report("b", requests_waiting=2)), now=110.0)
    assert set(router.engines) == {"a", "b"}
    router.engines_seen(_beat("n2", _report("b", requests_waiting=0)), now=100.0 + ENGINE_STALE_S + 1)
    assert router.engines == {"b": EngineLoad(waiting=0)}, "n1 has said nothing for three heartbeats"


actions = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from("abc")),
        st.tuples(st.just("finish"), st.integers(0, 20)),
        st.tuples(st.just("cancel"), st.integers(0, 20)),
        st.tuples(st.just("leave"), st.integers(0, 20)),
        st.tuples(st.just("finish, then cancel the waiting"), st.integers(0, 20)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), actions)
def test_no_slot_is_ever_overgiven_or_leaked_whatever_arrives_finishes_is_cancelled_or_leaves(
    slots_n: int, steps: list[tuple[str, object]]
) -> None:
    """Requests arrive, finish, are cancelled while waiting (or just after their grant) and leave, in any
    order: in flight plus granted never exceeds the slots, and once everything has ended nothing is held."""

    async def run() -> None:
        slots = Slots(slots_n)
        gate = Gate(slots.load, max_per_model=100, max_per_project=100, wait_s=60.0)
        gate.SWEEP_S = 0.001  # type: ignore[misc]
        tasks: list[asyncio.Task[None]] = []
        done: list[asyncio.Event] = []
        left: list[bool] = []
        sent: set[int] = set()

        async def request(i: int, project: str) -> None:
            if not gate.passes("m"):
                await gate.wait("m", project, lambda: left[i])
                gate.sent("m")
            sent.add(i)
            slots.in_flight += 1
            try:
                await done[i].wait()
            finally:
                slots.in_flight -= 1
                gate.released("m")

        async def settle() -> None:
            for _ in range(5):
                await asyncio.sleep(0.002)
            assert slots.in_flight + gate.granted.get("m", 0) <= slots.slots

        for kind, arg in steps:
            if kind == "arrive":
                i = len(tasks)
                done.append(asyncio.Event())
                left.append(False)
                tasks.append(asyncio.create_task(request(i, str(arg))))
            elif tasks:
                i = int(arg) % len(tasks)  # type: ignore[call-overload]
                if kind == "finish":
                    done[i].set()
                    # One turn of the loop: the finished request releases its slot and the next waiter is
                    # granted it but has not run yet, so a "cancel" next may land between grant and send.
                    await asyncio.sleep(0)
                    continue
                elif kind == "finish, then cancel the waiting":
                    for j in sent:
                        done[j].set()
                    await asyncio.sleep(0)
                    for j, t in enumerate(tasks):
                        if j not in sent:
                            t.cancel()  # the one just granted a slot among them
                elif kind == "cancel":
                    tasks[i].cancel()
                else:
                    left[i] = True
            await settle()
        for e in done:
            e.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        await gate.close()
        assert slots.in_flight == 0 and gate.granted.get("m", 0) == 0 and gate.depths().get("m", 0) == 0

    asyncio.run(run())
