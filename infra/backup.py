"""Backup and restore of everything llmgw keeps in JetStream (SPEC OPS-3), as one archive file.

Each stream — the log's five, and the key-value buckets and object stores, which are streams too
(``KV_llmgw_secrets``, ``OBJ_llmgw_snapshots``…) — is copied with the server's own stream snapshot
API (``$JS.API.STREAM.SNAPSHOT``) and put back with its restore API (``$JS.API.STREAM.RESTORE``):
the server writes and reads its own block files, so a restored stream has the same sequence
numbers, subjects, headers (``Nats-Msg-Id`` included), timestamps, deleted gaps and config, and
the projections' stored positions stay true (docs/decisions.md, "Backups are the server's stream
snapshots"). nats-py has no wrapper for it; the protocol is small and is spoken here:

- snapshot: subscribe to an inbox, ask ``$JS.API.STREAM.SNAPSHOT.<stream>`` to deliver there; each
  chunk carries a reply subject the client acks (the server's flow control); an empty message ends
  it, its status (none or 204: complete; 408/500: failed, with a description);
- restore: ask ``$JS.API.STREAM.RESTORE.<stream>`` with the config and state, send the chunks as
  requests to the subject it answers with (each acked), then an empty request, answered with the
  new stream's info or an error.

The archive is a plain tar (the snapshots are already s2-compressed): ``streams/<name>.snap`` per
stream, ``files/<path>`` for what a restore needs from the data directory (the CA, the NATS users'
credentials, the first administrator's token), and ``manifest.json`` last, listing every member
with its size and sha256 and every stream with its first/last sequence and message count. A
restore checks the whole archive against its manifest before it touches the cluster.

Decisions (which archives rotation deletes, whether a cluster may be restored into, whether an
archive is whole) are pure functions; the rest is thin I/O.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import importlib.metadata
import json
import os
import re
import tarfile
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import IO, Any

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError

FORMAT = 1
MANIFEST = "manifest.json"
SUFFIX = ".tar"
PREFIX = "llmgw-backup-"
CHUNK = 128 * 1024  # snapshot chunks the server sends (its default), and restore chunks we send
# A restore stores every message again. A server that flushes each write (`sync_interval: always`)
# does so hundreds of times a second, and gives up on a restore whose chunk it has not taken within
# 5 s (one compressed block of the snapshot holds thousands of messages): what to say then.
TOO_SLOW = (
    "the server took more than 5 s to store part of {stream} and gave up: a nats-server that flushes every "
    "write (sync_interval: always) restores too slowly. Restore into servers running without it, then set it "
    "again and restart them one at a time (`llmgw --data-dir DIR restore ARCHIVE` does this by itself); what it "
    "stored of {stream} is left there: run the restore again with --force"
)
API_TIMEOUT_S = 30.0
# What a restore needs from the data directory (`llmgw up`'s), relative to it: the CA and the
# certificates it issued, the NATS users' passwords (agents keep theirs), the first administrator's
# token and password files and the demo key. Projections, the mirror's files and journals are not:
# the first are rebuilt from the log, the others fetched or replayed again.
DATA_FILES = ("pki", "nats/users", "admin-token", "admin-password", "demo-key")
_NAME = re.compile(rf"^{re.escape(PREFIX)}(\d{{8}}T\d{{6}}(?:\d{{6}})?Z){re.escape(SUFFIX)}$")


class BackupError(Exception):
    """A backup or restore could not be done; the message says what is wrong and what to do."""


class StreamEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One stream in the archive: where its log stood when it was copied, and its snapshot's digest."""

    name: str
    first_seq: int
    last_seq: int
    messages: int
    bytes: int  # the stream's own size on the server
    size: int  # the snapshot's size in the archive
    sha256: str
    config: dict[str, Any]  # as the server reported it; what the restore recreates the stream with
    state: dict[str, Any]


class FileEntry(msgspec.Struct, frozen=True, kw_only=True):
    path: str  # relative to the data directory
    size: int
    sha256: str
    mode: int


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    format: int
    llmgw_version: str
    created_at: str
    streams: tuple[StreamEntry, ...]
    files: tuple[FileEntry, ...] = ()


class BackupResult(msgspec.Struct, frozen=True, kw_only=True):
    path: str
    size: int
    duration_s: float
    manifest: Manifest
    deleted: tuple[str, ...] = ()


