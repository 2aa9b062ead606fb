"""`llmgw bench backbone`: figures for the backbone (the log and the projections), as ratios within one run.

The machine a benchmark runs on may be shared and noisy, so an absolute figure moves from run to
run. What is meant to be read is each llmgw figure next to the raw nats-py figure measured in the
same run, on the same servers: the ratio is llmgw's overhead (or its gain, where batching beats
what a naive client does). Nothing here asserts; it prints.

`llmgw bench backbone` starts its own nats-server processes from the wheel, in a temporary
directory: one with the durable flush (``sync_interval: always``, how llmgw runs) and one without
(NATS's default, for comparison). It never touches a running `llmgw up`.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import subprocess
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy, StorageType, StreamConfig
from prometheus_client import CollectorRegistry

from llmgw.bench import BenchError
from llmgw.events.runtime.store import MAX_ATOMIC_BATCH, STREAMS, EventStore, NewEvent
from llmgw.events.schema import subjects as S
from llmgw.events.schema.catalog import all_event_types
from llmgw.events.schema.codec import encode_envelope
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.registry import EventRegistry, EventType
from llmgw.infra.natsd import NatsConfig, NatsProcess, NatsStartError, free_port, nats_server_binary
from llmgw.projections.backends import Backend, open_backend
from llmgw.projections.base import Projection, Tx
from llmgw.projections.reader import read_log
from llmgw.projections.rebuild import RebuildResult, rebuild
from llmgw.projections.runner import ProjectionRunner

log = structlog.get_logger("llmgw.bench.backbone")

ACTOR = "system:bench"
KEYS = 1000  # distinct subjects (aggregates) the events are spread over
RAW_STREAM = "BENCH_RAW"
RAW_ROOT = "bench.raw"
APPLY_TARGET = 20_000.0  # events/s
APPEND_TARGET = 20_000.0  # events/s
REBUILD_TARGET_S = 60.0
PHASE_TIMEOUT_S = 1800.0
PREPARE_CHUNK = 20_000  # events built and appended at a time while preparing the rebuild's log

Echo = Callable[[str], None]


# -- the bench's own event type and projection ----------------------------------------------------


class BenchCounted(msgspec.Struct, frozen=True, kw_only=True):
    """One count for ``key``: what the projection benchmarks fold."""

    key: str
    amount: int = 1


BENCH_TYPE = EventType("bench.counted", 1, BenchCounted, "a benchmark's counter event (llmgw bench only)")
BENCH_AGGREGATE = "bench"

_UPSERT = (
    "INSERT INTO {counts} (key, n, total, last_seq) VALUES (?, 1, ?, ?) ON CONFLICT (key) DO UPDATE"
    " SET n = {counts}.n + 1, total = {counts}.total + excluded.total, last_seq = excluded.last_seq"
)


class BenchCounters(Projection):
    """A simple upsert projection: one row per key, counting its events."""

    name = "bench_counters"
    subject = f"{S.EVENTS_ROOT}.{BENCH_AGGREGATE}.>"
    tables = {"counts": "key TEXT NOT NULL, n BIGINT NOT NULL, total BIGINT NOT NULL, last_seq BIGINT NOT NULL"}
    primary_keys = {"counts": ["key"]}
    handlers = {"bench.counted": "counted"}

    async def counted(self, tx: Tx, event: RecordedEvent) -> None:
        p = event.payload
        await tx.execute(_UPSERT, p.key, p.amount, event.seq)


def bench_registry() -> EventRegistry:
    """Every event type the system knows, plus the bench's own."""
    return EventRegistry([*all_event_types(), BENCH_TYPE])


def bench_subject(i: int) -> str:
    return S.event_subject(BENCH_AGGREGATE, f"k{i % KEYS:05d}")


def bench_events(start: int, count: int) -> list[tuple[str, NewEvent]]:
    """``count`` events spread over :data:`KEYS` aggregates (built outside the timed sections)."""
    return [
        (bench_subject(i), NewEvent(payload=BenchCounted(key=f"k{i % KEYS:05d}"), actor=ACTOR))
        for i in range(start, start + count)
    ]


# -- a nats-server of our own --------------------------------------------------------------------


def bench_nats(base: Path, *, durable: bool) -> NatsProcess:
    """A JetStream nats-server on a free port, with its own store directory (not yet started)."""
    where = base / ("nats-durable" if durable else "nats-nosync")
    config = NatsConfig(port=free_port(), store_dir=str(where / "jetstream"), durable=durable, max_payload="8MB")
    return NatsProcess(config, where / "nats.conf", where / "nats-server.log")


