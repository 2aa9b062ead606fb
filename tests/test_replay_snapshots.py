"""Replay snapshots (SPEC EVT-2): `events replay --until T` starts from the newest replay snapshot at
or before T and folds only the tail, and answers exactly what a replay from 0 answers; a snapshot it
cannot trust is ignored, logged, and the replay folds from 0. The series of snapshots the projection
runner saves is thinned so its size grows with the log's length only logarithmically.
Real nats-server; the log is the cold-start benchmark's realistic mix."""

from __future__ import annotations

import uuid
import zlib
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
import pytest
from click.testing import CliRunner
from structlog.testing import capture_logs

from llmgw.bench.coldstart import realistic_log
from llmgw.cli.main import main
from llmgw.events.runtime.snapshots import SnapshotStore
from llmgw.events.runtime.store import EventStore
from llmgw.projections.backends import open_backend
from llmgw.projections.replay import replay_into, stamp_of
from llmgw.projections.replay_fold import TailFold
from llmgw.projections.replay_snapshots import (
    FORMAT,
    PREFIX,
    ReplaySnapshotter,
    decode_state,
    dump,
    encode_state,
    newest_at_or_before,
    position_of,
    replay_projections,
    snapshot_name,
    start_from_snapshot,
    to_keep,
)
from llmgw.projections.runner import ProjectionRunner
from llmgw.services.api.replay import cluster_at
from tests.support import wait_until

pytestmark = pytest.mark.timeout(180)

LOG = 3_000
EVERY = 500
CHUNK = 100  # events appended at a time: each chunk gets later server stamps than the one before


async def _write(store: EventStore, events: list[Any]) -> int:
    last = 0
    for i in range(0, len(events), CHUNK):
        last = await store.append_many(events[i : i + CHUNK])
    return last


async def _run_projections(
    store: EventStore,
    tmp_path: Path,
    saver_every: int = EVERY,
    newest: int = 20,
    batch_size: int = 100,
    dsn: str | None = None,
) -> Any:
    """The live projections as a server runs them, with the replay snapshots' saver, caught up with the log."""
    backend = await open_backend(dsn or f"sqlite:///{tmp_path / f'live-{uuid.uuid4().hex[:6]}.db'}")
    saver = ReplaySnapshotter(store, backend, every=saver_every, newest=newest)
    runner = ProjectionRunner(
        store, backend, replay_projections(), batch_size=batch_size, on_batch=saver.folded, lag_interval_s=None
    )
    await runner.start()
    await _folded(store, runner, saver)
    return runner, saver, backend


async def _folded(store: EventStore, runner: ProjectionRunner, saver: ReplaySnapshotter) -> None:
    """Until the projections have folded the whole log and the saver has saved what is due."""
    head = await store.stream_last_seq()
    for p in replay_projections():
        assert await runner.wait_until(p.name, head, timeout=60)
    # The last batch may have found a save under way and let it be: ask once more, then wait for it.
    await saver.flush()
    saver.folded("fleet", runner.position("fleet"))
    await saver.flush()


async def _write_followed(
    store: EventStore, runner: ProjectionRunner, saver: ReplaySnapshotter, events: list[Any], step: int
) -> None:
    """``events`` written ``step`` at a time, each step folded and saved before the next is written: a log
    whose events come more slowly than a save takes, as on a running system."""
    for i in range(0, len(events), step):
        await _write(store, events[i : i + step])
        await _folded(store, runner, saver)


@pytest.fixture
async def logged(store: EventStore, tmp_path: Path) -> AsyncIterator[tuple[EventStore, list[int]]]:
    """A log of LOG events with replay snapshots saved by the running projections; their positions."""
    runner, saver, backend = await _run_projections(store, tmp_path)
    try:
        await _write_followed(store, runner, saver, list(realistic_log(LOG)), EVERY)
        snapshots = await SnapshotStore.open(store.js)
        positions = sorted(p for n in await snapshots.names(PREFIX) if (p := position_of(n)) is not None)
        assert len(positions) >= 3, positions
        yield store, positions
    finally:
        await runner.stop()
        await saver.close()
        await backend.close()


