"""The tenancy tree's decisions, as tables of sentences: pure functions, no I/O."""

from __future__ import annotations

import pytest

from llmgw.events.schema import access as A
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import Envelope, RecordedEvent, utc_now
from llmgw.events.schema.outcomes import Rejected
from llmgw.services.tenancy.tree import TenancyTree, decide


def fold(commands: list[T.TenancyCommand]) -> TenancyTree:
    tree = TenancyTree()
    for i, command in enumerate(commands, start=1):
        for payload in decide(tree, command).payloads:
            env = Envelope(id=f"e{i}", type="x", at=utc_now(), actor="user:t", causation=f"c{i}")
            tree.apply(RecordedEvent(envelope=env, payload=payload, subject="s", seq=tree.last_seq + 1))
    return tree


ACME = [
    T.CreateScope(kind="org", path="acme"),
    T.CreateScope(kind="team", path="acme/ml"),
    T.CreateScope(kind="project", path="acme/ml/chat"),
]

REFUSALS = [
    (
        "an org name with capitals is refused with a suggestion",
        [],
        T.CreateScope(kind="org", path="Acme Corp"),
        "try 'acme-corp'",
    ),
    (
        "an org name with a slash is a path of the wrong depth",
        [],
        T.CreateScope(kind="org", path="a/b"),
        "a org is named like 'acme'",
    ),
    ("a name that starts with a digit is refused", [], T.CreateScope(kind="org", path="9lives"), "start with a letter"),
    ("a name with a double hyphen is refused", [], T.CreateScope(kind="org", path="a--b"), "single hyphens"),
    ("a name longer than 63 characters is refused", [], T.CreateScope(kind="org", path="a" * 64), "64 characters long"),
    ("a reserved name is refused", [], T.CreateScope(kind="org", path="system"), "reserved"),
    ("an empty name is refused", [], T.CreateScope(kind="org", path=""), "needs a name"),
    (
        "a team in a missing org names the command to run first",
        [],
        T.CreateScope(kind="team", path="acme/ml"),
        "`llmgw ctl org create acme` first",
    ),
    (
        "a project in a missing team says which team",
        ACME[:1],
        T.CreateScope(kind="project", path="acme/x/chat"),
        "needs team 'acme/x'",
    ),
    ("an org that exists is not created twice", ACME[:1], T.CreateScope(kind="org", path="acme"), "already exists"),
    (
        "a non-empty org is not deleted and says what it holds",
        ACME,
        T.DeleteScope(kind="org", path="acme"),
        "org acme still holds 1 team (ml); delete it first",
    ),
    (
        "a non-empty team is not deleted and says what it holds",
        ACME,
        T.DeleteScope(kind="team", path="acme/ml"),
        "team acme/ml still holds 1 project (chat)",
    ),
    (
        "renaming onto a sibling's name is refused",
        [*ACME, T.CreateScope(kind="team", path="acme/ops")],
        T.RenameScope(kind="team", path="acme/ops", name="ml"),
        "team acme/ml already exists",
    ),
    (
        "deleting what does not exist says so",
        ACME[:1],
        T.DeleteScope(kind="team", path="acme/nope"),
        "there is no team 'acme/nope'",
    ),
    ("an unknown scope kind is refused", [], T.CreateScope(kind="galaxy", path="x"), "use org, team or project"),
]


@pytest.mark.parametrize(("description", "before", "command", "reason"), REFUSALS, ids=[r[0] for r in REFUSALS])
def test_refusals_say_what_to_do(description: str, before: list, command: T.TenancyCommand, reason: str) -> None:
    tree = fold(before)
    with pytest.raises(Rejected) as caught:
        decide(tree, command)
    assert reason in caught.value.reason


def test_a_rename_keeps_the_id_and_moves_the_children_paths() -> None:
    tree = fold([*ACME, T.RenameScope(kind="org", path="acme", name="acme-corp")])
    project = tree.find("project", "acme-corp/ml/chat")
    assert project is not None
    assert tree.find("org", "acme") is None
    assert tree.path(project) == "acme-corp/ml/chat"


def test_scopes_are_found_by_id_as_well_as_path() -> None:
    tree = fold(ACME)
    team = tree.find("team", "acme/ml")
    assert team is not None and tree.find("team", team.id) is team


def test_an_emptied_org_can_be_deleted() -> None:
    tree = fold(
        [
            *ACME,
            T.DeleteScope(kind="project", path="acme/ml/chat"),
            T.DeleteScope(kind="team", path="acme/ml"),
            T.DeleteScope(kind="org", path="acme"),
        ]
    )
    assert tree.scopes == {}


def test_the_same_name_may_live_under_different_parents() -> None:
    tree = fold(
        [*ACME, T.CreateScope(kind="team", path="acme/ops"), T.CreateScope(kind="project", path="acme/ops/chat")]
    )
    assert tree.find("project", "acme/ops/chat") is not tree.find("project", "acme/ml/chat")


def _with_keys(tree: TenancyTree, project_path: str, names: list[str], revoked: int = 0) -> None:
    """Fold ``key.created`` for each name (and ``key.revoked`` for the first ``revoked``) into the tree."""
    project = tree.find("project", project_path)
    assert project is not None
    seq = tree.keys_seq
    for i, name in enumerate(names):
        env = Envelope(id=f"k{i}", type="key.created", at=utc_now(), actor="user:t")
        payload = A.KeyCreated(
            key_id=f"key_{i}", prefix=f"p{i:07d}", secret_sha256="0" * 64, project_id=project.id, name=name
        )
        seq += 1
        tree.apply_key(RecordedEvent(envelope=env, payload=payload, subject=f"llmgw.evt.key.key_{i}", seq=seq))
    for i in range(revoked):
        env = Envelope(id=f"r{i}", type="key.revoked", at=utc_now(), actor="user:t")
        seq += 1
        tree.apply_key(
            RecordedEvent(
                envelope=env, payload=A.KeyRevoked(key_id=f"key_{i}"), subject=f"llmgw.evt.key.key_{i}", seq=seq
            )
        )


def test_a_project_that_still_holds_keys_is_not_deleted_and_says_which() -> None:
    tree = fold(ACME)
    last_seq = tree.last_seq
    _with_keys(tree, "acme/ml/chat", ["web", "ci"])
    assert tree.last_seq == last_seq, "key events never move the tree's expected sequence"
    with pytest.raises(Rejected) as caught:
        decide(tree, T.DeleteScope(kind="project", path="acme/ml/chat"))
    assert "project acme/ml/chat still holds 2 keys (ci, web); revoke them first" in caught.value.reason
    assert caught.value.code == "has_keys"


def test_a_project_whose_keys_are_all_revoked_can_be_deleted() -> None:
    tree = fold(ACME)
    _with_keys(tree, "acme/ml/chat", ["web", "ci"], revoked=2)
    [deleted] = decide(tree, T.DeleteScope(kind="project", path="acme/ml/chat")).payloads
    assert isinstance(deleted, T.ProjectDeleted)
