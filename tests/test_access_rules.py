"""Keys, limits, prices and budgets: the access decisions, as tables of sentences (pure, no I/O)."""

from __future__ import annotations

import hashlib
import math
from datetime import UTC, datetime, timedelta

import pytest

from llmgw.events.schema import access as A
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject
from llmgw.services.access.rules import AccessState, decide, new_key_id
from llmgw.services.tenancy import tree as tenancy

NOW = datetime(2030, 1, 1, tzinfo=UTC)
TREE = event_subject(T.AGGREGATE, T.TREE_ID)

Step = T.TenancyCommand | A.AccessCommand


def fold(steps: list[Step]) -> AccessState:
    """The state after each step is decided and its events applied, as the service would."""
    state = AccessState()
    for seq, step in enumerate(steps, start=1):
        env = Envelope(id=f"e{seq}", type="x", at=NOW, actor="user:t", causation=f"c{seq}")
        if isinstance(step, T.CreateScope | T.RenameScope | T.DeleteScope):
            for payload in tenancy.decide(state.tree, step).payloads:
                state.apply(RecordedEvent(envelope=env, payload=payload, subject=TREE, seq=seq))
            continue
        decision = decide(state, step, NOW)
        for payload in decision.payloads:
            state.apply(RecordedEvent(envelope=env, payload=payload, subject=decision.subject, seq=seq))
    return state


def mk(prefix: str, name: str = "", **kw: object) -> A.CreateKey:
    """A key whose hash differs per prefix."""
    return A.CreateKey(
        project=str(kw.pop("project", "acme/ml/chat")),
        prefix=prefix,
        secret_sha256=hashlib.sha256(prefix.encode()).hexdigest(),
        name=name,
        **kw,  # type: ignore[arg-type]
    )


ACME = [
    T.CreateScope(kind="org", path="acme"),
    T.CreateScope(kind="team", path="acme/ml"),
    T.CreateScope(kind="project", path="acme/ml/chat"),
]
CI = mk("cicicici", "ci")
WEB = mk("webwebwe", "web")

