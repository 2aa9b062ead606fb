"""Mirror and serve over loopback: fetch throughput against a plain HTTP copy, and `serve` to an answer.

    .venv/bin/python -m tests.bench.mirror [--size-mb 256] [--runs 3]

Starts a durable nats-server and a fake hub (tests/fakehub.py) in a child process of its own (so
the hub's CPU does not share this process's event loop and core with the fetchers), serving a file
of ``--size-mb`` random bytes (an LFS file: its sha256 published, redirected to the hub's "CDN"
port), then, in each of ``--runs`` rounds, side by side:

- **sha256 in memory**: ``hashlib.sha256`` over the same number of bytes, in this process, one
  core — the ceiling for any verified fetch on this machine, whatever the network does;
- **plain copy from the hub**: an aiohttp GET (redirect followed) streamed to disk in 1 MiB writes,
  no hashing — the baseline for the mirror;
- **mirror fetch**: a `mirror.fetch` command to a MirrorService in this process (its defaults:
  1 MiB writes), timed from the command to `mirror.fetch_completed` (the published sha256 checked;
  git's blob id is computed only for files the hub publishes no sha256 for), a fresh model name each round;
- **plain copy from the mirror's file server**: the same GET with the mirror token — the baseline
  for the agent;
- **agent fetch**: `WeightsCache.ensure` (agent/weights/cache.py) of that file into an empty cache:
  HEAD for the sha256, GET into ``.partial``, hashed, fsynced, renamed.

Both fetches run the one download of modelfiles/download.py (receive, write and hash overlapped).

The mirror's file server runs in this process with the MirrorService (it is part of the system
under test), so the agent fetch and its baseline read from the same server. Each fetch is printed
with its ratio to its plain copy, the ceiling ratio (sha256 rate / plain copy rate) beside it (a
verified fetch cannot beat the slower of the two), and its rate over the sha256 rate (÷sha).

Then ``ctl model serve`` as tests/test_serve.py stands it up: the mirror and a jobs service in
this process (the jobs service's own defaults, ``source="local"``), a Fleet with catalog, fleet
and scheduler and one agent process; the tiny GGUF of tests/gguf_tiny.py on the hub; ``--runs``
ServeModel commands, each with a fresh model name (so each fetches again), timed from the command
to `job.finished` ok (after its smoke request was answered). Each model is scaled to 0 afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import multiprocessing
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from llmgw.agent.weights.cache import WeightsCache
from llmgw.events.commands.client import CommandClient
from llmgw.events.runtime.secrets import engine_key_secret, mirror_token
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import jobs as J
from llmgw.events.schema import mirror as E
from llmgw.events.schema import models as M
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.subjects import event_subject
from llmgw.services.jobs.service import JobsConfig, JobsService
from llmgw.services.mirror.service import MirrorConfig, MirrorService
from tests.fakehub import FakeHub
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import free_port, nats_server

BIG_REPO = "bench/big"
BIG_FILE = "big.safetensors"
TINY_REPO = "acme/tiny-GGUF"
COPY_CHUNK = 1 << 20
MB = 1_000_000


def _hub_process(size: int, gguf: str, conn: Any) -> None:
    """The fake hub in a child process: sends its URL, serves until told to stop (or the pipe closes)."""

    async def serve() -> None:
        hub = await FakeHub().start()
        hub.add_repo(BIG_REPO)
        hub.add_file(BIG_REPO, BIG_FILE, os.urandom(size), lfs=True)
        hub.add_repo(TINY_REPO)
        hub.add_file(TINY_REPO, "tiny-Q4_K_M.gguf", Path(gguf))
        conn.send(hub.url)
        with contextlib.suppress(EOFError, OSError):
            await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await hub.stop()

    asyncio.run(serve())


@contextlib.contextmanager
def hub_process(size: int, gguf: Path) -> Any:
    """Start :func:`_hub_process`; yields the hub's URL."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_hub_process, args=(size, str(gguf), child), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(120):
            raise RuntimeError("the fake hub did not start")
        yield parent.recv()
    finally:
        with contextlib.suppress(OSError):
            parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()


def sha256_seconds(data: bytes) -> float:
    """Seconds for ``hashlib.sha256`` over ``data`` in memory, one core."""
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    return time.perf_counter() - t0