@contextlib.contextmanager
def nats_server(base: Path, *, durable: bool) -> Iterator[NatsProcess]:
    server = bench_nats(base, durable=durable)
    try:
        server.start()
    except NatsStartError as exc:
        raise BenchError(str(exc)) from exc
    try:
        yield server
    finally:
        server.stop()


# -- results -------------------------------------------------------------------------------------


class Figure(msgspec.Struct, kw_only=True):
    """One measured figure. ``baseline`` is the key of the raw figure its ratio is taken against."""

    key: str
    label: str
    events: int
    seconds: float
    baseline: str | None = None
    min_rate: float | None = None  # target: at least this many events/s
    max_seconds: float | None = None  # target: at most this many seconds
    lost: int = 0  # events the reader never delivered: the figure is then not valid
    note: str = ""

    @property
    def rate(self) -> float:
        return self.events / self.seconds if self.seconds > 0 else float("inf")

    @property
    def met(self) -> bool | None:
        if self.lost:
            return False
        if self.min_rate is not None:
            return self.rate >= self.min_rate
        if self.max_seconds is not None:
            return self.seconds <= self.max_seconds
        return None

    def target(self) -> str:
        if self.lost:
            return f"INVALID: {self.lost:,} events lost"
        if self.min_rate is not None:
            return f"≥ {self.min_rate:,.0f}/s " + ("met" if self.met else "MISSED")
        if self.max_seconds is not None:
            return f"≤ {self.max_seconds:.0f} s " + ("met" if self.met else "MISSED")
        return ""


class Report:
    """The figures of one run, in the order they were measured, and notes for the reader."""

    def __init__(self, machine: dict[str, Any], options: dict[str, Any]) -> None:
        self.machine = machine
        self.options = options
        self.figures: dict[str, Figure] = {}
        self.notes: list[str] = []

    def add(self, key: str, label: str, events: int, seconds: float, **more: Any) -> Figure:
        figure = Figure(key=key, label=label, events=events, seconds=seconds, **more)
        self.figures[key] = figure
        return figure

    def ratio(self, figure: Figure) -> float | None:
        base = self.figures.get(figure.baseline) if figure.baseline else None
        if base is None or base.rate <= 0:
            return None
        return figure.rate / base.rate

    def as_dict(self) -> dict[str, Any]:
        figures = []
        for f in self.figures.values():
            ratio = self.ratio(f)
            figures.append(
                {
                    **msgspec.to_builtins(f),
                    "events_per_s": round(f.rate, 1),
                    "seconds": round(f.seconds, 4),
                    "ratio": None if ratio is None else round(ratio, 3),
                    "target_met": f.met,
                }
            )
        return {"machine": self.machine, "options": self.options, "figures": figures, "notes": self.notes}

    def table(self) -> str:
        """A Markdown table: figure, events, seconds, events/s, ratio to its raw figure, which one, target."""
        rows = [("figure", "events", "seconds", "events/s", "ratio", "vs raw", "target")]
        for f in self.figures.values():
            ratio = self.ratio(f)
            rows.append(
                (
                    f.label,
                    f"{f.events:,}",
                    f"{f.seconds:.2f}",
                    f"{f.rate:,.0f}",
                    "" if ratio is None else f"{ratio:.2f}",
                    f.baseline if f.baseline in self.figures else "",
                    f.target(),
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        right = {1, 2, 3, 4}
        lines = []
        for r in rows:
            cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))]
            lines.append(f"| {' | '.join(cells)} |")
        rule = [("-" * (w + 1) + ":") if i in right else "-" * (w + 2) for i, w in enumerate(widths)]
        lines.insert(1, "|" + "|".join(rule) + "|")
        return "\n".join(lines)


def machine_info() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    try:
        out = subprocess.run([nats_server_binary(), "--version"], capture_output=True, text=True, timeout=10)
        server = out.stdout.strip() or out.stderr.strip()
    except (OSError, subprocess.SubprocessError, NatsStartError) as exc:
        server = f"unknown ({exc})"
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "nats_server": server,
        "nats_py": importlib.metadata.version("nats-py"),
    }


# -- raw nats-py: no llmgw code ------------------------------------------------------------------


