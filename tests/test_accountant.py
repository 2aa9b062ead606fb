"""The accountant (SPEC USE-1, USE-2, GW-8): usage records folded once into requests and per-minute rollups.

Records go on the real usage stream the way a router sends them (``Nats-Msg-Id`` = request id); the
fold runs on SQLite and on PostgreSQL. What the tables must hold is folded again here in plain
Python, so a record applied twice, or lost, shows as a wrong sum.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import sys
from collections.abc import AsyncIterator, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from prometheus_client import CollectorRegistry

from llmgw.cli.runtime import serve
from llmgw.cli.server_config import ServerConfig
from llmgw.events.commands.client import CommandClient
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import subjects as S
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import Envelope, RecordedEvent, utc_now
from llmgw.events.schema.registry import EventRegistry
from llmgw.events.schema.usage import UsageRecord, usage_subject
from llmgw.projections.apply import apply_events, create_tables, read_checkpoint
from llmgw.projections.backends import Backend, open_backend
from llmgw.projections.base import Tx
from llmgw.projections.metrics import ProjectionMetrics
from llmgw.projections.rebuild import rebuild, verify
from llmgw.projections.runner import ProjectionRunner
from llmgw.projections.usage import (
    RollupCost,
    UsageProjection,
    budget_spend,
    minute_of,
    parse_since,
    period_start,
    rollup_keys,
    usage_query,
)
from llmgw.services.accountant.service import AccountantService
from tests.signin import cli_env, headers, sign_in_tester
from tests.support import NatsServer, free_port

LLMGW = str(Path(sys.executable).parent / "llmgw")
SUMS = "requests, errors, tokens_in, tokens_out, cost_nano_usd, total_us"

# -- records and what they must add up to ----------------------------------------------------------

# key → (project, team, org): the tree the records come from.
KEYS = {
    "k1": ("p1", "t1", "o1"),
    "k2": ("p1", "t1", "o1"),
    "k3": ("p2", "t1", "o1"),
    "k4": ("p3", "t2", "o2"),
}
MODELS = ("qwen-7b", "smollm2", "llama-3.1-8b")


def make_records(n: int, start: datetime, seed: int = 7, prefix: str = "req") -> list[UsageRecord]:
    """``n`` records over about five minutes from ``start``: several keys, models, statuses and a fallback."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        key = rng.choice(sorted(KEYS))
        project, team, org = KEYS[key]
        asked = rng.choice(MODELS)
        status = rng.choice((200, 200, 200, 200, 429, 502, 499))
        ok = status in (200, 499)
        out.append(
            UsageRecord(
                request_id=f"{prefix}-{i:05d}",
                at=start + timedelta(seconds=rng.uniform(0, 300)),
                status=status,
                key_id=key,
                project_id=project,
                team_id=team,
                org_id=org,
                user=rng.choice((None, "alice", "bob")),
                model_asked=asked,
                # Now and then a fallback serves another model (counted under the one that answered).
                model_served=(("smollm2" if rng.random() < 0.2 else asked) if ok or status == 502 else None),
                replica_id=f"r-{rng.randrange(4)}" if ok else None,
                node_id=f"node-{rng.randrange(2)}" if ok else None,
                endpoint="/v1/chat/completions",
                stream=rng.random() < 0.5,
                tokens_in=rng.randrange(1, 2000) if ok else 0,
                tokens_out=rng.randrange(0, 500) if ok else 0,
                queue_s=round(rng.uniform(0, 0.2), 6),
                ttft_s=round(rng.uniform(0.01, 0.5), 6) if ok else None,
                total_s=round(rng.uniform(0.05, 3.0), 6),
                cost_usd=round(rng.uniform(0, 0.01), 8) if ok else 0.0,
                error=None if ok else f"status {status}",
                router="router-a",
            )
        )
    return out


Sums = list[int]  # requests, errors, tokens_in, tokens_out, cost (nano-USD), total time (µs)


