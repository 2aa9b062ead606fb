"""The jobs service reads a GGUF header from the first mirror that answers (MIR-4 failover)."""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp import web

from llmgw.events.store import EventStore
from llmgw.services.jobs.rules import StepFailed
from llmgw.services.jobs.service import JobsConfig, JobsService
from tests.gguf_tiny import write_tiny_gguf
from tests.support import free_port


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
