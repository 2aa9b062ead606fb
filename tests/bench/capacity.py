"""`llmgw ctl bench` against engines whose capacity is known: does it find it?

    .venv/bin/python -m tests.bench.capacity [--parallel 1,2,4] [--max-concurrency 8] [--requests-per-step 16]
                                             [--max-tokens 32] [--json FILE]

Starts a durable nats-server, the services and the gateway in this process and one agent as a
process, then for each ``--parallel`` N adds the tiny GGUF under llama.cpp with N slots (one replica,
max 1, one thread), runs the real CLI, ``llmgw ctl bench tiny-pN --json``, and removes the model
before the next. Without an SLO the answer is the knee of the total tokens/s; an engine with N slots
should put it near N (past N the gateway queues the rest). Last, the same engine with an SLO of
twice the time to first token the bench measured at one request: the answer within it, beside the
knee. Figures only; what is read is the found concurrency against N and the ratios of tokens/s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from llmgw.cli import logs
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import models as M
from llmgw.events.schema.catalog import default_registry
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import nats_server
from tests.test_gateway import FAST_ROUTER, GATEWAY, make_key, make_tenant


async def ctl(fleet: Fleet, *args: str) -> dict[str, Any]:
    proc = await asyncio.create_subprocess_exec(
        str(Path(sys.executable).parent / "llmgw"), "--nats", fleet.nats_url, "--api", fleet.admin_url, "ctl", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=fleet.cli_env(),
    )  # fmt: skip
    out, err = await proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"ctl {' '.join(args)} failed ({proc.returncode}): {err.decode()[-2000:]}")
    print(err.decode().rstrip(), file=sys.stderr)
    return json.loads(out)


async def add(fleet: Fleet, name: str, source: Path, parallel: int, slo: M.Slo | None = None) -> None:
    profile = M.Profile(engine="llamacpp", cpu_cores=1, min_memory_gb=0.05, ctx_size=2048, parallel=parallel)
    spec = M.ModelSpec(name=name, source=str(source), scaling=M.Scaling(min=1, max=1), profiles=[profile], slo=slo)
    await fleet.command("add", M.AddModel(spec=spec))
    await fleet.wait_ready(name, 1, deadline_s=120)
    await fleet.router_caught_up()


async def run(parallels: list[int], top: int, per_step: int, max_tokens: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp)
        with nats_server(base) as nats:
            store = await EventStore.connect(nats.url, default_registry())
            await store.ensure_streams()
            fleet = await Fleet(store, nats.url, base).start(services=GATEWAY, router=FAST_ROUTER)
            try:
                fleet.agent("bench-node")
                key, _ = await make_key(store, await make_tenant(store))
                tiny = write_tiny_gguf(base / "tiny.gguf")
                send = ["--gateway", f"http://127.0.0.1:{fleet.port}", "--key", key]
                size = ["--max-concurrency", str(top), "--requests-per-step", str(per_step)]
                size += ["--max-tokens", str(max_tokens)]
                last: dict[str, Any] = {}
                for n in parallels:
                    name = f"tiny-p{n}"
                    await add(fleet, name, tiny, n)
                    last = await ctl(fleet, "bench", name, *send, *size, "--json")
                    out.append({**last, "parallel": n, "slo_ttft_p95_s": None})
                    await fleet.command("remove", M.RemoveModel(name=name))
                n = parallels[-1]
                slo = M.Slo(ttft_p95_s=round(2 * last["steps"][0]["ttft_p95_s"], 3))
                name = f"tiny-p{n}-slo"
                await add(fleet, name, tiny, n, slo)
                result = await ctl(fleet, "bench", name, *send, *size, "--json")
                out.append({**result, "parallel": n, "slo_ttft_p95_s": slo.ttft_p95_s})
            finally:
                await fleet.stop()
                await store.close()
    return out


def report(results: list[dict[str, Any]]) -> str:
    lines = [
        "slots  SLO ttft p95  found  basis  tok/s there  tok/s at 1  ratio  ttft p95 there  steps (c: total tok/s)"
    ]
    for r in results:
        one = r["steps"][0]["tokens_per_s"]
        steps = ", ".join(f"{s['concurrency']}: {s['tokens_per_s']:.0f}" for s in r["steps"])
        slo = f"{r['slo_ttft_p95_s']:.3f} s" if r["slo_ttft_p95_s"] else "-"
        lines.append(
            f"{r['parallel']:>5}  {slo:>12}  {r['concurrency']:>5}  {r['basis']:>5}  {r['tokens_per_s']:>11.1f}  "
            f"{one:>10.1f}  {r['tokens_per_s'] / one if one else 0:>5.2f}  {r['ttft_p95_s']:>12.3f} s  {steps}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallel", default="1,2,4", help="the engines' slot counts, in order")
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--requests-per-step", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args()
    logs.configure("warning")
    parallels = [int(x) for x in args.parallel.split(",")]
    results = asyncio.run(run(parallels, args.max_concurrency, args.requests_per_step, args.max_tokens))
    print(report(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
