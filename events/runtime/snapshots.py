"""Snapshots: a service's folded state saved with its log position, so a start folds only the tail.

Without them every in-memory reader (a router, the scheduler) starts from sequence 0 and a start
costs the whole history. With them a start is: the newest snapshot, decoded, then the events after
its position, read by the service's :class:`~llmgw.events.runtime.follower.Follower` — a follower
given a :class:`SnapshotPlan` restores from it and saves the next ones itself.

A snapshot is one object in the ``llmgw_snapshots`` JetStream object store (an object store, not a
key-value bucket: a router's state at 100,000 keys is several MB, more than a message may carry),
named after what it holds (``router``, ``scheduler``). Its bytes are a msgpack :class:`Snapshot`:
the service's schema version, the position, and the state as the service encoded it, compressed
(zlib at level 1: a router's state at 100,000 keys, 18 MB, is 2.2 MB stored, and nats-py reads an
object at about 30 MB/s). Compressing and decompressing run in a thread (zlib releases the GIL), so
neither pauses the event loop.

A snapshot is only ever a shortcut: one written by another schema version, or one whose bytes do
not decode or decompress (one of an earlier format included), is ignored (and logged) and the fold
starts from 0 — the log is the truth, and a wrong snapshot would answer from wrong state. Deleting
the store (``nats object rm``) is always safe.
"""

from __future__ import annotations

import asyncio
import base64
import gc
import hashlib
import io
import time
import zlib
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import msgspec
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import ObjectInfo, ObjectMeta, ObjectMetaOptions, ObjectStoreConfig, StorageType
from nats.js.object_store import (
    OBJ_CHUNKS_PRE_TEMPLATE,
    OBJ_DEFAULT_CHUNK_SIZE,
    OBJ_STREAM_TEMPLATE,
    ObjectStore,
)

from llmgw.events.runtime.buckets import open_object_store

if TYPE_CHECKING:
    from llmgw.events.runtime.store import EventStore

log = structlog.get_logger("llmgw.events.runtime.snapshots")

BUCKET = "llmgw_snapshots"
# A service saves its state after this many events folded since the last save… A start reads at
# most this many after its snapshot, about 0.1 ms each (1 s of a router's 3.4 s start at 10,000, on
# a loaded 2-core machine); 5,000 halves that, and the encoding pauses it costs are bounded below.
EVERY_EVENTS = 5_000
EVERY_S = 300.0  # …or this many seconds, whichever first (and only when it has moved on)
PAUSE_SHARE = 100  # …but no sooner than this many times the last encoding took (it pauses the event loop)
CODEC = "zlib"  # how a snapshot's state is compressed (the only codec written or read)
CHUNK_BYTES = 1024 * 1024  # an object's chunk, at most (half the server's max_payload if that is less)
LEVEL = 1  # zlib's fastest: 12x smaller at 100,000 keys; level 6 saves 12% more bytes for 3x the time

T = TypeVar("T")


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """One saved state: what :meth:`SnapshotStore.save` writes."""

    name: str
    schema_version: int
    position: int  # the last log sequence folded into ``state``
    taken_at: float  # wall-clock seconds
    codec: str  # how ``state`` is compressed: :data:`CODEC` (a snapshot without one is of an earlier format)
    state: bytes  # the service's own encoding (msgpack), compressed; decoded by the service
    # "type@v" of each kind of event folded into ``state`` that its writer could not read (a newer
    # version's, during a rolling upgrade): a reader that reads one of them must not start from here
    unread: list[str] = []


class SnapshotPlan(msgspec.Struct, frozen=True, kw_only=True):
    """A follower's snapshots: what to start from and how to save the next ones (``Follower(snapshot=...)``).

    The follower restores before it reads: the newest snapshot ``name`` that decodes at
    ``schema_version`` is given to ``adopt``, which makes it the service's state and returns what the
    follower folds into from then on (None: the fold it was given, which reads the service's state
    itself). After each batch, a save is due every ``every_events`` events or ``every_s`` seconds (0
    turns a trigger off; both 0: none is read or saved), once ``live()`` says so (None: once the
    follower has caught up). ``encode`` is read at each save, so it may follow a state replaced later.
    """

    name: str
    schema_version: int
    decode: Callable[[bytes], Any]
    encode: Callable[[], bytes]
    adopt: Callable[[Any], Any]
    every_events: int = EVERY_EVENTS
    every_s: float = EVERY_S
    live: Callable[[], bool] | None = None


class Restored(msgspec.Struct, Generic[T], frozen=True, kw_only=True):
    position: int
    state: T
    unread: list[str] = []  # as the snapshot said: still unread, since this reader did not read them either