async def plain_copy(url: str, dest: Path, headers: dict[str, str] | None = None) -> float:
    """Seconds to GET ``url`` (redirects followed) and stream it to ``dest``: no hashing, one fsync."""
    t0 = time.perf_counter()
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with (
        aiohttp.ClientSession(timeout=timeout, auto_decompress=False) as http,
        http.get(url, headers={"Accept-Encoding": "identity", **(headers or {})}) as resp,
    ):
        resp.raise_for_status()
        with dest.open("wb") as f:
            async for chunk in resp.content.iter_chunked(COPY_CHUNK):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - t0


async def mirror_fetch(store: EventStore, model: str) -> tuple[float, E.FetchCompleted]:
    """Seconds from `mirror.fetch` of the big file as ``model`` to its `fetch_completed`, and that event."""
    subject = event_subject(E.AGGREGATE, model)
    after = await store.stream_last_seq()
    t0 = time.perf_counter()
    await CommandClient.for_service(store, "tests").send(
        E.SERVICE, "fetch", E.MirrorFetch(model=model, repo=BIG_REPO), actor="user:bench", timeout=30
    )
    async for batch in store.subscribe(subject, after=after):
        for e in batch:
            if isinstance(e.payload, E.FetchFailed):
                raise RuntimeError(f"the mirror's fetch failed: {e.payload.reason}")
            if isinstance(e.payload, E.FetchCompleted):
                return time.perf_counter() - t0, e.payload
    raise RuntimeError("the log ended before the fetch did")


async def serve_once(store: EventStore, name: str) -> tuple[float, J.JobFinished]:
    """Seconds from the ServeModel command to `job.finished`, and that event."""
    after = await store.stream_last_seq()
    t0 = time.perf_counter()
    out = await CommandClient.for_service(store, "tests").send(
        J.SERVICE,
        "serve",
        J.ServeModel(repo=TINY_REPO, name=name, ctx_pool=1024, cores=1),
        actor="user:bench",
        timeout=20,
    )
    job = out.result["job"]
    async for batch in store.subscribe(event_subject(J.AGGREGATE, job), after=after):
        for e in batch:
            if isinstance(e.payload, J.JobFinished):
                return time.perf_counter() - t0, e.payload
    raise RuntimeError("the log ended before the job did")


async def _timed(step: Callable[[], Awaitable[Any]]) -> float:
    t0 = time.perf_counter()
    await step()
    return time.perf_counter() - t0