async def _tables(
    store: EventStore, tmp_path: Path, position: int, from_snapshots: bool, on_a_thread: bool = False
) -> tuple[Any, dict]:
    """Every row of the replayed projections at ``position`` (from the newest snapshot, or from 0), folded
    through the backend as the server's projections fold, or ``on_a_thread`` as a replay's tail is."""
    database = tmp_path / f"scratch-{uuid.uuid4().hex[:6]}.db"
    projections = replay_projections()
    start = await start_from_snapshot(store, database, position, projections) if from_snapshots else None
    backend = await open_backend(f"sqlite:///{database}")
    try:
        after = start.after if start else None
        if on_a_thread:
            async with TailFold(database) as fold:
                await replay_into(store, backend, position, projections, after, commit=fold.commit)
        else:
            await replay_into(store, backend, position, projections, after)
        tables = {}
        for p in projections:
            for logical in p.tables:
                rows = await backend.fetchall(f"SELECT * FROM {p.table_name(logical)}")
                tables[p.table_name(logical)] = sorted(rows, key=repr)
        return start, tables
    finally:
        await backend.close()


def _without_how(answer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in answer.items() if k not in ("from_snapshot", "events_folded")}


async def _moment(store: EventStore, seq: int) -> datetime:
    stamped = await stamp_of(store, seq)
    assert stamped is not None
    return stamped


# -- the pure parts -------------------------------------------------------------------------------


def test_a_snapshot_name_carries_its_position_and_other_names_carry_none() -> None:
    assert snapshot_name(1_234) == "replay-000000001234"
    assert position_of(snapshot_name(1_234)) == 1_234
    assert position_of("router") is None and position_of("replay-x") is None


def test_a_replay_starts_from_the_newest_snapshot_at_or_before_its_position() -> None:
    assert newest_at_or_before([100, 200, 300], 250) == 200
    assert newest_at_or_before([100, 200, 300], 300) == 300
    assert newest_at_or_before([100, 200, 300], 99) is None
    assert newest_at_or_before([], 1_000) is None


