"""`llmgw bench console`: how long each console page takes to render on the server, at scale.

Issue 24 asks for every page in ≤ 200 ms at 1,000 nodes / 5,000 replicas / 10,000 keys / 1,000,000
events. This builds that world as `llmgw up` would hold it and times every page against it, next to the
same pages over a small world in the same run (the ratio is what grows with scale):

1. its own nats-server (no flush: the log is built for reading, not to time writes) and a log written
   with ``append_many``: the tenancy tree (1,000 projects under 100 teams under 10 orgs), people with
   roles, nodes (a quarter with GPUs), models with prices, replicas placed and ready, keys (one in ten
   revoked) with limits, budgets for every project — each change a person made carried by a command
   outcome, as the command services write them — then cordons, uncordons and limit changes, each with
   its outcome, up to the number of events asked for; and usage records on ``LLMGW_USAGE`` over the
   last day;
2. the services a console needs, as `llmgw up` runs them (``serve`` with the projections, the admin API
   and the people service; SQLite): the projection runner folds the whole log and the usage stream
   into the read models (the fold is timed and reported, not part of the page figures);
3. a sign-in through ``POST /console/login`` as a cluster admin, then every page of the console (and a
   few filtered views) fetched over HTTP on loopback, ``runs`` times each after one warm-up: the
   median and the 95th percentile of the time from request to the last byte.

With ``keep`` each world (its nats-server's store and its SQLite read models) is kept there, and a later
run of the same scale times the pages on it without building it again (at a million events the build
takes minutes, the timing seconds). Nothing here asserts a time; it prints. The figures depend on the
machine and its load: read the ratio to the small world, and the target column as a guide.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import socket
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from llmgw.bench import BenchError
from llmgw.bench.backbone import nats_server
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import access as A
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import outcomes as O
from llmgw.events.schema import people as P
from llmgw.events.schema import replicas as R
from llmgw.events.schema import subjects as S
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.usage import UsageRecord, usage_subject

ADMIN = "bench-admin"
PASSWORD = "bench console password"  # the bench's own throwaway server, never a real one
SERVICE_ACTOR = "svc:scheduler"
CHUNK = 20_000  # events built and appended at a time
USAGE_IN_FLIGHT = 500  # usage records published before their acknowledgements are awaited
TARGET_MS = 200.0
PAST = " (as it was)"  # a page at a past moment: the name's suffix
PAST_PAGES = ("overview", "nodes", "tenants")
PAST_RUNS = 3
TIMEOUT_S = 3600.0
PROJECTIONS = ("tenancy", "eventlog", "fleet", "access")  # what folds LLMGW_EVENTS; "usage" folds LLMGW_USAGE

Echo = Callable[[str], None]
# Runs the console's services until ``stop`` is set: (nats_url, db_dsn, admin_port, stop, on_ready, handles).
# Given by the CLI (the composition root), so this module needs nothing of it.
Serve = Callable[[str, str, int, asyncio.Event, Callable[[], None], dict[str, Any]], Awaitable[None]]


class Scale(msgspec.Struct, frozen=True, kw_only=True):
    nodes: int
    replicas: int
    keys: int
    events: int  # the log's length at least (the world's own events may make it longer)
    usage: int  # usage records over the last day

    @property
    def models(self) -> int:
        return max(1, self.replicas // 10)

    @property
    def projects(self) -> int:
        return max(2, min(1000, self.keys // 10))

    @property
    def teams(self) -> int:
        return max(1, self.projects // 10)

    @property
    def orgs(self) -> int:
        return max(1, self.teams // 10)

    @property
    def people(self) -> int:
        return max(2, self.keys // 100)


LARGE = Scale(nodes=1000, replicas=5000, keys=10_000, events=1_000_000, usage=100_000)
SMALL = Scale(nodes=10, replicas=50, keys=100, events=2_000, usage=1_000)


class ConsoleOptions(msgspec.Struct, frozen=True, kw_only=True):
    large: Scale = LARGE
    small: Scale = SMALL
    runs: int = 20
    base_dir: str | None = None
    keep: str | None = None  # a directory the built worlds are kept in, and reused from by a later run


class PageFigure(msgspec.Struct, kw_only=True):
    name: str
    path: str
    status: int
    runs: int
    median_ms: float
    p95_ms: float
    bytes: int
    first_ms: float = 0.0  # the warm-up: for a past moment, the one that folds the replay the others reuse


class World(msgspec.Struct, kw_only=True):
    scale: Scale
    events: int  # on the log
    usage: int
    write_s: float
    fold_s: float
    pages: list[PageFigure]


class ConsoleReport(msgspec.Struct, kw_only=True):
    small: World
    large: World
    runs: int
    machine: dict[str, Any]


# -- the world ------------------------------------------------------------------------------------


def _ids(scale: Scale) -> dict[str, list[str]]:
    return {
        "orgs": [f"org-{o:02d}" for o in range(scale.orgs)],
        "teams": [f"team-{t:03d}" for t in range(scale.teams)],
        "projects": [f"proj-{p:04d}" for p in range(scale.projects)],
        "nodes": [f"node-{i:04d}" for i in range(scale.nodes)],
        "models": [f"model-{i:03d}" for i in range(scale.models)],
        "keys": [f"key-{i:06d}" for i in range(scale.keys)],
    }


def world_log(scale: Scale, password_hash: str) -> Iterator[tuple[str, NewEvent]]:
    """The log of a cluster at ``scale``: its state first, then everyday changes up to ``scale.events``."""
    ids = _ids(scale)
    admin = f"user:{ADMIN}"
    count = 0

    def ev(aggregate: str, agg_id: str, payload: msgspec.Struct, actor: str = SERVICE_ACTOR) -> tuple[str, NewEvent]:
        return S.event_subject(aggregate, agg_id), NewEvent(payload=payload, actor=actor)

    def commanded(aggregate: str, agg_id: str, payload: msgspec.Struct, kind: str) -> list[tuple[str, NewEvent]]:
        """A person's change as a command service writes it: the event, then the command's outcome."""
        command = new_id()
        event = NewEvent(payload=payload, actor=admin, causation=command, correlation=command)
        outcome = O.CommandCompleted(kind=kind, requested_by=admin, message=f"{kind} applied", events=[event.id])
        return [
            (S.event_subject(aggregate, agg_id), event),
            (
                S.command_outcome_subject(command),
                NewEvent(payload=outcome, actor=admin, causation=command, correlation=command),
            ),
        ]

    def state() -> Iterator[tuple[str, NewEvent]]:
        yield ev(P.AGGREGATE, ADMIN, P.UserAdded(name=ADMIN), "system:bench")
        yield ev(P.AGGREGATE, ADMIN, P.PasswordSet(name=ADMIN, password_hash=password_hash), "system:bench")
        yield ev(P.AGGREGATE, ADMIN, P.RoleGranted(name=ADMIN, role="cluster-admin", scope="cluster"), "system:bench")
        tree = (T.AGGREGATE, T.TREE_ID)
        for o, org in enumerate(ids["orgs"]):
            yield from commanded(*tree, T.OrgCreated(org_id=org, name=f"o{o}"), "tenancy.create")
        for t, team in enumerate(ids["teams"]):
            org = ids["orgs"][t % scale.orgs]
            yield from commanded(*tree, T.TeamCreated(team_id=team, org_id=org, name=f"t{t}"), "tenancy.create")
        for p, project in enumerate(ids["projects"]):
            team = ids["teams"][p % scale.teams]
            yield from commanded(
                *tree, T.ProjectCreated(project_id=project, team_id=team, name=f"p{p}"), "tenancy.create"
            )
        for i in range(scale.people):
            name = f"person-{i:03d}"
            yield from commanded(P.AGGREGATE, name, P.UserAdded(name=name), "people.user.add")
            role = ("viewer", "member", "team-admin")[i % 3]
            scope = f"team:{ids['teams'][i % scale.teams]}" if role == "team-admin" else "cluster"
            if role == "member":
                scope = f"project:{ids['projects'][i % scale.projects]}"
            yield from commanded(
                P.AGGREGATE, name, P.RoleGranted(name=name, role=role, scope=scope), "people.role.grant"
            )
        for i, node in enumerate(ids["nodes"]):
            gpus = [N.GpuInfo(index=g, name="NVIDIA H100 80GB HBM3", memory_total_mb=81_559) for g in range(8)]
            capacity = N.NodeCapacity(
                address=f"http://10.0.{i // 250}.{i % 250}:9000",
                labels={"zone": f"z{i % 4}"},
                cpus=64,
                memory_total_bytes=512 * 1024**3,
                gpus=gpus if i % 4 == 0 else [],
                engines=["llamacpp", "vllm"] if i % 4 == 0 else ["llamacpp"],
                agent_version="0.1.0",
            )
            yield ev(N.AGGREGATE, node, N.NodeRegistered(node_id=node, capacity=capacity), f"node:{node}")
        per_model = max(1, scale.replicas // scale.models)
        for i, model in enumerate(ids["models"]):
            spec = M.ModelSpec(name=model, source=f"/models/{model}.gguf", scaling=M.Scaling(min=per_model))
            yield from commanded(M.AGGREGATE, model, M.ModelAdded(spec=spec), "catalog.add")
            price = A.PriceSet(model=model, input_usd_per_m=0.1 + i % 7 / 10, output_usd_per_m=0.4 + i % 5 / 10)
            yield from commanded(A.PRICE_AGGREGATE, model, price, "access.price.set")
        for i in range(scale.replicas):
            rid, node, model = f"rep-{i:06d}", ids["nodes"][i % scale.nodes], ids["models"][i % scale.models]
            placed = R.ReplicaPlaced(
                replica_id=rid,
                model=model,
                node_id=node,
                source=f"/models/{model}.gguf",
                profile=M.Profile(),
                spec_hash="h",
                cores=4,
                memory_bytes=8 * 1024**3,
            )
            yield ev(R.AGGREGATE, rid, placed)
            url = f"http://{node}:{8000 + i % 1000}"
            ready = R.ReplicaReady(replica_id=rid, node_id=node, pid=1000 + i, port=8000 + i % 1000, url=url)
            yield ev(R.AGGREGATE, rid, ready, f"node:{node}")
        for i, key in enumerate(ids["keys"]):
            created = A.KeyCreated(
                key_id=key,
                prefix=f"k{i:07d}",
                secret_sha256=f"{i:064x}",
                project_id=ids["projects"][i % scale.projects],
                name=f"service {i}",
            )
            yield from commanded(A.KEY_AGGREGATE, key, created, "access.key.create")
            if i % 10 == 9:
                yield from commanded(
                    A.KEY_AGGREGATE, key, A.KeyRevoked(key_id=key, reason="rotated"), "access.key.revoke"
                )
            elif i % 10 == 0:
                limit = A.LimitSet(scope=f"key:{key}", rpm=60, tpm=100_000)
                yield from commanded(A.LIMIT_AGGREGATE, f"key:{key}", limit, "access.limit.set")
        for team in ids["teams"]:
            limit = A.LimitSet(scope=f"team:{team}", rpm=600, tpm=1_000_000)
            yield from commanded(A.LIMIT_AGGREGATE, f"team:{team}", limit, "access.limit.set")
        for project in ids["projects"]:
            budget = A.BudgetSet(scope=f"project:{project}", usd=100.0, period="month")
            yield from commanded(A.BUDGET_AGGREGATE, f"project:{project}", budget, "access.budget.set")

    def everyday() -> Iterator[tuple[str, NewEvent]]:
        i = 0
        while True:
            node = ids["nodes"][(i // 2) % scale.nodes]
            if i % 3 == 0:
                yield from commanded(
                    N.AGGREGATE, node, N.NodeCordoned(node_id=node, reason="maintenance"), "fleet.cordon"
                )
            elif i % 3 == 1:
                yield from commanded(N.AGGREGATE, node, N.NodeUncordoned(node_id=node), "fleet.uncordon")
            else:
                key = ids["keys"][(i * 7) % scale.keys]
                limit = A.LimitSet(scope=f"key:{key}", rpm=60 + i % 5 * 30, tpm=100_000)
                yield from commanded(A.LIMIT_AGGREGATE, f"key:{key}", limit, "access.limit.set")
            i += 1

    for item in state():
        count += 1
        yield item
    for item in everyday():
        if count >= scale.events:
            return
        count += 1
        yield item


def usage_records(scale: Scale, now: datetime) -> Iterator[UsageRecord]:
    """``scale.usage`` requests over the day before ``now``, spread over keys and models; one in twenty refused."""
    ids = _ids(scale)
    for i in range(scale.usage):
        key = i * 7919 % scale.keys
        project = key % scale.projects
        team = project % scale.teams
        refused = i % 20 == 0
        yield UsageRecord(
            request_id=f"req-{i:08d}",
            at=now - timedelta(seconds=86_400 * (scale.usage - i) / scale.usage),
            status=429 if refused else 200,
            key_id=ids["keys"][key],
            project_id=ids["projects"][project],
            team_id=ids["teams"][team],
            org_id=ids["orgs"][team % scale.orgs],
            model_asked=ids["models"][i % scale.models],
            model_served=None if refused else ids["models"][i % scale.models],
            endpoint="/v1/chat/completions",
            tokens_in=0 if refused else 200 + i % 300,
            tokens_out=0 if refused else 50 + i % 400,
            total_s=0.001 if refused else 0.4 + i % 10 / 10,
            cost_usd=0.0 if refused else 0.0001 * (1 + i % 5),
            error="rate_limited" if refused else None,
            router="bench",
        )


async def write_world(store: EventStore, scale: Scale, echo: Echo) -> tuple[float, int, int]:
    """Append the world's log and publish its usage records: (seconds, events, usage records)."""
    from llmgw.services.people.passwords import hash_password  # argon2: only where a password is set

    started = time.perf_counter()
    log = world_log(scale, hash_password(PASSWORD))
    written = 0
    while True:
        chunk = [item for _, item in zip(range(CHUNK), log, strict=False)]
        if not chunk:
            break
        await store.append_many(chunk)
        written += len(chunk)
        if written % 200_000 < CHUNK:
            echo(f"  {written:,} events written")
    published = 0
    pending: list[asyncio.Future] = []
    for record in usage_records(scale, datetime.now(UTC)):
        data = msgspec.json.encode(record)
        headers = {S.HDR_MSG_ID: record.request_id}
        pending.append(await store.js.publish_async(usage_subject(record.project_id), data, headers=headers))
        if len(pending) >= USAGE_IN_FLIGHT:
            await asyncio.gather(*pending)
            published += len(pending)
            pending = []
    await asyncio.gather(*pending)
    published += len(pending)
    return time.perf_counter() - started, written, published


