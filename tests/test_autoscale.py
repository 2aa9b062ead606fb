"""Autoscaling (SCHED-9) as stories over the pure reconciler and an injected clock: the engines' load
arrives in heartbeats, the pass adds or removes one replica at a time between min and max, and the
step is a ``model.autoscaled`` event a new leader folds."""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.events.folds import models as MF
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.services.scheduler import autoscale as AS
from llmgw.services.scheduler import load as LD
from llmgw.services.scheduler.state import ClusterState
from llmgw.services.scheduler.vocabulary import Config
from tests.scheduler_world import T0, World, model, node, placed, ready, said

CFG = Config()


def world(min: int = 1, max: int = 3, replicas: int = 1) -> World:
    """Model m (min, max) with ``replicas`` ready replicas on node a (16 cores, room for many)."""
    w = World().add(node("a"), model("m", min=min, max=max, cores=1, mem=1))
    for i in range(1, replicas + 1):
        w.add(placed(f"m-{i}", "m", "a"), ready(f"m-{i}"))
    return w


def report(w: World, running: int, waiting: int, slots: int | None = 1) -> None:
    """Node a reports now: the load spread over m's ready replicas (the first ones take the rest)."""
    ready_ids = sorted(r.id for r in w.state.replicas_of("m") if r.state == "ready")
    reps = []
    for i, rid in enumerate(ready_ids):
        n = len(ready_ids)
        reps.append(
            N.ReplicaReport(
                replica_id=rid,
                model="m",
                pid=1,
                port=20000 + i,
                state="ready",
                requests_running=running // n + (1 if i < running % n else 0),
                requests_waiting=waiting // n + (1 if i < waiting % n else 0),
                slots=slots,
            )
        )
    w.beats["a"] = msgspec.structs.replace(w.beats["a"], replicas=reps)
    w.beat("a")


def hold(
    w: World, seconds: float, running: int, waiting: int, *, slots: int | None = 1, every: float = 5.0
) -> list[str]:
    """This load from now for ``seconds``, reported every ``every`` s with a committed pass after each
    report: what the passes said (but waits). New replicas stay starting until :func:`make_ready`."""
    out: list[str] = []
    t_end = w.t + seconds
    while True:  # the load changes now, and is reported every `every` s until the end
        report(w, running, waiting, slots)
        out += [said(d) for d in w.step(CFG) if not said(d).startswith("waiting")]
        if w.t >= t_end:
            return out
        w.advance(min(every, t_end - w.t))


def make_ready(w: World) -> None:
    for r in w.state.replicas_of("m"):
        if r.active and r.state != "ready":
            w.add(ready(r.id))


def test_a_sustained_queue_adds_one_replica_after_a_minute() -> None:
    w = world()
    assert hold(w, 55, running=1, waiting=3) == [], "not yet a minute"
    said_now = hold(w, 5, running=1, waiting=3)
    assert said_now == [
        "autoscale m 1 -> 2: 3 requests waiting on 1 ready replica, 3.0 a replica on average over 60 s",
        "place m on a",
    ]
    assert w.state.models["m"].status.autoscaled == 1, "the step is an event the model fold keeps"


def test_a_short_burst_adds_none() -> None:
    w = world()
    assert hold(w, 40, running=1, waiting=5) == []
    assert hold(w, 120, running=1, waiting=0) == [], "the queue emptied before the minute: nothing waits now"
    assert w.active("m") == ["m-1"]


def test_a_queue_that_dips_for_a_moment_still_counts_as_held() -> None:
    # Engines' queues are noisy: one heartbeat with nothing waiting does not restart the minute.
    w = world()
    assert hold(w, 30, running=1, waiting=3) == []
    assert hold(w, 5, running=1, waiting=0) == []
    said_now = hold(w, 25, running=1, waiting=3)
    assert (
        said_now[0] == "autoscale m 1 -> 2: 3 requests waiting on 1 ready replica, 2.8 a replica on average over 60 s"
    )


def test_a_queue_below_one_waiting_request_per_ready_replica_adds_none() -> None:
    w = world(replicas=2)
    assert hold(w, 600, running=2, waiting=1) == [], "1 waiting on 2 ready is half a request each"


def test_no_flapping_under_a_steady_load_at_the_threshold() -> None:
    # Two requests all day on one-slot engines: one replica leaves one waiting, two serve both.
    w = world()
    first = hold(w, 60, running=1, waiting=1)
    assert first[0].startswith("autoscale m 1 -> 2")
    make_ready(w)
    # Nothing waits now, but both replicas are busy: removing one would queue again, so it stays.
    assert hold(w, 6 * 3600, running=2, waiting=0, every=30) == []
    assert len(w.active("m")) == 2


