"""From `ctl model scale M --min 1` to a ready replica of the tiny GGUF, on this machine.

    .venv/bin/python -m tests.bench.ready [--runs 10]

Starts a durable nats-server, the services in this process and one agent as a process, adds the
tiny model at min 0, then repeatedly scales it to 1 and back to 0, timing each step of the way
from the command to `replica.ready` as the log records it (placed, starting, ready).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import models as M
from llmgw.events.schema import replicas as R
from llmgw.events.schema.catalog import default_registry
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import nats_server


async def run(runs: int) -> dict[str, list[float]]:
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        with nats_server(base) as nats:
            store = await EventStore.connect(nats.url, default_registry())
            await store.ensure_streams()
            fleet = await Fleet(store, nats.url, base).start()
            try:
                fleet.agent("bench-node")
                tiny = write_tiny_gguf(base / "tiny.gguf")
                await fleet.add_model("tiny", tiny, min_=0)
                await asyncio.sleep(1.0)  # let the agent register before the first run
                out: dict[str, list[float]] = {"placed": [], "starting": [], "ready": []}
                for _ in range(runs):
                    after = await store.stream_last_seq()
                    t0 = time.perf_counter()
                    await fleet.command("scale", M.ScaleModel(name="tiny", min=1))
                    seen: dict[str, float] = {}
                    async for batch in store.subscribe("llmgw.evt.replica.>", after=after):
                        for e in batch:
                            for name, cls in (
                                ("placed", R.ReplicaPlaced),
                                ("starting", R.ReplicaStarting),
                                ("ready", R.ReplicaReady),
                            ):
                                if isinstance(getattr(e, "payload", None), cls) and name not in seen:
                                    seen[name] = time.perf_counter() - t0
                        if "ready" in seen:
                            break
                    for k in out:
                        out[k].append(seen.get(k, float("nan")))
                    await fleet.command("scale", M.ScaleModel(name="tiny", min=0))
                    await _wait_none_active(fleet)
                return out
            finally:
                await fleet.stop()
                await store.close()


async def _wait_none_active(fleet: Fleet) -> None:
    while await fleet.active("tiny") or any(r["state"] == "draining" for r in (await fleet.replicas()).values()):
        await asyncio.sleep(0.05)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    out = asyncio.run(run(args.runs))
    print(f"scale --min 1 → ready, tiny GGUF, {args.runs} runs (seconds from the command)")
    print(f"{'step':<10} {'median':>8} {'p90':>8} {'max':>8}")
    for step, values in out.items():
        values = sorted(values)
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        print(f"{step:<10} {statistics.median(values):>8.3f} {p90:>8.3f} {values[-1]:>8.3f}")


if __name__ == "__main__":
    main()