# -- the pages ------------------------------------------------------------------------------------


def targets(scale: Scale, then: str | None = None) -> list[tuple[str, str]]:
    """(name, path) of every console page, with a node and a model for the detail pages, and filtered views
    that make the database work harder (the audit of one rare type, the usage of every key); with
    ``then`` (an ISO moment), a few pages as they were then (the time slider: a replay of the log)."""
    from llmgw.services.console.pages import PAGES

    ids = _ids(scale)
    params = {"id": ids["nodes"][0], "name": ids["models"][0]}
    found: list[tuple[str, str]] = []
    for page in PAGES:
        path = page.path
        for name, value in params.items():
            path = path.replace("{" + name + "}", value)
        if "{" not in path:
            found.append((page.name, path))
    names = {name for name, _ in found}
    if "audit" in names:
        found += [
            ("audit: one rare type", "/console/audit?type=budget.set"),
            ("audit: every actor", "/console/audit?actor="),
        ]
    if "usage" in names:
        found.append(("usage: by key", "/console/usage?by=key"))
    if then is not None:
        found += [(f"{name}{PAST}", f"{path}?at={then}") for name, path in found if name in PAST_PAGES]
    return found


async def sign_in(session: aiohttp.ClientSession, url: str, deadline_s: float = 60.0) -> None:
    """Sign in as the bench's admin (once the admin API has folded them)."""
    deadline = time.monotonic() + deadline_s
    while True:
        async with session.post(
            f"{url}/console/login",
            data={"user": ADMIN, "password": PASSWORD, "next": "/console"},
            allow_redirects=False,
        ) as r:
            if r.status == 303:
                return
            body = await r.text()
        if time.monotonic() > deadline:
            raise BenchError(f"signing in to the console failed ({r.status}): {body[:300]}")
        await asyncio.sleep(0.2)


