"""Writes the Grafana dashboards in this folder (SPEC OBS-3): ``python ops/grafana/build.py``.

The dashboards are built here, not edited as JSON, so every query is in one readable place;
``tests/test_fleet_metrics.py`` checks that the JSON files are what this writes, that every series
a Prometheus query names is one the code publishes, and that every SQL query runs against the
projection tables in PostgreSQL.

Datasources are variables (``$prometheus``, ``$postgres``): pick yours when importing. The SQL
reads the projections llmgw keeps in PostgreSQL (``llmgw server --db postgresql://…``):
``usage_rollups`` (per minute, model and scope) and ``tenancy_scopes`` (names).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROM = {"type": "prometheus", "uid": "${prometheus}"}
PG = {"type": "grafana-postgresql-datasource", "uid": "${postgres}"}


def prom(expr: str, legend: str = "") -> dict[str, Any]:
    return {"expr": expr, "legendFormat": legend}


def sql(query: str, fmt: str = "time_series") -> dict[str, Any]:
    return {"rawSql": " ".join(query.split()), "format": fmt, "rawQuery": True, "editorMode": "code"}


def panel(title: str, targets: list[dict[str, Any]], *, kind: str = "timeseries", unit: str = "", w: int = 12) -> dict:
    return {"title": title, "type": kind, "targets": targets, "unit": unit, "w": w}


def dashboard(uid: str, title: str, description: str, panels: list[dict], datasources: tuple[str, ...]) -> dict:
    """A dashboard with ``panels`` laid out in rows of 24 columns, 8 high."""
    out, x, y = [], 0, 0
    for i, p in enumerate(panels, start=1):
        if x + p["w"] > 24:
            x, y = 0, y + 8
        ds = PG if "rawSql" in p["targets"][0] else PROM
        out.append(
            {
                "id": i,
                "title": p["title"],
                "type": p["type"],
                "datasource": ds,
                "gridPos": {"x": x, "y": y, "w": p["w"], "h": 8},
                "fieldConfig": {"defaults": {"unit": p["unit"]} if p["unit"] else {}, "overrides": []},
                "targets": [{**t, "refId": chr(ord("A") + j), "datasource": ds} for j, t in enumerate(p["targets"])],
            }
        )
        x += p["w"]
    variables = [
        {"name": name, "type": "datasource", "query": kind, "label": name.capitalize()}
        for name, kind in (("prometheus", "prometheus"), ("postgres", "grafana-postgresql-datasource"))
        if name in datasources
    ]
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["llmgw"],
        "schemaVersion": 39,
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "templating": {"list": variables},
        "panels": out,
    }


def fleet() -> dict:
    return dashboard(
        "llmgw-fleet",
        "llmgw · fleet",
        "Nodes as the leading scheduler sees them: state, memory, disk, sensors, GPUs.",
        [
            panel("Nodes by state", [prom("max by (state) (llmgw_nodes)", "{{state}}")]),
            panel("Schedulers leading", [prom("sum(llmgw_control_plane_leader)", "leaders")], kind="stat"),
            panel("Memory available", [prom("llmgw_node_memory_available_bytes", "{{node}}")], unit="bytes"),
            panel("Disk free (agent data)", [prom("llmgw_node_disk_free_bytes", "{{node}}")], unit="bytes"),
            panel("CPU temperature", [prom("llmgw_node_temperature_celsius", "{{node}} {{sensor}}")], unit="celsius"),
            panel("CPU package power", [prom("llmgw_node_power_watts", "{{node}} {{zone}}")], unit="watt"),
            panel("GPU temperature", [prom("llmgw_gpu_temperature_celsius", "{{node}}/{{gpu}}")], unit="celsius"),
            panel(
                "GPU power of limit",
                [prom("llmgw_gpu_power_watts / llmgw_gpu_power_limit_watts", "{{node}}/{{gpu}}")],
                unit="percentunit",
            ),
            panel(
                "GPU memory used",
                [prom("llmgw_gpu_memory_used_bytes / llmgw_gpu_memory_total_bytes", "{{node}}/{{gpu}}")],
                unit="percentunit",
            ),
            panel("GPUs throttled", [prom("sum by (node, reason) (llmgw_gpu_throttled)", "{{node}} {{reason}}")]),
        ],
        ("prometheus",),
    )


def models() -> dict:
    return dashboard(
        "llmgw-models",
        "llmgw · models",
        "What runs and what should: ready against desired, failures, parked and unplaceable models.",
        [
            panel("Ready replicas", [prom("max by (model) (llmgw_model_replicas_ready)", "{{model}}")]),
            panel("Desired replicas", [prom("max by (model) (llmgw_model_replicas_desired)", "{{model}}")]),
            panel(
                "Short of desired",
                [
                    prom(
                        "max by (model) (llmgw_model_replicas_desired)"
                        " - max by (model) (llmgw_model_replicas_ready) > 0",
                        "{{model}}",
                    )
                ],
            ),
            panel("Start failures in a row", [prom("max by (model) (llmgw_model_start_failures)", "{{model}}")]),
            panel("Parked", [prom("max by (model) (llmgw_model_parked) == 1", "{{model}}")], kind="stat"),
            panel("Unplaceable", [prom("max by (model) (llmgw_model_unplaceable) == 1", "{{model}}")], kind="stat"),
            panel(
                "Pool saturation (in flight / slots)",
                [prom("sum by (model) (llmgw_pool_saturation)", "{{model}}")],
                unit="percentunit",
                w=24,
            ),
        ],
        ("prometheus",),
    )


def gateway() -> dict:
    rate = "sum by (model) (rate({}[5m]))"
    return dashboard(
        "llmgw-gateway",
        "llmgw · gateway",
        "Requests through every router: rate, errors, latency, time to first token, tokens.",
        [
            panel("Requests / s", [prom(rate.format("llmgw_gateway_requests_total"), "{{model}}")], unit="reqps"),
            panel(
                "Errors / s by status",
                [prom('sum by (status) (rate(llmgw_gateway_requests_total{status!~"2.."}[5m]))', "{{status}}")],
                unit="reqps",
            ),
            panel(
                "Latency p50 / p99",
                [
                    prom(
                        "histogram_quantile(0.5, sum by (model, le) (rate(llmgw_gateway_request_seconds_bucket[5m])))",
                        "{{model}} p50",
                    ),
                    prom(
                        "histogram_quantile(0.99, sum by (model, le) (rate(llmgw_gateway_request_seconds_bucket[5m])))",
                        "{{model}} p99",
                    ),
                ],
                unit="s",
            ),
            panel(
                "Time to first token p50",
                [
                    prom(
                        "histogram_quantile(0.5, sum by (model, le) "
                        "(rate(llmgw_gateway_time_to_first_token_seconds_bucket[5m])))",
                        "{{model}}",
                    )
                ],
                unit="s",
            ),
            panel(
                "Tokens / s",
                [prom("sum by (model, direction) (rate(llmgw_gateway_tokens_total[5m]))", "{{model}} {{direction}}")],
            ),
            panel("In flight", [prom("sum by (model) (llmgw_gateway_in_flight)", "{{model}}")]),
            panel("Waiting in the gateways' queues", [prom("sum by (model) (llmgw_gateway_queue_depth)", "{{model}}")]),
            panel(
                "Queue wait p99 (requests that waited)",
                [
                    prom(
                        "histogram_quantile(0.99, sum by (model, le) "
                        "(rate(llmgw_gateway_queue_wait_seconds_bucket[5m])))",
                        "{{model}}",
                    )
                ],
                unit="s",
            ),
            panel(
                "Refused by the queue / s",
                [
                    prom(
                        "sum by (model, reason) (rate(llmgw_gateway_queue_rejections_total[5m]))",
                        "{{model}} {{reason}}",
                    )
                ],
                unit="reqps",
            ),
            panel(
                "Retries on another replica / s",
                [prom(rate.format("llmgw_gateway_replica_retries_total"), "{{model}}")],
                unit="reqps",
            ),
            panel(
                "Projection lag",
                [prom("max by (projection) (llmgw_projection_lag_events)", "{{projection}}")],
            ),
        ],
        ("prometheus",),
    )


def usage() -> dict:
    per_project = """
        SELECT r.minute::timestamptz AS time, COALESCE(s.name, r.value) AS metric, SUM(r.{col}) {scale} AS value
        FROM usage_rollups r LEFT JOIN tenancy_scopes s ON s.id = r.value
        WHERE r.dimension = 'project' AND $__timeFilter(r.minute::timestamptz)
        GROUP BY 1, 2 ORDER BY 1
    """
    return dashboard(
        "llmgw-usage",
        "llmgw · tenants and usage",
        "From the usage projection in PostgreSQL: requests, tokens and spend per project and model.",
        [
            panel("Requests per project", [sql(per_project.format(col="requests", scale=""))]),
            panel("Tokens out per project", [sql(per_project.format(col="tokens_out", scale=""))]),
            panel(
                "Spend per project (USD)",
                [sql(per_project.format(col="cost_nano_usd", scale="/ 1e9"))],
                unit="currencyUSD",
            ),
            panel(
                "Error ratio per project",
                [
                    sql(
                        """
                        SELECT r.minute::timestamptz AS time, COALESCE(s.name, r.value) AS metric,
                               SUM(r.errors)::float / NULLIF(SUM(r.requests), 0) AS value
                        FROM usage_rollups r LEFT JOIN tenancy_scopes s ON s.id = r.value
                        WHERE r.dimension = 'project' AND $__timeFilter(r.minute::timestamptz)
                        GROUP BY 1, 2 ORDER BY 1
                        """
                    )
                ],
                unit="percentunit",
            ),
            panel(
                "Top projects by spend in the range",
                [
                    sql(
                        """
                        SELECT COALESCE(s.name, r.value) AS project, r.model, SUM(r.requests) AS requests,
                               SUM(r.tokens_in) AS tokens_in, SUM(r.tokens_out) AS tokens_out,
                               SUM(r.cost_nano_usd) / 1e9 AS usd,
                               SUM(r.total_us) / 1e6 / NULLIF(SUM(r.requests), 0) AS mean_s
                        FROM usage_rollups r LEFT JOIN tenancy_scopes s ON s.id = r.value
                        WHERE r.dimension = 'project' AND $__timeFilter(r.minute::timestamptz)
                        GROUP BY 1, 2 ORDER BY usd DESC LIMIT 50
                        """,
                        fmt="table",
                    )
                ],
                kind="table",
                w=24,
            ),
        ],
        ("postgres",),
    )


DASHBOARDS = {"fleet.json": fleet, "models.json": models, "gateway.json": gateway, "usage.json": usage}


def render(name: str) -> str:
    return json.dumps(DASHBOARDS[name](), indent=2) + "\n"


def main() -> int:
    for name in DASHBOARDS:
        (HERE / name).write_text(render(name))
        print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
