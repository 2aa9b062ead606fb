"""Gateway overhead: the gateway's latency minus the same request sent straight to the engine.

    .venv/bin/python -m tests.bench.gateway [--quick] [--no-paced] [--no-real] [--json FILE]
                                            [--keep-logs DIR] [--py-spy DIR]
    .venv/bin/python -m tests.bench.gateway --ab-queue [--ab-same] [--quick]

Starts, each as its own process: a durable nats-server (``sync_interval: always``, as llmgw runs);
simulated engines (:mod:`tests.bench.simengine`): *sim* answers 16 tokens at once (no latency, to
isolate the gateway), *paced* takes 5-15 ms to the first token then 1,000 tokens/s (so the machine
is not saturated); one router (this module with ``--router-process``: ``serve()`` with only the
``router`` service, as ``llmgw server --services router`` runs it, logging JSON access lines to a
file like the CLI, plus a ``gc.callbacks`` hook that times every collection); and last the real
engine, the tiny GGUF under llama.cpp (``llamacpp_launch``). Each engine becomes a ready replica
by the events the catalog and an agent would append (``ModelAdded``, ``ReplicaPlaced``,
``ReplicaReady``, its key derived from the cluster secret), next to a tenant and an API key.

This process is the load generator: an aiohttp client with a connection pool keeping ``c``
requests in flight (closed loop). For each engine, concurrency (1, 16, 64; 1 and 16 for llama.cpp)
and streaming or not, it sends the same chat request (two messages, ``max_tokens`` 16) straight to
the engine and through the gateway, in two rounds (direct then gateway, gateway then direct), after
a warm-up, and reports per percentile the gateway minus the direct figure (*added*; p50 and p99),
the time to first byte added when streaming, requests/s through the gateway, the router's CPU time
per request (``/proc/PID/task/*/schedstat`` before and after its rounds, read once every usage
record is in the log, so publishing them is counted), the nats-server's, and the router's longest GC pause (the
collector's CPU time / wall-clock time, which includes being preempted). LiteLLM's figures from the
issue are printed beside as ratios. Figures only: nothing passes or fails (ARCHITECTURE §10).

``--ab-queue`` measures what the admission queue costs when nothing waits: two routers side by side on
the same log and the same simulated engine (which has a slot for every request, so nothing ever
waits), one with the queue and one without (``RouterConfig.queue``), sent the same requests in
alternating rounds (A B, B A, ...); it prints each one's latency and CPU per request and the
difference. ``--ab-same`` runs both with the queue: what it prints is the machine's noise floor.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from llmgw.events.runtime.secrets import engine_key, engine_key_secret
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema import access as A
from llmgw.events.schema import models as M
from llmgw.events.schema import replicas as R
from llmgw.events.schema import subjects as S
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.subjects import event_subject
from tests.support import NatsServer, free_port

CLK_TCK = os.sysconf("SC_CLK_TCK")
MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. Answer briefly and plainly."},
    {"role": "user", "content": "Why is the sky blue? Explain it in two sentences for a ten-year-old."},
]
MAX_TOKENS = 16
# llama.cpp's server (xllamacpp) closes a connection after each streamed answer without saying so:
# the next request on it fails before its first byte and goes again on a fresh one.
ATTEMPTS = 10
PACED_TTFT_MS, PACED_TOKENS_PER_S, PACED_JITTER = 10.0, 1000.0, 0.5
# LiteLLM 1.108.7's proxy (one worker, no database) against a fast fake upstream, on this machine:
# added p50/p99 ms by concurrency, requests/s, CPU ms per request (from the issue).
LITELLM = {
    "added_ms": {1: (8.0, None), 16: (124.0, 475.0), 64: (456.0, 843.0)},
    "rps": {False: 120.0, True: 45.0},
    "cpu_ms": {False: 8.0, True: 22.0},
}


# -- the router process ----------------------------------------------------------------------------


class GcWatch:
    """Every collection's pause, by generation, via ``gc.callbacks``; written out on SIGUSR1."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._t0 = self._c0 = 0.0
        self.reset()

    def reset(self) -> None:
        self.count = [0, 0, 0]
        self.max_ms = [0.0, 0.0, 0.0]  # wall clock: what a request waits, the OS's preemption included
        self.max_cpu_ms = [0.0, 0.0, 0.0]  # the collector's own work
        self.total_ms = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0, self._c0 = time.perf_counter(), time.thread_time()
            return
        ms = (time.perf_counter() - self._t0) * 1000
        cpu_ms = (time.thread_time() - self._c0) * 1000
        gen = info["generation"]
        self.count[gen] += 1
        self.total_ms += ms
        self.max_ms[gen] = max(self.max_ms[gen], ms)
        self.max_cpu_ms[gen] = max(self.max_cpu_ms[gen], cpu_ms)

    def dump(self) -> None:
        data = {
            "count": self.count,
            "max_ms": self.max_ms,
            "max_cpu_ms": self.max_cpu_ms,
            "total_ms": self.total_ms,
            "frozen": gc.get_freeze_count(),
            "tracked": len(gc.get_objects()),
        }
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data))
        tmp.rename(self.path)
        self.reset()