async def time_pages(url: str, pages: list[tuple[str, str]], runs: int, echo: Echo) -> list[PageFigure]:
    jar = aiohttp.CookieJar(unsafe=True)  # a cookie for 127.0.0.1
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    figures = []
    async with aiohttp.ClientSession(cookie_jar=jar, timeout=timeout) as session:
        await sign_in(session, url)
        for name, path in pages:
            times, status, size, first = [], 0, 0, 0.0
            # A past moment is a replay of the log each time: seconds, so fewer of them.
            count = min(runs, PAST_RUNS) if name.endswith(PAST) else runs
            for i in range(count + 1):  # the first is a warm-up
                started = time.perf_counter()
                async with session.get(f"{url}{path}", allow_redirects=False) as r:
                    body = await r.read()
                    status, size = r.status, len(body)
                took = (time.perf_counter() - started) * 1000
                if i:
                    times.append(took)
                else:
                    first = took
            p95 = statistics.quantiles(times, n=20)[18] if len(times) >= 2 else times[0]
            figure = PageFigure(
                name=name,
                path=path,
                status=status,
                runs=count,
                median_ms=statistics.median(times),
                p95_ms=p95,
                bytes=size,
                first_ms=first,
            )
            echo(f"  {name:<28} {figure.median_ms:8.1f} ms median  {figure.p95_ms:8.1f} ms p95  ({status})")
            figures.append(figure)
    return figures


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _middle_moment(handles: dict[str, Any], events: int) -> str | None:
    """When the event half-way along the log was written (ISO, UTC, whole seconds): the moment the past
    pages are shown at."""
    rows = await handles["backend"].query(
        "eventlog", "SELECT at FROM {events} WHERE seq >= ? ORDER BY seq LIMIT 1", events // 2
    )
    if not rows:
        return None
    return datetime.fromisoformat(rows[0][0]).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def _folded(handles: dict[str, Any], store: EventStore, echo: Echo) -> None:
    """Wait until every projection has folded the whole log and the usage stream."""
    runner = handles["runner"]
    heads = {name: await store.stream_last_seq() for name in PROJECTIONS}
    heads["usage"] = await store.on_stream(S.STREAM_USAGE).stream_last_seq()
    deadline = time.monotonic() + TIMEOUT_S
    for name, head in heads.items():
        while not await runner.wait_until(name, head, timeout=30.0):
            if time.monotonic() > deadline:
                raise BenchError(f"projection {name} did not fold the log in {TIMEOUT_S:.0f} s")
            echo(f"  folding: {name} at {runner.position(name):,} of {head:,}")


