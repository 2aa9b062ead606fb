"""The console's nodes: the list (capacity, reservations, state) and one node (its sensors from the last
heartbeat, its replicas, each engine's log tail); cordon, uncordon and drain as the fleet's commands.

The rows are the admin API's (``ctx.source``: now, or as they were at ``ctx.at``). Heartbeats and engine
logs are not events: they are read as they are now, and a page of the past says it does not show them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import msgspec
import nats.errors
import nats.js.errors

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import nodes as N
from llmgw.events.schema import subjects as S
from llmgw.events.schema.agent_rpc import LogsReply, LogsRequest, logs_subject
from llmgw.events.schema.subjects import encode_token
from llmgw.services.api.act import Outcome
from llmgw.services.api.views import ACTIVE_STATES, shape_node
from llmgw.services.console.forms import refused
from llmgw.services.console.page import Ctx, Page
from llmgw.services.console.source import Source, marked

LOG_LINES = 20  # the tail of each engine's log the node page shows
LOG_TIMEOUT_S = 2.0  # an agent that has not answered by then is said not to answer; the page does not wait on
DRAIN_GRACE_S = 300.0  # `ctl drain`'s default
MAX_GRACE_S = 7 * 86400.0  # a week: longer is a typing slip
PER_PAGE = 100  # rows of a list page drawn at once
NODE_FIELDS = ("state", "cordoned", "draining", "cpus", "memory_total_bytes", "replicas")
REPLICA_FIELDS = ("state", "model", "node_id", "port")


def active_clause() -> str:
    return "state IN (" + ", ".join(f"'{s}'" for s in ACTIVE_STATES) + ")"


def node_state(n: dict[str, Any]) -> str:
    """The node's standing in one word (for ``data-status`` and the message key): lost, draining,
    cordoned or ready."""
    if n["state"] == "lost":
        return "lost"
    if n["draining"]:
        return "draining"
    if n["cordoned"]:
        return "cordoned"
    return "ready"


async def fleet_sql(src: Source, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    """Rows of a query over the fleet projection (``{nodes}``, ``{models}``, ``{replicas}``) as ``src`` shows
    it; now, once the projection has read the log as far as the page shows it (as :meth:`Source.fleet`)."""
    await src.caught_up("fleet")
    return [tuple(r) for r in await src.backend.query("fleet", sql, *args)]


async def holdings(src: Source, node_id: str | None = None) -> dict[str, dict[str, int]]:
    """What the active replicas on each node (or the one named) hold, summed by the database: a thousand
    nodes' worth of five thousand replicas is one grouped query, not five thousand rows to add up here."""
    where, args = f"WHERE {active_clause()}", []
    if node_id is not None:
        where, args = where + " AND node_id = ?", [node_id]
    rows = await fleet_sql(
        src,
        "SELECT node_id, COUNT(*), COALESCE(SUM(cores), 0), COALESCE(SUM(memory_bytes), 0), COALESCE(SUM(gpus), 0) "
        f"FROM {{replicas}} {where} GROUP BY node_id",
        *args,
    )
    return {
        n: {"replicas": int(c), "cores": int(cores), "memory_bytes": int(mem), "gpus": int(gpus)}
        for n, c, cores, mem, gpus in rows
    }


async def fleet_nodes(src: Source, node_id: str | None = None) -> list[dict[str, Any]]:
    """Every node (or the one named), shaped as the admin API shows it, with what its replicas reserve and
    its standing."""
    if node_id is None:
        rows = await src.fleet("nodes", "ORDER BY id")
    else:
        rows = await src.fleet("nodes", "WHERE id = ?", node_id)
    held = await holdings(src, node_id)
    for n in rows:
        shape_node(n, [])
        n["held"] = held.get(n["id"], {"cores": 0, "memory_bytes": 0, "gpus": 0, "replicas": 0})
        n["replicas"] = n["held"]["replicas"]
        n["standing"] = node_state(n)
    return rows


