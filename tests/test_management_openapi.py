"""The admin API's OpenAPI 3.1 document (services/api/openapi.py): open, valid by openapi-spec-validator,
covering every command the CLI sends; and schemathesis, generating requests from the document the live
server serves, finds no 5xx and no answer that differs from the document — with a cluster admin's real
token, against every service a command goes to."""

from __future__ import annotations

import asyncio
import re
import typing
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from openapi_spec_validator import validate
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import access as A
from llmgw.events.schema import jobs as J
from llmgw.events.schema import mirror as E
from llmgw.events.schema import models as M
from llmgw.events.schema import nodes as N
from llmgw.events.schema import people as P
from llmgw.events.schema import quotas as Q
from llmgw.events.schema import replicas as R
from llmgw.events.schema import tenancy as T
from llmgw.services.api.manage import ENDPOINTS
from llmgw.services.api.openapi import OPENAPI_PATH, READS, document
from tests.fleet import Fleet
from tests.support import NatsServer, free_port

pytestmark = [pytest.mark.timeout(300)]

CLI = Path(__file__).parent.parent / "cli"
EXAMPLES = 8  # per operation: about 60 operations, each example a command or a read against real services
EVERY_SERVICE = (
    "tenancy",
    "access",
    "people",
    "catalog",
    "fleet",
    "scheduler",
    "projections",
    "api",
    "jobs",
    "mirror",
)


@pytest.fixture
async def everything(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    """Every service a command goes to; the hub is a closed port, so a fetch fails at once instead of
    reaching out (the jobs and the mirror refuse or fail it on the log, as they would without network)."""
    hub = f"http://127.0.0.1:{free_port()}"
    f = await Fleet(store, nats.url, tmp_path).start(services=EVERY_SERVICE, hub_endpoint=hub)
    try:
        yield f
    finally:
        await f.stop()


async def served_document(fleet: Fleet) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as s, s.get(fleet.admin_url + OPENAPI_PATH) as r:  # no token
        return r.status, await r.json()


def test_every_command_a_service_takes_has_an_endpoint() -> None:
    unions = (
        M.CatalogCommand,
        N.FleetCommand,
        R.RestartReplica,
        T.TenancyCommand,
        Q.QuotaCommand,
        A.AccessCommand,
        P.PeopleCommand,
        J.JobCommand,
        E.MirrorCommand,
    )
    commands = {c for u in unions for c in (typing.get_args(u) or (u,))}
    assert commands == {ep.payload for ep in ENDPOINTS}


def test_every_verb_the_cli_sends_has_an_endpoint() -> None:
    services = {"M": M, "N": N, "T": T, "A": A, "P": P, "J": J, "E": E}
    sent = {
        (services[alias].SERVICE, verb)
        for source in CLI.glob("*.py")
        for alias, verb in re.findall(r"s\.command\(\s*(\w)\.SERVICE,\s*\"([\w.\-]+)\"", source.read_text())
    }
    assert len(sent) > 20, sent  # the CLI names most verbs literally; the rest are the payload types above
    assert sent <= {(ep.service, ep.verb) for ep in ENDPOINTS}


def test_the_document_is_valid_openapi_3_1_with_a_bearer_scheme() -> None:
    doc = document()
    validate(doc)
    assert doc["openapi"].startswith("3.1") and doc["security"] == [{"bearer": []}]
    assert doc["components"]["securitySchemes"]["bearer"] == {
        **doc["components"]["securitySchemes"]["bearer"],
        "type": "http",
        "scheme": "bearer",
    }
    operations = {(method.upper(), path) for path, item in doc["paths"].items() for method in item}
    assert {(ep.method, ep.openapi_path) for ep in ENDPOINTS} <= operations
    assert {("GET", path) for path in READS} <= operations
    # A body is the payload's fields as the handler decodes them, unknown fields refused.
    scale = doc["paths"]["/api/v1/models/{name}/scale"]["put"]
    body = doc["components"]["schemas"][
        scale["requestBody"]["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
    ]
    assert set(body["properties"]) == {"min", "max"} and body["additionalProperties"] is False
    assert [p["name"] for p in scale["parameters"]] == ["name", "Idempotency-Key"]


def _explore(operation: schemathesis.APIOperation, base_url: str, token: str) -> list[str]:
    """Send EXAMPLES generated requests for one operation; the failed checks, each with its request."""
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    failures: list[str] = []

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],  # every failure is collected below; no shrinking
        suppress_health_check=list(HealthCheck),
    )
    @given(operation.as_strategy())
    def send(case: schemathesis.Case) -> None:
        response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        try:
            case.validate_response(response, checks=checks)
        except (AssertionError, FailureGroup) as failed:
            body = response.text[:600]
            failures.append(f"{case.as_curl_command()[:1500]}\n  → {response.status_code} {body}\n  {failed}")

    send()
    return failures


async def test_schemathesis_finds_no_5xx_and_every_answer_matches_the_served_document(everything: Fleet) -> None:
    status, doc = await served_document(everything)
    assert status == 200 and doc == document()
    schema = schemathesis.openapi.from_dict(doc)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) == len(ENDPOINTS) + len(READS) + 4  # rebuild, verify, login, the document
    failures: list[str] = []
    for operation in operations:
        # Hypothesis and schemathesis's client are synchronous; the admin API answers on this loop.
        failures += await asyncio.to_thread(_explore, operation, everything.admin_url, everything.admin_token)
    assert not failures, f"{len(failures)} failed:\n\n" + "\n\n".join(failures[:20])


def test_docs_api_lists_every_endpoint_with_its_service_and_verb() -> None:
    page = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    for ep in ENDPOINTS:
        row = f"| `{ep.method} {ep.openapi_path}` | `{ep.service}` `{ep.verb}` | `{ep.payload.__name__}` |"
        assert row in page, f"docs/api.md lacks the row of {ep.method} {ep.openapi_path}: {row}"
