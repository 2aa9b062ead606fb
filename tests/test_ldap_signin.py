"""Signing in with a directory's password (SPEC ID-2, ID-3): ``POST /api/v1/login`` with a provider, on
the admin API the suite runs, against a real OpenLDAP slapd (tests/ldapd/). The provider and its group
mappings are set by identity commands a cluster admin sends; roles follow the directory's groups."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import identity as I
from llmgw.events.schema import people as P
from llmgw.events.schema.subjects import event_subject
from llmgw.services.api.act import act
from tests.fleet import Fleet
from tests.ldapd import harness
from tests.ldapd.harness import GROUPS, PASSWORDS, PEOPLE, READER_DN, READER_PASSWORD, Slapd
from tests.signin import headers
from tests.support import NatsServer, wait_until

READER_ENV = "LLMGW_TEST_LDAP_READER_PASSWORD"
EVERYONE = f"cn=everyone,{GROUPS}"


@pytest.fixture
def slapd(tmp_path: Path) -> Iterator[Slapd]:
    """A directory of this test's own: the tests change who is in which group."""
    why = harness.missing()
    if why:
        pytest.skip(why)
    with harness.running(tmp_path / "slapd") as server:
        yield server


@pytest.fixture
async def fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=("people", "identity", "projections", "api"))
    yield f
    await f.stop()


async def login(fleet: Fleet, user: str, password: str, provider: str = "corp") -> tuple[int, dict[str, Any]]:
    body = {"user": user, "password": password, "provider": provider}
    async with aiohttp.ClientSession() as s, s.post(f"{fleet.admin_url}/api/v1/login", json=body) as r:
        return r.status, await r.json()


async def whoami(fleet: Fleet, token: str) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(f"{fleet.admin_url}/api/v1/whoami", headers=headers(token)) as r:
        return r.status, await r.json()


