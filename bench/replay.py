"""`llmgw bench replay`: how long `events replay --until T` takes on a long log — folding from 0, and
from the newest replay snapshot at or before T plus its tail — and what saving the snapshots costs.

It starts its own nats-server (durable, how llmgw runs) in a temporary directory and writes the
cold-start benchmark's realistic log (:func:`llmgw.bench.coldstart.realistic_log`) ``every`` events at
a time, while the live projections follow it as a server runs them — a
:class:`~llmgw.projections.runner.ProjectionRunner` on SQLite with the
:class:`~llmgw.projections.replay_snapshots.ReplaySnapshotter` as its batch listener — waiting after
each step until they have folded it and the saver has saved: the snapshots are the ones a running
system saves when its events arrive more slowly than a save takes (a catch-up from 0 saves fewer,
one after the other). Each replay is the admin API's own (:func:`~llmgw.services.api.replay.replayed`
and its ``answer``, one page of keys: the fold, the views), timed twice at the same moment, from 0 and
from snapshots; the two answers with every key (made after the timing) are compared, and the page
with them (a difference is an error). The moments: just before the newest snapshot (near the head) and
just before the first snapshot past the middle of the log, each the longest tail a replay there folds:
the worst point of the snapshot cycle. With ``keep`` the server's directory is kept there with what the
build measured, and a later run of the same size and spacing measures on it without building it again
(at a million events the build takes twenty minutes, the replays seconds). Nothing here asserts a time; it prints.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
from prometheus_client import CollectorRegistry

from llmgw.bench import BenchError
from llmgw.bench.backbone import events_spec, nats_server
from llmgw.bench.coldstart import Echo, realistic_log
from llmgw.events.runtime.snapshots import SnapshotStore
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.catalog import default_registry
from llmgw.projections.backends import open_backend
from llmgw.projections.replay import stamp_of
from llmgw.projections.replay_snapshots import (
    EVERY_EVENTS,
    PREFIX,
    ReplaySnapshotter,
    newest_at_or_before,
    position_of,
    replay_projections,
    start_from_snapshot,
)
from llmgw.projections.runner import ProjectionRunner
from llmgw.services.api.replay import answer, replayed

TIMEOUT_S = 3600.0
REPEAT = 3  # replays from a snapshot timed at each moment


class ReplayOptions(msgspec.Struct, frozen=True, kw_only=True):
    events: tuple[int, ...] = (200_000,)
    every: int = EVERY_EVENTS
    base_dir: str | None = None
    keep: str | None = None  # a directory the built logs are kept in, and reused from by a later run


class Built(msgspec.Struct, kw_only=True):
    """What building a log measured, kept beside it so a run that reuses the log can report it."""

    events: int
    every: int
    head: int
    build_s: float
    saves: int
    snapshot_bytes: int
    copy_s: float
    save_s: float


class Moment(msgspec.Struct, kw_only=True):
    where: str
    position: int
    from_zero_s: float
    from_snapshot_s: float  # the median of REPEAT
    from_snapshot_worst_s: float  # the slowest of them
    snapshot: int | None  # the snapshot it started from
    load_s: float  # of from_snapshot_s: reading the snapshot and writing its database out (timed on its own; median)
    views_s: float  # of from_snapshot_s: the views that shape the answer (one page of keys; median)
    json_s: (
        float  # not in from_snapshot_s: the answer encoded as the API sends it and decoded as the CLI reads it (median)
    )
    answer_bytes: int  # … its size
    keys: int  # keys at the moment (all counted, one page listed)
    tail: int  # events on the log after the snapshot it started from (all of them from 0)
    tail_events: int  # events folded after the snapshot, by the three projections together
    zero_events: int  # events folded from 0 (the same)


class Result(msgspec.Struct, kw_only=True):
    events: int
    every: int
    build_s: float  # writing the log step by step, the projections following it and saving snapshots
    saves: int
    kept: int  # snapshots in the store after thinning
    kept_bytes: int  # all of them together
    snapshot_bytes: int  # the last one saved
    copy_s: float  # the last one: copying the tables into a SQLite file and deflating it (beside the runner)
    save_s: float  # … and with the write to the object store
    moments: list[Moment]
    load_average: list[float]  # the machine's 1-minute load average before and after each moment's replays


async def _live(store: EventStore, db: Path, n: int, every: int, echo: Echo) -> tuple[float, int, ReplaySnapshotter]:
    """The log written ``every`` events at a time, the projections following it live and the saver saving
    after each step, as on a system whose events arrive more slowly than a save takes: (seconds, head, saver)."""
    backend = await open_backend(f"sqlite:///{db}")
    saver = ReplaySnapshotter(store, backend, every=every)
    runner = ProjectionRunner(
        store, backend, replay_projections(), registry=CollectorRegistry(), lag_interval_s=None, on_batch=saver.folded
    )
    started = time.perf_counter()
    await runner.start()
    events = realistic_log(n)
    head = written = 0
    try:
        while chunk := [e for _, e in zip(range(every), events, strict=False)]:
            head = await store.append_many(chunk)
            written += len(chunk)
            for p in replay_projections():
                if not await runner.wait_until(p.name, head, timeout=TIMEOUT_S):
                    raise BenchError(f"projection {p.name} did not catch up within {TIMEOUT_S:.0f} s")
            await saver.flush()
            saver.folded("fleet", runner.position("fleet"))  # the last batch may have found a save under way
            await saver.flush()
            if written % 100_000 < every:
                echo(f"  {written:,} events written and folded, {saver.saves} snapshots saved")
        return time.perf_counter() - started, head, saver
    finally:
        await runner.stop()
        await saver.close()
        await backend.close()


async def _load_s(store: EventStore, tmp: Path, position: int) -> float:
    """start_from_snapshot alone: the load part of a replay from a snapshot (its database written out)."""
    database = tmp / f"load-{position}.db"
    started = time.perf_counter()
    await start_from_snapshot(store, database, position, replay_projections())
    took = time.perf_counter() - started
    database.unlink(missing_ok=True)
    return took


async def _replay(store: EventStore, when: datetime, *, from_snapshots: bool) -> tuple[float, float, dict, dict]:
    """One replay as the API answers it (one page of keys): (seconds, of which the views, the answer, and the
    same moment's answer with every key, made after the timing and kept out of it, for the comparison)."""
    started = time.perf_counter()
    async with replayed(store, when, from_snapshots=from_snapshots) as moment:
        shaping = time.perf_counter()
        page = await answer(moment)
        views_s = time.perf_counter() - shaping
        untimed = time.perf_counter()
        full = await answer(moment, keys_limit=None)
        untimed = time.perf_counter() - untimed
    return time.perf_counter() - started - untimed, views_s, page, full


def _json_s(answer: dict) -> float:
    """The answer encoded as the API's ``json_response`` encodes it and decoded as the CLI reads it."""
    started = time.perf_counter()
    json.loads(json.dumps(answer))
    return time.perf_counter() - started


async def _moment(store: EventStore, tmp: Path, where: str, seq: int, saved: list[int]) -> Moment:
    when = await stamp_of(store, seq)
    if when is None:
        raise BenchError(f"no event at sequence {seq} to replay to")
    from_zero_s, _, _, zero = await _replay(store, when, from_snapshots=False)
    # From a snapshot it is seconds: timed REPEAT times, the median reported with the slowest (a shared
    # machine's noise is of the order of the figure).
    runs = [await _replay(store, when, from_snapshots=True) for _ in range(REPEAT)]
    _, _, snap, full = runs[0]
    from_snapshot_s = statistics.median(r[0] for r in runs)
    views_s = statistics.median(r[1] for r in runs)
    encoded = json.dumps(snap)
    json_s = statistics.median(_json_s(r[2]) for r in runs)
    how = ("from_snapshot", "events_folded")
    if {k: v for k, v in zero.items() if k not in how} != {k: v for k, v in full.items() if k not in how}:
        raise BenchError(f"the replay to #{seq} from a snapshot differs from the replay from 0")
    if snap["keys"] != full["keys"][: len(snap["keys"])] or snap["counts"] != full["counts"]:
        raise BenchError(f"the replay to #{seq}: its page of keys is not the start of all of them")
    if snap["from_snapshot"] != newest_at_or_before(saved, snap["position"]):
        raise BenchError(f"the replay to #{seq} started from {snap['from_snapshot']}, not the newest snapshot before")
    return Moment(
        where=where,
        position=snap["position"],
        from_zero_s=from_zero_s,
        from_snapshot_s=from_snapshot_s,
        from_snapshot_worst_s=max(r[0] for r in runs),
        snapshot=snap["from_snapshot"],
        load_s=statistics.median([await _load_s(store, tmp, snap["position"]) for _ in range(REPEAT)]),
        views_s=views_s,
        json_s=json_s,
        answer_bytes=len(encoded),
        keys=snap["counts"]["keys"]["total"],
        tail=snap["position"] - (snap["from_snapshot"] or 0),
        tail_events=snap["events_folded"],
        zero_events=zero["events_folded"],
    )


async def _build(store: EventStore, where: Path, n: int, every: int, echo: Echo) -> Built:
    """The log and its snapshots: built, or the ones a run before kept in ``where`` (``built.json`` says so)."""
    record = where / "built.json"
    if record.exists():
        built = msgspec.json.decode(record.read_bytes(), type=Built)
        echo(f"reusing the log of {built.head:,} events kept in {where} (built in {built.build_s:.0f} s)")
        return built
    await store.ensure_streams(events_spec())
    echo(f"writing {n:,} events, {every:,} at a time, the projections following and saving snapshots…")
    build_s, head, saver = await _live(store, where / "live.db", n, every, echo)
    built = Built(
        events=n,
        every=every,
        head=head,
        build_s=build_s,
        saves=saver.saves,
        snapshot_bytes=saver.last_bytes,
        copy_s=saver.last_copy_s,
        save_s=saver.last_save_s,
    )
    record.write_bytes(msgspec.json.encode(built))  # written last: a build cut short is not reused
    return built


async def measure(store: EventStore, tmp: Path, n: int, every: int, echo: Echo) -> Result:
    built = await _build(store, tmp, n, every, echo)
    head = built.head
    snapshots = await SnapshotStore.open(store.js, replicas=1)
    saved = sorted(p for name in await snapshots.names(PREFIX) if (p := position_of(name)) is not None)
    infos = await snapshots.objects.list(ignore_deletes=True) if saved else []
    kept_bytes = sum(i.size or 0 for i in infos if position_of(i.name) is not None and not i.deleted)
    if not saved:
        raise BenchError(f"no replay snapshot was saved on a log of {head:,} events (every {every:,})")
    # Mid-log, the event just before the first snapshot past the middle: the longest tail there is.
    later = [p for p in saved if p > head // 2]
    mid = (later[0] - 1) if later else head // 2
    moments = []
    load: list[float] = []
    for where, seq in (("near the head, before one", saved[-1] - 1), ("mid-log, before a snapshot", mid)):
        echo(f"replaying to #{seq:,} ({where}) from 0 and from snapshots…")
        load.append(os.getloadavg()[0])
        moments.append(await _moment(store, tmp, where, seq, saved))
        load.append(os.getloadavg()[0])
    return Result(
        events=head,
        every=every,
        build_s=built.build_s,
        saves=built.saves,
        kept=len(saved),
        kept_bytes=kept_bytes,
        snapshot_bytes=built.snapshot_bytes,
        copy_s=built.copy_s,
        save_s=built.save_s,
        moments=moments,
        load_average=load,
    )


async def run_replay(opts: ReplayOptions, echo: Echo) -> list[Result]:
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        if opts.keep is not None:
            tmp = opts.keep
            Path(tmp).mkdir(parents=True, exist_ok=True)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="llmgw-bench-replay-", dir=opts.base_dir))
        for n in opts.events:
            where = Path(tmp) / f"n{n}-every{opts.every}"
            with nats_server(where, durable=True) as server:
                try:
                    store = await EventStore.connect(server.url, default_registry())
                except (OSError, nats.errors.Error) as exc:
                    raise BenchError(f"cannot connect to the bench's nats-server at {server.url}: {exc}") from exc
                try:
                    results.append(await measure(store, where, n, opts.every, echo))
                finally:
                    with contextlib.suppress(Exception):
                        await store.close()
    return results


