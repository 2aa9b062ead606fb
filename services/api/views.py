"""How the admin API shapes projection rows: the columns it reads and the phrases it shows.

Shared by the live views (:mod:`.app`) and the replayed ones (:mod:`.replay`), so a model at a past
moment reads exactly as it would have then.
"""

from __future__ import annotations

from typing import Any

FLEET_COLUMNS = {
    "nodes": [
        "id",
        "address",
        "cpus",
        "memory_total_bytes",
        "gpus",
        "engines",
        "labels",
        "agent_version",
        "state",
        "cordoned",
        "draining",
        "cordon_reason",
        "registered_at",
        "updated_at",
    ],
    "models": [
        "name",
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
        "updated_at",
    ],
    "replicas": [
        "id",
        "model",
        "node_id",
        "state",
        "spec_hash",
        "pid",
        "port",
        "url",
        "reason",
        "placed_at",
        "updated_at",
    ],
}


# Never a key's secret or hash: the projection does not hold them, and the API would not show them.
ACCESS_COLUMNS = {
    "keys": [
        "id",
        "prefix",
        "project_id",
        "name",
        "user_name",
        "rpm",
        "tpm",
        "models",
        "expires_at",
        "revoked",
        "revoked_at",
        "revoked_by",
        "revoke_reason",
        "created_at",
        "created_by",
    ],
    "limits": ["scope", "rpm", "tpm", "updated_at", "updated_by"],
    "prices": ["model", "input_usd_per_m", "output_usd_per_m", "updated_at", "updated_by"],
    "budgets": ["scope", "usd", "period", "updated_at", "updated_by"],
}


def model_status(m: dict[str, Any]) -> str:
    """The one phrase `ctl models` shows: why a model is not serving, or how it is serving."""
    if m["stopped"]:
        return "stopped by an administrator"
    if m["parked"]:
        return f"parked: {m['parked']}"
    if m["unplaceable"] and m["ready"] + m["starting"] < (m["min_replicas"] or 0):
        return f"unplaceable: {m['unplaceable']}"
    if (m["min_replicas"] or 0) == 0 and m["ready"] == 0:
        return "on demand (no replica)"
    if m["ready"] >= (m["min_replicas"] or 0):
        return "serving" + (f" ({m['stale']} stale profile)" if m["stale"] else "")
    if m["failures"]:
        return f"failing to start ({m['failures']} in a row; last: {m['last_error']})"
    return "starting"
