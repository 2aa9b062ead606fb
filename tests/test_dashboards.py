"""The Grafana dashboards (SPEC OBS-3, ops/grafana/): what build.py writes, over series the code
publishes, and SQL that runs against the projection tables in a real PostgreSQL."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import ModuleType

import asyncpg
import pytest

from llmgw.events.commands.client import CommandClient
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import utc_now
from llmgw.events.schema.subjects import event_subject
from llmgw.events.schema.usage import UsageRecord
from tests.support import NatsServer, Postgres, wait_until
from tests.test_accountant import publish, running
from tests.test_fleet_metrics import published_series

GRAFANA = Path(__file__).resolve().parent.parent / "ops" / "grafana"
TIME_FILTER = re.compile(r"\$__timeFilter\(([^)]*)\)")


def build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("grafana_build", GRAFANA / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def targets(kind: str) -> list[tuple[str, str, dict]]:
    """(dashboard file, panel title, target) of every query of one kind (``expr`` or ``rawSql``)."""
    out = []
    for path in sorted(GRAFANA.glob("*.json")):
        for p in json.loads(path.read_text())["panels"]:
            out.extend((path.name, p["title"], t) for t in p["targets"] if kind in t)
    return out


def test_the_dashboards_on_disk_are_what_build_py_writes() -> None:
    b = build()
    assert sorted(p.name for p in GRAFANA.glob("*.json")) == sorted(b.DASHBOARDS)
    for name in b.DASHBOARDS:
        assert (GRAFANA / name).read_text() == b.render(name), f"{name} is stale: run python ops/grafana/build.py"
    for path in GRAFANA.glob("*.json"):
        d = json.loads(path.read_text())
        assert d["uid"].startswith("llmgw-") and d["panels"], path.name
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: panel ids repeat"
        for p in d["panels"]:
            g = p["gridPos"]
            assert g["x"] + g["w"] <= 24, f"{path.name}: {p['title']} is wider than the row"


def test_every_series_a_dashboard_reads_is_one_the_system_publishes() -> None:
    published = published_series()
    found = targets("expr")
    assert len(found) >= 20
    for name, title, t in found:
        used = set(re.findall(r"\bllmgw_[a-z_]+", t["expr"]))
        assert used, f"{name}: {title} reads no llmgw series"
        assert not used - published, f"{name}: {title} reads {sorted(used - published)}, which nothing publishes"


@pytest.mark.asyncio
@pytest.mark.timeout(120)
async def test_every_sql_panel_runs_on_the_projections_and_names_projects_by_name(
    store: EventStore, nats: NatsServer, postgres: Postgres
) -> None:
    dsn = await postgres.new_database()
    async with running(nats.url, dsn, store):
        client = CommandClient.for_service(store, "tests")
        for kind, path in (("org", "acme"), ("team", "acme/ml"), ("project", "acme/ml/chat")):
            await client.send(T.SERVICE, "create", T.CreateScope(kind=kind, path=path), actor="user:test", timeout=20)
        events = await store.read(event_subject(T.AGGREGATE, T.TREE_ID))
        ids = {type(e.payload).__name__: e.payload for e in events}
        project, team, org = ids["ProjectCreated"], ids["TeamCreated"], ids["OrgCreated"]
        record = UsageRecord(
            request_id="req-dash-1",
            at=utc_now(),
            status=200,
            key_id="k1",
            project_id=project.project_id,
            team_id=team.team_id,
            org_id=org.org_id,
            model_asked="tiny",
            model_served="tiny",
            endpoint="/v1/chat/completions",
            stream=False,
            tokens_in=12,
            tokens_out=34,
            queue_s=0.0,
            ttft_s=0.1,
            total_s=0.5,
            cost_usd=0.25,
            router="router-a",
        )
        await publish(store, record)
        conn = await asyncpg.connect(dsn)
        try:

            async def folded() -> bool:
                return bool(await conn.fetchval("SELECT count(*) FROM usage_rollups WHERE dimension = 'project'"))

            await wait_until(folded, deadline_s=30, what="the usage projection to fold the record")
            found = targets("rawSql")
            assert len(found) >= 5
            for name, title, t in found:
                # Grafana's macro, as its PostgreSQL datasource expands it for "the last day".
                query = re.sub(
                    r"\$__timeFilter\(([^()]*(?:\([^()]*\))?[^()]*)\)", r"(\1) > now() - interval '1 day'", t["rawSql"]
                )
                assert "$" not in query, f"{name}: {title} uses a macro the test does not expand"
                rows = await conn.fetch(query)
                assert rows, f"{name}: {title} found nothing for a request just made"
                names = {r.get("metric") or r.get("project") for r in rows}
                assert names == {project.name}, f"{name}: {title} names the project {names}"
        finally:
            await conn.close()
