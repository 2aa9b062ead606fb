"""`ctl model serve` (SPEC MIR-3): a job on the bus from a hub repository to an answering replica."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from asyncio.subprocess import PIPE
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import jobs as J
from llmgw.events.schema.subjects import event_subject
from llmgw.services.jobs.service import JobsConfig, JobsService
from llmgw.services.mirror.service import MirrorConfig, MirrorService
from tests.fakehub import FakeHub
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, wait_until

pytestmark = [pytest.mark.timeout(180)]

LLMGW = str(Path(sys.executable).parent / "llmgw")
REPO = "acme/tiny-GGUF"


@pytest.fixture
async def hub(tmp_path: Path) -> AsyncIterator[FakeHub]:
    h = await FakeHub().start()
    h.add_repo(REPO)
    for i, quant in enumerate(("Q4_K_M", "Q8_0")):
        h.add_file(REPO, f"tiny-{quant}.gguf", write_tiny_gguf(tmp_path / f"tiny-{quant}.gguf", seed=i))
    h.add_file(REPO, "mmproj-tiny-F16.gguf", write_tiny_gguf(tmp_path / "mmproj.gguf", seed=9))
    h.add_file(REPO, "README.md", b"# tiny\n")
    yield h
    await h.stop()


class Rig:
    """A mirror and a jobs service in this process (restartable), against the fake hub."""

    def __init__(self, store: EventStore, hub: FakeHub, base: Path) -> None:
        self.store = store
        self.mirror_dir = str(base / "mirror")
        self.mirror = MirrorService(
            store, MirrorConfig(dir=self.mirror_dir, hub=hub.url, hub_allow_private=True, retry_backoff_s=0.01)
        )
        # No test here waits for the unplaceable limit; a long one keeps a slow machine from failing
        # a job that is only waiting for its agent to start.
        self.config = JobsConfig(
            hub=hub.url, hub_allow_private=True, source="local", mirror_dir=self.mirror_dir, unplaceable_s=600.0
        )
        self.jobs: JobsService | None = None
        self.tasks: list[asyncio.Task] = []
        self.client = CommandClient.for_service(store, "tests")

    async def start(self) -> Rig:
        await self.mirror.start()
        self.tasks.append(asyncio.create_task(self.mirror.run()))
        await self.start_jobs()
        return self

    async def start_jobs(self) -> JobsService:
        self.jobs = JobsService(self.store, self.config)
        await self.jobs.start()
        self.jobs_task = asyncio.create_task(self.jobs.run())
        return self.jobs

    async def stop_jobs(self) -> None:
        assert self.jobs is not None
        await self.jobs.close()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await asyncio.wait_for(self.jobs_task, 10)

    async def stop(self) -> None:
        await self.stop_jobs()
        await self.mirror.close()
        for t in self.tasks:
            t.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t

    async def serve(self, **kw: object) -> str:
        out = await self.client.send(J.SERVICE, "serve", J.ServeModel(**kw), actor="user:test", timeout=20)
        return out.result["job"]

    async def events(self, job_id: str) -> list:
        return [e.payload for e in await self.store.read(event_subject(J.AGGREGATE, job_id))]

    async def finished(self, job_id: str, deadline_s: float = 120.0) -> J.JobFinished:
        async def done() -> J.JobFinished | None:
            return next((p for p in await self.events(job_id) if isinstance(p, J.JobFinished)), None)

        return await wait_until(done, deadline_s=deadline_s, what=f"job {job_id} to finish")


@pytest.fixture
async def rig(store: EventStore, hub: FakeHub, tmp_path: Path) -> AsyncIterator[Rig]:
    r = await Rig(store, hub, tmp_path).start()
    yield r
    await r.stop()


def steps(events: list, status: str) -> list[str]:
    return [p.step for p in events if isinstance(p, J.JobStep) and p.status == status]


async def test_serve_from_repository_to_an_answering_replica(
    rig: Rig, store: EventStore, nats: NatsServer, tmp_path: Path
) -> None:
    fleet = await Fleet(store, nats.url, tmp_path / "fleet").start(services=("catalog", "fleet", "scheduler"))
    try:
        fleet.agent("node-a")
        job_id = await rig.serve(repo=REPO, ctx_pool=1024, cores=1)
        finished = await rig.finished(job_id)
        events = await rig.events(job_id)
        assert finished.ok, [(p.step, p.message) for p in events if isinstance(p, J.JobStep)]
        assert steps(events, J.DONE) == ["validate", "pick", "fetch", "inspect", "size", "add", "wait_ready", "smoke"]
        assert steps(events, J.STARTED) == steps(events, J.DONE)
        done = {p.step: p for p in events if isinstance(p, J.JobStep) and p.status == J.DONE}
        assert "Q4_K_M" in done["pick"].message and "mmproj" not in done["pick"].message
        assert done["inspect"].data["architecture"] == "llama"
        assert done["size"].data["memory_gb"] > 1.0  # weights + KV cache + 1 GiB + 5 %
        assert "tokens/s" in done["smoke"].message and "answer" in done["smoke"].data
        assert "tokens/s" in finished.summary
        assert (Path(rig.mirror_dir) / done["pick"].data["model"]).is_dir()
    finally:
        await fleet.stop()


async def test_a_missing_quant_names_what_the_repository_has(rig: Rig, nats: NatsServer) -> None:
    job_id = await rig.serve(repo=REPO, quant="Q2_K")
    finished = await rig.finished(job_id, deadline_s=30)
    assert not finished.ok
    failed = [p for p in await rig.events(job_id) if isinstance(p, J.JobStep) and p.status == J.FAILED]
    assert [p.step for p in failed] == ["pick"]
    assert "no Q2_K" in failed[0].message and "Q4_K_M" in failed[0].message and "Q8_0" in failed[0].message
    assert "mmproj" not in failed[0].message
    # `ctl job ID` replays it from anywhere: each step, then the failure, exit 1.
    proc = await asyncio.create_subprocess_exec(
        LLMGW, "--nats", nats.url, "ctl", "job", job_id, stdout=PIPE, stderr=PIPE
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1, (out, err)
    assert "✓ validate" in out.decode() and "✗ pick" in err.decode() and "no Q2_K" in err.decode()


@pytest.mark.parametrize("repo", ["../x", "a/b/c", "acme/..", "", "acme"])
async def test_a_bad_repository_name_is_refused_at_once(rig: Rig, store: EventStore, repo: str) -> None:
    with pytest.raises(CommandRejectedError) as info:
        await rig.serve(repo=repo)
    assert info.value.code == "invalid_repo" and "OWNER/NAME" in info.value.reason
    assert not await store.read(f"llmgw.evt.{J.AGGREGATE}.>")  # no job was started


async def test_the_job_survives_its_service_restart(
    rig: Rig, store: EventStore, nats: NatsServer, tmp_path: Path
) -> None:
    # No agent yet: the job reaches "wait_ready" and waits there.
    fleet = await Fleet(store, nats.url, tmp_path / "fleet").start(services=("catalog", "fleet", "scheduler"))
    try:
        job_id = await rig.serve(repo=REPO, quant="Q8_0", name="tiny-eight", ctx_pool=1024, cores=1)

        async def waiting() -> bool:
            return "wait_ready" in steps(await rig.events(job_id), J.STARTED)

        await wait_until(waiting, deadline_s=60, what="the job to wait for a replica")
        await rig.stop_jobs()
        before = await rig.events(job_id)
        assert not any(isinstance(p, J.JobFinished) for p in before), [
            (getattr(p, "step", ""), getattr(p, "message", p)) for p in before
        ]

        fleet.agent("node-a")
        await rig.start_jobs()
        finished = await rig.finished(job_id)
        events = await rig.events(job_id)
        assert finished.ok, [(p.step, p.message) for p in events if isinstance(p, J.JobStep)]
        done = steps(events, J.DONE)
        assert done == ["validate", "pick", "fetch", "inspect", "size", "add", "wait_ready", "smoke"]
        # Nothing done before the interruption ran again: each step started once.
        assert steps(events, J.STARTED) == done
    finally:
        await fleet.stop()
