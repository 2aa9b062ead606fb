"""The management API (services/api/manage.py) against real services on a real nats-server: a change over
HTTP is the command the CLI sends, signed with the caller's own token; the command's service decides who
may; an Idempotency-Key names the command; a body that does not fit is a 400 naming the field."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from click.testing import CliRunner

from llmgw.cli.main import main
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import access as A
from llmgw.events.schema import models as M
from llmgw.events.schema import people as P
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import RecordedEvent
from llmgw.events.schema.outcomes import CommandCompleted
from llmgw.events.schema.subjects import event_subject
from llmgw.services.api.act import command_id_for
from llmgw.services.console import session as SES
from tests.fleet import Fleet
from tests.signin import TESTER
from tests.support import NatsServer, wait_until

pytestmark = [pytest.mark.timeout(240)]

SERVICES = ("tenancy", "access", "people", "catalog", "fleet", "scheduler", "projections", "api")
PASSWORD = "a long enough password"


@pytest.fixture
async def api(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    """The admin API with every service a command here goes to; the tester is a cluster admin."""
    f = await Fleet(store, nats.url, tmp_path).start(services=SERVICES)
    try:
        yield f
    finally:
        await f.stop()


async def call(
    fleet: Fleet,
    method: str,
    path: str,
    body: Any = None,
    *,
    token: str | None = None,
    key: str | None = None,
    raw: bytes | None = None,
) -> tuple[int, dict[str, Any]]:
    headers = {"Authorization": f"Bearer {token or fleet.admin_token}"}
    if key is not None:
        headers["Idempotency-Key"] = key
    data = raw if raw is not None else (msgspec.json.encode(body) if body is not None else None)
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, fleet.admin_url + path, data=data, headers=headers) as r,
    ):
        return r.status, await r.json()


async def applied(fleet: Fleet, method: str, path: str, body: Any = None, **kw: Any) -> dict[str, Any]:
    status, answer = await call(fleet, method, path, body, **kw)
    assert status == 200 and answer["outcome"] == "applied", (status, answer)
    return answer


async def tenants(fleet: Fleet, *paths: str) -> None:
    for path in paths:
        kind = ("org", "team", "project")[path.count("/")]
        await applied(fleet, "POST", "/api/v1/tenants", {"kind": kind, "path": path})


async def person(fleet: Fleet, name: str, role: str, scope: str) -> str:
    """A person with ``role`` over ``scope``, made over HTTP by the tester; their personal token, once known."""
    await applied(fleet, "POST", "/api/v1/users", {"name": name, "password": PASSWORD})
    await applied(fleet, "POST", f"/api/v1/users/{name}/roles", {"role": role, "scope": scope})
    token = (await applied(fleet, "POST", f"/api/v1/users/{name}/tokens", {"label": "tests"}))["result"]["secret"]

    async def known() -> bool:
        return (await call(fleet, "GET", "/api/v1/whoami", token=token))[0] == 200

    await wait_until(known, what=f"the admin API to know {name}'s token")
    return token


async def completed(store: EventStore, kind: str) -> list[tuple[str, CommandCompleted]]:
    """Every carried-out command of ``kind`` on the log: (its id, its outcome)."""
    return [
        (e.subject.rsplit(".", 1)[1], e.payload)
        for e in await store.read("llmgw.evt.command.>")
        if isinstance(e, RecordedEvent) and isinstance(e.payload, CommandCompleted) and e.payload.kind == kind
    ]


async def ctl(fleet: Fleet, *args: str) -> str:
    """``llmgw ctl ARGS…`` signed in as the tester (on a thread: the CLI runs its own event loop)."""
    argv = ["--nats", fleet.nats_url, "--api", fleet.admin_url, "ctl", *args]
    done = await asyncio.to_thread(CliRunner().invoke, main, argv, env=fleet.cli_env())
    assert done.exit_code == 0, done.output
    return done.output


async def test_a_change_over_http_is_the_command_the_cli_sends_and_its_actor_is_the_token_s_person(
    api: Fleet,
) -> None:
    await tenants(api, "acme", "acme/ml", "acme/ml/chat")
    # The actor is not the body's to say: a body naming one is refused before any command is made.
    status, refused = await call(api, "PUT", "/api/v1/limits/project:acme/ml/chat", {"rpm": 5, "actor": "user:eve"})
    assert status == 400 and refused["error"]["field"] == "actor", refused

    over_http = await applied(api, "PUT", "/api/v1/limits/project:acme%2Fml%2Fchat", {"rpm": 5})
    await ctl(api, "limit", "set", "project:acme/ml/chat", "--rpm", "5")

    sent = await completed(api.store, "access.limit.set")
    assert len(sent) == 2 and sent[0][0] == over_http["command"], sent
    (_, http), (_, cli) = sent
    as_sent = [msgspec.json.decode(c.command) for c in (http, cli)]
    assert (
        as_sent[0]["data"]
        == as_sent[1]["data"]
        == {
            "type": "limit-set",
            "scope": "project:acme/ml/chat",
            "rpm": 5,
            "tpm": None,
        }
    )
    assert as_sent[0]["actor"] == as_sent[1]["actor"] == ""  # left for the service to write the verified person
    assert http.requested_by == cli.requested_by == f"user:{TESTER}"
    assert http.signer == cli.signer and http.signer.startswith("token:")
    limit_events = [e for e in await api.store.read(f"llmgw.evt.{A.LIMIT_AGGREGATE}.>") if isinstance(e, RecordedEvent)]
    assert [e.envelope.actor for e in limit_events] == [f"user:{TESTER}"] * 2
    assert limit_events[0].id in over_http["events"]


async def test_a_team_admin_creates_a_key_in_its_project_and_is_refused_in_another_team_s(api: Fleet) -> None:
    await tenants(api, "acme", "acme/ml", "acme/ml/chat", "acme/web", "acme/web/shop")
    tina = await person(api, "tina", "team-admin", "team:acme/ml")

    made = await applied(api, "POST", "/api/v1/keys", {"project": "acme/ml/chat", "name": "ci"}, token=tina)
    secret, prefix = made["result"]["secret"], made["result"]["prefix"]
    assert A.key_prefix(secret) == prefix
    status, listed = await call(api, "GET", "/api/v1/keys?project=acme/ml/chat", token=tina)
    assert status == 200 and [k["id"] for k in listed["keys"]] == [made["result"]["id"]], listed
    assert secret not in str(listed) and secret not in str(await api.store.read(f"llmgw.evt.{A.KEY_AGGREGATE}.>"))

    status, refused = await call(api, "POST", "/api/v1/keys", {"project": "acme/web/shop"}, token=tina)
    assert status == 403 and refused["outcome"] == "refused" and refused["code"] == "forbidden", refused
    assert "needs member of project:acme/web/shop" in refused["message"], refused
    assert "tina holds team-admin of team:acme/ml" in refused["message"], refused
    assert "secret" not in refused["result"]


async def test_a_viewer_s_change_is_refused_with_a_403_and_nothing_is_applied(api: Fleet) -> None:
    vic = await person(api, "vic", "viewer", "cluster")
    for method, path, body in (
        ("POST", "/api/v1/tenants", {"kind": "org", "path": "acme"}),
        ("POST", "/api/v1/nodes/n1/cordon", {"reason": "mine now"}),
        ("PUT", "/api/v1/prices/tiny", {"input_usd_per_m": 1.0, "output_usd_per_m": 2.0}),
    ):
        status, refused = await call(api, method, path, body, token=vic)
        assert status == 403 and refused["code"] == "forbidden", (path, refused)
        assert "needs " in refused["message"] and "vic holds viewer of the cluster" in refused["message"], refused
    assert (await call(api, "GET", "/api/v1/tree"))[1]["orgs"] == []
    # A person only a cluster admin may add: refused by the people service, the password never hashed.
    status, refused = await call(api, "POST", "/api/v1/users", {"name": "eve", "password": PASSWORD}, token=vic)
    assert status == 403 and refused["code"] == "forbidden" and "adding user eve needs" in refused["message"]
    # Their own password is theirs to set.
    status, done = await call(
        api, "PUT", "/api/v1/users/vic/password", {"password": "another long password"}, token=vic
    )
    assert status == 200 and done["outcome"] == "applied", done
    # The projections' rebuild is no command: the API itself keeps it to cluster admins.
    status, refused = await call(api, "POST", "/api/v1/projections/rebuild", token=vic)
    assert status == 403 and refused["error"]["code"] == "forbidden", refused


async def test_the_same_idempotency_key_twice_applies_once_and_answers_the_same_command(api: Fleet) -> None:
    first = await applied(api, "POST", "/api/v1/tenants", {"kind": "org", "path": "acme"}, key="make-acme")
    again = await applied(api, "POST", "/api/v1/tenants", {"kind": "org", "path": "acme"}, key="make-acme")
    assert again == first and first["command"] == command_id_for(TESTER, "make-acme")
    created = [e for e in await api.store.read(event_subject(T.AGGREGATE, T.TREE_ID)) if e.type == "org.created"]
    assert len(created) == 1
    # Without the key it is a new command, refused as the state now is.
    status, refused = await call(api, "POST", "/api/v1/tenants", {"kind": "org", "path": "acme"})
    assert status == 409 and refused["code"] == "exists", refused
    # The key names that one command: another command under it is refused, not answered with its outcome.
    status, refused = await call(api, "POST", "/api/v1/tenants", {"kind": "org", "path": "beta"}, key="make-acme")
    assert status == 200 and refused == first  # the same kind: its first outcome, beta is not made
    status, refused = await call(api, "PUT", "/api/v1/limits/org:acme", {"rpm": 1}, key="make-acme")
    assert status == 409 and refused["code"] == "conflict" and "Idempotency-Key" in refused["message"], refused
    # A key made twice under one Idempotency-Key: one key, its secret answered the first time only.
    await tenants(api, "acme/ml", "acme/ml/chat")
    made = await applied(api, "POST", "/api/v1/keys", {"project": "acme/ml/chat"}, key="key-1")
    made_again = await applied(api, "POST", "/api/v1/keys", {"project": "acme/ml/chat"}, key="key-1")
    assert "secret" in made["result"] and "secret" not in made_again["result"]
    assert made_again["result"]["id"] == made["result"]["id"]
    status, keys = await call(api, "GET", "/api/v1/keys")
    assert status == 200 and len(keys["keys"]) == 1


async def test_a_body_that_does_not_fit_is_a_400_naming_the_field(api: Fleet) -> None:
    cases: list[tuple[str, str, bytes, str | None, str]] = [
        ("PUT", "/api/v1/models/tiny/scale", b'{"min": 1, "size": 3}', "size", "unknown field `size`"),
        ("PUT", "/api/v1/models/tiny/scale", b'{"min": "one"}', "min", "Expected `int`, got `str`"),
        ("PUT", "/api/v1/models/tiny/scale", b"{}", "min", "missing required field `min`"),
        ("PUT", "/api/v1/models/tiny/scale", b'{"min": 1, "name": "other"}', "name", "unknown field `name`"),
        ("PUT", "/api/v1/models/tiny/scale", b'{"min": ', None, "not JSON"),
        ("POST", "/api/v1/tenants", b"[1, 2]", None, "Expected `object`, got `array`"),
        ("DELETE", "/api/v1/models/tiny?purge=maybe", b"", "purge", "query field purge"),
        (
            "POST",
            "/api/v1/keys",
            b'{"project": "p", "expires_at": "2030-01-01T00:00:00"}',
            "expires_at",
            "timezone component",
        ),
        ("POST", "/api/v1/users", b'{"name": "bo", "password": "short"}', "password", "at least 12 characters"),
    ]
    for method, path, raw, field, words in cases:
        status, answer = await call(api, method, path, raw=raw)
        assert status == 400, (path, raw, answer)
        assert answer["error"].get("field") == field and words in answer["error"]["message"], (raw, answer)
    status, answer = await call(api, "POST", "/api/v1/tenants", {"kind": "org", "path": "acme"}, key="k" * 256)
    assert status == 400 and answer["error"]["field"] == "Idempotency-Key", answer
    assert (await call(api, "GET", "/api/v1/tree"))[1]["orgs"] == []
    # A body that fits but that the service finds wrong is its refusal, a 400 too (invalid_…).
    status, answer = await call(api, "POST", f"/api/v1/users/{TESTER}/roles", {"role": "wizard", "scope": "cluster"})
    assert status == 400 and answer["code"] == "invalid_role" and "wizard" in answer["message"], answer


async def test_delete_with_purge_removes_the_model(api: Fleet, tmp_path: Path) -> None:
    spec = {
        "name": "tiny",
        "source": str(tmp_path / "tiny.gguf"),
        "scaling": {"min": 0},
        "profiles": [{"engine": "llamacpp", "cpu_cores": 1, "min_memory_gb": 0.05}],
    }
    await applied(api, "POST", "/api/v1/models", {"spec": spec})
    assert [m["name"] for m in (await call(api, "GET", "/api/v1/models"))[1]["models"]] == ["tiny"]

    removed = await applied(api, "DELETE", "/api/v1/models/tiny?purge=true")
    assert removed["kind"] == "catalog.remove" and removed["events"], removed
    assert (await call(api, "GET", "/api/v1/models"))[1]["models"] == []
    gone = [e.payload for e in await api.store.read(event_subject(M.AGGREGATE, "tiny"))]
    assert any(isinstance(p, M.ModelRemoved) and p.purge for p in gone), gone
    status, again = await call(api, "DELETE", "/api/v1/models/tiny")
    assert status == 404 and again["code"] == "not_found", again


async def test_a_console_session_s_cookie_acts_with_its_csrf_token_and_is_refused_without(api: Fleet) -> None:
    await person(api, "cora", "cluster-admin", "cluster")
    async with aiohttp.ClientSession() as s:
        async with s.post(api.admin_url + "/api/v1/login", json={"user": "cora", "password": PASSWORD}) as r:
            assert r.status == 200, await r.text()
            session = (await r.json())["token"]
        cookie = {SES.COOKIE: session}
        url = api.admin_url + "/api/v1/tenants"
        body = {"kind": "org", "path": "acme"}
        async with s.post(url, json=body, cookies=cookie) as r:
            assert r.status == 403 and (await r.json())["error"]["code"] == "csrf"
        csrf = {SES.CSRF_HEADER: SES.csrf_token(session)}
        async with s.post(url, json=body, cookies=cookie, headers=csrf) as r:
            done = await r.json()
            assert r.status == 200 and done["outcome"] == "applied", done
    outcome = [c for i, c in await completed(api.store, "tenancy.create") if i == done["command"]]
    assert outcome[0].requested_by == "user:cora" and outcome[0].signer == f"token:{P.token_prefix(session)}"
