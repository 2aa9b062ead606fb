"""Signed commands, by trying: a command is carried out only when signed by a key the cluster knows, over
its very bytes, by someone who may; every refusal is in the log and nothing is applied."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator

import msgspec
import pytest

from llmgw.events.commands.auth import CommandVerifier, ServiceSigner, TokenSigner
from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.command import Command, command_subject
from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.commands.signing import service_key, sign
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.secrets import signing_secret
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import people as P
from llmgw.events.schema import subjects as S
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import utc_now
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.outcomes import REFUSAL_AGGREGATE
from llmgw.events.schema.subjects import event_subject
from llmgw.services.people.service import PeopleService
from llmgw.services.tenancy.service import TenancyService
from tests.fleet import LLMGW
from tests.support import NatsServer, signed, wait_until

pytestmark = pytest.mark.asyncio

TREE = event_subject(T.AGGREGATE, T.TREE_ID)
HASH = "$argon2id$v=19$m=19456,t=2,p=1$c2FsdHNhbHRzYWx0$aGFzaGhhc2hoYXNoaGFzaGhhc2hoYXNoaGFzaGhhc2g"


@pytest.fixture
async def services(store: EventStore) -> AsyncIterator[CommandClient]:
    """The tenancy and people services on the bus; yields a client of the system itself (a service)."""
    processors = [TenancyService(store).processor(), PeopleService(store).processor()]
    tasks = [asyncio.create_task(p.run()) for p in processors]
    yield CommandClient.for_service(store, "tests")
    for p in processors:
        p.stop()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)


async def person(system: CommandClient, name: str, *roles: tuple[str, str]) -> str:
    """A person with ``roles`` and a personal token; returns the token."""
    await system.send(P.SERVICE, "user.add", P.AddUser(name=name, password_hash=HASH), actor="system:tests")
    for role, scope in roles:
        grant = P.GrantRole(name=name, role=role, scope=scope)
        await system.send(P.SERVICE, "role.grant", grant, actor="system:tests")
    token, issue = P.issue(name, "personal", label="tests")
    await system.send(P.SERVICE, "token.issue", issue, actor="system:tests")
    return token


def create(kind: str, path: str, actor: str = "") -> Command:
    return Command(
        id=new_id(),
        kind="tenancy.create",
        actor=actor,
        at=utc_now(),
        data=msgspec.Raw(msgspec.json.encode(T.CreateScope(kind=kind, path=path))),
    )


async def publish(store: EventStore, command: Command, msg_id: str | None = None) -> None:
    await store.js.publish(
        command_subject(T.SERVICE, "create"),
        msgspec.json.encode(command),
        headers={S.HDR_MSG_ID: msg_id or command.id},
    )


async def outcome_of(store: EventStore, command: Command) -> msgspec.Struct:
    subject = S.command_outcome_subject(command.id)
    await wait_until(lambda: store.last_seq(subject), what=f"the outcome of {command.id}")
    [event] = await store.read(subject)
    return event.payload


async def tree_types(store: EventStore) -> list[str]:
    return [e.type for e in await store.read(TREE)]


async def test_a_persons_command_is_carried_out_as_that_person_whatever_actor_it_leaves_blank(
    store: EventStore, services: CommandClient
) -> None:
    token = await person(services, "ann", ("cluster-admin", "cluster"))
    out = await CommandClient(store, TokenSigner(token)).send(
        T.SERVICE, "create", T.CreateScope(kind="org", path="acme"), actor=""
    )
    assert out.message == "org acme created" and out.requested_by == "user:ann"
    [created] = await store.read(TREE)
    assert created.envelope.actor == "user:ann"


async def test_a_command_with_a_forged_actor_is_refused_and_nothing_applied(
    store: EventStore, services: CommandClient
) -> None:
    token = await person(services, "bob", ("cluster-admin", "cluster"))
    with pytest.raises(CommandRejectedError) as caught:
        await CommandClient(store, TokenSigner(token)).send(
            T.SERVICE, "create", T.CreateScope(kind="org", path="acme"), actor="user:ann"
        )
    assert caught.value.code == "forged_actor"
    assert "says it is from user:ann but is signed by user:bob's token" in caught.value.reason
    assert await tree_types(store) == []


async def test_an_altered_command_is_refused_and_nothing_applied(store: EventStore, services: CommandClient) -> None:
    token = await person(services, "bob", ("cluster-admin", "cluster"))
    good = await signed(store, create("org", "acme"), TokenSigner(token))
    altered = msgspec.structs.replace(
        good, data=msgspec.Raw(msgspec.json.encode(T.CreateScope(kind="org", path="evil")))
    )
    await publish(store, altered)
    refused = await outcome_of(store, altered)
    assert refused.code == "bad_signature" and "does not match the command" in refused.reason
    assert await tree_types(store) == []


async def test_an_unsigned_command_and_one_signed_with_a_key_the_cluster_does_not_know_are_refused(
    store: EventStore, services: CommandClient
) -> None:
    unsigned = create("org", "acme", actor="user:root")
    await publish(store, unsigned)
    assert (await outcome_of(store, unsigned)).code == "unsigned"

    # A "service" signature made with another cluster's secret.
    stranger = msgspec.structs.replace(create("org", "acme", actor="svc:scheduler"), signer="svc:scheduler")
    stranger = msgspec.structs.replace(
        stranger, signature=sign(service_key(b"x" * 32, "scheduler"), stranger.signed_bytes())
    )
    await publish(store, stranger)
    assert (await outcome_of(store, stranger)).code == "bad_signature"

    never_issued = P.make_token("personal")[0]
    ghost = await signed(store, create("org", "acme"), TokenSigner(never_issued))
    await publish(store, ghost)
    refused = await outcome_of(store, ghost)
    assert refused.code == "unknown_signer" and "sign in again" in refused.reason
    assert await tree_types(store) == []


async def test_a_disabled_or_revoked_signer_is_refused_at_once(store: EventStore, services: CommandClient) -> None:
    token = await person(services, "cy", ("cluster-admin", "cluster"))
    cy = CommandClient(store, TokenSigner(token))
    await cy.send(T.SERVICE, "create", T.CreateScope(kind="org", path="acme"), actor="")
    await services.send(P.SERVICE, "user.disable", P.DisableUser(name="cy", reason="left"), actor="system:tests")
    with pytest.raises(CommandRejectedError) as caught:
        await cy.send(T.SERVICE, "create", T.CreateScope(kind="org", path="beta"), actor="")
    assert caught.value.code == "disabled" and "user cy is disabled (left)" in caught.value.reason

    await services.send(P.SERVICE, "user.enable", P.EnableUser(name="cy"), actor="system:tests")
    prefix = P.token_prefix(token)
    await services.send(P.SERVICE, "token.revoke", P.RevokeToken(name="cy", token=prefix or ""), actor="system:tests")
    with pytest.raises(CommandRejectedError) as caught:
        await cy.send(T.SERVICE, "create", T.CreateScope(kind="org", path="beta"), actor="")
    assert caught.value.code == "unknown_signer"
    assert await tree_types(store) == ["org.created"]


async def test_a_replayed_command_is_refused_with_an_event_and_applied_once(
    store: EventStore, services: CommandClient
) -> None:
    token = await person(services, "dee", ("cluster-admin", "cluster"))
    command = await signed(store, create("org", "acme"), TokenSigner(token))
    await publish(store, command)
    assert (await outcome_of(store, command)).message == "org acme created"
    # The same bytes again, as a new message (past the stream's de-duplication window).
    await publish(store, command, msg_id="replayed")

    async def refusals() -> list:
        return await store.read(f"{S.EVENTS_ROOT}.{REFUSAL_AGGREGATE}.>")

    [refusal] = await wait_until(refusals, what="the replay's refusal")
    assert refusal.type == "command.replayed" and refusal.payload.command_id == command.id
    assert refusal.payload.requested_by == "user:dee"
    assert await tree_types(store) == ["org.created"]
    assert len(await store.read(S.command_outcome_subject(command.id))) == 1


async def test_a_person_without_the_role_is_refused_naming_the_role_and_scope_needed(
    store: EventStore, services: CommandClient
) -> None:
    await services.send(T.SERVICE, "create", T.CreateScope(kind="org", path="acme"), actor="system:tests")
    await services.send(T.SERVICE, "create", T.CreateScope(kind="team", path="acme/ml"), actor="system:tests")
    token = await person(services, "eve", ("member", "team:acme/ml"))
    eve = CommandClient(store, TokenSigner(token))
    with pytest.raises(CommandRejectedError) as caught:
        await eve.send(T.SERVICE, "create", T.CreateScope(kind="project", path="acme/ml/chat"), actor="")
    assert caught.value.code == "forbidden"
    assert caught.value.reason == (
        "creating project acme/ml/chat needs team-admin of team:acme/ml; eve holds member of team:acme/ml"
    )
    with pytest.raises(CommandRejectedError) as caught:
        grant = P.GrantRole(name="eve", role="team-admin", scope="team:acme/ml")
        await eve.send(P.SERVICE, "role.grant", grant, actor="")
    assert caught.value.code == "forbidden"

    grant = P.GrantRole(name="eve", role="team-admin", scope="team:acme/ml")
    await services.send(P.SERVICE, "role.grant", grant, actor="system:tests")
    out = await eve.send(T.SERVICE, "create", T.CreateScope(kind="project", path="acme/ml/chat"), actor="")
    assert out.message.startswith("project acme/ml/chat created")


async def test_a_service_signs_as_itself_and_may_act_for_a_person(store: EventStore, services: CommandClient) -> None:
    api = CommandClient(store, ServiceSigner(store, "api"))
    out = await api.send(T.SERVICE, "create", T.CreateScope(kind="org", path="acme"), actor="user:ann")
    assert out.requested_by == "user:ann"
    [created] = await store.read(TREE)
    assert created.envelope.actor == "user:ann"
    [outcome] = await store.read(S.command_outcome_subject(created.envelope.causation or ""))
    assert outcome.payload.signer == "svc:api"


async def test_services_sharing_one_verifier_fold_the_signers_once_and_it_outlives_the_first_to_stop(
    store: EventStore,
) -> None:
    folds = FollowerRegistry()
    verifier = CommandVerifier(store, registry=folds)
    tenancy = TenancyService(store, folds=folds, verifier=verifier).processor()
    tenancy_task = asyncio.create_task(tenancy.run())
    system = CommandClient.for_service(store, "tests")
    await system.send(T.SERVICE, "create", T.CreateScope(kind="org", path="beta"), actor="system:tests")
    # Made once the verifier's fold is reading (as a later entry of `llmgw up` is): it decides on that fold.
    people = PeopleService(store, folds=folds, verifier=verifier).processor()
    people_task = asyncio.create_task(people.run())
    try:
        token = await person(system, "ann", ("cluster-admin", "cluster"))
        ann = CommandClient(store, TokenSigner(token))
        await ann.send(T.SERVICE, "create", T.CreateScope(kind="org", path="acme"), actor="")
        # One fold of the people and the tree, not one per service nor another for the people service.
        people_and_tree = sorted(h.name for h in folds.health() if not h.name.startswith("tenancy"))
        assert people_and_tree == ["signers", "signers-tenancy"]

        people.stop()
        await asyncio.wait_for(people_task, 10)
        out = await ann.send(T.SERVICE, "create", T.CreateScope(kind="team", path="acme/ml"), actor="")
        assert out.message.startswith("team acme/ml created")
    finally:
        people.stop()
        tenancy.stop()
        await asyncio.wait_for(asyncio.gather(people_task, tenancy_task), 10)


async def llmgw(nats_url: str, *args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        LLMGW,
        *args,
        env={**os.environ, "LLMGW_NATS_URL": nats_url, "LLMGW_DATA_DIR": "/nonexistent"},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    return proc.returncode or 0, out.decode()


async def test_events_verify_proves_every_command_from_the_log_and_finds_one_altered_afterwards(
    store: EventStore, services: CommandClient, nats: NatsServer
) -> None:
    token = await person(services, "fay", ("cluster-admin", "cluster"))
    await CommandClient(store, TokenSigner(token)).send(
        T.SERVICE, "create", T.CreateScope(kind="org", path="acme"), actor=""
    )
    unsigned = create("org", "evil", actor="user:root")
    await publish(store, unsigned)
    await outcome_of(store, unsigned)

    code, out = await llmgw(nats.url, "events", "verify", "--json")
    assert code == 0, out
    found = json.loads(out.splitlines()[-1])
    assert found["failures"] == [] and found["refused"] == 1
    # fay's command, and the system's: adding fay, granting her role, issuing her token.
    assert found["signers"] == {f"token:{P.token_prefix(token)}": 1, "svc:tests": 3}

    # Someone with write access to the log rewrites what fay asked for, after the fact.
    [event] = await store.read(TREE)
    [kept] = await store.read(S.command_outcome_subject(event.envelope.causation or ""))
    original = msgspec.json.decode(kept.payload.command, type=Command)
    rewritten = msgspec.structs.replace(
        original, id=new_id(), data=msgspec.Raw(msgspec.json.encode(T.CreateScope(kind="org", path="evil")))
    )
    forged = msgspec.structs.replace(kept.payload, command=msgspec.Raw(msgspec.json.encode(rewritten)))
    await store.append(S.command_outcome_subject(rewritten.id), [NewEvent(payload=forged, actor="svc:tenancy")])

    code, out = await llmgw(nats.url, "events", "verify")
    assert code == 1, out
    assert f"FAILED tenancy.create {rewritten.id}" in out and "the log was altered" in out


async def test_processes_that_first_need_the_signing_secret_at_the_same_moment_all_get_the_same_one(
    store: EventStore,
) -> None:
    got = await asyncio.gather(*(signing_secret(store.js) for _ in range(6)))
    assert len(set(got)) == 1 and len(got[0]) == 32
