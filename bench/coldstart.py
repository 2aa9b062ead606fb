"""`llmgw bench coldstart`: how long a router and a scheduler take to start on a long log — from 0, and from
a snapshot plus its tail — and what a snapshot costs to write.

It starts its own nats-server (durable, how llmgw runs) in a temporary directory, writes a log of a
realistic mix (nodes registered, 200 models, keys created and revoked, replicas placed, ready,
stopped and failed) with ``append_many``, then times each service's start as the service does it: a
fresh state folded by a :class:`~llmgw.events.runtime.follower.Follower` over the whole log until it has
caught up with the log as it was at its start. The "from a snapshot" figure is the same start after
a snapshot taken :data:`TAIL` events before the head (the most a service that saves every
``EVERY_EVENTS`` events leaves behind): loading and decoding it, then folding the tail. Both are
measured in the same run on the same log, so their ratio is what is meant to be read. What a save
costs the running service is reported beside them: the encoding (a pause of its event loop), then
the compression and the write (off the loop), and the bytes before and after compression. Nothing
here asserts; it prints.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import io
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats.errors

from llmgw.bench import BenchError
from llmgw.bench.backbone import events_spec, nats_server
from llmgw.events.runtime.follower import Follower
from llmgw.events.runtime.snapshots import EVERY_EVENTS, SnapshotStore
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import access as A
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.events.schema import subjects as S
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.services.router import state as RS
from llmgw.services.scheduler import state as SS
from llmgw.services.scheduler.service import FOLDED

ACTOR = "system:bench"
CHUNK = 20_000  # events built and appended at a time
TAIL = EVERY_EVENTS  # events after the snapshot in the "from a snapshot" figures
NODES = 1000
MODELS = 200
PROJECTS = 100
REPLICAS = 5000  # replicas placed or ready at a time, once the log has grown that far
TIMEOUT_S = 1800.0

Echo = Callable[[str], None]


class ColdstartOptions(msgspec.Struct, frozen=True, kw_only=True):
    events: tuple[int, ...] = (200_000,)
    base_dir: str | None = None


# -- the log --------------------------------------------------------------------------------------


def realistic_log(n: int) -> Iterator[tuple[str, NewEvent]]:
    """``n`` events of a running cluster: its nodes, models and projects first, then (of every 20) 3 keys
    created, 1 revoked, and 16 replica events — placed, ready, and once :data:`REPLICAS` run, the
    oldest stopped (one in ten failed), so the fleet stays that size while the keys grow."""

    def ev(aggregate: str, agg_id: str, payload: msgspec.Struct) -> tuple[str, NewEvent]:
        return S.event_subject(aggregate, agg_id), NewEvent(payload=payload, actor=ACTOR)

    def setup() -> Iterator[tuple[str, NewEvent]]:
        yield ev("tenancy", "org-0", T.OrgCreated(org_id="org-0", name="org"))
        yield ev("tenancy", "team-0", T.TeamCreated(team_id="team-0", org_id="org-0", name="team"))
        for p in range(PROJECTS):
            yield ev("tenancy", f"proj-{p}", T.ProjectCreated(project_id=f"proj-{p}", team_id="team-0", name=f"p{p}"))
        for i in range(NODES):
            cap = N.NodeCapacity(address=f"http://node-{i:04d}:9000", cpus=64, memory_total_bytes=512 * 1024**3)
            yield ev(N.AGGREGATE, f"node-{i:04d}", N.NodeRegistered(node_id=f"node-{i:04d}", capacity=cap))
        for i in range(MODELS):
            spec = M.ModelSpec(name=f"model-{i:03d}", source=f"/models/{i}", scaling=M.Scaling(min=1))
            yield ev(M.AGGREGATE, spec.name, M.ModelAdded(spec=spec))

    def steady() -> Iterator[tuple[str, NewEvent]]:
        keys = 0
        revoked = 0
        replicas = 0
        pending: list[tuple[str, str]] = []
        running: collections.deque[tuple[str, str]] = collections.deque()
        i = 0
        while True:
            slot = i % 20
            i += 1
            if slot < 3:
                kid = f"key-{keys:07d}"
                yield ev(
                    "key",
                    kid,
                    A.KeyCreated(
                        key_id=kid,
                        prefix=f"sk-{keys:09d}",
                        secret_sha256=f"{keys:064x}",
                        project_id=f"proj-{keys % 97}",
                    ),
                )
                keys += 1
            elif slot == 3:
                kid = f"key-{revoked * 3:07d}"  # every third key made is revoked, oldest first
                revoked += 1
                yield ev("key", kid, A.KeyRevoked(key_id=kid))
            elif pending:
                rid, node = pending.pop()
                running.append((rid, node))
                url = f"http://{node}:{8000 + replicas % 1000}"
                yield ev(R.AGGREGATE, rid, R.ReplicaReady(replica_id=rid, node_id=node, pid=1000, port=8000, url=url))
            elif len(running) > REPLICAS:
                rid, node = running.popleft()
                if replicas % 10 == 0:
                    yield ev(R.AGGREGATE, rid, R.ReplicaFailed(replica_id=rid, node_id=node, reason="exited (1)"))
                else:
                    yield ev(R.AGGREGATE, rid, R.ReplicaStopped(replica_id=rid, node_id=node))
            else:
                rid, node = f"rep-{replicas:08d}", f"node-{replicas % NODES:04d}"
                model = f"model-{replicas % MODELS:03d}"
                replicas += 1
                pending.append((rid, node))
                yield ev(
                    R.AGGREGATE,
                    rid,
                    R.ReplicaPlaced(
                        replica_id=rid,
                        model=model,
                        node_id=node,
                        source=f"/models/{replicas % MODELS}",
                        profile=M.Profile(),
                        spec_hash="h",
                    ),
                )

    produced = 0
    for source in (setup(), steady()):
        for item in source:
            if produced >= n:
                return
            produced += 1
            yield item


async def write_log(store: EventStore, n: int, echo: Echo) -> tuple[float, int]:
    """Append the first ``n`` events of :func:`realistic_log`: (seconds, last sequence)."""
    events = realistic_log(n)
    started = time.perf_counter()
    last = 0
    written = 0
    while written < n:
        chunk = [e for _, e in zip(range(CHUNK), events, strict=False)]
        if not chunk:
            break
        last = await store.append_many(chunk)
        written += len(chunk)
        if written % 200_000 < CHUNK:
            echo(f"  {written:,} events written")
    return time.perf_counter() - started, last


# -- the starts -----------------------------------------------------------------------------------


def router_fold() -> tuple[RS.RouterState, Any]:
    state = RS.RouterState()
    return state, state


def scheduler_fold(state: SS.ClusterState | None = None) -> tuple[SS.ClusterState, Any]:
    state = state if state is not None else SS.ClusterState()

    def apply(e: Any) -> None:
        if e.subject.split(".")[2] in FOLDED:
            state.apply(e)

    return state, apply


async def fold_until_caught_up(store: EventStore, name: str, fold: Any, after: int) -> tuple[float, int]:
    """A Follower of the whole log from ``after`` until caught up: (seconds, events read)."""
    started = time.perf_counter()
    lf = Follower(store, f"{S.EVENTS_ROOT}.>", fold, name=f"bench-{name}", after=after)
    lf.start()
    try:
        if not await lf.wait_caught_up(TIMEOUT_S):
            raise BenchError(f"the {name} fold did not catch up within {TIMEOUT_S:.0f} s")
        return time.perf_counter() - started, lf.position - after
    finally:
        await lf.close()


class Start(msgspec.Struct, kw_only=True):
    service: str
    from_zero_s: float
    from_snapshot_s: float
    snapshot_load_s: float  # of from_snapshot_s: reading and decoding the snapshot
    from_snapshot_cpu_s: float  # the CPU this process spent on it (all threads): what other load does not stretch
    tail_events: int
    encode_s: float  # the pause on the running service while it encodes its state
    save_s: float  # compressing it (in a thread) and writing it to the object store: off the fold's path
    read_s: float  # reading the stored snapshot as a start does (a direct get per chunk)…
    nats_get_s: float  # …and with nats-py's ObjectStore.get instead, for comparison
    state_bytes: int  # the state as encoded
    snapshot_bytes: int  # as stored: compressed
    state_size: str


class Result(msgspec.Struct, kw_only=True):
    events: int
    write_s: float
    starts: list[Start]


async def measure(store: EventStore, snapshots: SnapshotStore, n: int, echo: Echo) -> Result:
    await store.ensure_streams(events_spec())
    echo(f"writing {n:,} events…")
    write_s, head = await write_log(store, n, echo)
    at = max(0, head - TAIL)
    starts: list[Start] = []
    for name, make, version, decode in (
        ("router", router_fold, RS.SNAPSHOT_VERSION, RS.RouterState.decode),
        ("scheduler", scheduler_fold, SS.SNAPSHOT_VERSION, SS.ClusterState.decode),
    ):
        echo(f"{name}: folding {head:,} events from 0…")
        state, fold = make()
        from_zero_s, _ = await fold_until_caught_up(store, name, fold, 0)
        # The state a running service holds TAIL events before the head: folded up to there.
        echo(f"{name}: the snapshot {TAIL:,} events before the head…")
        state, fold = make()
        apply = fold.apply if hasattr(fold, "apply") else fold
        async for batch in store.subscribe(f"{S.EVENTS_ROOT}.>", after=0, follow=False, until=at):
            for e in batch:
                if isinstance(e, RecordedEvent) and e.seq <= at:
                    apply(e)
        state.position = at
        if isinstance(state, SS.ClusterState):
            # This log was written in seconds; a real one of this length spans weeks, over which the
            # scheduler has forgotten every replica that stopped or failed more than an hour after it
            # was placed. Forget them here too, so the snapshot is the one a long-running service saves.
            state.forget_inactive(keep_s=0.0, now_epoch=time.time())
        t = time.perf_counter()
        data = state.encode()
        encode_s = time.perf_counter() - t
        t = time.perf_counter()
        size = await snapshots.save(name, version, at, data)
        save_s = time.perf_counter() - t
        read_s, nats_get_s = await _read_both(snapshots, name)
        echo(f"{name}: starting from the snapshot…")
        t, cpu = time.perf_counter(), time.process_time()
        restored = await snapshots.restore(name, version, decode)
        load_s = time.perf_counter() - t
        if restored is None:
            raise BenchError(f"the {name} snapshot just saved could not be restored")
        fold = restored.state if name == "router" else scheduler_fold(restored.state)[1]
        tail_s, tail = await fold_until_caught_up(store, name, fold, restored.position)
        cpu_s = time.process_time() - cpu
        starts.append(
            Start(
                service=name,
                from_zero_s=from_zero_s,
                from_snapshot_s=load_s + tail_s,
                snapshot_load_s=load_s,
                from_snapshot_cpu_s=cpu_s,
                tail_events=tail,
                encode_s=encode_s,
                save_s=save_s,
                read_s=read_s,
                nats_get_s=nats_get_s,
                state_bytes=len(data),
                snapshot_bytes=size,
                state_size=_size_of(state),
            )
        )
    return Result(events=head, write_s=write_s, starts=starts)


async def _read_both(snapshots: SnapshotStore, name: str) -> tuple[float, float]:
    """Seconds to read the stored snapshot by direct gets (as a start does) and by nats-py's get."""
    t = time.perf_counter()
    await snapshots.read(name)
    read_s = time.perf_counter() - t
    t = time.perf_counter()
    await snapshots.objects.get(name, writeinto=io.BytesIO())  # type: ignore[arg-type]
    return read_s, time.perf_counter() - t