REFUSALS = [
    # keys
    (
        "a key for a project that does not exist names the projects there are",
        ACME,
        mk("aaaaaaaa", project="acme/ml/nope"),
        "there is no project 'acme/ml/nope' (projects: acme/ml/chat); create it with "
        "`llmgw ctl project create acme/ml/nope`",
    ),
    ("a key for a team path is not a key for a project", ACME, mk("aaaaaaaa", project="acme/ml"), "no project"),
    ("a key with no project says how to name one", ACME, mk("aaaaaaaa", project=""), "--project ORG/TEAM/PROJECT"),
    (
        "a key with a prefix llmgw did not make is refused",
        ACME,
        mk("ABC"),
        "make keys with `llmgw ctl key create`",
    ),
    (
        "a key whose hash is not SHA-256 in hex is refused",
        ACME,
        A.CreateKey(project="acme/ml/chat", prefix="aaaaaaaa", secret_sha256="xyz"),
        "SHA-256 in hex",
    ),
    ("a key sent twice is recognised as created before", [*ACME, CI], CI, "this key was created before, as key key_"),
    (
        "a key whose prefix another key holds is refused",
        [*ACME, CI],
        A.CreateKey(project="acme/ml/chat", prefix="cicicici", secret_sha256="f" * 64),
        "key prefix cicicici is taken",
    ),
    ("a zero rpm is refused", ACME, mk("aaaaaaaa", rpm=0), "rpm 0 is not allowed: give a positive number"),
    ("a negative tpm is refused", ACME, mk("aaaaaaaa", tpm=-5), "tpm -5 is not allowed"),
    ("an empty name in the model allow-list is refused", ACME, mk("aaaaaaaa", models=["a", " "]), "--models a,b"),
    (
        "an expiry in the past is refused",
        ACME,
        mk("aaaaaaaa", expires_at=NOW - timedelta(seconds=1)),
        "is in the past",
    ),
    (
        "an expiry without a time zone is refused",
        ACME,
        mk("aaaaaaaa", expires_at=datetime(2031, 1, 1)),
        "has no time zone",
    ),
    ("a key name longer than 64 characters is refused", ACME, mk("aaaaaaaa", "n" * 65), "at most 64"),
    ("a blank user is refused", ACME, mk("aaaaaaaa", user="  "), "user '  ' is not allowed"),
    # revocation
    (
        "revoking a key that does not exist lists the live keys",
        [*ACME, CI],
        A.RevokeKey(key="nope"),
        "there is no key 'nope' (live keys: key_",
    ),
    (
        "revoking a revoked key is refused",
        [*ACME, CI, A.RevokeKey(key="cicicici")],
        A.RevokeKey(key="cicicici"),
        "is already revoked",
    ),
    (
        "revoking by a start that two keys share names both",
        [*ACME, mk("abcd1111", "one"), mk("abcd2222", "two")],
        A.RevokeKey(key="abcd"),
        "'abcd' names 2 keys",
    ),
    # scopes
    (
        "a limit on a team that does not exist names the teams there are",
        ACME,
        A.SetLimit(scope="team:acme/x", rpm=10),
        "there is no team 'acme/x' (teams: acme/ml)",
    ),
    (
        "a scope of an unknown kind says how scopes are written",
        ACME,
        A.SetLimit(scope="galaxy:x", rpm=10),
        "unknown scope kind 'galaxy' in 'galaxy:x': write org:acme, team:acme/ml",
    ),
    (
        "a bare word that is no scope says how scopes are written",
        ACME,
        A.SetLimit(scope="nope", rpm=10),
        "there is no scope 'nope': write org:acme",
    ),
    ("an empty scope says how scopes are written", ACME, A.SetLimit(scope=" ", rpm=10), "a scope is needed"),
    ("a kind without a name is refused", ACME, A.SetLimit(scope="key:", rpm=10), "names no key"),
    (
        "a bare word that is an org and a key prefix is ambiguous",
        [*ACME, T.CreateScope(kind="org", path="abcd1111"), mk("abcd1111")],
        A.SetLimit(scope="abcd1111", rpm=10),
        "scope 'abcd1111' is ambiguous: it names org abcd1111",
    ),
    (
        "a key start shared by two keys is ambiguous as a scope",
        [*ACME, mk("abcd1111"), mk("abcd2222")],
        A.SetLimit(scope="key:abcd", rpm=10),
        "is ambiguous",
    ),
    (
        "a key that does not exist lists the live keys",
        [*ACME, CI],
        A.SetLimit(scope="key:nope", rpm=10),
        "there is no key 'nope' (keys: key_",
    ),
    (
        "a limit on a revoked key is refused",
        [*ACME, CI, A.RevokeKey(key="cicicici")],
        A.SetLimit(scope="key:cicicici", rpm=10),
        "is revoked; nothing can be set on it",
    ),
    # limits
    ("a limit of zero requests is refused", ACME, A.SetLimit(scope="org:acme", rpm=0), "rpm 0 is not allowed"),
    ("a negative token limit is refused", ACME, A.SetLimit(scope="org:acme", tpm=-1), "tpm -1 is not allowed"),
    (
        "clearing a limit that was never set is refused",
        ACME,
        A.SetLimit(scope="org:acme"),
        "org acme has no limit to clear; give --rpm and/or --tpm",
    ),
    # prices
    (
        "a negative price is refused",
        [],
        A.SetPrice(model="m", input_usd_per_m=-1.0, output_usd_per_m=1.0),
        "input price -1.0 is not allowed: give zero or a positive amount",
    ),
    (
        "a price that is not a number is refused",
        [],
        A.SetPrice(model="m", input_usd_per_m=0.0, output_usd_per_m=math.nan),
        "output price nan is not allowed",
    ),
    (
        "a price without a model is refused",
        [],
        A.SetPrice(model=" ", input_usd_per_m=0.0, output_usd_per_m=0.0),
        "needs a model name",
    ),
    # budgets
    ("a budget of zero is refused", ACME, A.SetBudget(scope="org:acme", usd=0.0), "give a positive amount"),
    ("a negative budget is refused", ACME, A.SetBudget(scope="org:acme", usd=-3.0), "give a positive amount"),
    (
        "a budget per week is refused",
        ACME,
        A.SetBudget(scope="org:acme", usd=5.0, period="week"),
        "period 'week' is not one of day, month",
    ),
    (
        "clearing a budget that was never set is refused",
        ACME,
        A.SetBudget(scope="project:acme/ml/chat", usd=None),
        "project acme/ml/chat has no budget to clear",
    ),
    (
        "a budget for a project that does not exist names the projects there are",
        ACME,
        A.SetBudget(scope="project:acme/ml/x", usd=5.0),
        "there is no project 'acme/ml/x' (projects: acme/ml/chat)",
    ),
]


