"""The command services and the jobs' waits read the log through supervised followers.

Each test breaks one thing a command service lives through — its fold's consumer deleted, an event
its fold raises on, a fold that cannot advance — and checks what a person sending commands would
notice: commands still decided on the log as it is, or refused naming the fold, and a ``/healthz``
that names the service's folds.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.commands.processor import CommandProcessor
from llmgw.events.folds.tenancy import TenancyTree
from llmgw.events.runtime.follower import FollowerRegistry
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.runtime.waiter import EventWaiter
from llmgw.events.schema import access as A
from llmgw.events.schema import subjects as S
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.outcomes import CommandCompleted
from llmgw.services.access.service import AccessService
from llmgw.services.tenancy.service import TenancyService
from tests.fleet import Fleet
from tests.support import NatsServer, wait_until

pytestmark = pytest.mark.asyncio

TREE = S.event_subject(T.AGGREGATE, T.TREE_ID)


@contextlib.asynccontextmanager
async def serving(*services: TenancyService | AccessService) -> AsyncIterator[None]:
    """The services' folds following the log and their commands handled, until the block ends."""
    processors: list[CommandProcessor] = []
    tasks: list[asyncio.Task] = []
    for service in services:
        service.start()
        processors.append(service.processor())
        tasks.append(asyncio.create_task(processors[-1].run()))
    try:
        yield
    finally:
        for p in processors:
            p.stop()
        await asyncio.wait_for(asyncio.gather(*tasks), 10)
        for service in services:
            await service.close()


async def create(store: EventStore, kind: str, path: str) -> CommandCompleted:
    return await CommandClient.for_service(store, "tests").send(
        T.SERVICE, "create", T.CreateScope(kind=kind, path=path), actor="user:a"
    )


async def create_key(store: EventStore, project: str) -> CommandCompleted:
    _, prefix, digest = A.make_api_key()
    key = A.CreateKey(project=project, prefix=prefix, secret_sha256=digest, name="ci")
    return await CommandClient.for_service(store, "tests").send(A.SERVICE, "key.create", key, actor="user:a")


def states(folds: FollowerRegistry) -> dict[str, str]:
    return {h.name: h.state for h in folds.health()}


def all_live(folds: FollowerRegistry) -> bool:
    return all(state == "live" for state in states(folds).values())


async def test_a_server_s_command_services_name_their_folds_live_on_its_healthz(
    store: EventStore, nats: NatsServer, tmp_path: Path
) -> None:
    services = ("tenancy", "access", "catalog", "fleet", "mirror", "jobs")
    server = await Fleet(store, nats.url, tmp_path).start(services=services)
    try:
        url = f"http://127.0.0.1:{server.admin_port}/healthz"

        async def healthy() -> dict | None:
            async with aiohttp.ClientSession() as s, s.get(url) as r:
                return await r.json() if r.status == 200 else None

        body = await wait_until(healthy, deadline_s=30, what="the server's /healthz 200")
        command_folds = {
            "tenancy",
            "tenancy-keys",
            "access-tenancy",
            "access-keys",
            "access-limits",
            "access-prices",
            "access-budgets",
            "catalog",
            "fleet",
            "mirror",
            "jobs-commands",
        }
        assert command_folds <= set(body["folds"])
        assert {body["folds"][name]["state"] for name in command_folds} == {"live"}
        metrics = server.handles["folds"].metrics
        assert metrics.get_sample_value("llmgw_fold_healthy", {"fold": "tenancy"}) == 1
        assert metrics.get_sample_value("llmgw_fold_healthy", {"fold": "access-keys"}) == 1
    finally:
        await server.stop()
    assert server.handles["folds"].health() == [], "stopping the server closes every fold"


async def test_a_command_after_its_fold_s_consumer_was_deleted_is_decided_on_the_log_as_it_is(
    store: EventStore,
) -> None:
    folds = FollowerRegistry()
    tenancy, access = TenancyService(store, folds=folds), AccessService(store, folds=folds)
    async with serving(tenancy, access):
        await create(store, "org", "acme")
        await create(store, "team", "acme/ml")
        await wait_until(lambda: all_live(folds), what="every fold live")
        consumers = await store.js.consumers_info(store.stream)
        assert len(consumers) == len(states(folds)), "one consumer per fold"
        for c in consumers:
            await store.js.delete_consumer(store.stream, c.name)
        # The project is new since the deletion: the key is decided on a fold that read it.
        await create(store, "project", "acme/ml/chat")
        key = await create_key(store, "acme/ml/chat")
        assert key.message.startswith("key ")
        await wait_until(lambda: all_live(folds), deadline_s=30, what="every fold live again")
        assert [h.quarantined for h in folds.health()] == [0] * len(states(folds))
        assert [k.name for k in access.state.keys.values()] == ["ci"], "the key folded once"
        assert tenancy.tree.live_keys == {key.result["project_id"]: {key.result["id"]: "ci"}}


