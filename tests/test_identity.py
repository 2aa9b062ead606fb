"""Identity providers, group mappings and people a provider vouches for (SPEC ID-1 to ID-4): the rules,
and the sign-in of an outside identity end to end on a real bus."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import pytest

from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.folds.identity import Mapping
from llmgw.events.folds.people import People
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import identity as I
from llmgw.events.schema import people as P
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject
from llmgw.services.api.signin import Refused, SignIn
from llmgw.services.identity import rules
from llmgw.services.identity.mapping import grants_for, matches, no_role_refusal
from llmgw.services.people import rules as people_rules
from llmgw.services.people.passwords import hash_password
from tests.fleet import Fleet
from tests.support import NatsServer, wait_until

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
OIDC = I.OidcSettings(issuer="https://id.example.com", client_id="llmgw", client_secret_env="CORP_SECRET")


def recorded(seq: int, payload: object, subject: str) -> RecordedEvent:
    envelope = Envelope(id=f"e{seq}", type="x", at=NOW, actor="user:test")
    return RecordedEvent(envelope=envelope, payload=payload, subject=subject, seq=seq)


def people_of(*payloads: object) -> People:
    people = People()
    for i, p in enumerate(payloads, 1):
        people.apply(recorded(i, p, event_subject(P.AGGREGATE, p.name)))
    return people


def state(*payloads: object) -> rules.IdentityAndTree:
    s = rules.IdentityAndTree()
    for i, p in enumerate(payloads, 1):
        aggregate = I.SCIM_GROUP_AGGREGATE if isinstance(p, I.ScimGroupSet | I.ScimGroupRemoved) else I.AGGREGATE
        key = getattr(p, "name", "") or getattr(p, "provider", "") or getattr(p, "group_id", "") or I.SCIM
        s.apply(recorded(i, p, event_subject(aggregate, key)))
    return s


def refused(call) -> Rejected:
    with pytest.raises(Rejected) as caught:
        call()
    return caught.value


# -- pure: the identity service's rules --------------------------------------------------------


def test_an_oidc_provider_is_kept_with_the_name_of_its_secrets_variable_never_the_secret() -> None:
    d = rules.decide(state(), I.SetProvider(name="corp", kind="oidc", oidc=OIDC), NOW)
    (event,) = d.payloads
    assert event.oidc.client_secret_env == "CORP_SECRET"
    assert "map its groups" in d.message
    got = refused(
        lambda: rules.decide(
            state(),
            I.SetProvider(
                name="corp",
                kind="oidc",
                oidc=I.OidcSettings(issuer=OIDC.issuer, client_id="x", client_secret_env="s3cr3t!"),
            ),
            NOW,
        )
    )
    assert got.code == "invalid_secret_env" and "never sent" in got.reason


@pytest.mark.parametrize(
    ("issuer", "ok"),
    [
        ("https://id.example.com", True),
        ("http://127.0.0.1:9000", True),
        ("http://localhost:9000/realms/x", True),
        ("http://id.example.com", False),
        ("ftp://id.example.com", False),
        ("id.example.com", False),
    ],
)
def test_an_issuer_is_https_or_on_a_loopback_address(issuer: str, ok: bool) -> None:
    command = I.SetProvider(name="corp", kind="oidc", oidc=I.OidcSettings(issuer=issuer, client_id="llmgw"))
    if ok:
        assert rules.decide(state(), command, NOW).payloads
    else:
        assert refused(lambda: rules.decide(state(), command, NOW)).code == "invalid_issuer"


def test_a_plain_ldap_url_is_refused_unless_asked_for_by_name() -> None:
    plain = I.LdapSettings(url="ldap://dir.example.com", user_dn="uid={user},ou=people,dc=example,dc=org")
    got = refused(lambda: rules.decide(state(), I.SetProvider(name="dir", kind="ldap", ldap=plain), NOW))
    assert got.code == "insecure" and "--insecure-plain-ldap" in got.reason
    for settings in (
        I.LdapSettings(url=plain.url, user_dn=plain.user_dn, start_tls=True),
        I.LdapSettings(url=plain.url, user_dn=plain.user_dn, allow_plain=True),
        I.LdapSettings(url="ldaps://dir.example.com", user_dn=plain.user_dn),
    ):
        assert rules.decide(state(), I.SetProvider(name="dir", kind="ldap", ldap=settings), NOW).payloads


def test_a_mapping_names_a_known_provider_and_resolves_its_scope_and_is_made_once() -> None:
    s = state(I.ProviderSet(name="corp", kind="oidc", oidc=OIDC))
    got = refused(lambda: rules.decide(s, I.MapGroup(provider="other", group="g", role="viewer", scope="cluster"), NOW))
    assert got.code == "not_found" and "corp" in got.reason
    d = rules.decide(s, I.MapGroup(provider="corp", group="ml-admins", role="viewer", scope="cluster"), NOW)
    (mapped,) = d.payloads
    assert (mapped.group, mapped.role, mapped.scope) == ("ml-admins", "viewer", "cluster")
    again = state(I.ProviderSet(name="corp", kind="oidc", oidc=OIDC), mapped)
    assert not rules.decide(
        again, I.MapGroup(provider="corp", group="ML-Admins", role="viewer", scope="cluster"), NOW
    ).payloads
    bad = refused(
        lambda: rules.decide(s, I.MapGroup(provider="corp", group="g", role="team-admin", scope="cluster"), NOW)
    )
    assert bad.code == "invalid_scope"


def test_removing_a_provider_takes_its_mappings_with_it() -> None:
    s = state(
        I.ProviderSet(name="corp", kind="oidc", oidc=OIDC),
        I.GroupMapped(provider="corp", mapping_id="m1", group="g", role="viewer", scope="cluster"),
    )
    d = rules.decide(s, I.RemoveProvider(name="corp"), NOW)
    s.apply(recorded(9, d.payloads[0], event_subject(I.AGGREGATE, "corp")))
    assert "corp" not in s.identity.providers and s.identity.mappings_of("corp") == []


def test_identity_commands_are_the_cluster_admins() -> None:
    assert rules.need(I.RemoveProvider(name="corp")).role == "cluster-admin"


# -- pure: groups to roles -------------------------------------------------------------------------


def test_a_group_matches_by_name_ignoring_case_and_an_ldap_dn_by_its_name_or_the_whole_dn() -> None:
    dn = "cn=ML-Admins,ou=groups,dc=example,dc=org"
    assert matches("ml-admins", "ML-Admins")
    assert matches("ml-admins", dn)
    assert matches("cn=ml-admins, ou=groups, dc=example, dc=org", dn)
    assert not matches("cn=ml-admins,ou=other,dc=example,dc=org", dn)
    assert not matches("ml", dn) and not matches("admins", "ml-admins")


def test_groups_grant_each_role_once_by_the_first_mapping_naming_it() -> None:
    mappings = [
        Mapping(mapping_id="m1", provider="corp", group="ml-admins", role="team-admin", scope="team:t1"),
        Mapping(mapping_id="m2", provider="corp", group="everyone", role="viewer", scope="cluster"),
        Mapping(mapping_id="m3", provider="corp", group="ml-leads", role="team-admin", scope="team:t1"),
        Mapping(mapping_id="m4", provider="corp", group="finance", role="viewer", scope="org:o1"),
    ]
    grants = grants_for(mappings, ["ML-Admins", "ml-leads", "everyone"])
    assert [(g.role, g.scope, g.mapping) for g in grants] == [
        ("team-admin", "team:t1", "m1"),
        ("viewer", "cluster", "m2"),
    ]
    assert grants_for(mappings, ["nobody"]) == ()


def test_a_person_in_no_mapped_group_is_told_which_of_their_groups_an_administrator_could_map() -> None:
    assert no_role_refusal("alice", "Corp", ["ml-users", "everyone"], []) == (
        "alice is in no group mapped to a role: ask an administrator to map one of everyone, ml-users"
    )
    mappings = [Mapping(mapping_id="m", provider="corp", group="ml-admins", role="viewer", scope="cluster")]
    assert "add them to one of ml-admins" in no_role_refusal("carol", "Corp", [], mappings)


# -- pure: people a provider makes --------------------------------------------------------------------


def test_a_provider_makes_a_person_without_a_password_named_after_their_login() -> None:
    d = people_rules.decide(
        people_rules.PeopleAndTree(),
        P.ProvisionUser(source="idp:corp", login="Alice.Smith@Example.com", display_name="Alice Smith"),
        NOW,
    )
    added = d.payloads[0]
    assert isinstance(added, P.UserAdded) and added.name == "alice.smith@example.com"
    assert added.source == "idp:corp" and added.login == "Alice.Smith@Example.com"
    assert not any(isinstance(p, P.PasswordSet) for p in d.payloads)


def test_two_logins_that_come_to_one_name_get_two_people() -> None:
    state_ = people_rules.PeopleAndTree(people_of(P.UserAdded(name="bob", source="scim", login="bob@old.example")))
    d = people_rules.decide(state_, P.ProvisionUser(source="scim", login="Bob"), NOW)
    assert d.payloads[0].name == "bob-2"
    assert P.person_name("42") == "u42" and P.person_name("Ünïcode") == "u-n-code"


def test_a_person_added_here_with_a_password_is_never_taken_over_by_a_provider() -> None:
    local = people_rules.PeopleAndTree(people_of(P.UserAdded(name="admin")))
    got = refused(
        lambda: people_rules.decide(local, P.ProvisionUser(source="idp:corp", login="admin", name="admin"), NOW)
    )
    assert got.code == "local_account"


def test_a_person_from_a_provider_has_no_password_here() -> None:
    state_ = people_rules.PeopleAndTree(people_of(P.UserAdded(name="alice", source="idp:corp", login="alice")))
    got = refused(
        lambda: people_rules.decide(
            state_, P.SetPassword(name="alice", password_hash="$argon2id$v=19$m=1,t=1,p=1$a$b"), NOW
        )
    )
    assert got.code == "provider_account"


def test_deactivating_by_a_provider_disables_and_says_the_tokens_stop() -> None:
    state_ = people_rules.PeopleAndTree(people_of(P.UserAdded(name="alice", source="scim", login="alice")))
    d = people_rules.decide(state_, P.ProvisionUser(source="scim", login="alice", name="alice", active=False), NOW)
    assert isinstance(d.payloads[0], P.UserDisabled) and "stop working" in d.message


def test_roles_follow_groups_leaving_those_granted_by_hand_or_by_another_provider() -> None:
    people = people_of(
        P.UserAdded(name="alice", source="idp:corp", login="alice"),
        P.RoleGranted(name="alice", role="viewer", scope="cluster"),  # by hand
        P.RoleGranted(name="alice", role="member", scope="org:o1", provider="scim", group="g", mapping="s1"),
        P.RoleGranted(name="alice", role="team-admin", scope="team:t1", provider="corp", group="ml", mapping="m1"),
    )
    grant = P.MappedGrant(role="member", scope="team:t2", group="ml-users", mapping="m2")
    d = people_rules.decide(
        people_rules.PeopleAndTree(people),
        P.SyncRoles(name="alice", provider="corp", groups=("ml-users",), grants=(grant,)),
        NOW,
    )
    kinds = [(type(p).__name__, getattr(p, "role", ""), getattr(p, "scope", "")) for p in d.payloads]
    assert kinds == [
        ("GroupsSeen", "", ""),
        ("RoleGranted", "member", "team:t2"),
        ("RoleRevoked", "team-admin", "team:t1"),
    ]
    granted = d.payloads[1]
    assert (granted.provider, granted.group, granted.mapping) == ("corp", "ml-users", "m2")


# -- end to end: a person a provider vouched for signs in ----------------------------------------


@pytest.fixture
async def fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=("people", "identity", "projections", "api"))
    # A sign-in of the tests' own, folding the same log as the admin API's (which answers whoami).
    f.signin = SignIn(f.store)
    f.signin.start()
    yield f
    await f.signin.close()
    await f.stop()


async def whoami(fleet: Fleet, token: str) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"http://127.0.0.1:{fleet.admin_port}/api/v1/whoami", headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        return r.status, await r.json()


async def answered(fleet: Fleet, token: str, status: int) -> tuple[int, dict]:
    """whoami with ``token`` once the admin API answers ``status``: it folds the log itself, a moment after
    the tests' own sign-in has (the last answer is returned when the deadline passes, for the assertion)."""
    last: list[tuple[int, dict]] = []

    async def attempt() -> bool:
        last[:] = [await whoami(fleet, token)]
        return last[0][0] == status

    with contextlib.suppress(TimeoutError, AssertionError):
        await wait_until(attempt, what=f"the admin API to answer {status}")
    return last[0]


