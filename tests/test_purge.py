"""`model remove --purge` (CAT-4): the mirror service deletes a removed model's files, one event per file,
and finishes a purge it was stopped in; the CLI only asks and follows.

A fake hub feeds a real mirror service; the catalog runs in this process, agents are real processes.
No replica runs (the models are on demand), so no engine is needed: an agent's cache copy is a file
the test puts there, as a fetch would have.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw.cli.fleet_cmd import purge_line
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import mirror as E
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import event_subject
from llmgw.services.mirror.purge import CatalogView, fold_catalog, plan_purge
from tests.fakehub import FakeHub
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.signin import person_on_log
from tests.support import NatsServer, wait_until
from tests.test_fleet import _last_heartbeat
from tests.test_mirror import Rig as MirrorRig

pytestmark = [pytest.mark.timeout(180)]

LLMGW = str(Path(sys.executable).parent / "llmgw")
COMMIT = "c0ffee00" + "0" * 32
TINY = "tiny/c0ffee00/tiny.gguf"
README = "tiny/c0ffee00/README.md"


# -- the decisions -----------------------------------------------------------------------------


def test_a_purge_deletes_the_whole_version_and_the_nodes_copy_when_no_other_model_uses_them() -> None:
    plan = plan_purge("tiny", f"mirror:{TINY}", {"other": "other/b1/other.gguf"}, [TINY, README])
    assert plan.mirror == [README, TINY]
    assert plan.nodes == [TINY]
    assert plan.kept == {}


def test_a_file_another_model_uses_is_kept_and_named() -> None:
    plan = plan_purge("tiny", f"mirror:{TINY}", {"tiny-too": TINY, "tiny-3": TINY}, [TINY, README])
    assert plan.mirror == []
    assert plan.nodes == []
    assert plan.kept == {TINY: "tiny-3, tiny-too use(s) it"}


def test_a_version_whose_other_file_is_used_stays_on_the_mirror_but_the_nodes_copy_goes() -> None:
    shard = "tiny/c0ffee00/other.gguf"
    plan = plan_purge("tiny", f"mirror:{TINY}", {"big": shard}, [TINY, shard])
    assert plan.mirror == []
    assert plan.nodes == [TINY]
    assert plan.kept[shard] == "big use(s) it"
    assert "big use(s) other files of tiny/c0ffee00" in plan.kept[TINY]


def test_a_model_with_a_local_source_has_nothing_to_purge() -> None:
    plan = plan_purge("local", "/models/x.gguf", {}, [])
    assert (plan.mirror, plan.nodes) == ([], [])
    assert "local path" in plan.note


def _recorded(seq: int, payload: object, event_id: str = "e") -> RecordedEvent:
    from datetime import UTC, datetime

    from llmgw.events.schema.envelope import Envelope

    env = Envelope(id=f"{event_id}{seq}", type="x", at=datetime.now(UTC), actor="svc:test")
    return RecordedEvent(envelope=env, payload=payload, subject="llmgw.evt.model.tiny", seq=seq)  # type: ignore[arg-type]


def test_the_catalog_fold_keeps_a_purge_open_from_the_removal_until_it_finishes() -> None:
    view = CatalogView()
    spec = M.ModelSpec(name="tiny", source=f"mirror:{TINY}")
    fold_catalog(view, "tiny", _recorded(1, M.ModelAdded(spec=spec)))
    assert "tiny" in view.models
    fold_catalog(view, "tiny", _recorded(2, M.ModelRemoved(purge=True)))
    assert "tiny" not in view.models
    track = view.purges["tiny"]
    assert track.source == f"mirror:{TINY}" and track.cause == "e2"
    fold_catalog(view, "tiny", _recorded(3, M.PurgeStarted(source=spec.source, mirror=[TINY], nodes=[TINY])))
    fold_catalog(view, "tiny", _recorded(4, M.PurgeFileRemoved(where="mirror", file=TINY)))
    assert view.purges["tiny"].removed == [("mirror", TINY)]
    fold_catalog(view, "tiny", _recorded(5, M.PurgeFinished(removed=1)))
    assert view.purges == {}


def test_a_removal_without_purge_opens_no_purge() -> None:
    view = CatalogView()
    fold_catalog(view, "tiny", _recorded(1, M.ModelAdded(spec=M.ModelSpec(name="tiny", source=f"mirror:{TINY}"))))
    fold_catalog(view, "tiny", _recorded(2, M.ModelRemoved(purge=False)))
    assert view.purges == {}


def test_the_cli_names_what_a_purge_keeps_and_the_nodes_that_did_not_answer() -> None:
    started = purge_line(
        M.PurgeStarted(source=f"mirror:{TINY}", nodes=[TINY], kept={README: "big use(s) it"}, waiting_for=["r1"])
    )
    assert started is not None
    assert f"kept {README}: big use(s) it" in started
    assert "waiting for 1 replica(s) to stop: r1" in started
    finished = purge_line(M.PurgeFinished(removed=1, unreached=["n2"]))
    assert finished is not None
    assert "node n2: did not answer; `llmgw ctl weights --collect` removes its copy later" in finished
    assert finished.endswith("purge finished: 1 file(s) removed")
    assert purge_line(M.PurgeFailed(reason="replicas of tiny still run")) == "purge failed: replicas of tiny still run"
    assert purge_line(M.ModelScaled(min=1, max=1)) is None


# -- the service -------------------------------------------------------------------------------


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[FakeHub]:
    h = await FakeHub().start()
    h.add_repo("acme/tiny-GGUF", commit=COMMIT)
    h.add_file("acme/tiny-GGUF", "tiny.gguf", write_tiny_gguf(tmp_path / "a.gguf"))
    h.add_file("acme/tiny-GGUF", "README.md", b"# tiny\n")
    yield h
    await h.stop()


async def purge_events(store: EventStore, model: str = "tiny") -> list[RecordedEvent]:
    return [e for e in await store.read(event_subject(M.AGGREGATE, model)) if e.type.startswith("model.purge_")]


async def purge_end(store: EventStore, model: str = "tiny") -> RecordedEvent:
    async def ended() -> RecordedEvent | None:
        ends = [e for e in await purge_events(store, model) if e.type in ("model.purge_finished", "model.purge_failed")]
        return ends[-1] if ends else None

    return await wait_until(ended, deadline_s=60, what=f"the purge of {model} to end")


async def cli(nats_url: str, token: str, *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        LLMGW,
        "--nats",
        nats_url,
        *args,
        env={**os.environ, "LLMGW_TOKEN": token},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def add_on_demand(fleet: Fleet, name: str, ref: str) -> None:
    await fleet.add_model(name, f"mirror:{ref}", min_=0, max_=1)


async def test_a_purge_removes_each_file_with_one_event_and_the_cli_prints_each_as_it_goes(
    store: EventStore, nats: NatsServer, hub: FakeHub, tmp_path: Path
) -> None:
    fleet = await Fleet(store, nats.url, tmp_path).start(
        services=("catalog", "fleet", "scheduler", "mirror"), hub_endpoint=hub.url, hub_allow_private=True
    )
    try:
        await fleet.command("fetch", E.MirrorFetch(model="tiny", repo="acme/tiny-GGUF"), service=E.SERVICE)
        mirror_root = tmp_path / "mirror"
        await wait_until(
            lambda: (mirror_root / TINY).exists() and (mirror_root / README).exists(),
            deadline_s=30,
            what="the mirror to hold tiny",
        )
        cached = tmp_path / "n1" / "weights" / TINY  # as an agent's fetch leaves it
        cached.parent.mkdir(parents=True)
        cached.write_bytes((mirror_root / TINY).read_bytes())
        fleet.agent("n1", ["--mirror", fleet.mirror_url])

        async def n1_holds_it() -> bool:
            try:
                return TINY in (await _last_heartbeat(store, "n1")).weights
            except Exception:  # no heartbeat yet
                return False

        await wait_until(n1_holds_it, deadline_s=30, what="n1 to report its copy")

        async def n1_registered() -> bool:
            return any(e.type == "node.registered" for e in await store.read(event_subject(N.AGGREGATE, "n1")))

        await wait_until(n1_registered, deadline_s=30, what="n1 to be registered")
        await add_on_demand(fleet, "tiny", TINY)

        proc = await cli(nats.url, await person_on_log(store), "ctl", "model", "remove", "tiny", "--purge")
        out_b, err_b = await asyncio.wait_for(proc.communicate(), 90)
        out, err = out_b.decode(), err_b.decode()
        assert proc.returncode == 0, err
        assert "model tiny removed" in out
        assert f"removed {TINY} from the mirror" in out
        assert f"removed {README} from the mirror" in out
        assert f"removed {TINY} from node n1" in out
        assert "purge finished: 3 file(s) removed" in out

        events = await purge_events(store)
        files = [(e.payload.where, e.payload.file) for e in events if e.type == "model.purge_file_removed"]
        assert sorted(files) == sorted([("mirror", TINY), ("mirror", README), ("n1", TINY)])
        assert events[0].type == "model.purge_started"
        assert events[-1].type == "model.purge_finished"
        assert not (mirror_root / "tiny").exists()
        assert not cached.exists()
        tombstones = [e for e in await store.read(event_subject(E.AGGREGATE, "tiny")) if e.type == "mirror.removed"]
        assert [t.payload.version for t in tombstones] == ["c0ffee00"]  # peers delete their copies from it
    finally:
        await fleet.stop()


@pytest.fixture
async def catalog(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    fleet = await Fleet(store, nats.url, tmp_path).start(services=("catalog",))
    yield fleet
    await fleet.stop()


async def test_a_mirror_stopped_halfway_through_a_purge_finishes_it_when_started_again_without_repeating_a_file(
    store: EventStore, catalog: Fleet, hub: FakeHub, tmp_path: Path
) -> None:
    mirror = await MirrorRig(store, hub, tmp_path).start()
    await mirror.fetch()
    assert (await mirror.outcome()).type == "mirror.fetch_completed"
    await add_on_demand(catalog, "tiny", TINY)
    await mirror.stop()

    # The log and the disk as a mirror stopped after its first deletion leave them.
    await catalog.command("remove", M.RemoveModel(name="tiny", purge=True))
    [removal] = [e for e in await store.read(event_subject(M.AGGREGATE, "tiny")) if e.type == "model.removed"]
    started = M.PurgeStarted(source=f"mirror:{TINY}", mirror=[README, TINY], nodes=[TINY])
    first = M.PurgeFileRemoved(where="mirror", file=README)
    await store.append(
        event_subject(M.AGGREGATE, "tiny"),
        [
            NewEvent(payload=p, actor="svc:mirror", causation=removal.id, correlation=removal.envelope.correlation)
            for p in (started, first)
        ],
    )
    (mirror.root / README).unlink()
    assert (mirror.root / TINY).exists()

    await mirror.start()
    try:
        end = await purge_end(store)
        assert end.type == "model.purge_finished", end.payload
        assert end.payload.removed == 2
        files = [e.payload.file for e in await purge_events(store) if e.type == "model.purge_file_removed"]
        assert sorted(files) == [README, TINY], "each file once"
        assert not (mirror.root / "tiny").exists()
        assert [e.type for e in await purge_events(store)].count("model.purge_started") == 1
    finally:
        await mirror.stop()


async def test_a_purge_finishes_though_the_cli_that_asked_for_it_was_killed(
    store: EventStore, nats: NatsServer, catalog: Fleet, hub: FakeHub, tmp_path: Path
) -> None:
    mirror = await MirrorRig(store, hub, tmp_path).start()
    await mirror.fetch()
    assert (await mirror.outcome()).type == "mirror.fetch_completed"
    await add_on_demand(catalog, "tiny", TINY)
    await mirror.stop()  # the purge cannot finish before the CLI is killed

    proc = await cli(nats.url, await person_on_log(store), "ctl", "model", "remove", "tiny", "--purge")
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), 60)
    assert line.decode().strip() == "model tiny removed"
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    assert await purge_events(store) == []

    await mirror.start()
    try:
        end = await purge_end(store)
        assert end.type == "model.purge_finished", end.payload
        assert end.payload.removed == 2
        assert not (mirror.root / "tiny").exists()
    finally:
        await mirror.stop()
