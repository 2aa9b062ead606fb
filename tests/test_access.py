"""Keys, limits, prices and budgets through the bus and the admin API (SPEC TEN-2, GW-4, GW-5).

The tenancy and access services, the projections and the admin API run in this process (as
`llmgw server` runs them); commands go over the bus, views come from the API.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import stat
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import click
import msgspec
import pytest

from llmgw.cli.access_cmd import parse_expiry
from llmgw.cli.runtime import serve
from llmgw.cli.server_config import ServerConfig
from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.runtime.store import AppendConflict, EventStore, NewEvent
from llmgw.events.schema import access as A
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import utc_now
from llmgw.events.schema.outcomes import CommandCompleted
from llmgw.events.schema.subjects import EVENTS_ROOT
from llmgw.services.access.bootstrap import DEMO_KEY_FILE, ensure_demo_key
from llmgw.services.access.rules import decide
from llmgw.services.access.service import AccessService
from tests.signin import headers, sign_in_tester
from tests.support import NatsServer, free_port

SERVICES = ("tenancy", "access", "people", "projections", "api")


class Access:
    """The access side of the system in this process; a command client and an admin API client."""

    def __init__(self, store: EventStore, nats_url: str, db_dsn: str) -> None:
        self.store = store
        self.client = CommandClient.for_service(store, "tests")
        self.admin_port = free_port()
        self.config = ServerConfig(
            nats_url=nats_url, db_dsn=db_dsn, services=SERVICES, port=free_port(), admin_port=self.admin_port
        )
        self._stop = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._http: aiohttp.ClientSession | None = None

    async def start(self) -> Access:
        ready = asyncio.Event()
        self._task = asyncio.create_task(serve(self.config, self._stop, on_ready=ready.set))
        await asyncio.wait_for(ready.wait(), 30)
        token = await sign_in_tester(self.store, f"http://127.0.0.1:{self.admin_port}")
        self._http = aiohttp.ClientSession(headers=headers(token))
        return self

    async def stop(self) -> None:
        if self._http is not None:
            await self._http.close()
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 30)

    async def send(self, verb: str, payload: msgspec.Struct, service: str = A.SERVICE) -> CommandCompleted:
        return await self.client.send(service, verb, payload, actor="user:test", timeout=20)

    async def tree(self, *scopes: tuple[str, str]) -> None:
        for kind, path in scopes:
            await self.send("create", T.CreateScope(kind=kind, path=path), service=T.SERVICE)

    async def key(self, project: str = "acme/ml/chat", **fields: Any) -> tuple[str, str, str, CommandCompleted]:
        """(secret, prefix, sha256, outcome) of a key made as the CLI makes it."""
        secret, prefix, digest = A.make_api_key()
        out = await self.send("key.create", A.CreateKey(project=project, prefix=prefix, secret_sha256=digest, **fields))
        return secret, prefix, digest, out

    async def post(self, path: str, **params: str) -> tuple[int, Any, str]:
        assert self._http is not None
        async with self._http.post(f"http://127.0.0.1:{self.admin_port}{path}", params=params) as resp:
            text = await resp.text()
            return resp.status, json.loads(text), text

    async def get(self, path: str, **params: str) -> tuple[int, Any, str]:
        assert self._http is not None
        url = f"http://127.0.0.1:{self.admin_port}{path}"
        async with self._http.get(url, params=params) as resp:
            text = await resp.text()
            return resp.status, json.loads(text), text


ACME = (("org", "acme"), ("team", "acme/ml"), ("project", "acme/ml/chat"))


@pytest.fixture
async def access(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Access]:
    a = await Access(store, nats.url, f"sqlite:///{tmp_path / 'projections.db'}").start()
    yield a
    await a.stop()


@pytest.fixture
async def access_any_db(store: EventStore, nats: NatsServer, db_dsn: str) -> AsyncIterator[Access]:
    """The same, once on SQLite and once on PostgreSQL."""
    a = await Access(store, nats.url, db_dsn).start()
    yield a
    await a.stop()


# -- keys ----------------------------------------------------------------------------------------


async def test_a_key_created_through_the_bus_is_listed_by_prefix_without_its_secret_or_hash(
    access_any_db: Access,
) -> None:
    access = access_any_db
    await access.tree(*ACME, ("project", "acme/ml/other"))
    later = utc_now() + timedelta(days=30)
    secret, prefix, digest, out = await access.key(
        name="ci", user="alice", rpm=60, tpm=10_000, models=["smollm2"], expires_at=later
    )
    assert out.message == f"key {out.result['id']} (ci) created for project acme/ml/chat"
    assert out.result["prefix"] == prefix
    await access.key(project="acme/ml/other", name="web")

    status, body, text = await access.get("/api/v1/keys", project="acme/ml/chat")
    assert status == 200
    [listed] = body["keys"]
    assert listed["id"] == out.result["id"]
    assert listed["prefix"] == prefix and listed["display"] == f"llmgw-{prefix}-…"
    assert (listed["project"], listed["name"], listed["user"]) == ("acme/ml/chat", "ci", "alice")
    assert (listed["rpm"], listed["tpm"], listed["models"]) == (60, 10_000, ["smollm2"])
    assert listed["state"] == "active" and listed["revoked"] is False
    assert listed["created_by"] == "user:test"
    assert datetime.fromisoformat(listed["expires_at"]) == later
    assert secret.split("-", 2)[2] not in text and digest not in text
    _, every, _ = await access.get("/api/v1/keys")
    assert [k["project"] for k in every["keys"]] == ["acme/ml/chat", "acme/ml/other"]


async def test_listing_the_keys_of_a_project_that_does_not_exist_names_the_projects(access: Access) -> None:
    await access.tree(*ACME)
    status, body, _ = await access.get("/api/v1/keys", project="acme/ml/nope")
    assert status == 404
    assert body["error"]["message"] == "there is no project 'acme/ml/nope' (projects: acme/ml/chat)"


async def test_a_revoked_key_is_listed_as_revoked_and_is_not_revoked_twice(access: Access) -> None:
    await access.tree(*ACME)
    _, prefix, _, created = await access.key(name="ci")
    out = await access.send("key.revoke", A.RevokeKey(key=prefix, reason="leaked in a log"))
    assert out.message == f"key {created.result['id']} (ci) revoked; routers refuse it within seconds"
    _, body, _ = await access.get("/api/v1/keys")
    [listed] = body["keys"]
    assert listed["state"] == "revoked" and listed["revoke_reason"] == "leaked in a log"
    assert listed["revoked_by"] == "user:test"
    with pytest.raises(CommandRejectedError) as caught:
        await access.send("key.revoke", A.RevokeKey(key=created.result["id"]))
    assert caught.value.code == "already_revoked" and "is already revoked" in caught.value.reason
    with pytest.raises(CommandRejectedError) as caught:
        await access.send("key.revoke", A.RevokeKey(key="key_doesnotexist"))
    assert "there is no key 'key_doesnotexist'" in caught.value.reason


async def test_a_key_for_a_project_that_does_not_exist_is_refused_naming_the_projects(access: Access) -> None:
    await access.tree(*ACME)
    with pytest.raises(CommandRejectedError) as caught:
        await access.key(project="acme/ml/chta")
    assert "there is no project 'acme/ml/chta' (projects: acme/ml/chat)" in caught.value.reason


# -- limits, prices, budgets -----------------------------------------------------------------------


async def test_limits_prices_and_budgets_are_set_and_listed_with_scope_paths(access_any_db: Access) -> None:
    access = access_any_db
    await access.tree(*ACME)
    _, prefix, _, created = await access.key(name="ci", rpm=100)
    key_id = created.result["id"]
    out = await access.send("limit.set", A.SetLimit(scope="team:acme/ml", rpm=600, tpm=100_000))
    assert out.message == "limits of team acme/ml set: 600 requests, 100000 tokens per minute"
    await access.send("limit.set", A.SetLimit(scope="org:acme", tpm=1_000_000))
    await access.send("limit.set", A.SetLimit(scope=f"key:{prefix}", rpm=5))
    await access.send("price.set", A.SetPrice(model="smollm2", input_usd_per_m=0.1, output_usd_per_m=0.25))
    await access.send("price.set", A.SetPrice(model="smollm2", input_usd_per_m=0.2, output_usd_per_m=0.5))
    await access.send("budget.set", A.SetBudget(scope="acme/ml/chat", usd=50.0, period="day"))

    _, body, _ = await access.get("/api/v1/limits")
    limits = {r["path"]: (r["rpm"], r["tpm"]) for r in body["limits"]}
    assert limits == {
        "org:acme": (None, 1_000_000),
        "team:acme/ml": (600, 100_000),
        f"key:{key_id} (ci)": (5, None),
    }
    assert all(r["scope"].split(":", 1)[1] not in ("acme", "acme/ml") for r in body["limits"]), "ids on the log"
    _, body, _ = await access.get("/api/v1/prices")
    assert [(p["model"], p["input_usd_per_m"], p["output_usd_per_m"]) for p in body["prices"]] == [
        ("smollm2", 0.2, 0.5)
    ]
    _, body, _ = await access.get("/api/v1/budgets")
    assert [(b["path"], b["usd"], b["period"]) for b in body["budgets"]] == [("project:acme/ml/chat", 50.0, "day")]
    _, body, _ = await access.get("/api/v1/keys")
    assert (body["keys"][0]["rpm"], body["keys"][0]["tpm"]) == (5, None), "the key's limits as last set"

    await access.send("limit.set", A.SetLimit(scope="org:acme"))
    await access.send("budget.set", A.SetBudget(scope="project:acme/ml/chat", usd=None))
    _, body, _ = await access.get("/api/v1/limits")
    assert "org:acme" not in {r["path"] for r in body["limits"]}
    _, body, _ = await access.get("/api/v1/budgets")
    assert body["budgets"] == []
    status, verified, _ = await access.post("/api/v1/projections/verify", name="access")
    assert status == 200 and verified["identical"], verified


async def test_scopes_keep_their_setting_across_a_rename_and_show_the_new_path(access: Access) -> None:
    await access.tree(*ACME)
    await access.send("budget.set", A.SetBudget(scope="team:acme/ml", usd=10.0))
    await access.send("rename", T.RenameScope(kind="team", path="acme/ml", name="ai"), service=T.SERVICE)
    _, body, _ = await access.get("/api/v1/budgets")
    assert [b["path"] for b in body["budgets"]] == ["team:acme/ai"]


async def test_unknown_and_ambiguous_scopes_are_refused_naming_what_exists(access: Access) -> None:
    await access.tree(*ACME, ("team", "acme/ops"))
    with pytest.raises(CommandRejectedError) as caught:
        await access.send("limit.set", A.SetLimit(scope="team:acme/research", rpm=5))
    assert caught.value.code == "not_found"
    assert "there is no team 'acme/research' (teams: acme/ml, acme/ops)" in caught.value.reason

    # An org and a key that answer to the same word: the bare word is ambiguous, a kind settles it.
    await access.tree(("org", "abcd1234"))
    _, _, digest = A.make_api_key()
    await access.send("key.create", A.CreateKey(project="acme/ml/chat", prefix="abcd1234", secret_sha256=digest))
    with pytest.raises(CommandRejectedError) as caught:
        await access.send("limit.set", A.SetLimit(scope="abcd1234", rpm=5))
    assert caught.value.code == "ambiguous"
    assert "scope 'abcd1234' is ambiguous: it names org abcd1234" in caught.value.reason
    assert "key key_" in caught.value.reason
    out = await access.send("limit.set", A.SetLimit(scope="org:abcd1234", rpm=5))
    assert out.message.startswith("limits of org abcd1234 set")


# -- keys and the tenancy tree ---------------------------------------------------------------------


async def test_a_project_with_live_keys_is_not_deleted_until_they_are_revoked(access: Access) -> None:
    await access.tree(*ACME)
    _, _, _, ci = await access.key(name="ci")
    _, _, _, web = await access.key(name="web")
    delete = T.DeleteScope(kind="project", path="acme/ml/chat")
    with pytest.raises(CommandRejectedError) as caught:
        await access.send("delete", delete, service=T.SERVICE)
    assert caught.value.code == "has_keys"
    assert "project acme/ml/chat still holds 2 keys (ci, web); revoke them first" in caught.value.reason
    for out in (ci, web):
        await access.send("key.revoke", A.RevokeKey(key=out.result["id"]))
    done = await access.send("delete", delete, service=T.SERVICE)
    assert done.message == "project acme/ml/chat deleted"


async def test_a_key_is_never_created_for_a_project_deleted_while_it_was_decided(
    access: Access, store: EventStore
) -> None:
    await access.tree(*ACME)
    racer = AccessService(store)
    try:
        await racer.catch_up()
        _, prefix, digest = A.make_api_key()
        create = A.CreateKey(project="acme/ml/chat", prefix=prefix, secret_sha256=digest)
        decision = decide(racer.state, create, utc_now())
        append = racer.shell.append_of(decision)  # fenced on the tree as read
        await access.send("delete", T.DeleteScope(kind="project", path="acme/ml/chat"), service=T.SERVICE)
        events = [NewEvent(payload=p, actor="user:test") for p in decision.payloads]
        with pytest.raises(AppendConflict):
            await racer.shell._append(append, events)
    finally:
        await racer.close()
    assert await store.read(f"{EVENTS_ROOT}.{A.KEY_AGGREGATE}.>") == []


# -- the demo key of `llmgw up` --------------------------------------------------------------------


async def test_the_demo_key_is_made_once_readable_by_its_owner_only(access: Access, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    written = await ensure_demo_key(access.store, data)
    assert written == data / DEMO_KEY_FILE
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600
    key = written.read_text().strip()
    [created] = await access.store.read(f"{EVENTS_ROOT}.{A.KEY_AGGREGATE}.>")
    assert created.payload.prefix == A.key_prefix(key)
    assert created.payload.secret_sha256 == A.hash_api_key(key)
    assert created.payload.name == "demo" and created.envelope.actor == "system:bootstrap"
    _, body, _ = await access.get("/api/v1/keys", project="default/default/default")
    assert [k["name"] for k in body["keys"]] == ["demo"]

    assert await ensure_demo_key(access.store, data) is None, "the second start keeps the key it has"
    assert written.read_text().strip() == key
    assert len(await access.store.read(f"{EVENTS_ROOT}.{A.KEY_AGGREGATE}.>")) == 1
    assert sorted(p.name for p in data.iterdir()) == [DEMO_KEY_FILE]


async def test_a_demo_key_recorded_before_a_crash_is_kept_not_made_twice(access: Access, tmp_path: Path) -> None:
    """The key was sent, and the process died before renaming the pending file."""
    data = tmp_path / "data"
    data.mkdir()
    await access.tree(("org", "default"), ("team", "default/default"), ("project", "default/default/default"))
    secret, prefix, digest = A.make_api_key()
    (data / f"{DEMO_KEY_FILE}.pending").write_text(secret + "\n")
    await access.send(
        "key.create", A.CreateKey(project="default/default/default", prefix=prefix, secret_sha256=digest, name="demo")
    )
    written = await ensure_demo_key(access.store, data)
    assert written is not None and written.read_text().strip() == secret
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600
    assert len(await access.store.read(f"{EVENTS_ROOT}.{A.KEY_AGGREGATE}.>")) == 1


# -- the CLI's expiry --------------------------------------------------------------------------------

NOW = datetime(2030, 1, 1, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("90m", NOW + timedelta(minutes=90)),
        ("12h", NOW + timedelta(hours=12)),
        ("30d", NOW + timedelta(days=30)),
        ("2w", NOW + timedelta(weeks=2)),
        ("2030-02-01", datetime(2030, 2, 1, tzinfo=UTC)),
        ("2030-02-01T08:30Z", datetime(2030, 2, 1, 8, 30, tzinfo=UTC)),
        ("2030-02-01T08:30+02:00", datetime(2030, 2, 1, 6, 30, tzinfo=UTC)),
    ],
)
def test_an_expiry_is_a_duration_from_now_or_a_date_in_utc_unless_zoned(text: str, expected: datetime) -> None:
    assert parse_expiry(text, NOW) == expected


def test_an_expiry_that_is_neither_says_what_would_do() -> None:
    with pytest.raises(click.BadParameter) as caught:
        parse_expiry("next tuesday", NOW)
    assert "neither a duration (90m, 12h, 30d, 2w) nor a date" in str(caught.value)


async def test_the_access_projection_follows_the_log_a_moment_after_each_command(access: Access) -> None:
    """Reads are consistent: a list right after a command shows it (no waiting in the caller)."""
    await access.tree(*ACME)
    for i in range(5):
        await access.key(name=f"k{i}")
        _, body, _ = await access.get("/api/v1/keys")
        assert len(body["keys"]) == i + 1
