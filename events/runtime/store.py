"""The event store over JetStream: streams as code, append with optimistic concurrency, reads.

- One subject per aggregate instance gives per-aggregate order; :meth:`EventStore.append`
  sends ``Nats-Expected-Last-Subject-Sequence`` and raises :class:`AppendConflict` when another
  writer got there first, so the caller re-reads and re-decides.
- ``Nats-Msg-Id`` is the event id, so a retried publish is stored once.
- Several events are written as one atomic batch (``allow_atomic``): all or none, one flush.
- A message that cannot be decoded is quarantined (raw bytes kept in ``LLMGW_QUARANTINE``,
  counted, logged) and reading goes on: a poison message never stops a service.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import ssl
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from llmgw.events.runtime.connection import (
    ConnectionLog,
    NatsCredential,
    Quarantined,
    StoreError,
    auth_refusal,
    cluster_replicas,
    connect_urls,
    is_auth_refusal,
    server_list,
    tls_refusal,
)
from llmgw.events.runtime.metrics import StoreMetrics
from llmgw.events.runtime.reader import read_log
from llmgw.events.runtime.retry import is_transient, retrying
from llmgw.events.schema import subjects as S
from llmgw.events.schema.codec import EventDecodeError, decode_event, encode_envelope
from llmgw.events.schema.envelope import Envelope, RecordedEvent, utc_now
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.registry import EventRegistry

log = structlog.get_logger("llmgw.events.runtime.store")

# JetStream API error codes we act on.
ERR_WRONG_LAST_SEQUENCE = 10071
ERR_BATCH_DUPLICATE_MSG_ID = 10201
MAX_ATOMIC_BATCH = 1000


class StreamSpec(msgspec.Struct, frozen=True):
    name: str
    subjects: tuple[str, ...]
    retention: str = "limits"  # limits | workqueue
    max_age_s: float = 0.0  # 0: kept
    max_msgs_per_subject: int = -1
    duplicate_window_s: float = 120.0
    allow_atomic: bool = True
    description: str = ""


# The streams, as code. Created (or updated) idempotently at start by every process that needs them.
STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(S.STREAM_EVENTS, (f"{S.EVENTS_ROOT}.>",), description="durable facts: the source of truth"),
    StreamSpec(
        S.STREAM_COMMANDS,
        (f"{S.COMMANDS_ROOT}.>",),
        retention="workqueue",
        max_age_s=7 * 86400,
        allow_atomic=False,
        description="what people and tools ask for",
    ),
    StreamSpec(S.STREAM_USAGE, (f"{S.USAGE_ROOT}.>",), max_age_s=400 * 86400, description="one record per request"),
    StreamSpec(
        S.STREAM_TELEMETRY,
        (f"{S.TELEMETRY_ROOT}.>",),
        max_age_s=3600,
        max_msgs_per_subject=120,
        allow_atomic=False,
        description="heartbeats, load, sensors",
    ),
    StreamSpec(
        S.STREAM_QUARANTINE,
        (f"{S.QUARANTINE_ROOT}.>",),
        max_age_s=90 * 86400,
        allow_atomic=False,
        description="messages no reader could decode, kept with their raw bytes",
    ),
)


class ReplicaMismatch(msgspec.Struct, frozen=True):
    """A stream or bucket whose replica count is not the one this process was configured with."""

    stream: str
    configured: int
    actual: int

    def message(self) -> str:
        return (
            f"stream {self.stream} has {self.actual} replica(s), this process is configured for {self.configured}; "
            f"it is left as it is: change it with `llmgw streams replicas {self.configured}`"
        )


class AppendConflict(StoreError):
    """Another writer appended to the aggregate first: re-read, re-decide, try again."""

    def __init__(self, subject: str, expected: int, actual: int | None) -> None:
        self.subject = subject
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"{subject} has moved on (expected last sequence {expected}, it is {actual}); "
            "re-read the aggregate and decide again"
        )


class NewEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event to append: its payload and who/what caused it. The id doubles as ``Nats-Msg-Id``."""

    payload: msgspec.Struct
    actor: str
    causation: str | None = None
    correlation: str | None = None
    id: str = msgspec.field(default_factory=new_id)


class AppendResult(msgspec.Struct, frozen=True):
    seqs: tuple[int, ...]
    duplicate: bool = False

    @property
    def last_seq(self) -> int:
        return self.seqs[-1] if self.seqs else 0


