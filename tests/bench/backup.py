"""Backup and restore of a long log (SPEC OPS-3): `python -m tests.bench.backup [--events 1000000]`.

It starts a durable nats-server in a temporary directory, writes the cold-start benchmark's realistic
log (bench/coldstart.py: nodes, models, keys, replicas) and then, in one run on that log:

- reads the whole event stream once as a reader would (an ordered consumer, raw messages): the
  baseline a backup is compared with;
- backs everything up with `llmgw backup`'s code (infra/backup.py) into an archive;
- restores the archive into a second, empty nats-server (without a flush per write, as `llmgw restore
  --data-dir` runs its own) and checks that every stream's first and
  last sequence and message count came back;
- rebuilds every projection from the restored log into a fresh SQLite database: the baseline a
  restore is compared with (after a restore it is what the services do next).

The figures are printed, with the ratios that are meant to be read (backup ÷ plain read, restore ÷
projections rebuild); nothing asserts a time. docs/benchmarks.md records a run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import nats

from llmgw.bench.backbone import nats_server
from llmgw.bench.coldstart import write_log
from llmgw.cli.runtime import projections
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.catalog import default_registry
from llmgw.infra import backup as B
from llmgw.projections.backends import open_backend
from llmgw.projections.rebuild import rebuild


async def plain_read(store: EventStore, stream: str, last: int) -> tuple[float, int]:
    """Every message of ``stream`` through an ordered consumer, undecoded: (seconds, messages)."""
    done = asyncio.Event()
    seen = 0

    async def got(msg: Any) -> None:
        nonlocal seen
        seen += 1
        if msg.metadata.sequence.stream >= last:
            done.set()

    started = time.perf_counter()
    info = await store.js.stream_info(stream)
    sub = await store.js.subscribe(info.config.subjects[0], cb=got, ordered_consumer=True, stream=stream)
    await asyncio.wait_for(done.wait(), 3600)
    seconds = time.perf_counter() - started
    await sub.unsubscribe()
    return seconds, seen


async def rebuild_all(store: EventStore, db: Path) -> float:
    backend = await open_backend(f"sqlite:///{db}")
    started = time.perf_counter()
    try:
        for p in projections():
            await rebuild(store, backend, p)
    finally:
        await backend.close()
    return time.perf_counter() - started


async def measure(n: int, base: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"events": n}
    with nats_server(base / "a", durable=True) as a:
        store = await EventStore.connect(a.url, default_registry())
        try:
            await store.ensure_streams()
            out["write_s"], last = await write_log(store, n, lambda line: print(line, flush=True))
            out["read_s"], out["read_messages"] = await plain_read(store, "LLMGW_EVENTS", last)
            print(f"  plain read: {out['read_s']:.2f}s", flush=True)
            result = await B.backup(store.nc, base / "backups")
            out["backup_s"], out["archive_bytes"] = result.duration_s, result.size
            print(f"  backup: {result.duration_s:.2f}s, {result.size:,} bytes", flush=True)
            before = await B.stream_names(store.nc)
            state = {s.name: (s.first_seq, s.last_seq, s.messages) for s in result.manifest.streams}
            stored = (await store.js.stream_info("LLMGW_EVENTS")).state.bytes
            out["stream_bytes"] = stored
        finally:
            await store.close()
    # Restored as `llmgw restore --data-dir` does: into a server without a flush per write, stopped
    # cleanly after (a flushing server takes each restored message one flush at a time).
    with nats_server(base / "b", durable=False) as b:
        nc = await nats.connect(b.url)
        try:
            started = time.perf_counter()
            await B.restore(nc, Path(result.path))
            out["restore_s"] = time.perf_counter() - started
            print(f"  restore: {out['restore_s']:.2f}s", flush=True)
            assert await B.stream_names(nc) == before
            js = nc.jetstream()
            for name, (first, last_seq, count) in state.items():
                s = (await js.stream_info(name)).state
                # An empty stream comes back with first 1, last 0 (as after a purge): the next message is 1 either way.
                got = (s.first_seq if s.messages else first, s.last_seq, s.messages)
                assert got == (first, last_seq, count), (
                    f"{name}: {got} after the restore, {(first, last_seq, count)} before"
                )
        finally:
            await nc.close()
        restored = await EventStore.connect(b.url, default_registry())
        try:
            out["rebuild_s"] = await rebuild_all(restored, base / "rebuilt.db")
            print(f"  projections rebuild: {out['rebuild_s']:.2f}s", flush=True)
        finally:
            await restored.close()
    out["backup_over_read"] = out["backup_s"] / out["read_s"]
    out["restore_over_rebuild"] = out["restore_s"] / out["rebuild_s"]
    return out


def text(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"{r['events']:,} events ({r['stream_bytes'] / 1e6:.0f} MB in LLMGW_EVENTS), "
            f"archive {r['archive_bytes'] / 1e6:.0f} MB",
            f"  plain read of the stream   {r['read_s']:8.2f} s",
            f"  backup (every stream)      {r['backup_s']:8.2f} s   {r['backup_over_read']:.2f}× the plain read",
            f"  restore (every stream)     {r['restore_s']:8.2f} s",
            f"  projections rebuild        {r['rebuild_s']:8.2f} s   restore is {r['restore_over_rebuild']:.2f}× it",
            f"  (the log was written in {r['write_s']:.1f} s; {platform.python_version()}, {os.cpu_count()} cores)",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-backup-") as tmp:
        result = asyncio.run(measure(args.events, Path(tmp)))
    print(json.dumps(result, indent=2) if args.json else text(result))


if __name__ == "__main__":
    main()