class RestoreResult(msgspec.Struct, frozen=True, kw_only=True):
    streams: tuple[StreamEntry, ...]
    replaced: tuple[str, ...]
    files_written: tuple[str, ...]
    files_kept: tuple[str, ...]  # already in the data directory, left as they were
    duration_s: float


# -- pure rules ------------------------------------------------------------------------------


def archive_name(at: dt.datetime) -> str:
    """The file name of a backup taken at ``at`` (UTC): sorts by time, microseconds so two never clash."""
    return f"{PREFIX}{at.astimezone(dt.UTC).strftime('%Y%m%dT%H%M%S%fZ')}{SUFFIX}"


def archive_time(name: str) -> dt.datetime | None:
    """When the archive called ``name`` was taken, or None for a file that is no backup archive."""
    m = _NAME.match(name)
    if not m:
        return None
    stamp = m.group(1)
    return dt.datetime.strptime(stamp, "%Y%m%dT%H%M%S%fZ" if len(stamp) > 16 else "%Y%m%dT%H%M%SZ").replace(
        tzinfo=dt.UTC
    )


def to_prune(names: Iterable[str], keep: int) -> list[str]:
    """Which backup archives rotation deletes: all but the newest ``keep`` (other files are never touched)."""
    ours = sorted((n for n in names if _NAME.match(n)), key=lambda n: _NAME.match(n).group(1).ljust(21, "0"))  # type: ignore[union-attr]
    return ours[: max(0, len(ours) - max(1, keep))]


def restore_refusal(existing: dict[str, int], archived: Sequence[str], force: bool) -> str | None:
    """Why a restore into a cluster holding ``existing`` (stream → messages) is refused, or None.

    A restore is for an empty cluster: any stream there means services have run on it, and mixing
    two histories is never what was meant. ``force`` replaces the archive's streams that are there
    (the others are left alone)."""
    if not existing or force:
        return None
    listed = ", ".join(f"{name} ({n:,} messages)" for name, n in sorted(existing.items()))
    clash = sorted(set(existing) & set(archived))
    what = f"; the archive would replace {', '.join(clash)}" if clash else ""
    return (
        f"the cluster is not empty: {listed}{what}. Restore into a fresh nats-server with services stopped "
        "(`llmgw --data-dir NEW_DIR restore ARCHIVE` starts one on NEW_DIR), or pass --force to delete "
        "and replace the archive's streams"
    )


def data_file_allowed(path: str) -> bool:
    """Whether ``path`` (from an archive) is one of :data:`DATA_FILES` or under one: relative, no ``..``,
    so a crafted archive cannot write outside the data directory."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in path:
        return False
    return any(path == d or path.startswith(d + "/") for d in DATA_FILES)


def check_members(manifest: Manifest, found: dict[str, tuple[int, str]]) -> str | None:
    """What is wrong with an archive whose members are ``found`` (name → size, sha256), or None."""
    for f in manifest.files:
        if not data_file_allowed(f.path):
            held = ", ".join(DATA_FILES)
            return f"it names a file {f.path!r} outside what a backup holds ({held}): it is not an llmgw backup"
    wanted = {f"streams/{s.name}.snap": (s.size, s.sha256) for s in manifest.streams}
    wanted |= {f"files/{f.path}": (f.size, f.sha256) for f in manifest.files}
    for name, (size, digest) in wanted.items():
        if name not in found:
            return f"{name} is missing from the archive: it is incomplete (truncated?); use another backup"
        got_size, got_digest = found[name]
        if got_size != size:
            return f"{name} is {got_size} bytes, the manifest says {size}: the archive is damaged; use another backup"
        if got_digest != digest:
            return f"{name} does not match its sha256 in the manifest: the archive is damaged; use another backup"
    return None


# -- the archive -----------------------------------------------------------------------------


class _TarWriter:
    """A tar written in one pass, members streamed in: each header is written once the size is known."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f

    def _header(self, name: str, size: int, mode: int = 0o600) -> bytes:
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.mtime = size, mode, int(time.time())
        # GNU: a size past 8 GiB is written in the same 512 bytes (base-256), so a header written
        # before its member's size is known can be rewritten in place.
        return info.tobuf(format=tarfile.GNU_FORMAT)

    def begin(self, name: str) -> tuple[int, int]:
        at = self.f.tell()
        placeholder = self._header(name, 0)
        self.f.write(placeholder)
        return at, len(placeholder)

    def end(self, name: str, at: int, header_len: int, size: int) -> None:
        pad = (-size) % tarfile.BLOCKSIZE
        self.f.write(b"\0" * pad)
        here = self.f.tell()
        header = self._header(name, size)
        if len(header) != header_len:  # a size that changes the pax header's length: never for our names
            raise BackupError(f"cannot write the tar header of {name}")
        self.f.seek(at)
        self.f.write(header)
        self.f.seek(here)

    def add(self, name: str, data: bytes, mode: int = 0o600) -> None:
        self.f.write(self._header(name, len(data), mode))
        self.f.write(data)
        self.f.write(b"\0" * ((-len(data)) % tarfile.BLOCKSIZE))

    def close(self) -> None:
        self.f.write(b"\0" * (tarfile.BLOCKSIZE * 2))


