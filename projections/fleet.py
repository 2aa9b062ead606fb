"""Nodes, models and replicas as tables: what `ctl nodes|models|replicas` and the API read.

Each row is what the shared folds (``events/folds``) make of its events: a node's is ``fold_node``'s,
a replica's ``fold_replica``'s, a model's ``fold_model``'s with its start failures
(``fold_start_failures``). A handler reads the row back as the fold's input, folds the event and
writes the result; no event is interpreted here by hand.
"""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from llmgw.events.folds import models as MF
from llmgw.events.folds import nodes as NF
from llmgw.events.folds import replicas as F
from llmgw.events.schema import models as M
from llmgw.events.schema import scheduler as SCH
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of
from llmgw.projections.base import Projection, Tx


def _json(v: object) -> str:
    return msgspec.json.encode(v).decode()


_STATUS = msgspec.json.Decoder(MF.ModelStatus)


_NODE_UPSERT = (
    "INSERT INTO {nodes} (id, address, cpus, memory_total_bytes, gpus, engines, labels, agent_version, state, "
    "cordoned, draining, cordon_reason, registered_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'ready', 0, 0, '', "
    "?, ?) ON CONFLICT (id) DO UPDATE SET address = excluded.address, cpus = excluded.cpus, "
    "memory_total_bytes = excluded.memory_total_bytes, gpus = excluded.gpus, engines = excluded.engines, "
    "labels = excluded.labels, agent_version = excluded.agent_version, updated_at = excluded.updated_at"
)
# A model's row is written whole from the folds (every column from ``ModelRow.columns``, in this order).
_MODEL_COLUMNS = (
    "spec",
    "declared",
    "min_replicas",
    "max_replicas",
    "stopped",
    "parked",
    "failures",
    "last_error",
    "unplaceable",
    "spec_hash",
    "gave_room_to",
    "held_until",
    "preemptions",
    "updated_at",
    "measured",
    "folded",  # the model as fold_model leaves it (JSON): the next event's fold starts from it
)
_MODEL_UPSERT = (
    f"INSERT INTO {{models}} (name, {', '.join(_MODEL_COLUMNS)}) VALUES (?{', ?' * len(_MODEL_COLUMNS)}) "
    f"ON CONFLICT (name) DO UPDATE SET {', '.join(f'{c} = excluded.{c}' for c in _MODEL_COLUMNS)}"
)
_MODEL_SELECT = "SELECT folded, spec_hash, failures, last_error, unplaceable, updated_at FROM {models} WHERE name = ?"
_REPLICA_INSERT = (
    "INSERT INTO {replicas} (id, model, node_id, state, spec_hash, pid, port, url, reason, placed_at, updated_at, "
    "restart, replaces, cores, memory_bytes, gpus) VALUES (?, ?, ?, 'placed', ?, NULL, NULL, NULL, '', ?, ?, '', ?, "
    "?, ?, ?) ON CONFLICT (id) DO NOTHING"
)
_REPLICA_SELECT = (
    "SELECT model, node_id, state, spec_hash, pid, port, url, reason, restart, replaces FROM {replicas} WHERE id = ?"
)


def _replica(rid: str, row: tuple) -> F.Replica:
    model, node_id, state, hash_, pid, port, url, reason, restart, replaces = row
    return F.Replica(
        id=rid,
        model=model,
        node_id=node_id,
        state=state,
        spec_hash=hash_ or "",
        pid=pid,
        port=port,
        url=url,
        reason=reason or "",
        restart=restart or "",
        replaces=replaces or "",
    )


class ModelRow(msgspec.Struct, frozen=True, kw_only=True):
    """A ``models`` row before it is written: the model as ``fold_model`` leaves it, its run of start
    failures as ``fold_start_failures`` leaves it, and what the row adds (the scheduler's word, the time)."""

    status: MF.ModelStatus
    starts: F.StartFailures
    unplaceable: str | None = None  # the scheduler's ``scheduler.unplaceable``, until a replica is placed
    updated_at: str  # the event time of its last edit, ISO

    def columns(self) -> tuple[object, ...]:
        """The row's columns (``_MODEL_COLUMNS``), each read from the folds.

        What the model never had stays NULL, as `ctl models` and the API have always shown it: no
        preemption yet (gave_room_to, held_until, preemptions), no measurement yet (measured)."""
        s, pre = self.status, self.status.preempted
        return (
            _json(s.spec),
            int(s.declared),
            s.min,
            s.max,
            int(s.stopped),
            s.parked,
            self.starts.count,
            self.starts.last_error,
            self.unplaceable,
            self.starts.spec_hash,
            pre.reason if pre else None,
            datetime.fromtimestamp(pre.held_until, UTC).isoformat() if pre else None,
            s.preemptions if pre else None,
            self.updated_at,
            _json(s.measured) if s.measured else None,
            _json(s),
        )


