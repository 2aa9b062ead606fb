"""No usage record is lost: the router's spill journal, its refusal when even that cannot be written,
its replay after an outage or a restart, and projections that resume once a full disk has room.

The disk-full cases mount a small tmpfs (we run as root); where mounting is not permitted they are
skipped with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats.js.errors
import pytest
import structlog

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.usage import UsageRecord
from llmgw.projections.backends import open_backend
from llmgw.projections.usage import UsageProjection
from llmgw.services.router.app import RouterConfig
from llmgw.services.router.inflight import InflightLog
from llmgw.services.router.journal import Journal, JournalError, frame
from llmgw.services.router.usage import UsageConfig, UsagePublisher
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import NatsServer, wait_until
from tests.test_accountant import START, make_records, publish_all, request_ids, runner_for
from tests.test_gateway import GATEWAY, make_key, make_tenant

pytestmark = [pytest.mark.timeout(300)]

ROOT = Path(__file__).parents[1]


def journaled_router(journal: Path) -> RouterConfig:
    return RouterConfig(
        activation_s=30.0,
        first_token_s=20.0,
        idle_s=20.0,
        total_s=60.0,
        usage_journal=str(journal),
        usage_ack_timeout_s=1.0,
    )


@contextlib.contextmanager
def tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``where`` for the test; skipped where mounting is not permitted."""
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or done.returncode}): a root-only test")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(directory: Path, leave_bytes: int = 0) -> Path:
    """Write a filler file into ``directory`` until its file system has ``leave_bytes`` free."""
    filler = directory / "filler"
    with open(filler, "wb", buffering=0) as f:
        chunk = b"\0" * 65536
        while True:
            st = os.statvfs(directory)
            free = st.f_bavail * st.f_frsize
            if free <= leave_bytes:
                break
            try:
                f.write(chunk[: max(4096, min(len(chunk), free - leave_bytes))])
            except OSError:
                break
    return filler


async def usage_in_stream(js: Any) -> Counter[str]:
    """How many messages the LLMGW_USAGE stream holds for each request id."""
    info = await js.stream_info("LLMGW_USAGE")
    ids: Counter[str] = Counter()
    if not info.state.messages:
        return ids
    for seq in range(max(1, info.state.first_seq), info.state.last_seq + 1):
        try:
            msg = await js.get_msg("LLMGW_USAGE", seq)
        except nats.js.errors.NotFoundError:
            continue
        record = msgspec.json.decode(msg.data)
        # The id a test request was sent with (X-Request-Id), else the record's own (records put directly).
        ids[record.get("client_request_id") or record["request_id"]] += 1
    return ids


async def each_recorded_once(js: Any, served: list[str], deadline_s: float = 60.0) -> Counter[str]:
    """Wait until every request id in ``served`` has its usage record in the stream, and hold that each
    has exactly one (billed once); the stream's counts by request id."""

    async def stored() -> bool:
        return set(served) <= set(await usage_in_stream(js))

    await wait_until(stored, deadline_s=deadline_s, what="every served request's usage record in the stream")
    in_stream = await usage_in_stream(js)
    assert {rid: in_stream[rid] for rid in served} == dict.fromkeys(served, 1), "each served request billed once"
    return in_stream


async def ask(session: aiohttp.ClientSession, port: int, key: str, request_id: str) -> tuple[int, dict]:
    async with session.post(
        f"http://127.0.0.1:{port}/v1/completions",
        json={"model": "tiny", "prompt": "hi", "max_tokens": 1},
        headers={"Authorization": f"Bearer {key}", "x-request-id": request_id},
    ) as resp:
        return resp.status, await resp.json()


async def health(session: aiohttp.ClientSession, port: int) -> tuple[int, dict]:
    async with session.get(f"http://127.0.0.1:{port}/healthz") as resp:
        return resp.status, await resp.json()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


# -- the journal itself ------------------------------------------------------------------------


