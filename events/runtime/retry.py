"""Riding out NATS trouble: which errors pass on their own, and one way to wait them out.

In a JetStream cluster a node's loss, a paused node or a leader election makes requests fail for a
few seconds — no responders, a 503 "JetStream system temporarily unavailable", a timeout, a
connection that is reconnecting to another node — and then they work again. A long-running loop
(a command processor, a log reader, the scheduler's lease) must treat those as a pause: log, wait
a little longer each time (capped), try again. Every such loop goes through this module, so they
all agree on what is transient and how long to wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
import structlog

log = structlog.get_logger("llmgw.events.runtime.retry")

T = TypeVar("T")

MIN_DELAY_S = 0.2
MAX_DELAY_S = 5.0

# Errors that say "not now" rather than "never": the cluster is electing, a node is away, the
# client is moving to another node.
_TRANSIENT_TYPES: tuple[type[BaseException], ...] = (
    TimeoutError,  # nats.errors.TimeoutError is one
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.NoServersError,
    nats.errors.FlushTimeoutError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
    ConnectionError,
)
# JetStream's descriptions for the same (the code is not always 503).
_TRANSIENT_TEXT = (
    "temporarily unavailable",
    "no responders",
    "leader",
    "quorum",
    "reconnecting",
)


def is_transient(exc: BaseException) -> bool:
    """True when ``exc`` (or what caused it) is NATS saying "not now": retrying later will do."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, nats.errors.ConnectionClosedError):
            return False  # closed by us: the process is stopping
        if isinstance(e, _TRANSIENT_TYPES):
            return True
        if isinstance(e, nats.js.errors.APIError):
            # getattr: some subclasses (KeyWrongLastSequenceError) never set the API error's fields.
            if getattr(e, "code", None) == 503:
                return True
            if any(t in (getattr(e, "description", None) or "").lower() for t in _TRANSIENT_TEXT):
                return True
        e = e.__cause__
    return False


def backoff_delay(attempt: int, min_s: float = MIN_DELAY_S, max_s: float = MAX_DELAY_S) -> float:
    """Seconds to wait before try ``attempt`` (1 = the first retry): doubling from ``min_s``, capped at ``max_s``."""
    return min(min_s * 2.0 ** max(attempt - 1, 0), max_s)


async def _pause(delay: float, stop: asyncio.Event | None) -> None:
    if stop is None:
        await asyncio.sleep(delay)
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(delay):
            await stop.wait()


async def retrying(
    what: str,
    action: Callable[[], Awaitable[T]],
    *,
    deadline_s: float | None = None,
    stop: asyncio.Event | None = None,
    max_s: float = MAX_DELAY_S,
) -> T:
    """``action()``'s result, trying again after each transient error with capped backoff.

    Other errors are raised at once; so is the last transient one once ``deadline_s`` has passed
    (``None``: no deadline) or ``stop`` is set.
    """
    end = None if deadline_s is None else time.monotonic() + deadline_s
    attempt = 0
    while True:
        try:
            return await action()
        except Exception as exc:
            if not is_transient(exc) or (stop is not None and stop.is_set()):
                raise
            attempt += 1
            delay = backoff_delay(attempt, max_s=max_s)
            if end is not None and time.monotonic() + delay > end:
                raise
            log.warning("NATS is not answering; trying again", what=what, error=_describe(exc), retry_in_s=delay)
            await _pause(delay, stop)


async def keep_running(
    what: str,
    loop: Callable[[], Awaitable[None]],
    *,
    stop: asyncio.Event,
    closed: Callable[[], bool] = lambda: False,
    max_s: float = MAX_DELAY_S,
) -> None:
    """Run a service's long-running ``loop`` until ``stop`` is set, starting it again when it fails.

    A transient error is a warning, any other an error with its traceback: either way the loop is
    started again after a capped backoff, because a service that exits takes its process down with
    it. It returns when the loop returns, when ``stop`` is set, or when ``closed()`` says the
    connection was closed (the process is stopping).
    """
    attempt = 0
    while not stop.is_set():
        started = time.monotonic()
        try:
            await loop()
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if stop.is_set() or closed() or isinstance(exc, nats.errors.ConnectionClosedError):
                return
            # A loop that ran a while before failing starts again quickly: this is a new outage.
            attempt = 1 if time.monotonic() - started > max_s * 2 else attempt + 1
            delay = backoff_delay(attempt, max_s=max_s)
            if is_transient(exc):
                log.warning("NATS is not answering; restarting", what=what, error=_describe(exc), retry_in_s=delay)
            else:
                log.error("a service loop failed; restarting it", what=what, error=_describe(exc), exc_info=exc)
            await _pause(delay, stop)


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if text.startswith(type(exc).__name__) else f"{type(exc).__name__}: {text}"