def fold_model_row(row: ModelRow | None, payload: msgspec.Struct, at: datetime) -> ModelRow | None:
    """The row after one of the model's events at ``at`` (None: no such model). Pure.

    The model is ``fold_model``'s, its start failures ``fold_start_failures``'s; a model added is new
    in every column. The autoscaler's steps change no column shown and are not an edit: ``updated_at``
    stays the last edit's.
    """
    status = MF.fold_model(row.status if row is not None else None, payload)
    if status is None:
        return None
    ts, when = at.timestamp(), at.isoformat()
    if row is None or isinstance(payload, M.ModelAdded):
        return ModelRow(status=status, starts=F.fold_start_failures(F.StartFailures(), payload, ts), updated_at=when)
    return msgspec.structs.replace(
        row,
        status=status,
        starts=F.fold_start_failures(row.starts, payload, ts),
        updated_at=row.updated_at if isinstance(payload, M.ModelAutoscaled) else when,
    )


def _model_row(found: tuple) -> ModelRow:
    folded, hash_, failures, last_error, unplaceable, updated_at = found
    return ModelRow(
        status=_STATUS.decode(folded),
        starts=F.StartFailures(spec_hash=hash_ or "", count=int(failures), last_error=last_error or ""),
        unplaceable=unplaceable,
        updated_at=updated_at or "",
    )