def read_manifest(path: Path) -> Manifest:
    """The archive's manifest, after checking every member against it; :class:`BackupError` names the fault."""
    found: dict[str, tuple[int, str]] = {}
    manifest: Manifest | None = None
    try:
        with tarfile.open(path, "r:") as tar:
            for member in tar:
                f = tar.extractfile(member)
                if f is None:
                    continue
                if member.name == MANIFEST:
                    try:
                        manifest = msgspec.json.decode(f.read(), type=Manifest)
                    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                        raise BackupError(f"{path}: its manifest cannot be read ({exc}); use another backup") from exc
                    continue
                digest, size = hashlib.sha256(), 0
                while block := f.read(CHUNK):
                    digest.update(block)
                    size += len(block)
                found[member.name] = (size, digest.hexdigest())
    except FileNotFoundError as exc:
        raise BackupError(f"there is no archive at {path}") from exc
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise BackupError(
            f"{path} is not a whole llmgw backup ({exc}): it is truncated or damaged; use another backup"
        ) from exc
    if manifest is None:
        raise BackupError(f"{path} has no manifest: it is truncated or not an llmgw backup; use another backup")
    if manifest.format != FORMAT:
        raise BackupError(f"{path} is backup format {manifest.format}; this llmgw reads format {FORMAT}")
    problem = check_members(manifest, found)
    if problem:
        raise BackupError(f"{path}: {problem}")
    return manifest


def _iter_members(path: Path) -> Iterable[tuple[str, tarfile.TarFile, tarfile.TarInfo]]:
    with tarfile.open(path, "r:") as tar:
        for member in tar:
            yield member.name, tar, member


def _data_files(data_dir: Path | None) -> list[tuple[str, Path]]:
    if data_dir is None:
        return []
    out: list[tuple[str, Path]] = []
    for rel in DATA_FILES:
        p = data_dir / rel
        if p.is_file():
            out.append((rel, p))
        elif p.is_dir():
            out += [(str(f.relative_to(data_dir)), f) for f in sorted(p.rglob("*")) if f.is_file()]
    return out


def llmgw_version() -> str:
    try:
        return importlib.metadata.version("llmgw")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# -- the JetStream API -----------------------------------------------------------------------


async def _api(nc: NATS, subject: str, body: dict[str, Any] | None = None, timeout: float = API_TIMEOUT_S) -> dict:
    payload = json.dumps(body).encode() if body is not None else b""
    try:
        msg = await nc.request(subject, payload, timeout=timeout)
    except TimeoutError as exc:
        raise BackupError(
            f"NATS did not answer {subject} within {timeout:.0f}s: is JetStream up, and may this credential "
            "use it (back up and restore as the operator)?"
        ) from exc
    resp = json.loads(msg.data or b"{}")
    if resp.get("error"):
        err = resp["error"]
        raise BackupError(
            f"{subject} was refused: {err.get('description')} (code {err.get('err_code', err.get('code'))})"
        )
    return resp


async def stream_names(nc: NATS) -> dict[str, int]:
    """Every stream on the server and its message count."""
    out: dict[str, int] = {}
    offset = 0
    while True:
        resp = await _api(nc, "$JS.API.STREAM.LIST", {"offset": offset})
        for s in resp.get("streams") or []:
            out[s["config"]["name"]] = int(s["state"]["messages"])
        offset += len(resp.get("streams") or [])
        if not resp.get("streams") or offset >= int(resp.get("total", 0)):
            return out