async def provider_with_mapping(fleet: Fleet) -> str:
    await fleet.client.send(
        I.SERVICE, "idp.set", I.SetProvider(name="corp", kind="oidc", oidc=OIDC), actor="user:tester"
    )
    done = await fleet.client.send(
        I.SERVICE,
        "idp.map",
        I.MapGroup(provider="corp", group="ml-admins", role="viewer", scope="cluster"),
        actor="user:tester",
    )
    return str(done.result["mapping"])


async def test_a_person_a_provider_vouches_for_is_made_given_their_mapped_roles_and_signed_in(fleet: Fleet) -> None:
    mapping = await provider_with_mapping(fleet)
    signin = fleet.signin
    await signin.folded(lambda: bool(signin.identity.mappings_of("corp")))
    alice = I.ExternalIdentity(
        provider="corp", subject="s-1", username="Alice", email="alice@example.com", groups=("ml-admins", "everyone")
    )
    token, _, name = await signin.sign_in_external(alice, "oidc:corp", "127.0.0.1")
    assert name == "alice"
    status, me = await answered(fleet, token, 200)
    assert status == 200 and me["user"] == "alice"

    events = await fleet.store.read(event_subject(P.AGGREGATE, "alice"))
    by_type = {type(e.payload).__name__: e for e in events}
    assert by_type["UserAdded"].envelope.actor == "idp:corp" and by_type["UserAdded"].payload.source == "idp:corp"
    granted = by_type["RoleGranted"]
    assert granted.envelope.actor == "idp:corp"
    assert (granted.payload.provider, granted.payload.group, granted.payload.mapping) == ("corp", "ml-admins", mapping)
    assert (
        by_type["TokenIssued"].payload.method == "oidc:corp" and by_type["TokenIssued"].envelope.actor == "user:alice"
    )
    assert not any(isinstance(e.payload, P.PasswordSet) for e in events)

    # Out of the group at the provider: the next sign-in takes the role away, and says which provider did.
    token2 = None
    with pytest.raises(Refused) as caught:
        token2 = await signin.sign_in_external(
            I.ExternalIdentity(provider="corp", subject="s-1", username="alice", groups=("everyone",)), "oidc:corp", "x"
        )
    assert token2 is None
    assert caught.value.code == "no_mapped_group"
    assert caught.value.message == "alice is in no group mapped to a role: ask an administrator to map one of everyone"
    # …and the role her group granted went first: leaving every mapped group leaves her nothing.
    await signin.folded(lambda: signin.people.by_name["alice"].roles == [])
    assert signin.people.by_name["alice"].roles == []
    revoked = [
        e for e in await fleet.store.read(event_subject(P.AGGREGATE, "alice")) if isinstance(e.payload, P.RoleRevoked)
    ]
    assert [(e.payload.role, e.payload.provider) for e in revoked] == [("viewer", "corp")]


