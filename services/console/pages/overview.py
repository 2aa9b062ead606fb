"""The console's overview: models satisfied, short, parked and stopped; nodes ready, cordoned and lost;
what is wrong now; requests per second and errors over the last minutes.

Models, nodes and replicas are the admin API's rows (``ctx.source``); the traffic is the usage rollups
(projections/usage.py), read live and bounded by ``ctx.at`` when the page shows a past moment.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from llmgw.projections.usage import minute_of, stamp
from llmgw.services.console.page import Ctx, Page
from llmgw.services.console.pages.models import STANDINGS as MODEL_STANDINGS
from llmgw.services.console.pages.models import catalog
from llmgw.services.console.pages.nodes import STANDINGS as NODE_STANDINGS
from llmgw.services.console.pages.nodes import fleet_nodes
from llmgw.services.console.source import marked

WINDOW_MIN = 15  # minutes of traffic the overview shows
FAILED_SHOWN = 10  # the latest failed replicas listed under "what is wrong"
REFUSALS_SHOWN = 5  # the commonest refusals in the window
CHART_W, CHART_H = 300, 60  # the traffic chart's size in SVG units


def traffic_minutes(rows: list[tuple[str, int, int]], end: datetime, window: int = WINDOW_MIN) -> list[dict[str, Any]]:
    """One entry per minute of the ``window`` minutes up to ``end`` (a minute without requests counts 0),
    each with its requests, errors and requests per second; the last minute is still counting. Pure."""
    by_minute = {m: (int(req or 0), int(err or 0)) for m, req, err in rows}
    last = end.astimezone(UTC).replace(second=0, microsecond=0)
    out = []
    for i in range(window - 1, -1, -1):
        at = last - timedelta(minutes=i)
        req, err = by_minute.get(minute_of(at), (0, 0))
        counting = i == 0
        elapsed = max((end - at).total_seconds(), 1.0) if counting else 60.0
        out.append({"minute": at, "requests": req, "errors": err, "rps": req / elapsed, "counting": counting})
    return out


def chart(minutes: list[dict[str, Any]], w: int = CHART_W, h: int = CHART_H) -> dict[str, Any]:
    """Bars for a server-drawn SVG: each minute's requests, and the part that were errors, scaled to the
    busiest minute. Pure."""
    peak = max((m["requests"] for m in minutes), default=0)
    top = peak or 1  # no traffic: flat bars, not a division by zero
    step = w / max(len(minutes), 1)
    bars = []
    for i, m in enumerate(minutes):
        total = h * m["requests"] / top
        bad = h * m["errors"] / top
        bars.append(
            {
                "x": round(i * step + 1, 1),
                "w": round(max(step - 2, 1), 1),
                "h": round(total, 1),
                "y": round(h - total, 1),
                "eh": round(bad, 1),
                "ey": round(h - bad, 1),
                **m,
            }
        )
    return {"w": w, "h": h, "bars": bars, "top": peak}


async def traffic(ctx: Ctx, end: datetime) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The window's minutes (requests, errors) from the rollups, and its commonest refusals (requests
    answered with a status of 400 or more, by status and error) from the stored requests."""
    since = end - timedelta(minutes=WINDOW_MIN)
    backend = ctx.api.backend
    # Every record adds to exactly one row of the "model" dimension per minute: their sum is the traffic.
    rows = await backend.query(
        "usage",
        "SELECT minute, SUM(requests), SUM(errors) FROM {rollups} WHERE dimension = 'model' AND minute > ? "
        "AND minute <= ? GROUP BY minute",
        minute_of(since),
        minute_of(end),
    )
    found = await backend.query(
        "usage",
        "SELECT status, COALESCE(error, ''), COUNT(*) FROM {requests} WHERE at > ? AND at <= ? AND status >= 400 "
        f"GROUP BY status, error ORDER BY COUNT(*) DESC LIMIT {REFUSALS_SHOWN}",
        stamp(since),
        stamp(end),
    )
    refusals = [{"status": int(s), "error": e, "count": int(c)} for s, e, c in found]
    return traffic_minutes([(m, r, e) for m, r, e in rows], end), refusals


async def gather_overview(ctx: Ctx) -> dict[str, Any]:
    models = await catalog(ctx.source)
    nodes = await fleet_nodes(ctx.source)
    if ctx.at is not None:
        models = marked(models, await catalog(ctx.now), key="name", fields=("standing", "status"))
        nodes = marked(nodes, await fleet_nodes(ctx.now), key="id", fields=("standing",))
    then_models = [m for m in models if m.get("_diff") != "added"]
    then_nodes = [n for n in nodes if n.get("_diff") != "added"]
    model_counts = {s: sum(1 for m in then_models if m["standing"] == s) for s in MODEL_STANDINGS}
    node_counts = {s: sum(1 for n in then_nodes if n["standing"] == s) for s in NODE_STANDINGS}
    # Failed replicas that matter now: those of models whose starts are failing (the index on model finds
    # them; the table keeps every replica that ever ran, so a scan of it for 'failed' would not be cheap).
    failing = [m for m in then_models if m["failures"] and m["standing"] != "stopped"]
    failed: list[dict[str, Any]] = []
    if failing:
        marks = ", ".join("?" for _ in failing)
        failed = await ctx.source.fleet(
            "replicas",
            f"WHERE model IN ({marks}) AND state = 'failed' ORDER BY updated_at DESC LIMIT {FAILED_SHOWN}",
            *(m["name"] for m in failing),
        )
    end = ctx.at or datetime.now(UTC)
    minutes, refusals = await traffic(ctx, end)
    window_requests = sum(m["requests"] for m in minutes)
    window_errors = sum(m["errors"] for m in minutes)
    return {
        "models": models,
        "not_satisfied": [m for m in models if m["standing"] != "satisfied"],
        "model_counts": model_counts,
        "nodes": nodes,
        "node_counts": node_counts,
        "parked": [m for m in then_models if m["standing"] == "parked"],
        "unplaceable": [m for m in then_models if m["standing"] == "short" and m["unplaceable"]],
        "lost": [n for n in then_nodes if n["standing"] == "lost"],
        "failing": failing,
        "failed": failed,
        "refusals": refusals,
        "minutes": minutes,
        "chart": chart(minutes),
        "window": WINDOW_MIN,
        "window_requests": window_requests,
        "window_errors": window_errors,
        "window_rps": window_requests / (WINDOW_MIN * 60),
    }


PAGES = [
    Page(
        path="/console",
        name="overview",
        title="overview.title",
        template="overview.html",
        gather=gather_overview,
        live=("node", "model", "replica", "usage"),
    ),
]
