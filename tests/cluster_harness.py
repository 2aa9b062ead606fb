"""The cluster shape on loopback: three NATS nodes, PostgreSQL, two `llmgw server`s, agents, a model.

``python -m tests.cluster up [--dir D] [--prometheus]`` starts it in the background (with
``--prometheus``, a Prometheus scraping it with the project's alert rules) and prints where it is;
``down`` stops everything it started (the pids are in ``D/harness.json``); ``status`` says what
runs. Tests use it as ``async with ClusterHarness(tmp_path) as c:`` and take parts away with
:meth:`ClusterHarness.kill9`, :meth:`ClusterHarness.restart`, :meth:`ClusterHarness.pause_nats`…

Every server runs every service (two schedulers: one leads; two projection runners on one
database: compare-and-set checkpoints), against the same PostgreSQL; each has its own ports, data
directory and usage journal. Timings are shortened through the servers' own settings
(``$LLMGW_SCHEDULER_…``) so a lost node is noticed in seconds; the behaviour is the product's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import msgspec

from llmgw.events.runtime.secrets import engine_key_secret
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema.catalog import default_registry
from tests.cluster import ClusterNode, NatsCluster
from tests.fleet import LLMGW, AgentProc, Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.support import Postgres, free_ports, stop_process, wait_until

MODEL = "tiny"
SERVICES = "tenancy,access,people,catalog,fleet,scheduler,projections,api,router,accountant,mirror,jobs"
# The servers' settings, shortened for a machine where everything restarts within seconds.
FAST_ENV = {
    # Above the ~15 s a NATS client takes to leave a paused server (3 missed pings): an agent on a paused
    # node cannot heartbeat that long, and a shorter limit calls its node lost (docs/reliability.md).
    "LLMGW_SCHEDULER_LOST_AFTER_S": "20",
    "LLMGW_SCHEDULER_BACKOFF_BASE_S": "0.2",
    "LLMGW_SCHEDULER_BACKOFF_CAP_S": "2",
    "LLMGW_SCHEDULER_STOP_GRACE_S": "5",
    "LLMGW_SCHEDULER_FIRST_NODE_WAIT_S": "5",
    "LLMGW_ROUTER_FIRST_TOKEN_S": "20",
    "LLMGW_ROUTER_IDLE_S": "20",
    "LLMGW_ROUTER_TOTAL_S": "60",
    "LLMGW_ROUTER_ACTIVATION_S": "30",
}


class ServerProc:
    """One `llmgw server` subprocess with every service, on ports and a data directory of its own."""

    def __init__(self, name: str, base: Path, nats_urls: str, db: str, first_admin_dir: Path | None) -> None:
        self.name = name
        self.dir = base / name
        self.port, self.admin_port, self.mirror_port = free_ports(3)
        self.argv = [
            LLMGW,
            "server",
            "--nats",
            nats_urls,
            "--db",
            db,
            "--services",
            SERVICES,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--admin-port",
            str(self.admin_port),
            "--mirror-port",
            str(self.mirror_port),
            "--mirror-dir",
            str(self.dir / "mirror"),
            "--usage-journal",
            str(self.dir / "usage-journal"),
            "--replicas",
            "3",
            *(["--first-admin-dir", str(first_admin_dir)] if first_admin_dir else []),
        ]
        self.env = {**os.environ, **FAST_ENV, "LLMGW_DATA_DIR": str(self.dir), "LLMGW_LOG_FORMAT": "json"}
        self.proc: subprocess.Popen[bytes] | None = None
        self.killed_at: list[float] = []  # time.monotonic() of each kill -9

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start(self) -> ServerProc:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "server.log", "ab") as out:
            self.proc = subprocess.Popen(
                self.argv, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill9(self) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.killed_at.append(time.monotonic())
            self.proc.wait()

    def stop(self, grace_s: float = 30.0) -> None:
        stop_process(self.proc, grace_s)

    def healthy(self) -> bool:
        return _http_status(f"{self.admin_url}/healthz") == 200

    def leads(self) -> bool:
        """Whether this server's scheduler says it leads (``llmgw_control_plane_leader`` 1)."""
        text = _http_text(f"{self.admin_url}/metrics")
        return bool(text and re.search(r"^llmgw_control_plane_leader\{[^}]*\} 1\.0$", text, re.M))

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "server.log").read_text(errors="replace")[-3000:]
        return ""


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _http_text(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.read().decode(errors="replace")
    except OSError:
        return None


class HarnessInfo(msgspec.Struct):
    """What `up` prints and `down` reads (``D/harness.json``)."""

    nats_urls: str
    db: str
    gateways: list[str]
    admin_urls: list[str]
    key: str
    project: str
    admin_user: str
    admin_password_file: str
    admin_token_file: str
    model: str
    pids: dict[str, int] = {}
    supervisor_pid: int = 0
    prometheus_url: str = ""  # with `up --prometheus`


class ClusterHarness:
    """Everything of a cluster on loopback, for tests (``async with``) and for people (``up``/``down``)."""

    def __init__(self, base: Path, *, agents: int = 2, replicas: int = 2, servers: int = 2) -> None:
        self.base = base
        self.n_agents = agents
        self.n_replicas = replicas
        self.n_servers = servers
        self.nats = NatsCluster(base / "nats")
        self.pg = Postgres(base / "pg")
        self.servers: list[ServerProc] = []
        self.admin_dir = base / "admin"
        self.key = ""
        self.project = ""
        self.db = ""
        self.store: EventStore | None = None
        self.fleet: Fleet | None = None

    # -- start and stop ----------------------------------------------------------------------

    async def __aenter__(self) -> ClusterHarness:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        from tests.test_gateway import make_key, make_tenant  # the log appends the gateway tests make keys with

        self.base.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(self.nats.start, 60.0)
        self.pg.start()
        self.db = await self.pg.new_database()
        self.store = await EventStore.connect(self.nats.urls, default_registry(), replicas=3)
        await self.store.ensure_streams()
        await engine_key_secret(self.store.js)
        for i in range(self.n_servers):
            first = self.admin_dir if i == 0 else None
            self.servers.append(ServerProc(f"server{i + 1}", self.base, self.nats.urls, self.db, first).start())
        for s in self.servers:
            await wait_until(lambda s=s: self._healthy_or_dead(s), deadline_s=120, what=f"{s.name} healthy\n{s.log()}")
        tenant = await make_tenant(self.store)
        self.project = tenant.project
        self.key, _ = await make_key(self.store, tenant)
        self.fleet = Fleet(self.store, self.nats.urls, self.base / "agents")
        for i in range(self.n_agents):
            self.fleet.agent(f"n{i + 1}")
        await wait_until(
            lambda: (self.admin_dir / "admin-token").exists(), deadline_s=60, what="the first admin's token"
        )
        await self.fleet.add_model(MODEL, write_tiny_gguf(self.base / "tiny.gguf"), min_=self.n_replicas)
        await self.fleet.wait_ready(MODEL, self.n_replicas, deadline_s=180)
        for s in self.servers:
            await wait_until(lambda s=s: self.answers(s), deadline_s=60, what=f"{s.name}'s gateway answering 200")

    def _healthy_or_dead(self, s: ServerProc) -> bool:
        if not s.alive():
            raise RuntimeError(f"{s.name} exited with {s.proc.returncode if s.proc else '?'}:\n{s.log()}")
        return s.healthy()

    async def stop(self) -> None:
        if self.fleet is not None:
            for a in self.fleet.agents.values():
                await asyncio.to_thread(a.stop)
                a.kill_engines()
        for s in self.servers:
            await asyncio.to_thread(s.stop)
        if self.store is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.store.close(), 10)
        await asyncio.to_thread(self.nats.stop)
        self.pg.stop()

    # -- what runs ---------------------------------------------------------------------------

    @property
    def gateways(self) -> list[str]:
        return [s.gateway_url for s in self.servers]

    @property
    def admin_token(self) -> str:
        return (self.admin_dir / "admin-token").read_text().strip()

    def cli_env(self, server: int = 0) -> dict[str, str]:
        """The environment a CLI subprocess reaches this cluster with, as its first admin."""
        return {
            **os.environ,
            "LLMGW_NATS_URL": self.nats.urls,
            "LLMGW_API_URL": self.servers[server].admin_url,
            "LLMGW_TOKEN": self.admin_token,
        }

    def role(self, role: str) -> Any:
        """``server1``, ``agent:n1`` or ``nats:n2``: the process behind a role."""
        kind, _, name = role.partition(":")
        if kind == "agent":
            assert self.fleet is not None
            return self.fleet.agents[name]
        if kind == "nats":
            return next(n for n in self.nats.nodes if n.name == name)
        return next(s for s in self.servers if s.name == role)

    def pids(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.servers:
            if s.alive():
                out[s.name] = s.proc.pid  # type: ignore[union-attr]
        for n in self.nats.running():
            out[f"nats:{n.name}"] = n.proc.pid  # type: ignore[union-attr]
        if self.fleet is not None:
            for node_id, a in self.fleet.agents.items():
                if a.proc is not None and a.proc.poll() is None:
                    out[f"agent:{node_id}"] = a.proc.pid
            for node_id, pid in self.engines().items():
                out[f"engine:{node_id}"] = pid
        return out

    def engines(self) -> dict[str, int]:
        """``replica id → engine pid`` of the engines the agents' state files name."""
        out: dict[str, int] = {}
        assert self.fleet is not None
        for a in self.fleet.agents.values():
            for state in a.dir.glob("replicas/*/state.json"):
                with contextlib.suppress(Exception):
                    pid = int(msgspec.json.decode(state.read_bytes())["pid"])
                    os.kill(pid, 0)
                    out[state.parent.name] = pid
        return out

    def leader(self) -> ServerProc | None:
        """The server whose scheduler leads, when exactly one says so."""
        leading = [s for s in self.servers if s.alive() and s.leads()]
        return leading[0] if len(leading) == 1 else None

    def lost_nodes(self) -> int:
        """How many nodes the leading scheduler calls lost (``llmgw_nodes{state="lost"}``; 0 without a leader)."""
        leader = self.leader()
        text = _http_text(f"{leader.admin_url}/metrics") if leader is not None else None
        found = re.search(r'^llmgw_nodes\{state="lost"\} (\S+)$', text or "", re.M)
        return int(float(found.group(1))) if found else 0

    def metrics_targets(self) -> dict[str, str]:
        """``name → host:port`` of every process that publishes /metrics: each server's admin port (agents,
        engines and nats-server publish none in Prometheus's format)."""
        return {s.name: f"127.0.0.1:{s.admin_port}" for s in self.servers}

    def answers(self, s: ServerProc) -> bool:
        body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        req = urllib.request.Request(
            f"{s.gateway_url}/v1/chat/completions",
            data=body.encode(),
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status == 200
        except OSError:
            return False

    # -- faults ------------------------------------------------------------------------------

    def kill9(self, role: str) -> None:
        """``kill -9`` the process behind ``role`` (``server1``, ``agent:n1``, ``nats:n2``)."""
        target = self.role(role)
        if isinstance(target, ClusterNode):
            self.nats.kill(target)
        else:
            target.kill9()

    def kill_engine(self) -> str:
        """``kill -9`` one engine (its process group); the replica it served."""
        replica, pid = sorted(self.engines().items())[0]
        os.killpg(pid, signal.SIGKILL)
        return replica

    async def restart(self, role: str) -> None:
        """Start ``role`` again as it was (after a kill): a server is waited on until healthy."""
        target = self.role(role)
        if isinstance(target, ClusterNode):
            await asyncio.to_thread(self.nats.start_node, target)
            await asyncio.to_thread(self.nats.wait_for_leader, 60.0)
        elif isinstance(target, AgentProc):
            target.start()
        else:
            target.start()
            await wait_until(lambda: self._healthy_or_dead(target), deadline_s=120, what=f"{role} healthy again")

    def pause_nats(self, name: str) -> None:
        self.nats.pause(self.role(f"nats:{name}"))

    def resume_nats(self, name: str) -> None:
        self.nats.resume(self.role(f"nats:{name}"))

    async def kill_everything_and_restart(self) -> None:
        """Every NATS node, server and agent killed -9 at once (engines live on: agents adopt them), then
        all started again: NATS first, since nothing else can start without a quorum."""
        assert self.fleet is not None
        for s in self.servers:
            s.kill9()
        for a in self.fleet.agents.values():
            a.kill9()
        for n in self.nats.nodes:
            self.nats.kill(n)
        for n in self.nats.nodes:
            await asyncio.to_thread(self.nats.start_node, n)
        await asyncio.to_thread(self.nats.wait_for_leader, 60.0)
        for s in self.servers:
            s.start()
        for a in self.fleet.agents.values():
            a.start()
        for s in self.servers:
            await wait_until(lambda s=s: self._healthy_or_dead(s), deadline_s=120, what=f"{s.name} healthy again")

    def info(self) -> HarnessInfo:
        return HarnessInfo(
            nats_urls=self.nats.urls,
            db=self.db,
            gateways=self.gateways,
            admin_urls=[s.admin_url for s in self.servers],
            key=self.key,
            project=self.project,
            admin_user="admin",
            admin_password_file=str(self.admin_dir / "admin-password"),
            admin_token_file=str(self.admin_dir / "admin-token"),
            model=MODEL,
            pids=self.pids(),
            supervisor_pid=os.getpid(),
        )


# -- the command line ------------------------------------------------------------------------------

STATE = "harness.json"


def _default_dir() -> Path:
    return Path(os.environ.get("LLMGW_HARNESS_DIR", "/tmp/llmgw-cluster"))


async def _run(base: Path, prometheus: bool = False) -> None:
    """The supervisor `up` leaves behind: holds the cluster (and, asked, a Prometheus scraping it) until
    SIGTERM, then stops it all."""
    from tests.faults.prometheus import Prometheus

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with ClusterHarness(base) as h:
        info = h.info()
        prom = Prometheus(base / "prometheus", h.metrics_targets()) if prometheus else None
        try:
            if prom is not None:
                await asyncio.to_thread(prom.start)
                assert prom.proc is not None
                info.prometheus_url = prom.url
                info.pids["prometheus"] = prom.proc.pid
            (base / STATE).write_bytes(msgspec.json.encode(info))
            await stop.wait()
        finally:
            if prom is not None:
                await asyncio.to_thread(prom.stop)
    with contextlib.suppress(OSError):
        (base / STATE).unlink()


def up(base: Path, prometheus: bool = False) -> int:
    from tests.faults.prometheus import NO_PROMETHEUS, prometheus_binary

    if (base / STATE).exists():
        print(f"a cluster already runs from {base}: `python -m tests.cluster down --dir {base}` first", file=sys.stderr)
        return 1
    if prometheus and prometheus_binary() is None:
        print(f"cannot start Prometheus beside the cluster: {NO_PROMETHEUS}", file=sys.stderr)
        return 1
    base.mkdir(parents=True, exist_ok=True)
    log = base / "harness.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.cluster",
                "_run",
                "--dir",
                str(base),
                *(["--prometheus"] if prometheus else []),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=Path(__file__).resolve().parent.parent,
        )
    end = time.monotonic() + 600
    while time.monotonic() < end:
        if (base / STATE).exists():
            info = msgspec.json.decode((base / STATE).read_bytes(), type=HarnessInfo)
            _print(info, base)
            return 0
        if proc.poll() is not None:
            print(f"the cluster did not start (exit {proc.returncode}); see {log}", file=sys.stderr)
            return 1
        time.sleep(0.5)
    print(f"the cluster did not start within 10 minutes; see {log}", file=sys.stderr)
    return 1


def _print(info: HarnessInfo, base: Path) -> None:
    print(f"gateways:   {' '.join(info.gateways)}")
    print(f"admin APIs: {' '.join(info.admin_urls)}")
    print(f"NATS:       {info.nats_urls}")
    print(f"database:   {info.db}")
    print(f"key:        {info.key}   (project {info.project}, model {info.model})")
    print(f"admin:      user {info.admin_user}, password in {info.admin_password_file}")
    print(f"CLI:        export LLMGW_NATS_URL={info.nats_urls} LLMGW_API_URL={info.admin_urls[0]}")
    print(f"            export LLMGW_TOKEN=$(cat {info.admin_token_file})")
    if info.prometheus_url:
        print(f"Prometheus: {info.prometheus_url}   (alerts: {info.prometheus_url}/alerts)")
    print(f"stop with:  python -m tests.cluster down --dir {base}")


def down(base: Path) -> int:
    try:
        info = msgspec.json.decode((base / STATE).read_bytes(), type=HarnessInfo)
    except OSError:
        print(f"no cluster runs from {base}", file=sys.stderr)
        return 1
    with contextlib.suppress(ProcessLookupError):
        os.kill(info.supervisor_pid, signal.SIGTERM)
    end = time.monotonic() + 120
    while time.monotonic() < end and _alive(info.supervisor_pid):
        time.sleep(0.2)
    # Whatever the supervisor could not stop (it was killed itself, say): its children, by pid.
    for role, pid in info.pids.items():
        if _alive(pid):
            with contextlib.suppress(ProcessLookupError):
                if role.startswith("engine:"):
                    os.killpg(pid, signal.SIGKILL)
                else:
                    os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(OSError):
        (base / STATE).unlink()
    print(f"stopped the cluster of {base}")
    return 0


def status(base: Path) -> int:
    try:
        info = msgspec.json.decode((base / STATE).read_bytes(), type=HarnessInfo)
    except OSError:
        print(f"no cluster runs from {base}")
        return 1
    _print(info, base)
    for role, pid in sorted(info.pids.items()):
        print(f"  {role:<14} pid {pid:<8} {'running' if _alive(pid) else 'GONE'}")
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped) is not running.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    return True


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m tests.cluster", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=["up", "down", "status", "_run"])
    parser.add_argument("--dir", type=Path, default=_default_dir(), help="where the cluster's state lives")
    parser.add_argument(
        "--prometheus",
        action="store_true",
        help="up: also a Prometheus scraping every server with ops/prometheus/alerts.yml (needs Debian's prometheus)",
    )
    args = parser.parse_args(argv)
    base = args.dir.resolve()
    if args.command == "up":
        return up(base, args.prometheus)
    if args.command == "down":
        return down(base)
    if args.command == "status":
        return status(base)
    asyncio.run(_run(base, args.prometheus))
    return 0
