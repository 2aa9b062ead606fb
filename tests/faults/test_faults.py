"""Faults under steady load on a cluster on loopback (tests/cluster_harness.py), one after another.

Marked ``faults``: not part of the default run (`make test-faults` runs them, about ten minutes).
After each fault: every request answered 200 has exactly one usage record, `llmgw projections
verify` is clean, and the load is steady again through both routers. The figures (errors, seconds
to recover) go to ``$LLMGW_FAULTS_REPORT`` (default: the harness's directory) as the table
docs/reliability.md shows; they are measured, never asserted.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.cluster_harness import MODEL, ClusterHarness
from tests.faults.load import Load
from tests.faults.suite import FAULTS, FaultResult, markdown, run_fault

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


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_every_request_answered_200_is_billed_once_and_the_books_verify_after(
    fault: str, harness: ClusterHarness, load: Load
) -> None:
    if "disk full" in fault and os.geteuid() != 0:
        pytest.skip("a NATS node's full disk is a tmpfs mount: it needs root")
    result = await run_fault(harness, load, fault)
    RESULTS.append(result)
    print(result)
    assert result.doubled == 0, f"{result.doubled} requests answered 200 have two usage records ({fault})"
    assert result.verify_clean, f"projections verify not clean after {fault}: {result.note}"
    beyond = result.lost - result.lost_at_kill
    assert beyond == 0, f"{beyond} requests answered 200 have no usage record ({fault}): {result.note}"
    if result.lost:
        # The router keeps a record in memory while the bus acknowledges (docs/decisions.md, "Usage records: a
        # spill journal…"): a kill -9 within that moment loses it. Known; shown in docs/reliability.md.
        pytest.xfail(f"{result.lost} usage records held in memory by a router killed -9 were lost")
