"""The embedded NATS server: `nats-server` with JetStream as a child process of `llmgw up`.

The log is the source of truth, so by default the server flushes to disk before it
acknowledges (``sync_interval: always``). NATS's own default flushes every two minutes, and
Jepsen's analysis of NATS 2.12.1 showed acknowledged writes lost on a crash with it; an operator
who prefers speed passes ``--unsafe-no-fsync`` and says so in their runbook.

One server per store, always. Two servers on one JetStream directory both accept writes and
lose each other's, so:

- the server holds ``nats/store.lock`` (flock) for exactly its own lifetime: `up` takes the lock,
  hands the descriptor to the child and closes its own copy;
- the server dies with `up` (``PR_SET_PDEATHSIG``: SIGTERM, so it still flushes and closes
  cleanly), and lives in its own session, so a Ctrl-C reaches `up`, which stops it in order;
- ``nats/server.json`` records its pid, start time and port (and stays after it stops); a new `up`
  stops a recorded server still running (after checking the pid is that very nats-server: start
  time and command line) and waits for the lock before starting its own;
- the port is kept across restarts: the recorded one is tried first, probed with SO_REUSEADDR
  as nats-server binds, so connections of the dead server in TIME_WAIT do not count as taken;
- `up` may restart its server in place (:meth:`EmbeddedNats.restart`, after a full disk:
  ``cli/nats_healer.py``): a clean stop, then the same port, configuration and credentials.

Nobody connects without a user (issue "Trust", item 4): at the first start one credential per role
(``infra/nats_permissions.py``) is made in ``nats/users/<user>.json`` (0600, the folder 0700) with a
random password, kept across restarts; the server's users and permissions are rendered into
``nats/users.conf``, which its configuration includes, so `llmgw ctl nats rotate` and `add-agent`
rewrite that file alone and reload the server (SIGHUP).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import secrets
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import IO

import msgspec
import structlog

from llmgw.agent.supervisor import pid_alive, proc_start_time
from llmgw.events.runtime.connection import NatsCredential
from llmgw.infra import nats_permissions as NP
from llmgw.infra.natsd import NatsConfig, NatsProcess, NatsStartError, render_authorization
from llmgw.infra.private import write_private

log = structlog.get_logger("llmgw.cli.natsd")

DEFAULT_PORT = 4222
LOCK_FILE = "store.lock"
RECORD_FILE = "server.json"
USERS_DIR = "users"
AUTH_FILE = "users.conf"
PR_SET_PDEATHSIG = 1


class ServerRecord(msgspec.Struct, frozen=True, kw_only=True):
    """What ``nats/server.json`` says about the server running on this store."""

    pid: int
    proc_start: int | None  # /proc/<pid>/stat start time: a reused pid is not mistaken for it
    port: int
    conf: str


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether nats-server could listen on ``port``: bound as it binds (SO_REUSEADDR), so a port whose
    only sockets are in TIME_WAIT — a server that just died — is free, and one with a listener is not."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_candidates(requested: int | None, recorded: int | None, avoid: frozenset[int] = frozenset()) -> list[int]:
    """The ports to try, in order; pure. ``requested``: ``--nats-port`` (None: not given, 0: any).

    An explicit port comes first; then the port this store used last time, so everything configured
    with it keeps working; then the default when nothing was asked for. ``avoid``: the ports `up`
    serves HTTP on, never NATS's even while they are still free."""
    out: list[int] = []
    for port in (requested, recorded, DEFAULT_PORT if requested is None else None):
        if port and port not in out and port not in avoid:
            out.append(port)
    return out


def pick_port(
    requested: int | None, recorded: int | None, host: str = "127.0.0.1", avoid: frozenset[int] = frozenset()
) -> int:
    for port in port_candidates(requested, recorded, avoid):
        if port_free(port, host):
            return port
    # The kernel's pick, held until one is found outside ``avoid``: `up` binds its own ports only after
    # NATS is running, so a pick that happens to be one of them would take it from under `up`.
    with contextlib.ExitStack() as held:
        while True:
            s = held.enter_context(socket.socket())
            s.bind((host, 0))
            if s.getsockname()[1] not in avoid:
                return s.getsockname()[1]


# -- credentials ---------------------------------------------------------------------------------


class CredentialError(RuntimeError):
    """A credential file that cannot be read or is not one; the message says what to do."""


def users_dir(data_dir: Path) -> Path:
    """Where `up` keeps one credential file per NATS user."""
    return data_dir / "nats" / USERS_DIR


def credential_path(folder: Path, user: str) -> Path:
    return folder / f"{user}.json"


def read_credential(path: str | Path) -> NatsCredential:
    """The credential in ``path`` (``--nats-creds FILE``)."""
    try:
        return msgspec.json.decode(Path(path).expanduser().read_bytes(), type=NatsCredential)
    except OSError as exc:
        raise CredentialError(
            f"cannot read the NATS credential file {path} ({exc.strerror}): give the file `llmgw up` made in "
            "DATA_DIR/nats/users/ (or `llmgw ctl nats add-agent NODE` printed), readable by this user"
        ) from exc
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CredentialError(
            f'{path} is not a NATS credential file ({exc}): it holds {{"user": …, "password": …}} '
            "as `llmgw up` writes it in DATA_DIR/nats/users/"
        ) from exc


