"""`usage_mode`: what a full disk does while the bus does not acknowledge usage records.

``strict`` refuses billable requests at once (no answer whose record lives only in memory), keeps
the records of requests in progress in the in-flight log's preallocated reserve, and admits again
by itself when space returns; ``available`` serves on and says how many records live only in
memory. The full disks are small tmpfs mounts (we run as root; skipped where mounting is not
permitted); the bus is a real nats-server, the router a real one, in this process or as `llmgw up`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import pytest
import structlog
import yaml
from prometheus_client import generate_latest

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.usage import UsageRecord
from llmgw.services.router.app import RouterConfig
from llmgw.services.router.inflight import InflightLog
from llmgw.services.router.usage import UsageConfig, UsagePublisher
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, wait_until
from tests.test_accountant import START, make_records
from tests.test_gateway import GATEWAY, make_key, make_tenant
from tests.test_up_crash import _engine
from tests.test_usage_journal import ask, each_recorded_once, fill, health, tmpfs, usage_in_stream
from tests.up import LLMGW, Up, nats_servers, wait_for

pytestmark = [pytest.mark.timeout(300)]

RECORD = b"r" * 450  # about a usage record's size


def router_on(journal: Path, mode: str, **more: object) -> RouterConfig:
    return RouterConfig(
        activation_s=30.0,
        first_token_s=20.0,
        idle_s=20.0,
        total_s=60.0,
        usage_journal=str(journal),
        usage_ack_timeout_s=1.0,
        usage_mode=mode,  # type: ignore[arg-type]
        **more,  # type: ignore[arg-type]
    )


def gauge(fleet: Fleet, name: str) -> float:
    """A series of the router's metrics, as /metrics shows them (read from its registry: the admin
    /metrics also asks NATS for the projections' lag, which takes its timeouts while NATS is away)."""
    text = generate_latest(fleet.handles["router"].metrics.registry).decode()
    return float(next(line for line in text.splitlines() if line.startswith(name + " ")).split()[1])


@pytest.fixture
async def http() -> aiohttp.ClientSession:
    async with aiohttp.ClientSession() as s:
        yield s


# -- the in-flight log's reserve ----------------------------------------------------------------


def test_the_in_flight_log_writes_into_its_reserve_on_a_full_disk_and_makes_it_again_when_space_returns(
    tmp_path: Path,
) -> None:
    with tmpfs(tmp_path / "disk", "1m") as disk:
        file_bytes = 64 << 10
        log = InflightLog(disk / "inflight", file_bytes)
        if not log.ensure_reserve() or log.unsupported:
            pytest.skip(f"no fallocate here: {log.unsupported}")
        written = [f"before-{i}".encode() + RECORD for i in range(80)]  # past half the file: the spare is made
        for r in written:
            log.write(r)
        assert log.reserve_error is None

        filler = fill(disk)
        # The rest of the current file and all of the spare take records; the spare after it cannot be made.
        during = []
        while log.reserve_error is None:
            record = f"during-{len(during)}".encode() + RECORD
            log.write(record)
            during.append(record)
        assert len(during) > file_bytes // (2 * len(RECORD)), "the current file's rest and the spare took records"
        assert log.reserve_error.errno == 28  # ENOSPC
        while True:  # what the spare has left is taken too, then a write fails: never a torn record
            record = f"last-{len(during)}".encode() + RECORD
            try:
                log.write(record)
            except OSError as exc:
                assert exc.errno == 28
                break
            during.append(record)

        # Every record written is read back whole: preallocated room is never taken for records.
        assert InflightLog(disk / "inflight").left_behind() == written + during

        filler.unlink()
        assert log.ensure_reserve() and log.reserve_error is None, "space returned: the reserve is made again"
        log.write(b"after")
        log.close()


