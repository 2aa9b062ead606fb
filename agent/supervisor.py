"""The engine supervisor (SPEC FLEET-5, FLEET-6): engines as processes that outlive the agent.

Each engine runs in its own session (process group), with a port from the node's range, the
replica's engine key in its environment, its output in ``DATA/replicas/<id>/engine.log``, and a
state file (``DATA/replicas/<id>/state.json``: pid, port, the process's start time). An agent that
restarts reads the state files, checks the pid is the same process (start time) and still
healthy, and adopts it: the replica never leaves ``ready``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import msgspec
import structlog

from llmgw.agent.engines.commands import (
    EngineLaunch,
    choose_threads,
    llamacpp_launch,
    vllm_launch,
    with_chat_templates,
    with_prompt_cache_bound,
)
from llmgw.agent.engines.health import EngineStartError, probe, wait_healthy
from llmgw.events.schema.replicas import ReplicaPlaced

log = structlog.get_logger("llmgw.agent.supervisor")

LOG_TAIL = 20


class EngineRecord(msgspec.Struct, kw_only=True):
    """What the state file holds: enough to find the engine again after an agent restart."""

    replica_id: str
    model: str
    pid: int
    port: int
    spec_hash: str
    started_at: float
    proc_start: int | None = None  # /proc/<pid>/stat start time: guards against pid reuse
    state: str = "starting"  # starting | ready | stopping


def proc_start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def pid_alive(pid: int, start: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    if start is not None and proc_start_time(pid) != start:
        return False  # the pid now belongs to another process
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False  # a zombie is dead: it only waits to be reaped
    return True


def recorded_engines(agent_dir: Path) -> list[tuple[Path, EngineRecord]]:
    """The engines an agent's state files in ``agent_dir`` name, with their files (unreadable ones skipped)."""
    out = []
    for state in sorted((agent_dir / "replicas").glob("*/state.json")):
        with contextlib.suppress(OSError, msgspec.DecodeError, msgspec.ValidationError):
            out.append((state, msgspec.json.decode(state.read_bytes(), type=EngineRecord)))
    return out


def stop_recorded_engines(agent_dir: Path, grace_s: float = 10.0) -> list[EngineRecord]:
    """Stop the engines recorded in ``agent_dir`` that still run (the same process: start time), for when
    no agent will adopt them; their state files go. Returns the engines stopped."""
    running = []
    for state, rec in recorded_engines(agent_dir):
        if pid_alive(rec.pid, rec.proc_start):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rec.pid, signal.SIGTERM)  # the engine leads its own group: its children go too
            running.append(rec)
        state.unlink(missing_ok=True)
    end = time.monotonic() + grace_s
    for rec in running:
        while pid_alive(rec.pid, rec.proc_start) and time.monotonic() < end:
            time.sleep(0.05)
        if pid_alive(rec.pid, rec.proc_start):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(rec.pid, signal.SIGKILL)
    return running


def tail(path: Path, lines: int = LOG_TAIL) -> list[str]:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return list(deque(data.splitlines(), maxlen=lines))


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class SupervisorConfig(msgspec.Struct, frozen=True, kw_only=True):
    data_dir: Path
    port_range: tuple[int, int] = (20000, 20999)
    host: str = "127.0.0.1"
    advertise_host: str = "127.0.0.1"
    llamacpp_threads: int | None = None
    startup_timeout_s: float = 120.0
    llama_server_binary: str | None = None
    vllm_binary: str = "vllm"


