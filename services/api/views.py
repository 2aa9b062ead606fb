"""How the admin API shapes projection rows: the columns it reads and the phrases it shows.

Shared by the live views (:mod:`.app`) and the replayed ones (:mod:`.replay`), so a model at a past
moment reads exactly as it would have then.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import msgspec

from llmgw.events.schema import access as A
from llmgw.events.schema import models as M

ACTIVE_STATES = ("placed", "starting", "ready", "draining")
KEYS_LIMIT = 100  # keys a replay's answer lists unless asked otherwise (all are counted)
KEYS_LIMIT_MAX = 1000  # at most, as the audit's ``limit``: a page, not the book

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
        "gave_room_to",
        "held_until",
        "preemptions",
        "updated_at",
        "measured",
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
        "restart",  # "" | "queued" | "replacing" (SCHED-6)
        "replaces",
        "cores",  # what the replica reserves (SCHED-8 counts it against its model's owner)
        "memory_bytes",
        "gpus",
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
        "external",
    ],
    "limits": ["scope", "rpm", "tpm", "updated_at", "updated_by"],
    "prices": ["model", "input_usd_per_m", "output_usd_per_m", "updated_at", "updated_by"],
    "budgets": ["scope", "usd", "period", "updated_at", "updated_by"],
    "quotas": [
        "scope",
        "guarantee_gpus",
        "guarantee_cores",
        "guarantee_memory_bytes",
        "limit_gpus",
        "limit_cores",
        "limit_memory_bytes",
        "updated_at",
        "updated_by",
    ],
}


def model_status(m: dict[str, Any], now: datetime | None = None) -> str:
    """The one phrase `ctl models` shows: why a model is not serving, or how it is serving."""
    if m["stopped"]:
        return "stopped by an administrator"
    if m.get("external"):  # served outside the cluster (GW-12): nothing is placed, so nothing to wait for
        return f"external, ready ({', '.join(m['external'])})"
    if m["parked"]:
        return f"parked: {m['parked']}"
    short = m["ready"] + m["starting"] < (m["min_replicas"] or 0)
    held_until = m.get("held_until")
    if short and m.get("gave_room_to") and held_until:
        if datetime.fromisoformat(held_until) > (now or datetime.now(UTC)):
            return f"{m['gave_room_to']}; held back until {held_until[11:19]} UTC or until the winner is placed"
    if m["unplaceable"] and short:
        return f"unplaceable: {m['unplaceable']}"
    if (m["min_replicas"] or 0) == 0 and m["ready"] == 0:
        return "on demand (no replica)"
    if m["ready"] >= (m["min_replicas"] or 0):
        return "serving" + (f" ({m['stale']} stale profile)" if m["stale"] else "")
    if m["failures"]:
        return f"failing to start ({m['failures']} in a row; last: {m['last_error']})"
    return "starting"


def shape_node(n: dict[str, Any], active: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``nodes`` row as the API shows it, counting the ``active`` replicas on it."""
    n["gpus"] = msgspec.json.decode(n["gpus"] or "[]")
    n["labels"] = msgspec.json.decode(n["labels"] or "{}")
    n["engines"] = [x for x in (n["engines"] or "").split(",") if x]
    n["replicas"] = sum(1 for r in active if r["node_id"] == n["id"])
    n["cordoned"], n["draining"] = bool(n["cordoned"]), bool(n["draining"])  # stored as 0/1: shown as what they are
    return n


def shape_model(m: dict[str, Any], active: list[dict[str, Any]]) -> dict[str, Any]:
    """A ``models`` row as the API shows it: replica counts from ``active`` and the status phrase."""
    spec = msgspec.json.decode(m.pop("spec"))
    mine = [r for r in active if r["model"] == m["name"]]
    m["aliases"] = spec.get("aliases", [])
    m["source"] = spec.get("source")
    m["owner"] = spec.get("owner")
    m["capacity_class"] = spec.get("capacity_class")
    m["capacity_class"] = spec.get("capacity_class") or "default"  # CAT-4
    m["owner"] = spec.get("owner")  # the scope whose capacity quota it counts against (SCHED-8)
    m["route"] = spec.get("route", "chat")
    m["slo"] = spec.get("slo")
    # The hosts of its external providers, cheapest first as the routers try them (GW-12); [] for a local model.
    providers = msgspec.convert(spec.get("external") or [], list[M.ExternalProvider])
    m["external"] = [p.host for p in M.cheapest_first(providers)]
    # What one replica serves by `ctl bench --save` (SCHED-10), the newest per profile and node shape;
    # one taken against another SLO than the model's now is stale (the autoscaler passes over it).
    m["measured"] = [
        {**x, "stale": x.get("slo") != m["slo"]} for x in msgspec.json.decode(m.pop("measured", None) or "[]")
    ]
    m["ready"] = sum(1 for r in mine if r["state"] == "ready")
    m["starting"] = sum(1 for r in mine if r["state"] in ("placed", "starting"))
    m["stale"] = sum(1 for r in mine if r["state"] == "ready" and r["spec_hash"] != m["spec_hash"])
    m["nodes"] = sorted({r["node_id"] for r in mine})
    m["status"] = model_status(m)
    m["stopped"], m["declared"] = bool(m["stopped"]), bool(m["declared"])  # stored as 0/1: shown as booleans
    return m


def key_expired(expires_at: str | None, now: datetime) -> bool:
    """Whether a key that ends at ``expires_at`` (a ``keys`` row's ISO time, or None: never) has ended at ``now``."""
    return expires_at is not None and datetime.fromisoformat(expires_at) <= now


def shape_key(k: dict[str, Any], paths: dict[str, tuple[str, str]], now: datetime) -> dict[str, Any]:
    """A ``keys`` row as the API shows it (never a secret): its project's path and its state at ``now``."""
    found = paths.get(k["project_id"])
    k["project"] = found[1] if found else f"{k['project_id']} (deleted)"
    k["user"] = k.pop("user_name")
    k["models"] = msgspec.json.decode(k["models"] or "[]")
    k["revoked"] = bool(k["revoked"])
    k["external"] = bool(k.get("external"))  # may call models served outside the cluster (GW-12)
    k["state"] = "revoked" if k["revoked"] else "expired" if key_expired(k["expires_at"], now) else "active"
    k["display"] = f"{A.KEY_PREFIX}-{k['prefix']}-…"
    return k