def test_a_step_waits_for_the_previous_addition_to_be_ready() -> None:
    w = world()
    assert hold(w, 60, running=1, waiting=4)[0].startswith("autoscale m 1 -> 2")
    # The new replica is still starting: the queue goes on, no second step.
    assert hold(w, 300, running=1, waiting=4) == []
    make_ready(w)
    # Ready now: its own minute of queue (at two ready replicas) before the next step.
    assert hold(w, 55, running=2, waiting=4) == []
    assert hold(w, 5, running=2, waiting=4)[0] == (
        "autoscale m 2 -> 3: 4 requests waiting on 2 ready replicas, 2.0 a replica on average over 60 s"
    )


def test_ten_idle_minutes_remove_one_load_added_replica() -> None:
    w = world()
    hold(w, 60, running=1, waiting=2)
    make_ready(w)
    assert hold(w, 595, running=0, waiting=0) == []
    said_now = hold(w, 5, running=0, waiting=0)
    assert said_now[0] == "autoscale m 2 -> 1: nothing waiting for 600 s; at most 0 running on 2 ready replicas"
    assert said_now[1].startswith("stop m-") and "autoscaled to 1" in said_now[1]
    assert w.state.models["m"].status.autoscaled == 0


def test_idle_never_goes_below_min_nor_takes_a_replica_an_operators_min_asked_for() -> None:
    w = world(min=2, max=4, replicas=2)
    assert hold(w, 3600, running=0, waiting=0, every=30) == []
    assert len(w.active("m")) == 2


def test_max_is_a_ceiling() -> None:
    w = world(min=1, max=2)
    hold(w, 60, running=1, waiting=9)
    make_ready(w)
    assert hold(w, 600, running=2, waiting=9) == [], "at max: the queue stays, no third replica"
    assert len(w.active("m")) == 2


def test_an_operator_lowering_max_ends_what_the_load_added() -> None:
    w = world(min=1, max=3)
    hold(w, 60, running=1, waiting=2)
    make_ready(w)
    w.emit(M.AGGREGATE, "m", M.ModelScaled(min=1, max=1))
    said_now = [said(d) for d in w.step(CFG)]
    assert said_now[0] == "autoscale m 2 -> 1: max 1 leaves no room above min 1"
    assert any(s.startswith("stop m-") for s in said_now)


def test_a_new_leader_folds_model_autoscaled_and_continues() -> None:
    w = world()
    hold(w, 60, running=1, waiting=2)
    make_ready(w)
    hold(w, 120, running=0, waiting=0)

    # The leader dies; the new one has folded the same log (here: the durable fold, through a
    # snapshot's bytes), and of the load only what it observes from now on.
    heir = ClusterState.decode(w.state.encode())
    assert heir.models["m"].status.autoscaled == 1
    assert heir.load == {}, "the load is an observation, not an event"
    w.state = heir
    # It keeps what the load added (not the minimum), and counts its idle window from what it saw:
    # it cannot know that nothing waited before it led.
    assert hold(w, 595, running=0, waiting=0) == []
    out = hold(w, 5, running=0, waiting=0)
    assert out[0] == "autoscale m 2 -> 1: nothing waiting for 600 s; at most 0 running on 2 ready replicas"
    assert heir.models["m"].status.autoscaled == 0


def test_a_measured_model_scales_on_requests_per_replica_past_its_slo_concurrency() -> None:
    m = world().state.models["m"]
    measured = AS.Measurement(concurrency=4)
    for waiting, running, expect in ((0, 4, None), (1, 4, 2), (0, 5, 2)):
        load = LD.ModelLoad()
        for t in (0.0, 61.0):
            LD.fold_load(load, LD.LoadSample(at=t, waiting=waiting, running=running, ready=1, slots=4))
        live = world().state.replicas_of("m")
        clock = World().advance(61).clock()
        *_, step = AS.adjust(m, 1, 3, live, load, clock, CFG, measured)
        assert (step.to if step else None) == expect, (waiting, running)