@contextlib.contextmanager
def ramfs(where: Path) -> Iterator[Path]:
    """A ramfs (a file system without fallocate) at ``where``; skipped where mounting is not permitted."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a ramfs here ({done.stderr.decode().strip() or done.returncode}): a root-only test")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


async def test_without_fallocate_the_in_flight_log_keeps_no_reserve_says_so_once_at_start_and_still_writes(
    tmp_path: Path, store: EventStore
) -> None:
    with ramfs(tmp_path / "ram") as disk:
        journal = disk / "usage-journal"
        records = make_records(30, START, prefix="ramfs")
        with structlog.testing.capture_logs() as logs:
            publisher = UsagePublisher(store.js, store.nc, UsageConfig(journal_dir=str(journal), reserve_bytes=4096))
            await publisher.start()
            for r in records:
                publisher.put(r)
            await wait_until(lambda: publisher.published == len(records), deadline_s=30, what="every record published")
            await publisher.stop()
        said = [e for e in logs if e["event"].startswith("the in-flight usage log keeps no reserve on this system")]
        assert len(said) == 1 and said[0]["reason"] == (
            "fallocate is not supported on this file system (Operation not supported)"
        )
        assert not [e for e in logs if e["log_level"] == "error"], "no write failed: records went to the log as before"
        assert publisher.backlog().memory_only == 0 and publisher.backlog().reserve is None


# -- strict --------------------------------------------------------------------------------------


async def test_a_strict_publisher_without_a_journal_refuses_as_soon_as_the_bus_does_not_acknowledge(
    nats: NatsServer, store: EventStore
) -> None:
    publisher = UsagePublisher(store.js, store.nc, UsageConfig(ack_timeout_s=0.5, retry_max_s=0.2))
    await publisher.start()
    try:
        nats.stop()
        publisher.put(UsageRecord(request_id="only-one", at=datetime.now(UTC), status=200, project_id="p1"))
        await wait_until(lambda: publisher.refusal() is not None, what="the publisher to find the bus away")
        reason = publisher.refusal()
        assert reason is not None and reason.startswith("usage records cannot be kept: the bus does not acknowledge")
        assert reason.endswith("no usage journal is configured; requests are refused until the bus acknowledges them")
        backlog = publisher.backlog()
        assert (backlog.state, backlog.mode, backlog.memory_only) == ("refusing", "strict", 1)

        nats.start()
        await wait_until(lambda: publisher.refusal() is None, deadline_s=30, what="the bus to acknowledge again")
        assert publisher.backlog().memory_only == 0
    finally:
        if nats.proc is None or nats.proc.poll() is not None:
            nats.start()
        await publisher.stop()


async def test_strict_refuses_at_once_while_the_bus_is_away_and_the_disk_is_full_and_admits_again_by_itself(
    tmp_path: Path, http: aiohttp.ClientSession, nats: NatsServer, store: EventStore
) -> None:
    with tmpfs(tmp_path / "disk", "4m") as disk:
        journal = disk / "usage-journal"
        fleet = await Fleet(store, nats.url, tmp_path).start(services=GATEWAY, router=router_on(journal, "strict"))
        try:
            fleet.agent("n1")
            tenant = await make_tenant(store)
            key, _ = await make_key(store, tenant)
            await fleet.add_model("tiny", write_tiny_gguf(tmp_path / "tiny.gguf"))
            await fleet.wait_ready("tiny", 1)
            await fleet.router_caught_up()
            served = []
            assert (await ask(http, fleet.port, key, "before"))[0] == 200
            served.append("before")

            filler = fill(disk)
            nats.stop()
            refused: list[tuple[int, dict]] = []

            async def refusing() -> bool:
                rid = f"down-{uuid.uuid4().hex[:8]}"
                status, body = await ask(http, fleet.port, key, rid)
                if status == 200:
                    served.append(rid)
                else:
                    refused.append((status, body))
                # Each 200 until then has its record on disk: in the in-flight log's reserve.
                _, h = await health(http, fleet.port)
                assert h["usage"]["memory_only"] == 0, h
                return status != 200

            await wait_until(refusing, deadline_s=30, what="billable requests to be refused")
            status, body = refused[0]
            assert status == 503 and body["error"]["code"] == "usage_unavailable"
            assert body["error"]["message"].startswith("usage records cannot be kept: ")
            assert str(journal) in body["error"]["message"], "the message names the full disk's directory"
            h_status, h = await health(http, fleet.port)
            assert h_status == 503 and h["usage"]["state"] == "refusing" and h["usage"]["mode"] == "strict"
            assert gauge(fleet, "llmgw_usage_refusing") == 1

            # Space returns: admitted again with no request trying, the bus still away (so /healthz stays
            # 503 for NATS; its usage part says it).
            filler.unlink()

            async def admitting() -> bool:
                return (await health(http, fleet.port))[1]["usage"]["refusing"] is None

            await wait_until(admitting, deadline_s=30, what="the router to admit again by itself")
            assert gauge(fleet, "llmgw_usage_refusing") == 0
            rid = f"again-{uuid.uuid4().hex[:8]}"
            assert (await ask(http, fleet.port, key, rid))[0] == 200
            served.append(rid)

            nats.start()

            await each_recorded_once(store.js, served)
        finally:
            if nats.proc is None or nats.proc.poll() is not None:
                nats.start()
            await fleet.stop()


# -- available -----------------------------------------------------------------------------------


async def test_available_serves_on_a_full_disk_saying_how_many_records_live_only_in_memory_and_refuses_at_the_bound(
    tmp_path: Path, http: aiohttp.ClientSession, nats: NatsServer, store: EventStore
) -> None:
    bound = 30
    with tmpfs(tmp_path / "disk", "4m") as disk:
        journal = disk / "usage-journal"
        # The smallest reserve (some dozen records), so that records reach memory only after a few requests.
        config = router_on(journal, "available", usage_memory_records=bound, usage_reserve_bytes=4096)
        fleet = await Fleet(store, nats.url, tmp_path).start(services=GATEWAY, router=config)
        try:
            fleet.agent("n1")
            tenant = await make_tenant(store)
            key, _ = await make_key(store, tenant)
            await fleet.add_model("tiny", write_tiny_gguf(tmp_path / "tiny.gguf"))
            await fleet.wait_ready("tiny", 1)
            await fleet.router_caught_up()

            filler = fill(disk)
            nats.stop()
            served: list[str] = []
            said_memory_only = []
            refused: list[dict] = []
            while len(served) < 10 * bound:
                rid = f"down-{len(served)}"
                status, body = await ask(http, fleet.port, key, rid)
                if status != 200:
                    refused.append(body)
                    break
                served.append(rid)
                _, h = await health(http, fleet.port)  # 503 for NATS away; its usage part says what is held
                if h["usage"]["memory_only"]:
                    # memory_only while serving; refusing once the bound is held (the state says the worse)
                    assert h["usage"]["state"] == ("refusing" if h["usage"]["refusing"] else "memory_only"), h
                    assert h["usage"]["mode"] == "available"
                    metric = gauge(fleet, "llmgw_usage_memory_only_records")
                    said_memory_only.append((h["usage"]["memory_only"], metric))
            assert said_memory_only, "records beyond the reserve were held in memory only, and said so"
            assert all(n > 0 and metric == n for n, metric in said_memory_only), said_memory_only
            assert refused and refused[0]["error"]["code"] == "usage_unavailable", "refused once the bound is held"
            message = refused[0]["error"]["message"]
            assert message.startswith("usage records cannot be kept: ") and " wait in memory for the bus (" in message
            assert str(journal) in message, "the message names the journal that cannot be written"
            assert len(served) >= bound, "served until the bound, not refused at once"

            filler.unlink()
            nats.start()

            await each_recorded_once(store.js, served)
            _, h = await health(http, fleet.port)
            assert h["usage"]["memory_only"] == 0 and gauge(fleet, "llmgw_usage_memory_only_records") == 0
        finally:
            if nats.proc is None or nats.proc.poll() is not None:
                nats.start()
            await fleet.stop()


# -- strict, killed -9 on a full disk: `llmgw up` with its data directory on the full disk -----------


def _up_key(up: Up) -> str:
    for args in (["org", "create", "acme"], ["team", "create", "acme/ml"], ["project", "create", "acme/ml/chat"]):
        done = up.cli("ctl", *args)
        assert done.returncode == 0, done.stderr
    done = up.cli("ctl", "key", "create", "--project", "acme/ml/chat", "--name", "load")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


async def _stored_by(up: Up) -> set[str]:
    store = await EventStore.connect(up.nats_url(), default_registry(), creds=up.nats_creds())
    try:
        return set(await usage_in_stream(store.js))
    finally:
        await store.close()


@pytest.mark.timeout(600)
async def test_strict_up_killed_on_a_full_disk_loses_no_usage_record_of_a_request_it_answered(
    tmp_path: Path, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_ROUTER_USAGE_MODE", "strict")  # `up` defaults to available
    monkeypatch.setenv("LLMGW_ROUTER_USAGE_ACK_TIMEOUT_S", "1")
    with tmpfs(tmp_path / "disk", "96m") as disk:
        data = disk / "data"
        tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
        first = Up(data)
        filler: Path | None = None
        try:
            await asyncio.to_thread(first.start)
            add = ["model", "add", "tiny", "--source", str(tiny), "--cpu-cores", "1", "--memory-gb", "0.1"]
            added = await asyncio.to_thread(first.cli, "ctl", *add)
            assert added.returncode == 0, added.stderr
            await asyncio.to_thread(wait_for, lambda: _engine(data), "the tiny model's engine to be ready", 120.0)
            key = await asyncio.to_thread(_up_key, first)

            async def answered() -> bool:
                return (await ask(http, first.port, key, f"warm-{uuid.uuid4().hex[:6]}"))[0] == 200

            await wait_until(answered, deadline_s=60, what="the gateway to serve the tiny model")

            served: list[str] = []
            refusals: list[dict] = []
            stop = asyncio.Event()

            async def client(n: int) -> None:
                i = 0
                while not stop.is_set():
                    rid = f"load-{n}-{i}"
                    i += 1
                    status, body = await ask(http, first.port, key, rid)
                    if status == 200:
                        served.append(rid)
                    elif body.get("error", {}).get("code") == "usage_unavailable":
                        refusals.append(body)

            clients = [asyncio.create_task(client(n)) for n in range(4)]
            await wait_until(lambda: len(served) >= 20, deadline_s=60, what="requests under load")
            filler = await asyncio.to_thread(fill, disk)  # the router's disk, and its nats-server's, fills
            await wait_until(lambda: refusals, deadline_s=60, what="strict refusals once the bus cannot store")
            await wait_until(lambda: len(refusals) >= 20, deadline_s=30, what="refusals under load")
            # Answered, and not on the bus: the stream could not store them, nor the journal keep them.
            on_bus = await asyncio.wait_for(_stored_by(first), 60)
            assert set(served) - on_bus, "some answered requests' records are not on the bus when up is killed"
            first.kill9()
            stop.set()
            await asyncio.gather(*clients, return_exceptions=True)
            assert any((data / "usage-journal" / "inflight").glob("*.inflight")), (
                "records of answered requests are in the in-flight log"
            )
        finally:
            if first.proc is not None and first.proc.poll() is None:
                first.kill9()
            for pid in nats_servers(data):
                os.kill(pid, 9)
        assert filler is not None
        filler.unlink()  # space returns

        second = Up(data)
        try:
            await asyncio.to_thread(second.start)
            moved = [
                line for line in second.output().splitlines() if "an earlier run had not seen acknowledged" in line
            ]
            assert moved, "the next start moves the in-flight log's records into the journal"
            store = await EventStore.connect(second.nats_url(), default_registry(), creds=second.nats_creds())
            try:
                await each_recorded_once(store.js, served, deadline_s=120)
            finally:
                await store.close()
        finally:
            if second.proc is not None and second.proc.poll() is None:
                second.stop()
            for pid in nats_servers(data):
                os.kill(pid, 9)


# -- the defaults ----------------------------------------------------------------------------------


def _usage_mode_of(up: Up) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{up.admin_port}/healthz", timeout=5) as r:
        return json.load(r)["usage"]["mode"]


@pytest.mark.timeout(240)
def test_llmgw_server_defaults_to_strict_and_llmgw_up_to_available_unless_the_environment_chooses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    shown = subprocess.run(
        [LLMGW, "server", "--print-config"],
        env={**clean, "LLMGW_DATA_DIR": str(tmp_path / "server")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert yaml.safe_load(shown.stdout)["router"]["usage_mode"] == "strict"

    monkeypatch.delenv("LLMGW_ROUTER_USAGE_MODE", raising=False)
    up = Up(tmp_path / "data").start()
    try:
        assert _usage_mode_of(up) == "available"
    finally:
        up.stop()
    monkeypatch.setenv("LLMGW_ROUTER_USAGE_MODE", "strict")
    up = Up(tmp_path / "data").start()
    try:
        assert _usage_mode_of(up) == "strict"
    finally:
        up.stop()