def expected_rollups(records: Iterable[UsageRecord]) -> dict[tuple[str, str, str, str], Sums]:
    """The rollups folded in plain Python: per (minute, dimension, value, model), each request once."""
    out: dict[tuple[str, str, str, str], Sums] = {}
    seen: set[str] = set()
    for r in records:
        if r.request_id in seen:
            continue
        seen.add(r.request_id)
        model = r.model_served or "(none)"
        dims = {"key": r.key_id, "project": r.project_id, "team": r.team_id, "org": r.org_id, "model": model}
        for dim, value in dims.items():
            if value is None:
                continue
            sums = out.setdefault((minute_of(r.at), dim, value, model), [0] * 6)
            add = (1, int(r.status >= 400), r.tokens_in, r.tokens_out, round(r.cost_usd * 1e9), round(r.total_s * 1e6))
            for i, v in enumerate(add):
                sums[i] += v
    return out


async def stored_rollups(backend: Backend) -> dict[tuple[str, str, str, str], Sums]:
    rows = await backend.query("usage", f"SELECT minute, dimension, value, model, {SUMS} FROM {{rollups}}")
    return {tuple(r[:4]): [int(v) for v in r[4:]] for r in rows}


def assert_rollups(stored: dict[Any, Sums], expected: dict[Any, Sums]) -> None:
    assert stored.keys() == expected.keys()
    for k, sums in expected.items():
        assert stored[k] == sums, k  # exact: integer sums, whatever the batches were


async def request_ids(backend: Backend) -> list[str]:
    return [r[0] for r in await backend.query("usage", "SELECT request_id FROM {requests} ORDER BY request_id")]


# -- fixtures and helpers ---------------------------------------------------------------------------


@pytest.fixture
async def backend(db_dsn: str) -> AsyncIterator[Backend]:
    b = await open_backend(db_dsn)
    yield b
    await b.close()


async def publish(store: EventStore, record: UsageRecord, msg_id: str | None = None) -> tuple[int, bool]:
    """As a router sends a record: JSON on ``llmgw.usage.<project>``, ``Nats-Msg-Id`` = the request id."""
    ack = await store.js.publish(
        usage_subject(record.project_id),
        msgspec.json.encode(record),
        headers={S.HDR_MSG_ID: msg_id or record.request_id},
    )
    return ack.seq, bool(ack.duplicate)


async def publish_all(store: EventStore, records: Iterable[UsageRecord]) -> int:
    last = 0
    for r in records:
        last, _ = await publish(store, r)
    return last


def runner_for(store: EventStore, backend: Backend, projection: UsageProjection, **kwargs: Any) -> ProjectionRunner:
    return ProjectionRunner(
        store, backend, [projection], lag_interval_s=None, metrics=ProjectionMetrics(CollectorRegistry()), **kwargs
    )


async def usage_head(store: EventStore) -> int:
    return await store.on_stream(S.STREAM_USAGE).stream_last_seq()


START = datetime(2026, 11, 29, 20, 0, 0, tzinfo=UTC)


# -- the fold ---------------------------------------------------------------------------------------


async def test_records_are_folded_into_requests_and_per_minute_rollups_for_every_dimension(
    store: EventStore, backend: Backend
) -> None:
    records = make_records(300, START)
    last = await publish_all(store, records)
    assert last == 300  # on the usage stream, which numbers its own messages
    async with runner_for(store, backend, UsageProjection(), batch_size=64) as runner:
        assert await runner.wait_until("usage", last, timeout=20)
        assert runner.position("usage") == last

    assert await request_ids(backend) == sorted(r.request_id for r in records)
    assert_rollups(await stored_rollups(backend), expected_rollups(records))
    cp = await read_checkpoint(backend, "usage")
    assert cp is not None and cp.position == last

    # Every field of a record is kept.
    r = records[17]
    cols = (
        "request_id, seq, at, status, key_id, project_id, team_id, org_id, user_name, model_asked, model_served, "
        "replica_id, node_id, endpoint, stream, tokens_in, tokens_out, queue_s, ttft_s, total_s, cost_usd, error, "
        "router"
    )
    row = (await backend.query("usage", f"SELECT {cols} FROM {{requests}} WHERE request_id = ?", r.request_id))[0]
    assert row[0] == r.request_id and row[1] == 18
    assert datetime.fromisoformat(row[2]) == r.at
    assert tuple(row[3:14]) == (
        r.status,
        r.key_id,
        r.project_id,
        r.team_id,
        r.org_id,
        r.user,
        r.model_asked,
        r.model_served,
        r.replica_id,
        r.node_id,
        r.endpoint,
    )
    assert (bool(row[14]), int(row[15]), int(row[16])) == (r.stream, r.tokens_in, r.tokens_out)
    assert (row[17], row[18], row[19], row[20]) == (r.queue_s, r.ttft_s, r.total_s, r.cost_usd)
    assert (row[21], row[22]) == (r.error, r.router)

    # Each dimension adds up to the same totals: every request is in each once (all have a key here).
    totals = await backend.query(
        "usage", "SELECT dimension, SUM(requests), SUM(tokens_in) FROM {rollups} GROUP BY dimension"
    )
    want = (len(records), sum(r.tokens_in for r in records))
    assert {d: (int(n), int(t)) for d, n, t in totals} == dict.fromkeys(
        ("key", "project", "team", "org", "model"), want
    )