def test_the_journal_gives_back_its_records_in_order_skips_a_torn_tail_and_deletes_what_is_acknowledged(
    tmp_path: Path,
) -> None:
    d = tmp_path / "journal"
    j = Journal(d, segment_bytes=64)
    written = [f"record-{i:03d}".encode() for i in range(12)]
    for i in range(0, 12, 3):
        j.append(written[i : i + 3])  # one write and one fsync per batch
    segments = j.segments()
    assert len(segments) > 1, "batches beyond the segment size start new segments"
    read = [r for s in segments for r in j.read(s)[0]]
    assert read == written

    # A crash in the middle of a write: the last record is cut short on disk.
    j.close()
    last = j.path(segments[-1])
    with open(last, "ab") as f:
        f.write(frame([b"record-torn"])[:-4])
    with structlog.testing.capture_logs() as logs:
        again = Journal(d, segment_bytes=64)
        read = [r for s in again.segments() for r in again.read(s)[0]]
    assert read == written, "the torn record is skipped, everything before it is kept"
    torn = [e for e in logs if "torn" in e["event"]]
    assert torn and torn[0]["segment"] == str(last) and torn[0]["skipped_bytes"] > 0

    # A reopened journal never appends behind the torn bytes: a new segment takes the next batch.
    again.append([b"after-the-crash"])
    assert again.segments()[-1] > segments[-1]
    assert again.read(again.segments()[-1])[0] == [b"after-the-crash"]

    # Acknowledged segments are deleted, oldest first, until the directory holds none.
    for s in again.segments():
        again.delete(s)
    assert again.segments() == [] and not list(d.glob("*.journal"))


def test_a_failed_journal_write_leaves_no_torn_record_behind(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "small", "64k") as disk:
        j = Journal(disk / "journal")
        j.append([b"kept"])
        fill(disk)
        with pytest.raises(OSError) as failed:
            j.append([b"x" * 200_000])
        assert failed.value.errno == 28  # ENOSPC
        (disk / "filler").unlink()
        j.append([b"after"])
        assert [r for s in j.segments() for r in j.read(s)[0]] == [b"kept", b"after"]
        j.close()


async def test_a_journal_directory_that_cannot_be_used_is_refused_at_start_in_one_sentence(
    tmp_path: Path, store: EventStore
) -> None:
    not_a_dir = tmp_path / "journal"
    not_a_dir.write_text("a file where the journal should be")
    publisher = UsagePublisher(store.js, store.nc, UsageConfig(journal_dir=str(not_a_dir)))
    with pytest.raises(JournalError) as refused:
        await publisher.start()
    assert str(refused.value) == f"the usage journal path {not_a_dir} is not a directory"


async def test_without_a_journal_records_wait_in_memory_up_to_the_bound_and_then_requests_are_refused(
    nats: NatsServer, store: EventStore
) -> None:
    config = UsageConfig(mode="available", memory_records=20, ack_timeout_s=0.5, retry_max_s=0.2)
    publisher = UsagePublisher(store.js, store.nc, config)
    await publisher.start()
    nats.stop()
    now = datetime.now(UTC)
    for i in range(20):
        assert publisher.refusal() is None
        publisher.put(UsageRecord(request_id=f"mem-{i}", at=now, status=200, project_id="p1"))
    await wait_until(lambda: publisher.refusal() is not None, what="the publisher to find the bus away")
    reason = publisher.refusal()
    assert reason is not None and reason.startswith("usage records cannot be kept: 20 wait in memory for the bus (")
    assert reason.endswith("and no usage journal is configured; requests are refused until the bus acknowledges them")
    assert publisher.backlog().state == "refusing" and publisher.backlog().in_memory == 20

    nats.start()
    await wait_until(lambda: publisher.backlog().records == 0, deadline_s=30, what="the records to be published")
    assert publisher.refusal() is None
    assert set(await usage_in_stream(store.js)) == {f"mem-{i}" for i in range(20)}
    report = await publisher.stop()
    assert (report.lost, report.journaled) == (0, 0)


# -- through the gateway -----------------------------------------------------------------------