@pytest.mark.parametrize(("description", "before", "command", "reason"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_say_what_to_do(description: str, before: list[Step], command: A.AccessCommand, reason: str) -> None:
    state = fold(before)
    with pytest.raises(Rejected) as caught:
        decide(state, command, NOW)
    assert reason in caught.value.reason


# -- what is accepted ----------------------------------------------------------------------------


def test_a_key_is_made_for_the_project_s_id_with_a_short_id_and_only_the_hash() -> None:
    state = fold(ACME)
    project = state.tree.find("project", "acme/ml/chat")
    assert project is not None
    c = mk(
        "abcdefgh",
        "ci",
        user="alice",
        rpm=60,
        tpm=1000,
        models=["not-in-any-catalog"],
        expires_at=NOW + timedelta(days=1),
    )
    decision = decide(state, c, NOW)
    [created] = decision.payloads
    assert isinstance(created, A.KeyCreated)
    assert created.project_id == project.id
    assert created.key_id.startswith("key_") and len(created.key_id) == 16
    assert decision.subject == event_subject("key", created.key_id)
    assert created.models == ["not-in-any-catalog"]  # kept as given: the catalog may change
    assert (created.prefix, created.secret_sha256) == (c.prefix, c.secret_sha256)
    assert decision.fence == TREE, "a key is appended only while the tree is as decided on"
    assert decision.message == f"key {created.key_id} (ci) created for project acme/ml/chat"


def test_a_key_s_project_may_be_named_by_id() -> None:
    state = fold(ACME)
    project = state.tree.find("project", "acme/ml/chat")
    assert project is not None
    [created] = decide(state, mk("abcdefgh", project=project.id), NOW).payloads
    assert created.project_id == project.id


def test_key_ids_are_short_and_safe_in_a_subject() -> None:
    ids = {new_key_id() for _ in range(200)}
    assert len(ids) == 200
    assert all(i.startswith("key_") and i[4:].isalnum() and i.islower() for i in ids)


@pytest.mark.parametrize(
    ("written", "kind"),
    [("org:acme", "org"), ("team:acme/ml", "team"), ("acme/ml", "team"), ("project:acme/ml/chat", "project")],
)
def test_scopes_are_recorded_by_id_whether_written_by_path_or_id(written: str, kind: str) -> None:
    state = fold(ACME)
    path = {"org": "acme", "team": "acme/ml", "project": "acme/ml/chat"}[kind]
    scope = state.tree.find(kind, path)
    assert scope is not None
    [by_path] = decide(state, A.SetLimit(scope=written, rpm=5), NOW).payloads
    [by_id] = decide(state, A.SetLimit(scope=f"{kind}:{scope.id}", rpm=5), NOW).payloads
    [bare_id] = decide(state, A.SetLimit(scope=scope.id, rpm=5), NOW).payloads
    assert by_path.scope == by_id.scope == bare_id.scope == f"{kind}:{scope.id}"


def test_a_key_scope_may_be_named_by_id_prefix_or_start() -> None:
    state = fold([*ACME, CI])
    [ci] = state.keys.values()
    for written in (f"key:{ci.id}", "key:cicicici", "key:llmgw-cicicici", "key:cici", "cicicici", ci.id):
        [limit] = decide(state, A.SetLimit(scope=written, rpm=5), NOW).payloads
        assert limit.scope == f"key:{ci.id}", written


def test_a_rename_keeps_what_was_set_by_id() -> None:
    state = fold(
        [*ACME, A.SetLimit(scope="team:acme/ml", rpm=5), T.RenameScope(kind="team", path="acme/ml", name="ai")]
    )
    team = state.tree.find("team", "acme/ai")
    assert team is not None
    assert state.limits[f"team:{team.id}"].rpm == 5
    decision = decide(state, A.SetLimit(scope="team:acme/ai"), NOW)
    assert decision.message == "limits of team acme/ai cleared"


def test_a_limit_and_a_budget_can_be_cleared() -> None:
    state = fold([*ACME, A.SetLimit(scope="org:acme", rpm=5), A.SetBudget(scope="org:acme", usd=10.0, period="day")])
    assert len(state.limits) == 1 and len(state.budgets) == 1
    state = fold(
        [
            *ACME,
            A.SetLimit(scope="org:acme", rpm=5),
            A.SetBudget(scope="org:acme", usd=10.0, period="day"),
            A.SetLimit(scope="org:acme"),
            A.SetBudget(scope="org:acme", usd=None),
        ]
    )
    assert state.limits == {} and state.budgets == {}


def test_a_key_s_own_limits_can_be_replaced_and_cleared() -> None:
    state = fold([*ACME, mk("cicicici", "ci", rpm=60), A.SetLimit(scope="key:cicicici", tpm=100)])
    [ci] = state.keys.values()
    assert (ci.rpm, ci.tpm) == (None, 100)
    state = fold([*ACME, mk("cicicici", "ci", rpm=60)])
    decision = decide(state, A.SetLimit(scope="key:cicicici"), NOW)  # its creation limits can be cleared
    assert decision.message.endswith("cleared")


def test_a_price_may_name_a_model_the_catalog_does_not_know_yet_and_be_free() -> None:
    state = fold([])
    decision = decide(state, A.SetPrice(model="qwen2.5-7b", input_usd_per_m=0.0, output_usd_per_m=1.5), NOW)
    assert decision.subject == event_subject("price", "qwen2.5-7b")
    assert decision.message == "price of qwen2.5-7b set: $0 input, $1.5 output per million tokens"


def test_a_budget_is_recorded_by_scope_id_and_period() -> None:
    state = fold(ACME)
    project = state.tree.find("project", "acme/ml/chat")
    assert project is not None
    decision = decide(state, A.SetBudget(scope="acme/ml/chat", usd=25.0, period="day"), NOW)
    assert decision.payloads == [A.BudgetSet(scope=f"project:{project.id}", usd=25.0, period="day")]
    assert decision.subject == event_subject("budget", f"project:{project.id}")
    assert decision.message == "budget of project acme/ml/chat set: $25 per day"


def test_revoking_by_prefix_revokes_that_key() -> None:
    state = fold([*ACME, CI, WEB])
    decision = decide(state, A.RevokeKey(key="llmgw-webwebwe", reason="leaked"), NOW)
    [revoked] = decision.payloads
    web = next(k for k in state.keys.values() if k.name == "web")
    assert revoked == A.KeyRevoked(key_id=web.id, reason="leaked")
    assert decision.subject == event_subject("key", web.id)