Reads = Callable[[str], bool]  # whether this process reads events of a "type@v"


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Snapshot)


def encode_state(state: msgspec.Struct) -> bytes:
    """A state's snapshot bytes (msgpack: smaller and faster than JSON)."""
    return _encoder.encode(state)


def encode_snapshot(
    name: str,
    schema_version: int,
    position: int,
    state_bytes: bytes,
    level: int = LEVEL,
    unread: Iterable[str] = (),
) -> bytes:
    """A snapshot's bytes, its state compressed at zlib ``level`` (CPU-bound: call it off the event loop)."""
    snap = Snapshot(
        name=name,
        schema_version=schema_version,
        position=position,
        taken_at=time.time(),
        codec=CODEC,
        state=zlib.compress(state_bytes, level),
        unread=sorted(unread),
    )
    return _encoder.encode(snap)


def decode_snapshot(name: str, schema_version: int, data: bytes, reads: Reads | None = None) -> Snapshot | None:
    """The snapshot in ``data`` if it is ``name``'s at ``schema_version`` and (with ``reads``) its
    writer read every event this reader reads; else None, logged."""
    try:
        snap = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        log.warning("a snapshot that does not decode is ignored; folding from 0", snapshot=name, error=str(exc))
        return None
    if snap.name != name or snap.schema_version != schema_version:
        log.warning(
            "a snapshot of another schema version is ignored; folding from 0",
            snapshot=name,
            found=snap.schema_version,
            expected=schema_version,
        )
        return None
    if reads is not None and (missed := [u for u in snap.unread if reads(u)]):
        # Written during a rolling upgrade by an older process, which skipped events this one folds:
        # starting from it would skip them for good.
        log.warning(
            "a snapshot whose writer could not read events this version reads is ignored; folding from 0",
            snapshot=name,
            unread=missed,
        )
        return None
    return snap


def open_snapshot(name: str, schema_version: int, data: bytes) -> tuple[int, bytes] | None:
    """(position, state bytes decompressed) of the snapshot in ``data`` if it is ``name``'s at
    ``schema_version`` and decompresses; else None, logged (CPU-bound: call it off the event loop)."""
    opened = _open(name, schema_version, data, None)
    return None if opened is None else (opened[0], opened[1])


def _open(name: str, schema_version: int, data: bytes, reads: Reads | None) -> tuple[int, bytes, list[str]] | None:
    snap = decode_snapshot(name, schema_version, data, reads)
    if snap is None:
        return None
    if snap.codec != CODEC:
        log.warning("a snapshot of an unknown codec is ignored; folding from 0", snapshot=name, codec=snap.codec)
        return None
    try:
        return snap.position, zlib.decompress(snap.state), list(snap.unread)
    except zlib.error as exc:
        log.warning("a snapshot that does not decompress is ignored; folding from 0", snapshot=name, error=str(exc))
        return None


