"""Keys, limits, prices and budgets as tables (read by `ctl key|limit|price|budget list` and the API).

The keys table never holds a key's secret or its hash: a read model is for showing, and only the
routers (which fold the events themselves) check keys. Scopes are kept as on the log (by id);
the API names them by path through the tenancy projection.
"""

from __future__ import annotations

import msgspec

from llmgw.events.folds import keys as K
from llmgw.events.folds import quotas as QF
from llmgw.events.schema import access as A
from llmgw.events.schema import quotas as Q
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.subjects import EVENTS_ROOT
from llmgw.projections.backends import Backend
from llmgw.projections.base import Projection, Tx

_KEY_INSERT = (
    "INSERT INTO {keys} (id, prefix, project_id, name, user_name, rpm, tpm, models, expires_at, revoked, revoked_at, "
    "revoked_by, revoke_reason, created_at, created_by, external) "
    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, 0, NULL, NULL, '', ?, ?, ?) "
    "ON CONFLICT (id) DO NOTHING"
)
_KEY_REVOKE = "UPDATE {keys} SET revoked = 1, revoked_at = ?, revoked_by = ?, revoke_reason = ? WHERE id = ?"
_KEY_LIMITS = "UPDATE {keys} SET rpm = ?, tpm = ? WHERE id = ?"
_LIMIT_UPSERT = (
    "INSERT INTO {limits} (scope, rpm, tpm, updated_at, updated_by) VALUES (?, ?, ?, ?, ?) ON CONFLICT (scope) "
    "DO UPDATE SET rpm = excluded.rpm, tpm = excluded.tpm, updated_at = excluded.updated_at, "
    "updated_by = excluded.updated_by"
)
_PRICE_UPSERT = (
    "INSERT INTO {prices} (model, input_usd_per_m, output_usd_per_m, updated_at, updated_by) VALUES (?, ?, ?, ?, ?) "
    "ON CONFLICT (model) DO UPDATE SET input_usd_per_m = excluded.input_usd_per_m, "
    "output_usd_per_m = excluded.output_usd_per_m, updated_at = excluded.updated_at, updated_by = excluded.updated_by"
)
_QUOTA_UPSERT = (
    "INSERT INTO {quotas} (scope, guarantee_gpus, guarantee_cores, guarantee_memory_bytes, limit_gpus, limit_cores, "
    "limit_memory_bytes, updated_at, updated_by) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (scope) DO UPDATE SET "
    "guarantee_gpus = excluded.guarantee_gpus, guarantee_cores = excluded.guarantee_cores, "
    "guarantee_memory_bytes = excluded.guarantee_memory_bytes, limit_gpus = excluded.limit_gpus, "
    "limit_cores = excluded.limit_cores, limit_memory_bytes = excluded.limit_memory_bytes, "
    "updated_at = excluded.updated_at, updated_by = excluded.updated_by"
)
_BUDGET_UPSERT = (
    "INSERT INTO {budgets} (scope, usd, period, updated_at, updated_by) VALUES (?, ?, ?, ?, ?) ON CONFLICT (scope) "
    "DO UPDATE SET usd = excluded.usd, period = excluded.period, updated_at = excluded.updated_at, "
    "updated_by = excluded.updated_by"
)


