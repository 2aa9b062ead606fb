"""The jobs service reads a GGUF header from the first mirror that answers (MIR-4 failover)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from aiohttp import web

from llmgw.cli.runtime import serve
from llmgw.cli.server_config import ServerConfig
from llmgw.events.runtime.store import EventStore
from llmgw.services.jobs.rules import StepFailed
from llmgw.services.jobs.service import JobsConfig, JobsService
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, free_port


async def _files(root: Path) -> tuple[web.AppRunner, int]:
    app = web.Application()
    app.router.add_static("/files/tiny/v1", root)  # aiohttp's static files honour Range
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, port


async def test_a_header_is_read_from_the_first_mirror_that_answers(store: EventStore, tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "tiny.gguf")
    runner, port = await _files(tmp_path)
    try:
        down = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        jobs = JobsService(store, JobsConfig(source="mirror", mirror_url=f"{down},http://127.0.0.1:{port}"))
        header = await jobs._header({"first": "tiny.gguf", "model": "tiny", "version": "v1"})
        assert header.architecture == "llama"
        alone = JobsService(store, JobsConfig(source="mirror", mirror_url=down))
        with pytest.raises(StepFailed) as caught:
            await alone._header({"first": "tiny.gguf", "model": "tiny", "version": "v1"})
        assert "no mirror answered" in caught.value.message and down in caught.value.message
    finally:
        await runner.cleanup()


async def test_a_server_running_jobs_without_a_mirror_reads_from_the_mirrors_it_is_given(
    nats: NatsServer, tmp_path: Path
) -> None:
    """`llmgw server --services jobs --mirror-url A --mirror-url B`: the mirror runs elsewhere."""
    write_tiny_gguf(tmp_path / "tiny.gguf")
    runner, port = await _files(tmp_path)
    down = f"http://127.0.0.1:{free_port()}"
    config = ServerConfig(
        nats_url=nats.url,
        db_dsn=f"sqlite:///{tmp_path / 'projections.db'}",
        services=("jobs",),
        port=free_port(),
        admin_port=free_port(),
        mirror_urls=f"{down},http://127.0.0.1:{port}",
    )
    stop, ready, handles = asyncio.Event(), asyncio.Event(), {}
    task = asyncio.create_task(serve(config, stop, on_ready=ready.set, handles=handles))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        header = await handles["jobs"]._header({"first": "tiny.gguf", "model": "tiny", "version": "v1"})
        assert header.architecture == "llama"
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await runner.cleanup()
