"""Usage records off the request path, kept until JetStream acknowledges them (SPEC GW-8: none lost).

A record is published with ``Nats-Msg-Id`` = its request id, so a retry after a lost
acknowledgement is stored once. While the bus acknowledges, records wait in memory only as long
as a publish takes. Once it does not (NATS away, the stream's store failing, more records waiting
than ``memory_records``), every waiting record is written to the usage journal (:mod:`.journal`,
a directory on the router's own disk, one fsync per batch) and published from there, oldest
first, when the bus accepts again; a segment is deleted once all its records are acknowledged.
A router that starts with records in its journal publishes them first.

Every record is also on the router's disk from the moment it is made: :meth:`UsagePublisher.put`
appends it to the in-flight log (:mod:`.inflight`, one write, no fsync) and it leaves that log
once acknowledged or journaled, so a router killed while a record waits for the bus loses nothing;
the next start moves what it finds there into the journal.

What happens when the bus does not acknowledge and the router's disk cannot take more records
(full, read-only) depends on ``mode`` (docs/usage.md, "A full disk"):

- ``strict`` (``llmgw server``): :meth:`UsagePublisher.refusal` refuses billable requests at once —
  when the in-flight log cannot keep its reserve (:mod:`.inflight`: preallocated room for the
  records of requests already in progress), a write to it failed, or the journal cannot be written;
  without a journal, as soon as the bus does not acknowledge. No 200 is answered whose record could
  live only in memory. While refusing, the loop probes about once a second whether the reserve can
  be made again (no new record would ever try), and admits again by itself.
- ``available`` (``llmgw up``): keeps serving; records the disk cannot take wait in memory, counted
  as ``memory_only`` in ``/healthz`` and ``llmgw_usage_memory_only_records``, and billable requests
  are refused only once ``memory_records`` wait.

Why a bus failure used to go unnoticed: when the stream's store fails, nats-server answers a
publish with an error (503 "insufficient resources") or not at all (a store write error, e.g.
ENOSPC, is kept by the stream until nats-server restarts). nats-py raises the 503 inside its reply
handler instead of failing the publish's future, so either way the future never completes; the
old publisher waited for each of a batch's 256 futures in turn, 10 s apiece, so the first warning
came after 40 minutes. Here a batch's acknowledgements are awaited against one deadline for the
whole batch, and failures are logged with their count and error, at most every 10 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import deque
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Literal

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext

from llmgw.events.runtime.retry import backoff_delay
from llmgw.events.schema import subjects as S
from llmgw.events.schema.usage import UsageRecord, usage_subject
from llmgw.services.router.inflight import InflightLog, disk_problem
from llmgw.services.router.journal import Journal
from llmgw.services.router.metrics import UsageMetrics

log = structlog.get_logger("llmgw.router.usage")
_enc = msgspec.json.Encoder()

RETRY_MIN_S = 0.1
SPILL_CHUNK = 1024  # records per journal write (one fsync each)
INFLIGHT_DIR = "inflight"  # the in-flight log's folder, in the journal's
LOG_EVERY_S = 10.0


UsageMode = Literal["strict", "available"]


class UsageConfig(msgspec.Struct, frozen=True, kw_only=True):
    journal_dir: str | None = None  # None: records wait in memory only
    # strict: refuse billable requests as soon as a record could live only in memory; available: keep
    # serving, up to memory_records held in memory (module docstring).
    mode: UsageMode = "strict"
    reserve_bytes: int = 1 << 20  # each in-flight file, preallocated: the reserve is up to 1.5 of it
    probe_s: float = 1.0  # while refusing, how often the disk is tried again
    memory_records: int = 10_000  # records held in memory before they go to the journal
    batch: int = 256  # records published per round of acknowledgements
    ack_timeout_s: float = 5.0  # a record not acknowledged within this is retried
    retry_max_s: float = 5.0  # the longest pause between attempts while the bus refuses
    stop_timeout_s: float = 10.0  # how long a stopping router tries to publish what is left
    segment_bytes: int = 1 << 20


class UsageBacklog(msgspec.Struct, frozen=True, kw_only=True):
    """What the router holds that the bus has not acknowledged (``/healthz``'s ``usage``)."""

    state: str  # ok | waiting | journaling | memory_only | refusing
    records: int  # in memory and in the journal
    in_memory: int
    journaled: int
    oldest_s: float | None  # age of the oldest record held, seconds
    journal: str | None
    error: str | None = None  # the last publish or journal error, while records are held
    refusing: str | None = None  # why billable requests are refused
    mode: str = "strict"  # strict | available
    memory_only: int = 0  # records held in memory and on no disk: a crash now loses them
    reserve: str | None = None  # why the in-flight log has no reserve (a full disk), while it has none


class StopReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a stopping publisher did with what it held."""

    published: int  # published during the stop
    journaled: int  # left in the journal for the next start
    lost: int  # could be neither published nor journaled (logged with their request ids)
    error: str | None = None


class _Head(msgspec.Struct):
    """The parts of a journaled record needed to publish it."""

    request_id: str
    at: datetime
    project_id: str | None = None


class _Item(msgspec.Struct):
    request_id: str
    subject: str
    data: bytes
    at: float


class _Held(msgspec.Struct):
    """A record waiting in memory: encoded once, and the in-flight file it was written to (None: not written)."""

    record: UsageRecord
    data: bytes
    inflight: int | None


_head = msgspec.json.Decoder(_Head)

PROBE_BYTES = 64 << 10  # what a disk without fallocate must take for the in-flight log to be written again


def _has_room(directory: Path) -> bool:
    """Whether ``directory`` takes a write of ``PROBE_BYTES`` now (written and removed)."""
    probe = directory / ".probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    except OSError:
        return False
    try:
        return os.write(fd, b"\0" * PROBE_BYTES) == PROBE_BYTES
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink(missing_ok=True)


def journal_problem(directory: str, exc: OSError) -> str:
    """A sentence saying why the journal cannot be written. Pure."""
    return disk_problem("the usage journal", directory, exc)


def inflight_problem(directory: str, exc: OSError) -> str:
    """A sentence saying why the in-flight log cannot take records (or keep its reserve). Pure."""
    return disk_problem("the in-flight usage log", directory, exc)


class _FailureLog:
    """Failures summed and logged at most every ``every_s``: a dead bus neither floods the log nor goes unsaid."""

    def __init__(self, every_s: float = LOG_EVERY_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s = every_s
        self.clock = clock
        self.count = 0
        self.errors: dict[str, int] = {}
        self.last = float("-inf")

    def note(self, errors: dict[str, int], backlog: int) -> None:
        for error, count in errors.items():
            self.count += count
            self.errors[error] = self.errors.get(error, 0) + count
        now = self.clock()
        if now - self.last >= self.every_s:
            log.warning(
                "usage records not acknowledged by the bus; kept and retried",
                records=self.count,
                errors=self.errors,
                backlog=backlog,
            )
            self.count, self.errors, self.last = 0, {}, now


class UsagePublisher:
    def __init__(
        self,
        js: JetStreamContext,
        nc: NATS | None = None,
        config: UsageConfig | None = None,
        metrics: UsageMetrics | None = None,
    ) -> None:
        self.js = js
        self.nc = nc
        self.cfg = config or UsageConfig()
        self.metrics = metrics
        self.published = 0
        self._memory: deque[_Held] = deque()
        self._memory_only = 0  # held records (memory and sending) written to no disk
        self._sending = 0  # taken from memory, awaiting acknowledgement
        self._journal: Journal | None = None
        self._inflight: InflightLog | None = None
        self._inflight_error: str | None = None
        self._journaled = 0
        self._journal_oldest: float | None = None
        self._offset = 0  # into the oldest segment: what is before it is acknowledged
        self._replay: tuple[int, list[_Item], int] | None = None  # (segment, items left, offset after them)
        self._bus_ok = True
        self._bus_error: str | None = None
        self._journal_error: str | None = None
        self._failures = _FailureLog()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._task: asyncio.Task | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the journal (raises :class:`JournalError` with a sentence) and publish what it holds."""
        if self.cfg.journal_dir:
            self._journal = Journal(self.cfg.journal_dir, self.cfg.segment_bytes)
            await asyncio.to_thread(self._recover_inflight)
            count, oldest = await asyncio.to_thread(self._scan)
            self._journaled, self._journal_oldest = count, oldest
            if count:
                log.warning(
                    "usage journal holds records from an earlier run; publishing them",
                    records=count,
                    journal=self.cfg.journal_dir,
                )
        self._task = asyncio.create_task(self._run(), name="usage-publisher")
        self._wake.set()

    def put(self, record: UsageRecord) -> None:
        data = _enc.encode(record)
        held = _Held(record, data, self._write_inflight(data))
        if held.inflight is None:
            self._memory_only += 1
        self._memory.append(held)
        if not self._wake.is_set():
            self._wake.set()

    def _write_inflight(self, data: bytes) -> int | None:
        """The record on disk before anything else happens (:mod:`.inflight`); None when it cannot be
        (said once per failure, and again when it can)."""
        if self._inflight is None:
            return None
        try:
            file = self._inflight.write(data)
        except OSError as exc:
            problem = inflight_problem(str(self._inflight.directory), exc)
            if problem != self._inflight_error:
                log.error("usage records cannot be written to the in-flight log; a crash now loses them", error=problem)
            self._inflight_error = problem
            return None
        if self._inflight_error is not None:
            log.info("usage records are written to the in-flight log again", directory=str(self._inflight.directory))
            self._inflight_error = None
        return file

    def _kept(self, held: list[_Held]) -> None:
        """``held`` are kept elsewhere now (acknowledged, or in the spill journal): out of the in-flight log."""
        for h in held:
            if h.inflight is None:
                self._memory_only -= 1
            elif self._inflight is not None:
                self._inflight.done(h.inflight)

    def _recover_inflight(self) -> None:
        """Move what an earlier run left in the in-flight log into the spill journal (fsynced), from
        where it is published; then start a log of this run's own."""
        assert self._journal is not None and self.cfg.journal_dir
        try:
            inflight = InflightLog(Path(self.cfg.journal_dir) / INFLIGHT_DIR, self.cfg.reserve_bytes)
        except OSError as exc:
            problem = inflight_problem(str(Path(self.cfg.journal_dir) / INFLIGHT_DIR), exc)
            log.error("no in-flight log: a crash loses the records waiting for the bus", error=problem)
            return
        self._inflight = inflight
        left = inflight.left_behind()
        if left:
            try:
                self._journal.append(left)
            except OSError as exc:
                # Left where they are: the next start tries again. This run's log is its own files.
                log.error(
                    "usage records an earlier run left in the in-flight log cannot be moved to the journal",
                    records=len(left),
                    error=journal_problem(str(self._journal.directory), exc),
                )
                return
            log.warning(
                "usage records an earlier run had not seen acknowledged are moved to the journal; publishing them",
                records=len(left),
            )
        inflight.forget_left()  # files with nothing whole in them go too
        inflight.ensure_reserve()  # the first file, preallocated; says now if this file system cannot
        if inflight.unsupported:
            log.warning(
                "the in-flight usage log keeps no reserve on this system: with a full disk, records of requests "
                "in progress wait in memory only",
                directory=str(inflight.directory),
                reason=inflight.unsupported,
            )

    async def stop(self, timeout_s: float | None = None) -> StopReport:
        """Publish what is held within ``timeout_s``; journal the rest; log and report what neither took."""
        timeout_s = self.cfg.stop_timeout_s if timeout_s is None else timeout_s
        end = time.monotonic() + timeout_s
        published_before = self.published
        self._stopping.set()
        self._wake.set()
        if self._task is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._task), max(timeout_s, self.cfg.ack_timeout_s + 1))
            except TimeoutError:
                self._task.cancel()
            except Exception as exc:  # the loop must never die, but if it did, say so and go on
                log.error("usage publisher loop had failed", error=str(exc))
        if self._journal is not None and self._memory:
            await self._spill()  # durable first; then publish what time allows
        while self._has_work() and time.monotonic() < end:
            if not await self._step(min(self.cfg.ack_timeout_s, max(0.1, end - time.monotonic()))):
                break
        lost = [h.record for h in self._memory]
        report = StopReport(
            published=self.published - published_before,
            journaled=self._journaled,
            lost=len(lost),
            error=(self._journal_error or self._bus_error) if (lost or self._journaled) else None,
        )
        if lost:
            log.error(
                "usage records lost at stop: the bus did not acknowledge them and they could not be journaled",
                records=len(lost),
                error=report.error,
                journal=self.cfg.journal_dir,
                request_ids=[r.request_id for r in lost[:50]],
            )
            if self.metrics:
                self.metrics.lost.inc(len(lost))
        elif self._journaled:
            log.warning(
                "usage records left in the journal at stop; the next router start publishes them",
                records=self._journaled,
                journal=self.cfg.journal_dir,
                error=report.error,
            )
        if self._journal is not None:
            self._journal.close()
        if self._inflight is not None:
            self._inflight.close()  # what is still needed stays for the next start
        return report

    # -- state -------------------------------------------------------------------------------

    def refusal(self) -> str | None:
        """Why billable requests must be refused now (records cannot be kept), or None. Called for each
        billable request: O(1)."""
        if self._bus_ok:
            return None
        if self.cfg.mode == "strict":
            return self._strict_refusal()
        if self._journal is not None and self._journal_error is None:
            return None
        if len(self._memory) < self.cfg.memory_records:
            return None
        if self._journal is not None:
            return (
                f"usage records cannot be kept: {len(self._memory)} wait in memory for the bus ({self._bus_error}) "
                f"and {self._journal_error}; requests are refused until the bus acknowledges them or the journal "
                "can be written"
            )
        return (
            f"usage records cannot be kept: {len(self._memory)} wait in memory for the bus ({self._bus_error}) and "
            "no usage journal is configured; requests are refused until the bus acknowledges them"
        )

    def _strict_refusal(self) -> str | None:
        """The bus does not acknowledge: refused as soon as the disk cannot take more records."""
        if self._journal is None:
            return (
                f"usage records cannot be kept: the bus does not acknowledge them ({self._bus_error}) and no usage "
                "journal is configured; requests are refused until the bus acknowledges them"
            )
        if self._journal_error is not None:
            return f"usage records cannot be kept: {self._journal_error}; requests are refused until it can be written"
        problem = self._disk_problem()
        if problem is None:
            return None
        return (
            f"usage records cannot be kept: the bus does not acknowledge them ({self._bus_error}) and {problem}; "
            "requests are refused until the disk has room again or the bus acknowledges them"
        )

    def _disk_problem(self) -> str | None:
        """Why the in-flight log cannot take the records of more requests, or None."""
        if self._inflight_error is not None:
            return self._inflight_error
        reserve = self._reserve_problem()
        return f"{reserve}: no room for the records of more requests" if reserve else None

    def _reserve_problem(self) -> str | None:
        inflight = self._inflight
        if inflight is None or inflight.reserve_error is None:
            return None
        return inflight_problem(str(inflight.directory), inflight.reserve_error)

    def backlog(self) -> UsageBacklog:
        in_memory = len(self._memory) + self._sending
        oldest = []
        if self._memory:
            oldest.append(self._memory[0].record.at.timestamp())
        if self._journaled and self._journal_oldest is not None:
            oldest.append(self._journal_oldest)
        refusing = self.refusal()
        held = in_memory + self._journaled
        if refusing:
            state = "refusing"
        elif self._memory_only:
            state = "memory_only"
        elif self._journaled or not self._bus_ok:
            state = "journaling" if self._journal is not None else "waiting"
        else:
            state = "ok"
        return UsageBacklog(
            state=state,
            records=held,
            in_memory=in_memory,
            journaled=self._journaled,
            oldest_s=round(max(0.0, time.time() - min(oldest)), 3) if oldest else None,
            journal=self.cfg.journal_dir,
            error=(self._journal_error or self._inflight_error or self._bus_error) if state != "ok" else None,
            refusing=refusing,
            mode=self.cfg.mode,
            memory_only=self._memory_only,
            reserve=self._reserve_problem(),
        )

    # -- the loop ----------------------------------------------------------------------------

    def _has_work(self) -> bool:
        return bool(self._memory) or self._journaled > 0

    async def _run(self) -> None:
        refused = 0  # rounds in a row the bus refused: the pause before the next doubles with each
        while not self._stopping.is_set():
            if self.refusal() is not None:
                # Every request is refused, so no record would try the disk again: this loop does.
                self._probe()
            if not self._has_work():
                self._wake.clear()
                if self.refusal() is None:
                    await self._wake.wait()
                else:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), self.cfg.probe_s)
                continue
            try:
                ok = await self._step(self.cfg.ack_timeout_s)
            except Exception as exc:  # never let the loop die: records would wait forever
                log.exception("usage publisher step failed; retrying", error=str(exc))
                ok = False
            if ok:
                refused = 0
                continue
            refused += 1
            pause = backoff_delay(refused, RETRY_MIN_S, self.cfg.retry_max_s)
            if self.refusal() is not None:
                pause = min(pause, self.cfg.probe_s)  # admitting again must not wait for the backoff
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), pause)

    def _probe(self) -> None:
        """Whether the in-flight log has room again: its reserve made anew (a few syscalls, on the loop)."""
        inflight = self._inflight
        if inflight is None or (inflight.reserve_error is None and self._inflight_error is None):
            return
        if inflight.reserving:
            if inflight.ensure_reserve() and self._inflight_error is not None:
                log.info("the in-flight usage log has room again", directory=str(inflight.directory))
                self._inflight_error = None  # the next record goes into the reserve just made
            return
        if self._inflight_error is not None and _has_room(inflight.directory):
            log.info("the in-flight usage log has room again", directory=str(inflight.directory))
            self._inflight_error = None

    async def _step(self, ack_timeout_s: float) -> bool:
        """One round: spill to the journal if records must be kept there, then publish a batch
        (the journal's oldest first). False when the bus refused (back off)."""
        if self._journal is not None and self._memory:
            if self._journaled or not self._bus_ok or len(self._memory) > self.cfg.memory_records:
                await self._spill()
        if self._journaled:
            return await self._replay_batch(ack_timeout_s)
        if self._memory:
            return await self._publish_memory(ack_timeout_s)
        return True

    async def _spill(self) -> bool:
        assert self._journal is not None
        while self._memory:
            chunk = [self._memory.popleft() for _ in range(min(SPILL_CHUNK, len(self._memory)))]
            try:
                await asyncio.to_thread(self._journal.append, [h.data for h in chunk])
            except OSError as exc:
                self._memory.extendleft(reversed(chunk))
                problem = journal_problem(str(self._journal.directory), exc)
                if problem != self._journal_error:
                    log.error(
                        "usage journal cannot be written; billable requests are refused while the bus "
                        "does not acknowledge records either",
                        journal=str(self._journal.directory),
                        error=problem,
                        in_memory=len(self._memory),
                    )
                self._journal_error = problem
                return False
            if self._journaled == 0:
                self._journal_oldest = chunk[0].record.at.timestamp()
            self._journaled += len(chunk)
            self._kept(chunk)
            if self.metrics:
                self.metrics.journaled.inc(len(chunk))
            if self._journal_error is not None:
                log.info("usage journal can be written again", journal=str(self._journal.directory))
                self._journal_error = None
        return True

    async def _publish_memory(self, ack_timeout_s: float) -> bool:
        held = [self._memory.popleft() for _ in range(min(self.cfg.batch, len(self._memory)))]
        items = [
            _Item(
                request_id=h.record.request_id,
                subject=usage_subject(h.record.project_id),
                data=h.data,
                at=h.record.at.timestamp(),
            )
            for h in held
        ]
        self._sending = len(held)
        try:
            failed = await self._publish(items, ack_timeout_s)
        except BaseException:
            self._memory.extendleft(reversed(held))  # cancelled mid-publish: keep them all
            raise
        finally:
            self._sending = 0
        again = set(failed)
        self._kept([h for i, h in enumerate(held) if i not in again])
        if failed:
            self._memory.extendleft(reversed([held[i] for i in failed]))
        return not failed

    async def _replay_batch(self, ack_timeout_s: float) -> bool:
        assert self._journal is not None
        segments = self._journal.segments()
        if not segments:
            self._journaled, self._offset, self._replay = 0, 0, None
            return True
        segment = segments[0]
        if self._replay is None or self._replay[0] != segment:
            payloads, end = await asyncio.to_thread(self._journal.read, segment, self._offset)
            self._replay = (segment, self._items(payloads), end)
        _, items, end = self._replay
        if items:
            self._journal_oldest = items[0].at
            chunk, rest = items[: self.cfg.batch], items[self.cfg.batch :]
            failed = await self._publish(chunk, ack_timeout_s)
            acked = len(chunk) - len(failed)
            self._journaled = max(0, self._journaled - acked)
            if self.metrics and acked:
                self.metrics.replayed.inc(acked)
            items = [chunk[i] for i in failed] + rest
            self._replay = (segment, items, end)
            if failed:
                return False
            if items:
                return True
        # Everything read from this segment is acknowledged.
        self._replay = None
        read_from, self._offset = self._offset, end
        if self._journal.size(segment) > end and (end > read_from or self._journal.is_current(segment)):
            # More was appended since it was read — to the segment still being written, or before a later
            # append moved on to the next one: read on from there, never delete it unread. (A closed segment
            # whose read found nothing whole past the offset ends in a torn record: nothing to publish.)
            return True
        await asyncio.to_thread(self._journal.delete, segment)
        self._offset = 0
        if not self._journal.segments():
            if self._journaled:
                log.warning("usage journal count corrected: it is empty", counted=self._journaled)
            self._journaled, self._journal_oldest = 0, None
            log.info("usage journal drained: every journaled record is acknowledged", journal=self.cfg.journal_dir)
        return True

    def _items(self, payloads: list[bytes]) -> list[_Item]:
        items = []
        for p in payloads:
            try:
                h = _head.decode(p)
            except msgspec.DecodeError as exc:
                # Checked by its CRC, so written so by a router: keep it out of the way, say so.
                log.error("usage journal: a record that is not a usage record is skipped", error=str(exc), data=p[:200])
                self._journaled = max(0, self._journaled - 1)
                continue
            items.append(
                _Item(request_id=h.request_id, subject=usage_subject(h.project_id), data=p, at=h.at.timestamp())
            )
        return items

    async def _publish(self, items: list[_Item], ack_timeout_s: float) -> list[int]:
        """Publish ``items`` pipelined; the indices of those not acknowledged within ``ack_timeout_s``."""
        if self.nc is not None and not self.nc.is_connected:
            return self._failed(list(range(len(items))), {"NATS is not connected": len(items)})
        futures: list[asyncio.Future] = []
        errors: dict[str, int] = {}
        try:
            # The batch goes out in one burst (nats-py writes it in one socket write). No ``wait_stall``:
            # it cost a task and a timer per record, and at most ``batch`` (256) of this publisher's
            # records are ever pending, far below nats-py's limit of 4,000.
            for it in items:
                futures.append(await self.js.publish_async(it.subject, it.data, headers={S.HDR_MSG_ID: it.request_id}))
        except Exception as exc:  # could not even be sent (connection closed, too many pending)
            errors[f"{type(exc).__name__}: {exc}"] = len(items) - len(futures)
        if futures:
            # Each acknowledgement awaited in turn, against one deadline for the batch: a turn of the event
            # loop per record lets the requests it serves go on between them. Awaited together (one
            # asyncio.wait) the gateway's median latency at 64 concurrent was 1.4x; with wait_stall on each
            # publish instead, its CPU per request 1.1x (docs/benchmarks.md, "No regression").
            loop = asyncio.get_running_loop()
            deadline = loop.time() + ack_timeout_s
            for f in futures:
                left = deadline - loop.time()
                if left <= 0:
                    break
                with contextlib.suppress(Exception):  # a failed or late one is counted below
                    await asyncio.wait_for(f, left)
            for f in futures:
                if not f.done():
                    f.cancel()
        failed = list(range(len(futures), len(items)))
        for i, f in enumerate(futures):
            if f.cancelled():
                failed.append(i)
                key = f"no acknowledgement within {ack_timeout_s:g}s"
                errors[key] = errors.get(key, 0) + 1
            elif f.exception() is not None:
                failed.append(i)
                exc = f.exception()
                key = f"{type(exc).__name__}: {exc}"
                errors[key] = errors.get(key, 0) + 1
        acked = len(items) - len(failed)
        self.published += acked
        if failed:
            return self._failed(sorted(failed), errors)
        if not self._bus_ok:
            log.info("the bus acknowledges usage records again", backlog=len(self._memory) + self._journaled)
            self._bus_ok, self._bus_error = True, None
        return []

    def _failed(self, failed: list[int], errors: dict[str, int]) -> list[int]:
        error = max(errors, key=lambda e: errors[e])
        if self._bus_ok:
            log.warning(
                "the bus does not acknowledge usage records; keeping them"
                + (f" in the journal at {self.cfg.journal_dir}" if self._journal is not None else " in memory"),
                error=error,
            )
        self._bus_ok, self._bus_error = False, error
        if self.metrics:
            self.metrics.failures.inc(len(failed))
        self._failures.note(errors, len(self._memory) + self._journaled + self._sending)
        return failed

    def _scan(self) -> tuple[int, float | None]:
        """Records in the journal at start and the time of the oldest."""
        assert self._journal is not None
        count, oldest = 0, None
        for segment in self._journal.segments():
            payloads, _ = self._journal.read(segment)
            if not payloads:
                self._journal.delete(segment)  # empty, or only a torn record: nothing to publish
                continue
            count += len(payloads)
            if payloads and oldest is None:
                try:
                    oldest = _head.decode(payloads[0]).at.timestamp()
                except msgspec.DecodeError:
                    pass
        return count, oldest
