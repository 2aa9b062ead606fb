"""scim2-tester's checks of RFC 7643 / 7644 against the live /scim/v2 endpoint (SPEC ID-4).

The tester reads what the server publishes (/ServiceProviderConfig, /ResourceTypes, /Schemas), then
creates, reads, filters, replaces, patches and deletes Users and Groups with random values for every
attribute published as writable, and checks each comes back as written.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx2
import pytest
from scim2_client.engines.httpx2 import SyncSCIMClient
from scim2_tester import Status, check_server

from llmgw.events.runtime.store import EventStore
from tests.fleet import Fleet
from tests.scim_support import SERVICES, bearer, scim_token
from tests.support import NatsServer


@pytest.fixture
async def fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=SERVICES)
    yield f
    await f.stop()


def run_checks(base_url: str, token: str) -> list:
    with httpx2.Client(base_url=base_url, headers=bearer(token), timeout=30) as http:
        client = SyncSCIMClient(http)
        return check_server(client)


@pytest.mark.timeout(600)
async def test_scim2_tester_finds_nothing_wrong_with_the_endpoint(fleet: Fleet) -> None:
    token = await scim_token(fleet)
    # The tester's client is synchronous: it runs in a thread while the server serves on this loop.
    results = await asyncio.to_thread(run_checks, f"{fleet.admin_url}/scim/v2", token)
    failed = [r for r in results if r.status in (Status.ERROR, Status.CRITICAL)]
    ran = [r for r in results if r.status == Status.SUCCESS]
    report = "\n".join(f"- {r.resource_type or ''} {r.title}: {r.reason}" for r in failed)
    assert not failed, f"{len(failed)} of {len(results)} checks failed:\n{report}"
    assert len(ran) > 40, [(r.title, r.status, r.reason) for r in results]
