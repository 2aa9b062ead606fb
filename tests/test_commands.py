"""Commands through the bus: outcome with a deadline, refusals with reasons, handled once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import msgspec
import pytest

from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.command import Command, command_subject
from llmgw.events.commands.errors import CommandRejectedError, CommandTimeoutError
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import subjects as S
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import utc_now
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.outcomes import REFUSAL_AGGREGATE
from llmgw.events.schema.subjects import event_subject
from llmgw.services.tenancy.service import TenancyService
from tests.support import signed, wait_until

pytestmark = pytest.mark.asyncio


@pytest.fixture
async def tenancy(store: EventStore) -> AsyncIterator[TenancyService]:
    service = TenancyService(store)
    processor = service.processor()
    task = asyncio.create_task(processor.run())
    service.processor_ref = processor  # type: ignore[attr-defined]
    yield service
    processor.stop()
    await asyncio.wait_for(task, 10)


async def test_a_command_waits_for_its_outcome_and_the_events_carry_its_actor(
    store: EventStore, tenancy: TenancyService
) -> None:
    client = CommandClient.for_service(store, "tests")
    out = await client.send(T.SERVICE, "create", T.CreateScope(kind="org", path="acme"), actor="user:alice")
    assert out.message == "org acme created"
    [event] = await store.read(event_subject(T.AGGREGATE, T.TREE_ID))
    assert event.envelope.actor == "user:alice"
    assert event.id in out.events and out.last_seq == event.seq
    assert event.envelope.causation is not None  # the command's id


async def test_a_refusal_reaches_the_caller_with_its_reason(store: EventStore, tenancy: TenancyService) -> None:
    client = CommandClient.for_service(store, "tests")
    with pytest.raises(CommandRejectedError) as caught:
        await client.send(T.SERVICE, "create", T.CreateScope(kind="team", path="acme/ml"), actor="user:alice")
    assert "`llmgw ctl org create acme` first" in caught.value.reason
    assert caught.value.code == "parent_missing"


async def test_a_command_with_an_unknown_field_is_refused_as_malformed(
    store: EventStore, tenancy: TenancyService
) -> None:
    class Sneaky(msgspec.Struct, tag="create"):
        kind: str
        path: str
        owner: str

    with pytest.raises(CommandRejectedError) as caught:
        await CommandClient.for_service(store, "tests").send(
            T.SERVICE, "create", Sneaky(kind="org", path="acme", owner="eve"), actor="user:eve"
        )
    assert "malformed" in caught.value.reason and "owner" in caught.value.reason


async def test_a_command_nobody_handles_times_out_with_advice(store: EventStore) -> None:
    with pytest.raises(CommandTimeoutError) as caught:
        await CommandClient.for_service(store, "tests").send(
            "nobody", "create", T.CreateScope(kind="org", path="x"), actor="user:a", timeout=1.5
        )
    assert "is the nobody service running?" in str(caught.value)


async def _publish_raw_command(store: EventStore, command: Command, msg_id: str) -> None:
    command = await signed(store, command)
    await store.js.publish(
        command_subject(T.SERVICE, "create"), msgspec.json.encode(command), headers={S.HDR_MSG_ID: msg_id}
    )


async def test_a_command_sent_again_is_handled_once_and_the_replay_refused_in_the_log(
    store: EventStore, tenancy: TenancyService
) -> None:
    command = Command(
        id=new_id(),
        kind="tenancy.create",
        actor="user:a",
        at=utc_now(),
        data=msgspec.Raw(msgspec.json.encode(T.CreateScope(kind="org", path="acme"))),
    )
    outcome = S.command_outcome_subject(command.id)
    await _publish_raw_command(store, command, "first")
    await wait_until(lambda: store.last_seq(outcome), what="the first outcome")
    handled = tenancy.processor_ref.handled  # type: ignore[attr-defined]
    await _publish_raw_command(store, command, "second delivery")
    # The work queue drains once the processor has acknowledged the second delivery.
    await wait_until(lambda: _queue_empty(store), what="the command queue to drain")
    tree = await store.read(event_subject(T.AGGREGATE, T.TREE_ID))
    assert [e.type for e in tree] == ["org.created"]
    assert len(await store.read(outcome)) == 1
    assert tenancy.processor_ref.handled == handled  # type: ignore[attr-defined]
    [refusal] = await store.read(f"{S.EVENTS_ROOT}.{REFUSAL_AGGREGATE}.>")
    assert refusal.type == "command.replayed" and refusal.payload.command_id == command.id


async def _queue_empty(store: EventStore) -> bool:
    info = await store.js.stream_info(S.STREAM_COMMANDS)
    return info.state.messages == 0


async def test_a_command_whose_events_were_written_before_a_crash_is_not_applied_twice(
    store: EventStore, tenancy: TenancyService
) -> None:
    """The service died after appending the events and before writing the outcome."""
    command = Command(
        id=new_id(),
        kind="tenancy.create",
        actor="user:a",
        at=utc_now(),
        data=msgspec.Raw(msgspec.json.encode(T.CreateScope(kind="org", path="acme"))),
    )
    subject = event_subject(T.AGGREGATE, T.TREE_ID)
    await store.append(
        subject, [NewEvent(payload=T.OrgCreated(org_id="o1", name="acme"), actor="user:a", causation=command.id)]
    )
    await _publish_raw_command(store, command, command.id)
    outcome = S.command_outcome_subject(command.id)
    await wait_until(lambda: store.last_seq(outcome), what="the outcome")
    [written] = await store.read(outcome)
    assert written.type == "command.completed"
    assert written.payload.message == "already applied"
    assert len(await store.read(subject)) == 1


async def test_two_services_racing_on_the_tree_never_create_a_name_twice(store: EventStore) -> None:
    services = [TenancyService(store) for _ in range(2)]
    processors = [s.processor() for s in services]
    tasks = [asyncio.create_task(p.run()) for p in processors]
    client = CommandClient.for_service(store, "tests")
    results = await asyncio.gather(
        *(client.send(T.SERVICE, "create", T.CreateScope(kind="org", path="acme"), actor="user:a") for _ in range(6)),
        return_exceptions=True,
    )
    for p in processors:
        p.stop()
    await asyncio.gather(*tasks)
    created = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, CommandRejectedError)]
    assert len(created) == 1 and len(refused) == 5
    assert all("already exists" in r.reason for r in refused)