async def test_a_record_sent_twice_is_stored_once_and_counted_once(store: EventStore, backend: Backend) -> None:
    records = make_records(40, START, seed=3)
    await publish_all(store, records)
    dup = records[5]
    # Within the duplicate window the stream itself keeps one copy.
    seq, duplicate = await publish(store, dup)
    assert duplicate and seq == 6
    assert await usage_head(store) == 40
    # Past the window (simulated: another message id), the stream holds it twice; the fold counts it once.
    seq, duplicate = await publish(store, dup, msg_id=f"{dup.request_id}-resent")
    assert not duplicate and seq == 41

    async with runner_for(store, backend, UsageProjection(), batch_size=8) as runner:
        assert await runner.wait_until("usage", 41, timeout=20)
        # Sent again while the runner follows, in a batch of its own, and in one with a new request.
        extra = make_records(1, START, seed=99, prefix="late")[0]
        await publish(store, records[0], msg_id="again-1")
        last, _ = await publish(store, extra)
        await publish(store, records[0], msg_id="again-2")
        last, _ = await publish(store, records[39], msg_id="again-3")
        assert await runner.wait_until("usage", last, timeout=20)

    assert await request_ids(backend) == sorted([r.request_id for r in records] + [extra.request_id])
    assert_rollups(await stored_rollups(backend), expected_rollups([*records, extra]))
    # The request row is the first copy's (its stream position), not the later one's.
    assert (await backend.query("usage", "SELECT seq FROM {requests} WHERE request_id = ?", dup.request_id)) == [(6,)]


async def test_a_batch_folded_at_once_equals_the_same_records_folded_one_by_one(backend: Backend) -> None:
    # The runner folds a batch at once and, when that fails, retries record by record: both must agree.
    p, registry = UsageProjection(), EventRegistry()
    records = make_records(400, START, seed=21)
    records += [records[7], records[300]]  # sent twice (past the window)
    events = [
        p.decode(registry, msgspec.json.encode(r), usage_subject(r.project_id), i + 1) for i, r in enumerate(records)
    ]
    async with backend.transaction() as tx:
        await create_tables(tx, p)
        await create_tables(tx, p, shadow=True)
    for start in range(0, len(events), 150):
        async with backend.transaction(p, buffered=True) as tx:
            await apply_events(tx, p, events[start : start + 150], whole=True)
    for e in events:
        async with backend.transaction(p, shadow=True) as tx:
            await apply_events(tx, p, [e])
    for table in p.tables:
        live, shadow = p.table_name(table), p.table_name(table, shadow=True)
        assert await backend.fetchall(f"SELECT * FROM {live} EXCEPT SELECT * FROM {shadow}") == []
        assert await backend.fetchall(f"SELECT * FROM {shadow} EXCEPT SELECT * FROM {live}") == []
    assert_rollups(await stored_rollups(backend), expected_rollups(records))


