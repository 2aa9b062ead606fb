"""The one command-handling shell (events/commands/shell.py), with a real nats-server and real services.

A rival writer appends to the same aggregate between a decision and its append, the way a second
service instance would; a redelivery is a command published again after its events were written.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.command import Command, command_subject
from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.commands.processor import CommandProcessor
from llmgw.events.commands.shell import Decision
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import jobs as J
from llmgw.events.schema import mirror as MI
from llmgw.events.schema import nodes as N
from llmgw.events.schema import subjects as S
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent, utc_now
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.subjects import EVENTS_ROOT, event_subject
from llmgw.services.fleet.service import FleetService
from llmgw.services.jobs.service import JobsConfig, JobsService
from llmgw.services.mirror.service import MirrorConfig, MirrorService
from llmgw.services.tenancy.service import TenancyService
from tests.fakehub import FakeHub
from tests.gguf_tiny import write_tiny_gguf
from tests.support import signed, wait_until

pytestmark = pytest.mark.asyncio

TREE = event_subject(T.AGGREGATE, T.TREE_ID)


@contextlib.asynccontextmanager
async def running(processor: CommandProcessor) -> AsyncIterator[CommandProcessor]:
    task = asyncio.create_task(processor.run())
    try:
        yield processor
    finally:
        processor.stop()
        await asyncio.wait_for(task, 10)


def with_rival(store: EventStore, service: TenancyService, races: int | None) -> list[int]:
    """Make a rival create an org after each of the first ``races`` decisions (None: after every one), before
    the decision is appended; returns the tree's sequence each decision was made at."""
    decided: list[int] = []

    async def rival(command: Command, payload: T.TenancyCommand, decision: Decision) -> None:
        decided.append(service.fold.seq(TREE))  # nothing awaited since the decision: the sequence it was made at
        if races is None or len(decided) <= races:
            rival = T.OrgCreated(org_id=new_id(), name=f"rival{len(decided)}")
            await store.append(TREE, [NewEvent(payload=rival, actor="user:rival")])

    service.shell.before_append = rival
    return decided


async def org_names(store: EventStore) -> list[str]:
    return [e.payload.name for e in await store.read(TREE) if isinstance(e.payload, T.OrgCreated)]


async def test_a_command_that_loses_a_race_is_decided_again_and_applied_once(store: EventStore) -> None:
    service = TenancyService(store)
    decided = with_rival(store, service, races=1)
    async with running(service.processor()):
        out = await CommandClient.for_service(store, "tests").send(
            T.SERVICE, "create", T.CreateScope(kind="org", path="acme"), actor="user:alice"
        )
    assert out.message == "org acme created"
    assert await org_names(store) == ["rival1", "acme"]
    assert len(decided) == 2 and decided[1] > decided[0], "decided again on the rival's event"


async def test_a_command_that_keeps_losing_races_is_refused_as_busy_with_what_to_do(store: EventStore) -> None:
    service = TenancyService(store)
    decided = with_rival(store, service, races=None)
    async with running(service.processor()):
        with pytest.raises(CommandRejectedError) as caught:
            await CommandClient.for_service(store, "tests").send(
                T.SERVICE, "create", T.CreateScope(kind="org", path="acme"), actor="user:alice"
            )
    assert caught.value.code == "busy"
    assert caught.value.reason == (
        "the tenancy tree changed 5 times while this tenancy.create command was being decided (other writers are "
        "busy on it): nothing was written; send the command again in a moment; "
        f"`llmgw events tail --aggregate {T.AGGREGATE}` shows who is changing it"
    )
    assert len(decided) == 5
    assert "acme" not in await org_names(store)


async def test_a_command_redelivered_after_its_events_but_before_its_outcome_is_already_applied(
    store: EventStore,
) -> None:
    """A fleet service stopped between appending a cordon and writing its outcome; the command comes again."""
    node = event_subject(N.AGGREGATE, "n1")
    await store.append(
        node,
        [NewEvent(payload=N.NodeRegistered(node_id="n1", capacity=N.NodeCapacity(address="n1:9")), actor="node:n1")],
    )
    command = Command(
        id=new_id(),
        kind="fleet.cordon",
        actor="user:ops",
        at=utc_now(),
        data=msgspec.Raw(msgspec.json.encode(N.CordonNode(node_id="n1", reason="maintenance"))),
    )
    cordoned = N.NodeCordoned(node_id="n1", reason="maintenance")
    await store.append(node, [NewEvent(payload=cordoned, actor="user:ops", causation=command.id)])
    async with running(FleetService(store).processor()):
        await store.js.publish(
            command_subject(N.SERVICE, "cordon"),
            msgspec.json.encode(await signed(store, command)),
            headers={S.HDR_MSG_ID: command.id},
        )
        outcome = S.command_outcome_subject(command.id)
        await wait_until(lambda: store.last_seq(outcome), what="the redelivered command's outcome")
        [written] = await store.read(outcome)
        assert written.type == "command.completed" and written.payload.message == "already applied"
        assert [e.type for e in await store.read(node)] == ["node.registered", "node.cordoned"]
        # The fold holds the cordon: cordoning again is refused for what it is, not applied twice.
        with pytest.raises(CommandRejectedError) as caught:
            await CommandClient.for_service(store, "tests").send(
                N.SERVICE, "cordon", N.CordonNode(node_id="n1"), actor="user:ops"
            )
    assert caught.value.reason == "node n1 is already cordoned"