class Built(msgspec.Struct, kw_only=True):
    """What building a world measured, kept beside it (``--keep``) so a later run can reuse it."""

    scale: Scale
    events: int
    usage: int
    write_s: float
    fold_s: float


BUILT = "world.json"


async def measure_world(scale: Scale, serve: Serve, runs: int, base: Path, echo: Echo) -> World:
    """Build the world at ``scale`` in ``base`` (or reuse the one built there before), serve the console
    over it and time every page."""
    built_file = base / BUILT
    built = msgspec.json.decode(built_file.read_bytes(), type=Built) if built_file.exists() else None
    if built is not None and built.scale != scale:
        raise BenchError(f"{base} holds a world of another scale ({built.scale}); give another --keep directory")
    with nats_server(base, durable=False) as server:
        store = await EventStore.connect(server.url, default_registry())
        try:
            await store.ensure_streams()
            if built is None:
                echo(f"writing the log: {scale.nodes:,} nodes, {scale.replicas:,} replicas, {scale.keys:,} keys")
                write_s, events, usage = await write_world(store, scale, echo)
            else:
                echo(f"reusing the world built in {base}")
            stop, ready, handles = asyncio.Event(), asyncio.Event(), {}
            port = _free_port()
            task = asyncio.create_task(
                serve(server.url, f"sqlite:///{base / 'projections.db'}", port, stop, ready.set, handles)
            )
            started_up = asyncio.ensure_future(ready.wait())
            try:
                done, _ = await asyncio.wait({task, started_up}, timeout=120, return_when="FIRST_COMPLETED")
                if task in done or not ready.is_set():
                    why = task.exception() if task.done() else "no answer in 120 s"
                    raise BenchError(f"the console's services did not start: {why}")
                started = time.perf_counter()
                await _folded(handles, store, echo)
                if built is None:
                    fold_s = time.perf_counter() - started
                    built = Built(scale=scale, events=events, usage=usage, write_s=write_s, fold_s=fold_s)
                    built_file.write_bytes(msgspec.json.encode(built))
                echo(f"folded {built.events:,} events and {built.usage:,} usage records; timing the pages")
                then = await _middle_moment(handles, built.events)
                pages = await time_pages(f"http://127.0.0.1:{port}", targets(scale, then), runs, echo)
            finally:
                started_up.cancel()
                stop.set()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task, 60)
        finally:
            await store.close()
    return World(
        scale=scale, events=built.events, usage=built.usage, write_s=built.write_s, fold_s=built.fold_s, pages=pages
    )


