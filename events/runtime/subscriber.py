"""One supervised core-NATS subscription: what a service follows on the bus that is not the log.

Heartbeats, the routers' demand and queue reports, `ctl explain` requests, an agent's log and weights
requests come as plain NATS messages (``nc.subscribe``), not log events. Written by hand, each was a
subscription in a task nothing awaited: one refused when it subscribed, or whose handler raised on
every message, ended or went quiet, and nothing said so.

A :class:`Subscriber` is that subscription once, under the same supervision as a
:class:`~llmgw.events.runtime.follower.Follower`, and in the same :class:`FollowerRegistry` (so it is on
``/healthz`` and in ``llmgw_fold_healthy{fold}``):

- it subscribes with backoff (:mod:`.retry`) and watches for the server's refusal — a subject its
  NATS user may not subscribe to is refused asynchronously, and nats-py only tells the connection's
  error callback, so the subscriber reads the connection's last error, after a flush and then at
  each check of its watchdog; a refused subscription is dropped and tried again with backoff (a
  reload of the server's permissions is enough), and is not live until a check passes without a
  refusal (or a message comes);
- it reads its messages in a loop of its own and gives each to the handler, one at a time (as
  ``nc.subscribe(cb=...)`` does); a handler that raises is logged and makes the subscriber
  ``failed`` until it handles a message again — the subscription goes on;
- when the subscription ends without being stopped (the server or the connection dropped it), it
  subscribes again; while NATS is disconnected for ``stall_s`` it is ``stalled``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

from llmgw.events.runtime.follower import STALL_S, FollowerHealth, FollowerRegistry, log_change
from llmgw.events.runtime.retry import keep_running, retrying

log = structlog.get_logger("llmgw.events.runtime.subscriber")

Handler = Callable[[Any], Awaitable[None]]  # given each nats.aio.msg.Msg


class SubscriptionRefused(Exception):
    """The server refused the subscription (its user may not subscribe to the subject)."""


class SubscriptionEnded(Exception):
    """The subscription's messages stopped without the subscriber being stopped."""


class SubscriberObservation(msgspec.Struct, frozen=True, kw_only=True):
    """What the subscriber knows about itself at one moment: the input to :func:`judge_subscriber`."""

    subscribed: bool  # the server took the subscription and it has not ended since
    failure: str | None  # subscribing failed, or the subscription ended, and it has not subscribed since
    handler_error: str | None  # the handler raised on the last message it was given
    disconnected_since: float | None  # when the watchdog first saw NATS disconnected (None: connected)


def judge_subscriber(o: SubscriberObservation, now: float, stall_s: float) -> tuple[str, str | None]:
    """The subscriber's state and why, from what it knows (monotonic seconds). Pure."""
    if o.failure is not None:
        return "failed", o.failure
    if o.handler_error is not None:
        return "failed", f"its handler raised on the last message: {o.handler_error}"
    if not o.subscribed:
        return "starting", None
    if o.disconnected_since is not None and now - o.disconnected_since >= stall_s:
        return "stalled", f"NATS has been disconnected for {now - o.disconnected_since:.0f} s"
    return "live", None