async def test_leaving_a_mapped_group_revokes_its_role_at_the_next_sign_in(fleet: Fleet) -> None:
    await provider_with_mapping(fleet)
    await fleet.client.send(
        I.SERVICE,
        "idp.map",
        I.MapGroup(provider="corp", group="everyone", role="viewer", scope="cluster"),
        actor="user:tester",
    )
    await fleet.client.send(
        I.SERVICE,
        "idp.map",
        I.MapGroup(provider="corp", group="ml-admins", role="cluster-admin", scope="cluster"),
        actor="user:tester",
    )
    signin = fleet.signin
    await signin.folded(lambda: len(signin.identity.mappings_of("corp")) == 3)
    bob = I.ExternalIdentity(provider="corp", subject="s-2", username="bob", groups=("ml-admins", "everyone"))
    await signin.sign_in_external(bob, "oidc:corp", "x")
    assert ("cluster-admin", "cluster") in signin.people.by_name["bob"].roles
    await signin.sign_in_external(
        I.ExternalIdentity(provider="corp", subject="s-2", username="bob", groups=("everyone",)), "oidc:corp", "x"
    )
    assert signin.people.by_name["bob"].roles == [("viewer", "cluster")]
    revoked = [
        e for e in await fleet.store.read(event_subject(P.AGGREGATE, "bob")) if isinstance(e.payload, P.RoleRevoked)
    ]
    assert [(e.payload.role, e.payload.provider, e.envelope.actor) for e in revoked] == [
        ("cluster-admin", "corp", "idp:corp")
    ]