class HangingUsage(UsageProjection):
    """The usage fold, stuck inside its transaction at one request until the runner is killed around it."""

    def __init__(self, stop_at: str) -> None:
        self.stop_at = stop_at
        self.stopped = asyncio.Event()

    async def apply_batch(self, tx: Tx, events: Sequence[RecordedEvent]) -> None:
        await super().apply_batch(tx, events)
        if any(e.payload.request_id == self.stop_at for e in events):
            await tx.fetchall("SELECT 1")  # the batch's writes are now in the open transaction
            self.stopped.set()
            await asyncio.Event().wait()


async def test_a_runner_killed_mid_batch_resumes_without_double_counting(store: EventStore, db_dsn: str) -> None:
    records = make_records(120, START, seed=11)
    # Some records sent twice (past the window) on both sides of the kill.
    resent = [records[3], records[70], records[100]]
    last = await publish_all(store, records)
    for r in resent:
        last, _ = await publish(store, r, msg_id=f"{r.request_id}-again")

    backend = await open_backend(db_dsn)
    hanging = HangingUsage(stop_at=records[75].request_id)
    runner = runner_for(store, backend, hanging, batch_size=20)
    await runner.start()
    await asyncio.wait_for(hanging.stopped.wait(), 20)
    committed = runner.position("usage")
    assert 0 < committed < 76
    await runner.stop()  # the kill: cancelled inside the transaction, which rolls back
    assert len(await request_ids(backend)) == committed
    await backend.close()

    backend = await open_backend(db_dsn)
    try:
        async with runner_for(store, backend, UsageProjection(), batch_size=20) as runner:
            assert await runner.wait_until("usage", last, timeout=20)
        assert await request_ids(backend) == sorted(r.request_id for r in records)
        assert_rollups(await stored_rollups(backend), expected_rollups(records))
    finally:
        await backend.close()


async def test_verify_agrees_with_the_live_tables_and_rebuild_restores_them(
    store: EventStore, backend: Backend
) -> None:
    records = make_records(250, START, seed=5)
    await publish_all(store, records)
    last, _ = await publish(store, records[9], msg_id="resent")
    projection = UsageProjection()
    async with runner_for(store, backend, projection, batch_size=50) as runner:
        assert await runner.wait_until("usage", last, timeout=20)
        result = await verify(store, backend, projection, runner)
        assert result.identical, result.lines()
        assert result.position == last

        # A live row tampered with is found, by key.
        key = (minute_of(records[0].at), "project", records[0].project_id, records[0].model_served or "")
        async with backend.transaction(projection) as tx:
            await tx.execute(
                "UPDATE {rollups} SET requests = requests + 1 WHERE minute = ? AND dimension = ? AND value = ?",
                *key[:3],
            )
        result = await verify(store, backend, projection, runner)
        assert not result.identical
        assert "rollups" in result.differences and result.differences["rollups"].changed

        rebuilt = await rebuild(store, backend, projection, runner)
        assert rebuilt.position == last and rebuilt.events == len(records) + 1
        assert (await verify(store, backend, projection, runner)).identical
        assert_rollups(await stored_rollups(backend), expected_rollups(records))


async def test_a_record_no_reader_can_read_is_quarantined_and_the_fold_goes_on(
    store: EventStore, backend: Backend
) -> None:
    good = make_records(2, START, seed=1)
    await store.js.publish(usage_subject("p1"), b"{not json", headers={S.HDR_MSG_ID: "garbage"})
    await publish(store, good[0])
    # A record inside an event envelope is read too (a publisher that wraps it loses nothing).
    env = Envelope(
        id="e1", type="usage.record", at=utc_now(), actor="svc:router", data=msgspec.Raw(msgspec.json.encode(good[1]))
    )
    ack = await store.js.publish(usage_subject("p1"), msgspec.json.encode(env), headers={S.HDR_MSG_ID: "wrapped"})
    async with runner_for(store, backend, UsageProjection()) as runner:
        assert await runner.wait_until("usage", ack.seq, timeout=20)
    assert await request_ids(backend) == sorted(r.request_id for r in good)
    quarantine = await store.js.stream_info(S.STREAM_QUARANTINE)
    assert quarantine.state.messages == 1


