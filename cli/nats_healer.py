"""`llmgw up` heals its own nats-server after a full disk (issue 23).

A JetStream stream whose store write failed (ENOSPC) keeps failing until nats-server restarts, even
once the disk has room again (nats-server 2.15: "JetStream stream '$G > S' critical write error",
kept by that stream; other streams go on). Under `llmgw up` the server is `up`'s own child, so `up`
restarts it itself once space is back, instead of asking the operator to.

How it knows:

- **the store is failing**: `up` publishes a probe of a few KiB every couple of seconds to a stream of
  its own (:data:`PROBE_STREAM`, one message kept) and counts the probes not acknowledged in a row.
  Each probe needs fresh disk pages, so a full disk fails it like any other stream's write, and a
  probe stream that hit the error stays failed like the others do. nats-server's own word — its
  "critical write error" log line — is no use here: its log is on the same full disk. Nor are
  ``/jsz`` or stream info, which report no write error;
- **the disk was full**: `up` also looks at the store's file system four times a second; a disk seen
  with less than :attr:`HealPolicy.full_below` free may have failed any stream — the usage stream,
  the events stream — in a burst too short for three probes to fail in a row, so once it has room
  again the server is restarted whatever the probes say;
- **space is back**: the store's file system has :attr:`HealPolicy.free_margin` bytes free and a
  test write of 64 KiB (fsynced) in the store's folder succeeds. nats-server sizes its store limit
  from the free disk at start (75 %), so a restart on a nearly full disk would only trade a write
  error for "insufficient resources".

:func:`heal_decision` is the whole decision, pure over plain data; :class:`NatsHealer` is the thin
loop around it: probe, look at the disk, decide, restart, say so in one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js.api import DiscardPolicy, StorageType, StreamConfig

from llmgw.cli.natsd import EmbeddedNats, NatsStartError, read_credential
from llmgw.infra import nats_permissions as NP

log = structlog.get_logger("llmgw.cli.nats_healer")

PROBE_STREAM = "LLMGW_UP_PROBE"
PROBE_SUBJECT = "llmgw.up.probe"
# Larger than a page: every probe needs a fresh page of the disk, as a real write past a block's end does.
PROBE_BYTES = 4200
ROOM_CHECK_BYTES = 64 * 1024
ROOM_CHECK_FILE = ".llmgw-room-check"


class Action(enum.StrEnum):
    HEALTHY = "healthy"  # the probes are acknowledged (or too few failed to say otherwise)
    WAIT_FOR_SPACE = "wait_for_space"  # failing, and the disk has no room yet: a restart would not help
    HOLD = "hold"  # failing, but a restart now would be too soon, or the probe never worked at all
    RESTART = "restart"


class HealPolicy(msgspec.Struct, frozen=True, kw_only=True):
    failures_needed: int = 3  # probes not acknowledged in a row before the store counts as failing
    free_margin: int = 64 * 1024 * 1024  # bytes free on the store's disk before a restart is worth it
    cooldown_s: float = 20.0  # after a restart, the least time before the next; doubled per restart that did not heal
    max_cooldown_s: float = 600.0
    # Free bytes below which the store's disk counts as full. A disk seen full may have failed any stream,
    # even one whose writes no probe shares, so once it has room again the server is restarted anyway.
    full_below: int = 4 * 1024 * 1024


class HealInputs(msgspec.Struct, frozen=True, kw_only=True):
    """What the decision looks at, all plain data."""

    probe_failures: int  # probes not acknowledged in a row
    acked_ever: bool  # a probe was acknowledged since `up` started (else the probe itself is what fails)
    free_bytes: int | None  # free on the store's disk; None: not looked at (the store is not failing)
    writable: bool  # a test write in the store's folder succeeded
    restarted_at: float | None  # monotonic time of the last restart `up` made, None: none
    unhealed_restarts: int  # restarts since the last acknowledged probe
    now: float
    disk_full_seen: bool = False  # the store's disk was seen full since the last restart


def cooldown(policy: HealPolicy, unhealed_restarts: int) -> float:
    """How long after a restart the next may come: longer each time restarting did not heal; pure."""
    return min(policy.max_cooldown_s, policy.cooldown_s * 2 ** max(0, unhealed_restarts - 1))


def heal_decision(state: HealInputs, policy: HealPolicy = HealPolicy()) -> Action:
    """Whether to restart the embedded nats-server now; pure."""
    failing = state.probe_failures >= policy.failures_needed
    if not failing and not state.disk_full_seen:
        return Action.HEALTHY
    if failing and not state.acked_ever and not state.disk_full_seen:
        # Never acknowledged: the probe's own setup is what fails, and restarting would not change it.
        return Action.HOLD
    if not state.writable or state.free_bytes is None or state.free_bytes < policy.free_margin:
        return Action.WAIT_FOR_SPACE
    if state.restarted_at is not None and state.now - state.restarted_at < cooldown(policy, state.unhealed_restarts):
        return Action.HOLD
    return Action.RESTART


class Room(msgspec.Struct, frozen=True, kw_only=True):
    free_bytes: int
    writable: bool
    error: str | None = None


def store_room(folder: Path) -> Room:
    """The free bytes of ``folder``'s file system, and whether a 64 KiB write there (fsynced) succeeds."""
    try:
        st = os.statvfs(folder)
    except OSError as exc:
        return Room(free_bytes=0, writable=False, error=exc.strerror)
    free = st.f_bavail * st.f_frsize
    path = folder / ROOM_CHECK_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"\0" * ROOM_CHECK_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return Room(free_bytes=free, writable=False, error=exc.strerror)
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    return Room(free_bytes=free, writable=True)


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def healed_line(disk_was_full: bool, why: str | None) -> str:
    """The one line `up` prints once it has restarted its nats-server; pure."""
    if disk_was_full:
        what = "could not write its store (disk full); space is back"
    else:
        what = f"stopped storing writes ({why}) though its disk has room"
    return (
        f"the embedded nats-server {what}, so it was restarted on the same port; "
        "routers now publish the usage records they kept"
    )


