"""Faults under steady load on a cluster on loopback (tests/cluster_harness.py), one after another.

Marked ``faults``: not part of the default run (`make test-faults` runs them, about ten minutes).
After each fault: every request answered 200 has exactly one usage record, `llmgw projections
verify` is clean, and the load is steady again through both routers. The figures (errors, seconds
to recover) go to ``$LLMGW_FAULTS_REPORT`` (default: the harness's directory) as the table
docs/reliability.md shows; they are measured, never asserted.

A real Prometheus (tests/faults/prometheus.py) scrapes every server each second with the project's alert
rules all through the suite; what fired during each fault goes into the report, and the faults in
``ALERTS_EXPECTED`` must fire their alert and see it clear (skipped without a ``prometheus`` binary).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.cluster_harness import MODEL, ClusterHarness
from tests.faults.load import Load
from tests.faults.prometheus import NO_PROMETHEUS, RULES, Prometheus, prometheus_binary, running, shortened_rules
from tests.faults.suite import ALERTS_EXPECTED, FAULTS, SHORTENED_FOR, FaultResult, markdown, run_fault
from tests.support import wait_until

pytestmark = [pytest.mark.faults, pytest.mark.timeout(900)]

CLIENTS = int(os.environ.get("LLMGW_FAULTS_CLIENTS", "8"))
RESULTS: list[FaultResult] = []


@pytest.fixture(scope="module")
async def harness() -> AsyncIterator[ClusterHarness]:
    # Outside pytest's own temporary directories, which later runs on this machine rotate away: the
    # servers' logs and each verify's output stay for a look after a failure.
    base = Path(os.environ.get("LLMGW_FAULTS_DIR") or tempfile.mkdtemp(prefix="llmgw-faults-"))
    print(f"\nfault suite: the cluster's logs are under {base}")
    async with ClusterHarness(base) as h:
        yield h
    report = Path(os.environ.get("LLMGW_FAULTS_REPORT") or base / "reliability.md")
    report.write_text(markdown(RESULTS))
    print(f"\nfault report: {report}\n{markdown(RESULTS)}")


@pytest.fixture(scope="module")
async def load(harness: ClusterHarness) -> AsyncIterator[Load]:
    running = Load(harness.gateways, harness.key, MODEL, clients=CLIENTS).start()
    yield running
    await running.stop()


@pytest.fixture(scope="module")
async def prometheus(harness: ClusterHarness) -> AsyncIterator[Prometheus | None]:
    """A real Prometheus scraping every server each second with ops/prometheus/alerts.yml (ALERTS_EXPECTED's
    for: shortened, in a copy beside the cluster's logs), its alerts logged all through the suite; None
    without a prometheus binary (the faults still run, their alert tests are skipped)."""
    if prometheus_binary() is None:
        print(f"\nfault suite: {NO_PROMETHEUS}")
        yield None
        return
    rules = shortened_rules(RULES, harness.base / "prometheus" / "alerts.yml", SHORTENED_FOR)
    async with running(harness.base / "prometheus", harness.metrics_targets(), rules) as prom:
        print(f"\nfault suite: Prometheus at {prom.url} (alerts: {prom.url}/alerts)")
        yield prom


def check_books(result: FaultResult) -> None:
    assert result.doubled == 0, f"{result.doubled} requests answered 200 have two usage records ({result.fault})"
    assert result.verify_clean, f"projections verify not clean after {result.fault}: {result.note}"
    # None excused, not even a record a router killed -9 had just made: it was in the in-flight log.
    assert result.lost == 0, (
        f"{result.lost} requests answered 200 have no usage record ({result.fault}; {result.lost_at_kill} of them "
        f"answered by a process just before it was killed): {result.note}"
    )


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_every_request_answered_200_is_billed_once_and_the_books_verify_after(
    fault: str, harness: ClusterHarness, load: Load, prometheus: Prometheus | None
) -> None:
    if "disk full" in fault and os.geteuid() != 0:
        pytest.skip("a NATS node's full disk is a tmpfs mount: it needs root")
    result = await run_fault(harness, load, fault)
    if prometheus is not None:
        result.alerts = prometheus.log.summary(result.began, result.ended)
    RESULTS.append(result)
    print(result)
    check_books(result)


@pytest.mark.parametrize(("fault", "alert"), list(ALERTS_EXPECTED.items()))
async def test_the_alert_a_fault_raises_fires_and_clears_once_the_cluster_is_whole_again(
    fault: str, alert: str, harness: ClusterHarness, load: Load, prometheus: Prometheus | None
) -> None:
    """Read from Prometheus's /api/v1/alerts (polled all through the suite): ``alert`` fired after ``fault``
    began, and is not firing once the cluster is whole again."""
    if prometheus is None:
        pytest.skip(NO_PROMETHEUS)
    result = next((r for r in RESULTS if r.fault == fault), None)
    if result is None:  # its fault did not run in this session (a -k that leaves it out): run it here
        result = await run_fault(harness, load, fault)
        RESULTS.append(result)
        check_books(result)
    began = result.began
    await wait_until(
        lambda: any(s.fired >= began for s in prometheus.log.since(began, alert)),
        deadline_s=120,
        what=f"Prometheus firing {alert} after {fault!r} began",
    )
    await wait_until(
        lambda: not prometheus.log.firing(alert),
        deadline_s=120,
        what=f"{alert} cleared after {fault!r}",
    )
    result.alerts = prometheus.log.summary(began, result.ended)
    print(f"{fault}: {result.alerts}")
