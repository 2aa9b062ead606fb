"""The backup service (SPEC OPS-3): `llmgw backup` on a schedule inside `llmgw server --services …,backup`.

It owns the backup series Prometheus reads (``llmgw_backup_last_success_timestamp_seconds`` and the
size and duration of the last archive, the failures, and the interval, so the ``BackupTooOld`` alert
needs no threshold of its own). When it starts it takes the newest archive already in its directory
as the last success, so a restart neither resets the alert nor backs up again before it is due.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

from llmgw.events.runtime.store import EventStore
from llmgw.infra import backup as B

log = structlog.get_logger("llmgw.services.backup")

EVERY_S = 86400.0
KEEP = 14


class BackupMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.last_success = Gauge(
            "llmgw_backup_last_success_timestamp_seconds",
            "When the newest backup archive was written (Unix time; 0: none yet)",
            registry=self.registry,
        )
        self.last_size = Gauge("llmgw_backup_last_size_bytes", "Size of the newest archive", registry=self.registry)
        self.last_duration = Gauge(
            "llmgw_backup_last_duration_seconds", "How long the newest backup took", registry=self.registry
        )
        self.interval = Gauge(
            "llmgw_backup_interval_seconds", "How often this process backs up", registry=self.registry
        )
        self.failures = Counter("llmgw_backup_failures", "Backups that failed", registry=self.registry)


def newest(names: Iterable[str]) -> dt.datetime | None:
    """When the newest backup archive among ``names`` was taken (from its name), or None."""
    times = [B.archive_time(n) for n in names]
    return max((t for t in times if t is not None), default=None)


def due_in(last: dt.datetime | None, now: dt.datetime, every_s: float) -> float:
    """Seconds until the next backup: now when there is none yet or it is overdue."""
    if last is None:
        return 0.0
    return max(0.0, every_s - (now - last).total_seconds())


class BackupService:
    def __init__(
        self,
        store: EventStore,
        to_dir: Path,
        *,
        every_s: float = EVERY_S,
        keep: int = KEEP,
        data_dir: Path | None = None,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        if every_s <= 0:
            raise ValueError(f"backups need an interval of more than 0 s, not {every_s}")
        self.store = store
        self.to_dir = to_dir
        self.every_s = every_s
        self.keep = keep
        self.data_dir = data_dir
        self.clock = clock
        self.metrics = BackupMetrics(registry)
        self.metrics.interval.set(every_s)
        self.last: B.BackupResult | None = None
        self._stop = asyncio.Event()

    def _existing(self) -> list[str]:
        try:
            return os.listdir(self.to_dir)
        except FileNotFoundError:
            return []

    async def run(self) -> None:
        """Back up when due, then every ``every_s``; a failed backup is logged, counted and tried again."""
        last = newest(self._existing())
        if last is not None:
            self.metrics.last_success.set(last.timestamp())
        while not self._stop.is_set():
            wait = due_in(last, self.clock(), self.every_s)
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), wait)
                continue
            try:
                await self.once()
                last = self.clock()
            except Exception as exc:  # NATS away, a full disk: the alert tells; try again in a while
                self.metrics.failures.inc()
                log.warning("backup failed; trying again later", error=str(exc), to=str(self.to_dir))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), min(self.every_s, 300.0))

    async def once(self) -> B.BackupResult:
        data_dir = self.data_dir if self.data_dir is not None and self.data_dir.is_dir() else None
        result = await B.backup(self.store.nc, self.to_dir, data_dir=data_dir, keep=self.keep, now=self.clock())
        self.last = result
        self.metrics.last_success.set(dt.datetime.fromisoformat(result.manifest.created_at).timestamp())
        self.metrics.last_size.set(result.size)
        self.metrics.last_duration.set(result.duration_s)
        log.info("backed up", path=result.path, bytes=result.size, seconds=round(result.duration_s, 3))
        return result

    def stop(self) -> None:
        self._stop.set()