def waiting_line(store: Path, why: str | None, margin: int) -> str:
    """The line `up` prints when the store fails and its disk has no room yet; pure."""
    return (
        f"warning: the embedded nats-server cannot write its store in {store} ({why or 'no acknowledgement'}): "
        f"free space on that disk; `llmgw up` restarts it by itself once {_size(margin)} are free"
    )


class NatsHealer:
    """Probes the embedded server's store and restarts the server in place when the store fails and the
    disk has room again. Runs in `up`'s event loop; the restart runs in that loop's thread, the one
    that started the server (its parent-death signal is tied to that thread)."""

    def __init__(
        self,
        natsd: EmbeddedNats,
        *,
        say: Callable[[str], None],
        policy: HealPolicy = HealPolicy(),
        probe_every_s: float = 2.0,
        # Generous: a busy disk's fsync can be slow, and three slow probes must not pass for a failing store.
        ack_timeout_s: float = 5.0,
    ) -> None:
        self.natsd = natsd
        self.say = say
        self.policy = policy
        self.probe_every_s = probe_every_s
        self.ack_timeout_s = ack_timeout_s
        self.nc: NATS | None = None
        self.stream_ready = False
        self.failures = 0
        self.acked_ever = False
        self.restarted_at: float | None = None
        self.unhealed_restarts = 0
        self.disk_was_full = False  # in this failing episode
        self.disk_full_seen = False  # by the disk watch, since the last restart
        self.disk_every_s = 0.25  # how often the disk is looked at: a full disk may last a second
        self.warned = False  # the waiting line, once per episode
        self.last_error: str | None = None

    async def run(self, stop: asyncio.Event) -> None:
        watch = asyncio.create_task(self.watch_disk(stop), name="nats-disk-watch")
        try:
            while not stop.is_set():
                await self.step()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.probe_every_s)
        finally:
            watch.cancel()
            if self.nc is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.nc.close(), 2.0)

    async def watch_disk(self, stop: asyncio.Event) -> None:
        """Latch :attr:`disk_full_seen` when the store's disk is seen full. A burst of a second or two is
        enough to fail a stream for good (until a restart) while the probes, every 2 s, still get through."""
        while not stop.is_set():
            try:
                st = os.statvfs(self.natsd.dir)
            except OSError:
                pass
            else:
                if st.f_bavail * st.f_frsize < self.policy.full_below and not self.disk_full_seen:
                    self.disk_full_seen = True
                    log.warning("the embedded nats-server's disk is full", store=str(self.natsd.dir))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.disk_every_s)

    async def step(self) -> Action:
        """One probe, one decision, and the restart it calls for."""
        if not self.natsd.alive():
            return Action.HOLD  # a server that exited is `up`'s watcher's business, not a store to heal
        error = await self.probe()
        if error is None:
            self.failures, self.acked_ever, self.unhealed_restarts = 0, True, 0
            self.warned = False
            if not self.disk_full_seen:
                self.disk_was_full = False
                return Action.HEALTHY
        else:
            self.failures += 1
            self.last_error = error
        if self.disk_full_seen:
            self.disk_was_full = True
        looked = self.failures >= self.policy.failures_needed or self.disk_full_seen
        room = store_room(self.natsd.dir) if looked else None
        action = heal_decision(
            HealInputs(
                probe_failures=self.failures,
                acked_ever=self.acked_ever,
                free_bytes=room.free_bytes if room is not None else None,
                writable=room is not None and room.writable,
                restarted_at=self.restarted_at,
                unhealed_restarts=self.unhealed_restarts,
                now=time.monotonic(),
                disk_full_seen=self.disk_full_seen,
            ),
            self.policy,
        )
        if action is Action.WAIT_FOR_SPACE:
            self.disk_was_full = True
            if not self.warned:
                self.warned = True
                self.say(waiting_line(self.natsd.dir, error or "its disk is full", self.policy.free_margin))
        elif action is Action.RESTART:
            self.restart()
        return action

    def restart(self) -> None:
        log.warning("restarting the embedded nats-server: its store failed", error=self.last_error)
        started = time.monotonic()
        try:
            # Synchronous on purpose (see the class): the loop pauses for the restart, well under a second.
            self.natsd.restart()
        except NatsStartError as exc:
            self.say(f"error: the embedded nats-server could not be restarted after its store failed: {exc}")
            return  # not alive now: `up`'s watcher stops `up` with the reason
        self.restarted_at = time.monotonic()
        self.unhealed_restarts += 1
        self.failures = 0
        self.disk_full_seen = False
        log.info("embedded nats-server restarted", seconds=round(self.restarted_at - started, 3))
        self.say(healed_line(self.disk_was_full, self.last_error))

    async def probe(self) -> str | None:
        """Publish one probe; None when it was acknowledged, else why not."""
        try:
            nc = await self._client()
            if not nc.is_connected:
                return "not connected"
            js = nc.jetstream(timeout=self.ack_timeout_s)
            # nats-py may never complete a publish whose stream answers with an error: a deadline of our own.
            await asyncio.wait_for(js.publish(PROBE_SUBJECT, b"\0" * PROBE_BYTES), self.ack_timeout_s + 0.5)
        except (TimeoutError, nats.errors.TimeoutError):
            return f"no acknowledgement within {self.ack_timeout_s:.0f}s"
        except Exception as exc:  # whatever keeps a probe from its acknowledgement is a failed probe
            return f"{type(exc).__name__}: {exc}"
        return None

    async def _client(self) -> NATS:
        if self.nc is None:
            cred = read_credential(self.natsd.creds(NP.OPERATOR))

            async def quiet(_exc: Exception) -> None:
                pass  # the probe's verdict is what counts; `up`'s services log the connection's trouble

            self.nc = await nats.connect(
                self.natsd.url,
                user=cred.user,
                password=cred.password,
                inbox_prefix=cred.inbox_prefix,
                name="llmgw-up-probe",
                connect_timeout=2,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                ping_interval=5,
                error_cb=quiet,
            )
        if not self.stream_ready:
            await self._ensure_stream(self.nc)
            self.stream_ready = True
        return self.nc

    async def _ensure_stream(self, nc: NATS) -> None:
        js = nc.jetstream(timeout=self.ack_timeout_s)
        config = StreamConfig(
            name=PROBE_STREAM,
            description="llmgw up's probe of its nats-server's store (one message kept)",
            subjects=[PROBE_SUBJECT],
            storage=StorageType.FILE,
            max_msgs=1,
            max_bytes=64 * 1024,  # small blocks too: nats-server sizes a stream's blocks from its byte limit
            discard=DiscardPolicy.OLD,
            num_replicas=1,
        )
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await js.update_stream(config)  # there from an earlier `up`, configured otherwise
