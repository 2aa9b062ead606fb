"""Two versions of the gateway side by side: the same requests, one load generator, rounds alternated.

    .venv/bin/python -m tests.bench.gateway_ab BASE AFTER [--rounds 8] [--requests 400] [--json FILE]

BASE and AFTER are git revisions of this repository (``WORK`` is the working tree, uncommitted
changes and all). Each is exported (``git archive``) into a folder of its own, laid out as an
install would see it (``pkg/llmgw/<package>`` links to the export; ``--after-patch FILE`` applied to
AFTER's, e.g. to turn features off and see what they cost), and run as a *side*: a process
from that tree which starts, through that tree's own :mod:`tests.bench.gateway`, a durable
nats-server, a simulated engine with no latency, a router process and the events that make the
engine a ready replica behind an API key, then waits for this process's word.

This process is the one load generator for both: for each concurrency (1, 16, 64) and answer kind
(whole, streamed) it sends ``--requests`` requests to BASE's gateway, then to AFTER's (then AFTER
first, then BASE first, ...), ``--rounds`` times, and after each round waits until that side's
usage records are all in its log (publishing them is part of a request's cost) before reading its
router's CPU time. A round's figures are compared with the other side's in the same pair of
rounds, so what the machine does meanwhile (other processes, a slower minute) falls on both alike.
Reported per cell: the median over the pairs of AFTER ÷ BASE for the router's CPU per request,
the median latency and requests per second, and how many pairs came out above 1. Figures only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import aiohttp

from tests.bench.gateway import Target, _py_spy, cpu_s, load, pct

ROOT = Path(__file__).parents[2]
CELLS = [(c, stream) for stream in (False, True) for c in (1, 16, 64)]

# Run in each side's own tree (its tests.bench.gateway): set up, say where the gateway is, then
# wait for "sent N" (N more requests that each leave a usage record) and answer once they are in the log.
SIDE = """
import argparse, asyncio, json, shutil, sys, tempfile
from pathlib import Path
from tests.bench import gateway as G

async def main():
    base = Path(tempfile.mkdtemp(prefix="llmgw-ab-side-"))
    args = argparse.Namespace(quick=True, no_real=True, no_paced=True, keep_logs=None, py_spy=None)
    b = G.Bench(base, args)
    try:
        await b.setup()
        await b.start_sim("sim", 0, 0)
        await b.start_router()
        target = b.gateway("sim")
        await b.gateway_serves(target)
        print(json.dumps({"url": target.url, "headers": target.headers, "model": target.model,
                          "router_pid": b.router.pid}), flush=True)
        loop = asyncio.get_running_loop()
        while line := await loop.run_in_executor(None, sys.stdin.readline):
            b.gateway_sent += int(line.split()[1])
            await b.usage_settled()
            print("settled", flush=True)
    finally:
        if b.store is not None:
            await b.store.close()
        b.stop_all()
        shutil.rmtree(base, ignore_errors=True)

asyncio.run(main())
"""


def export(rev: str, into: Path, patch: Path | None = None) -> Path:
    """``rev``'s tree as an install sees it: ``into/src`` (the files), ``into/pkg/llmgw`` (links);
    ``patch`` applied to the files (``git apply``), never to the working tree."""
    src, pkg = into / "src", into / "pkg" / "llmgw"
    pkg.mkdir(parents=True)
    if rev == "WORK":
        if patch is not None:
            raise ValueError("a patch applies to a revision's export, not to the working tree: commit it first")
        src.symlink_to(ROOT)
    else:
        src.mkdir()
        archive = subprocess.run(["git", "archive", rev], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    if patch is not None:
        applied = subprocess.run(["git", "apply", str(patch.resolve())], cwd=src, capture_output=True, text=True)
        if applied.returncode != 0:
            raise ValueError(f"{patch} does not apply to {rev}: {applied.stderr.strip()}")
    (pkg / "__init__.py").touch()
    for package in src.iterdir():  # the tree's own top-level packages (they differ between revisions)
        if package.name != "tests" and (package / "__init__.py").exists():
            (pkg / package.name).symlink_to(package)
    return into


class Side:
    """One tree's gateway, started by its own code, and the rounds measured against it."""

    def __init__(self, name: str, tree: Path, label: str) -> None:
        paths = [str(tree / "pkg"), str(tree / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
        env = {**os.environ, "PYTHONPATH": ":".join(paths)}
        self.name = name
        self.label = label  # "base" or "after"
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SIDE],
            cwd=tree / "src",
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.rounds: list[dict[str, float]] = []
        self.target: Target | None = None
        self.router_pid = 0

    async def ready(self) -> None:
        line = await asyncio.to_thread(self.proc.stdout.readline)  # type: ignore[union-attr]
        if not line:
            raise RuntimeError(f"side {self.name} did not start (exit {self.proc.wait()})")
        said = json.loads(line)
        self.target = Target(url=said["url"], headers=said["headers"], model=said["model"])
        self.router_pid = said["router_pid"]

    async def settled(self, sent: int) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"sent {sent}\n")
        self.proc.stdin.flush()
        if (await asyncio.to_thread(self.proc.stdout.readline)).strip() != "settled":
            raise RuntimeError(f"side {self.name} stopped answering")

    async def round(self, session: aiohttp.ClientSession, c: int, stream: bool, n: int) -> dict[str, float]:
        assert self.target is not None
        cpu0 = cpu_s(self.router_pid)
        run = await load(session, self.target, stream, c, n)
        await self.settled(n)
        cpu = cpu_s(self.router_pid) - cpu0
        return {
            "cpu_us": 1e6 * cpu / max(run.n, 1),
            "p50_ms": pct(run.latency, 0.5),
            "rps": run.n / run.wall_s if run.wall_s else 0.0,
            "errors": run.errors,
        }

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def ratios(a: list[dict[str, float]], b: list[dict[str, float]], metric: str) -> list[float]:
    return [y[metric] / x[metric] for x, y in zip(a, b, strict=True) if x[metric]]