class FleetProjection(Projection):
    name = "fleet"
    # 2: replicas and failure counts folded by events/folds/replicas.py; rows folded before are rebuilt from the log
    # 3: nodes folded by events/folds/nodes.py (draining keeps the reason a node was cordoned for)
    # 4: a replica's restart (SCHED-6): restart and replaces
    # 5: a model's last preemption (SCHED-7): gave_room_to, held_until, preemptions
    # 6: what each replica reserves (cores, memory_bytes, gpus), so a replay can say what each scope held
    # 7: a model's measurements (SCHED-10): measured, the newest per profile and node shape, as JSON
    # 8: models folded by events/folds/models.py (fold_model): the folded model kept in `folded`, each column read
    #    from it
    version = 8
    subject = f"{EVENTS_ROOT}.>"
    tables = {
        "nodes": "id TEXT PRIMARY KEY, address TEXT, cpus INTEGER, memory_total_bytes BIGINT, gpus TEXT, "
        "engines TEXT, labels TEXT, agent_version TEXT, state TEXT NOT NULL, cordoned INTEGER NOT NULL, "
        "draining INTEGER NOT NULL, cordon_reason TEXT, registered_at TEXT, updated_at TEXT",
        "models": "name TEXT PRIMARY KEY, spec TEXT NOT NULL, declared INTEGER NOT NULL, min_replicas INTEGER, "
        "max_replicas INTEGER, stopped INTEGER NOT NULL, parked TEXT, failures INTEGER NOT NULL, last_error TEXT, "
        "unplaceable TEXT, spec_hash TEXT, gave_room_to TEXT, held_until TEXT, preemptions INTEGER, updated_at TEXT, "
        "measured TEXT, folded TEXT NOT NULL",
        "replicas": "id TEXT PRIMARY KEY, model TEXT NOT NULL, node_id TEXT NOT NULL, state TEXT NOT NULL, "
        "spec_hash TEXT, pid INTEGER, port INTEGER, url TEXT, reason TEXT, placed_at TEXT, updated_at TEXT, "
        "restart TEXT, replaces TEXT, cores INTEGER, memory_bytes BIGINT, gpus INTEGER",
    }
    primary_keys = {"nodes": ["id"], "models": ["name"], "replicas": ["id"]}
    indexes = {"replicas": [["model"], ["node_id"]]}
    handlers = {
        "node.registered": "node_registered",
        "node.capacity_changed": "node_registered",
        "node.lost": "node_state",
        "node.returned": "node_state",
        "node.cordoned": "node_state",
        "node.uncordoned": "node_state",
        "node.drain_requested": "node_state",
        # A model's events (``M.MODEL_EVENTS``), each through the shared fold
        "model.added": "model_event",
        "model.changed": "model_event",
        "model.scaled": "model_event",
        "model.stopped": "model_event",
        "model.started": "model_event",
        "model.removed": "model_event",
        "model.parked": "model_event",
        "model.retried": "model_event",
        "model.preempted": "model_event",
        "model.autoscaled": "model_event",
        "model.measured": "model_event",
        "scheduler.unplaceable": "model_unplaceable",
        "replica.placed": "replica_placed",
        "replica.starting": "replica_state",
        "replica.ready": "replica_state",
        "replica.failed": "replica_state",
        "replica.stop_requested": "replica_state",
        "replica.stopped": "replica_state",
        "replica.restart_requested": "replica_state",
    }

    async def node_registered(self, tx: Tx, e: RecordedEvent) -> None:
        p = e.payload
        c = p.capacity
        at = e.envelope.at.isoformat()
        await tx.execute(
            _NODE_UPSERT,
            p.node_id,
            c.address,
            c.cpus,
            c.memory_total_bytes,
            _json(c.gpus),
            ",".join(c.engines),
            _json(c.labels),
            c.agent_version,
            at,
            at,
        )

    async def node_state(self, tx: Tx, e: RecordedEvent) -> None:
        """Lost, returned, cordoned, drained: the row moves as the shared fold (``events/folds/nodes.py``) moves
        the node, as the scheduler's and the fleet service's do. Rows are only for registered nodes."""
        p = e.payload
        row = await tx.fetchone("SELECT state, cordoned, draining, cordon_reason FROM {nodes} WHERE id = ?", p.node_id)
        if row is None:
            return
        state, cordoned, draining, reason = row
        before = NF.Node(
            id=p.node_id,
            registered=True,
            lost=state == "lost",
            cordoned=bool(cordoned),
            draining=bool(draining),
            cordon_reason=reason or "",
        )
        after = NF.fold_node(before, p, e.envelope.at.timestamp())
        await tx.execute(
            "UPDATE {nodes} SET state = ?, cordoned = ?, draining = ?, cordon_reason = ?, updated_at = ? WHERE id = ?",
            after.state,
            int(after.cordoned),
            int(after.draining),
            after.cordon_reason,
            e.envelope.at.isoformat(),
            p.node_id,
        )

    async def model_event(self, tx: Tx, e: RecordedEvent) -> None:
        """Any of a model's events: the row is read back as the folds left it, folded once more
        (:func:`fold_model_row`) and written whole, every column from the folded model."""
        _, name = aggregate_of(e.subject)
        found = await tx.fetchone(_MODEL_SELECT, name)
        before = _model_row(found) if found is not None else None
        after = fold_model_row(before, e.payload, e.envelope.at)
        if after is None:
            if before is not None:
                await tx.execute("DELETE FROM {models} WHERE name = ?", name)
            return
        await tx.execute(_MODEL_UPSERT, name, *after.columns())

    async def model_unplaceable(self, tx: Tx, e: RecordedEvent) -> None:
        p = e.payload
        if isinstance(p, SCH.PlacementBlocked):
            await tx.execute(
                "UPDATE {models} SET unplaceable = ?, updated_at = ? WHERE name = ?",
                p.reason,
                e.envelope.at.isoformat(),
                p.model,
            )

    async def replica_placed(self, tx: Tx, e: RecordedEvent) -> None:
        p = e.payload
        at = e.envelope.at.isoformat()
        await tx.execute(
            _REPLICA_INSERT,
            p.replica_id,
            p.model,
            p.node_id,
            p.spec_hash,
            at,
            at,
            p.replaces,
            p.cores,
            p.memory_bytes,
            len(p.gpus),
        )
        await tx.execute("UPDATE {models} SET unplaceable = NULL WHERE name = ?", p.model)
        if p.replaces:
            placed = F.Replica(id=p.replica_id, model=p.model, node_id=p.node_id, replaces=p.replaces)
            await self._replaced(tx, placed)

    async def _replaced(self, tx: Tx, replacement: F.Replica) -> None:
        """A restart's replacement moved: so does the restart of the replica it replaces (the shared fold)."""
        row = await tx.fetchone(_REPLICA_SELECT, replacement.replaces)
        if row is None:
            return
        old = _replica(replacement.replaces, row)
        after = F.fold_replaced(old, replacement)
        if after is not old:
            await tx.execute("UPDATE {replicas} SET restart = ? WHERE id = ?", after.restart, old.id)

    async def replica_state(self, tx: Tx, e: RecordedEvent) -> None:
        """The row moves as the shared fold moves it (``events/folds/replicas.py``), as the scheduler's state does."""
        p = e.payload
        at = e.envelope.at
        row = await tx.fetchone(_REPLICA_SELECT, p.replica_id)
        if row is None:
            return
        before = _replica(p.replica_id, row)
        model = before.model
        after = F.fold_replica(before, p, at.timestamp())
        if after is None or after is before:
            return
        await tx.execute(
            "UPDATE {replicas} SET state = ?, pid = ?, port = ?, url = ?, reason = ?, restart = ?, updated_at = ? "
            "WHERE id = ?",
            after.state,
            after.pid,
            after.port,
            after.url,
            after.reason,
            after.restart,
            at.isoformat(),
            p.replica_id,
        )
        if after.replaces:
            await self._replaced(tx, after)
        found = await tx.fetchone("SELECT failures, last_error, spec_hash FROM {models} WHERE name = ?", model)
        if found is None:
            return
        starts = F.StartFailures(spec_hash=found[2] or "", count=int(found[0]), last_error=found[1] or "")
        folded = F.fold_start_failures(starts, p, at.timestamp(), before)
        if folded != starts:
            await tx.execute(
                "UPDATE {models} SET failures = ?, last_error = ? WHERE name = ?",
                folded.count,
                folded.last_error,
                model,
            )
