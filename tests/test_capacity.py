"""Measured capacity per replica (SCHED-10, SCHED-11) as pure rules: how `ctl bench` judges its steps, how a
``model.measured`` is folded and checked, which measurement the autoscaler follows, how it moves the
lines (up past the measured concurrency; down only when the rest stay under 70 % of it), and the
arithmetic of `ctl model target`."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.bench import capacity as C
from llmgw.events.folds import models as MF
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject
from llmgw.services.catalog.rules import Catalog, CatalogEntry, decide
from llmgw.services.scheduler import autoscale as AS
from llmgw.services.scheduler.headroom import headroom
from tests.scheduler_world import T0, on_model
from tests.test_autoscale import CFG, hold, world

SHAPE = M.NodeShape(cpus=16)  # node a of the scheduler world


def measured(concurrency: int = 2, **more: object) -> M.ModelMeasured:
    fields: dict[str, object] = dict(
        profile="default",
        shape=SHAPE,
        node_id="a",
        replica_id="m-1",
        concurrency=concurrency,
        tokens_per_s=100.0,
        ttft_p95_s=0.2,
        request_tokens_per_s=40.0,
        basis="knee",
        requests=30,
        at=T0,
    )
    return M.ModelMeasured(**(fields | more))  # type: ignore[arg-type]


def step(c: int, total: float, *, failed: int = 0, within: bool | None = None, why: str = "") -> C.Step:
    return C.Step(
        concurrency=c,
        requests=8,
        failed=failed,
        ttft_p95_s=0.1,
        request_tokens_per_s=20.0,
        tokens_per_s=total,
        within_slo=within,
        why=why,
    )


# -- judging the steps ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("totals", "last_step", "best", "more"),
    [
        ([10.0], False, 1, True),  # one step says nothing of the knee yet
        ([10.0, 19.0, 30.0], False, 4, True),  # still rising by 10 % or more
        ([10.0, 19.0, 20.0], False, 2, False),  # 19 -> 20 is +5 %: the knee is at 2
        ([10.0, 10.9], False, 1, False),  # +9 %: the knee is at 1
        ([10.0, 11.0], False, 2, True),  # +10 % exactly is a rise
        ([10.0, 19.0, 30.0], True, 4, False),  # the last step allowed: the answer, saying it may be higher
        ([10.0, 8.0], False, 1, False),  # falling: the knee is before it
    ],
)
def test_without_an_slo_the_answer_is_the_knee_where_total_tokens_per_s_stops_rising_by_ten_percent(
    totals: list[float], last_step: bool, best: int, more: bool
) -> None:
    steps = [step(2**k, total) for k, total in enumerate(totals)]
    v = C.judge(steps, None, last_step=last_step)
    assert v.best is not None and v.best.concurrency == best
    assert v.more is more


def test_a_step_with_a_failed_request_ends_the_knee_search_before_it() -> None:
    v = C.judge([step(1, 10.0), step(2, 30.0, failed=1, why="1 of 8 requests failed")], None)
    assert v.best is not None and v.best.concurrency == 1 and not v.more and "failed" in v.note


@pytest.mark.parametrize(
    ("within", "best", "more"),
    [
        ([True], 1, True),
        ([True, True, False], 2, False),  # the most concurrent step within the SLO
        ([False], None, False),  # even one request misses it
        ([True, True], 2, True),
    ],
)
def test_with_an_slo_the_answer_is_the_most_concurrent_step_within_it(
    within: list[bool], best: int | None, more: bool
) -> None:
    slo = M.Slo(ttft_p95_s=1.0)
    steps = [step(k + 1, 10.0 * (k + 1), within=w, why="" if w else "too slow") for k, w in enumerate(within)]
    v = C.judge(steps, slo)
    assert (v.best.concurrency if v.best else None) == best
    assert v.more is more


@pytest.mark.parametrize(
    ("slo", "within", "says"),
    [
        (M.Slo(ttft_p95_s=0.5), True, ""),
        (M.Slo(ttft_p95_s=0.3), False, "time to first token p95 0.400 s is over the SLO's 0.3 s"),
        (M.Slo(tokens_per_s=9.0), True, ""),  # the slowest request generates 10 tokens/s (9 after its first)...
        (M.Slo(tokens_per_s=10.0), False, "requests' speed 9.0 tokens/s is under the SLO's 10 tokens/s"),
        (None, None, ""),
    ],
)
def test_a_step_is_within_the_slo_by_its_ttft_p95_and_the_speed_95_percent_of_requests_see(
    slo: M.Slo | None, within: bool | None, says: str
) -> None:
    # Twenty requests: TTFT 0.1 … 0.4 s (p95: the 19th, 0.4 s), 10 tokens each over 1 s or 0.5 s.
    samples = [
        C.Sample(ttft_s=0.1 if i < 18 else 0.4, tokens=10, generating_s=1.0 if i == 0 else 0.5) for i in range(20)
    ]
    s = C.summarize(4, samples, wall_s=2.0, slo=slo)
    assert s.ttft_p95_s == pytest.approx(0.4)
    assert s.request_tokens_per_s == pytest.approx(9.0)  # the 5th percentile: the one that took 1 s
    assert s.tokens_per_s == pytest.approx(100.0)  # 200 tokens in 2 s, all requests together
    assert s.within_slo is within
    assert s.why == says


def test_a_failed_request_puts_a_step_outside_the_slo_and_says_why() -> None:
    samples = [
        C.Sample(ttft_s=0.1, tokens=5, generating_s=0.5),
        C.Sample(ttft_s=None, tokens=0, generating_s=0, error="HTTP 429: queue full"),
    ]
    s = C.summarize(2, samples, wall_s=1.0, slo=M.Slo(ttft_p95_s=5.0))
    assert s.failed == 1 and s.within_slo is False and "1 of 2 requests failed (first: HTTP 429: queue full)" in s.why


@pytest.mark.parametrize(
    ("top", "linear", "steps"),
    [(1, False, [1]), (8, False, [1, 2, 4, 8]), (6, False, [1, 2, 4, 6]), (3, True, [1, 2, 3])],
)
def test_concurrency_doubles_up_to_the_most_asked_or_rises_one_at_a_time(
    top: int, linear: bool, steps: list[int]
) -> None:
    assert C.concurrency_steps(top, linear) == steps


# -- ctl model target -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("wanted", "per_replica", "replicas"),
    [(100.0, 120.0, 1), (120.0, 120.0, 1), (121.0, 120.0, 2), (1000.0, 120.0, 9), (0.5, 120.0, 1), (360.0, 120.0, 3)],
)
def test_target_replicas_are_the_tokens_per_s_wanted_over_what_one_serves_rounded_up(
    wanted: float, per_replica: float, replicas: int
) -> None:
    assert C.replicas_for(wanted, per_replica) == replicas


def test_a_measurement_of_no_tokens_sizes_nothing_and_says_so() -> None:
    with pytest.raises(ValueError, match="measure again"):
        C.replicas_for(100.0, 0.0)


# -- the event and the catalog's rules --------------------------------------------------------------


def test_model_measured_keeps_the_newest_measurement_per_profile_and_node_shape() -> None:
    status = MF.fold_model(None, M.ModelAdded(spec=world().state.models["m"].spec))
    gpu = M.NodeShape(cpus=32, gpu="NVIDIA H200", gpus=1)
    for x in (measured(2), measured(3, shape=gpu), measured(4)):
        status = MF.fold_model(status, x)
    assert status is not None
    assert [(x.shape, x.concurrency) for x in status.measured] == [(gpu, 3), (SHAPE, 4)]
    wire = msgspec.json.decode(msgspec.json.encode(measured()), type=M.ModelMeasured)
    assert wire == measured()


def _catalog(declared: bool = False) -> Catalog:
    c = Catalog()
    spec = world().state.models["m"].spec
    c.models["m"] = CatalogEntry(status=MF.ModelStatus(spec=spec, declared=declared))
    return c


@pytest.mark.parametrize(
    ("found", "refusal"),
    [
        (measured(2), None),
        (measured(0), "says nothing to scale on"),
        (measured(2, profile="gpu"), "has no profile 'gpu' (profiles: default)"),
        (measured(2, basis="guess"), "basis 'guess' is not slo or knee"),
        (measured(2, requests=0), "at least one request"),
    ],
)
def test_a_measurement_is_saved_only_when_a_rule_could_use_it(found: M.ModelMeasured, refusal: str | None) -> None:
    for declared in (False, True):  # a measurement is no edit of the definition: declared models take it too
        if refusal is None:
            decision = decide(_catalog(declared), M.SaveMeasurement(name="m", measured=found))
            assert (decision.subject, decision.payloads) == (event_subject(M.AGGREGATE, "m"), [found])
            assert decision.message == (
                "model m: measured one replica of profile default on 16 CPUs serves 2 concurrent requests, 100 tokens/s"
            )
        else:
            with pytest.raises(Rejected, match=refusal.replace("(", r"\(").replace(")", r"\)")):
                decide(_catalog(declared), M.SaveMeasurement(name="m", measured=found))


# -- which measurement the scheduler follows ---------------------------------------------------------


def test_the_autoscaler_follows_the_measurement_of_the_replicas_profile_on_their_node_shape() -> None:
    w = world()
    m = w.state.models["m"]
    live = w.state.replicas_of("m")
    a = [w.state.nodes["a"].capacity]
    assert AS.measurement_of(m, live, a) is None, "nothing saved: the rules without a measurement"

    other_shape = M.NodeShape(cpus=64)
    w.add(on_model("m", measured(3)), on_model("m", measured(5, shape=other_shape)))
    m = w.state.models["m"]
    found = AS.measurement_of(m, live, a)
    assert found is not None and (found.concurrency, found.shape) == (3, SHAPE), "the node's shape, though older"
    elsewhere = N.NodeCapacity(address="b", cpus=8, memory_total_bytes=1)
    found = AS.measurement_of(m, live, [elsewhere])
    assert found is not None and found.concurrency == 5, "no measurement of that shape: the profile's newest"

    w.add(on_model("m", M.ModelChanged(spec=msgspec.structs.replace(m.spec, slo=M.Slo(ttft_p95_s=1.0)))))
    assert AS.measurement_of(w.state.models["m"], live, a) is None, "measured against another SLO: it does not count"


@pytest.mark.parametrize(
    ("running", "waiting", "concurrency", "steps_up"),
    [
        (2, 0, 2, False),  # at the measured concurrency: served within the SLO
        (3, 0, 2, True),  # past it, though nothing waits in the engine
        (1, 1, 2, False),
        (2, 1, 2, True),
        (3, 0, None, False),  # without a measurement: nothing waiting, nothing to add
        (4, 0, 4, False),
        (5, 0, 4, True),
    ],
)
def test_a_measured_model_scales_up_past_its_measured_concurrency_and_not_before(
    running: int, waiting: int, concurrency: int | None, steps_up: bool
) -> None:
    w = world()
    if concurrency is not None:
        w.add(on_model("m", measured(concurrency)))
    said_now = hold(w, 60, running=running, waiting=waiting, slots=8)
    up = [s for s in said_now if s.startswith("autoscale m 1 -> 2")]
    assert bool(up) is steps_up, said_now
    if up and concurrency is not None:
        assert f"above the {concurrency} one replica serves within its SLO" in up[0]


@pytest.mark.parametrize(
    ("peak", "concurrency", "steps_down"),
    [
        (1, 2, True),  # 1 fits in the one replica left under 70 % of 2 (1.4)
        (2, 2, False),  # 2 would be past 70 % of what the rest serve by the measurement
        (2, None, True),  # without one, the engines' 8 slots: 2 is under 70 % of 8
        (2, 3, True),  # 70 % of 3 is 2.1
        (3, 4, False),  # 70 % of 4 is 2.8
    ],
)
def test_a_measured_model_scales_down_only_when_the_rest_stay_under_70_percent_of_measured_capacity(
    peak: int, concurrency: int | None, steps_down: bool
) -> None:
    w = world(replicas=2)
    w.add(on_model("m", M.ModelAutoscaled(from_=1, to=2, added=1, reason="load", at=T0)))
    if concurrency is not None:
        w.add(on_model("m", measured(concurrency)))
    said_now = hold(w, 600, running=peak, waiting=0, slots=8)
    assert any(s.startswith("autoscale m 2 -> 1") for s in said_now) is steps_down, said_now


def test_headroom_says_what_one_more_replica_serves_by_the_measurement() -> None:
    w = world()
    assert headroom(w.state, "m", w.clock(), CFG)["one_more"] is None
    w.add(on_model("m", measured(4, tokens_per_s=120.0)))
    one = headroom(w.state, "m", w.clock(), CFG)["one_more"]
    assert one["line"] == (
        "one more replica serves ~4 concurrent requests, ~120 tokens/s, by the measurement of "
        "2023-11-14 22:13 UTC (profile default, 16 CPUs)"
    )
    assert (one["concurrency"], one["tokens_per_s"]) == (4, 120.0)


@given(st.lists(st.tuples(st.floats(0.0, 1e4), st.booleans(), st.booleans()), min_size=1, max_size=8))
def test_the_answer_is_always_a_step_that_qualifies_and_none_after_it_was_tried(
    raw: list[tuple[float, bool, bool]],
) -> None:
    steps = [step(k + 1, total, within=w, failed=int(f)) for k, (total, w, f) in enumerate(raw)]
    slo = M.Slo(ttft_p95_s=1.0)
    # Steps are run until the verdict says stop: judge the prefix the bench would have reached.
    for n in range(1, len(steps) + 1):
        v = C.judge(steps[:n], slo)
        if not v.more:
            break
    if v.best is not None:
        assert v.best.within_slo and all(s.within_slo for s in steps[: v.best.concurrency])
    for n in range(1, len(steps) + 1):
        k = C.judge(steps[:n], None)
        if not k.more:
            break
    if k.best is not None:
        i = k.best.concurrency - 1
        assert not k.best.failed
        assert i == 0 or steps[i].tokens_per_s >= C.KNEE_RISE * steps[i - 1].tokens_per_s


def test_the_result_says_what_one_replica_serves_and_on_what() -> None:
    r = C.Result(
        model="tiny",
        replica="tiny-1",
        node="n1",
        profile="default",
        shape=M.NodeShape(cpus=8),
        slo=None,
        basis="knee",
        steps=[],
        concurrency=2,
        tokens_per_s=3204.5,
        ttft_p95_s=0.104,
        request_tokens_per_s=784.8,
        requests=49,
        at=T0,
    )
    assert C.result_line(r) == (
        "tiny: one replica (default on 8 CPUs) serves 2 concurrent requests at its knee (total tokens/s "
        "stopped rising by 10 %), 3204.5 tokens/s in all, time to first token p95 0.104 s, each request at "
        "least 784.8 tokens/s (95 %)"
    )
    assert r.measured().concurrency == 2 and r.measured().basis == "knee"
    none = msgspec.structs.replace(r, concurrency=0, note="even 1 concurrent: too slow")
    assert C.result_line(none) == "tiny: one replica misses its SLO even at one request (even 1 concurrent: too slow)"


def test_the_metrics_say_what_one_replica_serves_by_the_measurement_followed() -> None:
    from llmgw.services.scheduler.metrics import fleet_figures

    w = world()
    [f] = fleet_figures(w.state, T0, CFG, []).models
    assert (f.measured_concurrency, f.measured_tokens_per_s) == (None, None), "no measurement: no series"
    w.add(on_model("m", measured(4, tokens_per_s=120.0)))
    [f] = fleet_figures(w.state, T0, CFG, []).models
    assert (f.measured_concurrency, f.measured_tokens_per_s) == (4, 120.0)


@pytest.mark.parametrize(
    ("served", "plan", "found", "tried"),
    [
        (7, [1, 2, 4, 8, 16], 7, [1, 2, 4, 8, 6, 7]),  # doubling finds 4-8, halving the gap finds 7
        (4, [1, 2, 4, 8], 4, [1, 2, 4, 8, 6, 5]),
        (1, [1, 2, 4], 1, [1, 2]),
        (0, [1, 2, 4], None, [1]),
        (20, [1, 2, 4, 8, 16], 16, [1, 2, 4, 8, 16]),  # within at the last step: no gap to halve
        (3, [1, 2, 3, 4], 3, [1, 2, 3, 4]),  # one at a time: nothing between
    ],
)
async def test_with_an_slo_the_gap_between_the_last_step_within_and_the_first_outside_is_halved(
    served: int, plan: list[int], found: int | None, tried: list[int]
) -> None:
    asked: list[int] = []

    async def replica(c: int) -> C.Step:  # a replica that meets the SLO up to `served` concurrent requests
        asked.append(c)
        ok = c <= served
        return step(c, 10.0 * min(c, served), within=ok, why="" if ok else "too slow")

    steps, verdict = await C.climb(replica, M.Slo(ttft_p95_s=1.0), plan)
    assert (verdict.best.concurrency if verdict.best else None) == found
    assert asked == tried
    assert [s.concurrency for s in steps] == sorted(tried)
    assert not verdict.more