def raw_stream_config() -> StreamConfig:
    """A file stream like LLMGW_EVENTS (atomic batches allowed), for the raw figures."""
    return StreamConfig(
        name=RAW_STREAM,
        subjects=[f"{RAW_ROOT}.>"],
        storage=StorageType.FILE,
        num_replicas=1,
        duplicate_window=120.0,
        allow_direct=True,
        allow_atomic=True,
    )


async def reset_stream(js: JetStreamContext, config: StreamConfig) -> None:
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await js.delete_stream(config.name)
    await js.add_stream(config)


def raw_subjects(n: int) -> list[str]:
    return [f"{RAW_ROOT}.k{i % KEYS:05d}" for i in range(n)]


async def raw_pipelined(js: JetStreamContext, payload: bytes, n: int) -> float:
    """``js.publish_async`` with many in flight, then wait for every ack. Seconds."""
    subjects = raw_subjects(n)
    started = time.perf_counter()
    futures = [await js.publish_async(subject, payload) for subject in subjects]
    await js.publish_async_completed()
    seconds = time.perf_counter() - started
    failed = [f.exception() for f in futures if f.exception() is not None]
    if failed:
        raise BenchError(f"{len(failed)} raw async publishes failed, e.g. {failed[0]}")
    return seconds


async def raw_awaited(js: JetStreamContext, payload: bytes, n: int) -> float:
    """``js.publish`` one by one, awaiting each ack. Seconds."""
    subjects = raw_subjects(n)
    started = time.perf_counter()
    for subject in subjects:
        await js.publish(subject, payload)
    return time.perf_counter() - started


async def raw_atomic(nc: NATS, payload: bytes, n: int, size: int) -> float:
    """Atomic batches of ``size``: ``nc.publish`` with the batch headers, the commit with ``nc.request``."""
    subjects = raw_subjects(n)
    started = time.perf_counter()
    for start in range(0, n, size):
        chunk = subjects[start : start + size]
        batch_id = uuid.uuid4().hex
        last = len(chunk)
        for i, subject in enumerate(chunk, start=1):
            headers = {"Nats-Batch-Id": batch_id, "Nats-Batch-Sequence": str(i)}
            if i < last:
                await nc.publish(subject, payload, headers=headers)
                continue
            headers["Nats-Batch-Commit"] = "1"
            reply = await nc.request(subject, payload, headers=headers, timeout=10.0)
            ack = json.loads(reply.data)
            if "error" in ack:
                raise BenchError(f"raw atomic batch refused: {ack['error']}")
    return time.perf_counter() - started


async def raw_read(js: JetStreamContext, n: int) -> float:
    """An ordered consumer from the stream's start until ``n`` messages have arrived. Seconds."""
    done = asyncio.Event()
    count = 0

    async def on_msg(msg: Any) -> None:
        nonlocal count
        count += 1
        if count >= n:
            done.set()

    started = time.perf_counter()
    sub = await js.subscribe(
        f"{RAW_ROOT}.>",
        stream=RAW_STREAM,
        cb=on_msg,
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.ALL),
    )
    try:
        await done.wait()
        return time.perf_counter() - started
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


# -- llmgw -------------------------------------------------------------------------------------


class Drops:
    """Counts what the nats-py client dropped (slow consumer): a reader that lost events is no figure."""

    def __init__(self) -> None:
        self.count = 0
        self.seen = asyncio.Event()

    async def on_error(self, exc: Exception) -> None:
        if isinstance(exc, nats.errors.SlowConsumerError):
            self.count += 1  # one call per dropped message
            self.seen.set()
            return
        log.warning("nats client error", error=f"{type(exc).__name__}: {exc}")

    def reset(self) -> None:
        self.count = 0
        self.seen.clear()


async def connect_store(url: str, drops: Drops) -> EventStore:
    """An EventStore on a connection of our own, whose error callback counts dropped messages."""
    nc = await nats.connect(url, name="llmgw-bench", connect_timeout=5, error_cb=drops.on_error)
    return EventStore(nc, bench_registry())


def events_spec() -> list[Any]:
    return [s for s in STREAMS if s.name == S.STREAM_EVENTS]


async def reset_events(store: EventStore) -> None:
    """An empty ``LLMGW_EVENTS``: every write figure starts from the same place."""
    with contextlib.suppress(nats.js.errors.NotFoundError):
        await store.js.delete_stream(S.STREAM_EVENTS)
    await store.ensure_streams(events_spec())


