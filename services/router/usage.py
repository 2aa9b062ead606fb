"""Usage records off the request path: queued, published pipelined, kept until acknowledged.

A record is published with ``Nats-Msg-Id`` = its request id, so a retry after a lost
acknowledgement is stored once. Records wait in memory while NATS is away and are retried; none
is dropped while the router runs (SPEC GW-8: no usage record lost).
"""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import structlog
from nats.js import JetStreamContext

from llmgw.events import subjects as S
from llmgw.events.usage import UsageRecord, usage_subject

log = structlog.get_logger("llmgw.router.usage")
_enc = msgspec.json.Encoder()


class UsagePublisher:
    def __init__(self, js: JetStreamContext, batch: int = 256) -> None:
        self.js = js
        self.batch = batch
        self._queue: asyncio.Queue[UsageRecord] = asyncio.Queue()
        self._task: asyncio.Task | None = None
        self.published = 0

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="usage-publisher")

    def put(self, record: UsageRecord) -> None:
        self._queue.put_nowait(record)

    async def _run(self) -> None:
        while True:
            records = [await self._queue.get()]
            while len(records) < self.batch and not self._queue.empty():
                records.append(self._queue.get_nowait())
            await self._publish(records)

    async def _publish(self, records: list[UsageRecord]) -> None:
        pending = records
        delay = 0.1
        while pending:
            futures = []
            for r in pending:
                fut = await self.js.publish_async(
                    usage_subject(r.project_id), _enc.encode(r), headers={S.HDR_MSG_ID: r.request_id}
                )
                futures.append((r, fut))
            failed = []
            for r, fut in futures:
                try:
                    await asyncio.wait_for(fut, 10.0)
                    self.published += 1
                except Exception as exc:
                    failed.append(r)
                    err = str(exc)
            if failed:
                log.warning("usage records not acknowledged; retrying", count=len(failed), error=err)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
            pending = failed

    async def flush(self, timeout: float = 10.0) -> None:
        """Publish what is queued (at shutdown)."""
        end = asyncio.get_running_loop().time() + timeout
        while not self._queue.empty() and asyncio.get_running_loop().time() < end:
            await asyncio.sleep(0.02)
        if self._task:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        rest = []
        while not self._queue.empty():
            rest.append(self._queue.get_nowait())
        if rest:
            await asyncio.wait_for(self._publish(rest), timeout)