async def test_an_event_a_command_service_cannot_fold_is_quarantined_and_later_commands_are_decided(
    store: EventStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    apply = TenancyTree.apply

    def buggy_apply(self: TenancyTree, e: RecordedEvent) -> None:  # a bug in the fold for one event
        if isinstance(e.payload, T.OrgCreated) and e.payload.name == "poison":
            raise KeyError("a handler bug")
        apply(self, e)

    monkeypatch.setattr(TenancyTree, "apply", buggy_apply)
    folds = FollowerRegistry()
    tenancy = TenancyService(store, folds=folds)
    async with serving(tenancy):
        poison = T.OrgCreated(org_id="o-poison", name="poison")
        poisoned = await store.append(TREE, [NewEvent(payload=poison, actor="user:t")])
        out = await create(store, "org", "acme")
        assert out.message == "org acme created"
        assert (await create(store, "team", "acme/ml")).message == "team acme/ml created"
        assert folds.metrics.get_sample_value("llmgw_fold_quarantined_total", {"fold": "tenancy"}) == 1
        kept = await store.js.get_last_msg(S.STREAM_QUARANTINE, f"{S.QUARANTINE_ROOT}.>")
        assert kept.headers["Llmgw-Origin-Seq"] == str(poisoned.last_seq)
        assert "a handler bug" in kept.headers["Llmgw-Error"]
        await wait_until(lambda: states(folds)["tenancy"] == "live", what="the tenancy fold live")


async def test_a_command_whose_fold_cannot_catch_up_is_refused_naming_the_fold_and_then_decided(
    store: EventStore,
) -> None:
    folds = FollowerRegistry()
    tenancy = TenancyService(store, folds=folds)
    tenancy.fold.wait_s = 0.5  # how long a command waits for the fold: it cannot advance here at all
    gate = asyncio.Event()
    fold_tree = tenancy.fold.apply

    async def stuck_apply(e: RecordedEvent) -> None:
        if isinstance(e.payload, T.OrgCreated) and e.payload.name == "stuck":
            await gate.wait()  # the fold's handler hangs on one event: everything after it waits
        fold_tree(e)

    tenancy.fold.apply = stuck_apply
    async with serving(tenancy):
        await store.append(TREE, [NewEvent(payload=T.OrgCreated(org_id="o-stuck", name="stuck"), actor="user:t")])
        with pytest.raises(CommandRejectedError) as caught:
            await create(store, "org", "acme")
        assert caught.value.code == "unavailable"
        assert caught.value.reason.startswith("the tenancy fold has read the log to 0 of 1 and did not catch up")
        assert "nothing was decided; send the command again once the process's /healthz shows the fold live" in (
            caught.value.reason
        )
        gate.set()
        out = await create(store, "org", "acme")
        assert out.message == "org acme created"

        async def folded() -> list[str] | None:  # the outcome is written before the fold reads the event back
            names = [s.name for s in tenancy.tree.scopes.values()]
            return names if len(names) == 2 else None

        assert await wait_until(folded, what="the fold to read the new org") == ["stuck", "acme"]


async def test_a_follower_keeps_delivering_after_its_consumer_is_deleted(store: EventStore) -> None:
    subject = S.event_subject(T.AGGREGATE, "follow")
    first = await store.append(subject, [NewEvent(payload=T.OrgCreated(org_id="o1", name="a"), actor="user:t")])
    folds = FollowerRegistry()
    async with EventWaiter(store, {subject: 0}, registry=folds, name="waiter") as follower:
        got = await follower.next(30)
        assert got is not None and got.seq == first.last_seq
        await wait_until(lambda: all_live(folds), what="the follower's fold live")
        assert list(states(folds)) == [f"waiter:{subject}"]
        for c in await store.js.consumers_info(store.stream):
            await store.js.delete_consumer(store.stream, c.name)
        then = await store.append(subject, [NewEvent(payload=T.OrgCreated(org_id="o2", name="b"), actor="user:t")])
        got = await follower.next(60)
        assert got is not None and got.seq == then.last_seq, "the event after the deletion arrives"
        assert await follower.next(0.2) is None, "and nothing is delivered twice"
        await wait_until(lambda: all_live(folds), deadline_s=30, what="the follower's fold live again")
        assert follower.not_live() == []
    assert folds.health() == [], "leaving the block closes the follower's folds"
