"""A small fleet on this machine for tests: services in-process, agents as real processes.

Agents run as `llmgw agent` subprocesses (distinct node ids, data dirs and port ranges), so they
can be killed -9 for real; their engines are real llama.cpp processes serving a tiny GGUF.
Timings are shortened (heartbeats every 0.3 s, a node lost after 3 s, backoff from 0.2 s) so the
tests finish quickly; the behaviour is the product's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgspec

from llmgw.cli.runtime import serve
from llmgw.cli.server_config import ServerConfig
from llmgw.events.commands.client import CommandClient
from llmgw.events.runtime.secrets import engine_key, engine_key_secret
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import models as M
from llmgw.events.schema import replicas as R
from llmgw.events.schema.outcomes import CommandCompleted
from llmgw.services.router.app import RouterConfig
from llmgw.services.scheduler.vocabulary import Config as SchedulerConfig
from tests.signin import cli_env, sign_in_tester
from tests.support import free_port, free_ports, stop_process, wait_until

LLMGW = str(Path(sys.executable).parent / "llmgw")
FAST = SchedulerConfig(lost_after_s=3.0, backoff_base_s=0.2, backoff_cap_s=2.0, stop_grace_s=5.0)


class AgentProc:
    def __init__(
        self, nats_url: str, node_id: str, base: Path, port_lo: int, extra_args: list[str] | None = None
    ) -> None:
        self.node_id = node_id
        self.dir = base / node_id
        self.argv = [
            LLMGW,
            "agent",
            "--nats",
            nats_url,
            "--node-id",
            node_id,
            "--data-dir",
            str(self.dir),
            "--port-range",
            f"{port_lo}-{port_lo + 49}",
            "--heartbeat",
            "0.3",
            # Several agents share this machine's two cores: each offers eight, and the tests' models
            # reserve one each (``add_model``), so placement is about the story a test tells, not the CI box.
            "--cpus",
            "8",
            *(extra_args or []),
        ]
        self.proc: subprocess.Popen | None = None

    def start(self) -> AgentProc:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / "agent.log", "ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT)
        return self

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        stop_process(self.proc)

    def kill_engines(self) -> None:
        for state in self.dir.glob("replicas/*/state.json"):
            with contextlib.suppress(Exception):
                pid = msgspec.json.decode(state.read_bytes())["pid"]
                os.killpg(pid, signal.SIGKILL)

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return (self.dir / "agent.log").read_text()[-4000:]
        return ""


class Fleet:
    """Services (catalog, fleet, scheduler, projections, api) in this process, agents outside it."""

    def __init__(self, store: EventStore, nats_url: str, base: Path) -> None:
        self.store = store
        self.nats_url = nats_url
        self.base = base
        self.agents: dict[str, AgentProc] = {}
        self.admin_port, self.port = free_ports(2)
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.client = CommandClient.for_service(store, "tests")
        self.admin_token = ""  # set by start() when the admin API runs

    async def start(
        self,
        services: tuple[str, ...] = ("catalog", "fleet", "scheduler", "projections", "api"),
        router: RouterConfig | None = None,
        scheduler: SchedulerConfig = FAST,
        **config_fields: Any,
    ) -> Fleet:
        """``config_fields``: more ServerConfig fields (the mirror's ``mirror_dir``, ``hub_endpoint``, …).

        With the admin API, the people service runs too, and ``admin_token`` signs the tests in."""
        if "api" in services and "people" not in services:
            services = (*services, "people")
        if "api" in services and "identity" not in services:
            services = (*services, "identity")
        if "api" in services and "mcp" not in services:
            services = (*services, "mcp")
        if "mirror" in services:
            config_fields.setdefault("mirror_dir", str(self.base / "mirror"))
            config_fields.setdefault("mirror_port", free_port())
        self.mirror_url = f"http://127.0.0.1:{config_fields['mirror_port']}" if "mirror" in services else ""
        config = ServerConfig(
            nats_url=self.nats_url,
            db_dsn=f"sqlite:///{self.base / 'projections.db'}",
            services=services,
            port=self.port,
            admin_port=self.admin_port,
            scheduler=scheduler,
            router=router or RouterConfig(),
            **config_fields,
        )
        ready = asyncio.Event()
        self.handles: dict[str, Any] = {}
        self._task = asyncio.create_task(serve(config, self._stop, on_ready=ready.set, handles=self.handles))
        await asyncio.wait_for(ready.wait(), 30)
        if "api" in services:
            self.admin_token = await sign_in_tester(self.store, self.admin_url)
        return self

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def api_headers(self) -> dict[str, str]:
        """What a test's call to the admin API carries: the tester's token."""
        return {"Authorization": f"Bearer {self.admin_token}"}

    def cli_env(self, **more: str) -> dict[str, str]:
        """The environment a CLI subprocess runs with: signed in as the tester, plus ``more``."""
        return cli_env(self.admin_token, **more)

    def agent(self, node_id: str, extra_args: list[str] | None = None) -> AgentProc:
        port_lo = 21000 + 50 * len(self.agents) + (os.getpid() % 40) * 200
        a = AgentProc(self.nats_url, node_id, self.base, port_lo, extra_args).start()
        self.agents[node_id] = a
        return a

    async def stop(self) -> None:
        for a in self.agents.values():
            a.stop()
            a.kill_engines()
        self._stop.set()
        if self._task:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 30)

    async def command(self, verb: str, payload: msgspec.Struct, service: str = M.SERVICE) -> CommandCompleted:
        return await self.client.send(service, verb, payload, actor="user:test", timeout=20)

    async def add_model(
        self,
        name: str,
        source: Path | str,
        *,
        min_: int = 1,
        max_: int | None = None,
        cores: int = 1,  # one llama.cpp thread: the tiny model needs no more, and the machine has two cores
        memory_gb: float = 0.05,
        args: list[str] | None = None,
        **spec_fields: Any,
    ) -> None:
        profile = M.Profile(
            engine="llamacpp",
            cpu_cores=cores,
            min_memory_gb=memory_gb,
            ctx_size=1024,
            parallel=2,
            args=args or [],
        )
        spec = M.ModelSpec(
            name=name, source=str(source), scaling=M.Scaling(min=min_, max=max_), profiles=[profile], **spec_fields
        )
        await self.command("add", M.AddModel(spec=spec))

    # -- reading the log -------------------------------------------------------------------

    async def replicas(self) -> dict[str, dict[str, Any]]:
        """Every replica's current state, folded from the log."""
        out: dict[str, dict[str, Any]] = {}
        for e in await self.store.read(f"llmgw.evt.{R.AGGREGATE}.>"):
            p = e.payload
            rid = getattr(p, "replica_id", None)
            if rid is None:
                continue
            if isinstance(p, R.ReplicaPlaced):
                out[rid] = {"id": rid, "model": p.model, "node": p.node_id, "state": "placed", "history": []}
            r = out.get(rid)
            if r is None:
                continue
            r["history"].append(e.type)
            match p:
                case R.ReplicaStarting():
                    r["state"], r["pid"] = "starting", p.pid
                case R.ReplicaReady():
                    r["state"], r["pid"], r["url"] = "ready", p.pid, p.url
                case R.ReplicaFailed():
                    r["state"], r["reason"] = "failed", p.reason
                case R.ReplicaStopRequested():
                    r["state"] = "draining"
                case R.ReplicaStopped():
                    r["state"] = "stopped"
        return out

    async def ready(self, model: str) -> list[dict[str, Any]]:
        return [r for r in (await self.replicas()).values() if r["model"] == model and r["state"] == "ready"]

    async def active(self, model: str) -> list[dict[str, Any]]:
        return [
            r
            for r in (await self.replicas()).values()
            if r["model"] == model and r["state"] in ("placed", "starting", "ready")
        ]

    async def wait_ready(self, model: str, n: int, deadline_s: float = 60.0) -> list[dict[str, Any]]:
        async def enough() -> list[dict[str, Any]] | None:
            got = await self.ready(model)
            active = await self.active(model)
            return got if len(got) == n and len(active) == n else None

        return await wait_until(
            enough,
            deadline_s=deadline_s,
            what=f"{n} ready replica(s) of {model}\n" + "\n".join(a.log()[-1500:] for a in self.agents.values()),
        )

    async def router_caught_up(self) -> None:
        """Until this fleet's router has folded everything written so far (events reach it in order)."""
        last = await self.store.stream_last_seq()
        router = self.handles["router"]
        await wait_until(lambda: router.state.position >= last, what="the router to read the log")

    async def key(self, replica_id: str) -> str:
        return engine_key(await engine_key_secret(self.store.js), replica_id)
