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
from llmgw.events.schema import identity as I
from llmgw.events.schema import jobs as J
from llmgw.events.schema import mcp as MCP
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
        I.IdentityCommand,
        MCP.McpCommand,
    )
    # Sent by the sign-in and the SCIM endpoint for a provider (actor idp:NAME, svc:scim), by no person.
    services_only = {I.SetScimGroup, I.RemoveScimGroup, P.ProvisionUser, P.SyncRoles, P.RemoveUser}
    commands = {c for u in unions for c in (typing.get_args(u) or (u,))} - services_only
    assert commands == {ep.payload for ep in ENDPOINTS}


def test_every_verb_the_cli_sends_has_an_endpoint() -> None:
    services = {"M": M, "N": N, "T": T, "A": A, "P": P, "J": J, "E": E, "I": I}
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
    # rebuild, verify, login, the device sign-in (start, poll), the document
    assert len(operations) == len(ENDPOINTS) + len(READS) + 6
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


# Every endpoint once, in an order that gives each something to act on: (method, path, path parameters,
# query, body, the status expected). Some name what this fleet lacks (no node, no replica, no hub): those
# are answered by their service, refused as not found or as the hub's failure — still by the document.
TOUR: list[tuple[str, str, dict[str, str], dict[str, str], Any, set[int]]] = [
    ("POST", "/api/v1/tenants", {}, {}, {"kind": "org", "path": "acme"}, {200}),
    ("POST", "/api/v1/tenants", {}, {}, {"kind": "team", "path": "acme/ml"}, {200}),
    ("POST", "/api/v1/tenants", {}, {}, {"kind": "project", "path": "acme/ml/chat"}, {200}),
    ("POST", "/api/v1/tenants", {}, {}, {"kind": "project", "path": "acme/ml/spare"}, {200}),
    (
        "PATCH",
        "/api/v1/tenants/{kind}/{path}",
        {"kind": "project", "path": "acme/ml/spare"},
        {},
        {"name": "gone"},
        {200},
    ),
    ("DELETE", "/api/v1/tenants/{kind}/{path}", {"kind": "project", "path": "acme/ml/gone"}, {}, None, {200}),
    ("PUT", "/api/v1/quotas/{scope}", {"scope": "team:acme/ml"}, {}, {"limit": {"cores": 8}}, {200}),
    ("DELETE", "/api/v1/quotas/{scope}", {"scope": "team:acme/ml"}, {}, None, {200}),
    (
        "POST",
        "/api/v1/models",
        {},
        {},
        {
            "spec": {
                "name": "tiny",
                "source": "/models/tiny.gguf",
                "scaling": {"min": 0},
                "profiles": [{"engine": "llamacpp", "cpu_cores": 1, "min_memory_gb": 0.05}],
            }
        },
        {200},
    ),
    ("PUT", "/api/v1/models/{name}/scale", {"name": "tiny"}, {}, {"min": 0, "max": 2}, {200}),
    ("PUT", "/api/v1/models/{name}/resources", {"name": "tiny"}, {}, {"memory_gb": 0.1}, {200}),
    ("PUT", "/api/v1/models/{name}/class", {"name": "tiny"}, {}, {"capacity_class": "opportunistic"}, {200}),
    ("PUT", "/api/v1/models/{name}/owner", {"name": "tiny"}, {}, {"owner": "team:acme/ml"}, {200}),
    ("PUT", "/api/v1/models/{name}/slo", {"name": "tiny"}, {}, {"ttft_p95_s": 2.0}, {200}),
    (
        "PUT",
        "/api/v1/models/{name}/measured",
        {"name": "tiny"},
        {},
        {
            "measured": {
                "profile": "default",
                "shape": {},
                "node_id": "n1",
                "replica_id": "r1",
                "concurrency": 2,
                "tokens_per_s": 9.0,
                "ttft_p95_s": 0.5,
                "request_tokens_per_s": 4.0,
                "basis": "knee",
                "requests": 10,
                "at": 1.0,
            }
        },
        {200},
    ),
    ("POST", "/api/v1/models/{name}/stop", {"name": "tiny"}, {}, None, {200}),
    ("POST", "/api/v1/models/{name}/start", {"name": "tiny"}, {}, None, {200}),
    ("POST", "/api/v1/models/{name}/retry", {"name": "tiny"}, {}, None, {409}),  # not parked
    ("POST", "/api/v1/nodes/{node_id}/cordon", {"node_id": "n1"}, {}, {"reason": "maintenance"}, {404}),
    ("POST", "/api/v1/nodes/{node_id}/uncordon", {"node_id": "n1"}, {}, None, {404}),
    ("POST", "/api/v1/nodes/{node_id}/drain", {"node_id": "n1"}, {}, {"grace_s": 5.0}, {404}),
    ("POST", "/api/v1/replicas/{replica_id}/restart", {"replica_id": "r1"}, {}, {"reason": "tests"}, {404}),
    ("POST", "/api/v1/keys", {}, {}, {"project": "acme/ml/chat", "name": "ci", "rpm": 10}, {200}),
    ("PUT", "/api/v1/limits/{scope}", {"scope": "project:acme/ml/chat"}, {}, {"rpm": 5, "tpm": 1000}, {200}),
    ("PUT", "/api/v1/prices/{model}", {"model": "tiny"}, {}, {"input_usd_per_m": 0.1, "output_usd_per_m": 0.2}, {200}),
    ("PUT", "/api/v1/budgets/{scope}", {"scope": "project:acme/ml/chat"}, {}, {"usd": 10.0, "period": "day"}, {200}),
    ("POST", "/api/v1/users", {}, {}, {"name": "bo", "password": "bo's long password"}, {200}),
    ("PUT", "/api/v1/users/{name}/password", {"name": "bo"}, {}, {"password": "bo's other password"}, {200}),
    ("PUT", "/api/v1/users/{name}/language", {"name": "bo"}, {}, {"language": "de"}, {200}),
    ("POST", "/api/v1/users/{name}/roles", {"name": "bo"}, {}, {"role": "viewer", "scope": "team:acme/ml"}, {200}),
    (
        "DELETE",
        "/api/v1/users/{name}/roles/{role}/{scope}",
        {"name": "bo", "role": "viewer", "scope": "team:acme/ml"},
        {},
        None,
        {200},
    ),
    ("POST", "/api/v1/users/{name}/tokens", {"name": "bo"}, {}, {"label": "ci"}, {200}),
    ("POST", "/api/v1/users/{name}/disable", {"name": "bo"}, {}, {"reason": "left"}, {200}),
    ("POST", "/api/v1/users/{name}/enable", {"name": "bo"}, {}, None, {200}),
    (
        "POST",
        "/api/v1/identity/providers",
        {},
        {},
        {"name": "corp", "kind": "oidc", "oidc": {"issuer": "https://idp.example", "client_id": "llmgw"}},
        {200},
    ),
    (
        "POST",
        "/api/v1/identity/providers/{provider}/mappings",
        {"provider": "corp"},
        {},
        {"group": "ml-admins", "role": "team-admin", "scope": "team:acme/ml"},
        {200},
    ),
    (
        "DELETE",
        "/api/v1/identity/providers/{provider}/mappings/{mapping}",
        {"provider": "corp", "mapping": "m1"},
        {},
        None,
        {404},
    ),
    ("DELETE", "/api/v1/identity/providers/{name}", {"name": "corp"}, {}, None, {200}),
    ("POST", "/api/v1/scim-tokens", {}, {}, {"label": "okta"}, {200}),
    ("DELETE", "/api/v1/scim-tokens/{token}", {"token": "nosuchtk"}, {}, None, {404}),
    ("POST", "/api/v1/mcp/servers", {}, {}, {"name": "time", "command": ["python", "-m", "mcp_server_time"]}, {200}),
    ("POST", "/api/v1/mcp/servers/{server}/grants", {"server": "time"}, {}, {"project": "acme/ml/chat"}, {200}),
    (
        "POST",
        "/api/v1/mcp/servers/{server}/grants/withdraw",
        {"server": "time"},
        {},
        {"project": "acme/ml/chat"},
        {200},
    ),
    ("DELETE", "/api/v1/mcp/servers/{name}", {"name": "time"}, {}, None, {200}),
    ("POST", "/api/v1/serve", {}, {}, {"repo": "acme/tiny-GGUF"}, {200}),  # the job starts; it fails later
    ("POST", "/api/v1/mirror", {}, {}, {"model": "tiny", "repo": "acme/tiny-GGUF"}, {409}),  # a loopback hub
    ("DELETE", "/api/v1/mirror/{model}", {"model": "tiny"}, {"version": "v1"}, None, {404}),
    ("DELETE", "/api/v1/models/{name}", {"name": "tiny"}, {"purge": "true"}, None, {200}),
]