class AccessProjection(Projection):
    name = "access"
    # 2: rows folded by events/folds/keys.py (a key is created once; revoking is final); rows folded before are rebuilt
    # 3: capacity quotas (SCHED-8), so a replay shows each scope's guarantee and limit at a moment
    # 4: a key's ``external`` (GW-12: it may call models served outside the cluster)
    version = 4
    subject = f"{EVENTS_ROOT}.>"
    tables = {
        "keys": "id TEXT PRIMARY KEY, prefix TEXT NOT NULL, project_id TEXT NOT NULL, name TEXT NOT NULL, "
        "user_name TEXT, rpm INTEGER, tpm INTEGER, models TEXT NOT NULL, expires_at TEXT, revoked INTEGER NOT NULL, "
        "revoked_at TEXT, revoked_by TEXT, revoke_reason TEXT, created_at TEXT NOT NULL, created_by TEXT NOT NULL, "
        "external INTEGER NOT NULL",
        "limits": "scope TEXT PRIMARY KEY, rpm INTEGER, tpm INTEGER, updated_at TEXT NOT NULL, "
        "updated_by TEXT NOT NULL",
        "prices": "model TEXT PRIMARY KEY, input_usd_per_m DOUBLE PRECISION NOT NULL, "
        "output_usd_per_m DOUBLE PRECISION NOT NULL, updated_at TEXT NOT NULL, updated_by TEXT NOT NULL",
        "budgets": "scope TEXT PRIMARY KEY, usd DOUBLE PRECISION NOT NULL, period TEXT NOT NULL, "
        "updated_at TEXT NOT NULL, updated_by TEXT NOT NULL",
        "quotas": "scope TEXT PRIMARY KEY, guarantee_gpus INTEGER, guarantee_cores INTEGER, "
        "guarantee_memory_bytes BIGINT, limit_gpus INTEGER, limit_cores INTEGER, limit_memory_bytes BIGINT, "
        "updated_at TEXT NOT NULL, updated_by TEXT NOT NULL",
    }
    primary_keys = {"keys": ["id"], "limits": ["scope"], "prices": ["model"], "budgets": ["scope"], "quotas": ["scope"]}
    indexes = {"keys": [["project_id"], ["prefix"]]}
    handlers = {
        "key.created": "key_created",
        "key.revoked": "key_revoked",
        "limit.set": "limit_set",
        "price.set": "price_set",
        "budget.set": "budget_set",
        "quota.set": "quota_changed",
        "quota.cleared": "quota_changed",
    }

    async def key_created(self, tx: Tx, e: RecordedEvent) -> None:
        """A key is created once (the insert does nothing for an id already there), as the shared fold says."""
        key = K.fold_key(None, e.payload)
        assert key is not None
        await tx.execute(
            _KEY_INSERT,
            key.id,
            key.prefix,
            key.project_id,
            key.name,
            key.user,
            key.rpm,
            key.tpm,
            msgspec.json.encode(key.models).decode(),
            key.expires_at.isoformat() if key.expires_at else None,
            e.envelope.at.isoformat(),
            e.envelope.actor,
            int(key.external),
        )

    async def _key(self, tx: Tx, key_id: str) -> K.Key | None:
        """A key's row as the shared fold's record (the secret's hash is never in a table)."""
        row = await tx.fetchone("SELECT prefix, project_id, rpm, tpm, revoked FROM {keys} WHERE id = ?", key_id)
        if row is None:
            return None
        prefix, project_id, rpm, tpm, revoked = row
        return K.Key(
            id=key_id, prefix=prefix, secret_sha256="", project_id=project_id, rpm=rpm, tpm=tpm, revoked=bool(revoked)
        )

    async def key_revoked(self, tx: Tx, e: RecordedEvent) -> None:
        """Revoking is final: the row moves only as the shared fold (``events/folds/keys.py``) moves the key."""
        p: A.KeyRevoked = e.payload  # type: ignore[assignment]
        before = await self._key(tx, p.key_id)
        after = K.fold_key(before, p)
        if after is None or after is before:
            return
        await tx.execute(_KEY_REVOKE, e.envelope.at.isoformat(), e.envelope.actor, after.revoke_reason, p.key_id)

    async def limit_set(self, tx: Tx, e: RecordedEvent) -> None:
        p: A.LimitSet = e.payload  # type: ignore[assignment]
        limit = K.fold_limit(p)
        await _set_scope(tx, e, "limits", _LIMIT_UPSERT, p.scope, None if limit is None else (limit.rpm, limit.tpm))
        key_id = K.key_of_scope(p.scope)
        if key_id is not None:  # a key's own limits: the latest of its creation and its `limit.set`
            before = await self._key(tx, key_id)
            after = K.fold_key(before, p)
            if after is not None and after is not before:
                await tx.execute(_KEY_LIMITS, after.rpm, after.tpm, key_id)

    async def price_set(self, tx: Tx, e: RecordedEvent) -> None:
        p: A.PriceSet = e.payload  # type: ignore[assignment]
        price = K.fold_price(p)
        at = e.envelope.at.isoformat()
        await tx.execute(_PRICE_UPSERT, p.model, price.input_usd_per_m, price.output_usd_per_m, at, e.envelope.actor)

    async def quota_changed(self, tx: Tx, e: RecordedEvent) -> None:
        """A scope's capacity quota, as the shared fold (``QF.fold_quota``) leaves it."""
        p: Q.QuotaSet | Q.QuotaCleared = e.payload  # type: ignore[assignment]
        quota = QF.fold_quota(None, p)
        values = None
        if quota is not None:
            g, lim = quota.guarantee, quota.limit
            values = (g.gpus, g.cores, g.memory_bytes, lim.gpus, lim.cores, lim.memory_bytes)
        await _set_scope(tx, e, "quotas", _QUOTA_UPSERT, f"{p.kind}:{p.scope_id}", values)

    async def budget_set(self, tx: Tx, e: RecordedEvent) -> None:
        p: A.BudgetSet = e.payload  # type: ignore[assignment]
        budget = K.fold_budget(p)
        values = None if budget is None else (budget.usd, budget.period)
        await _set_scope(tx, e, "budgets", _BUDGET_UPSERT, p.scope, values)


async def _set_scope(
    tx: Tx, e: RecordedEvent, table: str, upsert: str, scope: str, values: tuple[object, ...] | None
) -> None:
    """A scope's row in ``table`` after its event: ``values`` upserted with when and by whom, or the row
    deleted when the fold cleared the setting (None)."""
    if values is None:
        await tx.execute(f"DELETE FROM {{{table}}} WHERE scope = ?", scope)
    else:
        await tx.execute(upsert, scope, *values, e.envelope.at.isoformat(), e.envelope.actor)


# -- naming scopes for people: read helpers over this projection and the tenancy one -------------


async def tenancy_paths(backend: Backend) -> dict[str, tuple[str, str]]:
    """id -> (kind, path) of every org, team and project, from the tenancy projection's ``scopes``."""
    rows = await backend.query("tenancy", "SELECT id, kind, name, parent_id FROM {scopes}")
    by_id = {r[0]: r for r in rows}

    def path(sid: str) -> str:
        names: list[str] = []
        seen: set[str] = set()
        current: str | None = sid
        while current is not None and current in by_id and current not in seen:
            seen.add(current)
            names.append(by_id[current][2])
            current = by_id[current][3]
        return "/".join(reversed(names))

    return {r[0]: (r[1], path(r[0])) for r in rows}


def scope_path(scope: str, paths: dict[str, tuple[str, str]], key_names: dict[str, str]) -> str:
    """``team:acme/ml`` for ``team:<id>``; ``key:<id> (name)`` for a key; ``… (deleted)`` for a scope gone."""
    kind, _, sid = scope.partition(":")
    if kind == "key":
        name = key_names.get(sid)
        return f"key:{sid} ({name})" if name else f"key:{sid}"
    found = paths.get(sid)
    return f"{kind}:{found[1]}" if found is not None and found[0] == kind else f"{scope} (deleted)"