def _size_of(state: Any) -> str:
    if isinstance(state, RS.RouterState):
        live = sum(1 for k in state.access.keys.values() if not k.revoked)
        keys = f"{len(state.access.keys):,} keys ({live:,} live)"
        return f"{keys}, {len(state.models)} models, {len(state.replicas):,} replicas"
    return f"{len(state.nodes):,} nodes, {len(state.models)} models, {len(state.replicas):,} replicas"


async def run_coldstart(opts: ColdstartOptions, echo: Echo) -> list[Result]:
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-coldstart-", dir=opts.base_dir) as tmp:
        for n in opts.events:
            with nats_server(Path(tmp) / f"n{n}", durable=True) as server:
                try:
                    store = await EventStore.connect(server.url, default_registry())
                except (OSError, nats.errors.Error) as exc:
                    raise BenchError(f"cannot connect to the bench's nats-server at {server.url}: {exc}") from exc
                try:
                    snapshots = await SnapshotStore.open(store.js, replicas=1)
                    results.append(await measure(store, snapshots, n, echo))
                finally:
                    with contextlib.suppress(Exception):
                        await store.close()
    return results


def coldstart_json(results: list[Result]) -> dict[str, Any]:
    return {"machine": f"{platform.machine()} {platform.processor()}".strip(), "runs": msgspec.to_builtins(results)}