async def test_a_provider_cannot_sign_in_as_a_person_added_here_with_a_password(fleet: Fleet) -> None:
    await provider_with_mapping(fleet)
    await fleet.client.send(
        P.SERVICE,
        "user.add",
        P.AddUser(name="root", password_hash=hash_password("a long local password")),
        actor="user:t",
    )
    signin = fleet.signin
    await signin.folded(lambda: "root" in signin.people.by_name and bool(signin.identity.mappings_of("corp")))
    with pytest.raises(Refused) as caught:
        await signin.sign_in_external(
            I.ExternalIdentity(provider="corp", subject="x", username="Root", groups=("ml-admins",)), "oidc:corp", "x"
        )
    assert caught.value.status == 409 and caught.value.code == "local_account"
    assert signin.people.by_name["root"].tokens == {}


async def test_a_person_disabled_at_the_provider_is_not_let_back_in_by_a_sign_in(fleet: Fleet) -> None:
    await provider_with_mapping(fleet)
    signin = fleet.signin
    await signin.folded(lambda: bool(signin.identity.mappings_of("corp")))
    dave = I.ExternalIdentity(provider="corp", subject="d", username="dave", groups=("ml-admins",))
    token, _, _ = await signin.sign_in_external(dave, "oidc:corp", "x")
    await fleet.client.send(
        P.SERVICE,
        "user.provision",
        P.ProvisionUser(source="scim", login="dave", name="dave", active=False),
        actor="svc:scim",
    )
    await signin.folded(lambda: signin.people.by_name["dave"].disabled)
    assert (await answered(fleet, token, 403))[0] == 403
    with pytest.raises(Refused) as caught:
        await signin.sign_in_external(dave, "oidc:corp", "x")
    assert caught.value.code == "user_disabled"


