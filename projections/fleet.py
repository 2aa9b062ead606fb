"""Nodes, models and replicas as tables: what `ctl nodes|models|replicas` and the API read."""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec

from llmgw.events.folds import nodes as NF
from llmgw.events.folds import replicas as F
from llmgw.events.schema import models as M
from llmgw.events.schema import scheduler as SCH
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.models import spec_hash
from llmgw.events.schema.subjects import EVENTS_ROOT, aggregate_of
from llmgw.projections.base import Projection, Tx


def _json(v: object) -> str:
    return msgspec.json.encode(v).decode()


_NODE_UPSERT = (
    "INSERT INTO {nodes} (id, address, cpus, memory_total_bytes, gpus, engines, labels, agent_version, state, "
    "cordoned, draining, cordon_reason, registered_at, updated_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'ready', 0, 0, '', "
    "?, ?) ON CONFLICT (id) DO UPDATE SET address = excluded.address, cpus = excluded.cpus, "
    "memory_total_bytes = excluded.memory_total_bytes, gpus = excluded.gpus, engines = excluded.engines, "
    "labels = excluded.labels, agent_version = excluded.agent_version, updated_at = excluded.updated_at"
)
_MODEL_UPSERT = (
    "INSERT INTO {models} (name, spec, declared, min_replicas, max_replicas, stopped, parked, failures, last_error, "
    "unplaceable, spec_hash, updated_at) VALUES (?, ?, ?, ?, ?, 0, NULL, 0, '', NULL, ?, ?) ON CONFLICT (name) DO "
    "UPDATE SET spec = excluded.spec, declared = excluded.declared, min_replicas = excluded.min_replicas, "
    "max_replicas = excluded.max_replicas, stopped = 0, parked = NULL, failures = 0, last_error = '', "
    "unplaceable = NULL, spec_hash = excluded.spec_hash, updated_at = excluded.updated_at"
)
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


class FleetProjection(Projection):
    name = "fleet"
    # 2: replicas and failure counts folded by events/folds/replicas.py; rows folded before are rebuilt from the log
    # 3: nodes folded by events/folds/nodes.py (draining keeps the reason a node was cordoned for)
    # 4: a replica's restart (SCHED-6): restart and replaces
    # 5: a model's last preemption (SCHED-7): gave_room_to, held_until, preemptions
    # 6: what each replica reserves (cores, memory_bytes, gpus), so a replay can say what each scope held
    # 7: a model's measurements (SCHED-10): measured, the newest per profile and node shape, as JSON
    version = 7
    subject = f"{EVENTS_ROOT}.>"
    tables = {
        "nodes": "id TEXT PRIMARY KEY, address TEXT, cpus INTEGER, memory_total_bytes BIGINT, gpus TEXT, "
        "engines TEXT, labels TEXT, agent_version TEXT, state TEXT NOT NULL, cordoned INTEGER NOT NULL, "
        "draining INTEGER NOT NULL, cordon_reason TEXT, registered_at TEXT, updated_at TEXT",
        "models": "name TEXT PRIMARY KEY, spec TEXT NOT NULL, declared INTEGER NOT NULL, min_replicas INTEGER, "
        "max_replicas INTEGER, stopped INTEGER NOT NULL, parked TEXT, failures INTEGER NOT NULL, last_error TEXT, "
        "unplaceable TEXT, spec_hash TEXT, gave_room_to TEXT, held_until TEXT, preemptions INTEGER, updated_at TEXT, "
        "measured TEXT",
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
        "model.added": "model_spec",
        "model.changed": "model_spec",
        "model.scaled": "model_edit",
        "model.stopped": "model_edit",
        "model.started": "model_edit",
        "model.removed": "model_edit",
        "model.parked": "model_edit",
        "model.retried": "model_edit",
        "model.preempted": "model_edit",
        "model.measured": "model_measured",
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

    async def model_spec(self, tx: Tx, e: RecordedEvent) -> None:
        p = e.payload
        spec = p.spec
        at = e.envelope.at.isoformat()
        if isinstance(p, M.ModelAdded):
            await tx.execute(
                _MODEL_UPSERT,
                spec.name,
                _json(spec),
                int(p.declared),
                spec.scaling.min,
                spec.scaling.upper,
                spec_hash(spec),
                at,
            )
        else:
            await tx.execute(
                "UPDATE {models} SET spec = ?, spec_hash = ?, parked = NULL, failures = 0, updated_at = ? "
                "WHERE name = ?",
                _json(spec),
                spec_hash(spec),
                at,
                spec.name,
            )

    async def model_edit(self, tx: Tx, e: RecordedEvent) -> None:
        _, name = aggregate_of(e.subject)
        p = e.payload
        at = e.envelope.at.isoformat()
        match p:
            case M.ModelPreempted():
                await tx.execute(
                    "UPDATE {models} SET gave_room_to = ?, held_until = ?, "
                    "preemptions = COALESCE(preemptions, 0) + ?, updated_at = ? WHERE name = ?",
                    p.reason,
                    datetime.fromtimestamp(p.held_until, UTC).isoformat(),
                    len(p.replicas),
                    at,
                    name,
                )
            case M.ModelScaled():
                await tx.execute(
                    "UPDATE {models} SET min_replicas = ?, max_replicas = ?, updated_at = ? WHERE name = ?",
                    p.min,
                    p.max,
                    at,
                    name,
                )
            case M.ModelStopped():
                await tx.execute("UPDATE {models} SET stopped = 1, updated_at = ? WHERE name = ?", at, name)
            case M.ModelStarted():
                await tx.execute(
                    "UPDATE {models} SET stopped = 0, min_replicas = ?, max_replicas = ?, "
                    "updated_at = ? WHERE name = ?",
                    p.min,
                    p.max,
                    at,
                    name,
                )
            case M.ModelRemoved():
                await tx.execute("DELETE FROM {models} WHERE name = ?", name)
            case M.ModelParked():
                await tx.execute(
                    "UPDATE {models} SET parked = ?, last_error = ?, updated_at = ? WHERE name = ?",
                    p.reason,
                    p.reason,
                    at,
                    name,
                )
            case M.ModelRetried():
                await tx.execute(
                    "UPDATE {models} SET parked = NULL, failures = 0, updated_at = ? WHERE name = ?", at, name
                )

    async def model_measured(self, tx: Tx, e: RecordedEvent) -> None:
        """The model's measurements as the shared fold keeps them (``MF.fold_model``): one per profile and shape."""
        _, name = aggregate_of(e.subject)
        row = await tx.fetchone("SELECT measured FROM {models} WHERE name = ?", name)
        if row is None:
            return
        measured = M.add_measurement(msgspec.json.decode(row[0] or "[]", type=list[M.ModelMeasured]), e.payload)
        await tx.execute(
            "UPDATE {models} SET measured = ?, updated_at = ? WHERE name = ?",
            _json(measured),
            e.envelope.at.isoformat(),
            name,
        )

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
