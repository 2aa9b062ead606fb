"""The language a person reads the console in, kept with them on the log (issue 24, item 7): the
``user.language`` command, its rules (oneself, or a cluster admin; only a language the console speaks),
the fold, and `llmgw ctl user language`."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from llmgw.events.commands import roles as R
from llmgw.events.folds.people import People, PeopleAndTree
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import people as P
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject
from llmgw.services.api.act import act
from llmgw.services.console import i18n
from llmgw.services.people import rules
from tests.fleet import Fleet
from tests.signin import cli_env
from tests.support import NatsServer

LLMGW = str(Path(sys.executable).parent / "llmgw")
NOW = datetime(2026, 12, 3, 12, tzinfo=UTC)
HASH = "$argon2id$v=19$m=19456,t=2,p=1$c2FsdHNhbHRzYWx0$aGFzaGhhc2hoYXNoaGFzaGhhc2hoYXNoaGFzaA"  # the form only


def people_with(*names: str) -> PeopleAndTree:
    people = People()
    for seq, name in enumerate(names, 1):
        envelope = Envelope(id=f"e{seq}", type="user.added", at=NOW, actor="user:test")
        subject = event_subject(P.AGGREGATE, name)
        people.apply(RecordedEvent(envelope=envelope, payload=P.UserAdded(name=name), subject=subject, seq=seq))
    return PeopleAndTree(people)


# -- pure ---------------------------------------------------------------------------------------------


def test_the_languages_a_person_may_choose_are_the_ones_the_console_speaks() -> None:
    assert P.LANGUAGES == i18n.LANGUAGES and i18n.DEFAULT in P.LANGUAGES


def test_a_language_is_set_folded_onto_the_person_and_set_again_is_nothing_new() -> None:
    state = people_with("ann")
    d = rules.decide(state, P.SetLanguage(name="ann", language="de"), NOW)
    assert d.payloads == [P.LanguageSet(name="ann", language="de")]
    assert d.subject == event_subject(P.AGGREGATE, "ann") and d.message == "ann reads the console in de"
    envelope = Envelope(id="e9", type="user.language_set", at=NOW, actor="user:ann")
    state.people.apply(RecordedEvent(envelope=envelope, payload=d.payloads[0], subject=d.subject, seq=9))
    assert state.people.by_name["ann"].language == "de"
    again = rules.decide(state, P.SetLanguage(name="ann", language="de"), NOW)
    assert again.payloads == [] and "already" in again.message


def test_an_empty_language_goes_back_to_the_browsers_choice() -> None:
    state = people_with("ann")
    state.people.by_name["ann"].language = "de"
    d = rules.decide(state, P.SetLanguage(name="ann", language=""), NOW)
    assert d.payloads == [P.LanguageSet(name="ann", language="")]
    assert d.message == "ann reads the console in the browser's language"


@pytest.mark.parametrize("language", ["fr", "DE", "en-US", "x" * 500])
def test_a_language_the_console_does_not_speak_is_refused_listing_those_it_does(language: str) -> None:
    with pytest.raises(Rejected) as refused:
        rules.decide(people_with("ann"), P.SetLanguage(name="ann", language=language), NOW)
    assert refused.value.code == "invalid_language"
    assert "the console speaks en, de" in refused.value.reason and len(refused.value.reason) < 200


def test_the_language_of_someone_never_added_is_refused_as_not_found() -> None:
    with pytest.raises(Rejected) as refused:
        rules.decide(people_with("ann"), P.SetLanguage(name="bob", language="de"), NOW)
    assert refused.value.code == "not_found" and "there is no user 'bob'" in refused.value.reason


def test_a_person_sets_their_own_language_and_only_a_cluster_admin_sets_anothers() -> None:
    assert rules.need("user:ann", P.SetLanguage(name="ann", language="de")) is None
    need = rules.need("user:ann", P.SetLanguage(name="bob", language="de"))
    assert need == R.cluster_admin("setting the language of bob")


# -- on the bus: the people service ----------------------------------------------------------------------


@pytest.fixture
async def fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=("people",))
    yield f
    await f.stop()


async def person(fleet: Fleet, name: str, *roles: str) -> str:
    """A person holding ``roles`` over the cluster, with a personal token: the token."""
    await fleet.client.send(P.SERVICE, "user.add", P.AddUser(name=name, password_hash=HASH), actor="user:test")
    for role in roles:
        grant = P.GrantRole(name=name, role=role, scope="cluster")
        await fleet.client.send(P.SERVICE, "role.grant", grant, actor="user:test")
    token, issue = P.issue(name, "personal", label="tests")
    await fleet.client.send(P.SERVICE, "token.issue", issue, actor="user:test")
    return token


async def language_on_log(store: EventStore, name: str) -> str:
    """``name``'s language as the log folds it."""
    people = People()
    for event in await store.read(event_subject(P.AGGREGATE, name)):
        people.apply(event)
    return people.by_name[name].language


async def test_a_person_keeps_their_language_on_the_log_and_may_not_set_anothers(fleet: Fleet) -> None:
    ann = await person(fleet, "ann")
    await person(fleet, "bob")

    own = await act(fleet.store, ann, P.SERVICE, "user.language", P.SetLanguage(name="ann", language="de"))
    assert own.applied, own.message
    assert own.message == "ann reads the console in de"
    events = await fleet.store.read(event_subject(P.AGGREGATE, "ann"))
    assert [(e.envelope.type, e.envelope.actor) for e in events if isinstance(e.payload, P.LanguageSet)] == [
        ("user.language_set", "user:ann")
    ]
    assert await language_on_log(fleet.store, "ann") == "de"

    other = await act(fleet.store, ann, P.SERVICE, "user.language", P.SetLanguage(name="bob", language="de"))
    assert not other.applied and other.code == "forbidden" and other.status == 403
    assert "setting the language of bob needs cluster-admin" in other.message
    assert await language_on_log(fleet.store, "bob") == ""

    unspoken = await act(fleet.store, ann, P.SERVICE, "user.language", P.SetLanguage(name="ann", language="fr"))
    assert not unspoken.applied and unspoken.code == "invalid_language"
    assert "the console speaks en, de, not 'fr'" in unspoken.message
    # The console shows that refusal in the reader's language, the service's message after it.
    assert i18n.refusal("de", unspoken.code, unspoken.message).startswith("Diese Sprache spricht die Konsole nicht.")


async def test_a_cluster_admin_sets_anothers_language_from_the_cli(fleet: Fleet) -> None:
    await person(fleet, "cy")
    admin = await person(fleet, "root", "cluster-admin")

    async def cli(*args: str) -> subprocess.CompletedProcess[str]:
        # In a thread: the services answering the CLI run on this test's event loop.
        env = cli_env(admin, LLMGW_NATS_URL=fleet.nats_url)
        return await asyncio.to_thread(
            subprocess.run, [LLMGW, *args], capture_output=True, text=True, env=env, timeout=60
        )

    done = await cli("ctl", "user", "language", "cy", "de")
    assert done.returncode == 0 and "cy reads the console in de" in done.stdout, done.stderr
    assert await language_on_log(fleet.store, "cy") == "de"
    refused = await cli("ctl", "user", "language", "cy", "klingon")
    assert refused.returncode == 2 and "the console speaks en, de, not 'klingon'" in refused.stderr
    back = await cli("ctl", "user", "language", "cy", "")
    assert back.returncode == 0 and "the browser's language" in back.stdout, back.stderr
    assert await language_on_log(fleet.store, "cy") == ""