async def directory_with_mappings(fleet: Fleet, slapd: Slapd, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The directory ``corp`` (found by a search as the reader, whose password the server reads from the
    environment), ml-admins → cluster-admin (by the group's name) and everyone → viewer (by its DN).
    Answers the mappings' ids by group."""
    monkeypatch.setenv(READER_ENV, READER_PASSWORD)
    settings = I.LdapSettings(
        url=slapd.ldaps_url,
        ca_file=slapd.ca_file,
        user_base=PEOPLE,
        bind_dn=READER_DN,
        bind_password_env=READER_ENV,
        group_base=GROUPS,
    )
    token = fleet.admin_token
    added = await act(fleet.store, token, I.SERVICE, "idp.set", I.SetProvider(name="corp", kind="ldap", ldap=settings))
    assert added.applied, added.message
    ids: dict[str, str] = {}
    for group, role in (("ml-admins", "cluster-admin"), (EVERYONE, "viewer")):
        mapped = await act(
            fleet.store,
            token,
            I.SERVICE,
            "idp.map",
            I.MapGroup(provider="corp", group=group, role=role, scope="cluster"),
        )
        assert mapped.applied, mapped.message
        ids[group] = str(mapped.result["mapping"])
    return ids


async def signed_in(fleet: Fleet, user: str) -> dict[str, Any]:
    """``user``'s sign-in, once the admin API has folded the directory and its mappings just sent."""

    async def attempt() -> dict[str, Any] | None:
        status, body = await login(fleet, user, PASSWORDS[user.lower()])
        # Until the sign-in's fold reads them: "unknown_provider", then "no_mapped_group" (neither records
        # anything); any other refusal is the test's failure, at once.
        if status in (400, 403) and error(body)[0] in ("unknown_provider", "no_mapped_group"):
            return None
        assert status == 200, body
        return body

    return await wait_until(attempt, what=f"{user} to sign in with the directory's password")


def error(body: dict[str, Any]) -> tuple[str, str]:
    """(code, message) of the admin API's refusal."""
    refused = body.get("error") or {}
    return refused.get("code", ""), refused.get("message", "")


async def log_of(store: EventStore, name: str) -> list[Any]:
    return await store.read(event_subject(P.AGGREGATE, name))


async def test_alice_signs_in_with_her_directory_password_and_gets_the_roles_her_nested_groups_map_to(
    slapd: Slapd, fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = await directory_with_mappings(fleet, slapd, monkeypatch)
    session = await signed_in(fleet, "ALICE")  # directories match names without case; the answer is her name here
    assert session["user"] == "alice"
    status, me = await whoami(fleet, session["token"])
    assert (status, me["user"], me["token"]) == (200, "alice", "session")

    events = await log_of(fleet.store, "alice")
    added = next(e for e in events if isinstance(e.payload, P.UserAdded))
    assert (added.envelope.actor, added.payload.source, added.payload.login) == ("idp:corp", "idp:corp", "alice")
    assert not any(isinstance(e.payload, P.PasswordSet) for e in events)  # a person from a directory has none here
    granted = {
        e.payload.role: (e.payload.provider, e.payload.group, e.payload.mapping, e.envelope.actor)
        for e in events
        if isinstance(e.payload, P.RoleGranted)
    }
    # cluster-admin by ml-admins, her own group; viewer by everyone, two levels up (ml-admins ⊂ engineering ⊂ everyone)
    assert granted == {
        "cluster-admin": ("corp", "ml-admins", ids["ml-admins"], "idp:corp"),
        "viewer": ("corp", EVERYONE, ids[EVERYONE], "idp:corp"),
    }
    issued = [e for e in events if isinstance(e.payload, P.TokenIssued)]
    assert [(e.payload.kind, e.payload.method, e.envelope.actor) for e in issued] == [
        ("session", "ldap:corp", "user:alice")
    ]


async def test_the_wrong_password_is_refused_like_an_unknown_name_and_nobody_is_made(
    slapd: Slapd, fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    await directory_with_mappings(fleet, slapd, monkeypatch)
    await signed_in(fleet, "bob")  # the directory and its mappings are folded: refusals below are the directory's
    wrong = await login(fleet, "alice", PASSWORDS["bob"])
    unknown = await login(fleet, "mallory", PASSWORDS["bob"])
    for status, body in (wrong, unknown):
        assert status == 401
        assert error(body) == ("invalid_login", "the user name or the password is wrong")
    assert await log_of(fleet.store, "alice") == []
    assert await log_of(fleet.store, "mallory") == []


async def test_a_person_whose_groups_map_to_no_role_is_refused_naming_the_groups_to_map(
    slapd: Slapd, fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    await directory_with_mappings(fleet, slapd, monkeypatch)
    await signed_in(fleet, "bob")
    status, body = await login(fleet, "dave", PASSWORDS["dave"])
    assert (status, *error(body)) == (
        403,
        "no_mapped_group",
        f"dave is in no group mapped to a role: ask an administrator to map one of cn=contractors,{GROUPS}",
    )
    status, body = await login(fleet, "erin", PASSWORDS["erin"])
    code, message = error(body)
    assert (status, code) == (403, "no_mapped_group")
    assert message.startswith("erin is in no group at corp: ask its administrators to add them to one of"), message
    assert await log_of(fleet.store, "dave") == []


async def test_leaving_a_group_in_the_directory_revokes_its_role_at_the_next_sign_in(
    slapd: Slapd, fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    await directory_with_mappings(fleet, slapd, monkeypatch)
    await signed_in(fleet, "alice")
    # alice hands ml-admins to bob and moves to engineering: still in everyone (one level less), no more in
    # ml-admins (a groupOfNames is never empty)
    slapd.modify(
        f"dn: cn=ml-admins,{GROUPS}\nchangetype: modify\nadd: member\nmember: uid=bob,{PEOPLE}\n-\n"
        f"delete: member\nmember: uid=alice,{PEOPLE}\n\n"
        f"dn: cn=engineering,{GROUPS}\nchangetype: modify\nadd: member\nmember: uid=alice,{PEOPLE}\n"
    )
    status, again = await login(fleet, "alice", PASSWORDS["alice"])
    assert status == 200, again

    events = await log_of(fleet.store, "alice")
    revoked = [e for e in events if isinstance(e.payload, P.RoleRevoked)]
    assert [(e.payload.role, e.payload.scope, e.payload.provider, e.envelope.actor) for e in revoked] == [
        ("cluster-admin", "cluster", "corp", "idp:corp")
    ]
    seen = [e.payload.groups for e in events if isinstance(e.payload, P.GroupsSeen)]
    assert seen[-1] == (f"cn=engineering,{GROUPS}", EVERYONE)
    sessions = [e.payload.method for e in events if isinstance(e.payload, P.TokenIssued)]
    assert sessions == ["ldap:corp", "ldap:corp"]


async def test_a_directory_down_or_missing_its_readers_password_answers_503_saying_what_to_fix(
    fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(READER_ENV, raising=False)
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    down = I.LdapSettings(url=f"ldaps://127.0.0.1:{port}", user_dn=f"uid={{user}},{PEOPLE}", timeout_s=2)
    unread = I.LdapSettings(
        url=f"ldaps://127.0.0.1:{port}", user_base=PEOPLE, bind_dn=READER_DN, bind_password_env=READER_ENV
    )
    for name, settings in (("down", down), ("unread", unread)):
        added = await act(
            fleet.store, fleet.admin_token, I.SERVICE, "idp.set", I.SetProvider(name=name, kind="ldap", ldap=settings)
        )
        assert added.applied, added.message

    async def answer(provider: str) -> tuple[int, tuple[str, str]] | None:
        status, body = await login(fleet, "alice", "a password", provider=provider)
        return None if error(body)[0] == "unknown_provider" else (status, error(body))

    status, (code, message) = await wait_until(lambda: answer("down"), what="the directory down to be known")
    assert (status, code) == (503, "unavailable")
    assert f"the directory down at ldaps://127.0.0.1:{port} cannot be reached" in message
    status, (code, message) = await wait_until(lambda: answer("unread"), what="the directory unread to be known")
    assert (status, code) == (503, "misconfigured")
    assert f"${READER_ENV}, which is not set on this server" in message