def _tour(schema: Any, base_url: str, token: str) -> list[str]:
    """Each call of TOUR, checked against the served document like schemathesis's own; what failed."""
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    failures: list[str] = []
    made: dict[str, str] = {}  # what earlier calls made that later ones name: a key's and a token's prefix
    for method, path, params, query, body, expected in TOUR:
        operation = schema[path][method]
        given = {"body": body, "media_type": "application/json"} if body is not None else {}
        case = operation.Case(path_parameters=params, query=query or None, **given)
        response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        answer = response.json()
        if response.status_code not in expected:
            failures.append(f"{method} {path} {params}: {response.status_code} {answer}")
        try:
            case.validate_response(response, checks=checks)
        except (AssertionError, FailureGroup) as failed:
            failures.append(f"{method} {path}: {failed}")
        if path in ("/api/v1/keys", "/api/v1/users/{name}/tokens") and response.status_code == 200:
            made[path] = answer["result"]["prefix"]
    for path, prefix in made.items():  # and the revocations of what was made
        revoke = "/api/v1/keys/{key}" if path == "/api/v1/keys" else "/api/v1/users/{name}/tokens/{token}"
        params = {"key": prefix} if path == "/api/v1/keys" else {"name": "bo", "token": prefix}
        case = schema[revoke]["DELETE"].Case(path_parameters=params, query={"reason": "tests"})
        response = case.call(base_url=base_url, headers={"Authorization": f"Bearer {token}"}, timeout=60)
        if response.status_code != 200:
            failures.append(f"DELETE {revoke}: {response.status_code} {response.text[:300]}")
        case.validate_response(response, checks=checks)
    if len(made) != 2:
        failures.append(f"the key and the token were not both made: {made}")
    return failures


async def test_every_endpoint_reaches_its_service_and_answers_by_the_document(everything: Fleet) -> None:
    assert {(m, p) for m, p, *_ in TOUR} | {
        ("DELETE", "/api/v1/keys/{key}"),
        ("DELETE", "/api/v1/users/{name}/tokens/{token}"),
    } == {(ep.method, ep.openapi_path) for ep in ENDPOINTS}
    _, doc = await served_document(everything)
    schema = schemathesis.openapi.from_dict(doc)
    failures = await asyncio.to_thread(_tour, schema, everything.admin_url, everything.admin_token)
    assert not failures, "\n".join(failures)
