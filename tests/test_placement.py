"""Placement (SCHED-1): properties over generated clusters, then tables of sentences for what a node lacks.

Properties are checked twice: on ``place`` + ``reserve`` directly, and through whole reconcile passes
whose decisions are folded back into a ClusterState as ``replica.placed`` events (the way the
scheduler's shell does), so what the pass builds around placement is covered too.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.services.scheduler.candidates import candidates
from llmgw.services.scheduler.placement import (
    WEIGHTS,
    Candidate,
    Need,
    Verdict,
    check,
    evaluate,
    need_of,
    place,
    reserve,
    scores,
    summarise,
)
from llmgw.services.scheduler.state import ClusterState
from llmgw.services.scheduler.vocabulary import Place
from tests.scheduler_world import (
    CFG,
    CPU_2C_8G,
    CPU_8C_32G,
    CPU_16C_64G,
    GPU_A100X4,
    GPU_H100X8,
    GPU_L4X1,
    OLD_AGENT,
    SHAPES,
    T0,
    Fact,
    Shape,
    World,
    candidate,
    failed,
    model,
    on_model,
    on_node,
    placed,
    ready,
    shaped,
    spec,
    stopped,
)

GiB = 1024**3
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
MANY = settings(PROPS, max_examples=800)  # cheap properties whose counter-examples are rare
ENGINES = ("llamacpp", "vllm")
LABELS = {"zone": ("a", "b"), "tier": ("gold", "bulk")}


# -- node shapes as fixtures ---------------------------------------------------------------------


@pytest.fixture
def cpu_2c_8g() -> Shape:
    return CPU_2C_8G


@pytest.fixture
def cpu_8c_32g() -> Shape:
    return CPU_8C_32G


@pytest.fixture
def cpu_16c_64g() -> Shape:
    return CPU_16C_64G


@pytest.fixture
def gpu_l4x1() -> Shape:
    return GPU_L4X1


@pytest.fixture
def gpu_a100x4() -> Shape:
    return GPU_A100X4


@pytest.fixture
def gpu_h100x8() -> Shape:
    return GPU_H100X8


@pytest.fixture
def old_agent() -> Shape:
    return OLD_AGENT


# -- strategies ----------------------------------------------------------------------------------

labels_st = st.dictionaries(st.sampled_from(sorted(LABELS)), st.sampled_from(("a", "b", "gold", "bulk")), max_size=2)


@st.composite
def candidate_st(draw: st.DrawFn, node_id: str, shape: Shape | None = None) -> Candidate:
    """A node of some shape with some of it already reserved (never more than it has)."""
    shape = shape or draw(st.sampled_from(SHAPES))
    c = candidate(shape, node_id)
    fields: dict[str, object] = {
        "labels": draw(labels_st),
        "model_replicas": draw(st.integers(0, 2)),
        "has_weights": draw(st.booleans()),
        "disk_free_bytes": draw(st.none() | st.integers(0, 400).map(lambda g: g * GiB)),
        "unusable": draw(st.sampled_from(("",) * 6 + ("cordoned (maintenance)", "lost (no heartbeat)", "draining"))),
    }
    if shape.cpus is not None:
        fields["reserved_cores"] = draw(st.integers(0, shape.cpus))
    if shape.mem_gb is not None:
        fields["reserved_memory_bytes"] = draw(st.integers(0, int(shape.mem_gb)).map(lambda g: g * GiB))
    if c.gpus:
        fields["reserved_gpus"] = draw(st.lists(st.sampled_from(sorted(c.gpus)), unique=True))
    if draw(st.integers(0, 9)) == 0:
        fields["engines"] = None  # an agent that does not say
    fields["replicas"] = int(fields["model_replicas"]) + draw(st.integers(0, 4))  # type: ignore[call-overload]
    return msgspec.structs.replace(c, **fields)


def cluster_st(min_size: int = 1, max_size: int = 10) -> st.SearchStrategy[list[Candidate]]:
    return st.integers(min_size, max_size).flatmap(
        lambda n: st.tuples(*(candidate_st(f"n{i:02d}") for i in range(n))).map(list)
    )


@st.composite
def need_st(draw: st.DrawFn, gpu: bool | None = None) -> Need:
    gpus = (
        draw(st.sampled_from((0, 0, 0, 1, 2, 4))) if gpu is None else draw(st.sampled_from((1, 2, 4) if gpu else (0,)))
    )
    return Need(
        engine=draw(st.sampled_from(ENGINES)),
        cores=draw(st.sampled_from((0, 1, 2, 4, 8, 16))),
        memory_bytes=draw(st.sampled_from((0, 1, 4, 8, 32, 96))) * GiB,
        gpus=gpus,
        gpu_min_memory_mb=draw(st.sampled_from((0, 24, 40, 80))) * 1024 if gpus else 0,
        disk_bytes=draw(st.sampled_from((0, 0, 10, 100))) * GiB,
        node_selector=draw(
            st.dictionaries(st.sampled_from(sorted(LABELS)), st.sampled_from(("a", "gold")), max_size=1)
        ),
    )


def within(c: Candidate) -> None:
    """What is reserved on ``c`` fits what it has, where it said what it has."""
    if c.cpus is not None:
        assert c.reserved_cores <= c.cpus, c
    if c.memory_total_bytes is not None:
        assert c.reserved_memory_bytes <= c.memory_total_bytes, c
    assert len(set(c.reserved_gpus)) == len(c.reserved_gpus), f"a GPU given twice on {c.node_id}"
    assert set(c.reserved_gpus) <= set(c.gpus), f"a GPU {c.node_id} does not have"


# -- (a) never over-commit -----------------------------------------------------------------------


@PROPS
@given(cluster=cluster_st(), needs=st.lists(need_st(), min_size=1, max_size=25))
def test_placing_replica_after_replica_never_reserves_more_than_a_node_has(
    cluster: list[Candidate], needs: list[Need]
) -> None:
    nodes = {c.node_id: c for c in cluster}
    for i, need in enumerate(needs):
        choice, verdicts = place(list(nodes.values()), need, seed=f"m/{i}")
        if choice is None:
            assert all(v.reasons for v in verdicts)
            continue
        chosen = nodes[choice.node_id]
        assert check(chosen, need) == [], "only a node with nothing lacking is chosen"
        assert len(choice.gpus) == need.gpus
        assert all(chosen.gpus[g] >= need.gpu_min_memory_mb for g in choice.gpus)
        nodes[choice.node_id] = reserve(chosen, need, choice.gpus)
        within(nodes[choice.node_id])


# Through whole passes: a story of a cluster, told twice with the nodes registering in a different order.

# What happens between two passes (a pass follows every one of these).
ACTIONS = (
    "nothing",
    "ready",
    "ready",
    "fail",
    "stop",
    "scale",
    "cordon",
    "drain",
    "silence",
    "return",
    "retry",
    "forget",
    "remove",
)


@st.composite
def model_facts_st(draw: st.DrawFn, name: str) -> Fact:
    gpus = draw(st.sampled_from((0, 0, 0, 1, 2, 4)))
    return model(
        name,
        draw(st.integers(0, 4)),
        cores=draw(st.sampled_from((None, 1, 2, 4, 8))),
        mem=draw(st.sampled_from((None, 1.0, 4.0, 16.0, 48.0))),
        gpus=gpus,
        gpu_mem=draw(st.sampled_from((0, 24, 40, 80))) if gpus else 0.0,
        engine=draw(st.sampled_from(ENGINES)),
        max=None,
    )


story_st = st.tuples(
    st.lists(st.sampled_from(SHAPES), min_size=1, max_size=6),
    st.integers(1, 5).flatmap(lambda n: st.tuples(*(model_facts_st(f"m{i}") for i in range(n)))),
    st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 1000)), min_size=3, max_size=30),
    st.randoms(use_true_random=False),
)


def indexes_agree(state: ClusterState) -> None:
    """The per-node and per-model indexes hold what a scan of every replica finds."""
    for node_id in {*state.nodes, *(r.node_id for r in state.replicas.values())}:
        assert state.replicas_on(node_id) == [r for r in state.replicas.values() if r.node_id == node_id]
    for name in {*state.models, *(r.model for r in state.replicas.values())}:
        assert state.replicas_of(name) == [r for r in state.replicas.values() if r.model == name]
    assert sorted(state.replica_models()) == sorted({r.model for r in state.replicas.values()})


def no_overcommit(state: ClusterState) -> None:
    for n in state.nodes.values():
        cap = n.capacity
        assert cap is not None
        held = [r for r in state.replicas.values() if r.node_id == n.id and (r.active or r.state == "draining")]
        if cap.cpus is not None:
            assert sum(r.cores for r in held) <= cap.cpus, f"{n.id} over-committed on cores"
        if cap.memory_total_bytes is not None:
            assert sum(r.memory_bytes for r in held) <= cap.memory_total_bytes, f"{n.id} over-committed on memory"
        gpus = [g for r in held for g in r.gpus]
        assert len(gpus) == len(set(gpus)), f"{n.id} gave a GPU twice"
        sizes = {g.index: g.memory_total_mb for g in cap.gpus}
        for r in held:
            want = r.profile.gpus.min_memory_gb * 1024 if r.profile.gpus else 0
            assert all(sizes[g] >= want for g in r.gpus), f"{n.id} gave {r.id} a GPU too small"


def tell(shapes: list[Shape], models: tuple[Fact, ...], actions: list[tuple[str, int]], order: list[int]) -> list[str]:
    """Run the story; check the invariants after every pass; return every decision made."""
    w = World()
    w.add(*(shaped(f"n{i}", shapes[i]) for i in order), *models)
    log: list[str] = []

    def pick(items: list[str], k: int) -> str | None:
        return sorted(items)[k % len(items)] if items else None

    for kind, k in actions:
        decisions = w.run()
        log.append(repr(decisions))
        w.commit(decisions)
        no_overcommit(w.state)
        indexes_agree(w.state)
        replicas = w.state.replicas.values()
        node_ids = sorted(w.state.nodes)
        match kind:
            case "ready" if rid := pick([r.id for r in replicas if r.state == "placed"], k):
                w.add(ready(rid))
            case "fail" if rid := pick([r.id for r in replicas if r.state == "placed"], k):
                w.add(failed(rid))
            case "stop" if rid := pick([r.id for r in replicas if r.state == "draining"], k):
                w.add(stopped(rid))
            case "scale" if w.state.models:
                name = sorted(w.state.models)[k % len(w.state.models)]
                w.add(on_model(name, M.ModelScaled(min=k % 4, max=k % 4 + k % 3)))
            case "retry" if w.state.models:
                name = sorted(w.state.models)[k % len(w.state.models)]
                w.add(on_model(name, M.ModelRetried()))
            case "cordon":
                nid = node_ids[k % len(node_ids)]
                w.add(on_node(nid, N.NodeCordoned(node_id=nid)))
            case "drain":
                nid = node_ids[k % len(node_ids)]
                w.add(on_node(nid, N.NodeDrainRequested(node_id=nid)))
            case "silence":  # all but one node go silent past the limit
                w.advance(31).beat(node_ids[k % len(node_ids)])
            case "return":
                w.beat()
            case "forget":  # a long-lived leader drops what stopped or failed
                w.state.forget_inactive(keep_s=0, now_epoch=T0 + w.t + 1)
            case "remove" if w.state.models:
                name = sorted(w.state.models)[k % len(w.state.models)]
                w.add(on_model(name, M.ModelRemoved()))
    return log


@PROPS
@given(story=story_st)
def test_reconcile_passes_never_over_commit_and_decide_the_same_whatever_order_nodes_registered_in(
    story: tuple[list[Shape], tuple[Fact, ...], list[tuple[str, int]], object],
) -> None:
    shapes, models, actions, rnd = story
    order = list(range(len(shapes)))
    shuffled = list(order)
    rnd.shuffle(shuffled)  # type: ignore[attr-defined]
    assert tell(shapes, models, actions, order) == tell(shapes, models, actions, shuffled)


# -- (b) the same input, the same decision -------------------------------------------------------


@PROPS
@given(cluster=cluster_st(), need=need_st(), data=st.data())
def test_the_same_input_gives_the_same_decision_whatever_the_order_of_candidates(
    cluster: list[Candidate], need: Need, data: st.DataObject
) -> None:
    first = place(cluster, need, seed="m/0/7")
    assert place(cluster, need, seed="m/0/7") == first
    shuffled = data.draw(st.permutations(cluster))
    assert place(shuffled, need, seed="m/0/7") == first


# -- (c) missing data constrains nothing ---------------------------------------------------------

UNREPORTED = [
    ("cpus", "CPUs"),
    ("memory_total_bytes", "memory"),
    ("disk_free_bytes", "disk"),
    ("engines", "cannot run"),
]


@PROPS
@given(c=candidate_st("n"), need=need_st(), field=st.sampled_from(UNREPORTED))
def test_a_node_that_did_not_report_something_is_never_refused_for_it(
    c: Candidate, need: Need, field: tuple[str, str]
) -> None:
    name, words = field
    told = check(c, need)
    untold = check(msgspec.structs.replace(c, **{name: None}), need)
    assert not [r for r in untold if words in r]
    if not c.unusable:
        assert untold == [r for r in told if words not in r], "nothing else changes"


def test_an_old_agent_reporting_no_cpus_is_not_refused_for_cores(old_agent: Shape) -> None:
    c = candidate(old_agent, "old")
    assert check(c, Need(engine="llamacpp", cores=64, memory_bytes=512 * GiB)) == []
    choice, _ = place([c], Need(engine="llamacpp", cores=64), seed="s")
    assert choice is not None and choice.node_id == "old"


# -- (d) spreading -------------------------------------------------------------------------------


@st.composite
def equal_nodes_st(draw: st.DrawFn) -> tuple[Shape, int, Need, int]:
    """A shape, how many equal nodes of it (nothing reserved), a need that fits one, and n ≤ nodes.

    The need is small next to the shape, so that spreading, not room, decides where replicas go.
    """
    shape = draw(st.sampled_from(SHAPES))
    k = draw(st.integers(1, 8))
    gpus = draw(st.integers(1, max(shape.gpus // 2, 1))) if shape.gpus and draw(st.booleans()) else 0
    need = Need(
        engine="llamacpp",
        cores=draw(st.integers(0, (shape.cpus or 32) // 4)),
        memory_bytes=draw(st.integers(0, int(shape.mem_gb or 64) // 4)) * GiB,
        gpus=gpus,
        gpu_min_memory_mb=draw(st.sampled_from((0, shape.gpu_mem_gb))) * 1024 if gpus else 0,
    )
    return shape, k, need, draw(st.integers(1, k))


@MANY
@given(case=equal_nodes_st(), weights=st.lists(st.booleans(), min_size=8, max_size=8))
def test_with_equal_nodes_n_replicas_land_on_n_distinct_nodes(
    case: tuple[Shape, int, Need, int], weights: list[bool]
) -> None:
    shape, k, need, n = case
    # Which nodes already hold the weights does not matter: spreading comes first.
    cands = {f"n{i}": candidate(shape, f"n{i}", has_weights=weights[i]) for i in range(k)}
    chosen = []
    for i in range(n):
        choice, _ = place(list(cands.values()), need, seed=f"m/{i}")
        assert choice is not None
        chosen.append(choice.node_id)
        cands[choice.node_id] = reserve(cands[choice.node_id], need, choice.gpus)
    assert len(set(chosen)) == n, chosen


@PROPS
@given(case=equal_nodes_st(), weights=st.lists(st.booleans(), min_size=8, max_size=8))
def test_a_reconcile_pass_spreads_a_models_replicas_over_equal_nodes(
    case: tuple[Shape, int, Need, int], weights: list[bool]
) -> None:
    shape, k, need, n = case
    w = World().add(*(shaped(f"n{i}", shape, weights=["m/v1"] if weights[i] else []) for i in range(k)))
    w.add(on_model("m", M.ModelAdded(spec=spec_for("m", n, need))))
    placed_on = [d.node_id for d in w.run() if isinstance(d, Place)]
    assert len(placed_on) == n and len(set(placed_on)) == n, placed_on


def spec_for(name: str, n: int, need: Need) -> M.ModelSpec:
    profile = M.Profile(
        engine=need.engine,
        cpu_cores=need.cores or None,
        min_memory_gb=need.memory_bytes / GiB or None,
        gpus=M.GpuRequest(count=need.gpus, min_memory_gb=need.gpu_min_memory_mb / 1024) if need.gpus else None,
    )
    return M.ModelSpec(name=name, source=f"/models/{name}", scaling=M.Scaling(min=n), profiles=[profile])


@PROPS
@given(
    others=st.lists(st.sampled_from(("cordoned", "lost (no heartbeat)", "engine", "full")), min_size=1, max_size=6),
    n=st.integers(1, 8),
)
def test_spreading_is_dropped_when_it_is_the_only_obstacle(others: list[str], n: int) -> None:
    need = Need(engine="llamacpp", cores=2, memory_bytes=4 * GiB)
    room = candidate(CPU_16C_64G, "room")  # 8 such replicas fit
    rest = []
    for i, why in enumerate(others):
        c = candidate(CPU_16C_64G, f"other{i}")
        match why:
            case "engine":
                c = msgspec.structs.replace(c, engines=["vllm"])
            case "full":
                c = msgspec.structs.replace(c, reserved_cores=15)
            case _:
                c = msgspec.structs.replace(c, unusable=why)
        rest.append(c)
    cands = {c.node_id: c for c in [*rest, room]}
    for i in range(n):
        choice, _ = place(list(cands.values()), need, seed=f"m/{i}")
        assert choice is not None and choice.node_id == "room"
        cands["room"] = reserve(cands["room"], need, choice.gpus)


@PROPS
@given(n=st.integers(1, 8), cordoned=st.integers(1, 5))
def test_a_reconcile_pass_puts_every_replica_on_the_one_node_with_room(n: int, cordoned: int) -> None:
    w = World().add(shaped("room", CPU_16C_64G))
    for i in range(cordoned):
        w.add(shaped(f"c{i}", CPU_16C_64G), on_node(f"c{i}", N.NodeCordoned(node_id=f"c{i}")))
    w.add(model("m", n, cores=2, mem=4))
    assert [d.node_id for d in w.run() if isinstance(d, Place)] == ["room"] * n


# -- (e) GPU profiles pack -----------------------------------------------------------------------


@MANY
@given(
    cluster=st.lists(st.sampled_from((GPU_L4X1, GPU_A100X4, GPU_H100X8)), min_size=1, max_size=8).flatmap(
        lambda shapes: st.tuples(*(candidate_st(f"g{i}", s) for i, s in enumerate(shapes)))
    ),
    need=need_st(gpu=True),
)
def test_gpu_profiles_pack_onto_the_node_with_the_fewest_free_gpus_that_fit(
    cluster: tuple[Candidate, ...], need: Need
) -> None:
    # Equal in everything but the GPUs: usable, no replicas of the model yet, no weights anywhere.
    cands = [msgspec.structs.replace(c, unusable="", model_replicas=0, has_weights=False) for c in cluster]
    need = msgspec.structs.replace(need, node_selector={}, disk_bytes=0)
    choice, verdicts = place(cands, need, seed="g/0")
    fitting = {v.node_id for v in verdicts if v.fits}
    if choice is None:
        assert not fitting
        return
    free = {c.node_id: len(c.free_gpus(need.gpu_min_memory_mb)) for c in cands if c.node_id in fitting}
    assert free[choice.node_id] == min(free.values()), (choice.node_id, free)
    assert choice.gpus == sorted(choice.gpus)


@PROPS
@given(c=candidate_st("n"), need=need_st())
def test_every_score_is_between_0_and_1_and_a_verdict_carries_the_same_scores(c: Candidate, need: Need) -> None:
    (verdict,) = evaluate([c], need)
    assert verdict.reasons == check(c, need)
    if verdict.fits:
        assert verdict.scores == scores(c, need)
        assert all(0.0 <= v <= 1.0 for v in verdict.scores.values())
        assert verdict.score == round(sum(WEIGHTS[k] * v for k, v in verdict.scores.items()), 6)


@PROPS
@given(cluster=cluster_st(max_size=30), need=need_st())
def test_a_verdict_says_the_same_as_check_for_every_node_of_a_cluster(cluster: list[Candidate], need: Need) -> None:
    # evaluate() writes each sentence once per evaluation and reuses it: never for the wrong node.
    assert {v.node_id: v.reasons for v in evaluate(cluster, need)} == {c.node_id: check(c, need) for c in cluster}


# -- what a node lacks, in sentences -------------------------------------------------------------

NEED_4C = Need(engine="llamacpp", cores=4, memory_bytes=8 * GiB)

CHECKS: list[tuple[str, str, dict[str, object], Need, list[str]]] = [
    ("a node with room lacks nothing", "cpu_16c_64g", {}, NEED_4C, []),
    (
        "a node short of cores says how many it has, how many are free and how many are needed",
        "cpu_8c_32g",
        {"reserved_cores": 6},
        NEED_4C,
        ["has 8 CPUs with 2 free, needs 4"],
    ),
    (
        "a node whose reservations exceed what it now reports shows 0 free, never a negative",
        "cpu_2c_8g",
        {"reserved_cores": 4},
        NEED_4C,
        ["has 2 CPUs with 0 free, needs 4"],
    ),
    (
        "a node short of memory says what it has and what is free",
        "cpu_16c_64g",
        {"reserved_memory_bytes": 60 * GiB},
        NEED_4C,
        ["has 64.0 GB memory with 4.0 GB free, needs 8.0 GB"],
    ),
    (
        "a small node lacking both cores and memory says both, cores first",
        "cpu_2c_8g",
        {"reserved_memory_bytes": 2 * GiB},
        NEED_4C,
        ["has 2 CPUs with 2 free, needs 4", "has 8.0 GB memory with 6.0 GB free, needs 8.0 GB"],
    ),
    (
        "a node without the engine names the engines it has",
        "cpu_16c_64g",
        {},
        Need(engine="vllm"),
        ["cannot run vllm (engines: llamacpp)"],
    ),
    (
        "a node that probed no engine says so",
        "cpu_16c_64g",
        {"engines": []},
        NEED_4C,
        ["cannot run llamacpp (engines: none)"],
    ),
    ("a node that did not report its engines can run any", "cpu_16c_64g", {"engines": None}, Need(engine="vllm"), []),
    (
        "a missing label is named",
        "cpu_16c_64g",
        {},
        Need(engine="llamacpp", node_selector={"zone": "a"}),
        ["label zone=a missing"],
    ),
    (
        "a label with another value names the value the node has",
        "cpu_16c_64g",
        {"labels": {"zone": "b"}},
        Need(engine="llamacpp", node_selector={"zone": "a"}),
        ["label zone=a missing (has zone=b)"],
    ),
    (
        "matching labels are fine",
        "cpu_16c_64g",
        {"labels": {"zone": "a", "tier": "gold"}},
        Need(engine="llamacpp", node_selector={"zone": "a"}),
        [],
    ),
    (
        "a GPU node with too few GPUs free says how many it has and how many are free",
        "gpu_h100x8",
        {"reserved_gpus": [0, 1, 2, 3, 4, 5, 6]},
        Need(engine="vllm", gpus=2),
        ["has 8 GPUs, 1 free, needs 2"],
    ),
    (
        "a GPU node whose GPUs are too small says so",
        "gpu_l4x1",
        {},
        Need(engine="vllm", gpus=1, gpu_min_memory_mb=40 * 1024),
        ["has 1 GPU, 0 free with ≥ 40 GB, needs 1"],
    ),
    (
        "a CPU node asked for a GPU has none",
        "cpu_16c_64g",
        {},
        Need(engine="llamacpp", gpus=1),
        ["has 0 GPUs, 0 free, needs 1"],
    ),
    (
        "a node short of disk says what is free",
        "cpu_16c_64g",
        {"disk_free_bytes": 10 * GiB},
        Need(engine="llamacpp", disk_bytes=20 * GiB),
        ["has 10.0 GB disk free, needs 20.0 GB"],
    ),
    (
        "a cordoned node says only that it is cordoned, and why",
        "cpu_2c_8g",
        {"unusable": "cordoned (maintenance)"},
        NEED_4C,
        ["cordoned (maintenance)"],
    ),
    (
        "a lost node says only that it is lost",
        "gpu_h100x8",
        {"unusable": "lost (no heartbeat)"},
        NEED_4C,
        ["lost (no heartbeat)"],
    ),
    (
        "an old agent that reports neither CPUs nor memory lacks nothing",
        "old_agent",
        {},
        Need(engine="llamacpp", cores=64, memory_bytes=1024 * GiB),
        [],
    ),
]


@pytest.mark.parametrize(("shape", "fields", "need", "expected"), [c[1:] for c in CHECKS], ids=[c[0] for c in CHECKS])
def test_check_says_what_a_node_lacks(
    request: pytest.FixtureRequest, shape: str, fields: dict[str, object], need: Need, expected: list[str]
) -> None:
    c = candidate(request.getfixturevalue(shape), "n", **fields)
    assert check(c, need) == expected


def test_the_verdicts_name_every_node_in_order() -> None:
    nodes = [
        candidate(CPU_8C_32G, "b", reserved_cores=6),
        candidate(CPU_16C_64G, "a", unusable="cordoned"),
        candidate(CPU_16C_64G, "c"),
    ]
    verdicts = evaluate(nodes, NEED_4C)
    assert [(v.node_id, v.reasons, v.fits) for v in verdicts] == [
        ("a", ["cordoned"], False),
        ("b", ["has 8 CPUs with 2 free, needs 4"], False),
        ("c", [], True),
    ]


SUMMARIES: list[tuple[str, list[Verdict], str]] = [
    (
        "with no nodes, the summary says to start an agent",
        [],
        "no nodes have registered: start an agent (`llmgw agent`) or check that agents reach NATS",
    ),
    (
        "each node is named with all it lacks",
        [
            Verdict(node_id="a", reasons=["has 8 CPUs with 2 free, needs 4"]),
            Verdict(node_id="b", reasons=["cordoned", "label zone=a missing"]),
        ],
        "no node fits — a: has 8 CPUs with 2 free, needs 4 | b: cordoned; label zone=a missing",
    ),
    (
        "past six nodes, the rest are counted",
        [Verdict(node_id=f"n{i}", reasons=["lost (no heartbeat)"]) for i in range(8)],
        "no node fits — " + " | ".join(f"n{i}: lost (no heartbeat)" for i in range(6)) + "; and 2 more",
    ),
]


@pytest.mark.parametrize(("verdicts", "expected"), [c[1:] for c in SUMMARIES], ids=[c[0] for c in SUMMARIES])
def test_summarise(verdicts: list[Verdict], expected: str) -> None:
    assert summarise(verdicts) == expected


def test_a_profile_becomes_what_one_replica_reserves() -> None:
    profile = M.Profile(
        engine="vllm",
        cpu_cores=4,
        min_memory_gb=1.5,
        gpus=M.GpuRequest(count=2, min_memory_gb=40),
        min_disk_gb=20,
        node_selector={"zone": "a"},
    )
    assert need_of(profile) == Need(
        engine="vllm",
        cores=4,
        memory_bytes=int(1.5 * GiB),
        gpus=2,
        gpu_min_memory_mb=40 * 1024,
        disk_bytes=20 * GiB,
        node_selector={"zone": "a"},
    )
    assert need_of(M.Profile()) == Need(engine="llamacpp")


def test_placement_prefers_a_node_that_holds_the_weights(cpu_16c_64g: Shape) -> None:
    nodes = [candidate(cpu_16c_64g, f"n{i}", has_weights=(i == 3)) for i in range(6)]
    choice, _ = place(nodes, NEED_4C, seed="m/0")
    assert choice is not None and choice.node_id == "n3"


def test_cpu_profiles_balance_onto_the_node_with_fewest_replicas(cpu_16c_64g: Shape) -> None:
    nodes = [candidate(cpu_16c_64g, f"n{i}", replicas=5 - i) for i in range(5)]
    choice, _ = place(nodes, NEED_4C, seed="m/0")
    assert choice is not None and choice.node_id == "n4"


def test_reserve_adds_one_replicas_reservation(gpu_h100x8: Shape) -> None:
    c = candidate(gpu_h100x8, "g", reserved_gpus=[0])
    need = Need(engine="vllm", cores=8, memory_bytes=64 * GiB, gpus=2)
    after = reserve(c, need, [1, 2])
    assert (after.reserved_cores, after.reserved_memory_bytes, after.reserved_gpus) == (8, 64 * GiB, [0, 1, 2])
    assert (after.model_replicas, after.replicas) == (1, 1)
    assert reserve(c, need, [1, 2], model_replica=False).model_replicas == 0


def test_a_node_holding_a_mirror_source_s_file_holds_the_model_whatever_its_catalog_name() -> None:
    w = World().add(shaped("n0", CPU_16C_64G), shaped("n1", CPU_16C_64G, weights=["qwen-src/abc123/q4.gguf"]))
    source = "mirror:qwen-src/abc123/q4.gguf"
    w.add(on_model("chat", M.ModelAdded(spec=msgspec.structs.replace(spec("chat"), source=source))))
    cands = candidates(w.state, "chat")
    assert cands["n1"].has_weights and not cands["n0"].has_weights
    [place] = [d for d in w.run() if isinstance(d, Place)]
    assert place.node_id == "n1"


def test_a_node_whose_model_directory_holds_a_local_source_is_preferred() -> None:
    held = ["/mnt/models/llama/llama-Q4_K_M.gguf", "/mnt/models/other.gguf"]
    w = World().add(shaped("n0", CPU_16C_64G), shaped("n1", CPU_16C_64G, weights=held))
    source = "/mnt/models/./llama/llama-Q4_K_M.gguf"  # as an operator may write it
    w.add(on_model("chat", M.ModelAdded(spec=msgspec.structs.replace(spec("chat"), source=source))))
    cands = candidates(w.state, "chat")
    assert cands["n1"].has_weights and not cands["n0"].has_weights
    [place] = [d for d in w.run() if isinstance(d, Place)]
    assert place.node_id == "n1"


def test_headroom_is_what_the_real_pass_would_place_and_says_why_not_more() -> None:
    from llmgw.services.scheduler.headroom import headroom

    w = World().add(
        shaped("n0", CPU_16C_64G),
        shaped("n1", CPU_16C_64G),
        model("alpha", min=2, cores=8),  # short of its minimum, and before chat in the pass
        model("chat", cores=4),
        placed("chat-1", "chat", "n0"),
        on_model("chat", M.ModelParked(reason="engine exited with 1, 5 times", failures=5)),
    )
    before = (w.state.models["chat"], dict(w.state.models))
    room = headroom(w.state, "chat", w.clock(), CFG)
    # 32 cores, 4 held by chat-1, 16 taken by alpha's two replicas first: 12 left, 3 more of 4 cores.
    assert (room["current"], room["more"], room["at_least"]) == (1, 3, False)
    assert sum(room["where"].values()) == 3
    assert "needs 4" in room["why_not_more"]
    assert room["notes"] and "parked" in room["notes"][0]
    assert (w.state.models["chat"], dict(w.state.models)) == before, "the state is not changed"
    assert headroom(w.state, "nope", w.clock(), CFG)["error"].startswith("no model named 'nope'")
    assert headroom(w.state, "chat", w.clock(), CFG, cap=2)["at_least"] is True