def replay_json(results: list[Result]) -> dict[str, Any]:
    return {"machine": f"{platform.machine()} {platform.processor()}".strip(), "runs": msgspec.to_builtins(results)}


def replay_text(results: list[Result]) -> str:
    lines = [
        "events replay --until T: from 0 vs from the newest replay snapshot + its tail (same log, same run)",
        f"{'events':>10} {'moment':<27} {'position':>10} {'from 0':>9} {'snapshot':>9} {'slowest':>9} {'ratio':>7} "
        f"{'load':>7} {'views':>7} {'tail':>8} {'keys':>8} {'json':>7} {'answer':>8}",
    ]
    for r in results:
        for m in r.moments:
            lines.append(
                f"{r.events:>10,} {m.where:<27} {m.position:>10,} {m.from_zero_s:>8.2f}s {m.from_snapshot_s:>8.2f}s "
                f"{m.from_snapshot_worst_s:>8.2f}s "
                f"{m.from_zero_s / max(m.from_snapshot_s, 1e-9):>6.1f}x {m.load_s:>6.2f}s {m.views_s:>6.2f}s "
                f"{m.tail:>8,} {m.keys:>8,} {m.json_s:>6.2f}s {m.answer_bytes / 1e6:>6.1f}MB"
            )
        lines.append(
            f"{'':>10} (log written and folded in {r.build_s:.1f} s, saving "
            f"{r.saves} snapshots every {r.every:,} events, {r.kept} kept ({r.kept_bytes / 1e6:.0f} MB); "
            f"the last: {r.snapshot_bytes:,} bytes, "
            f"copied and deflated in {r.copy_s:.2f} s, saved in {r.save_s:.2f} s; "
            f"load average {min(r.load_average):.1f} to {max(r.load_average):.1f} while replaying)"
        )
    return "\n".join(lines)