def paged(rows: list[dict[str, Any]], query: Mapping[str, str], per_page: int = PER_PAGE) -> dict[str, Any]:
    """One page of ``rows`` (``?page=N``, from 1; a page past the end is the last one): a long list is
    drawn a page at a time, so a page of a thousand nodes renders as fast as one of ten. Pure."""
    pages = max((len(rows) + per_page - 1) // per_page, 1)
    try:
        page = min(max(int(query.get("page", "1")), 1), pages)
    except ValueError:
        page = 1
    return {"rows": rows[(page - 1) * per_page : page * per_page], "page": page, "pages": pages, "total": len(rows)}


async def last_heartbeat(store: EventStore, node_id: str) -> N.NodeHeartbeat | None:
    """The node's newest heartbeat on the telemetry stream (None without one, or one that does not decode)."""
    subject = f"{S.TELEMETRY_ROOT}.node.{encode_token(node_id)}"
    try:
        msg = await store.js.get_last_msg(S.STREAM_TELEMETRY, subject, direct=True)
    except nats.js.errors.NotFoundError:
        return None
    try:
        return msgspec.json.decode(msg.data or b"", type=N.NodeHeartbeat)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


async def engine_tails(
    store: EventStore, node_id: str, replica_ids: list[str], lines: int = LOG_LINES
) -> tuple[dict[str, list[str] | str], bool]:
    """The last ``lines`` of each replica's engine log, asked of the node's agent (agent RPC, as `ctl logs`
    does): replica id → its lines, or why there are none; and whether the agent did not answer at all."""

    async def ask(rid: str) -> list[str] | str:
        req = msgspec.json.encode(LogsRequest(replica=rid, lines=lines))
        msg = await store.nc.request(logs_subject(node_id), req, timeout=LOG_TIMEOUT_S)
        reply = msgspec.json.decode(msg.data, type=LogsReply)
        return reply.error or list(reply.lines)

    if not replica_ids:
        return {}, False
    answers = await asyncio.gather(*(ask(rid) for rid in replica_ids), return_exceptions=True)
    tails: dict[str, list[str] | str] = {}
    unreached = False
    for rid, got in zip(replica_ids, answers, strict=True):
        if isinstance(got, nats.errors.NoRespondersError | nats.errors.TimeoutError):
            unreached = True
        elif isinstance(got, BaseException):  # a connection in trouble, an answer that does not decode
            tails[rid] = f"{type(got).__name__}: {got}"
        else:
            tails[rid] = got
    return tails, unreached


# -- gather ---------------------------------------------------------------------------------------


async def gather_nodes(ctx: Ctx) -> dict[str, Any]:
    nodes = await fleet_nodes(ctx.source)
    if ctx.at is not None:
        nodes = marked(nodes, await fleet_nodes(ctx.now), key="id", fields=NODE_FIELDS)
    counts = {s: sum(1 for n in nodes if n.get("standing") == s and n.get("_diff") != "added") for s in STANDINGS}
    state = ctx.query.get("state", "")
    shown = [n for n in nodes if n.get("standing") == state] if state in STANDINGS else nodes
    listing = paged(shown, ctx.query)
    return {
        "nodes": listing["rows"],
        "listing": listing,
        "state": state if state in STANDINGS else "",
        "counts": counts,
        "may_act": may_act(ctx),
    }


STANDINGS = ("ready", "cordoned", "draining", "lost")


def may_act(ctx: Ctx) -> bool:
    """Whether the page shows the fleet's controls: to a cluster admin, and only for now (the past is not
    editable). The fleet service decides again when the command comes."""
    return ctx.at is None and ctx.can("cluster-admin")


async def gather_node(ctx: Ctx) -> dict[str, Any]:
    node_id = ctx.params["id"]
    rows = await fleet_nodes(ctx.source, node_id)
    node = rows[0] if rows else None
    replicas = await ctx.source.fleet("replicas", f"WHERE node_id = ? AND {active_clause()} ORDER BY id", node_id)
    if ctx.at is not None:
        now_rows = await fleet_nodes(ctx.now, node_id)
        if node is not None:
            node = marked([node], now_rows, key="id", fields=NODE_FIELDS)[0]
        now_replicas = await ctx.now.fleet("replicas", f"WHERE node_id = ? AND {active_clause()} ORDER BY id", node_id)
        replicas = marked(replicas, now_replicas, key="id", fields=REPLICA_FIELDS)
    heartbeat: N.NodeHeartbeat | None = None
    tails: dict[str, list[str] | str] = {}
    unreached = False
    if ctx.at is None and node is not None:
        # Telemetry and logs are now-only: they are not events, so a past moment has none to show.
        heartbeat = await last_heartbeat(ctx.api.store, node_id)
        tails, unreached = await engine_tails(ctx.api.store, node_id, [r["id"] for r in replicas])
    return {
        "node_id": node_id,
        "node": node,
        "replicas": replicas,
        "heartbeat": heartbeat,
        "sensors": sorted((heartbeat.sensors if heartbeat else {}).items()),
        "tails": tails,
        "unreached": unreached,
        "may_act": may_act(ctx),
    }


# -- actions --------------------------------------------------------------------------------------


def _node_of(ctx: Ctx, form: Mapping[str, str], kind: str) -> str | Outcome:
    node_id = (form.get("node") or ctx.params.get("id") or "").strip()
    return node_id or refused(kind, "say which node: the form's `node` field names it")


async def cordon(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    node_id = _node_of(ctx, form, "fleet.cordon")
    if isinstance(node_id, Outcome):
        return node_id
    return await ctx.act(N.SERVICE, "cordon", N.CordonNode(node_id=node_id, reason=(form.get("reason") or "").strip()))


async def uncordon(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    node_id = _node_of(ctx, form, "fleet.uncordon")
    if isinstance(node_id, Outcome):
        return node_id
    return await ctx.act(N.SERVICE, "uncordon", N.UncordonNode(node_id=node_id))


async def drain(ctx: Ctx, form: Mapping[str, str]) -> Outcome:
    node_id = _node_of(ctx, form, "fleet.drain")
    if isinstance(node_id, Outcome):
        return node_id
    raw = (form.get("grace") or "").strip()
    try:
        grace = float(raw) if raw else DRAIN_GRACE_S
    except ValueError:
        return refused("fleet.drain", f"the grace {raw!r} is not a number of seconds: give e.g. 300")
    if not 0 <= grace <= MAX_GRACE_S:  # also refuses nan and infinity
        return refused("fleet.drain", f"the grace must be from 0 to {MAX_GRACE_S:,.0f} seconds")
    return await ctx.act(N.SERVICE, "drain", N.DrainNode(node_id=node_id, grace_s=grace))


ACTIONS = {"cordon": cordon, "uncordon": uncordon, "drain": drain}

PAGES = [
    Page(
        path="/console/nodes",
        name="nodes",
        title="nodes.title",
        template="nodes.html",
        gather=gather_nodes,
        actions=ACTIONS,
        live=("node", "replica"),
    ),
    Page(
        path="/console/nodes/{id}",
        name="node",
        title="nodes.node_title",
        template="node.html",
        gather=gather_node,
        actions=ACTIONS,
        live=("node", "replica"),
        nav=False,
    ),
]