async def run_console(opts: ConsoleOptions, serve: Serve, echo: Echo) -> ConsoleReport:
    if opts.runs < 1:
        raise BenchError("--runs must be at least 1")
    with contextlib.ExitStack() as stack:
        if opts.keep:
            root = Path(opts.keep)
            root.mkdir(parents=True, exist_ok=True)
        else:
            root = Path(
                stack.enter_context(tempfile.TemporaryDirectory(prefix="llmgw-bench-console-", dir=opts.base_dir))
            )
        echo("the small world (the baseline)")
        small = await measure_world(opts.small, serve, opts.runs, root / _world_dir(opts.small), echo)
        echo("the large world")
        large = await measure_world(opts.large, serve, opts.runs, root / _world_dir(opts.large), echo)
    machine = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }
    return ConsoleReport(small=small, large=large, runs=opts.runs, machine=machine)


def _world_dir(scale: Scale) -> str:
    return f"world-{scale.nodes}n-{scale.replicas}r-{scale.keys}k-{scale.events}e-{scale.usage}u"


# -- the report -----------------------------------------------------------------------------------


def console_json(report: ConsoleReport) -> dict[str, Any]:
    return msgspec.to_builtins(report)


def _scale_line(world: World) -> str:
    s = world.scale
    return (
        f"{s.nodes:,} nodes, {s.replicas:,} replicas, {s.keys:,} keys, {world.events:,} events, "
        f"{world.usage:,} usage records (log written in {world.write_s:.1f} s, folded in {world.fold_s:.1f} s)"
    )


