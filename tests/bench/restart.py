"""`ctl restart --model M` under steady gateway traffic (SCHED-6), on this machine.

    .venv/bin/python -m tests.bench.restart [--runs 3] [--clients 4]

Starts a durable nats-server, the services and the gateway in this process and two agents as
processes, serves the tiny GGUF with 2 replicas, and keeps ``--clients`` clients sending chat
requests (2 tokens each) through the gateway. Each run asks for a restart of every running replica
(one command per replica, as `ctl restart --model` sends them) and times, from the first command,
until both replicas have been replaced by ready new ones; it counts the requests answered and
failed over the run, and the latency of those answered during the restart against a quiet spell of
the same length just before.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import openai

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.events.schema.catalog import default_registry
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import nats_server, wait_until
from tests.test_gateway import FAST_ROUTER, GATEWAY, client, make_key, make_tenant


class Traffic:
    """Clients sending requests until stopped; each answer's (end time, latency), each failure."""

    def __init__(self, fleet: Fleet, key: str, clients: int) -> None:
        self.answers: list[tuple[float, float]] = []
        self.failures: list[tuple[float, str]] = []
        self._stop = asyncio.Event()
        self._tasks = [asyncio.create_task(self._one(fleet, key)) for _ in range(clients)]

    async def _one(self, fleet: Fleet, key: str) -> None:
        c = client(fleet, key)
        while not self._stop.is_set():
            t0 = time.perf_counter()
            try:
                await c.chat.completions.create(
                    model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
                )
                self.answers.append((time.perf_counter(), time.perf_counter() - t0))
            except openai.APIError as exc:
                self.failures.append((time.perf_counter(), repr(exc)))

    def between(self, t0: float, t1: float) -> tuple[list[float], int]:
        return [lat for at, lat in self.answers if t0 <= at < t1], sum(1 for at, _ in self.failures if t0 <= at < t1)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks)


def q(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(int(p * len(xs)), len(xs) - 1)] if xs else float("nan")


async def run(runs: int, clients: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        with nats_server(base) as nats:
            store = await EventStore.connect(nats.url, default_registry())
            await store.ensure_streams()
            fleet = await Fleet(store, nats.url, base).start(services=GATEWAY, router=FAST_ROUTER)
            try:
                fleet.agent("n1")
                fleet.agent("n2")
                key, _ = await make_key(store, await make_tenant(store))
                await fleet.add_model("tiny", write_tiny_gguf(base / "tiny.gguf"), min_=2)
                await fleet.wait_ready("tiny", 2)
                await fleet.router_caught_up()
                traffic = Traffic(fleet, key, clients)
                out = []
                for _ in range(runs):
                    before = {r["id"] for r in await fleet.ready("tiny")}
                    quiet_from = time.perf_counter()
                    await asyncio.sleep(5.0)  # a quiet spell to compare latency with
                    t0 = time.perf_counter()
                    for rid in sorted(before):
                        await fleet.command("restart", R.RestartReplica(replica_id=rid), service=N.SERVICE)

                    async def replaced(before: set[str] = before) -> bool:
                        ready = {r["id"] for r in await fleet.ready("tiny")}
                        active = {r["id"] for r in await fleet.active("tiny")}
                        return len(ready) == 2 and ready == active and not ready & before

                    await wait_until(replaced, deadline_s=120, what="both replicas replaced")
                    t1 = time.perf_counter()
                    quiet, _ = traffic.between(quiet_from, t0)
                    during, failed = traffic.between(t0, t1)
                    out.append(
                        {
                            "restart_s": t1 - t0,
                            "answered": len(during),
                            "failed": failed,
                            "p50_quiet_ms": 1000 * q(quiet, 0.5),
                            "p50_during_ms": 1000 * q(during, 0.5),
                            "p99_quiet_ms": 1000 * q(quiet, 0.99),
                            "p99_during_ms": 1000 * q(during, 0.99),
                        }
                    )
                    await asyncio.sleep(2.0)  # the old replicas finish stopping
                await traffic.stop()
                out.append({"failed_total": len(traffic.failures), "answered_total": len(traffic.answers)})
                return out
            finally:
                await fleet.stop()
                await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    args = ap.parse_args()
    rows = asyncio.run(run(args.runs, args.clients))
    *each, total = rows
    print("| run | restart (s) | answered | failed | p50 quiet / during (ms) | p99 quiet / during (ms) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for i, r in enumerate(each, 1):
        print(
            f"| {i} | {r['restart_s']:.1f} | {r['answered']:.0f} | {r['failed']:.0f} | "
            f"{r['p50_quiet_ms']:.1f} / {r['p50_during_ms']:.1f} | {r['p99_quiet_ms']:.1f} / {r['p99_during_ms']:.1f} |"
        )
    print(
        f"\nmedian restart {statistics.median(r['restart_s'] for r in each):.1f} s; "
        f"{total['answered_total']:.0f} requests answered, {total['failed_total']:.0f} failed in all"
    )


if __name__ == "__main__":
    main()