def _differs(config: StreamConfig, spec: StreamSpec) -> bool:
    """Whether a stream's settings (replicas aside) differ from its spec: only then is it updated."""
    want = _stream_config(spec, config.num_replicas or 1)
    fields = ("subjects", "max_age", "max_msgs_per_subject", "duplicate_window", "description", "allow_direct")
    return any(_norm(getattr(config, f)) != _norm(getattr(want, f)) for f in fields) or bool(
        config.allow_atomic
    ) != bool(want.allow_atomic)


def _norm(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 3)
    if isinstance(value, list):
        return sorted(value)
    return value


def _stream_config(spec: StreamSpec, replicas: int) -> StreamConfig:
    return StreamConfig(
        name=spec.name,
        description=spec.description,
        subjects=list(spec.subjects),
        retention=RetentionPolicy.WORK_QUEUE if spec.retention == "workqueue" else RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        num_replicas=replicas,
        max_age=spec.max_age_s,
        max_msgs_per_subject=spec.max_msgs_per_subject,
        duplicate_window=spec.duplicate_window_s,
        discard=DiscardPolicy.OLD,
        allow_direct=True,
        allow_atomic=spec.allow_atomic or None,
    )


class EventStore:
    """Append and read events on ``LLMGW_EVENTS``; the other streams share the connection."""

    def __init__(
        self,
        nc: NATS,
        registry: EventRegistry,
        *,
        replicas: int | None = None,
        metrics: StoreMetrics | None = None,
        stream: str = S.STREAM_EVENTS,
        append_retry_s: float = 20.0,
    ) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream(timeout=10.0)
        self.registry = registry
        # None: as many as the cluster has nodes (at most 3), as the connected server says.
        self.replicas = replicas if replicas is not None else cluster_replicas(connect_urls(nc))
        self.append_retry_s = append_retry_s  # how long an append rides out a leader election or a lost node
        self.metrics = metrics or StoreMetrics()
        self.stream = stream

    @classmethod
    async def connect(
        cls,
        url: str | Sequence[str],
        registry: EventRegistry,
        *,
        tls: ssl.SSLContext | None = None,
        tls_hostname: str | None = None,
        creds: NatsCredential | None = None,
        give_up_s: float | None = None,
        **kwargs: Any,
    ) -> EventStore:
        """Connect to NATS at ``url``: one URL or several (comma-separated), any of which will do.

        With several, the client moves to another listed (or gossiped) node when its node goes away.
        ``tls``: connect over TLS with this context (its CA, and a client certificate for servers that
        verify one); ``tls_hostname``: the name the servers' certificates must carry when the URLs do not;
        ``creds``: the NATS user to connect as (its replies come to that user's own inbox prefix);
        ``give_up_s``: how long to keep trying to reach a server the first time (None: as long as it takes,
        for services, which wait for their NATS; the CLI gives up and says so).
        """
        servers = server_list(url)
        if not servers:
            raise StoreError("no NATS URL given: pass --nats nats://HOST:4222 (a cluster: comma-separated)")
        events = ConnectionLog()
        nc = NATS()
        connecting = asyncio.ensure_future(
            nc.connect(
                servers=servers,
                connect_timeout=5,
                max_reconnect_attempts=-1,
                reconnect_time_wait=0.5,
                # A paused or wedged node keeps the socket open: pings notice it in seconds, not minutes.
                ping_interval=5,
                max_outstanding_pings=2,
                drain_timeout=5,
                name="llmgw",
                error_cb=events.error,
                disconnected_cb=events.disconnected,
                reconnected_cb=events.reconnected,
                **({"tls": tls, "tls_hostname": tls_hostname} if tls is not None else {}),
                **(
                    {"user": creds.user, "password": creds.password, "inbox_prefix": creds.inbox_prefix}
                    if creds is not None
                    else {}
                ),
            )
        )
        try:
            # The client retries a refused TLS handshake or user for ever: the first refusal ends the attempt, with why.
            await asyncio.wait(
                [connecting, events.tls_refused, events.auth_refused],
                timeout=give_up_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if not connecting.done():
                connecting.cancel()
                with contextlib.suppress(BaseException):
                    await connecting
                with contextlib.suppress(Exception):
                    await nc.close()
                if events.auth_refused.done():
                    raise StoreError(auth_refusal(servers, creds))
                if events.tls_refused.done():
                    raise StoreError(tls_refusal(servers, events.tls_refused.result(), tls is not None))
                raise StoreError(
                    f"cannot reach NATS at {', '.join(servers)} within {give_up_s:.0f} s: is `llmgw up` (or the "
                    "cluster's NATS) running, and is this the address (--nats, LLMGW_NATS_URL)?"
                )
            connecting.result()
        except Exception as exc:
            if isinstance(exc, StoreError):
                raise
            if is_auth_refusal(exc):
                raise StoreError(auth_refusal(servers, creds)) from exc
            if isinstance(exc, OSError | nats.errors.NoServersError | TimeoutError):
                raise StoreError(f"cannot reach NATS at {', '.join(servers)}: {exc}; is `llmgw up` running?") from exc
            raise
        finally:
            events.tls_refused.cancel()
            events.auth_refused.cancel()
        if tls is not None and not (getattr(nc, "_server_info", None) or {}).get("tls_required"):
            # The client falls back to plain text with a server that does not ask for TLS: refused instead.
            with contextlib.suppress(Exception):
                await nc.close()
            raise StoreError(
                f"NATS at {', '.join(servers)} does not speak TLS, yet a NATS CA was given: add a tls block to the "
                "servers' configuration (ops/nats/cluster-tls.conf), or drop --nats-ca (LLMGW_NATS_CA)"
            )
        events.nc = nc
        return cls(nc, registry, **kwargs)

    def on_stream(self, stream: str) -> EventStore:
        """This store reading ``stream`` instead (e.g. ``LLMGW_USAGE``): same connection, registry and metrics.

        Reads (``subscribe``, ``last_seq``, ``stream_last_seq``, ``get``) go to ``stream``; closing the
        view closes the shared connection, so close only the store it came from.
        """
        if stream == self.stream:
            return self
        return EventStore(
            self.nc,
            self.registry,
            replicas=self.replicas,
            metrics=self.metrics,
            stream=stream,
            append_retry_s=self.append_retry_s,
        )

    async def close(self, timeout_s: float = 10.0) -> None:
        """Drain and close the connection, in bounded time: a node that does not answer cannot hold the exit."""
        with contextlib.suppress(Exception):
            async with asyncio.timeout(timeout_s):
                await self.nc.drain()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2.0):
                await self.nc.close()

    # -- streams -----------------------------------------------------------------------------

    async def ensure_streams(
        self, specs: Sequence[StreamSpec] = STREAMS, *, update: bool = True
    ) -> list[ReplicaMismatch]:
        """Create each missing stream at the configured replicas; bring an existing one's other settings up
        to date, keeping its replica count. Safe to call from every process.

        Replicas change only by :meth:`set_replicas` (an operator's `llmgw streams replicas N`): a process
        started with another count (an agent, a server without ``--replicas``) must never scale a
        cluster's streams down. A difference is logged as a warning and returned. ``update=False`` (an
        agent) creates what is missing and leaves existing streams entirely to the servers.
        """
        mismatches: list[ReplicaMismatch] = []
        for spec in specs:
            try:
                info = await retrying(f"stream {spec.name}", lambda name=spec.name: self.js.stream_info(name))
            except nats.js.errors.NotFoundError:
                await self._add_stream(_stream_config(spec, self.replicas))
                continue
            actual = info.config.num_replicas or 1
            if actual != self.replicas:
                mismatches.append(ReplicaMismatch(spec.name, self.replicas, actual))
            if update and _differs(info.config, spec):
                await retrying(
                    f"update stream {spec.name}",
                    lambda spec=spec, n=actual: self.js.update_stream(_stream_config(spec, n)),
                )
        mismatches += await self._bucket_mismatches()
        for m in mismatches:
            log.warning(
                "replica count differs from the configured one; left as it is",
                stream=m.stream,
                configured=m.configured,
                actual=m.actual,
                change_with=f"llmgw streams replicas {m.configured}",
            )
        return mismatches

    async def _add_stream(self, config: StreamConfig) -> None:
        try:
            await retrying(f"create stream {config.name}", lambda: self.js.add_stream(config))
        except nats.js.errors.BadRequestError:
            pass  # another process created it meanwhile (10058): it is kept as that process made it

    async def _bucket_mismatches(self) -> list[ReplicaMismatch]:
        out: list[ReplicaMismatch] = []
        for name in await self._kv_streams():
            with contextlib.suppress(nats.js.errors.NotFoundError):
                info = await retrying(f"bucket {name}", lambda name=name: self.js.stream_info(name))
                actual = info.config.num_replicas or 1
                if actual != self.replicas:
                    out.append(ReplicaMismatch(name, self.replicas, actual))
        return out

    async def _kv_streams(self) -> list[str]:
        names = await retrying("list streams", self.js.streams_info)
        # Key-value buckets and object stores (the services' snapshots): streams underneath, kept at the replicas too.
        return sorted(i.config.name for i in names if (i.config.name or "").startswith(("KV_llmgw", "OBJ_llmgw")))

    async def replica_counts(self, specs: Sequence[StreamSpec] = STREAMS) -> list[tuple[str, int]]:
        """Each existing llmgw stream and bucket with its replica count."""
        out: list[tuple[str, int]] = []
        for name in [s.name for s in specs] + await self._kv_streams():
            with contextlib.suppress(nats.js.errors.NotFoundError):
                info = await retrying(f"stream {name}", lambda name=name: self.js.stream_info(name))
                out.append((name, info.config.num_replicas or 1))
        return out

    async def set_replicas(self, replicas: int, specs: Sequence[StreamSpec] = STREAMS) -> list[tuple[str, int, int]]:
        """An operator's change of every llmgw stream's and bucket's replica count; (name, before, after) each.

        JetStream moves the data itself; on a cluster of fewer nodes than ``replicas`` the server refuses.
        """
        if replicas < 1:
            raise StoreError(f"a stream needs at least 1 replica, not {replicas}")
        changed: list[tuple[str, int, int]] = []
        names = [s.name for s in specs] + await self._kv_streams()
        for name in names:
            try:
                info = await retrying(f"stream {name}", lambda name=name: self.js.stream_info(name))
            except nats.js.errors.NotFoundError:
                continue
            before = info.config.num_replicas or 1
            if before == replicas:
                continue
            config = dataclasses.replace(info.config, num_replicas=replicas)
            try:
                await retrying(f"update stream {name}", lambda config=config: self.js.update_stream(config))
            except nats.js.errors.APIError as exc:
                raise StoreError(f"JetStream refused {replicas} replicas for {name}: {exc.description}") from exc
            changed.append((name, before, replicas))
            log.warning("stream replicas changed", stream=name, before=before, after=replicas)
        self.replicas = replicas
        return changed

    # -- append ------------------------------------------------------------------------------

    def envelope(self, event: NewEvent) -> Envelope:
        event_type = self.registry.type_of(event.payload)
        return Envelope(
            id=event.id,
            type=event_type.name,
            v=event_type.v,
            at=utc_now(),
            actor=event.actor,
            causation=event.causation,
            correlation=event.correlation,
            data=msgspec.Raw(msgspec.json.encode(event.payload)),
        )

    async def append(self, subject: str, events: Sequence[NewEvent], *, expected: int | None = None) -> AppendResult:
        """Append ``events`` to one aggregate's subject, in order, all or none.

        ``expected`` is the sequence of the aggregate's last event as the caller saw it (0 for
        a new aggregate); ``None`` appends whatever is there. Raises :class:`AppendConflict`.
        """
        if not events:
            return AppendResult(())
        items = [(subject, self.envelope(e), expected if i == 0 else None) for i, e in enumerate(events)]
        with self.metrics.append_seconds.time():
            if len(items) == 1:
                result = await self._publish_one(*items[0])
            else:
                result = await self._publish_atomic(items)
        self.metrics.appended.inc(len(events))
        return result

    async def append_many(self, items: Sequence[tuple[str, NewEvent]]) -> int:
        """Append events to many subjects with no expectation, in atomic batches of up to 1,000.

        Group commit: one durable flush per batch instead of one per event. Returns the last sequence.
        """
        last = 0
        for start in range(0, len(items), MAX_ATOMIC_BATCH):
            chunk = [(subj, self.envelope(e), None) for subj, e in items[start : start + MAX_ATOMIC_BATCH]]
            with self.metrics.append_seconds.time():
                res = await self._publish_atomic(chunk) if len(chunk) > 1 else await self._publish_one(*chunk[0])
            last = max(last, res.last_seq)
            self.metrics.appended.inc(len(chunk))
        return last

    async def append_fenced(
        self, items: Sequence[tuple[str, NewEvent]], *, fence_subject: str, fence_seq: int
    ) -> AppendResult:
        """Append events to many subjects as one atomic batch, only while ``fence_subject`` is still at
        ``fence_seq``: a leader's decisions are refused once another leader has been elected (SCHED-13).

        Raises :class:`AppendConflict` (with ``subject`` = the fence) when the fence has moved.
        """
        if not items:
            return AppendResult(())
        if len(items) > MAX_ATOMIC_BATCH:
            raise StoreError(f"a fenced append holds at most {MAX_ATOMIC_BATCH} events, not {len(items)}")
        batch = [(subj, self.envelope(e), None) for subj, e in items]
        with self.metrics.append_seconds.time():
            result = await self._publish_atomic(batch, fence=(fence_subject, fence_seq))
        self.metrics.appended.inc(len(items))
        return result

    async def publish_raw(self, subject: str, data: bytes, headers: dict[str, str] | None = None) -> int:
        """Publish bytes as they are (tests and tools that must write what no codec would)."""
        ack = await self.js.publish(subject, data, headers=headers)
        return ack.seq

    async def _publish_one(self, subject: str, env: Envelope, expected: int | None) -> AppendResult:
        headers = {S.HDR_MSG_ID: env.id}
        if expected is not None:
            headers[S.HDR_EXPECTED_LAST_SUBJECT_SEQ] = str(expected)
        data = encode_envelope(env)
        tries = 0

        async def publish() -> Any:
            nonlocal tries
            tries += 1
            return await self.js.publish(subject, data, headers=headers)

        try:
            # Retried through an election or a lost node; Nats-Msg-Id makes a retry of a stored event a no-op.
            ack = await retrying(f"append to {subject}", publish, deadline_s=self.append_retry_s)
        except nats.js.errors.APIError as exc:
            if tries > 1 and exc.err_code == ERR_WRONG_LAST_SEQUENCE:
                # The server checks the expected sequence before duplicates: a retry whose first try
                # was stored (its answer lost in the election) looks like a conflict. It is not one.
                stored = await self._stored_last(subject, env.id)
                if stored:
                    return AppendResult((stored,), duplicate=True)
            raise self._translate(exc, subject, expected) from exc
        except Exception as exc:
            if is_transient(exc):
                raise StoreError(f"no acknowledgement from JetStream for {subject}: {exc!r}") from exc
            raise
        return AppendResult((ack.seq,), duplicate=bool(ack.duplicate))

    async def _stored_last(self, subject: str, event_id: str) -> int:
        """The sequence of the last message on ``subject`` when it is event ``event_id``; else 0."""
        try:
            msg = await self.js.get_last_msg(self.stream, subject)
        except Exception:  # best effort: without an answer, the conflict stands
            return 0
        return (msg.seq or 0) if (msg.headers or {}).get(S.HDR_MSG_ID) == event_id else 0

    async def _publish_atomic(
        self, items: Sequence[tuple[str, Envelope, int | None]], fence: tuple[str, int] | None = None
    ) -> AppendResult:
        # Retried whole through an election or a lost node: the server drops a batch it never saw
        # committed, and one it stored answers the retry as a duplicate.
        try:
            return await retrying(
                f"append a batch of {len(items)}",
                lambda: self._publish_batch(items, fence),
                deadline_s=self.append_retry_s,
            )
        except StoreError:
            raise
        except Exception as exc:
            if is_transient(exc):
                raise StoreError(f"no acknowledgement from JetStream for a batch of {len(items)}: {exc!r}") from exc
            raise

    async def _publish_batch(
        self, items: Sequence[tuple[str, Envelope, int | None]], fence: tuple[str, int] | None
    ) -> AppendResult:
        batch_id = new_id()
        n = len(items)
        for i, (subject, env, expected) in enumerate(items, start=1):
            headers = {S.HDR_BATCH_ID: batch_id, S.HDR_BATCH_SEQ: str(i), S.HDR_MSG_ID: env.id}
            if expected is not None:
                headers[S.HDR_EXPECTED_LAST_SUBJECT_SEQ] = str(expected)
            if fence is not None and i == 1:
                headers[S.HDR_EXPECTED_LAST_SUBJECT_SEQ] = str(fence[1])
                headers[S.HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT] = fence[0]
            payload = encode_envelope(env)
            if i < n:
                await self.nc.publish(subject, payload, headers=headers)
                continue
            headers[S.HDR_BATCH_COMMIT] = "1"
            try:
                reply = await self.nc.request(subject, payload, headers=headers, timeout=10.0)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
                raise StoreError(f"no acknowledgement from JetStream for a batch of {n}: {exc}") from exc
            resp = json.loads(reply.data)
            if "error" in resp:
                err = resp["error"]
                if err.get("err_code") == ERR_BATCH_DUPLICATE_MSG_ID:
                    # The batch was stored before (a retry): all or none, so all of it is there.
                    return AppendResult((), duplicate=True)
                api_error = nats.js.errors.APIError(
                    code=err.get("code"), err_code=err.get("err_code"), description=err.get("description")
                )
                if fence is not None:
                    raise self._translate(api_error, fence[0], fence[1]) from api_error
                raise self._translate(api_error, items[0][0], items[0][2]) from api_error
            last = int(resp["seq"])
            return AppendResult(tuple(range(last - n + 1, last + 1)))
        raise AssertionError("unreachable")

    def _translate(self, exc: nats.js.errors.APIError, subject: str, expected: int | None) -> StoreError:
        if exc.err_code == ERR_WRONG_LAST_SEQUENCE and expected is not None:
            self.metrics.conflicts.inc()
            actual = None
            desc = exc.description or ""
            if ":" in desc:
                with contextlib.suppress(ValueError):
                    actual = int(desc.rsplit(":", 1)[1].strip())
            return AppendConflict(subject, expected, actual)
        return StoreError(f"JetStream refused the append to {subject}: {exc.description} ({exc.err_code})")

    # -- read --------------------------------------------------------------------------------

    async def last_seq(self, subject: str) -> int:
        """The stream sequence of the last event on ``subject``; 0 when it has none."""
        try:
            msg = await self.js.get_last_msg(self.stream, subject, direct=True)
        except nats.js.errors.NotFoundError:
            return 0
        return msg.seq or 0

    async def stream_last_seq(self) -> int:
        info = await self.js.stream_info(self.stream)
        return info.state.last_seq

    async def get(self, seq: int) -> RecordedEvent | Quarantined | None:
        try:
            msg = await self.js.get_msg(self.stream, seq, direct=True)
        except nats.js.errors.NotFoundError:
            return None
        return await self._decode(msg.subject or "", msg.data or b"", seq)

    async def read(self, subject: str, *, after: int = 0) -> list[RecordedEvent]:
        """One aggregate's history (events after sequence ``after``), decoded, in order."""
        out: list[RecordedEvent] = []
        async for batch in self.subscribe(subject, after=after, follow=False):
            out.extend(e for e in batch if isinstance(e, RecordedEvent))
        return out

    async def subscribe(
        self,
        subject: str = f"{S.EVENTS_ROOT}.>",
        *,
        after: int = 0,
        follow: bool = True,
        batch_size: int = 500,
        until: int | None = None,
    ) -> AsyncIterator[list[RecordedEvent | Quarantined]]:
        """Yield batches of decoded events after sequence ``after`` on ``subject``.

        With ``follow`` it waits for new events forever; without, it ends once it has caught up
        with the stream (or reached ``until``). Undecodable messages are quarantined and yielded as
        :class:`Quarantined` so a reader's position moves past them. A pull consumer underneath
        (:mod:`llmgw.events.runtime.reader`): however slow the reader, no event is ever skipped.
        """
        async for batch in read_log(self, subject, after=after, follow=follow, batch_size=batch_size, until=until):
            yield batch

    async def _decode(self, subject: str, data: bytes, seq: int) -> RecordedEvent | Quarantined:
        try:
            return decode_event(self.registry, data, subject, seq)
        except EventDecodeError as exc:
            await self.quarantine(self.stream, subject, seq, data, str(exc))
            return Quarantined(subject, seq, str(exc))

    async def quarantine(self, stream: str, subject: str, seq: int, data: bytes, error: str) -> None:
        """Keep an undecodable message's bytes, count it, log it. Stored once however many readers see it."""
        self.metrics.quarantined.labels(stream=stream).inc()
        log.warning("event quarantined", stream=stream, subject=subject, seq=seq, error=error[:300])
        headers = {
            S.HDR_MSG_ID: f"q-{stream}-{seq}",
            "Llmgw-Origin-Stream": stream,
            "Llmgw-Origin-Subject": subject,
            "Llmgw-Origin-Seq": str(seq),
            "Llmgw-Error": error[:500].replace("\r", " ").replace("\n", " "),
        }
        try:
            await self.js.publish(f"{S.QUARANTINE_ROOT}.{stream.lower()}", data, headers=headers)
        except Exception as exc:  # quarantine is best effort: the reader must go on regardless
            log.error("could not write quarantined message", seq=seq, error=str(exc))