def py_spy(side: Side, out: Path) -> subprocess.Popen:
    """py-spy sampling ``side``'s router (folded stacks, 1,000 a second) until it is sent SIGINT."""
    return _py_spy(side.router_pid, out / side.label, rate=1000, fmt="raw")


def strace(side: Side, out: Path) -> subprocess.Popen:
    """strace counting ``side``'s router's system calls (``-c``, every thread) until it is sent SIGINT."""
    out.mkdir(parents=True, exist_ok=True)
    argv = ["strace", "-c", "-f", "-p", str(side.router_pid), "-o", str(out / f"{side.label}.strace")]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def compare(
    base: Side,
    after: Side,
    rounds: int,
    requests: int,
    cells: list[tuple[int, bool]],
    together: bool = False,
    spy: Path | None = None,
    syscalls: Path | None = None,
) -> list[dict[str, Any]]:
    rows = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
        for c, stream in cells:
            got: dict[str, list[dict[str, float]]] = {"base": [], "after": []}
            for side in (base, after):  # warm-up: connections opened, code paths taken
                await side.round(session, c, stream, max(2 * c, 50))
            cell = f"c{c}-{'stream' if stream else 'whole'}"
            spies = [py_spy(side, spy / cell) for side in (base, after)] if spy else []
            spies += [strace(side, syscalls / cell) for side in (base, after)] if syscalls else []
            for i in range(rounds):
                if together:
                    both = await asyncio.gather(*(side.round(session, c, stream, requests) for side in (base, after)))
                    got["base"].append(both[0])
                    got["after"].append(both[1])
                    continue
                for side in (base, after) if i % 2 == 0 else (after, base):
                    got[side.label].append(await side.round(session, c, stream, requests))
            for p in spies:
                p.send_signal(signal.SIGINT)
                p.wait(30)
            a, b = got["base"], got["after"]
            row: dict[str, Any] = {"concurrency": c, "stream": stream, "rounds": rounds, "requests": requests}
            for metric in ("cpu_us", "p50_ms", "rps"):
                rs = ratios(a, b, metric)
                row[metric] = {
                    "base": statistics.median(x[metric] for x in a),
                    "after": statistics.median(x[metric] for x in b),
                    "ratio_median": statistics.median(rs),
                    "above_1": sum(r > 1 for r in rs),
                    "ratios": [round(r, 3) for r in rs],
                }
            row["errors"] = sum(x["errors"] for x in a + b)
            rows.append(row)
            print(
                f"c={c:<3} {'stream' if stream else 'whole ':<6}"
                + "".join(
                    f"  {m} {row[m]['base']:8.2f} → {row[m]['after']:8.2f} (×{row[m]['ratio_median']:.3f}, "
                    f"{row[m]['above_1']}/{rounds} above 1)"
                    for m in ("cpu_us", "p50_ms", "rps")
                )
                + (f"  errors {row['errors']}" if row["errors"] else ""),
                flush=True,
            )
    return rows


async def main_async(args: argparse.Namespace) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="llmgw-ab-") as tmp:
        patch = Path(args.after_patch) if args.after_patch else None
        trees = {"base": export(args.base, Path(tmp) / "base"), "after": export(args.after, Path(tmp) / "after", patch)}
        after_name = f"{args.after}+{patch.name}" if patch else args.after
        base, after = Side(args.base, trees["base"], "base"), Side(after_name, trees["after"], "after")
        try:
            await asyncio.gather(base.ready(), after.ready())
            print(f"BASE {base.name} router pid {base.router_pid}; AFTER {after.name} router pid {after.router_pid}")
            print("each cell: BASE → AFTER (medians of the rounds), ×: median of AFTER ÷ BASE over the pairs")
            spy = Path(args.py_spy) if args.py_spy else None
            syscalls = Path(args.strace) if args.strace else None
            return await compare(
                base, after, args.rounds, args.requests, cells_of(args.cells), args.together, spy, syscalls
            )
        finally:
            base.close()
            after.close()
            shutil.rmtree(tmp, ignore_errors=True)


def cells_of(spec: str | None) -> list[tuple[int, bool]]:
    """``"16,64s"``: 16 concurrent whole answers, 64 streamed; None: every cell."""
    if not spec:
        return CELLS
    return [(int(c.rstrip("s")), c.endswith("s")) for c in spec.split(",")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="a git revision (WORK: the working tree)")
    parser.add_argument("after", help="a git revision (WORK: the working tree)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per side and cell, alternated")
    parser.add_argument("--requests", type=int, default=400, help="requests per round")
    parser.add_argument("--cells", help='which cells, e.g. "16,64s" (16 concurrent whole, 64 streamed); all by default')
    parser.add_argument(
        "--together",
        action="store_true",
        help="each round loads both gateways at once (c each): the machine's bursts fall on both alike",
    )
    parser.add_argument("--after-patch", help="a patch applied to AFTER's export (e.g. tests/bench/patches/*.patch)")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--py-spy", help="sample both routers with py-spy, a folder of folded stacks per cell")
    parser.add_argument("--strace", help="count both routers' system calls with strace, a folder per cell")
    args = parser.parse_args(argv)
    rows = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
