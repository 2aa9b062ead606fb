"""The fault suite's Prometheus launcher (tests/faults/prometheus.py), against a real Prometheus scraping a
small /metrics of our own: the project's alert rules load, an alert fires when its series say so and
clears when they stop, and a shortened ``for:`` is the only change in the copy of the rules.

Not marked ``faults``: it takes seconds, so it runs with the rest of `make test` (skipped without a
``prometheus`` binary).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from tests.faults.prometheus import NO_PROMETHEUS, RULES, AlertLog, prometheus_binary, running, shortened_rules
from tests.support import free_port, wait_until


def test_a_shortened_copy_of_the_rules_changes_only_the_named_alerts_for(tmp_path: Path) -> None:
    copy = shortened_rules(RULES, tmp_path / "alerts.yml", {"ControlPlaneLeadership": "1s"})
    original = {r["alert"]: r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    shortened = {r["alert"]: r for g in yaml.safe_load(copy.read_text())["groups"] for r in g["rules"]}
    assert shortened.pop("ControlPlaneLeadership")["for"] == "1s"
    assert original.pop("ControlPlaneLeadership")["for"] == "1m"
    assert shortened == original


def test_shortening_an_alert_the_rules_do_not_have_is_refused_with_its_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="NoSuchAlert"):
        shortened_rules(RULES, tmp_path / "alerts.yml", {"NoSuchAlert": "1s"})


def test_the_alert_log_keeps_when_each_alert_fired_and_cleared() -> None:
    log = AlertLog()
    log.saw(10.0, set())
    log.saw(11.0, {"NodeLost"})
    log.saw(12.0, {"NodeLost", "ControlPlaneLeadership"})
    log.saw(14.0, {"ControlPlaneLeadership"})
    assert log.firing("ControlPlaneLeadership") and not log.firing("NodeLost")
    assert log.summary(10.0) == (
        "NodeLost fired at 1.0 s, cleared at 4.0 s; ControlPlaneLeadership fired at 2.0 s, still firing"
    )
    assert log.summary(10.0, 11.5) == "NodeLost fired at 1.0 s, cleared at 4.0 s"
    assert [s.alert for s in log.since(13.0)] == ["NodeLost", "ControlPlaneLeadership"]
    assert log.since(15.0, "NodeLost") == []


@pytest.fixture
async def metrics() -> AsyncIterator[tuple[dict[str, float], str]]:
    """A /metrics of our own: what a leading scheduler with two nodes publishes, values set by the test."""
    values = {"lost": 0.0, "leader": 1.0}

    async def handler(_: web.Request) -> web.Response:
        body = (
            '# TYPE llmgw_nodes gauge\nllmgw_nodes{state="ready"} 2\n'
            f'llmgw_nodes{{state="lost"}} {values["lost"]}\n'
            "# TYPE llmgw_control_plane_leader gauge\n"
            f'llmgw_control_plane_leader{{instance="sched-a"}} {values["leader"]}\n'
        )
        return web.Response(text=body, content_type="text/plain")

    app = web.Application()
    app.router.add_get("/metrics", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield values, f"127.0.0.1:{port}"
    finally:
        await runner.cleanup()


@pytest.mark.timeout(120)
async def test_prometheus_fires_node_lost_and_control_plane_leadership_from_the_series_and_clears_them(
    tmp_path: Path, metrics: tuple[dict[str, float], str]
) -> None:
    if prometheus_binary() is None:
        pytest.skip(NO_PROMETHEUS)
    values, target = metrics
    rules = shortened_rules(RULES, tmp_path / "alerts.yml", {"ControlPlaneLeadership": "1s"})
    async with running(tmp_path / "prometheus", {"server1": target}, rules) as prom:
        assert prom.firing() == set()
        values["lost"] = 1
        await wait_until(lambda: prom.log.firing("NodeLost"), deadline_s=30, what="NodeLost firing")
        values["lost"] = 0
        await wait_until(lambda: not prom.log.firing("NodeLost"), deadline_s=30, what="NodeLost cleared")
        values["leader"] = 0
        await wait_until(
            lambda: prom.log.firing("ControlPlaneLeadership"), deadline_s=30, what="ControlPlaneLeadership firing"
        )
        values["leader"] = 1
        await wait_until(
            lambda: not prom.log.firing("ControlPlaneLeadership"),
            deadline_s=30,
            what="ControlPlaneLeadership cleared",
        )
        assert [s.alert for s in prom.log.spans] == ["NodeLost", "ControlPlaneLeadership"]
