"""Reading the log: a JetStream pull consumer, so a slow reader can never lose events.

Why not a push (ordered) consumer: the server sends as fast as it can and, when the client's
pending buffer is full, nats-py drops messages as a "slow consumer" *after* counting them as
delivered, so the ordered consumer never notices the gap. A reader slower than the bus (a
catch-up after downtime, a rebuild, a service folding the log at start) then silently skips
events — measured: 21,706 of 80,000 lost in one catch-up. A pull consumer only sends what was
asked for, so nothing is ever dropped. Every reader of the log goes through :func:`read_log`
(``EventStore.subscribe`` is it).

The reader keeps one pull request open, for one batch, and asks for the next as soon as that one
is filled and fewer than a batch are waiting: the next batch crosses the network while the
current one is applied, and at most two batches are ever held. When caught up, the open request
delivers each new event the moment it is written (read-your-writes stays quick). nats-py's own
``fetch`` is not used: it waits per message and for a batch to fill, which halves the read rate.

A consumer can vanish under a reader: its consumers live in memory, so a restarted nats-server has
none, and an operator may delete one. The server then never answers the reader's request, so each
request asks for idle heartbeats; a reader that hears nothing for a few of them checks its
consumer, and when it is gone makes a new one from the last event it delivered and reads on.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import APIError, NotFoundError

from llmgw.events.runtime.connection import Quarantined, StoreError, connect_urls
from llmgw.events.runtime.retry import backoff_delay, is_transient
from llmgw.events.schema.codec import EventDecodeError, decode_event
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.registry import EventRegistry

JS_API = "$JS.API"  # the store's JetStream context uses the default API prefix (no domain)
REQUEST_S = 30.0  # a pull request's life on the server; renewed when it ends
INACTIVE_S = 600.0  # the server deletes a consumer nobody pulled from for this long (a crashed reader)
HEARTBEAT_S = 5.0  # an open request is idle-heartbeated this often; silence for SILENCE_S means it was lost
SILENCE_S = HEARTBEAT_S * 3
LAGGING_WAIT_S = 30.0  # how long a read that ends waits for a replica catching up before it ends short
_encode = msgspec.json.Encoder().encode
if TYPE_CHECKING:  # the store reads through this module; the reader only names it
    from llmgw.events.runtime.store import EventStore

log = structlog.get_logger("llmgw.events.runtime.reader")

# bytes → event (``Projection.decode``): the envelope codec on the event log, another on another stream.
Decoder = Callable[[EventRegistry, bytes, str, int], RecordedEvent]


class _ConsumerGone(Exception):
    """The reader's consumer no longer exists (deleted, or the server restarted): make it again."""