def router_process(nats_url: str, db: str, port: int, admin_port: int, gc_file: Path, queue: bool = True) -> None:
    """One router, as `llmgw server --services router` runs it, with a GC pause recorder."""
    from llmgw.cli import logs
    from llmgw.cli.runtime import serve
    from llmgw.cli.server_config import ServerConfig
    from llmgw.services.router.config import RouterConfig

    logs.configure("info")
    watch = GcWatch(gc_file)
    gc.callbacks.append(watch)
    config = ServerConfig(
        nats_url=nats_url,
        db_dsn=db,
        services=("router",),
        port=port,
        admin_port=admin_port,
        router=RouterConfig(queue=queue),
    )

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGUSR1, watch.dump)
        await serve(config, stop)

    asyncio.run(go())


# -- measuring -------------------------------------------------------------------------------------


class Run(msgspec.Struct, kw_only=True):
    """One target's requests in one cell: seconds per request, to the last byte and to the first."""

    latency: list[float] = []
    ttft: list[float] = []
    wall_s: float = 0.0
    errors: int = 0
    retries: int = 0
    first_error: str = ""

    @property
    def n(self) -> int:
        return len(self.latency)


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile, in milliseconds."""
    if not values:
        return math.nan
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))] * 1000


class Target(msgspec.Struct, frozen=True, kw_only=True):
    url: str
    headers: dict[str, str]
    model: str
    pid: int = 0  # the engine's process (0: the gateway)


def _body(model: str, stream: bool) -> bytes:
    body: dict[str, Any] = {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return msgspec.json.encode(body)


async def one(session: aiohttp.ClientSession, target: Target, payload: bytes, stream: bool, run: Run) -> bool:
    """One request, retried on a fresh connection when a pooled one the server had closed fails (as
    the router does); the latency counts from the first attempt."""
    url = target.url + "/v1/chat/completions"
    t0 = time.perf_counter()
    for attempt in range(ATTEMPTS):
        first = 0.0
        try:
            async with session.post(url, data=payload, headers=target.headers) as resp:
                if stream:
                    data = b""
                    async for chunk in resp.content.iter_any():
                        if not first:
                            first = time.perf_counter()
                        data = (data + chunk)[-300:]
                    ok = resp.status == 200 and b"[DONE]" in data
                else:
                    data = await resp.read()
                    ok = resp.status == 200 and b'"usage"' in data
            break
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            if first or attempt == ATTEMPTS - 1:
                run.errors += 1
                run.first_error = run.first_error or repr(exc)
                return False
            run.retries += 1
    end = time.perf_counter()
    if not ok:
        run.errors += 1
        run.first_error = run.first_error or f"HTTP {resp.status}: {data[:300]!r}"
        return False
    run.latency.append(end - t0)
    if stream:
        run.ttft.append(first - t0)
    return True


async def load(session: aiohttp.ClientSession, target: Target, stream: bool, concurrency: int, n: int) -> Run:
    """``n`` requests, ``concurrency`` in flight at all times."""
    run = Run()
    payload = _body(target.model, stream)
    tickets = itertools.count()

    async def worker() -> None:
        while next(tickets) < n:
            await one(session, target, payload, stream, run)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.wall_s = time.perf_counter() - t0
    return run


def cpu_s(pid: int) -> float:
    """CPU seconds a process's threads have run so far: the scheduler's own count, to the nanosecond
    (``/proc/PID/task/*/schedstat``); user + system time from ``/proc/PID/stat`` (10 ms ticks) where a
    kernel keeps no schedstat."""
    try:
        total = 0
        for task in Path(f"/proc/{pid}/task").iterdir():
            with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
                total += int((task / "schedstat").read_text().split()[0])
        return total / 1e9
    except FileNotFoundError:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Cell(msgspec.Struct, kw_only=True):
    engine: str
    concurrency: int
    stream: bool
    direct: Run
    gateway: Run
    router_cpu_s: float
    nats_cpu_s: float
    cpu_s: dict[str, float]  # "direct.loadgen", "gateway.engine", ...: CPU seconds over the measured rounds
    gc: dict[str, Any]

    def summary(self) -> dict[str, Any]:
        d, g = self.direct, self.gateway
        out: dict[str, Any] = {
            "engine": self.engine,
            "concurrency": self.concurrency,
            "stream": self.stream,
            "n": g.n,
            "direct_p50_ms": pct(d.latency, 0.5),
            "direct_p99_ms": pct(d.latency, 0.99),
            "gateway_p50_ms": pct(g.latency, 0.5),
            "gateway_p99_ms": pct(g.latency, 0.99),
            "direct_rps": d.n / d.wall_s if d.wall_s else math.nan,
            "gateway_rps": g.n / g.wall_s if g.wall_s else math.nan,
            "router_cpu_ms": 1000 * self.router_cpu_s / max(g.n, 1),
            "nats_cpu_ms": 1000 * self.nats_cpu_s / max(g.n, 1),
            "cpu_ms_per_request": {
                k: 1000 * v / max((d if k.startswith("direct") else g).n, 1) for k, v in self.cpu_s.items()
            },
            "direct_errors": d.errors,
            "gateway_errors": g.errors,
            "first_error": d.first_error or g.first_error,
            "retries": d.retries + g.retries,
            "gc_max_ms": max(self.gc.get("max_ms", [0.0])),
            "gc_counts": self.gc.get("count", []),
            "gc_max_ms_by_gen": self.gc.get("max_ms", []),
            "gc_max_cpu_ms": max(self.gc.get("max_cpu_ms", [0.0])),
            "gc_max_cpu_ms_by_gen": self.gc.get("max_cpu_ms", []),
            "gc_tracked": self.gc.get("tracked"),
            "gc_frozen": self.gc.get("frozen"),
        }
        out["added_p50_ms"] = out["gateway_p50_ms"] - out["direct_p50_ms"]
        out["added_p99_ms"] = out["gateway_p99_ms"] - out["direct_p99_ms"]
        if self.stream:
            out["ttft_direct_p50_ms"] = pct(d.ttft, 0.5)
            out["ttft_gateway_p50_ms"] = pct(g.ttft, 0.5)
            out["ttft_added_p50_ms"] = out["ttft_gateway_p50_ms"] - out["ttft_direct_p50_ms"]
            out["ttft_added_p99_ms"] = pct(g.ttft, 0.99) - pct(d.ttft, 0.99)
        return out


# -- the bench -------------------------------------------------------------------------------------


class Bench:
    def __init__(self, base: Path, args: argparse.Namespace) -> None:
        self.base = base
        self.args = args
        self.procs: list[subprocess.Popen] = []
        self.gateway_sent = 0  # authenticated gateway requests: each leaves one usage record
        self.nats: NatsServer | None = None
        self.store: EventStore | None = None
        self.router: subprocess.Popen | None = None
        self.router_port = free_port()
        self.gc_file = base / "router-gc.json"
        self.api_key = ""
        self.secret = b""

    # processes

    def spawn(self, argv: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.base / log, "wb") as out:
            root = Path(__file__).parents[2]
            proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=root, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if self.nats:
            self.nats.stop()

    async def wait_http(self, url: str, headers: dict[str, str] | None = None, deadline_s: float = 60.0) -> None:
        end = time.monotonic() + deadline_s
        last = ""
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < end:
                with contextlib.suppress(aiohttp.ClientError, OSError):
                    async with s.get(url, headers=headers or {}) as resp:
                        if resp.status == 200:
                            return
                        last = f"HTTP {resp.status} {(await resp.text())[:200]}"
                for p in self.procs:
                    if p.poll() is not None:
                        raise RuntimeError(f"{p.args[:4]} exited with {p.returncode}; logs in {self.base}")
                await asyncio.sleep(0.05)
        raise TimeoutError(f"{url} not ready after {deadline_s}s ({last})")

    # the log

    async def setup(self) -> None:
        self.nats = NatsServer(self.base / "js").start()
        self.store = await EventStore.connect(self.nats.url, default_registry())
        await self.store.ensure_streams()
        self.secret = await engine_key_secret(self.store.js)
        project = await self._tenant()
        self.api_key = await self._key(project)

    async def _append(self, aggregate: str, agg_id: str, payloads: list[msgspec.Struct]) -> None:
        assert self.store is not None
        await self.store.append(
            event_subject(aggregate, agg_id), [NewEvent(payload=p, actor="user:bench") for p in payloads]
        )

    async def _tenant(self) -> str:
        await self._append(
            T.AGGREGATE,
            T.TREE_ID,
            [
                T.OrgCreated(org_id="o-bench", name="bench"),
                T.TeamCreated(team_id="t-bench", org_id="o-bench", name="perf"),
                T.ProjectCreated(project_id="p-bench", team_id="t-bench", name="gateway"),
            ],
        )
        return "p-bench"

    async def _key(self, project: str) -> str:
        key, prefix, digest = A.make_api_key()
        key_id = f"key_{prefix}"
        created = A.KeyCreated(key_id=key_id, prefix=prefix, secret_sha256=digest, project_id=project, name="bench")
        await self._append(A.KEY_AGGREGATE, key_id, [created])
        return key

    async def add_replica(self, model: str, replica_id: str, url: str, port: int, pid: int, parallel: int) -> None:
        """What the catalog and an agent would write: the model, then its replica placed and ready.
        ``parallel``: the requests the engine serves at once (more wait in the gateway's queue)."""
        profile = M.Profile(engine="llamacpp", ctx_size=1024, parallel=parallel)
        spec = M.ModelSpec(name=model, source=f"bench:{model}", scaling=M.Scaling(min=1), profiles=[profile])
        await self._append(M.AGGREGATE, model, [M.ModelAdded(spec=spec)])
        placed = R.ReplicaPlaced(
            replica_id=replica_id, model=model, node_id="bench-node", source=spec.source, profile=profile, spec_hash=""
        )
        ready = R.ReplicaReady(replica_id=replica_id, node_id="bench-node", pid=pid, port=port, url=url)
        await self._append(R.AGGREGATE, replica_id, [placed, ready])

    def engine_key(self, replica_id: str) -> str:
        return engine_key(self.secret, replica_id)

    # the parts

    async def start_sim(self, model: str, ttft_ms: float, tokens_per_s: float, jitter: float = 0.0) -> Target:
        port, rid = free_port(), f"r-{model}-1"
        key = self.engine_key(rid)
        argv = [sys.executable, "-m", "tests.bench.simengine", "--port", str(port), "--key", key, "--model", model]
        argv += ["--ttft-ms", str(ttft_ms), "--tokens", str(MAX_TOKENS), "--tokens-per-s", str(tokens_per_s)]
        argv += ["--jitter", str(jitter)]
        proc = self.spawn(argv, f"{model}.log")
        url = f"http://127.0.0.1:{port}"
        await self.wait_http(url + "/health")
        # The simulated engine answers any number of requests at once: a slot for each, so the gateway's
        # queue never holds one back and what is measured is the gateway's own path.
        await self.add_replica(model, rid, url, port, proc.pid, parallel=256)
        return Target(url=url, headers=_headers(key), model=model, pid=proc.pid)

    async def start_real(self) -> Target:
        from llmgw.agent.engines.commands import llamacpp_launch
        from tests.gguf_tiny import write_tiny_gguf

        port, rid = free_port(), "r-tiny-1"
        key = self.engine_key(rid)
        tiny = write_tiny_gguf(self.base / "tiny.gguf")
        launch = llamacpp_launch(
            str(tiny),
            host="127.0.0.1",
            port=port,
            threads=1,
            parallel=16,  # a slot for each of 16 requests: the engine's own queue would hide the gateway
            ctx_size=4096,  # 256 tokens a slot: the prompt is 135, the answer 16
            key=key,
            alias="tiny",
            llama_server_binary=None,
            python=sys.executable,
        )
        proc = self.spawn(launch.argv, "engine.log", env={**os.environ, **launch.env})
        url = f"http://127.0.0.1:{port}"
        await self.wait_http(url + "/health")
        await self.add_replica("tiny", rid, url, port, proc.pid, parallel=16)
        return Target(url=url, headers=_headers(key), model="tiny", pid=proc.pid)

    async def start_router(self) -> None:
        self.router = await self.spawn_router(self.router_port, "router")

    async def spawn_router(self, port: int, name: str, queue: bool = True) -> subprocess.Popen:
        assert self.nats is not None
        argv = [sys.executable, "-m", "tests.bench.gateway", "--router-process", "--nats", self.nats.url]
        argv += ["--db", f"sqlite:///{self.base / (name + '.db')}", "--port", str(port)]
        argv += ["--admin-port", str(free_port()), "--gc-file", str(self.base / f"{name}-gc.json")]
        if not queue:
            argv.append("--no-queue")
        proc = self.spawn(argv, f"{name}.log")
        await self.wait_http(f"http://127.0.0.1:{port}/healthz")
        return proc

    def gateway(self, model: str) -> Target:
        return Target(url=f"http://127.0.0.1:{self.router_port}", headers=_headers(self.api_key), model=model)

    async def gateway_serves(self, target: Target) -> None:
        """Until the router has read the replica's events and answers for the model."""
        end = time.monotonic() + 30
        async with aiohttp.ClientSession() as s:
            while True:
                self.gateway_sent += 1
                async with s.post(
                    target.url + "/v1/chat/completions", data=_body(target.model, False), headers=target.headers
                ) as resp:
                    if resp.status == 200:
                        return
                    text = await resp.text()
                if time.monotonic() > end:
                    raise TimeoutError(f"the gateway does not serve {target.model}: {text[:300]}")
                await asyncio.sleep(0.05)

    async def usage_settled(self) -> None:
        """Until every gateway request so far has its usage record in the log (its CPU is spent)."""
        assert self.store is not None
        seen, since = -1, time.monotonic()
        while True:
            got = (await self.store.js.stream_info(S.STREAM_USAGE)).state.messages
            if got >= self.gateway_sent:
                return
            if got != seen:
                seen, since = got, time.monotonic()
            elif time.monotonic() - since > 5:
                print(f"  note: {got} usage records for {self.gateway_sent} gateway requests", file=sys.stderr)
                self.gateway_sent = got
                return
            await asyncio.sleep(0.02)

    async def router_idle_cpu(self, seconds: float = 2.0) -> float:
        """The router's CPU milliseconds per second with nothing to serve (its timers, NATS pings)."""
        assert self.router is not None
        c0 = cpu_s(self.router.pid)
        await asyncio.sleep(seconds)
        return 1000 * (cpu_s(self.router.pid) - c0) / seconds

    async def router_gc(self) -> dict[str, Any]:
        """The router's GC pauses since the last call."""
        assert self.router is not None
        self.gc_file.unlink(missing_ok=True)
        self.router.send_signal(signal.SIGUSR1)
        end = time.monotonic() + 10
        while not self.gc_file.exists():
            if time.monotonic() > end:
                return {}
            await asyncio.sleep(0.01)
        return json.loads(self.gc_file.read_text())

    async def cell(self, engine: str, direct: Target, gateway: Target, concurrency: int, stream: bool, n: int) -> Cell:
        """``n`` requests each way, in two alternating rounds (direct first, then gateway first)."""
        assert self.router is not None and self.nats is not None and self.nats.proc is not None
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
            warm = max(2 * concurrency, 50)
            await load(session, direct, stream, concurrency, warm)
            await load(session, gateway, stream, concurrency, warm)
            self.gateway_sent += warm
            await self.usage_settled()
            await self.router_gc()
            d, g = Run(), Run()
            router_cpu = nats_cpu = 0.0
            spent: dict[str, float] = {}
            for order in ((d, g), (g, d)):
                for run in order:
                    side = "direct" if run is d else "gateway"
                    l0, e0 = time.process_time(), cpu_s(direct.pid)
                    if run is d:
                        part = await load(session, direct, stream, concurrency, n // 2)
                    else:
                        r0, n0 = cpu_s(self.router.pid), cpu_s(self.nats.proc.pid)
                        part = await load(session, gateway, stream, concurrency, n // 2)
                    spent[f"{side}.loadgen"] = spent.get(f"{side}.loadgen", 0.0) + time.process_time() - l0
                    spent[f"{side}.engine"] = spent.get(f"{side}.engine", 0.0) + cpu_s(direct.pid) - e0
                    if run is g:
                        self.gateway_sent += n // 2
                        await self.usage_settled()
                        router_cpu += cpu_s(self.router.pid) - r0
                        nats_cpu += cpu_s(self.nats.proc.pid) - n0
                    run.latency += part.latency
                    run.ttft += part.ttft
                    run.wall_s += part.wall_s
                    run.errors += part.errors
                    run.retries += part.retries
                    run.first_error = run.first_error or part.first_error
            gcs = await self.router_gc()
        return Cell(
            engine=engine,
            concurrency=concurrency,
            stream=stream,
            direct=d,
            gateway=g,
            router_cpu_s=router_cpu,
            nats_cpu_s=nats_cpu,
            cpu_s={**spent, "gateway.router": router_cpu, "gateway.nats": nats_cpu},
            gc=gcs,
        )


class Side(msgspec.Struct, kw_only=True):
    """One router's requests in an A/B cell, and the CPU it spent on them (in all, and per request in each round)."""

    run: Run = msgspec.field(default_factory=Run)
    cpu_s: float = 0.0
    cpu_us_by_round: list[float] = []


AB_ROUNDS = 8  # alternating A B, B A, ...: a machine's load that drifts falls on both sides alike


async def ab_cell(b: Bench, routers: dict[str, tuple[subprocess.Popen, Target]], c: int, stream: bool, n: int) -> dict:
    """``n`` requests through each router, in alternating rounds (A B, B A, ...), after a warm-up."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    sides = {name: Side() for name in routers}
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
        for _, target in routers.values():
            await load(session, target, stream, c, max(2 * c, 50))
            b.gateway_sent += max(2 * c, 50)
        await b.usage_settled()
        names = list(routers)
        per_round = n // AB_ROUNDS
        for round_ in range(AB_ROUNDS):
            for name in names if round_ % 2 == 0 else names[::-1]:
                proc, target = routers[name]
                c0 = cpu_s(proc.pid)
                part = await load(session, target, stream, c, per_round)
                b.gateway_sent += per_round
                await b.usage_settled()  # publishing the usage records is part of each request's cost
                side = sides[name]
                spent = cpu_s(proc.pid) - c0
                side.cpu_s += spent
                side.cpu_us_by_round.append(1e6 * spent / max(part.n, 1))
                side.run.latency += part.latency
                side.run.errors += part.errors
    out: dict[str, Any] = {"concurrency": c, "stream": stream}
    for name, side in sides.items():
        out[f"{name}_p50_ms"] = pct(side.run.latency, 0.5)
        out[f"{name}_p99_ms"] = pct(side.run.latency, 0.99)
        out[f"{name}_cpu_us"] = 1e6 * side.cpu_s / max(side.run.n, 1)
        out[f"{name}_errors"] = side.run.errors
    a, b_ = (sides[name].cpu_us_by_round for name in names)
    diffs = sorted(x - y for x, y in zip(a, b_, strict=True))
    out["cpu_us_diff_median"] = diffs[len(diffs) // 2]  # A − B, round by round: the drift between rounds cancels
    return out


def queue_fast_path_us(replicas: int, calls: int = 200_000) -> float:
    """CPU microseconds the queue costs a request when nothing waits — its check (``Gate.passes``: the
    ready replicas' in-flight counts against their slots) and its release — in this process, for a
    model with ``replicas``; CPU time, not wall-clock, so a busy machine's preemption is left out."""
    from llmgw.services.router.app import Router, RouterConfig
    from llmgw.services.router.state import ReplicaInfo

    class _Store:
        js = nc = None

    router = Router(_Store(), RouterConfig())  # type: ignore[arg-type]
    ready = {
        f"r{i}": ReplicaInfo(replica_id=f"r{i}", model="m", node_id="n", state="ready", url="http://x", slots=4)
        for i in range(replicas)
    }
    router.state.ready_by_model["m"] = ready
    router.outstanding.update({rid: 1 for rid in ready})
    passes, released = router.gate.passes, router.gate.released
    best = math.inf
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(calls):
            passes("m")
            released("m")
        best = min(best, time.thread_time() - t0)
    return 1e6 * best / calls


async def bench_ab_queue(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The queue's cost when nothing waits: a router with it and one without, side by side."""
    scale = 0.2 if args.quick else 1.0
    n = {1: int(4000 * scale), 16: int(8000 * scale), 64: int(8000 * scale)}
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-ab-") as tmp:
        b = Bench(Path(tmp), args)
        try:
            await b.setup()
            await b.start_sim("sim", 0, 0)
            routers: dict[str, tuple[subprocess.Popen, Target]] = {}
            # --ab-same: both with the queue, so the differences printed are the machine's noise alone.
            for name, queue in (("queue", True), ("no_queue", bool(args.ab_same))):
                port = free_port()
                proc = await b.spawn_router(port, name, queue=queue)
                target = Target(url=f"http://127.0.0.1:{port}", headers=_headers(b.api_key), model="sim")
                await b.gateway_serves(target)
                routers[name] = (proc, target)
            print(_machine())
            fast = {n: queue_fast_path_us(n) for n in (1, 4, 16)}
            print(
                "the queue's check when nothing waits, in-process: "
                + ", ".join(f"{us:.2f} µs with {n} replica{'s' if n > 1 else ''}" for n, us in fast.items()),
                flush=True,
            )
            print(
                f"{'c':>3} {'stream':<6} {'p50 queue':>9} {'no queue':>9} {'Δ µs':>7} {'p99 queue':>9} "
                f"{'no queue':>9} {'Δ µs':>7} {'CPU µs/req queue':>16} {'no queue':>9} {'Δ µs':>6} "
                f"{'Δ median of rounds':>18} {'err':>5}",
                flush=True,
            )
            for stream in (False, True):
                for c in (1, 16, 64):
                    r = await ab_cell(b, routers, c, stream, n[c])
                    rows.append(r)
                    print(
                        f"{c:>3} {('yes' if stream else 'no'):<6} {r['queue_p50_ms']:9.3f} {r['no_queue_p50_ms']:9.3f} "
                        f"{1000 * (r['queue_p50_ms'] - r['no_queue_p50_ms']):7.0f} {r['queue_p99_ms']:9.3f} "
                        f"{r['no_queue_p99_ms']:9.3f} {1000 * (r['queue_p99_ms'] - r['no_queue_p99_ms']):7.0f} "
                        f"{r['queue_cpu_us']:16.0f} {r['no_queue_cpu_us']:9.0f} "
                        f"{r['queue_cpu_us'] - r['no_queue_cpu_us']:6.0f} {r['cpu_us_diff_median']:18.0f} "
                        f"{r['queue_errors'] + r['no_queue_errors']:>5}",
                        flush=True,
                    )
        finally:
            await close_bench(b, Path(tmp), args.keep_logs)
    return rows


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    scale = 0.2 if args.quick else 1.0
    sim_n = {1: int(2000 * scale), 16: int(6000 * scale), 64: int(8000 * scale)}
    paced_n = {1: int(400 * scale), 16: int(3200 * scale), 64: int(4000 * scale)}
    real_n = {1: int(600 * scale), 16: int(1600 * scale)}
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-gw-") as tmp:
        b = Bench(Path(tmp), args)
        try:
            await b.setup()
            sim = await b.start_sim("sim", 0, 0)
            await b.start_router()
            await b.gateway_serves(b.gateway("sim"))
            print(f"router pid {b.router.pid if b.router else '?'}; logs in {tmp}", file=sys.stderr)
            idle = await b.router_idle_cpu()
            print(f"{_machine()}; the router idle: {idle:.1f} ms of CPU per second")
            print(HEADER, flush=True)
            for stream in (False, True):
                for c in (1, 16, 64):
                    spy = None
                    if args.py_spy and c == 64 and b.router is not None:
                        name = f"router-c{c}-{'stream' if stream else 'whole'}"
                        spy = _py_spy(b.router.pid, Path(args.py_spy) / name)
                    cell = await b.cell("sim", sim, b.gateway("sim"), c, stream, sim_n[c])
                    if spy is not None:
                        spy.send_signal(signal.SIGINT)
                        spy.wait(30)
                    out.append(cell.summary())
                    _print_row(out[-1])
            if not args.no_paced:
                # An engine that takes its time (first token after 5-15 ms, then 1,000 tokens/s): the
                # machine is far from saturated, so what is added is the gateway's own delay.
                paced = await b.start_sim("sim-paced", PACED_TTFT_MS, PACED_TOKENS_PER_S, PACED_JITTER)
                await b.gateway_serves(b.gateway("sim-paced"))
                for stream in (False, True):
                    for c in (1, 16, 64):
                        cell = await b.cell("paced", paced, b.gateway("sim-paced"), c, stream, paced_n[c])
                        out.append(cell.summary())
                        _print_row(out[-1])
            if not args.no_real:
                real = await b.start_real()
                await b.gateway_serves(b.gateway("tiny"))
                for stream in (False, True):
                    for c in (1, 16):
                        cell = await b.cell("llama.cpp", real, b.gateway("tiny"), c, stream, real_n[c])
                        out.append(cell.summary())
                        _print_row(out[-1])
        finally:
            await close_bench(b, Path(tmp), args.keep_logs)
    return out


async def close_bench(b: Bench, tmp: Path, keep_logs: str | None) -> None:
    """Close the bench's store, stop its processes, and keep their logs in ``keep_logs`` when asked."""
    if b.store is not None:
        await b.store.close()
    b.stop_all()
    if keep_logs:
        dest = Path(keep_logs)
        dest.mkdir(parents=True, exist_ok=True)
        for f in tmp.glob("*.log"):
            shutil.copy(f, dest / f.name)


def _py_spy(pid: int, out: Path, rate: int = 200, fmt: str = "speedscope") -> subprocess.Popen:
    """py-spy sampling ``pid`` into ``out`` (+ ``.speedscope.json``, or ``.txt`` for ``raw``, folded
    stacks) until it is sent SIGINT."""
    out.parent.mkdir(parents=True, exist_ok=True)
    spy = str(Path(sys.executable).parent / "py-spy")
    argv = [spy, "record", "--pid", str(pid), "--nonblocking", "--rate", str(rate), "--format", fmt]
    argv += ["--output", str(out.with_suffix(".txt" if fmt == "raw" else f".{fmt}.json"))]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


HEADER = (
    f"{'engine':<9} {'c':>3} {'stream':<6} {'n':>5} {'direct p50':>10} {'p99':>7} {'gateway p50':>11} {'p99':>7} "
    f"{'added p50':>9} {'p99':>7} {'TTFT+ p50':>9} {'p99':>7} {'gw req/s':>8} {'CPU ms/req':>10} {'nats ms':>7} "
    f"{'GC cpu/wall ms':>14} {'err d/g':>7}"
)


def _print_row(r: dict[str, Any]) -> None:
    ttft = f"{r['ttft_added_p50_ms']:9.2f} {r['ttft_added_p99_ms']:7.2f}" if r["stream"] else f"{'':>9} {'':>7}"
    gc_ = f"{r['gc_max_cpu_ms']:.2f}/{r['gc_max_ms']:.2f}"
    err = f"{r['direct_errors']}/{r['gateway_errors']}"
    print(
        f"{r['engine']:<9} {r['concurrency']:>3} {('yes' if r['stream'] else 'no'):<6} {r['n']:>5} "
        f"{r['direct_p50_ms']:10.2f} {r['direct_p99_ms']:7.2f} {r['gateway_p50_ms']:11.2f} "
        f"{r['gateway_p99_ms']:7.2f} {r['added_p50_ms']:9.2f} {r['added_p99_ms']:7.2f} {ttft} "
        f"{r['gateway_rps']:8.0f} {r['router_cpu_ms']:10.3f} {r['nats_cpu_ms']:7.3f} {gc_:>14} {err:>7}",
        flush=True,
    )
    if r["first_error"]:
        print(f"    first error: {r['first_error']}", flush=True)


def _machine() -> str:
    import platform

    load = Path("/proc/loadavg").read_text().split()[:3]
    return (
        f"{os.cpu_count()} CPUs, load average {' '.join(load)}; Python {platform.python_version()}, "
        f"aiohttp {aiohttp.__version__}"
    )


def _print_cpu(rows: list[dict[str, Any]]) -> None:
    print("\nCPU ms per request by process, at c=64 (each way: what the machine spends on one request)")
    for r in rows:
        if r["concurrency"] != 64:
            continue
        c = r["cpu_ms_per_request"]
        direct = c["direct.loadgen"] + c["direct.engine"]
        gateway = sum(v for k, v in c.items() if k.startswith("gateway"))
        kind = "stream" if r["stream"] else "whole "
        print(
            f"  {r['engine']:<6} {kind} direct: loadgen {c['direct.loadgen']:.3f} + engine {c['direct.engine']:.3f} "
            f"= {direct:.3f} | gateway: loadgen {c['gateway.loadgen']:.3f} + engine {c['gateway.engine']:.3f} "
            f"+ router {c['gateway.router']:.3f} + nats {c['gateway.nats']:.3f} = {gateway:.3f}"
        )


def _print_reference(rows: list[dict[str, Any]]) -> None:
    print("\nagainst LiteLLM 1.108.7's proxy (one worker, fake upstream, same machine): llmgw ÷ LiteLLM")
    for r in rows:
        if r["engine"] != "sim":
            continue
        ref = LITELLM["added_ms"][r["concurrency"]]
        parts = [f"c={r['concurrency']:<3} {'stream' if r['stream'] else 'whole ':<6}"]
        if not r["stream"]:
            parts.append(f"added p50 {r['added_p50_ms'] / ref[0]:.3f}")
            if ref[1] is not None:
                parts.append(f"added p99 {r['added_p99_ms'] / ref[1]:.3f}")
        if r["concurrency"] == 64:
            parts.append(f"req/s {r['gateway_rps'] / LITELLM['rps'][r['stream']]:.1f}×")
        parts.append(f"CPU/req {r['router_cpu_ms'] / LITELLM['cpu_ms'][r['stream']]:.3f}")
        print("  " + ", ".join(parts))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.gateway", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a fifth of the requests")
    parser.add_argument("--no-real", action="store_true", help="skip the real llama.cpp engine")
    parser.add_argument("--no-paced", action="store_true", help="skip the paced simulated engine")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--py-spy", help="record py-spy profiles of the router at c=64 into this folder")
    parser.add_argument("--keep-logs", help="copy the processes' logs here at the end")
    parser.add_argument(
        "--ab-queue", action="store_true", help="the admission queue's cost: a router with it and one without"
    )
    # The router process (started by the bench itself).
    parser.add_argument("--router-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--admin-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument(
        "--ab-same", action="store_true", help="with --ab-queue: both routers with the queue (the noise floor)"
    )
    parser.add_argument("--gc-file", help=argparse.SUPPRESS)
    parser.add_argument("--no-queue", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.router_process:
        router_process(args.nats, args.db, args.port, args.admin_port, Path(args.gc_file), queue=not args.no_queue)
        return
    if args.ab_queue:
        rows = asyncio.run(bench_ab_queue(args))
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return
    rows = asyncio.run(bench(args))
    _print_cpu(rows)
    _print_reference(rows)
    print(f"\nafter: {_machine()}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
