"""Is an engine ready? ``GET /health`` (FLEET-5).

llama.cpp binds its port before loading the model and answers ``/health`` with 503 while loading,
200 once ready; vLLM answers 200 once its API server is up. Both leave ``/health`` public; the key
is sent anyway, so a probe behaves the same if an engine ever guards it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import aiohttp

_FIRST_INTERVAL_S = 0.02  # the tiny test model is ready in milliseconds
_MAX_INTERVAL_S = 0.5  # a 70B model takes minutes: no need to ask more often than this
_REQUEST_TIMEOUT_S = 2.0


class EngineStartError(RuntimeError):
    """The engine did not become healthy."""


class EngineExited(EngineStartError):
    """The engine's process ended before it was healthy."""


class EngineStartTimeout(EngineStartError):
    """The engine was still not healthy when the startup deadline passed."""


def _headers(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def _health_status(session: aiohttp.ClientSession, base_url: str, key: str, timeout_s: float) -> str:
    """'ready', or what the engine said instead (for the error when it never gets ready)."""
    try:
        async with session.get(
            f"{base_url.rstrip('/')}/health",
            headers=_headers(key),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            if resp.status == 200:
                return "ready"
            body = (await resp.text())[:200]
            return f"HTTP {resp.status} {body}".strip()
    except (TimeoutError, aiohttp.ClientError, OSError) as e:
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


async def probe(base_url: str, key: str, *, timeout_s: float = _REQUEST_TIMEOUT_S) -> bool:
    """One ``GET /health``: True when the engine answers 200."""
    async with aiohttp.ClientSession() as session:
        return await _health_status(session, base_url, key, timeout_s) == "ready"


async def wait_healthy(
    base_url: str,
    *,
    key: str,
    deadline_s: float,
    proc_alive: Callable[[], bool],
) -> None:
    """Return once ``GET /health`` answers 200.

    Raises ``EngineExited`` as soon as ``proc_alive()`` is false (no point waiting out the
    deadline for a process that died), ``EngineStartTimeout`` after ``deadline_s`` seconds; both
    say what the engine last answered.
    """
    end = time.monotonic() + deadline_s
    interval = _FIRST_INTERVAL_S
    last = "no answer yet"
    async with aiohttp.ClientSession() as session:
        while True:
            if not proc_alive():
                raise EngineExited(f"engine at {base_url} exited before it was healthy (last probe: {last})")
            remaining = end - time.monotonic()
            if remaining <= 0:
                raise EngineStartTimeout(f"engine at {base_url} not healthy after {deadline_s:g}s (last probe: {last})")
            last = await _health_status(session, base_url, key, min(_REQUEST_TIMEOUT_S, max(remaining, 0.05)))
            if last == "ready":
                return
            # Not a fixed sleep: a backoff between probes, bounded by the deadline.
            await asyncio.sleep(min(interval, max(end - time.monotonic(), 0)))
            interval = min(interval * 2, _MAX_INTERVAL_S)
