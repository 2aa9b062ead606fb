"""The purge of a removed model's files (CAT-4), carried out by the mirror service and told in events.

``model.removed{purge}`` asks for it. The mirror service writes ``model.purge_started`` (what it
deletes, what stays because another model uses it), waits until none of the model's replicas runs,
deletes each mirror file and asks each node's agent to delete its copy, one
``model.purge_file_removed`` per file, then ``model.purge_finished`` (or ``model.purge_failed``).
Everything it needs is in the log, so a purge the log shows open (asked, or started and not
finished) is taken up again when the service starts: the files already recorded are skipped, and
deleting a file that is gone already is success.

:func:`plan_purge` and :func:`fold_catalog` decide; :class:`Purger` only reads the log, deletes and writes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import nats.errors
import structlog

from llmgw.events.folds import models as MF
from llmgw.events.folds.replicas import Replica, fold_replica
from llmgw.events.runtime.follower import Follower, FollowerRegistry
from llmgw.events.runtime.retry import backoff_delay
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.runtime.tasks import cancel_and_wait
from llmgw.events.schema import mirror as MI
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import replicas as R
from llmgw.events.schema.agent_rpc import WeightsReply, WeightsRequest, weights_subject
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of, event_subject

if TYPE_CHECKING:
    from llmgw.events.folds.mirror import MirrorState

log = structlog.get_logger("llmgw.services.mirror.purge")

ACTOR = f"svc:{MI.SERVICE}"
MIRROR = "mirror"  # ``where`` of a file deleted from the mirror itself


def safe_ref(source: str) -> str | None:
    """MODEL/VERSION/FILE of a ``mirror:`` source; None for a local path or a malformed one."""
    try:
        return M.mirror_ref(source)
    except ValueError:
        return None


# -- pure decisions --------------------------------------------------------------------------


class PurgePlan(msgspec.Struct, frozen=True, kw_only=True):
    mirror: list[str] = []
    nodes: list[str] = []
    kept: dict[str, str] = {}
    note: str = ""  # set when there is nothing to purge, and why


def plan_purge(model: str, source: str, others: dict[str, str], version_files: list[str]) -> PurgePlan:
    """What purging ``model`` deletes. ``others``: every other catalog model -> the mirror file its source
    names; ``version_files``: the files the mirror holds of the version ``source`` names. Pure.

    A file another model uses stays, on the mirror and on the nodes. The mirror keeps or deletes a
    version whole (its fold knows versions, not single files), so it deletes the version only when no
    other model uses any of its files; the nodes' copy of the model's own file goes unless it is used.
    """
    ref = safe_ref(source)
    if ref is None:
        return PurgePlan(note=f"model {model}'s source is a local path: no mirror files or node copies to purge")
    users: dict[str, list[str]] = {}
    for name, other in sorted(others.items()):
        users.setdefault(other, []).append(name)
    version = ref.rsplit("/", 1)[0] + "/"
    files = sorted(set(version_files) | {ref})
    shared = {f: users[f] for f in files if f in users}
    kept = {f: f"{', '.join(u)} use(s) it" for f, u in shared.items()}
    if shared and ref not in shared:
        sharers = sorted({n for u in shared.values() for n in u})
        kept[ref] = f"kept on the mirror: {', '.join(sharers)} use(s) other files of {version.rstrip('/')}"
    mirror = [] if shared else [f for f in files if f in version_files]
    nodes = [] if ref in shared else [ref]
    return PurgePlan(mirror=mirror, nodes=nodes, kept=kept)


class PurgeTrack(msgspec.Struct, kw_only=True):
    """One open purge as the log tells it."""

    model: str
    source: str = ""
    cause: str | None = None  # the model.removed event's id: every purge event is caused by it
    correlation: str | None = None
    started: M.PurgeStarted | None = None
    removed: list[tuple[str, str]] = []  # (where, file) already recorded


class CatalogView(msgspec.Struct, kw_only=True):
    """The catalog as the purge needs it: the models there now, the last source of every model ever
    added (a removed model's files are found from it) and the purges still open."""

    models: dict[str, MF.ModelStatus] = {}
    sources: dict[str, str] = {}
    purges: dict[str, PurgeTrack] = {}

    def others(self, model: str) -> dict[str, str]:
        """Every catalog model but ``model`` -> the mirror file its source names."""
        return {n: ref for n, s in self.models.items() if n != model and (ref := safe_ref(s.spec.source))}


def fold_catalog(view: CatalogView, model: str, event: RecordedEvent) -> None:
    """``view`` after one ``model.*`` event (in place: the view is one reader's own state)."""
    p = event.payload
    if isinstance(p, M.ModelAdded | M.ModelChanged):
        view.sources[model] = p.spec.source
    if isinstance(p, M.MODEL_EVENTS):
        status = MF.fold_model(view.models.get(model), p)
        if status is None:
            view.models.pop(model, None)
        else:
            view.models[model] = status
    match p:
        case M.ModelRemoved(purge=True):
            view.purges[model] = PurgeTrack(
                model=model,
                source=view.sources.get(model, ""),
                cause=event.envelope.id,
                correlation=event.envelope.correlation or event.envelope.id,
            )
        case M.PurgeStarted():
            if (track := view.purges.get(model)) is not None:
                track.started = p
        case M.PurgeFileRemoved():
            if (track := view.purges.get(model)) is not None:
                track.removed.append((p.where, p.file))
        case M.PurgeFinished() | M.PurgeFailed():
            view.purges.pop(model, None)


# -- the service's part ----------------------------------------------------------------------


class Purger:
    """Follows the catalog, the replicas and the nodes; runs one task per open purge.

    ``cancel_fetch`` stops a download of a version before its files go; ``forget_version`` writes the
    mirror's ``removed`` tombstone for a version whose files are all gone (peers read it) and deletes
    what is left of its folder.
    """

    def __init__(
        self,
        store: EventStore,
        root: Path,
        state: Callable[[], MirrorState],
        *,
        cancel_fetch: Callable[[str, str], Awaitable[None]],
        forget_version: Callable[[str, str, str | None, str | None], Awaitable[None]],
        folds: FollowerRegistry,
        replica_wait_s: float = 600.0,
        agent_timeout_s: float = 10.0,
        agent_attempts: int = 8,
    ) -> None:
        self.store = store
        self.root = root
        self.state = state
        self.cancel_fetch = cancel_fetch
        self.forget_version = forget_version
        self.folds = folds
        self.replica_wait_s = replica_wait_s
        self.agent_timeout_s = agent_timeout_s
        self.agent_attempts = agent_attempts
        self.catalog = CatalogView()
        self.replicas: dict[str, Replica] = {}
        self.nodes: set[str] = set()
        self.tasks: dict[str, asyncio.Task] = {}
        self.ended: set[str] = set()  # purges (their model.removed ids) this process ran to their end
        self._changed = asyncio.Event()
        self._folds: list[Follower] = []
        self._waker: asyncio.Task | None = None

    async def start(self) -> None:
        def follow(aggregate: str, apply: Callable[[RecordedEvent], None], name: str) -> Follower:
            return Follower(
                self.store,
                f"{EVENTS_ROOT}.{aggregate}.>",
                apply,
                name=name,
                registry=self.folds,
                on_batch=self._kick,
            ).start()

        self._folds = [
            follow(M.AGGREGATE, self._apply_model, "mirror-purge-catalog"),
            follow(R.AGGREGATE, self._apply_replica, "mirror-purge-replicas"),
            follow(N.AGGREGATE, self._apply_node, "mirror-purge-nodes"),
        ]
        self._waker = asyncio.create_task(self._kick_when_caught_up(), name="purge-caught-up")

    async def _kick_when_caught_up(self) -> None:
        """A fold with nothing to read has no batch to kick from: once all caught up, look at open purges."""
        await asyncio.gather(*(f.caught_up.wait() for f in self._folds))
        self._kick()

    async def close(self) -> None:
        if self._waker is not None:
            self._waker.cancel()
        for fold in self._folds:
            await fold.close()
        await cancel_and_wait(self.tasks.values())

    def _apply_model(self, e: RecordedEvent) -> None:
        fold_catalog(self.catalog, aggregate_of(e.subject)[1], e)

    def _apply_replica(self, e: RecordedEvent) -> None:
        rid = getattr(e.payload, "replica_id", None)
        if rid is not None:
            replica = fold_replica(self.replicas.get(rid), e.payload, e.envelope.at.timestamp())
            if replica is not None and replica.state in ("stopped", "failed"):
                self.replicas.pop(rid, None)  # ended for good: only the live ones are waited for
            elif replica is not None:
                self.replicas[rid] = replica

    def _apply_node(self, e: RecordedEvent) -> None:
        if isinstance(e.payload, N.NodeRegistered):
            self.nodes.add(e.payload.node_id)

    def _kick(self) -> None:
        """After each batch: wake purges waiting for replicas; start open purges once every fold caught up."""
        self._changed.set()
        if not all(f.caught_up.is_set() for f in self._folds):
            return
        for model, track in self.catalog.purges.items():
            if model not in self.tasks and track.cause not in self.ended:
                self.tasks[model] = asyncio.create_task(self._run(track), name=f"purge-{model}")

    def running(self, model: str) -> list[Replica]:
        """The model's replicas whose engines may still hold its files open: any not stopped or failed yet
        (a draining replica still runs)."""
        live = (r for r in self.replicas.values() if r.model == model and r.state not in ("stopped", "failed"))
        return sorted(live, key=lambda r: r.id)

    async def _append(self, track: PurgeTrack, payload: msgspec.Struct) -> None:
        event = NewEvent(payload=payload, actor=ACTOR, causation=track.cause, correlation=track.correlation)
        await self.store.append(event_subject(M.AGGREGATE, track.model), [event])

    async def _run(self, track: PurgeTrack) -> None:
        model = track.model
        try:
            await self._purge(track)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.exception("purge failed", model=model)
            with contextlib.suppress(Exception):
                await self._append(
                    track,
                    M.PurgeFailed(
                        reason=f"the purge of {model} failed ({type(exc).__name__}: {exc}); see the mirror's log"
                    ),
                )
        finally:
            # The task ends before the fold reads its last event: remembered, so it is not taken up again.
            if track.cause is not None:
                self.ended.add(track.cause)
            self.tasks.pop(model, None)

    async def _purge(self, track: PurgeTrack) -> None:
        model = track.model
        started = track.started
        if started is None:
            ref = safe_ref(track.source)
            held = self._version_files(ref) if ref is not None else []
            plan = plan_purge(model, track.source, self.catalog.others(model), held)
            if plan.note:
                await self._append(track, M.PurgeFinished(note=plan.note))
                return
            waiting = [r.id for r in self.running(model)]
            started = M.PurgeStarted(
                source=track.source, mirror=plan.mirror, nodes=plan.nodes, kept=plan.kept, waiting_for=waiting
            )
            await self._append(track, started)
            log.info("purge started", model=model, mirror=plan.mirror, nodes=plan.nodes, kept=plan.kept)
        if not await self._replicas_stopped(model):
            left = ", ".join(f"{r.id} on {r.node_id}" for r in self.running(model))
            await self._append(
                track,
                M.PurgeFailed(
                    reason=f"replicas of {model} still run after {self.replica_wait_s:.0f} s ({left}); nothing more "
                    "was deleted. Run `llmgw ctl weights --collect` once they stopped"
                ),
            )
            return
        done = set(track.removed)
        count = len(done)
        kept = dict(started.kept)
        used = self.catalog.others(model)
        in_use = set(used.values())
        # A model added since the start may use a file: it stays, and the version with it.
        mirror_kept = [f for f in started.mirror if f in in_use]
        for f in mirror_kept:
            kept[f] = f"{', '.join(sorted(n for n, r in used.items() if r == f))} use(s) it"
        if not mirror_kept:
            for f in started.mirror:
                if (MIRROR, f) in done:
                    continue
                mmodel, version, name = f.split("/")
                await self.cancel_fetch(mmodel, version)
                await asyncio.to_thread(_unlink, self.root / mmodel / version / name)
                await self._append(track, M.PurgeFileRemoved(where=MIRROR, file=f))
                count += 1
            versions = sorted({f.rsplit("/", 1)[0] for f in started.mirror})
            for v in versions:
                mmodel, version = v.split("/")
                if self.state().version(mmodel, version) is not None:
                    await self.forget_version(mmodel, version, track.cause, track.correlation)
        remove = [f for f in started.nodes if f not in in_use]
        unreached: list[str] = []
        if remove:
            for node in sorted(self.nodes):
                removed, held = await self._remove_on(node, remove, sorted(in_use))
                if removed is None:
                    unreached.append(node)
                    continue
                for f in removed:
                    if (node, f) not in done:
                        await self._append(track, M.PurgeFileRemoved(where=node, file=f))
                        count += 1
                for f in held:
                    kept[f] = f"node {node} still runs an engine on it: `llmgw ctl weights --collect` removes it later"
        await self._append(track, M.PurgeFinished(removed=count, kept=kept, unreached=unreached))
        log.info("purge finished", model=model, removed=count, unreached=unreached)

    def _version_files(self, ref: str) -> list[str]:
        mmodel, version, _ = ref.split("/")
        held = self.state().version(mmodel, version)
        return [f"{mmodel}/{version}/{name}" for name in held.files] if held is not None else []

    async def _replicas_stopped(self, model: str) -> bool:
        loop = asyncio.get_running_loop()
        end = loop.time() + self.replica_wait_s
        while self.running(model):
            self._changed.clear()
            left = end - loop.time()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), left)
        return True

    async def _remove_on(self, node: str, files: list[str], keep: list[str]) -> tuple[list[str] | None, list[str]]:
        """(files the node deleted, or None when it did not answer; files it still holds).

        An agent keeps a file an engine of its own still runs on; the replica's ``stopped`` can reach the
        log a moment before the agent let go of it, so a file still held is asked for again a few times.
        """
        removed: list[str] = []
        for attempt in range(self.agent_attempts):
            reply = await self._ask(node, WeightsRequest(action="remove", remove=files, keep=keep))
            if reply is None or reply.error:
                return (removed or None), files
            removed += reply.removed
            files = [f for f in files if f in reply.held]
            if not files or attempt == self.agent_attempts - 1:
                break
            # the agent's own loop lets go of a stopped engine's file
            await asyncio.sleep(backoff_delay(attempt + 1, 0.2, 5.0))
        return removed, files

    async def _ask(self, node: str, req: WeightsRequest) -> WeightsReply | None:
        try:
            msg = await self.store.nc.request(
                weights_subject(node), msgspec.json.encode(req), timeout=self.agent_timeout_s
            )
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            return None
        return msgspec.json.decode(msg.data, type=WeightsReply)


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)  # gone already (an earlier attempt): success