async def test_pruning_drops_requests_and_rollups_older_than_the_retention(store: EventStore, backend: Backend) -> None:
    old = make_records(20, START - timedelta(days=40), seed=2, prefix="old")
    new = make_records(20, START, seed=4, prefix="new")
    last = await publish_all(store, [*old, *new])
    accountant = AccountantService(backend, retention_days=30)
    assert await accountant.prune(now=START) == 0  # before the first fold: no tables, nothing to do
    async with runner_for(store, backend, UsageProjection()) as runner:
        assert await runner.wait_until("usage", last, timeout=20)
    assert await accountant.prune(now=START) > 0
    assert await request_ids(backend) == sorted(r.request_id for r in new)
    assert_rollups(await stored_rollups(backend), expected_rollups(new))


# -- pure parts -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("description", "period", "now", "start"),
    [
        ("a day starts at midnight UTC", "day", "2026-11-29T20:22:05+00:00", "2026-11-29T00:00:00+00:00"),
        ("a month starts on the 1st", "month", "2026-11-29T20:22:05+00:00", "2026-11-01T00:00:00+00:00"),
        ("a time in another zone counts in UTC", "day", "2026-11-30T01:30:00+03:00", "2026-11-29T00:00:00+00:00"),
    ],
)
def test_budget_periods(description: str, period: str, now: str, start: str) -> None:
    assert period_start(period, datetime.fromisoformat(now)) == datetime.fromisoformat(start), description


def test_a_model_name_no_catalog_model_answered_to_is_no_usage_row_of_its_own() -> None:
    start = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    refused, served = make_records(2, start)
    refused = msgspec.structs.replace(refused, status=404, model_asked="gpt-4o", model_served=None)
    served = msgspec.structs.replace(served, status=200, model_asked="chat", model_served="smollm2")
    assert [value for dim, value, *_ in rollup_keys(refused) if dim == "model"] == ["(none)"]
    assert [value for dim, value, *_ in rollup_keys(served) if dim == "model"] == ["smollm2"]