async def snapshot_chunks(nc: NATS, stream: str, meta: dict[str, Any]) -> AsyncIterator[bytes]:
    """The server's snapshot of ``stream``, chunk by chunk; ``meta`` gets its ``config`` and ``state``."""
    inbox = nc.new_inbox()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def put(msg: Any) -> None:
        await queue.put(msg)

    sub = await nc.subscribe(inbox, cb=put, pending_msgs_limit=-1, pending_bytes_limit=-1)
    try:
        resp = await _api(
            nc,
            f"$JS.API.STREAM.SNAPSHOT.{stream}",
            {"deliver_subject": inbox, "no_consumers": True, "chunk_size": CHUNK},
        )
        meta["config"], meta["state"] = resp["config"], resp["state"]
        while True:
            try:
                msg = await asyncio.wait_for(queue.get(), API_TIMEOUT_S)
            except TimeoutError as exc:
                raise BackupError(f"the snapshot of {stream} stalled (nothing for {API_TIMEOUT_S:.0f}s)") from exc
            if msg.data:
                yield msg.data
                if msg.reply:
                    await nc.publish(msg.reply, b"")  # flow control: the server sends on as we ack
                continue
            status = (msg.headers or {}).get("Status")
            if status not in (None, "204"):
                why = (msg.headers or {}).get("Description") or status
                raise BackupError(f"the server could not snapshot {stream}: {why}")
            return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _send_chunk(nc: NATS, deliver: str, chunk: bytes) -> Any:
    """One snapshot chunk to the server, acknowledged. In a cluster the server's interest in the
    deliver subject reaches the node this client is on a moment after the restore is accepted
    ("no responders"): asked again for up to 5 s, then the error stands."""
    for _ in range(50):
        try:
            return await nc.request(deliver, chunk, timeout=API_TIMEOUT_S)
        except NoRespondersError:
            await asyncio.sleep(0.1)
    return await nc.request(deliver, chunk, timeout=API_TIMEOUT_S)


async def restore_stream(nc: NATS, entry: StreamEntry, chunks: Iterable[bytes], replicas: int | None) -> dict:
    """Recreate ``entry``'s stream from its snapshot ``chunks``; the new stream's info."""
    config = dict(entry.config)
    if replicas is not None:
        config["num_replicas"] = replicas
    resp = await _api(nc, f"$JS.API.STREAM.RESTORE.{entry.name}", {"config": config, "state": entry.state})
    deliver = resp["deliver_subject"]
    for chunk in chunks:
        try:
            ack = await _send_chunk(nc, deliver, chunk)
        except TimeoutError as exc:
            raise BackupError(
                f"the server stopped taking {entry.name}'s snapshot (no ack in {API_TIMEOUT_S:.0f}s)"
            ) from exc
        if ack.data:
            why = str((json.loads(ack.data).get("error") or {}).get("description"))
            if "closed pipe" in why or "stalled" in why:
                raise BackupError(TOO_SLOW.format(stream=entry.name))
            raise BackupError(f"the server refused {entry.name}'s snapshot: {why}")
    done = await nc.request(deliver, b"", timeout=max(API_TIMEOUT_S, entry.size / 20e6))
    info = json.loads(done.data or b"{}")
    if info.get("error"):
        why = str(info["error"].get("description"))
        if "stalled" in why:
            raise BackupError(TOO_SLOW.format(stream=entry.name))
        raise BackupError(f"restoring {entry.name} failed: {why}")
    return info.get("stream_info") or {}