def _new_credential(user: str) -> NatsCredential:
    return NatsCredential(user=user, password=secrets.token_urlsafe(32))


def _write_credential(folder: Path, cred: NatsCredential) -> Path:
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    path = credential_path(folder, cred.user)
    write_private(path, msgspec.json.encode(cred).decode() + "\n")
    return path


def load_credentials(folder: Path) -> list[NatsCredential]:
    """Every role's credential in ``folder`` (files not named after a role are left alone)."""
    out = []
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if NP.is_role(path.stem):
            cred = read_credential(path)
            if cred.user == path.stem:
                out.append(cred)
    return out


def ensure_credentials(folder: Path, users: list[str]) -> list[NatsCredential]:
    """Each of ``users`` gets a credential file in ``folder`` if it has none (0600, a random password); the
    ones there are kept. Returns every credential in ``folder`` (other nodes' agents included)."""
    for user in users:
        NP.permissions_of(user)  # a name that is no role is refused here, before a file is made
        if not credential_path(folder, user).exists():
            _write_credential(folder, _new_credential(user))
    return load_credentials(folder)


def rotate_credentials(folder: Path, user: str | None) -> list[str]:
    """A new random password for ``user`` (None: every user in ``folder``); the users rotated."""
    existing = {c.user for c in load_credentials(folder)}
    if user is not None and user not in existing:
        NP.permissions_of(user)  # an unknown role is refused with the list of roles
        raise CredentialError(f"there is no credential for {user} in {folder}: make it with `llmgw ctl nats add-agent`")
    chosen = sorted(existing) if user is None else [user]
    for name in chosen:
        _write_credential(folder, _new_credential(name))
    return chosen


def default_users(local_node: str | None) -> list[str]:
    """The users `up` makes at its first start: every fixed role, and its local agent's."""
    return [*NP.ROLES, *([NP.agent_user(local_node)] if local_node is not None else [])]


def authorization_text(folder: Path) -> str:
    """The server's ``authorization`` block for the credentials in ``folder``."""
    return render_authorization(NP.users(load_credentials(folder)))


def reload_server(data_dir: Path) -> int | None:
    """Rewrite the running `up` server's users file from the credentials and make it reload (SIGHUP);
    the server's pid, or None when none runs on ``data_dir`` (the next start reads the files)."""
    nats_dir = data_dir / "nats"
    write_private(nats_dir / AUTH_FILE, authorization_text(users_dir(data_dir)))
    record = read_record(nats_dir / RECORD_FILE)
    if record is None or not is_recorded_server(record):
        return None
    os.kill(record.pid, signal.SIGHUP)
    return record.pid


def embedded_config(
    *,
    host: str,
    port: int,
    store_dir: Path,
    durable: bool,
    credentials: list[NatsCredential] | None = None,
) -> NatsConfig:
    """The configuration of `up`'s server; pure. ``credentials``: its users (None: no authorization)."""
    return NatsConfig(
        header="Written by `llmgw up` at every start; edit the flags, not this file.",
        server_name="llmgw-embedded",
        host=host,
        port=port,
        max_payload="8MB",
        store_dir=str(store_dir),
        durable=durable,
        authorization=NP.users(credentials) if credentials is not None else None,
        authorization_file=AUTH_FILE if credentials is not None else None,
    )