async def test_a_viewer_may_not_add_an_identity_provider(fleet: Fleet) -> None:
    from llmgw.services.api.act import act
    from tests.signin import person_on_log

    token = await person_on_log(fleet.store, "watcher", role="viewer")
    outcome = await act(fleet.store, token, I.SERVICE, "idp.set", I.SetProvider(name="corp", kind="oidc", oidc=OIDC))
    assert outcome.code == "forbidden" and "cluster-admin" in outcome.message
    with pytest.raises(CommandRejectedError):
        await fleet.client.send(
            I.SERVICE, "idp.set", I.SetProvider(name="BAD NAME", kind="oidc", oidc=OIDC), actor="user:tester"
        )


async def test_a_local_password_still_signs_in_beside_the_providers_and_the_log_says_it_was_a_password(
    fleet: Fleet,
) -> None:
    await provider_with_mapping(fleet)
    password = "the break-glass password, in the safe"
    await fleet.client.send(
        P.SERVICE, "user.add", P.AddUser(name="root", password_hash=hash_password(password)), actor="user:t"
    )
    signin = fleet.signin
    await signin.folded(lambda: "root" in signin.people.by_name and bool(signin.identity.providers))
    token, _, name = await signin.login("root", password, "10.9.8.7")
    assert name == "root" and (await answered(fleet, token, 200))[0] == 200
    issued = [
        e for e in await fleet.store.read(event_subject(P.AGGREGATE, "root")) if isinstance(e.payload, P.TokenIssued)
    ]
    assert [(e.payload.method, e.envelope.actor, e.payload.label) for e in issued] == [
        ("password", "user:root", "login from 10.9.8.7")
    ]
    # A person a provider made has no password to try: the answer is the same as for a wrong one, with a hint.
    await signin.sign_in_external(
        I.ExternalIdentity(provider="corp", subject="s", username="erin", groups=("ml-admins",)), "oidc:corp", "x"
    )
    with pytest.raises(Refused) as caught:
        await signin.login("erin", "any password at all", "10.9.8.7")
    assert caught.value.code == "invalid_login" and "sign in through it" in caught.value.message
