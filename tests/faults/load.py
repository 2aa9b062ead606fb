"""A steady gateway load: N concurrent clients, each on one router, each answer kept.

A client sends one small chat completion after another. Every answer is kept with its router, its
status (0: no HTTP answer at all — refused, reset, timed out) and, for a 200, the gateway's own
request id from ``X-Request-Id`` — the id its usage record carries. A client whose router refused
the connection waits a moment before the next try, as a client library's reconnect would, so a dead
router is not a hot loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import aiohttp
import msgspec


class Answer(msgspec.Struct, frozen=True):
    started: float  # time.monotonic()
    ended: float
    router: int
    status: int  # 0: no HTTP answer
    request_id: str | None = None
    error: str | None = None


class Load:
    def __init__(
        self, gateways: list[str], key: str, model: str, *, clients: int = 8, max_tokens: int = 2, timeout_s: float = 60
    ) -> None:
        self.gateways = gateways
        self.key = key
        self.model = model
        self.clients = clients
        self.max_tokens = max_tokens
        self.timeout_s = timeout_s
        self.answers: list[Answer] = []
        self.accounted_until = 0.0  # answers that ended before this were checked against the books
        self._running = False
        self._go = asyncio.Event()  # cleared: clients hold their next request
        self._go.set()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> Load:
        self._running = True
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        return self

    async def stop(self) -> None:
        self._running = False
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), self.timeout_s + 5)
        for t in self._tasks:
            t.cancel()

    @contextlib.asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """No new request while inside (those in flight finish)."""
        self._go.clear()
        try:
            yield
        finally:
            self._go.set()

    async def _client(self, i: int) -> None:
        router = i % len(self.gateways)
        url = f"{self.gateways[router]}/v1/chat/completions"
        body = {"model": self.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": self.max_tokens}
        headers = {"Authorization": f"Bearer {self.key}"}
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while self._running:
                await self._go.wait()
                started = time.monotonic()
                try:
                    async with session.post(url, json=body, headers=headers) as r:
                        await r.read()
                        rid = r.headers.get("x-request-id") if r.status == 200 else None
                        self.answers.append(Answer(started, time.monotonic(), router, r.status, rid))
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    self.answers.append(Answer(started, time.monotonic(), router, 0, None, type(exc).__name__))
                    await asyncio.sleep(0.2)

    def between(self, start: float, end: float) -> list[Answer]:
        """The answers to requests sent in [start, end)."""
        return [a for a in self.answers if start <= a.started < end]

    def steady_since(self, window_s: float) -> bool:
        """Whether, over the last ``window_s`` seconds, every answer was a 200 and every router gave one."""
        now = time.monotonic()
        recent = [a for a in self.answers if a.ended >= now - window_s]
        if any(a.status != 200 for a in recent):
            return False
        return {a.router for a in recent} == set(range(len(self.gateways)))