async def test_a_full_disk_under_the_bus_loses_no_usage_record_and_none_is_counted_twice(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    with tmpfs(tmp_path / "disk", "3m") as disk:
        nats_server = NatsServer(disk / "js", max_file_store="1G").start()
        store = await EventStore.connect(nats_server.url, default_registry())
        fleet: Fleet | None = None
        try:
            await store.ensure_streams()
            fleet = await Fleet(store, nats_server.url, tmp_path).start(
                services=GATEWAY, router=journaled_router(tmp_path / "usage-journal")
            )
            fleet.agent("n1")
            tenant = await make_tenant(store)
            key, _ = await make_key(store, tenant)
            await fleet.add_model("tiny", write_tiny_gguf(tmp_path / "tiny.gguf"))
            await fleet.wait_ready("tiny", 1)
            await fleet.router_caught_up()

            filler = fill(disk, leave_bytes=64 * 1024)
            served: list[str] = []
            sent = 0
            # Requests until the stream cannot store their records and the router journals them.
            while sent < 3000:
                rid = f"full-{sent}"
                sent += 1
                status, _ = await ask(http, fleet.port, key, rid)
                if status == 200:
                    served.append(rid)
                _, h = await health(http, fleet.port)
                if h["usage"]["journaled"] >= 20:
                    break
            status, h = await health(http, fleet.port)
            assert h["usage"]["journaled"] >= 20, f"the stream never stopped storing after {sent} requests: {h}"
            assert status == 200 and h["usage"]["state"] == "journaling", h  # billed still: still admitting
            assert h["usage"]["records"] >= h["usage"]["journaled"] and h["usage"]["oldest_s"] is not None
            status, h = await health(http, fleet.admin_port)
            assert status == 200 and h["usage"]["journaled"] >= 20
            async with http.get(f"http://127.0.0.1:{fleet.admin_port}/metrics") as resp:
                metrics = await resp.text()
            backlog = next(line for line in metrics.splitlines() if line.startswith("llmgw_usage_backlog_records "))
            assert float(backlog.split()[1]) > 0

            # Space returns; nats-server keeps a stream's write error until it restarts.
            filler.unlink()
            nats_server.stop()
            nats_server.start()

            async def drained() -> bool:
                _, h = await health(http, fleet.port)
                return h["usage"]["records"] == 0

            await wait_until(drained, deadline_s=90, what="the router to publish its usage backlog")
            in_stream = await usage_in_stream(store.js)
            assert {rid: in_stream[rid] for rid in served} == dict.fromkeys(served, 1)
            assert not [rid for rid, n in in_stream.items() if n > 1]

            # The usage projection catches up too, once per request.
            runner = fleet.handles["runner"]
            last = (await store.js.stream_info("LLMGW_USAGE")).state.last_seq
            assert await runner.wait_until("usage", last, timeout=60)
            rows = await fleet.handles["backend"].query("usage", "SELECT client_request_id FROM {requests}")
            counted = Counter(r[0] for r in rows)
            assert {rid: counted[rid] for rid in served} == dict.fromkeys(served, 1)
            assert not list((tmp_path / "usage-journal").glob("*.journal")), "acknowledged segments are deleted"
        finally:
            if fleet is not None:
                await fleet.stop()
            await store.close()
            nats_server.stop()


async def test_billable_requests_are_refused_with_the_reason_while_usage_cannot_be_kept_and_admitted_again_after(
    tmp_path: Path, http: aiohttp.ClientSession, nats: NatsServer, store: EventStore
) -> None:
    with tmpfs(tmp_path / "journal-disk", "256k") as disk:
        journal = disk / "usage-journal"
        # A reserve that fits this small disk once it has room again (the default, 1 MiB, never would).
        router = msgspec.structs.replace(journaled_router(journal), usage_reserve_bytes=16 << 10)
        fleet = await Fleet(store, nats.url, tmp_path).start(services=GATEWAY, router=router)
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

            filler = fill(disk)  # the journal's disk is full ...
            nats.stop()  # ... and the bus is away
            refused: list[tuple[int, dict]] = []

            async def refusing() -> bool:
                # Admitted until the publisher has found the bus silent and the journal full.
                rid = f"down-{uuid.uuid4().hex[:8]}"
                status, body = await ask(http, fleet.port, key, rid)
                if status == 200:
                    served.append(rid)
                else:
                    refused.append((status, body))
                return status != 200

            await wait_until(refusing, deadline_s=30, what="billable requests to be refused")
            status, body = refused[0]
            assert status == 503
            assert body["error"]["code"] == "usage_unavailable" and body["error"]["type"] == "api_error"
            # Strict (the default): whichever the router found first, the journal or the in-flight log's reserve.
            assert body["error"]["message"] in (
                f"usage records cannot be kept: the usage journal at {journal} is full (No space left on device); "
                "requests are refused until it can be written",
                "usage records cannot be kept: the bus does not acknowledge them (NATS is not connected) and the "
                f"in-flight usage log at {journal / 'inflight'} is full (No space left on device): no room for the "
                "records of more requests; requests are refused until the disk has room again or the bus "
                "acknowledges them",
            )
            h_status, h = await health(http, fleet.port)
            assert h_status == 503 and h["usage"]["state"] == "refusing" and h["usage"]["refusing"]
            h_status, h = await health(http, fleet.admin_port)  # the process's health says it too
            assert h_status == 503 and h["status"] == "degraded" and h["usage"]["state"] == "refusing"

            filler.unlink()  # room in the journal again: admitted again, by itself

            async def admitted() -> bool:
                rid = f"again-{uuid.uuid4().hex[:8]}"
                status, _ = await ask(http, fleet.port, key, rid)
                if status == 200:
                    served.append(rid)
                return status == 200

            await wait_until(admitted, deadline_s=30, what="billable requests to be admitted again")
            assert list(journal.glob("*.journal")), "records kept while the bus is away are in the journal"

            nats.start()

            in_stream = await each_recorded_once(store.js, served)
            assert not [rid for rid in in_stream if rid.startswith("down-") and rid not in served], (
                "a refused request has no usage record"
            )
        finally:
            if nats.proc is None or nats.proc.poll() is not None:
                nats.start()
            await fleet.stop()


async def test_records_a_stopping_router_could_not_publish_are_journaled_and_published_by_the_next_router(
    tmp_path: Path, http: aiohttp.ClientSession, nats: NatsServer, store: EventStore
) -> None:
    journal = tmp_path / "usage-journal"
    (tmp_path / "first").mkdir()
    (tmp_path / "second").mkdir()
    fleet = await Fleet(store, nats.url, tmp_path / "first").start(services=GATEWAY, router=journaled_router(journal))
    try:
        fleet.agent("n1")
        tenant = await make_tenant(store)
        key, _ = await make_key(store, tenant)
        await fleet.add_model("tiny", write_tiny_gguf(tmp_path / "tiny.gguf"))
        await fleet.wait_ready("tiny", 1)
        await fleet.router_caught_up()
        with structlog.testing.capture_logs() as logs:
            nats.stop()
            served = []
            for i in range(5):
                status, _ = await ask(http, fleet.port, key, f"unacked-{i}")
                assert status == 200
                served.append(f"unacked-{i}")
            await fleet.stop()
    finally:
        await fleet.stop()

    # Said in the log, with counts and the error: while it happened, and what the stop left behind.
    retrying = [e for e in logs if e["event"] == "usage records not acknowledged by the bus; kept and retried"]
    assert retrying and retrying[0]["records"] >= 1 and retrying[0]["errors"], logs
    left = [e for e in logs if e["event"].startswith("usage records left in the journal at stop")]
    assert left and left[0]["records"] == 5 and left[0]["log_level"] == "warning"

    kept = Journal(journal)
    in_journal = [msgspec.json.decode(r)["client_request_id"] for s in kept.segments() for r in kept.read(s)[0]]
    assert sorted(in_journal) == sorted(served), "the stopped router left its unacknowledged records in the journal"

    nats.start()
    second = await Fleet(store, nats.url, tmp_path / "second").start(
        services=("router",), router=journaled_router(journal)
    )
    try:
        await each_recorded_once(store.js, served)
        await wait_until(lambda: not list(journal.glob("*.journal")), what="the replayed segments to be deleted")
    finally:
        await second.stop()
    shutil.rmtree(journal, ignore_errors=True)


async def test_records_journaled_into_a_segment_being_replayed_are_published_after_the_journal_moves_on(
    tmp_path: Path, store: EventStore
) -> None:
    # Found by the fault suite (a NATS node paused 30 s under load lost 1,745 records): records appended
    # to the segment being replayed, before a later append moved on to the next segment, were deleted
    # with it unread. Driven step by step: one record published per step, one record arriving per step.
    first, later = make_records(4, START, prefix="first"), make_records(2, START, seed=8, prefix="later")
    config = UsageConfig(journal_dir=str(tmp_path / "journal"), batch=1)
    publisher = UsagePublisher(store.js, store.nc, config)
    # Room for the first four and one more: the sixth record starts the next segment.
    publisher._journal = Journal(tmp_path / "journal", len(frame([msgspec.json.encode(r) for r in first])) + 1)
    publisher._bus_ok = False  # the bus has just refused: what waits goes to the journal first
    for r in first:
        publisher.put(r)
    assert await publisher._step(5.0)  # journals the four, reads them back, publishes one
    for r in later:  # each step journals what arrived, then publishes one more of the four read
        publisher.put(r)
        assert await publisher._step(5.0)
    assert len(publisher._journal.segments()) == 2, "the sixth record started a second segment"
    for _ in range(20):
        if not publisher._has_work():
            break
        assert await publisher._step(5.0)
    in_stream = await usage_in_stream(store.js)
    assert {r.request_id: in_stream[r.request_id] for r in first + later} == {r.request_id: 1 for r in first + later}


# -- the in-flight log -------------------------------------------------------------------------

KILLED_AFTER_PUT = """
import asyncio, os, signal, sys
from llmgw.services.router.usage import UsageConfig, UsagePublisher
from tests.test_accountant import START, make_records

async def main():
    publisher = UsagePublisher(None, None, UsageConfig(journal_dir=sys.argv[1]))
    await publisher.start()
    for record in make_records(int(sys.argv[2]), START, prefix="killed"):
        publisher.put(record)  # the client was answered; the publisher has not run yet
    os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


async def test_a_router_killed_right_after_answering_loses_no_usage_record(tmp_path: Path, store: EventStore) -> None:
    journal = tmp_path / "journal"
    argv = [sys.executable, "-c", KILLED_AFTER_PUT, str(journal), "40"]
    done = await asyncio.to_thread(subprocess.run, argv, cwd=ROOT, capture_output=True, timeout=60)
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()
    assert not list(journal.glob("*.journal")), "nothing had been spilled: the records were only in flight"

    with structlog.testing.capture_logs() as logs:
        publisher = UsagePublisher(store.js, store.nc, UsageConfig(journal_dir=str(journal)))
        await publisher.start()
    try:
        moved = [e for e in logs if e["event"].startswith("usage records an earlier run had not seen acknowledged")]
        assert moved and moved[0]["records"] == 40
        expected = {r.request_id for r in make_records(40, START, prefix="killed")}

        async def published() -> bool:
            return expected <= set(await usage_in_stream(store.js))

        await wait_until(published, deadline_s=30, what="the killed router's records to be published")
        in_stream = await usage_in_stream(store.js)
        assert {rid: in_stream[rid] for rid in expected} == dict.fromkeys(expected, 1)
    finally:
        await publisher.stop()
    assert not list((journal / "inflight").iterdir()), "published: nothing left in flight"
    assert not list(journal.glob("*.journal")), "published: the journal is empty"


async def test_acknowledged_records_leave_the_in_flight_log_and_a_clean_stop_leaves_it_empty(
    tmp_path: Path, store: EventStore
) -> None:
    journal = tmp_path / "journal"
    records = make_records(300, START, prefix="steady")
    # A new file every dozen records or so.
    publisher = UsagePublisher(store.js, store.nc, UsageConfig(journal_dir=str(journal), reserve_bytes=4096))
    await publisher.start()
    try:
        for r in records:
            publisher.put(r)
        await wait_until(lambda: publisher.published == len(records), deadline_s=30, what="every record acknowledged")
        # Every file but the one being written (and the empty spare after it) is deleted once its records are
        # acknowledged.
        assert len(list((journal / "inflight").glob("*.inflight"))) <= 2
    finally:
        report = await publisher.stop()
    assert report.lost == 0 and report.journaled == 0
    assert not list((journal / "inflight").iterdir())


def test_the_in_flight_log_gives_back_what_a_dead_run_left_up_to_a_torn_record(tmp_path: Path) -> None:
    first = InflightLog(tmp_path, file_bytes=64)
    files = [first.write(f"record-{i}".encode()) for i in range(10)]
    assert len(set(files)) > 1, "small files: the records span several"
    first.done(files[0])  # one acknowledged; the process then dies without closing anything
    with open(tmp_path / f"{files[-1]:012d}.inflight", "ab") as f:
        f.write(b"\x20\x00\x00\x00torn")  # a write cut short by the kill

    again = InflightLog(tmp_path)
    left = again.left_behind()
    # The acknowledged record's file may still hold it (its file was current): sent again, kept once by id.
    assert [p.decode() for p in left][-9:] == [f"record-{i}" for i in range(1, 10)]
    again.forget_left()
    assert not list(tmp_path.glob("*.inflight"))
    assert again.write(b"next") > max(files), "a new run never appends to an old file"


# -- projections -------------------------------------------------------------------------------


async def test_a_usage_projection_stopped_by_a_full_disk_catches_up_by_itself_when_space_returns(
    tmp_path: Path, store: EventStore
) -> None:
    with tmpfs(tmp_path / "db-disk", "8m") as disk:
        backend = await open_backend(f"sqlite:///{disk / 'projections.db'}")
        try:
            async with runner_for(store, backend, UsageProjection(), batch_size=50) as runner:
                first = make_records(20, START, seed=5, prefix="before")
                assert await runner.wait_until("usage", await publish_all(store, first), timeout=20)

                filler = fill(disk)
                records = make_records(1000, START, seed=6, prefix="during")
                last = await publish_all(store, records)

                def retrying() -> bool:
                    state = runner.state("usage")
                    assert state.status != "failed", state.error
                    return state.status == "retrying"

                await wait_until(retrying, deadline_s=30, what="the projection to notice the full disk")

                filler.unlink()
                assert await runner.wait_until("usage", last, timeout=60)
                assert runner.state("usage").status == "running"
            assert await request_ids(backend) == sorted(r.request_id for r in [*first, *records])
        finally:
            await backend.close()
