"""`llmgw up` as a process for tests: started on ports of its own, waited on until healthy, driven
through the real CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmgw.cli.natsd import read_credential, users_dir
from llmgw.events.runtime.connection import NatsCredential
from llmgw.infra import nats_permissions as NP
from tests.support import free_ports

LLMGW = str(Path(sys.executable).parent / "llmgw")
DEADLINE_S = 30.0


def wait_for(condition: Callable[[], Any], what: str, deadline_s: float = DEADLINE_S) -> Any:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {deadline_s}s waiting for {what}")


def nats_servers(data_dir: Path) -> list[int]:
    """Pids of the live nats-server processes serving this data directory's store."""
    conf = os.fsencode(data_dir / "nats" / "nats.conf")
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"nats-server") and conf in argv:  # a zombie's cmdline is empty
            pids.append(int(entry.name))
    return sorted(pids)


class Up:
    """One `llmgw up` process on a data directory, on ports of its own."""

    def __init__(self, data_dir: Path, *, demo: bool = False) -> None:
        self.data_dir = data_dir
        self.demo = demo
        self.port, self.admin_port = free_ports(2)
        self.proc: subprocess.Popen | None = None
        self.log = data_dir.parent / f"up-{self.port}.log"

    def argv(self, *extra: str) -> list[str]:
        return [
            LLMGW,
            "up",
            "--data-dir",
            str(self.data_dir),
            "--port",
            str(self.port),
            "--admin-port",
            str(self.admin_port),
            "--nats-port",
            "0",
            *([] if self.demo else ["--no-demo"]),
            *extra,
        ]

    def start(self, *extra: str) -> Up:
        self.proc = self.spawn(self.argv(*extra))

        def up_and_healthy() -> bool:
            assert self.proc is not None and self.proc.poll() is None, f"llmgw up exited early:\n{self.output()}"
            info = self.run_info()
            return info is not None and info["pid"] == self.proc.pid and self.healthy()

        wait_for(up_and_healthy, f"llmgw up to become healthy; its output:\n{self.output()}")
        return self

    def spawn(self, argv: list[str]) -> subprocess.Popen:
        """The process, its output appended to :attr:`log`."""
        self.log.write_bytes(b"")
        return subprocess.Popen(argv, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)

    def output(self) -> str:
        """Everything the process printed (its log grows with each service it runs: no tail is enough)."""
        try:
            return self.log.read_text(errors="replace")
        except FileNotFoundError:
            return "(its output goes elsewhere)"

    def run_info(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.data_dir / "run.json").read_text())
        except (OSError, ValueError):
            return None

    def nats_url(self) -> str:
        info = self.run_info()
        assert info is not None
        return info["nats_url"]

    def nats_creds(self) -> NatsCredential:
        """The operator's NATS credential `up` made at its first start (its server lets no one in without one)."""
        return read_credential(users_dir(self.data_dir) / f"{NP.OPERATOR}.json")

    def nats_port(self) -> int:
        return int(self.nats_url().rsplit(":", 1)[1])

    def health(self, port: int) -> int:
        """The status of ``/healthz`` on ``port`` (0: nothing answers)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                return r.status
        except OSError:
            return 0

    def healthy(self) -> bool:
        return self.health(self.admin_port) == 200

    def nats_pid(self) -> int:
        """The pid of the nats-server serving this data directory (0: none)."""
        pids = nats_servers(self.data_dir)
        return pids[0] if pids else 0

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(60)

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "LLMGW_DATA_DIR": str(self.data_dir)}
        env.pop("LLMGW_NATS_URL", None)
        env.pop("LLMGW_API_URL", None)
        return subprocess.run([LLMGW, *args], capture_output=True, text=True, env=env, timeout=120)
