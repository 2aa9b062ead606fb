"""Logins beside the gateway: the gateway's latency while 100 concurrent logins run, against without.

    .venv/bin/python -m tests.bench.logins [--quick] [--pairs N] [--requests N] [--kinds K,...]
                                           [--check-nice N] [--json FILE] [--keep-logs DIR]

Starts, each as its own process: a durable nats-server, the paced simulated engine of
:mod:`tests.bench.gateway` (5-15 ms to the first token, then 1,000 tokens/s: the gateway alone
leaves the machine room to spare), and one server (this module with ``--server-process``: one
``serve()`` with the router, the admin API and the people service, as ``llmgw up`` runs them), so
logins and gateway requests share one process, one event loop and the same cores. The engine
becomes a ready replica, a tenant gets an API key, and a person (``bench``) is added with a known
password by a signed ``user.add`` (``CommandClient.for_service(store, "bench")``).

This process is the load generator. For each kind of login traffic, and the gateway's requests
non-streamed then streamed, rounds alternate: *A*, the gateway alone at concurrency 16 (closed
loop); *B*, the same while 100 clients each send ``POST /api/v1/login`` again and again (closed
loop, 100 in flight from before the gateway's first request to after its last). The kinds:

- ``right``: the right password, from one address (a success clears the throttle): each login is
  an argon2id check, a signed ``token.issue`` and the wait for its fold;
- ``wrong-many``: a wrong password, each attempt from an address of its own (``127.10.x.y``,
  bound by the client; the throttle counts per peer address and trusts no ``X-Forwarded-For``),
  so the throttle never blocks and every attempt costs a check, as from an attacker with many
  addresses;
- ``wrong-one``: a wrong password from one address: the throttle blocks it after 5 failures, and
  the rest are refused (429) without a check.

Each round of ``right`` and ``wrong-one`` uses an address of its own, so no block carries over.

The B rounds end by letting every login in flight finish, so an A round never shares the machine
with a leftover check. Per kind and mode: the gateway's p50, p99 and requests/s, median over the
rounds, the p99 of B over A per pair (median of the ratios), and the logins' own answers per
second, latency and status codes. Figures only: nothing passes or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from llmgw.events.commands.client import CommandClient
from llmgw.events.schema import people as P
from llmgw.services.people.passwords import hash_password
from tests.bench.gateway import (
    PACED_JITTER,
    PACED_TOKENS_PER_S,
    PACED_TTFT_MS,
    Bench,
    Run,
    Target,
    _machine,
    close_bench,
    cpu_s,
    load,
    pct,
)
from tests.support import free_port

USER = "bench"
PASSWORD = "the bench person's long password"
WRONG = "not the bench person's password"
KINDS = ("right", "wrong-many", "wrong-one")
LOGIN_CLIENTS = 100
CONCURRENCY = 16


# -- the server process ----------------------------------------------------------------------------


def server_process(nats_url: str, db: str, port: int, admin_port: int, check_nice: int | None) -> None:
    """The router, the admin API and the people service in one ``serve()``, as `llmgw up` runs them;
    ``check_nice``: the password checks' priority instead of the checker's own (this process only)."""
    from llmgw.cli import logs
    from llmgw.cli.runtime import serve
    from llmgw.cli.server_config import ServerConfig
    from llmgw.services.people import passwords

    logs.configure("info")
    if check_nice is not None:
        passwords.CHECK_NICE = check_nice  # read by each PasswordChecker made without a nice of its own
    config = ServerConfig(
        nats_url=nats_url, db_dsn=db, services=("people", "api", "router"), port=port, admin_port=admin_port
    )

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        loop.add_signal_handler(signal.SIGINT, stop.set)
        await serve(config, stop)

    asyncio.run(go())


# -- the logins ------------------------------------------------------------------------------------


class Logins(msgspec.Struct, kw_only=True):
    """The login answers of one B round: seconds each, counted while the gateway was measured."""

    latency: list[float] = []  # every answer's, 401 and 429 included
    statuses: dict[int, int] = {}
    errors: int = 0
    first_error: str = ""
    in_window: int = 0  # answers that came back while the gateway's requests ran
    window_s: float = 0.0
    drain_s: float = 0.0  # from the gateway's last answer to the last login's


class Addresses:
    """Loopback addresses never used before in this run: 127.10.0.1, 127.10.0.2, ..."""

    def __init__(self) -> None:
        self._n = itertools.count()

    def next(self) -> str:
        i = next(self._n)
        return f"127.{10 + i // 64516}.{i // 254 % 254 + 1}.{i % 254 + 1}"


async def _attempt(session: aiohttp.ClientSession, url: str, password: str, out: Logins) -> None:
    t0 = time.perf_counter()
    try:
        async with session.post(url, json={"user": USER, "password": password}) as resp:
            await resp.read()
            status = resp.status
    except (aiohttp.ClientError, OSError) as exc:
        out.errors += 1
        out.first_error = out.first_error or repr(exc)
        return
    out.latency.append(time.perf_counter() - t0)
    out.statuses[status] = out.statuses.get(status, 0) + 1


async def run_logins(
    admin_url: str, kind: str, addresses: Addresses, stop: asyncio.Event, first: asyncio.Event, out: Logins
) -> None:
    """``LOGIN_CLIENTS`` clients logging in until ``stop``; ``first`` is set at the first answer."""
    url = admin_url + "/api/v1/login"
    password = PASSWORD if kind == "right" else WRONG
    timeout = aiohttp.ClientTimeout(total=600)

    async def fresh_address() -> None:
        while not stop.is_set():
            connector = aiohttp.TCPConnector(local_addr=(addresses.next(), 0), force_close=True)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout) as s:
                await _attempt(s, url, password, out)
            first.set()

    async def shared(session: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            await _attempt(session, url, password, out)
            first.set()

    if kind == "wrong-many":
        await asyncio.gather(*(fresh_address() for _ in range(LOGIN_CLIENTS)))
        return
    # One address for the round, never used before: an earlier round's block does not carry over.
    connector = aiohttp.TCPConnector(limit=0, local_addr=(addresses.next(), 0))
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(shared(session) for _ in range(LOGIN_CLIENTS)))


# -- the bench -------------------------------------------------------------------------------------


class LoginBench(Bench):
    def __init__(self, base: Path, args: argparse.Namespace) -> None:
        super().__init__(base, args)
        self.admin_port = free_port()
        self.addresses = Addresses()

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    async def start_server(self) -> None:
        assert self.nats is not None
        argv = [sys.executable, "-m", "tests.bench.logins", "--server-process", "--nats", self.nats.url]
        argv += ["--db", f"sqlite:///{self.base / 'server.db'}", "--port", str(self.router_port)]
        argv += ["--admin-port", str(self.admin_port)]
        if self.args.check_nice is not None:
            argv += ["--check-nice", str(self.args.check_nice)]
        self.router = self.spawn(argv, "server.log")
        await self.wait_http(f"http://127.0.0.1:{self.router_port}/healthz")
        await self.wait_http(f"{self.admin_url}/healthz")

    async def add_person(self) -> None:
        """``bench`` with a known password, by a signed command; until a login with it succeeds."""
        assert self.store is not None
        client = CommandClient.for_service(self.store, "bench")
        add = P.AddUser(name=USER, password_hash=hash_password(PASSWORD))
        await client.send(P.SERVICE, "user.add", add, actor="user:bench", timeout=20)
        end = time.monotonic() + 30
        async with aiohttp.ClientSession() as s:
            while True:
                async with s.post(self.admin_url + "/api/v1/login", json={"user": USER, "password": PASSWORD}) as r:
                    if r.status == 200:
                        return
                    text = await r.text()
                if time.monotonic() > end:
                    raise TimeoutError(f"the admin API does not sign {USER} in: HTTP {r.status} {text[:300]}")
                await asyncio.sleep(0.05)

    async def round(self, session: aiohttp.ClientSession, gw: Target, stream: bool, n: int, kind: str | None) -> dict:
        """One round: ``n`` gateway requests at concurrency 16, alone (``kind`` None) or beside logins."""
        assert self.router is not None
        logins = Logins()
        stop, first = asyncio.Event(), asyncio.Event()
        task = None
        if kind is not None:
            task = asyncio.create_task(run_logins(self.admin_url, kind, self.addresses, stop, first, logins))
            async with asyncio.timeout(60):
                await first.wait()  # the checker's queue is full: every client has sent its first login
        c0, before = cpu_s(self.router.pid), len(logins.latency)
        gw_run = await load(session, gw, stream, CONCURRENCY, n)
        server_cpu = cpu_s(self.router.pid) - c0
        nices = thread_nices(self.router.pid)  # with logins in flight: the checks' threads among them
        logins.in_window, logins.window_s = len(logins.latency) - before, gw_run.wall_s
        if task is not None:
            stop.set()
            t0 = time.perf_counter()
            async with asyncio.timeout(600):
                await task
            logins.drain_s = time.perf_counter() - t0
        self.gateway_sent += n
        await self.usage_settled()
        return {"gateway": gw_run, "logins": logins, "server_cpu_s": server_cpu, "nices": nices}


def thread_nices(pid: int) -> dict[int, int]:
    """How many of the process's threads run at each nice value now."""
    out: dict[int, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            nice = int((task / "stat").read_text().rsplit(")", 1)[1].split()[16])
            out[nice] = out.get(nice, 0) + 1
    return out


def _gateway_row(r: Run) -> dict[str, float]:
    return {
        "p50_ms": pct(r.latency, 0.5),
        "p99_ms": pct(r.latency, 0.99),
        "rps": r.n / r.wall_s if r.wall_s else math.nan,
        "errors": r.errors,
    }


def _login_row(lg: Logins) -> dict[str, Any]:
    return {
        "per_s": lg.in_window / lg.window_s if lg.window_s else math.nan,
        "p50_ms": pct(lg.latency, 0.5),
        "p99_ms": pct(lg.latency, 0.99),
        "statuses": {str(k): v for k, v in sorted(lg.statuses.items())},
        "errors": lg.errors,
        "first_error": lg.first_error,
        "drain_s": lg.drain_s,
    }


def summarize(kind: str, stream: bool, pairs: list[tuple[dict, dict]]) -> dict[str, Any]:
    """Medians over the pairs of rounds (A alone, B beside logins), and the ratios B ÷ A per pair."""
    a = [_gateway_row(p[0]["gateway"]) for p in pairs]
    b = [_gateway_row(p[1]["gateway"]) for p in pairs]
    logins = [_login_row(p[1]["logins"]) for p in pairs]
    med = statistics.median
    statuses: dict[str, int] = {}
    for lg in logins:
        for k, v in lg["statuses"].items():
            statuses[k] = statuses.get(k, 0) + v
    return {
        "kind": kind,
        "stream": stream,
        "pairs": len(pairs),
        "alone_p50_ms": med(r["p50_ms"] for r in a),
        "alone_p99_ms": med(r["p99_ms"] for r in a),
        "alone_rps": med(r["rps"] for r in a),
        "beside_p50_ms": med(r["p50_ms"] for r in b),
        "beside_p99_ms": med(r["p99_ms"] for r in b),
        "beside_rps": med(r["rps"] for r in b),
        "p50_ratio": med(y["p50_ms"] / x["p50_ms"] for x, y in zip(a, b, strict=True)),
        "p99_ratio": med(y["p99_ms"] / x["p99_ms"] for x, y in zip(a, b, strict=True)),
        "rps_ratio": med(y["rps"] / x["rps"] for x, y in zip(a, b, strict=True)),
        "p99_ratios": [y["p99_ms"] / x["p99_ms"] for x, y in zip(a, b, strict=True)],
        "gateway_errors": sum(r["errors"] for r in a + b),
        "server_cpu_ms_per_s": {
            "alone": med(1000 * p[0]["server_cpu_s"] / p[0]["gateway"].wall_s for p in pairs),
            "beside": med(1000 * p[1]["server_cpu_s"] / p[1]["gateway"].wall_s for p in pairs),
        },
        "logins_per_s": med(lg["per_s"] for lg in logins),
        "login_p50_ms": med(lg["p50_ms"] for lg in logins),
        "login_p99_ms": med(lg["p99_ms"] for lg in logins),
        "login_statuses": statuses,
        "login_errors": sum(lg["errors"] for lg in logins),
        "login_first_error": next((lg["first_error"] for lg in logins if lg["first_error"]), ""),
        "drain_s": med(lg["drain_s"] for lg in logins),
        "server_thread_nices": [p[1]["nices"] for p in pairs],  # nice: threads, at the end of each B round
    }


HEADER = (
    f"{'logins':<10} {'stream':<6} {'pairs':>5} {'alone p50':>9} {'p99':>7} {'beside p50':>10} {'p99':>7} "
    f"{'p99 B/A':>7} {'p50 B/A':>7} {'req/s A':>7} {'B/A':>5} {'CPU ms/s A/B':>13} {'logins/s':>8} "
    f"{'login p50':>9} {'p99':>7}  statuses"
)


def _print_row(r: dict[str, Any]) -> None:
    cpu = f"{r['server_cpu_ms_per_s']['alone']:.0f}/{r['server_cpu_ms_per_s']['beside']:.0f}"
    print(
        f"{r['kind']:<10} {('yes' if r['stream'] else 'no'):<6} {r['pairs']:>5} {r['alone_p50_ms']:9.2f} "
        f"{r['alone_p99_ms']:7.2f} {r['beside_p50_ms']:10.2f} {r['beside_p99_ms']:7.2f} {r['p99_ratio']:7.2f} "
        f"{r['p50_ratio']:7.2f} {r['alone_rps']:7.0f} {r['rps_ratio']:5.2f} {cpu:>13} {r['logins_per_s']:8.1f} "
        f"{r['login_p50_ms']:9.0f} {r['login_p99_ms']:7.0f}  {r['login_statuses']}",
        flush=True,
    )
    nices = " ".join(str(x) for x in r["server_thread_nices"])
    print(f"    p99 B/A per pair: {' '.join(f'{x:.2f}' for x in r['p99_ratios'])}; server threads by nice: {nices}")
    if r["gateway_errors"] or r["login_errors"]:
        print(f"    errors: gateway {r['gateway_errors']}, logins {r['login_errors']} {r['login_first_error']}")


async def bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    n = args.requests or (400 if args.quick else 1500)
    pairs = args.pairs or (2 if args.quick else 4)
    kinds = args.kinds.split(",") if args.kinds else list(KINDS)
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="llmgw-bench-logins-") as tmp:
        b = LoginBench(Path(tmp), args)
        try:
            await b.setup()
            engine = await b.start_sim("sim-paced", PACED_TTFT_MS, PACED_TOKENS_PER_S, PACED_JITTER)
            await b.start_server()
            gw = b.gateway("sim-paced")
            await b.gateway_serves(gw)
            await b.add_person()
            print(f"server pid {b.router.pid if b.router else '?'}, engine pid {engine.pid}; logs in {tmp}")
            nice = "the checker's own" if args.check_nice is None else args.check_nice
            print(
                f"{_machine()}; {n} gateway requests a round at c={CONCURRENCY}, {LOGIN_CLIENTS} login clients, "
                f"password checks at nice {nice}"
            )
            print(HEADER, flush=True)
            connector = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=120)
            async with aiohttp.ClientSession(connector=connector, timeout=timeout, auto_decompress=False) as session:
                for stream in (False, True):
                    await load(session, gw, stream, CONCURRENCY, 200)  # warm-up
                    b.gateway_sent += 200
                    for kind in kinds:
                        done: list[tuple[dict, dict]] = []
                        for i in range(pairs):
                            # A then B, then B then A: neither always runs on the warmer machine.
                            if i % 2 == 0:
                                alone = await b.round(session, gw, stream, n, None)
                                beside = await b.round(session, gw, stream, n, kind)
                            else:
                                beside = await b.round(session, gw, stream, n, kind)
                                alone = await b.round(session, gw, stream, n, None)
                            done.append((alone, beside))
                        out.append(summarize(kind, stream, done))
                        _print_row(out[-1])
        finally:
            await close_bench(b, Path(tmp), args.keep_logs)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.logins", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="400 gateway requests a round (not 1,500), 2 pairs")
    parser.add_argument("--pairs", type=int, help="pairs of rounds (A alone, B beside logins) per kind and mode")
    parser.add_argument("--requests", type=int, help="gateway requests a round")
    parser.add_argument("--kinds", help=f"which login traffic, comma-separated (default: {','.join(KINDS)})")
    parser.add_argument(
        "--check-nice",
        type=int,
        help="run the server's password checks at this nice value, not the checker's own "
        "(0: at the gateway's priority, as before they were lowered)",
    )
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--keep-logs", help="copy the processes' logs here at the end")
    # The server process (started by the bench itself).
    parser.add_argument("--server-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nats", help=argparse.SUPPRESS)
    parser.add_argument("--db", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--admin-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.server_process:
        server_process(args.nats, args.db, args.port, args.admin_port, args.check_nice)
        return
    rows = asyncio.run(bench(args))
    print(f"\nafter: {_machine()}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