class Supervisor:
    def __init__(self, cfg: SupervisorConfig, cpus: int | None) -> None:
        self.cfg = cfg
        self.cpus = cpus
        self.dir = cfg.data_dir / "replicas"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.engines: dict[str, EngineRecord] = {}
        self._procs: dict[str, subprocess.Popen] = {}  # engines this agent process spawned

    # -- files -------------------------------------------------------------------------------

    def replica_dir(self, rid: str) -> Path:
        return self.dir / rid

    def log_path(self, rid: str) -> Path:
        return self.replica_dir(rid) / "engine.log"

    def _save(self, rec: EngineRecord) -> None:
        d = self.replica_dir(rec.replica_id)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / "state.json.tmp"
        tmp.write_bytes(msgspec.json.encode(rec))
        tmp.replace(d / "state.json")

    def _forget(self, rid: str) -> None:
        self.engines.pop(rid, None)
        self._procs.pop(rid, None)
        with contextlib.suppress(FileNotFoundError):
            (self.replica_dir(rid) / "state.json").unlink()

    def url(self, rec: EngineRecord) -> str:
        return f"http://{self.cfg.advertise_host}:{rec.port}"

    # -- adoption ----------------------------------------------------------------------------

    async def adopt(self, key_of: object, deadline_s: float = 60.0) -> list[EngineRecord]:
        """Engines left running by an earlier agent: kept when the same process is alive and healthy."""
        adopted: list[EngineRecord] = []
        for state in sorted(self.dir.glob("*/state.json")):
            try:
                rec = msgspec.json.decode(state.read_bytes(), type=EngineRecord)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("unreadable engine state file", path=str(state))
                continue
            if not pid_alive(rec.pid, rec.proc_start):
                log.info("engine from an earlier agent is gone", replica=rec.replica_id, pid=rec.pid)
                state.unlink(missing_ok=True)
                continue
            key = key_of(rec.replica_id)  # type: ignore[operator]
            end = time.monotonic() + deadline_s
            healthy = False
            while time.monotonic() < end and pid_alive(rec.pid, rec.proc_start):
                if await probe(self.url(rec), key):
                    healthy = True
                    break
                if rec.state != "ready":
                    break  # it was still starting: the supervisor waits on it again below
                await asyncio.sleep(0.25)
            if healthy or rec.state != "ready":
                self.engines[rec.replica_id] = rec
                adopted.append(rec)
                log.info("engine adopted", replica=rec.replica_id, pid=rec.pid, port=rec.port, healthy=healthy)
            else:
                log.warning("engine from an earlier agent is unhealthy; stopping it", replica=rec.replica_id)
                self._signal(rec.pid, signal.SIGKILL)
                state.unlink(missing_ok=True)
        return adopted

    # -- start -------------------------------------------------------------------------------

    def _pick_port(self) -> int:
        used = {r.port for r in self.engines.values()}
        lo, hi = self.cfg.port_range
        for port in range(lo, hi + 1):
            if port not in used and port_free(port):
                return port
        raise EngineStartError(f"no free port in {lo}-{hi}: widen the agent's port range")

    def launch_for(self, placed: ReplicaPlaced, port: int, key: str, model_path: str) -> EngineLaunch:
        p = placed.profile
        if p.engine == "vllm":
            return vllm_launch(
                model_path,
                host=self.cfg.host,
                port=port,
                gpus=list(placed.gpus),
                tensor_parallel=max(len(placed.gpus), 1),
                key=key,
                served_name=placed.model,
                extra_args=p.args,
                vllm_binary=self.cfg.vllm_binary,
                tool_parser=p.tool_parser,
            )
        # The cores placement reserved for it on this node (the profile's, or the threads rule's share).
        threads = choose_threads(placed.cores or p.cpu_cores, self.cfg.llamacpp_threads, self.cpus)
        binary = self.cfg.llama_server_binary or shutil.which("llama-server")
        # `--embeddings` in a profile's args turns the engine's embeddings endpoint on.
        embeddings = "--embeddings" in p.args or "--embedding" in p.args
        extra = [a for a in p.args if a not in ("--embeddings", "--embedding")]
        # llama.cpp's prompt cache would otherwise grow to 8 GiB of host memory, whatever was reserved.
        extra = with_prompt_cache_bound(extra, p.min_memory_gb)
        extra = with_chat_templates(extra)  # tools and tool_choice need the GGUF's Jinja template
        return llamacpp_launch(
            model_path,
            host=self.cfg.host,
            port=port,
            threads=threads,
            parallel=p.parallel or 4,
            ctx_size=p.ctx_size or 4096,
            key=key,
            extra_args=extra,
            alias=placed.model,
            embeddings=embeddings,
            llama_server_binary=binary,
            python=sys.executable,
        )

    def spawn(self, placed: ReplicaPlaced, key: str, model_path: str | None = None) -> EngineRecord:
        """Start the engine process; raises :class:`EngineStartError` with a reason.

        ``model_path`` is the local file to serve (a weights-cache file for a ``mirror:`` source);
        the placement's source, a local path, when left out."""
        model_path = model_path or placed.source
        if not Path(model_path).exists():
            raise EngineStartError(f"model file {model_path} does not exist on this node")
        port = self._pick_port()
        launch = self.launch_for(placed, port, key, model_path)
        d = self.replica_dir(placed.replica_id)
        d.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **placed.profile.env, **launch.env}
        with open(self.log_path(placed.replica_id), "ab") as out:
            proc = subprocess.Popen(
                launch.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: it outlives the agent
            )
        rec = EngineRecord(
            replica_id=placed.replica_id,
            model=placed.model,
            pid=proc.pid,
            port=port,
            spec_hash=placed.spec_hash,
            started_at=time.time(),
            proc_start=proc_start_time(proc.pid),
        )
        self.engines[rec.replica_id] = rec
        self._procs[rec.replica_id] = proc
        self._save(rec)
        log.info("engine started", replica=rec.replica_id, model=rec.model, pid=rec.pid, port=port)
        return rec

    async def wait_ready(self, rid: str, key: str) -> float:
        rec = self.engines[rid]
        t0 = time.monotonic()
        await wait_healthy(
            self.url(rec), key=key, deadline_s=self.cfg.startup_timeout_s, proc_alive=lambda: self.alive(rid)
        )
        rec.state = "ready"
        self._save(rec)
        return time.monotonic() - t0

    # -- watch and stop ----------------------------------------------------------------------

    def alive(self, rid: str) -> bool:
        rec = self.engines.get(rid)
        if rec is None:
            return False
        proc = self._procs.get(rid)
        if proc is not None:
            return proc.poll() is None
        return pid_alive(rec.pid, rec.proc_start)

    def exit_code(self, rid: str) -> int | None:
        proc = self._procs.get(rid)
        return proc.poll() if proc is not None else None

    def exited(self) -> list[tuple[EngineRecord, int | None, list[str]]]:
        """Engines that exited without being asked to, with exit code and last log lines; forgotten."""
        out = []
        for rid, rec in list(self.engines.items()):
            if rec.state != "stopping" and not self.alive(rid):
                out.append((rec, self.exit_code(rid), tail(self.log_path(rid))))
                self._forget(rid)
        return out

    def _signal(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, sig)  # the engine leads its own group: its children go too

    async def stop(self, rid: str, grace_s: float) -> None:
        rec = self.engines.get(rid)
        if rec is None:
            return
        rec.state = "stopping"
        self._save(rec)
        self._signal(rec.pid, signal.SIGTERM)
        end = time.monotonic() + max(grace_s, 0.0)
        while self.alive(rid) and time.monotonic() < end:
            await asyncio.sleep(0.1)
        if self.alive(rid):
            log.warning("engine ignored SIGTERM; killing it", replica=rid, pid=rec.pid)
            self._signal(rec.pid, signal.SIGKILL)
            while self.alive(rid):
                await asyncio.sleep(0.05)
        self._forget(rid)
        log.info("engine stopped", replica=rid)

    def kill_failed(self, rid: str) -> list[str]:
        """Kill an engine that failed to become ready; its last log lines."""
        rec = self.engines.get(rid)
        if rec is not None:
            self._signal(rec.pid, signal.SIGKILL)
            proc = self._procs.get(rid)
            if proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
        lines = tail(self.log_path(rid))
        self._forget(rid)
        return lines

    def load(self, rid: str) -> tuple[int | None, float | None]:
        """(RSS bytes, CPU seconds so far) of an engine, from /proc."""
        rec = self.engines.get(rid)
        if rec is None:
            return None, None
        rss = cpu = None
        with contextlib.suppress(OSError, ValueError, IndexError):
            for line in Path(f"/proc/{rec.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
            fields = Path(f"/proc/{rec.pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return rss, cpu
