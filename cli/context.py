"""How a CLI command finds the system: the data directory of a running `llmgw up`, or flags/env.

`llmgw up` writes ``DATA_DIR/run.json`` with the addresses it serves; every other command reads
it, unless ``--nats URL`` / ``LLMGW_NATS_URL`` (and ``--api URL`` / ``LLMGW_API_URL``) say where.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import msgspec

from llmgw.cli.credentials import token_for
from llmgw.events.commands.errors import Unreachable

RUN_FILE = "run.json"


class RunInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a running `llmgw up` tells other commands."""

    pid: int
    nats_url: str
    admin_url: str
    gateway_url: str
    data_dir: str
    mirror_url: str | None = None  # its file server, for agents


def default_data_dir() -> Path:
    env = os.environ.get("LLMGW_DATA_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "llmgw"


_ELSEWHERE = "or choose another with --data-dir or LLMGW_DATA_DIR"


def explain_dir_error(path: Path, exc: OSError) -> str:
    """One line a person can act on, for a data directory that cannot be used; pure."""
    why = exc.strerror or str(exc)
    if exc.errno in (errno.EROFS,):
        return f"the data directory {path} is on a read-only file system: remount it read-write, {_ELSEWHERE}"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return f"the data directory {path} is not writable ({why}): give this user write access to it, {_ELSEWHERE}"
    if exc.errno in (errno.ENOTDIR, errno.EEXIST):
        return f"the data directory {path} is not a directory: move what is there away, {_ELSEWHERE}"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"the data directory {path} has no space left ({why}): free space on its disk, {_ELSEWHERE}"
    return f"the data directory {path} cannot be used ({why}): {_ELSEWHERE.removeprefix('or ')}"


def data_dir_problem(data_dir: Path) -> str | None:
    """Why `llmgw up` cannot keep its data in ``data_dir`` (one line), or None: each directory it writes
    is created and a small file written, flushed and removed there — so a read-only mount, a file in
    the way, missing permissions or a full disk are found before anything starts."""
    for path in (data_dir, data_dir / "nats"):
        try:
            path.mkdir(parents=True, exist_ok=True)
            if not path.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(path))
            probe = path / ".llmgw-write-check"
            try:
                with probe.open("wb") as f:
                    f.write(b"\0" * 4096)
                    f.flush()
                    os.fsync(f.fileno())
            finally:
                probe.unlink(missing_ok=True)
        except OSError as exc:
            return explain_dir_error(path, exc)
    return None


def read_run_info(data_dir: Path) -> RunInfo | None:
    path = data_dir / RUN_FILE
    try:
        info = msgspec.json.decode(path.read_bytes(), type=RunInfo)
    except (FileNotFoundError, msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not _alive(info.pid):
        return None
    return info


def write_run_info(data_dir: Path, info: RunInfo) -> None:
    path = data_dir / RUN_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(json.dumps(msgspec.to_builtins(info), indent=2).encode())
    tmp.replace(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Target(msgspec.Struct, frozen=True):
    nats_url: str
    api_url: str | None
    token: str | None = None  # what the admin API is called with (cli/credentials.py)
    nats_creds: str | None = None  # the NATS credential file to connect with (None: no user)


OPERATOR_CREDS = Path("nats") / "users" / "operator.json"  # cli/natsd.py: what `up` makes at its first start


def resolve(nats_url: str | None, api_url: str | None, data_dir: str | None, nats_creds: str | None = None) -> Target:
    nats_url = nats_url or os.environ.get("LLMGW_NATS_URL")
    api_url = api_url or os.environ.get("LLMGW_API_URL")
    nats_creds = nats_creds or os.environ.get("LLMGW_NATS_CREDS") or None
    if nats_url and api_url:
        return Target(nats_url, api_url, token_for(api_url, None), nats_creds)
    where = Path(data_dir).expanduser() if data_dir else default_data_dir()
    info = read_run_info(where)
    if info is None:
        if nats_url:
            return Target(nats_url, api_url, token_for(api_url, None), nats_creds)
        raise Unreachable(
            f"no running `llmgw up` found in {where}: start one with `llmgw up`, "
            "or say where the system is with --nats URL (or LLMGW_NATS_URL) and --api URL"
        )
    api = api_url or info.admin_url
    nats = nats_url or info.nats_url
    if nats_creds is None and nats == info.nats_url and (where / OPERATOR_CREDS).exists():
        # On the `up` machine its operator's credential, so its commands need no flags (another NATS: none).
        nats_creds = str(where / OPERATOR_CREDS)
    # The up's own admin token only for its own admin API (another address is another system).
    return Target(nats, api, token_for(api, where if api == info.admin_url else None), nats_creds)