def read_record(path: Path) -> ServerRecord | None:
    try:
        return msgspec.json.decode(path.read_bytes(), type=ServerRecord)
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def is_recorded_server(record: ServerRecord) -> bool:
    """True when the recorded pid is still that nats-server on that config (not a reused pid)."""
    if not pid_alive(record.pid, record.proc_start) or record.proc_start is None:
        return False
    try:
        argv = Path(f"/proc/{record.pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(argv) and Path(os.fsdecode(argv[0])).name == "nats-server" and os.fsencode(record.conf) in argv


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: SIGTERM when `up` dies, however it dies (even kill -9)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:
        os._exit(1)  # `up` died before the prctl took effect: nobody would stop this server


def _stop_leftover(record: ServerRecord, grace_s: float) -> None:
    """Stop the recorded server (checked to be it by the caller): SIGTERM, then SIGKILL after ``grace_s``."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(record.pid, sig)
            os.kill(record.pid, signal.SIGCONT)  # a stopped (frozen) server acts on SIGTERM only once resumed
        end = time.monotonic() + wait_s
        while is_recorded_server(record) and time.monotonic() < end:
            time.sleep(0.05)
        if not is_recorded_server(record):
            return


def _try_lock(f: IO) -> bool:
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _wait_lock(f: IO, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while not _try_lock(f):
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)
    return True


class EmbeddedNats:
    """`up`'s server: the shared launcher, plus the store lock, the parent-death signal and the record."""

    def __init__(
        self,
        data_dir: Path,
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        durable: bool = True,
        local_node: str | None = None,
        avoid_ports: frozenset[int] = frozenset(),
    ) -> None:
        self.dir = data_dir / "nats"
        self.users_dir = users_dir(data_dir)
        self.local_node = local_node  # its agent gets a user at the first start
        self.host = host
        self.requested_port = port
        self.avoid_ports = avoid_ports  # `up`'s own HTTP ports, bound after this server starts
        self.port = 0
        self.durable = durable
        self.server: NatsProcess | None = None
        self.restarts = 0  # in-place restarts by `up` (a store that could not be written)
        self.restart_error: str | None = None

    @property
    def proc(self) -> subprocess.Popen[bytes] | None:
        return self.server.proc if self.server is not None else None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def conf(self) -> Path:
        return self.dir / "nats.conf"

    def creds(self, user: str) -> Path:
        """The credential file of ``user`` (made at start)."""
        return credential_path(self.users_dir, user)

    @property
    def record_path(self) -> Path:
        return self.dir / RECORD_FILE

    def start(self, deadline_s: float = 20.0, takeover_grace_s: float = 15.0, *, port: int | None = None) -> None:
        """Start the server on the store; ``port``: exactly this one (a restart), else :func:`pick_port`'s."""
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / LOCK_FILE, "a+") as lock:
            self._take_store(lock, takeover_grace_s)
            if port is not None:
                if not port_free(port, self.host):
                    raise NatsStartError(
                        f"cannot restart the embedded nats-server on {self.host}:{port}: another program took the "
                        "port while it restarted; stop that program and start `llmgw up` again"
                    )
                self.port = port
            else:
                recorded = read_record(self.record_path)
                self.port = pick_port(
                    self.requested_port, recorded.port if recorded else None, self.host, self.avoid_ports
                )
                if self.requested_port and self.port != self.requested_port:
                    log.info("nats port taken, using another", wanted=self.requested_port, port=self.port)
            credentials = ensure_credentials(self.users_dir, default_users(self.local_node))
            config = embedded_config(
                host=self.host,
                port=self.port,
                store_dir=self.dir / "jetstream",
                durable=self.durable,
                credentials=credentials,
            )
            self.server = NatsProcess(config, self.conf, self.dir / "nats-server.log")
            parent = os.getpid()
            # The record is written as soon as the child exists (a crash of `up` while the server
            # starts still leaves it findable), so the launcher is told to write it via on_spawn.
            self.server.start(
                deadline_s,
                pass_fds=(lock.fileno(),),  # the server holds the store's lock for as long as it runs
                start_new_session=True,
                preexec_fn=lambda: _die_with_parent(parent),
                on_spawn=self._write_record,
            )
        # Our copy of the lock is closed: from here on it lives exactly as long as the server.
        log.info(
            "nats-server started", url=self.url, pid=self.proc.pid if self.proc else None, durable_flush=self.durable
        )

    def _take_store(self, lock: IO, grace_s: float) -> None:
        """Hold the store's lock; a server left running on it (its `up` crashed) is stopped first."""
        recorded = read_record(self.record_path)
        if recorded is not None and is_recorded_server(recorded):
            log.warning("a nats-server of an earlier `up` still runs on this store; stopping it", pid=recorded.pid)
            _stop_leftover(recorded, grace_s)
        if _wait_lock(lock, 5.0):
            return
        raise NatsStartError(
            f"the NATS store {self.dir} is locked by a process other than the nats-server {self.record_path} "
            f"names: find it with `fuser {self.dir / LOCK_FILE}` and stop it, or use another --data-dir"
        )

    def _write_record(self) -> None:
        assert self.proc is not None
        record = ServerRecord(
            pid=self.proc.pid, proc_start=proc_start_time(self.proc.pid), port=self.port, conf=str(self.conf)
        )
        tmp = self.record_path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(record))
        tmp.replace(self.record_path)

    def restart(self, grace_s: float = 15.0) -> None:
        """Stop the server cleanly (SIGTERM: it flushes and closes its store) and start it again on the same
        port, configuration and credentials; clients reconnect by themselves. Called from the thread that
        started it: the parent-death signal is tied to that thread. Raises :class:`NatsStartError` when the
        new server cannot start (:meth:`exit_reason` then says so)."""
        self.restart_error = None
        self.stop(grace_s)
        try:
            self.start(port=self.port)
        except NatsStartError as exc:
            self.restart_error = str(exc)
            raise
        self.restarts += 1

    def alive(self) -> bool:
        return self.server is not None and self.server.alive()

    def exit_reason(self) -> str:
        """Why the server is gone, in words: its exit status and its last log line (or why a restart failed)."""
        if self.restart_error is not None:
            return f"restarting it failed: {self.restart_error}"
        return self.server.exit_reason() if self.server is not None else "never started"

    def stop(self, grace_s: float = 15.0) -> None:
        if not self.alive():
            return
        assert self.server is not None
        code = self.server.stop(grace_s)
        log.info("nats-server stopped", code=code)
