"""Capacity quotas over the tenancy tree (SCHED-8) as tables of sentences: holdings, limits,
guarantees and scope names, over a ClusterState folded from the same events the scheduler folds."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw.events.folds import quotas as QF
from llmgw.events.schema import models as M
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject
from llmgw.services.scheduler import quota as QU
from llmgw.services.scheduler.headroom import headroom
from llmgw.services.scheduler.vocabulary import Blocked, Config, Place
from llmgw.services.tenancy.quotas import decide_quota, need_quota
from tests.scheduler_world import GPU_H100X8, Fact, World, node, placed, ready, said, shaped, spec

GiB = 1024**3
# Preemption (SCHED-7) off where a test asks only what the limits allow.
NO_PREEMPT = Config(**({"preempt": False} if "preempt" in Config.__struct_fields__ else {}))


# -- facts: the tenancy tree and quotas, as the log tells them ---------------------------------------


def tree(*paths: str) -> Fact:
    """Orgs, teams and projects by path (``acme``, ``acme/ml``, ``acme/ml/chat``); ids are the paths
    with ``/`` as ``.`` so a test can name them."""

    def fact(w: World) -> None:
        for path in paths:
            parts = path.split("/")
            sid = ".".join(parts)
            parent = ".".join(parts[:-1])
            payload = [
                T.OrgCreated(org_id=sid, name=parts[-1]),
                T.TeamCreated(team_id=sid, org_id=parent, name=parts[-1]),
                T.ProjectCreated(project_id=sid, team_id=parent, name=parts[-1]),
            ][len(parts) - 1]
            w.emit(T.AGGREGATE, T.TREE_ID, payload)

    return fact


def quota(
    path: str,
    *,
    gpus: int | None = None,
    cores: int | None = None,
    mem: float | None = None,
    limit_gpus: int | None = None,
    limit_cores: int | None = None,
    limit_mem: float | None = None,
) -> Fact:
    kind = ("org", "team", "project")[path.count("/")]
    sid = path.replace("/", ".")
    payload = Q.QuotaSet(
        scope_id=sid,
        kind=kind,
        path=path,
        guarantee=Q.Resources(gpus=gpus, cores=cores, memory_bytes=None if mem is None else int(mem * GiB)),
        limit=Q.Resources(
            gpus=limit_gpus, cores=limit_cores, memory_bytes=None if limit_mem is None else int(limit_mem * GiB)
        ),
    )
    return lambda w: w.emit(Q.AGGREGATE, sid, payload)


def cleared(path: str) -> Fact:
    kind = ("org", "team", "project")[path.count("/")]
    sid = path.replace("/", ".")
    return lambda w: w.emit(Q.AGGREGATE, sid, Q.QuotaCleared(scope_id=sid, kind=kind, path=path))


ACME = tree("acme", "acme/ml", "acme/ml/chat", "acme/web", "beta", "beta/ml")
H100 = [shaped("h1", GPU_H100X8), shaped("h2", GPU_H100X8)]


def model(name: str, n: int = 1, *, owner: str | None = None, **more: object) -> Fact:
    """A model added to the catalog with ``owner``."""
    s = msgspec.structs.replace(spec(name, n, **more), owner=owner)  # type: ignore[arg-type]
    return lambda w: w.emit(M.AGGREGATE, name, M.ModelAdded(spec=s))


def gpu_model(name: str, n: int, gpus: int, owner: str | None) -> Fact:
    return model(name, n, cores=4, mem=16, gpus=gpus, gpu_mem=40, engine="vllm", owner=owner)


def told(d: object) -> str:
    """A decision as a line, without where a replica goes (placement's seeded choice is not the point here)."""
    return f"place {d.model}" if isinstance(d, Place) else said(d)  # type: ignore[arg-type]


def holds(w: World, path: str) -> QU.Usage:
    kind = ("org", "team", "project")[path.count("/")]
    return QU.holdings(w.state).get(f"{kind}:{path.replace('/', '.')}", QU.ZERO)


# -- holdings ---------------------------------------------------------------------------------------


def test_holdings_sum_down_the_tree_from_each_models_owner() -> None:
    w = World().add(
        ACME,
        H100,
        gpu_model("chat", 2, 1, "acme/ml/chat"),
        gpu_model("ml", 1, 2, "team:acme/ml"),
        gpu_model("web", 1, 1, "acme/web"),
        gpu_model("free", 1, 4, None),
        placed("c1", "chat", "h1"),
        placed("c2", "chat", "h1", gpus=[1]),
        placed("m1", "ml", "h2"),
        placed("w1", "web", "h2", gpus=[2]),
        placed("f1", "free", "h1", gpus=[4, 5, 6, 7]),
    )
    assert holds(w, "acme/ml/chat") == QU.Usage(gpus=2, cores=8, memory_bytes=32 * GiB)
    assert holds(w, "acme/ml") == QU.Usage(gpus=4, cores=12, memory_bytes=48 * GiB)
    assert holds(w, "acme") == QU.Usage(gpus=5, cores=16, memory_bytes=64 * GiB)
    assert holds(w, "beta") == QU.ZERO  # the model with no owner counts for nobody


def test_a_stopped_replica_holds_nothing_and_a_draining_one_still_does() -> None:
    from llmgw.events.schema import replicas as R
    from tests.scheduler_world import on_replica, stopped

    w = World().add(
        ACME,
        H100,
        gpu_model("chat", 2, 1, "acme/ml/chat"),
        placed("c1", "chat", "h1"),
        placed("c2", "chat", "h1", gpus=[1]),
        stopped("c1"),
        on_replica("c2", R.ReplicaStopRequested(replica_id="c2", reason="test")),
    )
    assert holds(w, "acme").gpus == 1


# -- limits ---------------------------------------------------------------------------------------------

LIMITS: list[tuple[str, list[Fact], list[str]]] = [
    (
        "a team's limit stops further replicas with the reason, nearest scope first",
        [ACME, H100, quota("acme/ml", limit_gpus=2), gpu_model("chat", 4, 1, "acme/ml/chat")],
        [
            "place chat",
            "place chat",
            "blocked chat (2 wanted): team:acme/ml is at its capacity limit (2 GPUs of 2 GPUs held; "
            "a replica needs 1 GPU more)",
        ],
    ),
    (
        "an org's limit holds its teams' models together",
        [
            ACME,
            H100,
            quota("acme", limit_gpus=3),
            gpu_model("a-chat", 2, 1, "acme/ml/chat"),
            gpu_model("b-web", 2, 1, "acme/web"),
        ],
        [
            "place a-chat",
            "place a-chat",
            "place b-web",
            "blocked b-web (1 wanted): org:acme is at its capacity limit (3 GPUs of 3 GPUs held; "
            "a replica needs 1 GPU more)",
        ],
    ),
    (
        "a model with no owner is not limited",
        [ACME, H100, quota("acme", limit_gpus=0), gpu_model("free", 2, 1, None)],
        ["place free", "place free"],
    ),
    (
        "a model whose owner names no scope is not limited",
        [ACME, H100, quota("acme", limit_gpus=0), gpu_model("lost", 1, 1, "acme/nowhere")],
        ["place lost"],
    ),
    (
        "a memory limit names the memory",
        [ACME, node("a", 16, 64), quota("beta", limit_mem=20), model("m", 2, cores=2, mem=16, owner="beta")],
        [
            "place m",
            "blocked m (1 wanted): org:beta is at its capacity limit (16 GB of memory of 20 GB of memory held; "
            "a replica needs 16 GB of memory more)",
        ],
    ),
    (
        "a resource the replica does not use never blocks it",
        [ACME, node("a", 16, 64), quota("beta", limit_gpus=0), model("m", 2, cores=2, mem=4, owner="beta/ml")],
        ["place m", "place m"],
    ),
    (
        "a cleared quota removes the limit",
        [ACME, H100, quota("acme/ml", limit_gpus=0), cleared("acme/ml"), gpu_model("chat", 1, 1, "acme/ml")],
        ["place chat"],
    ),
]


@pytest.mark.parametrize(("_name", "facts", "expected"), LIMITS, ids=[c[0] for c in LIMITS])
def test_limit(_name: str, facts: list[Fact], expected: list[str]) -> None:
    w = World().add(*facts)
    assert [told(d) for d in w.run(NO_PREEMPT)] == expected


def test_headroom_stops_at_the_owners_limit_and_says_so() -> None:
    w = World().add(ACME, H100, quota("acme/ml", limit_gpus=3), gpu_model("chat", 1, 1, "acme/ml/chat"))
    w.step(NO_PREEMPT)
    answer = headroom(w.state, "chat", w.clock(), NO_PREEMPT)
    assert answer["more"] == 2
    assert answer["why_not_more"] == (
        "stopped at team:acme/ml's capacity limit (3 GPUs of 3 GPUs held; a replica needs 1 GPU more)"
    )


def test_a_limit_does_not_stop_a_model_preempting_past_it() -> None:
    """With preemption on, a model at its limit is Blocked before any replica is taken for it."""
    w = World().add(
        ACME,
        shaped("h1", GPU_H100X8),
        quota("acme", limit_gpus=1),
        gpu_model("chat", 2, 1, "acme/ml/chat"),
    )
    out = [told(d) for d in w.run()]
    assert out[0] == "place chat"
    assert out[1].startswith("blocked chat (1 wanted): org:acme is at its capacity limit")


# -- guarantees --------------------------------------------------------------------------------------------

GUARANTEES: list[tuple[str, list[Fact], dict[str, str], set[str]]] = [
    (
        "a guarantee protects the replicas within it and beyond it they are borrowed",
        [
            ACME,
            H100,
            quota("acme/ml", gpus=2),
            gpu_model("chat", 3, 1, "acme/ml/chat"),
            placed("c1", "chat", "h1"),
            placed("c2", "chat", "h1", gpus=[1]),
            placed("c3", "chat", "h2"),
            ready("c2", "c3", "c1"),
        ],
        {"c1": "within team:acme/ml's guarantee", "c2": "within team:acme/ml's guarantee"},
        {"c3"},
    ),
    (
        "ready replicas are protected before those still starting",
        [
            ACME,
            H100,
            quota("acme", gpus=1),
            gpu_model("chat", 2, 1, "acme/ml/chat"),
            placed("c1", "chat", "h1"),
            placed("c2", "chat", "h2"),
            ready("c2"),
        ],
        {"c2": "within org:acme's guarantee"},
        {"c1"},
    ),
    (
        "the nearest guarantee that covers a replica names it",
        [
            ACME,
            H100,
            quota("acme", gpus=8),
            quota("acme/ml/chat", gpus=1),
            gpu_model("chat", 2, 1, "acme/ml/chat"),
            placed("c1", "chat", "h1"),
            placed("c2", "chat", "h2"),
        ],
        {"c1": "within project:acme/ml/chat's guarantee", "c2": "within org:acme's guarantee"},
        set(),
    ),
    (
        "a model with no owner is neither protected nor borrowed",
        [ACME, H100, quota("acme", gpus=8), gpu_model("free", 1, 1, None), placed("f1", "free", "h1")],
        {},
        set(),
    ),
    (
        "a guarantee of GPUs does not cover memory it leaves unset",
        [
            ACME,
            node("a", 16, 64),
            quota("beta", gpus=8),
            model("m", 1, cores=2, mem=4, owner="beta"),
            placed("m1", "m", "a"),
        ],
        {},
        {"m1"},
    ),
]


@pytest.mark.parametrize(("_name", "facts", "protected", "borrowed"), GUARANTEES, ids=[c[0] for c in GUARANTEES])
def test_guarantee(_name: str, facts: list[Fact], protected: dict[str, str], borrowed: set[str]) -> None:
    w = World().add(*facts)
    assert QU.protected_replicas(w.state) == protected
    assert QU.borrowed_replicas(w.state) == borrowed


# -- scope names and the tenancy service's decisions ----------------------------------------------------------


def _tree() -> World:
    return World().add(ACME)


SCOPES = [
    ("a kind and a path name a scope", "team:acme/ml", "acme.ml"),
    ("a bare path's depth says its kind", "acme/ml/chat", "acme.ml.chat"),
    ("a bare org name is the org", "acme", "acme"),
    ("a bare name only one scope carries names it", "web", "acme.web"),
    ("an id names its scope", "beta.ml", "beta.ml"),
]


@pytest.mark.parametrize(("_name", "text", "scope_id"), SCOPES, ids=[c[0] for c in SCOPES])
def test_scope_names(_name: str, text: str, scope_id: str) -> None:
    assert QF.resolve_scope(_tree().state.tree, text).id == scope_id


def test_an_ambiguous_bare_name_is_refused_naming_the_choices() -> None:
    with pytest.raises(Rejected) as exc:
        decide_quota(_tree().state.tree, {}, Q.SetQuota(scope="ml", limit=Q.Resources(gpus=1)))
    assert exc.value.code == "ambiguous"
    assert "'ml' names 2 scopes (team:acme/ml, team:beta/ml): say which" in str(exc.value)


REFUSALS = [
    ("an unknown scope is refused naming what exists", Q.SetQuota(scope="team:acme/x", limit=Q.Resources(gpus=1)),
     "there is no team 'acme/x' (teams: acme/ml, acme/web, beta/ml)"),
    ("a quota that sets nothing is refused saying what to give", Q.SetQuota(scope="acme"), "say what to set"),
    ("a guarantee above the limit is refused",
     Q.SetQuota(scope="acme", guarantee=Q.Resources(gpus=4), limit=Q.Resources(gpus=2)),
     "the guarantee of gpus (4) is above its limit (2)"),
    ("a negative amount is refused",
     Q.SetQuota(scope="acme", limit=Q.Resources(cores=-1)), "limit cores -1 is negative"),
]  # fmt: skip


@pytest.mark.parametrize(("_name", "command", "says"), REFUSALS, ids=[c[0] for c in REFUSALS])
def test_quota_refusal(_name: str, command: Q.QuotaCommand, says: str) -> None:
    with pytest.raises(Rejected) as exc:
        decide_quota(_tree().state.tree, {}, command)
    assert says in str(exc.value)


def test_set_then_clear_folds_to_no_quota() -> None:
    tree_ = _tree().state.tree
    d = decide_quota(tree_, {}, Q.SetQuota(scope="acme/ml", limit=Q.Resources(gpus=2)))
    sid = d.result["scope_id"]
    assert (sid, d.subject, d.message) == ("acme.ml", event_subject(Q.AGGREGATE, sid), "quota of team:acme/ml set")
    quotas = {sid: QF.fold_quota(None, d.payloads[0])}
    assert quotas[sid] == QF.Quota(scope_id="acme.ml", kind="team", limit=Q.Resources(gpus=2))
    d = decide_quota(tree_, quotas, Q.ClearQuota(scope="team:acme/ml"))
    assert d.message == "quota of team:acme/ml cleared"
    assert QF.fold_quota(quotas[sid], d.payloads[0]) is None
    d = decide_quota(tree_, {}, Q.ClearQuota(scope="acme/ml"))
    assert (d.payloads, d.message) == ([], "team:acme/ml has no quota")


def test_an_orgs_quota_needs_a_cluster_admin_and_a_teams_its_orgs_admin() -> None:
    tree_ = _tree().state.tree
    assert need_quota(tree_, Q.ClearQuota(scope="acme")).role == "cluster-admin"
    need = need_quota(tree_, Q.ClearQuota(scope="acme/ml"))
    assert (need.role, need.kind, need.tenant) == ("org-admin", "team", "acme.ml")


# -- the property: no pass takes a scope over its limit ----------------------------------------------------

PATHS = ["acme", "acme/ml", "acme/ml/chat", "acme/web", "beta", "beta/ml"]


@st.composite
def worlds(draw: st.DrawFn) -> tuple[World, dict[str, int]]:
    w = World().add(ACME)
    for i in range(draw(st.integers(1, 4))):
        w.add(shaped(f"h{i}", GPU_H100X8))
    limits: dict[str, int] = {}
    for path in draw(st.lists(st.sampled_from(PATHS), unique=True, max_size=4)):
        limits[path] = draw(st.integers(0, 10))
        w.add(quota(path, limit_gpus=limits[path], limit_cores=draw(st.none() | st.integers(0, 80))))
    for j in range(draw(st.integers(1, 6))):
        owner = draw(st.none() | st.sampled_from(PATHS))
        w.add(gpu_model(f"m{j}", draw(st.integers(0, 6)), draw(st.integers(1, 3)), owner))
    return w, limits


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(worlds(), st.integers(1, 3), st.booleans())
def test_no_pass_takes_a_scope_over_its_limit(world: tuple[World, dict[str, int]], passes: int, preempt: bool) -> None:
    w, _ = world
    for _ in range(passes):
        decisions = w.run(Config() if preempt else NO_PREEMPT)
        w.commit(decisions)
        held = QU.holdings(w.state)
        for q in w.state.quotas.values():
            h = held.get(q.scope, QU.ZERO)
            for resource in Q.RESOURCES:
                cap = getattr(q.limit, resource)
                assert cap is None or getattr(h, resource) <= cap, (q.scope, resource, [said(d) for d in decisions])
        assert all(not isinstance(d, Blocked) or d.reason for d in decisions)


def test_the_snapshot_keeps_the_tree_and_the_quotas() -> None:
    from llmgw.services.scheduler.state import ClusterState

    w = World().add(ACME, quota("acme/ml", gpus=1, limit_gpus=2))
    back = ClusterState.decode(w.state.encode())
    assert back.quotas == w.state.quotas
    assert back.tree.label("team:acme.ml") == "team:acme/ml"
    assert back.tree.scopes_above("acme.ml.chat") == ["team:acme.ml", "org:acme"]
    assert msgspec.json.encode(QU.quota_view(back)) == msgspec.json.encode(QU.quota_view(w.state))


# -- `ctl model class|owner` (CAT-4): the catalog's decisions -----------------------------------------


def _catalog(declared: bool = False) -> object:
    from llmgw.events.schema.envelope import Envelope, RecordedEvent, utc_now
    from llmgw.services.catalog.rules import Catalog

    catalog = Catalog()
    env = Envelope(id="e1", type="model.added", at=utc_now(), actor="user:t")
    added = M.ModelAdded(spec=spec("chat", 1), declared=declared)
    catalog.apply("chat", RecordedEvent(envelope=env, payload=added, subject="s", seq=1))
    return catalog


EDITS = [
    ("a class is set", M.SetClass(name="chat", capacity_class="critical"), "model chat is now of class critical",
     {"capacity_class": "critical"}),
    ("default unsets the class", M.SetClass(name="chat", capacity_class="default"),
     "model chat is already of class default", None),
    ("an owner is set as a path", M.SetOwner(name="chat", owner="acme/ml"), "model chat now has owner acme/ml",
     {"owner": "acme/ml"}),
    ("an owner is set with its kind", M.SetOwner(name="chat", owner="team:acme/ml"),
     "model chat now has owner team:acme/ml", {"owner": "team:acme/ml"}),
    ("no owner is no change for a model without one", M.SetOwner(name="chat", owner=None),
     "model chat already has owner none", None),
]  # fmt: skip


@pytest.mark.parametrize(("_name", "command", "message", "changed"), EDITS, ids=[c[0] for c in EDITS])
def test_model_edit(_name: str, command: M.CatalogCommand, message: str, changed: dict | None) -> None:
    from llmgw.services.catalog.rules import decide

    d = decide(_catalog(), command)  # type: ignore[arg-type]
    assert (d.result["model"], d.message) == ("chat", message)
    if changed is None:
        assert d.payloads == []
    else:
        [payload] = d.payloads
        assert isinstance(payload, M.ModelChanged)
        assert {k: getattr(payload.spec, k) for k in changed} == changed


EDIT_REFUSALS = [
    ("an unknown class is refused naming the classes", M.SetClass(name="chat", capacity_class="gold"),
     "class 'gold' is not one of critical, standard, opportunistic (or default)"),
    ("an owner of four parts is refused", M.SetOwner(name="chat", owner="a/b/c/d"),
     "an owner is org, org/team or org/team/project"),
    ("an owner of an unknown kind is refused", M.SetOwner(name="chat", owner="user:bob"),
     "'user' is not org, team or project"),
    ("an owner with an empty part is refused", M.SetOwner(name="chat", owner="acme//x"), "empty or padded part"),
    ("an unknown model is refused", M.SetOwner(name="nope", owner="acme"), "there is no model 'nope'"),
]  # fmt: skip


@pytest.mark.parametrize(("_name", "command", "says"), EDIT_REFUSALS, ids=[c[0] for c in EDIT_REFUSALS])
def test_model_edit_refusal(_name: str, command: M.CatalogCommand, says: str) -> None:
    from llmgw.services.catalog.rules import decide

    with pytest.raises(Rejected) as exc:
        decide(_catalog(), command)  # type: ignore[arg-type]
    assert says in str(exc.value)


def test_a_declared_models_owner_is_edited_in_its_file() -> None:
    from llmgw.services.catalog.rules import decide

    with pytest.raises(Rejected) as exc:
        decide(_catalog(declared=True), M.SetOwner(name="chat", owner="acme"))  # type: ignore[arg-type]
    assert exc.value.code == "declared" and "change the owner of it there" in str(exc.value)


# -- metrics ------------------------------------------------------------------------------------------------


def test_capacity_series_show_holdings_beside_the_guarantee_and_the_limit_by_path() -> None:
    w = World().add(
        ACME,
        H100,
        quota("acme/ml", gpus=1, limit_gpus=4),
        gpu_model("chat", 2, 1, "acme/ml/chat"),
        placed("c1", "chat", "h1"),
    )
    samples = {(name, labels): value for name, labels, value in QU.capacity_samples(w.state)}
    assert samples[("llmgw_capacity_holds", ("team:acme/ml", "gpus"))] == 1.0
    assert samples[("llmgw_capacity_holds", ("team:acme/ml", "memory_bytes"))] == 16.0 * GiB
    assert samples[("llmgw_capacity_guarantee", ("team:acme/ml", "gpus"))] == 1.0
    assert samples[("llmgw_capacity_limit", ("team:acme/ml", "gpus"))] == 4.0
    assert ("llmgw_capacity_limit", ("team:acme/ml", "cores")) not in samples  # unset: no series
    assert {labels[0] for _, labels in samples} == {"team:acme/ml"}  # only scopes with a quota


def test_the_capacity_at_limit_alert_reads_the_series_the_scheduler_publishes() -> None:
    from pathlib import Path

    import yaml
    from prometheus_client import CollectorRegistry

    from llmgw.services.scheduler.metrics import FleetCollector
    from llmgw.services.scheduler.state import ClusterState

    registry = CollectorRegistry()
    registry.register(FleetCollector("sched-a", ClusterState, lambda: True, list, Config()))
    published = {f.name for f in registry.collect()}
    alerts = Path(__file__).resolve().parent.parent / "ops" / "prometheus" / "alerts.yml"
    [rule] = [r for r in yaml.safe_load(alerts.read_text())["groups"][0]["rules"] if r["alert"] == "CapacityAtLimit"]
    assert {"llmgw_capacity_holds", "llmgw_capacity_limit"} <= published
    assert "llmgw_capacity_holds" in rule["expr"] and "llmgw_capacity_limit" in rule["expr"]


def test_a_restart_at_its_owners_limit_stops_the_old_replica_first_instead_of_surging_past_it() -> None:
    from llmgw.events.schema import replicas as R
    from tests.scheduler_world import on_replica

    w = World().add(
        ACME,
        H100,
        quota("acme/ml", limit_gpus=2),
        gpu_model("chat", 2, 1, "acme/ml/chat"),
        placed("c1", "chat", "h1"),
        placed("c2", "chat", "h2"),
        ready("c1", "c2"),
        on_replica("c1", R.ReplicaRestartRequested(replica_id="c1")),
    )
    out = [told(d) for d in w.run(NO_PREEMPT)]
    assert out == ["stop c1: restart of c1: no room for a second copy; model chat is short until it is back"]


def test_the_pass_ledger_and_the_plain_function_agree_on_room_within_a_guarantee() -> None:
    from llmgw.services.scheduler.placement import need_of

    w = World().add(
        ACME,
        H100,
        quota("acme/ml", gpus=2),
        quota("acme", gpus=3),
        gpu_model("chat", 3, 1, "acme/ml/chat"),
        gpu_model("free", 1, 1, None),
        placed("c1", "chat", "h1"),
    )
    need = need_of(w.state.models["chat"].spec.profiles[0])
    ledger = QU.Ledger(w.state)
    assert ledger.guarantee_room("chat", need) == QU.guarantee_room(w.state, "chat", need) == "team:acme/ml"
    assert ledger.guarantee_room("free", need) is QU.guarantee_room(w.state, "free", need) is None
    w.add(placed("c2", "chat", "h2"))  # the team's guarantee is full; the org's still has room
    ledger = QU.Ledger(w.state)
    assert ledger.guarantee_room("chat", need) == QU.guarantee_room(w.state, "chat", need) == "org:acme"


# -- the property: what the state keeps of the guarantees is what it would derive afresh -------------------


@st.composite
def histories(draw: st.DrawFn) -> list[Fact]:
    """Nodes, guarantees and owned models, then steps: passes (replicas placed, made ready), replicas
    stopped, guarantees set or cleared, models given another owner."""
    facts: list[Fact] = [ACME, *(shaped(f"h{i}", GPU_H100X8) for i in range(draw(st.integers(1, 3))))]
    for path in draw(st.lists(st.sampled_from(PATHS), unique=True, max_size=4)):
        facts.append(quota(path, gpus=draw(st.integers(0, 8)), cores=draw(st.none() | st.integers(0, 40))))
    names = [f"m{j}" for j in range(draw(st.integers(1, 5)))]
    for name in names:
        facts.append(
            gpu_model(name, draw(st.integers(0, 4)), draw(st.integers(1, 3)), draw(st.none() | st.sampled_from(PATHS)))
        )
    step = st.one_of(
        st.just("pass"),
        st.tuples(st.just("ready"), st.integers(0, 20)),
        st.tuples(st.just("stop"), st.integers(0, 20)),
        st.tuples(st.just("quota"), st.sampled_from(PATHS), st.none() | st.integers(0, 8)),
        st.tuples(st.just("owner"), st.sampled_from(names), st.none() | st.sampled_from(PATHS)),
    )
    return [*facts, *(_step(s) for s in draw(st.lists(step, min_size=1, max_size=12)))]


def _step(s: object) -> Fact:
    from tests.scheduler_world import stopped

    def fact(w: World) -> None:
        if s == "pass":
            w.step(NO_PREEMPT)
            return
        kind, *args = s  # type: ignore[misc]
        live = sorted(r.id for r in w.state.replicas.values() if r.active)
        if kind in ("ready", "stop") and live:
            rid = live[args[0] % len(live)]
            (ready(rid) if kind == "ready" else stopped(rid))(w)
        elif kind == "quota":
            (cleared(args[0]) if args[1] is None else quota(args[0], gpus=args[1]))(w)
        elif kind == "owner":
            m = w.state.models[args[0]]
            w.emit(
                M.AGGREGATE, m.name, M.ModelChanged(spec=msgspec.structs.replace(m.spec, owner=args[1]), what="owner")
            )
        w.advance(1)

    return fact


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(histories())
def test_the_guarantees_the_state_keeps_are_those_it_would_derive_afresh(history: list[Fact]) -> None:
    from llmgw.services.scheduler.state import ClusterState

    w = World()
    for fact in history:
        w.add(fact)
        QU.guarantee_shares(w.state)  # asked after every event, so that what is kept is what is read next
        QU.holdings(w.state)
        fresh = ClusterState.decode(w.state.encode())  # the same facts, nothing derived yet
        assert QU.guarantee_shares(w.state) == QU.guarantee_shares(fresh)
        assert QU.holdings(w.state) == QU.holdings(fresh)
        assert QU.chains(w.state) == QU.chains(fresh)
