"""Gateway throughput through two routers against one, on the cluster harness.

    .venv/bin/python -m tests.bench.routers [--seconds 20] [--clients 16] [--rounds 2]

Starts :class:`~tests.cluster_harness.ClusterHarness` (three NATS nodes, PostgreSQL, two `llmgw
server`s with every service, two agents serving the tiny GGUF with 2 replicas), then runs the fault
suite's load generator (:mod:`tests.faults.load`: ``--clients`` concurrent clients, each sending one
small chat completion after another) for ``--seconds``, alternately all through the first router and
split across both (A B B A …), and prints answered requests per second of each and their ratio.
Figures only: nothing passes or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path

from tests.cluster_harness import MODEL, ClusterHarness
from tests.faults.load import Load


async def rate(gateways: list[str], key: str, clients: int, seconds: float) -> tuple[float, int]:
    """Requests answered 200 per second, and the errors."""
    load = Load(gateways, key, MODEL, clients=clients).start()
    await asyncio.sleep(2)  # warm-up: connections made, not counted
    t0 = time.monotonic()
    await asyncio.sleep(seconds)
    t1 = time.monotonic()
    await load.stop()
    window = load.between(t0, t1)
    ok = sum(1 for a in window if a.status == 200)
    return ok / (t1 - t0), len(window) - ok


async def main(seconds: float, clients: int, rounds: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="llmgw-bench-routers-"))
    async with ClusterHarness(base) as h:
        one, two = [], []
        order = [("one", h.gateways[:1]), ("two", h.gateways)]
        for r in range(rounds):
            for name, gateways in order if r % 2 == 0 else reversed(order):
                per_s, errors = await rate(gateways, h.key, clients, seconds)
                (one if name == "one" else two).append(per_s)
                print(f"round {r + 1}: {name} router(s): {per_s:7.1f} requests/s answered 200, {errors} errors")
        a, b = sum(one) / len(one), sum(two) / len(two)
        print(f"one router: {a:.1f}/s   two routers: {b:.1f}/s   two/one: {b / a:.2f}×")
        print(f"machine: {os.cpu_count()} CPUs; {clients} clients, {seconds:.0f} s per round, {rounds} rounds")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    asyncio.run(main(args.seconds, args.clients, args.rounds))