class Subscriber:
    """Gives each message on ``subject`` (in ``queue``'s group, if given) to ``handler``, supervised;
    see the module's docstring. Registered in ``registry`` under ``name`` from construction to
    :meth:`close`."""

    def __init__(
        self,
        nc: NATS,
        subject: str,
        handler: Handler,
        *,
        name: str,
        queue: str = "",
        registry: FollowerRegistry | None = None,
        stall_s: float = STALL_S,
        check_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.nc = nc
        self.subject = subject
        self.handler = handler
        self.name = name
        self.queue = queue
        self.stall_s = stall_s
        self.check_s = check_s if check_s is not None else max(min(stall_s / 3, 5.0), 0.05)
        self.clock = clock
        self.handled = 0  # messages handled without an error
        self.subscribed = asyncio.Event()  # set while the server has the subscription
        self.registry = registry if registry is not None else FollowerRegistry()
        self.registry.add(self)
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._failure: str | None = None
        self._sub: Subscription | None = None
        self._error_before: BaseException | None = None  # the connection's last error before it subscribed
        self._subscribed_at = 0.0
        self._refused: str | None = None  # the refusal the watchdog saw, for the loop to raise
        self._handler_error: str | None = None
        self._disconnected_since: float | None = None
        self._shown: tuple[str, float] = ("starting", time.time())
        self._alarmed = False

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Subscriber:
        """Run the subscription in a task of its own (stopped by :meth:`close`)."""
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name=f"subscriber-{self.name}")
        return self

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        self.stop()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        self.registry.remove(self)

    async def run(self) -> None:
        """Subscribe and handle messages until stopped, subscribing again after any failure, watched."""
        watchdog = asyncio.create_task(self._watch(), name=f"subscriber-{self.name}-watchdog")
        try:
            await keep_running(
                f"the {self.name} subscription", self._subscribe_once, stop=self._stop, closed=lambda: self.nc.is_closed
            )
        finally:
            watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await watchdog

    # -- the loop ----------------------------------------------------------------------------

    async def _subscribe_once(self) -> None:
        try:
            sub = await retrying(f"the {self.name} subscription", self._subscribe, stop=self._stop)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._failure = _describe(exc)
            raise
        self._sub, self._subscribed_at = sub, self.clock()
        self.subscribed.set()  # after a failure, live once a check passes without a refusal (_check_refusal)
        self.health()
        try:
            async for msg in sub.messages:
                await self._handle(msg)
        finally:
            self.subscribed.clear()
            self._sub = None
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        if self._refused is not None:
            refused, self._refused = self._refused, None
            raise SubscriptionRefused(refused)
        if not self._stop.is_set() and not self.nc.is_closed:
            self._failure = f"the subscription to {self.subject} ended; subscribing again"
            raise SubscriptionEnded(self._failure)

    async def _subscribe(self) -> Subscription:
        before = self._error_before = self.nc.last_error
        sub = await self.nc.subscribe(self.subject, queue=self.queue)
        try:
            # The server answers a refusal asynchronously, most often before the flush's answer; one
            # that comes later is caught by the watchdog (_check_refusal).
            await self.nc.flush(timeout=max(self.check_s, 2.0))
            refusal = _refusal(self.nc.last_error, before, self.subject)
        except BaseException:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            raise
        if refusal is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            raise SubscriptionRefused(f"NATS refused the subscription to {self.subject}: {refusal}")
        return sub

    async def _handle(self, msg: Any) -> None:
        try:
            await self.handler(msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            first = self._handler_error is None
            self._handler_error = _describe(exc)
            if first:  # one line per run of failures, not one per message
                log.error("a subscriber's handler failed", subscriber=self.name, subject=msg.subject, exc_info=exc)
            self.health()
            return
        self.handled += 1
        if self._handler_error is not None or self._failure is not None:
            self._handler_error = self._failure = None  # a message handled: the subscription works
            self.health()

    # -- the watchdog ------------------------------------------------------------------------

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.check_s)
            if self.nc.is_connected:
                self._disconnected_since = None
            elif self._disconnected_since is None:
                self._disconnected_since = self.clock()
            await self._check_refusal()
            self.health()  # logs a change of state, for a process nobody asks (the agent)

    async def _check_refusal(self) -> None:
        """A refusal that came after the subscribe's flush ends the subscription (the loop tries again);
        a check without one, a while after subscribing, clears the failure before it."""
        sub = self._sub
        if sub is None:
            return
        refusal = _refusal(self.nc.last_error, self._error_before, self.subject)
        if refusal is not None:
            self._failure = self._refused = f"NATS refused the subscription to {self.subject}: {refusal}"
            self._error_before = self.nc.last_error  # seen: a new subscription waits for a new refusal
            with contextlib.suppress(Exception):
                await sub.unsubscribe()  # ends the loop's reading: it raises the refusal, then subscribes again
        elif self._failure is not None and self.clock() - self._subscribed_at >= self.check_s:
            self._failure = None

    # -- health ------------------------------------------------------------------------------

    def observe(self) -> SubscriberObservation:
        return SubscriberObservation(
            subscribed=self.subscribed.is_set(),
            failure=self._failure,
            handler_error=self._handler_error,
            disconnected_since=self._disconnected_since,
        )

    def health(self) -> FollowerHealth:
        state, reason = judge_subscriber(self.observe(), self.clock(), self.stall_s)
        if state != self._shown[0]:
            self._shown = (state, time.time())
            self._alarmed = log_change(self.name, self._alarmed, state, reason, subject=self.subject)
        return FollowerHealth(name=self.name, state=state, position=self.handled, error=reason, since=self._shown[1])


def _refusal(error: BaseException | None, before: BaseException | None, subject: str) -> str | None:
    """The server's refusal of a subscription to ``subject``, if ``error`` (the connection's last,
    ``before`` the one it had before subscribing) is one: nats-py lowercases the server's text."""
    if error is None or error is before:
        return None
    text = str(error)
    if "permissions violation" in text and f'subscription to "{subject.lower()}"' in text:
        return text.removeprefix("nats: ")
    return None


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if text.startswith(type(exc).__name__) else f"{type(exc).__name__}: {text}"


__all__ = ["Subscriber", "SubscriberObservation", "SubscriptionEnded", "SubscriptionRefused", "judge_subscriber"]