def console_text(report: ConsoleReport) -> str:
    small = {f.name: f for f in report.small.pages}
    lines = [
        f"small: {_scale_line(report.small)}",
        f"large: {_scale_line(report.large)}",
        f"each page {report.runs} times after a warm-up; ms from request to last byte on loopback",
        "",
        f"{'page':<30}{'small median':>13}{'large median':>13}{'large p95':>11}{'× small':>9}{'large KB':>10}  "
        f"target ≤ {TARGET_MS:.0f} ms (median); a past moment's first fetch folds the replay the next reuse",
    ]
    for f in report.large.pages:
        base = small.get(f.name)
        ratio = f"{f.median_ms / base.median_ms:8.1f}×" if base and base.median_ms > 0 else f"{'-':>9}"
        verdict = "met" if f.median_ms <= TARGET_MS else "MISSED"
        if f.status != 200 or (base is not None and base.status != 200):
            verdict = f"HTTP {f.status}" + (f" (small {base.status})" if base else "")
        lines.append(
            f"{f.name:<30}{(base.median_ms if base else float('nan')):>13.1f}{f.median_ms:>13.1f}{f.p95_ms:>11.1f}"
            f"{ratio}{f.bytes / 1000:>10,.0f}  {verdict}"
            + (f"  (first fetch {f.first_ms:,.0f} ms)" if f.name.endswith(PAST) else "")
        )
    m = report.machine
    lines += ["", f"machine: {m['cpus']} CPUs, load average {m['load_average']}, Python {m['python']}"]
    return "\n".join(lines)