def test_budget_spend_sums_the_scopes_own_rollups_in_the_current_period() -> None:
    usd = 1_000_000_000  # rollups count nano-USD
    rows = [
        RollupCost("2026-10-31T23:59:00Z", "project", "p1", 5 * usd),  # last month
        RollupCost("2026-11-01T00:00:00Z", "project", "p1", 125 * usd // 100),
        RollupCost("2026-11-29T20:00:00Z", "project", "p1", usd // 2),
        RollupCost("2026-11-29T20:00:00Z", "project", "p2", 7 * usd),  # another project
        RollupCost("2026-11-29T20:00:00Z", "key", "p1", 9 * usd),  # another dimension
    ]
    now = datetime(2026, 11, 29, 21, tzinfo=UTC)
    assert budget_spend(rows, ("project", "p1"), "month", now) == 1.75
    assert budget_spend(rows, ("project", "p1"), "day", now) == 0.5
    assert budget_spend(rows, ("project", "p9"), "month", now) == 0.0


def test_since_is_a_duration_back_or_an_iso_time() -> None:
    now = datetime(2026, 11, 29, 20, 0, tzinfo=UTC)
    assert parse_since("90m", now) == now - timedelta(minutes=90)
    assert parse_since("2d", now) == now - timedelta(days=2)
    assert parse_since("2026-11-29T10:00", now) == datetime(2026, 11, 29, 10, tzinfo=UTC)
    with pytest.raises(ValueError, match="neither a duration"):
        parse_since("yesterday", now)


@pytest.mark.parametrize(
    ("description", "by", "scope", "reads", "groups_by"),
    [
        ("models of everything read the model rows", "model", None, "model", "model"),
        ("models of a project read its project rows", "model", ("project", "p1"), "project", "model"),
        ("keys of an org read key rows filtered by org", "key", ("org", "o1"), "key", "key_id"),
        ("the project of a key reads that key's rows", "project", ("key", "k1"), "key", "project_id"),
        (
            "projects serving a model read project rows of that model",
            "project",
            ("model", "m"),
            "project",
            "project_id",
        ),
    ],
)
def test_usage_is_read_at_the_finer_of_the_scope_and_the_grouping(
    description: str, by: str, scope: tuple[str, str] | None, reads: str, groups_by: str
) -> None:
    sql, args = usage_query(by, scope, "2026-11-29T20:00:00Z")
    assert args[-1] == reads, description
    assert f"GROUP BY {groups_by} " in sql, description


# -- the admin API and the CLI ----------------------------------------------------------------------


@contextlib.asynccontextmanager
async def running(nats_url: str, db_dsn: str, store: EventStore) -> AsyncIterator[tuple[str, str]]:
    """Tenancy, projections, the accountant and the admin API in this process; yields the API's URL
    and a token to call it with."""
    admin_port = free_port()
    config = ServerConfig(
        nats_url=nats_url,
        db_dsn=db_dsn,
        services=("tenancy", "people", "projections", "accountant", "api"),
        port=free_port(),
        admin_port=admin_port,
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(serve(config, stop, on_ready=ready.set))
    readied = asyncio.create_task(ready.wait())
    try:
        await asyncio.wait([task, readied], timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raises what stopped it
        assert ready.is_set(), "the services did not start within 30 s"
        url = f"http://127.0.0.1:{admin_port}"
        yield url, await sign_in_tester(store, url)
    finally:
        stop.set()
        readied.cancel()
        if not task.done():
            await asyncio.wait_for(task, 30)


async def cli(nats_url: str, api_url: str, token: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        LLMGW,
        "--nats",
        nats_url,
        "--api",
        api_url,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=cli_env(token),
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_the_api_and_the_cli_read_back_usage_and_one_request(
    store: EventStore, nats: NatsServer, db_dsn: str
) -> None:
    async with running(nats.url, db_dsn, store) as (api, token), aiohttp.ClientSession(headers=headers(token)) as http:
        client = CommandClient.for_service(store, "tests")
        ids = {}
        for kind, path in (
            ("org", "acme"),
            ("team", "acme/ml"),
            ("project", "acme/ml/chat"),
            ("project", "acme/ml/rag"),
        ):
            done = await client.send(T.SERVICE, "create", T.CreateScope(kind=kind, path=path), actor="user:test")
            ids[path] = done.result["id"]
        org, team, chat, rag = ids["acme"], ids["acme/ml"], ids["acme/ml/chat"], ids["acme/ml/rag"]
        now = utc_now()
        base = UsageRecord(
            request_id="x",
            at=now - timedelta(minutes=10),
            status=200,
            key_id="key-a",
            project_id=chat,
            team_id=team,
            org_id=org,
            user="alice",
            model_asked="qwen-7b",
            model_served="qwen-7b",
            replica_id="rep-1",
            node_id="cpu-01",
            endpoint="/v1/chat/completions",
            stream=True,
            tokens_in=100,
            tokens_out=20,
            queue_s=0.01,
            ttft_s=0.2,
            total_s=1.0,
            cost_usd=0.002,
            router="router-a",
        )
        records = [
            msgspec.structs.replace(base, request_id="req-1"),
            msgspec.structs.replace(base, request_id="req-2", at=now - timedelta(minutes=3), total_s=3.0),
            msgspec.structs.replace(
                base, request_id="req-3", status=502, model_served="smollm2", tokens_out=0, error="engine failed"
            ),
            msgspec.structs.replace(base, request_id="req-4", key_id="key-b", project_id=rag, tokens_in=7),
            # Outside `--since 1h`.
            msgspec.structs.replace(base, request_id="req-old", at=now - timedelta(hours=5)),
        ]
        for r in records:
            await publish(store, r)
        await publish(store, records[0], msg_id="resent")  # counted once

        async def get(path: str, **params: str) -> tuple[int, Any]:
            async with http.get(api + path, params=params) as resp:
                return resp.status, await resp.json()

        status, body = await get("/api/v1/usage", scope="project:acme/ml/chat", since="1h", by="model")
        assert status == 200 and body["scope_id"] == chat
        by_model = {g["group"]: g for g in body["groups"]}
        assert set(by_model) == {"qwen-7b", "smollm2"}
        assert (by_model["qwen-7b"]["requests"], by_model["qwen-7b"]["tokens_in"]) == (2, 200)
        assert by_model["qwen-7b"]["mean_latency_s"] == pytest.approx(2.0)
        assert (by_model["smollm2"]["requests"], by_model["smollm2"]["errors"]) == (1, 1)
        assert body["total"]["requests"] == 3 and body["total"]["cost_usd"] == pytest.approx(0.006)

        # The same project by id; the org's keys; the project a key belongs to; everything by project.
        status, body = await get("/api/v1/usage", scope=f"project:{chat}", since="1h")
        assert status == 200 and body["total"]["requests"] == 3
        status, body = await get("/api/v1/usage", scope="org:acme", since="1h", by="key")
        assert {g["group"]: g["requests"] for g in body["groups"]} == {"key-a": 3, "key-b": 1}
        status, body = await get("/api/v1/usage", scope="key:key-b", since="1h", by="project")
        assert {g["group"]: g["tokens_in"] for g in body["groups"]} == {rag: 7}
        status, body = await get("/api/v1/usage", since="1d", by="project")
        assert {g["group"]: g["requests"] for g in body["groups"]} == {chat: 4, rag: 1}
        names = {g["group"]: g["name"] for g in body["groups"]}
        assert names == {chat: "project:acme/ml/chat", rag: "project:acme/ml/rag"}, "named as people know them"

        status, body = await get("/api/v1/usage", scope="project:acme/ml/nope")
        assert status == 404 and "no project at 'acme/ml/nope'" in body["error"]["message"]
        status, body = await get("/api/v1/usage", scope="galaxy:far")
        assert status == 400 and "KIND:ID-OR-PATH" in body["error"]["message"]

        status, body = await get("/api/v1/usage/spend", scope="project:acme/ml/chat", period="day")
        today = period_start("day", now)
        want = sum(r.cost_usd for r in records if r.project_id == chat and r.at >= today)
        assert status == 200 and body["usd"] == pytest.approx(want)

        status, body = await get("/api/v1/requests/req-3")
        assert status == 200
        assert (body["status"], body["model_asked"], body["model_served"]) == (502, "qwen-7b", "smollm2")
        assert (body["user"], body["stream"], body["error"], body["project_id"]) == (
            "alice",
            True,
            "engine failed",
            chat,
        )
        status, body = await get("/api/v1/requests/req-nope")
        assert status == 404 and "no usage record for request req-nope" in body["error"]["message"]

        # The CLI prints what was stored.
        code, out, err = await cli(
            nats.url, api, token, "ctl", "usage", "--scope", "project:acme/ml/chat", "--since", "1h"
        )
        assert code == 0, err
        assert "usage of project:acme/ml/chat" in out
        line = next(x for x in out.splitlines() if x.startswith("qwen-7b"))
        assert line.split()[1:5] == ["2", "0", "200", "40"] and line.endswith("2.000s")
        assert any(x.startswith("TOTAL") and x.split()[1] == "3" for x in out.splitlines())

        code, out, err = await cli(nats.url, api, token, "ctl", "usage", "--by", "key", "--since", "1h", "--json")
        assert code == 0, err
        assert {g["group"]: g["requests"] for g in json.loads(out)["groups"]} == {"key-a": 3, "key-b": 1}

        code, out, err = await cli(nats.url, api, token, "ctl", "request", "req-3")
        assert code == 0, err
        fields = {line.split(None, 1)[0]: line.split(None, 1)[1] for line in out.splitlines()}
        assert fields["status"].startswith("502") and "engine failed" in fields["status"]
        assert fields["model"] == "asked qwen-7b, served smollm2"
        assert fields["replica"] == "rep-1 on node cpu-01"
        assert fields["tokens"] == "100 in, 0 out"
        assert fields["key"].startswith("key:key-a") and fields["project"] == "project:acme/ml/chat"
        assert "team:acme/ml / org:acme" in out

        code, out, err = await cli(nats.url, api, token, "ctl", "request", "req-2", "--json")
        assert code == 0, err
        assert json.loads(out)["total_s"] == 3.0

        code, out, err = await cli(nats.url, api, token, "ctl", "request", "req-nope")
        assert code != 0 and "no usage record for request req-nope" in err

        # The CLI's verify covers the usage projection too.
        code, out, err = await cli(nats.url, api, token, "projections", "verify", "usage")
        assert code == 0, out + err
        assert "usage: identical" in out
