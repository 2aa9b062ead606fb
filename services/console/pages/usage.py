"""The usage page (issue 24, item 4): requests, tokens, cost and refusals (429s) over time, per model,
project or key, from the per-minute rollups (projections/usage.py) and the stored requests (the 429s:
a refused request is recorded with its status). Charts are drawn on the server (services/console/svg.py),
each with a table of the same numbers.

A team admin chooses among the tenants it may view (and must choose one); with the time slider the
range ends at the moment shown.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from markupsafe import Markup

from llmgw.events.schema.envelope import utc_now
from llmgw.projections.access import scope_path, tenancy_paths
from llmgw.projections.usage import LEVELS, NANO_USD, NOT_SERVED, ScopeError, resolve_scope, stamp
from llmgw.services.console.page import Ctx, Page
from llmgw.services.console.pages.tenants import Numbers, Visible
from llmgw.services.console.svg import Series, line_chart

# range -> (how far back, one bucket)
RANGES = {
    "hour": (timedelta(hours=1), timedelta(minutes=1)),
    "day": (timedelta(days=1), timedelta(hours=1)),
    "week": (timedelta(days=7), timedelta(days=1)),
}
BY = ("model", "project", "key")
TOP = 6  # lines per chart; the rest are added up as one
TABLE_MAX = 100  # groups in the table of totals, the busiest first
# range -> (characters of a minute's text that name its bucket, the bucket's name as strftime writes it)
BUCKETS = {"hour": (16, "%Y-%m-%dT%H:%M"), "day": (13, "%Y-%m-%dT%H"), "week": (10, "%Y-%m-%d")}
METRICS = ("requests", "tokens", "cost", "refusals")


def _floor(at: datetime, step: timedelta) -> datetime:
    at = at.replace(second=0, microsecond=0)
    minutes = int(step.total_seconds() // 60)
    return at - timedelta(minutes=(at.hour * 60 + at.minute) % minutes)


def _rollup_sql(by: str, scope: tuple[str, str] | None) -> tuple[str, str, list[Any]]:
    """(group column, WHERE clause, args after the two minutes) over ``{rollups}``: the rows at the finer
    of the scope's and the grouping's levels, as projections/usage.py usage_query reads them."""
    kind, value = scope if scope is not None else (None, None)
    if by == "model":
        dimension, group = (kind if kind in LEVELS else "model"), "model"
    elif kind in LEVELS:
        dimension, group = LEVELS[min(LEVELS.index(by), LEVELS.index(kind))], f"{by}_id"
    else:
        dimension, group = by, f"{by}_id"
    # Without a value, the (dimension, value, minute) index would read every row of the dimension, all time:
    # ``dimension || ''`` keeps the planner on the minutes asked for (the primary key's range) instead.
    where, args = (
        ["minute >= ?", "minute <= ?", "dimension = ?" if kind == dimension else "dimension || '' = ?"],
        [dimension],
    )
    if kind == dimension:
        where.append("value = ?")
    elif kind in LEVELS:
        where.append(f"{kind}_id = ?")
    elif kind == "model":
        where.append("model = ?")
    if kind is not None:
        args.append(value)
    return group, " AND ".join(where), args


def _refusal_sql(by: str, scope: tuple[str, str] | None) -> tuple[str, str, list[Any]]:
    group = f"COALESCE(model_served, '{NOT_SERVED}')" if by == "model" else f"{by}_id"
    where, args = ["status = 429", "at >= ?", "at <= ?"], []
    if scope is not None:
        kind, value = scope
        where.append("model_served = ?" if kind == "model" else f"{kind}_id = ?")
        args.append(value)
    return group, " AND ".join(where), args


async def _scope(ctx: Ctx, visible: Visible, text: str) -> tuple[tuple[str, str] | None, str | None]:
    """The scope asked for as (kind, id), or None for everything; and why it may not be shown, if not."""
    if not text:
        return None, (None if visible.everything else "usage.choose_scope")
    try:
        kind, sid = await resolve_scope(ctx.api.backend, text)
    except ScopeError:
        return None, "usage.unknown_scope"
    if visible.everything:
        return (kind, sid), None
    if kind == "key":
        rows = await ctx.api.backend.query("access", "SELECT project_id FROM {keys} WHERE id = ?", sid)
        allowed = bool(rows) and visible("project", rows[0][0])
    else:
        allowed = kind in ("org", "team", "project") and visible(kind, sid)
    return ((kind, sid), None) if allowed else (None, "usage.not_yours")


async def gather(ctx: Ctx) -> dict[str, Any]:
    q = ctx.query
    visible = Visible(ctx)
    by = q.get("by", "model") if q.get("by") in BY else "model"
    span_name = q.get("range", "hour") if q.get("range") in RANGES else "hour"
    span, step = RANGES[span_name]
    end = ctx.at or utc_now()
    start = _floor(end - span, step)
    n = int((end - start) / step) + 1
    backend = ctx.api.backend
    paths = await tenancy_paths(backend)
    scope_text = (q.get("scope") or "").strip()
    options = [{"value": "", "label": ctx.t("usage.everything")}] if visible.everything else []
    for sid, (kind, path) in sorted(paths.items(), key=lambda item: (item[1][1], item[1][0])):
        if visible(kind, sid):
            options.append({"value": f"{kind}:{sid}", "label": f"{kind}:{path}"})
    if not scope_text and not visible.everything and options:
        scope_text = options[0]["value"]  # a team admin's own tenant, not everything
    scope, problem = await _scope(ctx, visible, scope_text)
    base = {
        "by": by,
        "by_options": BY,
        "range": span_name,
        "ranges": tuple(RANGES),
        "scope": scope_text,
        "scope_options": options,
        "problem": problem,
        "end": end,
    }
    if problem is not None:
        return {**base, "charts": [], "totals": [], "labels": []}
    since_minute, until_minute = start.strftime("%Y-%m-%dT%H:%M:00Z"), end.strftime("%Y-%m-%dT%H:%M:00Z")
    width, key_fmt = BUCKETS[span_name]
    index = {(start + i * step).strftime(key_fmt): i for i in range(n)}
    group, where, args = _rollup_sql(by, scope)
    sums = "SUM(requests), SUM(errors), SUM(tokens_in) + SUM(tokens_out), SUM(cost_nano_usd)"
    totals: dict[str, dict[str, float]] = {}
    for g, requests, errors, tokens, cost in await backend.query(
        "usage",
        f"SELECT {group}, {sums} FROM {{rollups}} WHERE {where} GROUP BY {group}",
        since_minute,
        until_minute,
        *args,
    ):
        totals[str(g or "")] = {
            "requests": int(requests or 0),
            "errors": int(errors or 0),
            "tokens": int(tokens or 0),
            "cost": int(cost or 0) / NANO_USD,
            "refusals": 0,
        }
    # The 429s, a few per minute at most: by bucket and group in one query.
    r_group, r_where, r_args = _refusal_sql(by, scope)
    bucket = f"substr(at, 1, {width})"
    refusals = await backend.query(
        "usage",
        f"SELECT {bucket}, {r_group}, COUNT(*) FROM {{requests}} WHERE {r_where} GROUP BY {bucket}, {r_group}",
        stamp(start),
        stamp(end),
        *r_args,
    )
    refused_series: dict[str, list[float]] = {}
    for b, g, count in refusals:
        name = str(g or "")
        totals.setdefault(name, dict.fromkeys((*METRICS, "errors"), 0))["refusals"] += int(count or 0)
        if b in index:
            refused_series.setdefault(name, [0.0] * n)[index[b]] += int(count or 0)
    ranked = sorted(totals, key=lambda g: (-(totals[g]["requests"] + totals[g]["refusals"]), g))
    top, rest = ranked[:TOP], ranked[TOP:]
    # Series of the top groups only, by bucket in SQL: a day of 10,000 keys is 100,000 rows, not a chart.
    series: dict[str, dict[str, list[float]]] = {m: {} for m in METRICS}
    whole: dict[str, list[float]] = {m: [0.0] * n for m in METRICS}
    bucket = f"substr(minute, 1, {width})"
    chosen = ", ".join("?" * len(top))
    found = (
        await backend.query(
            "usage",
            f"SELECT {bucket}, {group}, {sums} FROM {{rollups}} WHERE {where} AND {group} IN ({chosen}) "
            f"GROUP BY {bucket}, {group}",
            since_minute,
            until_minute,
            *args,
            *top,
        )
        if top
        else []
    )
    for b, g, requests, _, tokens, cost in found:
        if b in index:
            for metric, value in (("requests", requests), ("tokens", tokens), ("cost", int(cost or 0) / NANO_USD)):
                series[metric].setdefault(str(g or ""), [0.0] * n)[index[b]] += float(value or 0)
    if rest:  # all the others as one line: everything less the top
        everything = await backend.query(
            "usage",
            f"SELECT {bucket}, {sums} FROM {{rollups}} WHERE {where} GROUP BY {bucket}",
            since_minute,
            until_minute,
            *args,
        )
        for b, requests, _, tokens, cost in everything:
            if b in index:
                for metric, value in (("requests", requests), ("tokens", tokens), ("cost", int(cost or 0) / NANO_USD)):
                    whole[metric][index[b]] += float(value or 0)
        for values in refused_series.values():
            for i, v in enumerate(values):
                whole["refusals"][i] += v
    series["refusals"] = refused_series
    shown = ranked[:TABLE_MAX]
    names: dict[str, str] = {}
    if by in ("project", "key"):
        ids = [g for g in shown if g]
        marks = ", ".join("?" * len(ids))
        key_names = (
            {
                r[0]: r[1]
                for r in await backend.query("access", f"SELECT id, name FROM {{keys}} WHERE id IN ({marks})", *ids)
            }
            if by == "key" and ids
            else {}
        )
        for g in shown:
            names[g] = scope_path(f"{by}:{g}", paths, key_names) if g else ctx.t("usage.none_group")
    else:
        names = {g: (ctx.t("usage.no_model") if g in (NOT_SERVED, "") else g) for g in shown}
    label_fmt = "%H:%M" if span_name != "week" else "%m-%d"
    labels = [(start + i * step).strftime(label_fmt) for i in range(n)]
    number = Numbers(ctx.lang)
    fmts = {"requests": number.integer, "tokens": number.integer, "refusals": number.integer, "cost": number.usd}
    charts = []
    for metric in METRICS:
        lines = [Series(name=names[g], values=series[metric].get(g, [0.0] * n)) for g in top]
        if rest:
            tops = [series[metric].get(g, [0.0] * n) for g in top]
            other = [max(whole[metric][i] - sum(t[i] for t in tops), 0.0) for i in range(n)]
            lines.append(Series(name=ctx.t("usage.other"), values=other))
        title = ctx.t(f"usage.chart.{metric}", by=ctx.t(f"usage.by.{by}"))
        total = sum(sum(s.values) for s in lines)
        desc = ctx.t(
            "usage.chart.desc",
            what=ctx.t(f"usage.metric.{metric}"),
            total=fmts[metric](total),
            groups=len(lines),
            range=ctx.t(f"usage.range.{span_name}"),
        )
        chart_id = f"usage-{metric}"
        charts.append(
            {
                "id": chart_id,
                "metric": metric,
                "title": title,
                "svg": Markup(line_chart(chart_id, title, desc, labels, lines, fmts[metric])) if lines else None,
                "lines": [{"name": s.name, "values": [fmts[metric](v) for v in s.values]} for s in lines],
                "total": fmts[metric](total),
            }
        )
    table = [
        {
            "group": g,
            "name": names[g],
            "requests": number.integer(totals[g]["requests"]),
            "errors": number.integer(totals[g]["errors"]),
            "refusals": number.integer(totals[g]["refusals"]),
            "tokens": number.integer(totals[g]["tokens"]),
            "cost": fmts["cost"](totals[g]["cost"]),
        }
        for g in shown
    ]
    return {**base, "charts": charts, "totals": table, "more": len(ranked) - len(shown), "labels": labels}


PAGES = [
    Page(
        path="/console/usage",
        name="usage",
        title="usage.nav",
        template="usage.html",
        gather=gather,
        live=("usage",),
        scope="tenant",
    )
]