def coldstart_text(results: list[Result]) -> str:
    lines = [
        "cold start: from 0 vs from a snapshot + its tail (same log, same run)",
        f"{'events':>10} {'service':<10} {'from 0':>9} {'snapshot':>9} {'ratio':>7} {'cpu':>7} {'load':>7} "
        f"{'read':>7} {'get':>7} "
        f"{'tail':>7} {'encode':>8} {'save':>7} {'encoded':>11} {'stored':>11}  state",
    ]
    for r in results:
        for s in r.starts:
            lines.append(
                f"{r.events:>10,} {s.service:<10} {s.from_zero_s:>8.2f}s {s.from_snapshot_s:>8.2f}s "
                f"{s.from_zero_s / max(s.from_snapshot_s, 1e-9):>6.1f}x {s.from_snapshot_cpu_s:>6.2f}s "
                f"{s.snapshot_load_s:>6.2f}s {s.read_s:>6.3f}s {s.nats_get_s:>6.3f}s {s.tail_events:>7,} "
                f"{s.encode_s * 1000:>6.0f}ms {s.save_s:>6.2f}s {s.state_bytes:>11,} {s.snapshot_bytes:>11,}  "
                f"{s.state_size}"
            )
        lines.append(f"{'':>10} (writing the log took {r.write_s:.1f} s)")
    return "\n".join(lines)


def run(opts: ColdstartOptions, echo: Echo) -> list[Result]:
    return asyncio.run(run_coldstart(opts, echo))