def test_the_load_series_keeps_only_changes_and_a_bounded_past() -> None:
    load = LD.ModelLoad()
    for t in range(0, 4000, 5):
        LD.fold_load(load, LD.LoadSample(at=float(t), waiting=0, running=1, ready=1))
    assert len(load.samples) == 1 and load.seen_at == 3995.0
    for t in range(4000, 8000, 5):
        LD.fold_load(load, LD.LoadSample(at=float(t), waiting=t % 2, running=1, ready=1))
    assert load.samples[1].at >= 7995 - LD.KEEP_S and load.samples[0].at <= 7995 - LD.KEEP_S


def test_model_autoscaled_is_a_fact_every_reader_folds_the_same() -> None:
    status = MF.fold_model(None, M.ModelAdded(spec=world().state.models["m"].spec))
    up = MF.fold_model(status, M.ModelAutoscaled(from_=1, to=2, added=1, reason="load", at=T0))
    assert up is not None and (up.autoscaled, up.autoscaled_at) == (1, T0)
    stopped = MF.fold_model(up, M.ModelStopped(saved_min=1, saved_max=3))
    assert stopped is not None and stopped.autoscaled == 0, "a stop ends what the load added"
    wire = msgspec.json.encode(M.ModelAutoscaled(from_=1, to=2, added=1, reason="r", at=1.0))
    assert b'"from":1' in wire


def test_the_metrics_say_what_the_load_added_and_the_engines_load() -> None:
    from llmgw.services.scheduler.metrics import fleet_figures

    w = world()
    hold(w, 60, running=1, waiting=3)
    [f] = fleet_figures(w.state, T0 + w.t, CFG, []).models
    assert (f.desired, f.autoscaled, f.requests_running, f.requests_waiting) == (2, 1, 1, 3)


def test_the_last_load_of_nodes_that_fell_silent_makes_no_step() -> None:
    w = world()
    hold(w, 50, running=1, waiting=3)
    w.advance(40)  # no heartbeat since: what the engines said then is not the load now
    assert not [s for s in (said(d) for d in w.run(CFG)) if s.startswith("autoscale")]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bounds=st.tuples(st.integers(1, 3), st.integers(0, 3)),
    loads=st.lists(st.tuples(st.integers(0, 12), st.integers(5, 400), st.booleans()), min_size=1, max_size=25),
)
def test_whatever_the_load_the_model_holds_between_min_and_max_one_step_at_a_time(
    bounds: tuple[int, int], loads: list[tuple[int, int, bool]]
) -> None:
    lo, extra = bounds
    w = world(min=lo, max=lo + extra, replicas=lo)
    held = lo
    for waiting, seconds, start_now in loads:
        for line in hold(w, seconds, running=lo, waiting=waiting):
            if not line.startswith("autoscale"):
                continue
            before, after = (int(x) for x in line.split(":")[0].split()[-3::2])
            assert before == held and abs(after - before) == 1, line
            assert lo <= after <= lo + extra, line
            held = after
            starting = [r for r in w.state.replicas_of("m") if r.active and r.state != "ready"]
            assert len(starting) <= 1, "one step at a time"
        if start_now:
            make_ready(w)
        assert w.state.models["m"].status.autoscaled == held - lo


def test_explain_says_what_the_load_added_and_the_load_now() -> None:
    from llmgw.services.scheduler.explain import explain

    w = world()
    hold(w, 60, running=1, waiting=3)
    body = explain(w.state, "m", CFG)
    assert body["autoscaling"]["added"] == 1
    assert body["autoscaling"]["load"] == {"waiting": 3, "running": 1, "ready": 1, "slots": 1}


def test_requests_waiting_in_a_routers_queue_count_as_the_models_load() -> None:
    # The gateway holds requests when every replica is saturated: the engines report nothing waiting.
    w = world()
    out: list[str] = []
    for _ in range(13):
        w.state.observe_queue("gw-1", {"m": 2}, w.t)
        out += hold(w, 0, running=1, waiting=0)
        w.advance(5)
    assert out[0] == "autoscale m 1 -> 2: 2 requests waiting on 1 ready replica, 2.0 a replica on average over 60 s"
    w.state.observe_queue("gw-1", {}, w.t)  # its queue emptied
    assert w.state.load["m"].samples[-1].waiting == 0


def test_the_simulated_morning_adds_replicas_and_uses_less_than_a_fleet_held_at_the_peak() -> None:
    from tests.bench.autoscale import simulate

    out = simulate(hours=3, seed=1, slots=4, service_s=20, peak=40, trough=2, ttft_slo_s=10)
    assert out["replicas_added"] >= 1, "the morning's rise adds replicas"
    assert out["replica_minutes_used"] < out["static_at_peak_replica_minutes"]
