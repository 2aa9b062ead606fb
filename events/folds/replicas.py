"""The replica lifecycle and a model's run of start failures, folded once for every reader.

The scheduler, the routers, the agents and the ``fleet`` projection all follow replicas, and each
used to fold them its own way; they drifted (a ``replica.ready`` of an old definition reset the
failure count in `ctl models` but not in the scheduler). These pure functions are the one fold:
:func:`transition` (a replica's state after one of its events), :func:`fold_replica` (the whole
replica) and :func:`fold_start_failures` (what parking counts). Readers keep what they need of
the result; none decides a transition itself.
"""

from __future__ import annotations

import msgspec

from llmgw.events.schema import models as M
from llmgw.events.schema import replicas as R


class Replica(msgspec.Struct, frozen=True, kw_only=True):
    """One replica as its events tell it. ``placed_at`` is the placement's event time (epoch seconds)."""

    id: str
    model: str
    node_id: str
    state: str = "placed"
    spec_hash: str = ""
    profile: M.Profile = M.Profile()
    source: str = ""
    cores: int = 0
    memory_bytes: int = 0
    gpus: list[int] = []
    placed_at: float = 0.0
    pid: int | None = None
    port: int | None = None
    url: str | None = None
    reason: str = ""
    log_tail: list[str] = []
    # A restart (SCHED-6): "queued" once asked for (or its replacement failed), "replacing" while a
    # replacement is placed; the old replica stops once that one is ready.
    restart: str = ""
    replaces: str = ""  # on a replacement: the replica it replaces

    @property
    def active(self) -> bool:
        return self.state in R.ACTIVE


def transition(state: str, payload: msgspec.Struct) -> str | None:
    """The state a replica in ``state`` moves to on ``payload``; None when the event does not apply.

    Late reports never undo later facts: a replica asked to drain stays draining when its
    ``starting`` or ``ready`` arrives after the request, and a stopped one stays stopped.
    """
    match payload:
        case R.ReplicaStarting():
            return "starting" if state in ("placed", "starting") else None
        case R.ReplicaReady():
            return "ready" if state in ("placed", "starting", "ready") else None
        case R.ReplicaFailed():
            return "failed" if state != "stopped" else None
        case R.ReplicaStopRequested():
            return "draining" if state in R.ACTIVE else None
        case R.ReplicaStopped():
            return "stopped"
    return None


def fold_replica(replica: Replica | None, payload: msgspec.Struct, at: float) -> Replica | None:
    """The replica after one of its events (None: not placed yet). ``at`` is the event's time. Pure.

    A replica is placed once: a second ``replica.placed`` for the same id changes nothing.
    """
    if isinstance(payload, R.ReplicaPlaced):
        if replica is not None:
            return replica
        p = payload
        return Replica(
            id=p.replica_id,
            model=p.model,
            node_id=p.node_id,
            spec_hash=p.spec_hash,
            profile=p.profile,
            source=p.source,
            cores=p.cores,
            memory_bytes=p.memory_bytes,
            gpus=list(p.gpus),
            placed_at=at,
            replaces=p.replaces,
        )
    if replica is None:
        return None
    if isinstance(payload, R.ReplicaRestartRequested):
        # Only a serving replica restarts; asking twice changes nothing.
        if replica.active and not replica.restart:
            return msgspec.structs.replace(replica, restart="queued")
        return replica
    state = transition(replica.state, payload)
    if state is None:
        return replica
    replace = msgspec.structs.replace
    match payload:
        case R.ReplicaStarting():
            return replace(replica, state=state, pid=payload.pid, port=payload.port)
        case R.ReplicaReady():
            return replace(replica, state=state, pid=payload.pid, port=payload.port, url=payload.url)
        case R.ReplicaFailed():
            return replace(replica, state=state, reason=payload.reason, log_tail=list(payload.log_tail))
        case R.ReplicaStopRequested():
            return replace(replica, state=state, reason=payload.reason)
        case R.ReplicaStopped():
            return replace(replica, state=state, reason=payload.reason or replica.reason)
    return replica


def fold_replaced(old: Replica, replacement: Replica) -> Replica:
    """The replica a restart replaces, after an event of its ``replacement`` (``replacement.replaces ==
    old.id``). Pure; every reader calls it after folding the replacement's event.

    While the replacement is placed, starting or ready, the old one is "replacing"; a replacement
    that failed or stopped leaves the restart "queued", the old replica still serving. Once the old
    one is no longer active (the restart stopped it) nothing changes.
    """
    if not old.active:
        return old
    restart = "replacing" if replacement.active else "queued"
    return old if old.restart == restart else msgspec.structs.replace(old, restart=restart)


class StartFailures(msgspec.Struct, frozen=True, kw_only=True):
    """A model's run of failed starts, which parks it at the scheduler's limit (SCHED-4).

    ``spec_hash`` is the model's current definition: only a replica of that definition becoming
    ready ends the run.
    """

    spec_hash: str = ""
    count: int = 0
    last_error: str = ""
    last_failure_at: float | None = None  # event time, epoch seconds: the backoff counts from it


def fold_start_failures(
    failures: StartFailures, payload: msgspec.Struct, at: float, replica: Replica | None = None
) -> StartFailures:
    """The model's run of start failures after one event. Pure.

    For a replica event, ``replica`` is that replica *before* the event (None: unknown, nothing
    counts). A failure counts when the replica had not yet been ready (placed or starting) and its
    node was not lost; a ready replica ends the run only if it runs the model's current
    definition — one of an older definition says nothing about whether the current one starts.
    A new definition and `ctl retry` start counting again.
    """
    replace = msgspec.structs.replace
    match payload:
        case M.ModelAdded():
            return StartFailures(spec_hash=M.spec_hash(payload.spec))
        case M.ModelChanged():
            return replace(failures, spec_hash=M.spec_hash(payload.spec), count=0, last_failure_at=None)
        case M.ModelParked():
            return replace(failures, last_error=payload.reason)
        case M.ModelRetried():
            return replace(failures, count=0, last_failure_at=None)
        case R.ReplicaReady():
            if replica is not None and transition(replica.state, payload) and replica.spec_hash == failures.spec_hash:
                return replace(failures, count=0, last_failure_at=None)
        case R.ReplicaFailed():
            if replica is not None and replica.state in ("placed", "starting") and not payload.node_lost:
                return replace(failures, count=failures.count + 1, last_error=payload.reason, last_failure_at=at)
    return failures