async def run(size_mb: int, runs: int) -> dict[str, list[float]]:
    """Every figure, one value per round: seconds for copies and fetches, seconds for serve."""
    size = size_mb * MB
    keys = ("sha256", "hub_copy", "mirror_fetch", "mirror_own", "files_copy", "agent_fetch", "serve")
    out: dict[str, list[float]] = {k: [] for k in keys}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        gguf = write_tiny_gguf(base / "tiny-Q4_K_M.gguf")
        in_memory = os.urandom(size)
        with nats_server(base) as nats, hub_process(size, gguf) as hub_url:
            store = await EventStore.connect(nats.url, default_registry())
            await store.ensure_streams()
            mirror_dir = base / "mirror"
            mirror = MirrorService(store, MirrorConfig(dir=str(mirror_dir), hub=hub_url, hub_allow_private=True))
            await mirror.start()
            mirror_task = asyncio.create_task(mirror.run())
            site = web.AppRunner(mirror.app(), access_log=None)
            await site.setup()
            port = free_port()
            await web.TCPSite(site, "127.0.0.1", port).start()
            mirror_url = f"http://127.0.0.1:{port}"
            token = mirror_token(await engine_key_secret(store.js))
            jobs: JobsService | None = None
            jobs_task: asyncio.Task | None = None
            fleet: Fleet | None = None
            try:
                scratch = base / "scratch"
                scratch.mkdir()
                for i in range(runs):
                    out["sha256"].append(sha256_seconds(in_memory))
                    dest = scratch / "copy.bin"
                    out["hub_copy"].append(await plain_copy(f"{hub_url}/{BIG_REPO}/resolve/main/{BIG_FILE}", dest))
                    dest.unlink()
                    model = f"big{i}"
                    seconds, done = await mirror_fetch(store, model)
                    out["mirror_fetch"].append(seconds)
                    out["mirror_own"].append(done.seconds)  # the mirror's own clock: first byte asked to verified
                    ref = f"{model}/{done.version}/{BIG_FILE}"
                    auth = {"Authorization": f"Bearer {token}"}
                    out["files_copy"].append(await plain_copy(f"{mirror_url}/files/{ref}", dest, auth))
                    dest.unlink()
                    cache = WeightsCache(base / f"weights{i}", mirror_url, lambda: token)
                    out["agent_fetch"].append(await _timed(lambda c=cache, r=ref: c.ensure(r)))  # type: ignore[misc]
                    shutil.rmtree(base / f"weights{i}")
                    shutil.rmtree(mirror_dir / model, ignore_errors=True)  # disk only; the log still holds it

                jobs = JobsService(
                    store,
                    JobsConfig(
                        hub=hub_url,
                        hub_allow_private=True,
                        source="local",
                        mirror_dir=str(mirror_dir),
                        unplaceable_s=600.0,
                    ),
                )
                await jobs.start()
                jobs_task = asyncio.create_task(jobs.run())
                fleet = await Fleet(store, nats.url, base / "fleet").start(services=("catalog", "fleet", "scheduler"))
                fleet.agent("bench-node")
                await asyncio.sleep(1.0)  # let the agent register before the first run
                for i in range(runs):
                    name = f"tiny-{i}"
                    seconds, finished = await serve_once(store, name)
                    if not finished.ok:
                        raise RuntimeError(f"serve {name} failed: {finished.summary}")
                    out["serve"].append(seconds)
                    await fleet.command("scale", M.ScaleModel(name=name, min=0, max=1))
                    while await fleet.active(name):
                        await asyncio.sleep(0.05)
                return out
            finally:
                if fleet is not None:
                    await fleet.stop()
                if jobs is not None:
                    await jobs.close()
                    if jobs_task is not None:
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await asyncio.wait_for(jobs_task, 10)
                await mirror.close()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await asyncio.wait_for(mirror_task, 10)
                await site.cleanup()
                await store.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size-mb", type=int, default=256, help="the big file, in MB (10^6 bytes)")
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    out = asyncio.run(run(args.size_mb, args.runs))
    size = args.size_mb * MB

    def rate(seconds: float) -> float:
        return size / seconds / MB

    print(f"{args.size_mb} MB over loopback, {args.runs} rounds; MB/s (10^6 bytes), median and each round")
    rows = [
        ("sha256 in memory (one core)", "sha256", None),
        ("plain copy from the hub", "hub_copy", None),
        ("mirror fetch (command → completed)", "mirror_fetch", "hub_copy"),
        ("plain copy from the mirror", "files_copy", None),
        ("agent fetch (WeightsCache.ensure)", "agent_fetch", "files_copy"),
    ]
    print(
        f"{'figure':<36} {'MB/s':>8} {'ratio':>6} {'ceil':>6} {'÷sha':>6}  "
        "rounds (MB/s; ratio to its plain copy / ceiling)"
    )
    for label, key, against in rows:
        rates = [rate(s) for s in out[key]]
        if against is None:
            each = ", ".join(f"{r:.0f}" for r in rates)
            print(f"{label:<36} {statistics.median(rates):>8.0f} {'':>6} {'':>6} {'':>6}  {each}")
        else:
            ratios = [b / a for a, b in zip(out[key], out[against], strict=True)]
            # The ceiling: sha256 over the same bytes in memory against the same plain copy.
            ceils = [b / a for a, b in zip(out["sha256"], out[against], strict=True)]
            # The fetch against the hash alone, same round: what is left when hashing is the limit.
            of_sha = [h / a for a, h in zip(out[key], out["sha256"], strict=True)]
            each = ", ".join(f"{r:.0f}; {q:.2f}/{c:.2f}" for r, q, c in zip(rates, ratios, ceils, strict=True))
            med = (
                f"{statistics.median(rates):>8.0f} {statistics.median(ratios):>6.2f} "
                f"{statistics.median(ceils):>6.2f} {statistics.median(of_sha):>6.2f}"
            )
            print(f"{label:<36} {med}  {each}")
    print("(ceil: the sha256 rate / the plain copy's rate; a verified fetch cannot go faster than either;")
    print(" ÷sha: the fetch's rate / the sha256 rate, same round)")
    own = statistics.median(rate(s) for s in out["mirror_own"])
    print(f"(the mirror's own `fetch_completed.seconds`, without the command and the hub lookup: {own:.0f} MB/s)")
    serve = out["serve"]
    each = ", ".join(f"{s:.2f}" for s in serve)
    print(f"serve → answering replica, tiny GGUF: median {statistics.median(serve):.2f} s ({each})")


if __name__ == "__main__":
    main()
