"""What the usage journal costs the router, and how fast it empties after an outage.

    .venv/bin/python -m tests.bench.usage_journal [--records 20000] [--rounds 5]

Against a real nats-server (durable: fsync on every write), in one process:

- **publish cost**: router CPU time (``time.process_time``, this process only: nats-server is
  another) to publish N records from ``put`` to the last acknowledgement, through the previous
  publisher (kept below as it was) and the current one with its journal idle, alternating, several
  rounds; reported as CPU µs per record and the ratio of the medians.
- **journal**: with nats-server stopped, N records are put and spilled to the journal (records/s,
  one write+fsync per batch); then nats-server starts again and the time until every record is
  acknowledged and the journal is empty gives the replay rate (records/s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import msgspec
from nats.js import JetStreamContext

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import subjects as S
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.usage import UsageRecord, usage_subject
from llmgw.services.router.usage import UsageConfig, UsagePublisher
from tests.support import NatsServer

_enc = msgspec.json.Encoder()


class PreviousPublisher:
    """The publisher before the journal (memory only, futures awaited one by one): the baseline."""

    def __init__(self, js: JetStreamContext, batch: int = 256) -> None:
        self.js = js
        self.batch = batch
        self._queue: asyncio.Queue[UsageRecord] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.published = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    def put(self, record: UsageRecord) -> None:
        self._queue.put_nowait(record)

    async def _run(self) -> None:
        while True:
            records = [await self._queue.get()]
            while len(records) < self.batch and not self._queue.empty():
                records.append(self._queue.get_nowait())
            await self._publish(records)

    async def _publish(self, records: list[UsageRecord]) -> None:
        pending = records
        while pending:
            futures = []
            for r in pending:
                fut = await self.js.publish_async(
                    usage_subject(r.project_id), _enc.encode(r), headers={S.HDR_MSG_ID: r.request_id}
                )
                futures.append((r, fut))
            failed = []
            for r, fut in futures:
                try:
                    await asyncio.wait_for(fut, 10.0)
                    self.published += 1
                except Exception:
                    failed.append(r)
            pending = failed

    async def stop(self) -> None:
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def records(n: int, tag: str) -> list[UsageRecord]:
    now = datetime.now(UTC)
    return [
        UsageRecord(
            request_id=f"{tag}-{i}",
            at=now,
            status=200,
            key_id="key_bench",
            project_id=f"p{i % 4}",
            team_id="t1",
            org_id="o1",
            model_asked="tiny",
            model_served="tiny",
            replica_id="tiny-abc",
            node_id="n1",
            endpoint="/v1/chat/completions",
            tokens_in=12,
            tokens_out=30,
            total_s=0.25,
            cost_usd=0.0001,
            router="router-bench",
        )
        for i in range(n)
    ]


async def until(condition, deadline_s: float = 300.0) -> None:
    end = time.monotonic() + deadline_s
    while not condition():
        if time.monotonic() > end:
            raise TimeoutError("the benchmark's condition was not met in time")
        await asyncio.sleep(0.001)


async def cost(publisher, batch: list[UsageRecord], walls: list[float] | None = None) -> float:
    """CPU seconds from the first put to the last acknowledgement (wall seconds appended to ``walls``)."""
    before = publisher.published
    t0, w0 = time.process_time(), time.perf_counter()
    for r in batch:
        publisher.put(r)
    await until(lambda: publisher.published - before >= len(batch))
    if walls is not None:
        walls.append(time.perf_counter() - w0)
    return time.process_time() - t0


async def run(n: int, rounds: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        nats = NatsServer(base / "js").start()
        store = await EventStore.connect(nats.url, default_registry())
        try:
            await store.ensure_streams()
            old = PreviousPublisher(store.js)
            old.start()
            new = UsagePublisher(store.js, store.nc, UsageConfig(journal_dir=str(base / "journal")))
            await new.start()
            await cost(old, records(1000, "warm-old"))
            await cost(new, records(1000, "warm-new"))
            old_s, new_s, new_wall = [], [], []
            for k in range(rounds):
                old_s.append(await cost(old, records(n, f"old{k}")))
                new_s.append(await cost(new, records(n, f"new{k}"), new_wall))
            await old.stop()

            # An outage: the bus is away, records go to the journal; then it is back.
            nats.stop()
            new.put(records(1, "first-down")[0])
            await until(lambda: new.backlog().journaled >= 1)  # the publisher has seen the bus go
            outage = records(n, "outage")
            t0 = time.perf_counter()
            for r in outage:
                new.put(r)
            await until(lambda: new.backlog().journaled >= n + 1)
            journal_s = time.perf_counter() - t0
            segments = len(list((base / "journal").glob("*.journal")))
            nats.start()
            t0 = time.perf_counter()
            await until(lambda: new.backlog().records == 0)
            replay_s = time.perf_counter() - t0
            await new.stop()
            return {
                "old_us": [s / n * 1e6 for s in old_s],
                "new_us": [s / n * 1e6 for s in new_s],
                "healthy_rps": n / statistics.median(new_wall),
                "journal_rps": n / journal_s,
                "replay_rps": n / replay_s,
                "segments": segments,
            }
        finally:
            await store.close()
            nats.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    r = asyncio.run(run(args.records, args.rounds))
    old, new = statistics.median(r["old_us"]), statistics.median(r["new_us"])
    print(f"records per round: {args.records}, rounds: {args.rounds}")
    print(
        f"previous publisher  CPU µs/record: median {old:.1f}  (rounds: {', '.join(f'{x:.1f}' for x in r['old_us'])})"
    )
    print(
        f"journaled publisher CPU µs/record: median {new:.1f}  (rounds: {', '.join(f'{x:.1f}' for x in r['new_us'])})"
    )
    print(f"ratio (journaled / previous): {new / old:.3f}")
    print(f"spilled to the journal while NATS was down: {r['journal_rps']:,.0f} records/s ({r['segments']} segments)")
    print(f"replayed after NATS returned: {r['replay_rps']:,.0f} records/s")
    print(f"published while the bus is healthy (for comparison): {r['healthy_rps']:,.0f} records/s")


if __name__ == "__main__":
    main()