async def store_append_many(store: EventStore, items: list[tuple[str, NewEvent]]) -> tuple[float, int]:
    """``append_many`` of ``items``: (seconds, last sequence)."""
    started = time.perf_counter()
    last = await store.append_many(items)
    return time.perf_counter() - started, last


async def store_append_each(store: EventStore, items: list[tuple[str, NewEvent]]) -> float:
    """``append`` one event at a time, awaiting each. Seconds."""
    started = time.perf_counter()
    for subject, event in items:
        await store.append(subject, [event])
    return time.perf_counter() - started


async def store_read(store: EventStore) -> tuple[float, int]:
    """Everything on the stream through ``subscribe(follow=False)``, decoded: (seconds, events)."""
    count = 0
    started = time.perf_counter()
    async for batch in store.subscribe(follow=False):
        count += len(batch)
    return time.perf_counter() - started, count


async def projections_read(store: EventStore) -> tuple[float, int]:
    """Everything on the stream through the projections' reader (``read_log``, a pull consumer): (seconds, events)."""
    count = 0
    started = time.perf_counter()
    async for batch in read_log(store, f"{S.EVENTS_ROOT}.>", follow=False):
        count += len(batch)
    return time.perf_counter() - started, count


async def projection_count(backend: Backend, projection: Projection) -> int:
    """How many events the bench projection has counted (its rows' sum)."""
    row = await backend.fetchone("SELECT COALESCE(SUM(n), 0) FROM {counts}", projection=projection)
    return int(row[0]) if row else 0


async def _wait_for(runner: ProjectionRunner, name: str, goal: int, drops: Drops) -> bool:
    """``runner.wait_until``, given up early once events were dropped and the position stops moving."""
    waiting = asyncio.create_task(runner.wait_until(name, goal, timeout=PHASE_TIMEOUT_S))
    last = -1
    while True:
        done, _ = await asyncio.wait({waiting}, timeout=2.0)
        if done:
            return waiting.result()
        if drops.seen.is_set():
            position = runner.position(name)
            if position == last:  # the last events were dropped: it would wait forever
                waiting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiting
                return False
            last = position


async def apply_from_zero(store: EventStore, dsn: str, last_seq: int, drops: Drops) -> tuple[float, int]:
    """A ProjectionRunner from an empty database until its checkpoint reaches ``last_seq``: (seconds, counted)."""
    backend = await open_backend(dsn)
    projection = BenchCounters()
    try:
        runner = ProjectionRunner(store, backend, [projection], registry=CollectorRegistry(), lag_interval_s=None)
        started = time.perf_counter()
        await runner.start()
        try:
            reached = await _wait_for(runner, projection.name, last_seq, drops)
            seconds = time.perf_counter() - started
        finally:
            await runner.stop()
        if not reached and not drops.count:
            raise BenchError(f"the projection did not reach {last_seq} within {PHASE_TIMEOUT_S:.0f}s")
        return seconds, await projection_count(backend, projection)
    finally:
        await backend.close()


async def rebuild_sqlite(store: EventStore, path: Path) -> tuple[RebuildResult, int]:
    """``rebuild`` (its default batch size) of the bench projection into a new SQLite file: (result, counted)."""
    backend = await open_backend(f"sqlite:///{path}")
    projection = BenchCounters()
    try:
        result = await rebuild(store, backend, projection)
        return result, await projection_count(backend, projection)
    finally:
        await backend.close()