class SnapshotStore:
    """Saves and loads snapshots by name in the ``llmgw_snapshots`` object store."""

    def __init__(self, objects: ObjectStore) -> None:
        self.objects = objects

    @classmethod
    async def open(cls, js: JetStreamContext, replicas: int | None = None) -> SnapshotStore:
        """The store, created at the cluster's replicas if missing (like every bucket)."""
        config = ObjectStoreConfig(
            bucket=BUCKET, description="services' folded state at a log position", storage=StorageType.FILE
        )
        return cls(await open_object_store(js, config, replicas))

    async def save(
        self,
        name: str,
        schema_version: int,
        position: int,
        state_bytes: bytes,
        level: int = LEVEL,
        unread: Iterable[str] = (),
    ) -> int:
        """Write ``name``'s snapshot (replacing the one before); returns its size in bytes, compressed.
        ``level`` 0 stores the state as it is, for one its service compressed already. ``unread``: the
        "type@v" of events folded past that the fold could not read (:class:`Snapshot`)."""
        data = await asyncio.to_thread(encode_snapshot, name, schema_version, position, state_bytes, level, unread)
        # Chunks as large as the server takes (up to CHUNK_BYTES), not nats-py's 128 KiB: a load
        # reads one chunk per request (see read).
        chunk = max(OBJ_DEFAULT_CHUNK_SIZE, min(CHUNK_BYTES, self.objects._js._nc.max_payload // 2))
        meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=chunk))
        await self.objects.put(name, data, meta=meta)
        return len(data)

    async def load(self, name: str, schema_version: int) -> tuple[int, bytes] | None:
        """(position, state bytes) of ``name``'s snapshot, or None: none saved, another schema version, or corrupt."""
        found = await self._load(name, schema_version, None)
        return None if found is None else (found[0], found[1])

    async def _load(self, name: str, schema_version: int, reads: Reads | None) -> tuple[int, bytes, list[str]] | None:
        try:
            data = await self.read(name)
        except Exception as exc:  # not found, deleted or unreadable: each means "fold from 0"
            if type(exc).__name__ not in ("ObjectNotFoundError", "NotFoundError", "ObjectDeletedError"):
                log.warning("a snapshot that cannot be read is ignored; folding from 0", snapshot=name, error=str(exc))
            return None
        return await asyncio.to_thread(_open, name, schema_version, data, reads)

    async def read(self, name: str) -> bytes:
        """The object's bytes, its chunks read by JetStream direct gets, one request each.

        nats-py's ``ObjectStore.get`` reads through an ordered push consumer whose flow control
        stalls for about 0.25 s at a time: 2 MB took 0.26 s and 20 MB 0.8 s, where direct gets take
        0.015 s and 0.1 s. A direct get may be answered by a replica that is behind, so what fails
        here (a chunk not found, bytes whose digest does not match) is read again with ``get``."""
        info = await self.objects.get_info(name)  # the meta from the stream's leader; raises if none
        try:
            return await self._read_direct(info)
        except Exception as exc:
            log.info("a snapshot's direct read failed; reading it again", snapshot=name, error=str(exc))
        # Into a buffer: without one nats-py joins the chunks as ``bytes += chunk``, quadratic in the
        # size (a 97 MB snapshot took 47 s to load that way, 7 s this way).
        buffer = io.BytesIO()
        await self.objects.get(name, writeinto=buffer)  # type: ignore[arg-type]
        return buffer.getvalue()

    async def _read_direct(self, info: ObjectInfo) -> bytes:
        if info.is_link() or not info.nuid:
            raise ValueError("not a plain object")
        js = self.objects._js
        stream, subject = (
            OBJ_STREAM_TEMPLATE.format(bucket=BUCKET),
            OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=BUCKET, obj=info.nuid),
        )
        data = bytearray()
        seq = 0
        for _ in range(info.chunks or 0):
            msg = await js.get_msg(stream, seq=seq + 1, subject=subject, next=True, direct=True)
            seq = msg.seq
            data += msg.data or b""
        _, _, expected = (info.digest or "").partition("=")  # "SHA-256=<base64url of the digest>"
        if len(data) != info.size or base64.urlsafe_b64decode(expected) != hashlib.sha256(data).digest():
            raise ValueError(f"{len(data)} bytes read of {info.size}, or a digest that does not match")
        return bytes(data)

    async def restore(
        self,
        name: str,
        schema_version: int,
        decode: Callable[[bytes], T],
        head: int | None = None,
        reads: Reads | None = None,
    ) -> Restored[T] | None:
        """``name``'s state decoded by ``decode`` with its position, or None (from 0) — a state that
        fails to decode is ignored and logged like a corrupt snapshot, and so is one past ``head`` (the
        log's last sequence: a snapshot of a log since deleted and begun again), and one whose writer
        skipped events this reader ``reads`` (a rolling upgrade's older process)."""
        found = await self._load(name, schema_version, reads)
        if found is None:
            return None
        position, data, unread = found
        if head is not None and position > head:
            log.warning(
                "a snapshot past the log's head is ignored; folding from 0", snapshot=name, position=position, head=head
            )
            return None
        collecting = gc.isenabled()
        gc.disable()  # decoding makes ~10^5 objects that all live on: collections meanwhile only cost (3x here)
        try:
            state = decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError, TypeError, KeyError) as exc:
            log.warning(
                "a snapshot whose state does not decode is ignored; folding from 0", snapshot=name, error=str(exc)
            )
            return None
        finally:
            if collecting:
                gc.enable()
        log.info("started from a snapshot", snapshot=name, position=position, size=len(data))
        return Restored(position=position, state=state, unread=unread)

    async def delete(self, name: str) -> None:
        await self.objects.delete(name)

    async def names(self, prefix: str = "") -> list[str]:
        """The names of the snapshots saved (deleted ones left out) that start with ``prefix``, sorted."""
        try:
            infos = await self.objects.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:  # nats-py's answer for an empty store
            return []
        return sorted(i.name for i in infos if i.name.startswith(prefix) and not i.deleted)


