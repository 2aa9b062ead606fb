from __future__ import annotations

import logging
import os
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import structlog

from llmgw.cli.logs import SinkHandler
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.catalog import default_registry
from tests.fleet import Fleet
from tests.support import NatsServer, Postgres, nats_server
from tests.up import Up, nats_servers

os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(autouse=True)
def fresh_structlog() -> None:
    """Every test starts from structlog's defaults: a command run in-process (click's CliRunner) configures
    it for the whole process, and a level it set would hide from a later test's capture_logs what it logs.
    The standard library's root logger loses the sink an earlier test's ``logs.configure`` gave it."""
    structlog.reset_defaults()
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, SinkHandler)]:
        root.removeHandler(handler)
        handler.sink.close()


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh JetStream server per test: tests never see each other's events."""
    with nats_server(tmp_path) as server:
        yield server


@pytest.fixture
async def store(nats: NatsServer) -> AsyncIterator[EventStore]:
    es = await EventStore.connect(nats.url, default_registry())
    await es.ensure_streams()
    yield es
    await es.close()


@pytest.fixture
async def fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    """Catalog, fleet, scheduler, projections and the admin API in this process; each test starts
    its agents (``fleet.agent("n1")``), which are stopped with their engines afterwards."""
    f = await Fleet(store, nats.url, tmp_path).start()
    try:
        yield f
    finally:
        await f.stop()


@pytest.fixture(scope="session")
def postgres(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Postgres]:
    pg = Postgres(tmp_path_factory.mktemp("pg")).start()
    yield pg
    pg.stop()


@pytest.fixture(params=["sqlite", "postgres"])
async def db_dsn(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh projection database, once per backend: the same tests run on both."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'projections.db'}"
    pg: Postgres = request.getfixturevalue("postgres")
    return await pg.new_database()


@pytest.fixture
def ups() -> Iterator[list[Up]]:
    """The `llmgw up` processes a test starts; whatever still runs at the end is stopped, with its nats-server."""
    started: list[Up] = []
    yield started
    for u in started:
        if u.proc is not None and u.proc.poll() is None:
            u.stop()
    for u in started:
        for pid in nats_servers(u.data_dir):
            os.kill(pid, signal.SIGKILL)