@contextlib.asynccontextmanager
async def fresh_pg_database(admin_dsn: str) -> AsyncIterator[str]:
    """A new PostgreSQL database for this run (its DSN), dropped afterwards."""
    from urllib.parse import urlsplit, urlunsplit

    import asyncpg

    name = f"llmgw_bench_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(admin_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    parts = urlsplit(admin_dsn)
    try:
        yield urlunsplit((parts.scheme, parts.netloc, f"/{name}", parts.query, parts.fragment))
    finally:
        conn = await asyncpg.connect(admin_dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


# -- the backbone benchmark ----------------------------------------------------------------------


class BackboneOptions(msgspec.Struct, frozen=True, kw_only=True):
    events: int = 20_000
    repeat: int = 3  # each throughput figure is the best of this many runs
    rebuild_events: int = 1_000_000
    pg_dsn: str | None = None
    skip_rebuild: bool = False
    base_dir: str | None = None


def raw_payload(store: EventStore) -> bytes:
    """Raw bytes as long as one encoded llmgw envelope of the bench event."""
    return b"x" * len(encode_envelope(store.envelope(bench_events(0, 1)[0][1])))


Once = Callable[[], Awaitable[tuple[float, int]]]  # one measurement: (seconds, events lost)


class Rounds:
    """Interleaved measurements: every figure once per round, for ``repeat`` rounds, keeping the fastest.

    The machine is shared: a burst of someone else's load hits whatever runs at that moment. Taking
    each figure once per round, next to its raw counterpart, and keeping each one's best run, compares
    llmgw and raw under the same conditions rather than minutes apart.
    """

    def __init__(self, repeat: int, echo: Echo) -> None:
        self.repeat = repeat
        self.echo = echo
        self.steps: list[tuple[str, str, Once]] = []  # key, progress text, measurement
        self.best: dict[str, tuple[float, int]] = {}

    def step(self, key: str, what: str, once: Once) -> None:
        self.steps.append((key, what, once))

    async def run(self, where: str) -> None:
        for r in range(1, self.repeat + 1):
            for key, what, once in self.steps:
                self.echo(f"{where} (round {r}/{self.repeat}): {what}")
                seconds, lost = await once()
                best_s, worst_lost = self.best.get(key, (float("inf"), 0))
                self.best[key] = (min(best_s, seconds), max(worst_lost, lost))

    def add(self, report: Report, key: str, label: str, events: int, **more: Any) -> None:
        if key in self.best:
            seconds, lost = self.best[key]
            report.add(key, label, events, seconds, lost=lost, **more)


def _raw_publish_steps(rounds: Rounds, nc: NATS, payload: bytes, n: int, tag: str) -> None:
    js = nc.jetstream(timeout=10.0)

    async def pipelined() -> tuple[float, int]:
        await reset_stream(js, raw_stream_config())
        return await raw_pipelined(js, payload, n), 0

    async def awaited() -> tuple[float, int]:
        await reset_stream(js, raw_stream_config())
        return await raw_awaited(js, payload, n), 0

    rounds.step(f"raw.pipelined.{tag}", "raw pipelined publishes", pipelined)
    rounds.step(f"raw.awaited.{tag}", "raw publishes awaited one by one", awaited)


def _raw_batch_step(rounds: Rounds, nc: NATS, payload: bytes, n: int, tag: str, size: int) -> None:
    js = nc.jetstream(timeout=10.0)

    async def atomic() -> tuple[float, int]:
        await reset_stream(js, raw_stream_config())
        return await raw_atomic(nc, payload, n, size), 0

    rounds.step(f"raw.batch{size}.{tag}", f"raw atomic batches of {size}", atomic)


def _append_many_step(rounds: Rounds, store: EventStore, n: int, tag: str) -> None:
    async def append_many() -> tuple[float, int]:
        await reset_events(store)
        seconds, _ = await store_append_many(store, bench_events(0, n))
        return seconds, 0

    rounds.step(f"llmgw.append_many.{tag}", "llmgw append_many", append_many)


async def _durable_phase(server: NatsProcess, opts: BackboneOptions, report: Report, base: Path, echo: Echo) -> None:
    n = opts.events
    drops = Drops()
    nc = await nats.connect(server.url, name="llmgw-bench-raw")
    store = await connect_store(server.url, drops)
    databases = iter(range(1_000_000))  # each apply folds into a database of its own
    try:
        payload = raw_payload(store)
        report.notes.append(
            f"raw payloads are {len(payload)} bytes, the size of one encoded llmgw envelope; raw messages carry no "
            "Nats-Msg-Id (llmgw's carry the event id, which the server also de-duplicates on)"
        )
        js = nc.jetstream(timeout=10.0)
        rounds = Rounds(opts.repeat, echo)

        async def append_each() -> tuple[float, int]:
            await reset_events(store)
            return await store_append_each(store, bench_events(0, n)), 0

        async def read_raw() -> tuple[float, int]:  # the n messages of the raw atomic batches just written
            return await raw_read(js, n), 0

        async def read_store() -> tuple[float, int]:  # the n events append_many just wrote
            drops.reset()
            seconds, read = await store_read(store)
            return seconds, max(n - read, drops.count)

        async def read_projections() -> tuple[float, int]:
            seconds, read = await projections_read(store)
            return seconds, n - read

        async def apply_sqlite() -> tuple[float, int]:
            drops.reset()
            dsn = f"sqlite:///{base / f'apply-{next(databases)}.db'}"
            seconds, counted = await apply_from_zero(store, dsn, n, drops)
            return seconds, n - counted

        async def apply_pg() -> tuple[float, int]:
            assert opts.pg_dsn
            async with fresh_pg_database(opts.pg_dsn) as pg_dsn:
                drops.reset()
                seconds, counted = await apply_from_zero(store, pg_dsn, n, drops)
            return seconds, n - counted

        # One round, in this order; each llmgw figure right after the raw one it is compared with.
        _raw_publish_steps(rounds, nc, payload, n, "durable")
        rounds.step("llmgw.append.durable", "llmgw append, one event at a time", append_each)
        _raw_batch_step(rounds, nc, payload, n, "durable", 100)
        _raw_batch_step(rounds, nc, payload, n, "durable", MAX_ATOMIC_BATCH)
        _append_many_step(rounds, store, n, "durable")
        rounds.step("raw.read", "raw ordered consumer read", read_raw)
        rounds.step("llmgw.read", "llmgw subscribe(follow=False) read", read_store)
        rounds.step("projections.read", "projections read_log read", read_projections)
        rounds.step("apply.sqlite", "projection apply on SQLite", apply_sqlite)
        pg = await _pg_usable(opts.pg_dsn, report)
        if pg:
            rounds.step("apply.postgres", "projection apply on PostgreSQL", apply_pg)
        await rounds.run("durable")

        rounds.add(report, "raw.pipelined.durable", "raw publish_async, pipelined, durable", n)
        rounds.add(report, "raw.awaited.durable", "raw publish, each awaited, durable", n)
        rounds.add(report, "raw.batch100.durable", "raw atomic batches of 100, durable", n)
        rounds.add(
            report, f"raw.batch{MAX_ATOMIC_BATCH}.durable", f"raw atomic batches of {MAX_ATOMIC_BATCH}, durable", n
        )
        rounds.add(report, "raw.read", "raw ordered consumer read", n)
        rounds.add(
            report, "llmgw.append.durable", "llmgw append, one at a time, durable", n, baseline="raw.awaited.durable"
        )
        rounds.add(
            report,
            "llmgw.append_many.durable",
            "llmgw append_many (group commit), durable",
            n,
            baseline=f"raw.batch{MAX_ATOMIC_BATCH}.durable",
            min_rate=APPEND_TARGET,
        )
        rounds.add(report, "llmgw.read", "llmgw subscribe(follow=False), decoded", n, baseline="raw.read")
        rounds.add(report, "projections.read", "projections read_log (pull), decoded", n, baseline="raw.read")
        for key, label in (
            ("apply.sqlite", "projection apply, SQLite"),
            ("apply.postgres", "projection apply, PostgreSQL"),
        ):
            rounds.add(report, key, label, n, baseline="raw.read", min_rate=APPLY_TARGET)
    finally:
        await store.close()
        await nc.drain()


async def _pg_usable(dsn: str | None, report: Report) -> bool:
    """Whether PostgreSQL can be used (a database can be created and dropped); a note says why not."""
    if not dsn:
        report.notes.append("PostgreSQL skipped: no DSN (--pg, LLMGW_BENCH_POSTGRES_DSN or LLMGW_TEST_POSTGRES_DSN)")
        return False
    try:
        async with fresh_pg_database(dsn):
            return True
    except (OSError, ImportError) as exc:
        report.notes.append(f"PostgreSQL skipped: {exc}")
    except Exception as exc:
        if not type(exc).__module__.startswith("asyncpg"):
            raise
        report.notes.append(f"PostgreSQL skipped: {type(exc).__name__}: {exc}")
    return False


async def _nosync_phase(server: NatsProcess, opts: BackboneOptions, report: Report, base: Path, echo: Echo) -> None:
    n = opts.events
    drops = Drops()
    nc = await nats.connect(server.url, name="llmgw-bench-raw")
    store = await connect_store(server.url, drops)
    try:
        rounds = Rounds(opts.repeat, echo)
        payload = raw_payload(store)
        _raw_publish_steps(rounds, nc, payload, n, "nosync")
        _raw_batch_step(rounds, nc, payload, n, "nosync", MAX_ATOMIC_BATCH)
        _append_many_step(rounds, store, n, "nosync")
        await rounds.run("no flush")
        await nc.jetstream().delete_stream(RAW_STREAM)
        rounds.add(report, "raw.pipelined.nosync", "raw publish_async, pipelined, no flush", n)
        rounds.add(report, "raw.awaited.nosync", "raw publish, each awaited, no flush", n)
        batch = f"raw.batch{MAX_ATOMIC_BATCH}.nosync"
        rounds.add(report, batch, f"raw atomic batches of {MAX_ATOMIC_BATCH}, no flush", n)
        rounds.add(report, "llmgw.append_many.nosync", "llmgw append_many (group commit), no flush", n, baseline=batch)
        if opts.skip_rebuild:
            report.notes.append("full rebuild skipped (--skip-rebuild)")
            return

        # Measured once: at this size a run is long enough to average the machine's noise out.
        m = opts.rebuild_events
        echo(f"rebuild: writing {m:,} events with append_many on the no-flush server (preparation)")
        await reset_events(store)
        prepare_s, last_seq = 0.0, 0
        for start in range(0, m, PREPARE_CHUNK):
            seconds, last_seq = await store_append_many(store, bench_events(start, min(PREPARE_CHUNK, m - start)))
            prepare_s += seconds
        report.add("rebuild.prepare", "rebuild's log: llmgw append_many, no flush", m, prepare_s, baseline=batch)

        echo(f"rebuild: folding {m:,} events into SQLite")
        drops.reset()
        result, counted = await rebuild_sqlite(store, base / "rebuild.db")
        if result.position != last_seq:
            raise BenchError(f"the rebuild stopped at {result.position}; the log ends at {last_seq}")
        report.add(
            "rebuild.sqlite",
            "full rebuild, SQLite",
            m,
            result.seconds,
            baseline="raw.read",
            max_seconds=REBUILD_TARGET_S,
            lost=m - counted,
        )

        # The event store's own reader over the same log: a reader that falls behind must not lose events.
        echo(f"rebuild: reading the {m:,} events back through EventStore.subscribe(follow=False)")
        drops.reset()
        seconds, read = await store_read(store)
        report.add(
            "llmgw.read.big",
            "llmgw subscribe(follow=False), the rebuild's log",
            m,
            seconds,
            baseline="raw.read",
            lost=max(m - read, drops.count),
        )
    finally:
        await store.close()
        await nc.drain()


async def run_backbone(opts: BackboneOptions, echo: Echo) -> Report:
    """Measure every figure in one run; progress goes to ``echo``."""
    report = Report(machine_info(), msgspec.to_builtins(opts) | {"pg_dsn": bool(opts.pg_dsn)})
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-", dir=opts.base_dir) as tmp:
        base = Path(tmp)
        async with asyncio.timeout(PHASE_TIMEOUT_S * 4):
            with nats_server(base, durable=True) as server:
                echo(f"nats-server with sync_interval: always on {server.url}, in {base}")
                await _durable_phase(server, opts, report, base, echo)
            with nats_server(base, durable=False) as server:
                echo(f"nats-server without the durable flush on {server.url}")
                await _nosync_phase(server, opts, report, base, echo)
    lost = [f for f in report.figures.values() if f.lost]
    if lost:
        report.notes.append(
            f"INVALID rows ({'; '.join(f.label for f in lost)}): the reader delivered fewer events than the "
            "log holds, so the time is no figure"
        )
    if any(f.key.startswith("llmgw.read") for f in lost):
        report.notes.append(
            "EventStore.subscribe reads through a push ordered consumer with pending_msgs_limit = "
            "16 × batch_size; once the reader is further behind, nats-py drops messages (slow consumer) and "
            "its ordered consumer, having already counted them, never notices the gap"
        )
    return report


def backbone_text(report: Report) -> str:
    """The report as a person reads it: the machine, how to read the ratios, the table, the notes."""
    m = report.machine
    lines = [
        f"machine: {m['cpus']} CPUs ({m['cpu']}), {m['platform']}, Python {m['python']}",
        f"{m['nats_server']} (from the wheel), nats-py {m['nats_py']}",
        f"durable = sync_interval: always (flush before ack); each throughput figure is the best of "
        f"{report.options['repeat']} runs; ratio = events/s ÷ the raw figure named\n",
        report.table(),
    ]
    lines += [f"- {note}" for note in report.notes]
    return "\n".join(lines)