# -- backup ----------------------------------------------------------------------------------


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def backup(
    nc: NATS, to_dir: Path, *, data_dir: Path | None = None, keep: int = 14, now: dt.datetime | None = None
) -> BackupResult:
    """Write one archive of every stream (and ``data_dir``'s files a restore needs) into ``to_dir``.

    Written as a hidden temp file (0600), fsynced, renamed into place, the directory fsynced; then
    all but the newest ``keep`` archives there are deleted. A failure leaves no partial archive."""
    started = time.monotonic()
    now = now or dt.datetime.now(dt.UTC)
    to_dir.mkdir(parents=True, exist_ok=True)
    final = to_dir / archive_name(now)
    tmp = to_dir / f".{final.name}.partial"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w+b") as f:
            tar = _TarWriter(f)
            entries: list[StreamEntry] = []
            for name in sorted(await stream_names(nc)):
                member = f"streams/{name}.snap"
                at, hlen = tar.begin(member)
                digest, size, meta = hashlib.sha256(), 0, {}
                async for chunk in snapshot_chunks(nc, name, meta):
                    f.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
                tar.end(member, at, hlen, size)
                state = meta["state"]
                entries.append(
                    StreamEntry(
                        name=name,
                        first_seq=int(state.get("first_seq", 0)),
                        last_seq=int(state.get("last_seq", 0)),
                        messages=int(state.get("messages", 0)),
                        bytes=int(state.get("bytes", 0)),
                        size=size,
                        sha256=digest.hexdigest(),
                        config=meta["config"],
                        state=state,
                    )
                )
            files: list[FileEntry] = []
            for rel, p in _data_files(data_dir):
                data = p.read_bytes()
                tar.add(f"files/{rel}", data)
                files.append(
                    FileEntry(
                        path=rel, size=len(data), sha256=hashlib.sha256(data).hexdigest(), mode=p.stat().st_mode & 0o777
                    )
                )
            manifest = Manifest(
                format=FORMAT,
                llmgw_version=llmgw_version(),
                created_at=now.astimezone(dt.UTC).isoformat(),
                streams=tuple(entries),
                files=tuple(files),
            )
            tar.add(MANIFEST, json.dumps(msgspec.to_builtins(manifest), indent=1).encode())
            tar.close()
            f.flush()
            # Off the event loop: in `llmgw server` the gateway shares it, and a large archive's flush takes a while.
            await asyncio.to_thread(os.fsync, f.fileno())
        os.replace(tmp, final)
        await asyncio.to_thread(_fsync_dir, to_dir)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    deleted = []
    for old in to_prune(os.listdir(to_dir), keep):
        (to_dir / old).unlink(missing_ok=True)
        deleted.append(old)
    return BackupResult(
        path=str(final),
        size=final.stat().st_size,
        duration_s=time.monotonic() - started,
        manifest=manifest,
        deleted=tuple(deleted),
    )


# -- restore ---------------------------------------------------------------------------------


def restore_files(archive: Path, manifest: Manifest, data_dir: Path, force: bool) -> tuple[list[str], list[str]]:
    """Write the archive's data-directory files into ``data_dir`` (0600 or their mode); those already
    there are kept unless ``force``. Returns (written, kept)."""
    wanted = {f"files/{f.path}": f for f in manifest.files}
    written: list[str] = []
    kept: list[str] = []
    for name, tar, member in _iter_members(archive):
        entry = wanted.get(name)
        if entry is None:
            continue
        target = data_dir / entry.path
        if target.exists() and not force:
            kept.append(entry.path)
            continue
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        data = tar.extractfile(member).read()  # type: ignore[union-attr]
        tmp = target.with_name(f".{target.name}.restoring")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, entry.mode & 0o700 or 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        written.append(entry.path)
    return written, kept


async def restore(
    nc: NATS,
    archive: Path,
    *,
    force: bool = False,
    replicas: int | None = None,
    data_dir: Path | None = None,
    manifest: Manifest | None = None,
) -> RestoreResult:
    """Recreate every stream in ``archive`` on an empty cluster (``force``: replace the ones there), and
    write its files into ``data_dir`` when given. The archive is checked whole before anything changes."""
    started = time.monotonic()
    manifest = manifest or read_manifest(archive)
    existing = await stream_names(nc)
    refusal = restore_refusal(existing, [s.name for s in manifest.streams], force)
    if refusal:
        raise BackupError(refusal)
    written: list[str] = []
    kept: list[str] = []
    if data_dir is not None:
        written, kept = restore_files(archive, manifest, data_dir, force)
    replaced = []
    by_member = {f"streams/{s.name}.snap": s for s in manifest.streams}
    for name, tar, member in _iter_members(archive):
        entry = by_member.get(name)
        if entry is None:
            continue
        if entry.name in existing:
            await _api(nc, f"$JS.API.STREAM.DELETE.{entry.name}")
            replaced.append(entry.name)
        f = tar.extractfile(member)
        assert f is not None
        await restore_stream(nc, entry, iter(lambda f=f: f.read(CHUNK), b""), replicas)
    return RestoreResult(
        streams=manifest.streams,
        replaced=tuple(replaced),
        files_written=tuple(written),
        files_kept=tuple(kept),
        duration_s=time.monotonic() - started,
    )


def describe(manifest: Manifest) -> str:
    """The manifest in lines a person reads."""
    lines = [f"llmgw {manifest.llmgw_version} backup of {manifest.created_at}"]
    for s in manifest.streams:
        lines.append(f"  {s.name:<28} seq {s.first_seq}..{s.last_seq}  {s.messages:,} messages  {s.size:,} bytes")
    if manifest.files:
        lines.append(f"  files: {', '.join(f.path for f in manifest.files)}")
    return "\n".join(lines)