class _Puller:
    """A pull consumer's deliveries, with one request for one batch kept open ahead of the reader."""

    def __init__(self, store: EventStore, consumer: str, batch: int) -> None:
        self.store = store
        self.consumer = consumer
        self.nc = store.nc
        self.next_subject = f"{JS_API}.CONSUMER.MSG.NEXT.{store.stream}.{consumer}"
        self.inbox = self.nc.new_inbox()
        self.batch = batch
        self.buffer: collections.deque[Any] = collections.deque()
        self.arrived = asyncio.Event()
        self.open = False  # a request is open on the server
        self.received = 0  # messages delivered for the open request
        self.error: Exception | None = None
        self.closed = False
        self.unanswered = 0  # consumer checks in a row that got no answer
        self.sub: Any = None
        self.request = _encode(
            {"batch": batch, "expires": int(REQUEST_S * 1e9), "idle_heartbeat": int(HEARTBEAT_S * 1e9)}
        )

    async def start(self) -> None:
        # Never more than two batches in flight or waiting; the limit only guards against a bug.
        self.sub = await self.nc.subscribe(self.inbox, cb=self._on_msg, pending_msgs_limit=self.batch * 4 + 64)
        await self._ask()

    async def close(self) -> None:
        self.closed = True
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()

    async def _ask(self) -> None:
        if self.open or self.closed or self.error or len(self.buffer) >= self.batch:
            return
        self.open, self.received = True, 0  # set before the await: a concurrent caller sees it
        await self.nc.publish(self.next_subject, self.request, reply=self.inbox)

    async def _on_msg(self, msg: Any) -> None:
        status = msg.headers.get("Status") if msg.headers else None
        if status is None:
            self.buffer.append(msg)
            self.received += 1
            if self.received >= self.batch:
                self.open = False
        elif status == "100":
            pass  # an idle heartbeat: the request is alive (the waiter's clock starts again)
        elif status in ("404", "408") or (status == "409" and "deleted" not in _description(msg).lower()):
            self.open = False  # the request ended (expired, or the server shed it): ask again
        elif status == "409" or status == "503":  # "Consumer Deleted", or nobody serves its subject
            self.error = _ConsumerGone(f"{status} {_description(msg)}")
        else:
            self.error = StoreError(f"JetStream ended the log reader: {status} {_description(msg)}")
        self.arrived.set()
        await self._ask()

    async def take(self) -> list[Any]:
        """The messages waiting (at most one batch), waiting for at least one."""
        while not self.buffer:
            if self.error is not None:
                raise self.error
            self.arrived.clear()
            await self._ask()
            if self.buffer:
                break
            try:
                # Silence past a few heartbeats: the request was lost (a reconnect, a server restart).
                # asyncio.timeout, not wait_for: on 3.11 wait_for can swallow a cancel that lands as
                # a message arrives, and the reader's caller would then wait forever.
                async with asyncio.timeout(SILENCE_S):
                    await self.arrived.wait()
            except TimeoutError:
                await self._check_consumer()
                self.open = False
        n = min(self.batch, len(self.buffer))
        out = [self.buffer.popleft() for _ in range(n)]
        await self._ask()
        return out

    async def _check_consumer(self) -> None:
        try:
            await self.store.js.consumer_info(self.store.stream, self.consumer)
        except NotFoundError as exc:
            raise _ConsumerGone("the consumer no longer exists") from exc
        except Exception as exc:
            # Unreachable for now. Twice in a row: its node is likely gone (a consumer has one replica),
            # so make a new one elsewhere rather than wait for that node.
            self.unanswered += 1
            if self.unanswered >= 2:
                raise _ConsumerGone(f"the consumer does not answer ({type(exc).__name__})") from exc
            return
        self.unanswered = 0


def _position(reply: str) -> tuple[int, int]:
    """(stream sequence, messages pending after it) from a delivery's reply subject.

    ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<dseq>.<ts>.<pending>``, or with domain and
    account hash after ``ACK`` (v2). Parsed here because nats-py's ``metadata`` also builds a
    datetime per message, a tenth of the reader's time.
    """
    t = reply.split(".")
    if len(t) == 9:
        return int(t[5]), int(t[8])
    return int(t[7]), int(t[10])


def _description(msg: Any) -> str:
    return (msg.headers or {}).get("Description", "")