class Snapshotter:
    """When to save a service's snapshot — every ``every_events`` events or ``every_s`` seconds, whichever
    first — and the saving, off the fold's path.

    :meth:`folded` is called after each batch (``Follower``'s ``on_batch``). When one is due it encodes
    the state there, at the batch's edge (so the bytes match the position: the fold does not move while
    it encodes), and compresses (in a thread) and writes it in a task of its own, so neither the fold
    nor requests wait on zlib or NATS.
    While ``live()`` is false (the fold is still catching up) nothing is saved.
    """

    def __init__(
        self,
        store: SnapshotStore,
        name: str,
        schema_version: int,
        encode: Callable[[], bytes],
        position: Callable[[], int],
        *,
        every_events: int = EVERY_EVENTS,
        every_s: float = EVERY_S,
        live: Callable[[], bool] = lambda: True,
        clock: Callable[[], float] = time.monotonic,
        unread: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        self.store = store
        self.unread = unread
        self.name = name
        self.schema_version = schema_version
        self.encode = encode
        self.position = position
        self.every_events = every_events
        self.every_s = every_s
        self.live = live
        self.clock = clock
        self.saved_at = position()  # a state restored from a snapshot is saved already
        self.saved_when = clock()
        self.saves = 0
        self.last_bytes = 0
        self.last_encode_s = 0.0
        self._writing: asyncio.Task | None = None

    def due(self) -> bool:
        if not self.live():
            return False  # catching up: encoding every N events would slow the very start snapshots speed up
        if self.clock() - self.saved_when < self.last_encode_s * PAUSE_SHARE:
            return False  # encoding pauses the loop: a large state is saved less often, at most 1% of the time
        moved = self.position() - self.saved_at
        return moved >= self.every_events or (moved > 0 and self.clock() - self.saved_when >= self.every_s)

    def folded(self) -> None:
        if self._writing is not None and not self._writing.done():
            return  # one write at a time; the next batch asks again
        if not self.due():
            return
        position = self.position()
        started = time.perf_counter()
        data = self.encode()
        unread = tuple(self.unread())
        self.last_encode_s = time.perf_counter() - started
        self.saved_at, self.saved_when = position, self.clock()
        self._writing = asyncio.create_task(self._write(position, data, unread), name=f"snapshot-{self.name}")

    async def _write(self, position: int, data: bytes, unread: tuple[str, ...] = ()) -> None:
        try:
            self.last_bytes = await self.store.save(self.name, self.schema_version, position, data, unread=unread)
            self.saves += 1
            log.info("snapshot saved", snapshot=self.name, position=position, bytes=self.last_bytes)
        except Exception as exc:  # a snapshot is a shortcut: a failed one costs only the next start time
            log.warning(
                "a snapshot could not be saved; the next one is tried later", snapshot=self.name, error=str(exc)
            )

    async def flush(self) -> None:
        """Until the write under way (if any) is done."""
        if self._writing is not None:
            await asyncio.shield(self._writing)

    def close(self) -> None:
        if self._writing is not None and not self._writing.done():
            self._writing.cancel()


__all__ = [
    "BUCKET",
    "EVERY_EVENTS",
    "EVERY_S",
    "Restored",
    "Snapshot",
    "SnapshotPlan",
    "SnapshotStore",
    "Snapshotter",
    "decode_snapshot",
    "encode_snapshot",
    "encode_state",
    "open_snapshot",
]


async def resume(
    store: EventStore,
    name: str,
    schema_version: int,
    decode: Callable[[bytes], T],
    encode: Callable[[], bytes],
    position: Callable[[], int],
    *,
    every_events: int,
    every_s: float,
    live: Callable[[], bool],
    unread: Callable[[], Iterable[str]] = tuple,
) -> tuple[Restored[T] | None, Snapshotter] | None:
    """A service's start from snapshots: the newest of ``name`` that decodes at this schema (None: fold
    from 0) and the snapshotter that saves the next ones. None when both triggers are off (0) or the
    store cannot be opened — a snapshot is a shortcut only, so the fold then starts from 0 and saves
    none. ``encode`` and ``position`` are read at each save, so they may follow a state replaced later."""
    if every_events <= 0 and every_s <= 0:
        return None
    try:
        snapshots = await SnapshotStore.open(store.js)
        head = await store.stream_last_seq()
    except Exception as exc:
        log.warning("snapshots are not available; folding from 0 and saving none", error=str(exc))
        return None
    restored = await snapshots.restore(name, schema_version, decode, head, reads=store.registry.reads)
    saver = Snapshotter(
        snapshots,
        name,
        schema_version,
        encode,
        position,
        every_events=every_events if every_events > 0 else 2**62,
        every_s=every_s if every_s > 0 else float("inf"),
        live=live,
        unread=unread,
    )
    return restored, saver
