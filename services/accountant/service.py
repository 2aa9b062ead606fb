"""The accountant (SPEC USE-1, USE-2): keeps usage within its retention, and says what a scope has spent.

Folding records into ``usage_requests`` and ``usage_rollups`` is the ``usage`` projection's work,
run by the projection runner like every read model (so `llmgw projections status|rebuild|verify
usage` apply to it). This service adds what a fold cannot do: drop rows older than the retention
(by the clock, hourly) and compute budget spend per scope and period from the rollups.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from datetime import datetime

import structlog

from llmgw.events.runtime.store import STREAMS
from llmgw.events.schema.envelope import utc_now
from llmgw.events.schema.subjects import STREAM_USAGE
from llmgw.projections.backends import Backend
from llmgw.projections.usage import UsageProjection, minute_of, resolve_scope, retention_cutoff, spend, stamp

log = structlog.get_logger("llmgw.services.accountant")

# As long as the usage stream keeps records: a rebuild from the log then yields the same window.
RETENTION_DAYS = next(s.max_age_s for s in STREAMS if s.name == STREAM_USAGE) / 86400
PRUNE_EVERY_S = 3600.0


class AccountantService:
    def __init__(
        self,
        backend: Backend,
        *,
        retention_days: float = RETENTION_DAYS,
        prune_every_s: float = PRUNE_EVERY_S,
        clock: Callable[[], datetime] = utc_now,
    ) -> None:
        if retention_days <= 0:
            raise ValueError(f"usage retention must be more than 0 days, not {retention_days}")
        self.backend = backend
        self.retention_days = retention_days
        self.prune_every_s = prune_every_s
        self.clock = clock
        self.projection = UsageProjection()
        self._stop = asyncio.Event()

    async def run(self) -> None:
        """Prune now and then every ``prune_every_s`` until stopped; a failed prune is logged and retried."""
        while not self._stop.is_set():
            try:
                await self.prune()
            except Exception as exc:  # the database may be away for a while: try again next round
                log.warning("usage pruning failed; trying again later", error=str(exc))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.prune_every_s)

    def stop(self) -> None:
        self._stop.set()

    async def prune(self, now: datetime | None = None) -> int:
        """Delete requests and rollups older than the retention; how many rows went. Nothing before the first fold."""
        cutoff = retention_cutoff(now or self.clock(), self.retention_days)
        p = self.projection
        deleted = 0
        async with self.backend.transaction(p) as tx:
            if not await tx.columns(p.table_name("requests")):
                return 0  # the runner has not created the tables yet
            deleted += await tx.execute_count("DELETE FROM {requests} WHERE at < ?", stamp(cutoff))
            deleted += await tx.execute_count("DELETE FROM {rollups} WHERE minute < ?", minute_of(cutoff))
        if deleted:
            log.info("usage pruned", rows=deleted, before=cutoff.isoformat())
        return deleted

    async def spend(self, scope: str, period: str = "month", now: datetime | None = None) -> float:
        """USD spent by ``scope`` (``project:acme/ml/chat``, ``key:<id>``, …) in the current day or month (UTC)."""
        return await spend(self.backend, await resolve_scope(self.backend, scope), period, now or self.clock())