async def read_log(
    store: EventStore,
    subject: str,
    *,
    after: int = 0,
    follow: bool = True,
    batch_size: int = 1000,
    until: int | None = None,
    decode: Decoder = decode_event,
) -> AsyncIterator[list[RecordedEvent | Quarantined]]:
    """Yield batches of decoded events on ``subject`` after sequence ``after``, in log order.

    The same contract as ``EventStore.subscribe``: with ``follow`` it waits for new events
    forever; without, it ends once it has caught up (or reached ``until``). Undecodable messages
    are quarantined and yielded as :class:`Quarantined` so a reader's position moves past them.
    It reads ``store.stream`` (see ``EventStore.on_stream``), each message through ``decode``.
    """
    if until is not None and until <= after:
        return
    position = after  # the last event delivered: a lost consumer is made again from the next one
    # In a cluster, a read that ends reads up to the last event on the subject as the stream's leader
    # knows it: the consumer may sit on a replica still catching up (a node just back), which knows
    # fewer events. Asked while the consumer is made, so it costs no extra round trip; alone, 0.
    head = 0
    asking = asyncio.ensure_future(_leader_head(store, subject)) if not follow and _clustered(store) else None
    behind = False  # the consumer said "nothing more" short of the head: its replica is catching up
    attempt = 0
    while True:
        try:
            info = await _consumer(store, subject, position)
        except Exception as exc:
            # A follower outlives NATS trouble (an election, a lost node): wait, then read on from here.
            if not follow or not is_transient(exc):
                if asking is not None:
                    asking.cancel()
                raise
            attempt += 1
            delay = backoff_delay(attempt)
            log.warning(
                "the log reader waits for NATS", subject=subject, after=position, error=str(exc), retry_in_s=delay
            )
            await asyncio.sleep(delay)
            continue
        if asking is not None:
            try:
                head = await asking
            except BaseException:
                with contextlib.suppress(Exception):
                    await store.js.delete_consumer(store.stream, info.name)
                raise
            asking = None
        if not follow and info.num_pending == 0:
            if position >= head:
                with contextlib.suppress(Exception):
                    await store.js.delete_consumer(store.stream, info.name)
                return
            behind = True
        puller = _Puller(store, info.name, batch_size)
        try:
            await puller.start()
            while True:
                try:
                    if behind:
                        try:
                            async with asyncio.timeout(LAGGING_WAIT_S):
                                msgs = await puller.take()
                        except TimeoutError:
                            log.warning(
                                "the log reader's replica did not catch up; the read ends short of the head",
                                subject=subject,
                                position=position,
                                head=head,
                            )
                            return
                    else:
                        msgs = await puller.take()
                    attempt = 0
                except _ConsumerGone as exc:
                    log.warning(
                        "the log reader's consumer is gone; reading on from where it was",
                        subject=subject,
                        after=position,
                        reason=str(exc),
                    )
                    break
                except Exception as exc:
                    if not follow or not is_transient(exc):
                        raise
                    log.warning(
                        "the log reader lost NATS; reading on from where it was", subject=subject, error=str(exc)
                    )
                    break
                batch: list[RecordedEvent | Quarantined] = []
                done = False
                for msg in msgs:
                    seq, pending = _position(msg.reply)
                    if seq <= position:
                        # Delivered before (a consumer remade on a restarted node starts over).
                        if not follow and pending == 0:
                            done, behind = position >= head, True
                            if done:
                                break
                        continue
                    if until is not None and seq > until:
                        done = True
                        break
                    batch.append(await _decode(store, msg.subject, msg.data, seq, decode))
                    position = seq
                    # Nothing was left after this one when it was sent: caught up (if the replica is).
                    if (until is not None and seq >= until) or (not follow and pending == 0 and seq >= head):
                        done = True
                        break
                    behind = not follow and pending == 0
                if batch:
                    yield batch
                if done:
                    return
        finally:
            await puller.close()
            # Bounded: during an outage the request would wait its full timeout for nothing; an
            # undeleted consumer goes by itself after INACTIVE_S.
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    await store.js.delete_consumer(store.stream, info.name)


def _clustered(store: EventStore) -> bool:
    """Whether the connected server is one of several (it gossips their addresses)."""
    return len(connect_urls(store.nc)) > 1


async def _leader_head(store: EventStore, subject: str) -> int:
    """The sequence of the last event on ``subject`` (wildcards too) as the stream's leader knows it; 0: none."""
    try:
        msg = await store.js.get_last_msg(store.stream, subject)  # not direct: only the leader answers
    except NotFoundError:
        return 0
    except APIError as exc:
        raise StoreError(f"cannot read {subject} from {store.stream}: {exc.description} ({exc.err_code})") from exc
    return msg.seq or 0


async def _consumer(store: EventStore, subject: str, after: int) -> Any:
    config = ConsumerConfig(
        # Named, so the filter is in the API subject ($JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>) and a
        # NATS user's permissions can hold it to the subjects it may read (infra/nats_permissions.py).
        name=new_id(),
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=after + 1,
        ack_policy=AckPolicy.NONE,
        filter_subject=subject,
        inactive_threshold=INACTIVE_S,
        mem_storage=True,
        num_replicas=1,
    )
    try:
        return await store.js.add_consumer(store.stream, config)
    except APIError as exc:
        raise StoreError(f"cannot read {subject} from {store.stream}: {exc.description} ({exc.err_code})") from exc


async def _decode(
    store: EventStore, subject: str, data: bytes, seq: int, decode: Decoder = decode_event
) -> RecordedEvent | Quarantined:
    try:
        return decode(store.registry, data, subject, seq)
    except EventDecodeError as exc:
        await store.quarantine(store.stream, subject, seq, data, str(exc))
        return Quarantined(subject, seq, str(exc))