async def _outcomes(store: EventStore) -> list[RecordedEvent]:
    return await store.read(f"{EVENTS_ROOT}.command.>")


async def test_a_command_s_events_name_it_as_cause_and_carry_its_own_id_or_its_job_s_as_correlation(
    store: EventStore,
) -> None:
    client = CommandClient.for_service(store, "tests")
    async with running(TenancyService(store).processor()):
        await client.send(T.SERVICE, "create", T.CreateScope(kind="org", path="acme"), actor="user:alice")
        await client.send(
            T.SERVICE, "create", T.CreateScope(kind="team", path="acme/ml"), actor="svc:jobs", correlation="job-7"
        )
    plain, by_job = await store.read(TREE)
    plain_outcome, job_outcome = await _outcomes(store)
    # A plain command: caused by it, and a thread of its own.
    assert plain_outcome.subject == S.command_outcome_subject(plain.envelope.causation or "")
    assert plain.envelope.correlation == plain.envelope.causation
    assert plain_outcome.envelope.correlation == plain.envelope.causation
    # A command a job sent: still caused by the command, in the job's thread.
    assert job_outcome.subject == S.command_outcome_subject(by_job.envelope.causation or "")
    assert by_job.envelope.correlation == "job-7" and by_job.envelope.causation != "job-7"
    assert job_outcome.envelope.correlation == "job-7"


async def test_a_fetch_a_job_asked_for_keeps_the_job_s_correlation_to_its_last_event(
    store: EventStore, tmp_path: Path
) -> None:
    """The mirror's later events (each verified file, the end) stay in the thread of whoever asked."""
    hub = await FakeHub().start()
    mirror = MirrorService(
        store, MirrorConfig(dir=str(tmp_path / "mirror"), hub=hub.url, hub_allow_private=True, retry_backoff_s=0.01)
    )
    try:
        hub.add_repo("acme/tiny-GGUF")
        hub.add_file("acme/tiny-GGUF", "tiny-Q8_0.gguf", write_tiny_gguf(tmp_path / "tiny.gguf"))
        await mirror.start()
        async with running(mirror.processor()):
            await CommandClient.for_service(store, "tests").send(
                MI.SERVICE,
                "fetch",
                MI.MirrorFetch(model="tiny", repo="acme/tiny-GGUF"),
                actor="svc:jobs",
                correlation="job-7",
            )

            async def ended() -> list[RecordedEvent] | None:
                events = await store.read(event_subject(MI.AGGREGATE, "tiny"))
                return events if events[-1].type in ("mirror.fetch_completed", "mirror.fetch_failed") else None

            events = await wait_until(ended, deadline_s=30, what="the fetch to end")
    finally:
        await mirror.close()
        await hub.stop()
    assert events[-1].type == "mirror.fetch_completed"
    [outcome] = await _outcomes(store)
    command_id = outcome.envelope.causation
    assert {(e.envelope.causation, e.envelope.correlation) for e in events} == {(command_id, "job-7")}


async def test_a_serve_command_redelivered_after_its_job_started_answers_with_that_job_and_starts_no_other(
    store: EventStore,
) -> None:
    """The jobs service stopped between starting a job and writing the command's outcome."""
    command = Command(
        id=new_id(),
        kind="jobs.serve",
        actor="user:a",
        at=utc_now(),
        data=msgspec.Raw(msgspec.json.encode(J.ServeModel(repo="acme/tiny-GGUF"))),
    )
    started = J.JobStarted(kind="serve", repo="acme/tiny-GGUF", requested_by="user:a")
    job = event_subject(J.AGGREGATE, command.id)
    await store.append(job, [NewEvent(payload=started, actor="user:a", causation=command.id)], expected=0)
    async with running(JobsService(store, JobsConfig()).processor()):
        await store.js.publish(
            command_subject(J.SERVICE, "serve"),
            msgspec.json.encode(await signed(store, command)),
            headers={S.HDR_MSG_ID: command.id},
        )
        outcome = S.command_outcome_subject(command.id)
        await wait_until(lambda: store.last_seq(outcome), what="the redelivered command's outcome")
    [written] = await store.read(outcome)
    assert written.payload.message == "already applied" and written.payload.result == {"job": command.id}
    assert [e.subject for e in await store.read(f"{EVENTS_ROOT}.{J.AGGREGATE}.>")] == [job]