def test_the_series_keeps_the_newest_and_thins_older_ones_to_a_logarithmic_count() -> None:
    every, newest = 1_000, 20
    kept: set[int] = set()
    for i in range(1, 3_001):  # a saver's life: one snapshot per `every` events, thinned after each save
        kept.add(i * every + i % 7)  # batch edges: a little past each multiple
        kept = to_keep(kept, every=every, newest=newest)
        head = max(kept)
        ordered = sorted(kept, reverse=True)
        recent = {j * every + j % 7 for j in range(max(1, i - newest + 1), i + 1)}
        assert set(ordered[:newest]) == recent
        # No gap wider than half the age of the snapshot after it (a replay there folds at most that much).
        for newer, older in zip(ordered[newest - 1 :], ordered[newest:], strict=False):
            assert newer - older <= max(2 * every + 7, (head - older) // 2), (i, newer, older)
    assert len(kept) <= newest + newest // 2 * 12  # 3,000 snapshots' worth of history: ~8 doublings past the newest


def test_thinning_a_kept_series_again_keeps_it() -> None:
    positions = {i * 500 for i in range(1, 400)}
    kept = to_keep(positions, every=500, newest=10)
    assert to_keep(kept, every=500, newest=10) == kept
    assert to_keep({500, 1_000}, every=500, newest=10) == {500, 1_000}


# -- replaying from one ---------------------------------------------------------------------------


async def test_a_replay_from_a_snapshot_answers_what_a_replay_from_0_answers_at_every_moment(
    logged: tuple[EventStore, list[int]], tmp_path: Path
) -> None:
    store, saved = logged
    head = await store.stream_last_seq()
    first, second = saved[0], saved[1]
    moments = {
        "before the first snapshot": first - 1,
        "at a snapshot": second,
        "between two snapshots": (first + second) // 2,
        "at the head": head,
    }
    for what, seq in moments.items():
        when = await _moment(store, seq)
        snap = await cluster_at(store, when, keys_limit=None)
        zero = await cluster_at(store, when, from_snapshots=False, keys_limit=None)
        assert _without_how(snap) == _without_how(zero), what
        assert zero["from_snapshot"] is None and zero["events_folded"] > 0, what
        expected = newest_at_or_before(saved, snap["position"])
        assert snap["from_snapshot"] == expected, what
        if expected is not None:
            assert snap["events_folded"] < zero["events_folded"], what
        # Every row, not only what the views show (stopped replicas, limits, …).
        start, rows = await _tables(store, tmp_path, snap["position"], from_snapshots=True)
        _, rows_from_0 = await _tables(store, tmp_path, snap["position"], from_snapshots=False)
        assert (start.position if start else None) == expected
        assert rows == rows_from_0, what


async def test_a_tail_folded_on_a_thread_of_its_own_leaves_the_rows_the_backend_folds(
    logged: tuple[EventStore, list[int]], tmp_path: Path
) -> None:
    store, saved = logged
    for seq in ((saved[-2] + saved[-1]) // 2, await store.stream_last_seq()):
        for from_snapshots in (True, False):
            start, rows = await _tables(store, tmp_path, seq, from_snapshots, on_a_thread=True)
            _, expected = await _tables(store, tmp_path, seq, from_snapshots)
            assert (start is not None) == from_snapshots and rows == expected


async def test_snapshots_copied_from_either_live_database_replay_the_rows_a_replay_from_0_folds(
    store: EventStore, tmp_path: Path, db_dsn: str
) -> None:
    runner, saver, backend = await _run_projections(store, tmp_path, dsn=db_dsn)
    try:
        await _write_followed(store, runner, saver, list(realistic_log(1_500)), EVERY)
    finally:
        await runner.stop()
        await saver.close()
        await backend.close()
    assert saver.saves == 3
    head = await store.stream_last_seq()
    for seq in (head, head - EVERY // 2):
        start, rows = await _tables(store, tmp_path, seq, from_snapshots=True)
        _, rows_from_0 = await _tables(store, tmp_path, seq, from_snapshots=False)
        assert start is not None and rows == rows_from_0


async def test_the_answer_says_which_snapshot_a_replay_started_from(
    logged: tuple[EventStore, list[int]],
) -> None:
    store, saved = logged
    answer = await cluster_at(store, await _moment(store, await store.stream_last_seq()))
    assert answer["from_snapshot"] == saved[-1]
    assert answer["position"] >= saved[-1]


@pytest.mark.parametrize(
    "kind", ["corrupt", "other projection versions", "another log", "a database cut short", "not a database"]
)
async def test_a_snapshot_that_cannot_be_trusted_is_ignored_and_the_replay_folds_from_0(
    store: EventStore, tmp_path: Path, kind: str
) -> None:
    head = await _write(store, list(realistic_log(1_200)))
    runner, saver, backend = await _run_projections(store, tmp_path, saver_every=10**9)  # saves none itself
    try:
        state = await dump(store, backend, replay_projections(), tmp_path / "copy.db")
    finally:
        await runner.stop()
        await saver.close()
        await backend.close()
    assert state is not None and state.position == head
    if kind == "corrupt":
        data = b"\x93not a snapshot"
    elif kind == "other projection versions":
        changed = [msgspec.structs.replace(a, version=a.version + 1) for a in state.projections]
        data = encode_state(msgspec.structs.replace(state, projections=changed))
    elif kind == "another log":
        data = encode_state(msgspec.structs.replace(state, recorded=datetime(2020, 1, 1).astimezone()))
    elif kind == "a database cut short":
        data = encode_state(msgspec.structs.replace(state, database=state.database[: len(state.database) // 2]))
    else:
        data = encode_state(msgspec.structs.replace(state, database=zlib.compress(b"not a SQLite file" * 100)))
    snapshots = await SnapshotStore.open(store.js)
    if kind == "corrupt":
        await snapshots.objects.put(snapshot_name(state.position), data)
    else:
        await snapshots.save(snapshot_name(state.position), FORMAT, state.position, data)

    when = await _moment(store, head)
    with capture_logs() as logs:
        answer = await cluster_at(store, when, keys_limit=None)
    zero = await cluster_at(store, when, from_snapshots=False, keys_limit=None)
    assert answer["from_snapshot"] is None
    assert _without_how(answer) == _without_how(zero) and answer["events_folded"] == zero["events_folded"]
    assert any("is ignored" in e["event"] for e in logs), logs


async def test_every_key_is_counted_and_the_pages_list_them_all_once_in_order(
    logged: tuple[EventStore, list[int]],
) -> None:
    store, _ = logged
    when = await _moment(store, await store.stream_last_seq())
    every = await cluster_at(store, when, keys_limit=None)
    counts = every["counts"]["keys"]
    assert every["keys_next"] is None and len(every["keys"]) == counts["total"] > 100
    assert counts["revoked"] == sum(k["state"] == "revoked" for k in every["keys"]) > 0
    assert counts["active"] + counts["revoked"] + counts["expired"] == counts["total"]
    first = await cluster_at(store, when)  # the API's default page
    assert first["keys"] == every["keys"][:100] and first["keys_next"] is not None
    listed, after = [], None
    while True:
        page = await cluster_at(store, when, keys_limit=60, keys_after=after)
        assert page["counts"] == every["counts"] and len(page["keys"]) <= 60
        listed += page["keys"]
        after = page["keys_next"]
        if after is None:
            break
    assert listed == every["keys"]
    assert (await cluster_at(store, when, keys_limit=0))["keys"] == []


async def test_a_replay_with_no_snapshot_saved_folds_from_0(store: EventStore) -> None:
    head = await _write(store, list(realistic_log(300)))
    answer = await cluster_at(store, await _moment(store, head))
    assert answer["from_snapshot"] is None and answer["position"] == head and len(answer["nodes"]) > 0


# -- saving them ----------------------------------------------------------------------------------


async def test_the_saver_keeps_a_bounded_series_and_a_restarted_one_does_not_save_again_at_once(
    store: EventStore, tmp_path: Path
) -> None:
    events = list(realistic_log(4_000))
    runner, saver, backend = await _run_projections(store, tmp_path, saver_every=200, newest=3)
    await _write_followed(store, runner, saver, events[:3_000], 200)
    await runner.stop()
    await saver.close()
    await backend.close()
    snapshots = await SnapshotStore.open(store.js)
    names = await snapshots.names(PREFIX)
    positions = sorted(p for n in names if (p := position_of(n)) is not None)
    assert saver.saves == 15  # one per 200 events of a 3,000-event log
    assert len(positions) < saver.saves  # thinned as it went
    assert positions == sorted(to_keep(positions, every=200, newest=3))

    # Started again on the same database: nothing new to fold, so nothing saved; 1,000 more events, and it saves.
    runner, saver, backend = await _run_projections(store, tmp_path, saver_every=200, newest=3)
    try:
        assert saver.saves == 0 and saver.saved_at == positions[-1]
        await _write(store, events[3_000:])
        await wait_until(lambda: saver.saves > 0, deadline_s=60, what="a save after 1,000 more events")
        assert saver.saved_at is not None and saver.saved_at > positions[-1]
    finally:
        await runner.stop()
        await saver.close()
        await backend.close()


async def test_a_replay_snapshot_records_the_time_the_log_stamped_at_its_position(
    logged: tuple[EventStore, list[int]],
) -> None:
    store, saved = logged
    snapshots = await SnapshotStore.open(store.js)
    found = await snapshots.load(snapshot_name(saved[-1]), FORMAT)
    assert found is not None
    state = decode_state(found[1])
    assert state.position == saved[-1] == max(a.checkpoint for a in state.projections)
    assert state.recorded == await stamp_of(store, saved[-1])


async def test_a_replay_snapshots_database_is_deflated_once_not_again_by_the_store(
    logged: tuple[EventStore, list[int]],
) -> None:
    store, saved = logged
    snapshots = await SnapshotStore.open(store.js)
    stored = await snapshots.read(snapshot_name(saved[-1]))
    found = await snapshots.load(snapshot_name(saved[-1]), FORMAT)
    assert found is not None
    # Stored as it is: the object holds the whole deflated database (a second deflate would shrink it).
    assert len(stored) > len(decode_state(found[1]).database) > 0


# -- the benchmark --------------------------------------------------------------------------------


def test_bench_replay_times_a_replay_from_0_and_from_snapshots_at_the_head_and_mid_log(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        main, ["bench", "replay", "--events", "3000", "--every", "500", "--dir", str(tmp_path)], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any("near the head, before one" in line for line in lines), result.output
    assert any("mid-log, before a snapshot" in line for line in lines), result.output
    assert "snapshots every 500 events" in result.output


def test_bench_replay_keeps_the_log_it_built_and_a_later_run_measures_on_it_without_building(tmp_path: Path) -> None:
    args = ["bench", "replay", "--events", "1500", "--every", "500", "--keep", str(tmp_path / "kept")]
    built = CliRunner().invoke(main, args, catch_exceptions=False)
    assert built.exit_code == 0, built.output
    assert "writing 1,500 events" in built.output and "reusing" not in built.output
    again = CliRunner().invoke(main, args, catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert "reusing the log of 1,500 events" in again.output and "writing" not in again.output
    assert "near the head, before one" in again.output


def test_bench_replay_refuses_counts_that_are_not_counts() -> None:
    result = CliRunner().invoke(main, ["bench", "replay", "--events", "many"])
    assert result.exit_code != 0 and "--events takes event counts" in result.output
