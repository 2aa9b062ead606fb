"""People and passwords (SPEC TEN-1, TEN-3): users, argon2id, the login throttle, session and personal
tokens, the first administrator of `llmgw up`, and the CLI that manages them."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import msgspec
import pytest

from llmgw.events.commands.auth import TokenSigner
from llmgw.events.commands.client import CommandClient
from llmgw.events.commands.errors import CommandRejectedError
from llmgw.events.folds.people import People, PeopleAndTree
from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import people as P
from llmgw.events.schema.envelope import Envelope, RecordedEvent
from llmgw.events.schema.outcomes import Rejected
from llmgw.events.schema.subjects import event_subject
from llmgw.services.api.signin import identify
from llmgw.services.people import rules
from llmgw.services.people.bootstrap import PASSWORD_FILE, TOKEN_FILE, ensure_admin
from llmgw.services.people.passwords import PasswordChecker, hash_password, password_problem, verify_now
from llmgw.services.people.throttle import LoginThrottle
from tests.fleet import Fleet
from tests.support import NatsServer, free_port, wait_until

LLMGW = str(Path(sys.executable).parent / "llmgw")
NOW = datetime(2026, 12, 1, 12, tzinfo=UTC)
HASH = hash_password("correct horse battery staple")


def recorded(seq: int, payload: object, name: str = "ann") -> RecordedEvent:
    envelope = Envelope(id=f"e{seq}", type="x", at=NOW, actor="user:test")
    return RecordedEvent(envelope=envelope, payload=payload, subject=event_subject(P.AGGREGATE, name), seq=seq)


def folded(*payloads: object) -> People:
    people = People()
    for i, p in enumerate(payloads, 1):
        people.apply(recorded(i, p, getattr(p, "name", "ann")))
    return people


# -- pure: rules and the fold ---------------------------------------------------------------------


def test_a_person_is_added_with_an_argon2id_hash_and_never_twice() -> None:
    d = rules.decide(PeopleAndTree(), P.AddUser(name="ann", password_hash=HASH), NOW)
    assert [type(p) for p in d.payloads] == [P.UserAdded, P.PasswordSet]
    assert d.subject == event_subject(P.AGGREGATE, "ann")  # a new aggregate: the shell expects it empty
    with pytest.raises(Rejected, match="user ann exists"):
        rules.decide(PeopleAndTree(folded(*d.payloads)), P.AddUser(name="ann", password_hash=HASH), NOW)


@pytest.mark.parametrize(
    "password_hash",
    [
        "hunter2",  # a password, not a hash
        "$argon2i$v=19$m=65536,t=3,p=4$c2FsdHNhbHQ$aGFzaGhhc2g",  # argon2i, not argon2id
        "$argon2id$v=19$m=1024,t=1,p=1$c2FsdHNhbHQ$aGFzaGhhc2g",  # too weak to hold
    ],
)
def test_anything_but_a_strong_argon2id_hash_is_refused(password_hash: str) -> None:
    with pytest.raises(Rejected, match="argon2id hash") as refused:
        rules.decide(PeopleAndTree(), P.AddUser(name="ann", password_hash=password_hash), NOW)
    assert refused.value.code == "invalid_password_hash"


def test_user_names_are_plain() -> None:
    for bad in ("Ann", "1ann", "ann smith", "a" * 64, ""):
        with pytest.raises(Rejected, match="is not a user name"):
            rules.decide(PeopleAndTree(), P.AddUser(name=bad, password_hash=HASH), NOW)


def test_a_disabled_persons_token_stops_working_and_a_revoked_one_is_forgotten() -> None:
    token, prefix, digest = P.make_token("personal")
    people = folded(
        P.UserAdded(name="ann"),
        P.PasswordSet(name="ann", password_hash=HASH),
        P.TokenIssued(name="ann", token_id="t1", prefix=prefix, secret_sha256=digest, kind="personal"),
    )
    who = identify(people, f"Bearer {token}", NOW)
    assert not isinstance(who, Exception) and who.actor == "user:ann"
    people.apply(recorded(4, P.UserDisabled(name="ann", reason="left")))
    refused = identify(people, f"Bearer {token}", NOW)
    assert isinstance(refused, Exception) and refused.status == 403 and "ann is disabled (left)" in refused.message
    people.apply(recorded(5, P.UserEnabled(name="ann")))
    people.apply(recorded(6, P.TokenRevoked(name="ann", token_id="t1")))
    gone = identify(people, f"Bearer {token}", NOW)
    assert isinstance(gone, Exception) and gone.status == 401 and prefix not in people.by_prefix


def test_a_token_is_refused_when_expired_altered_or_missing() -> None:
    token, prefix, digest = P.make_token("session")
    people = folded(
        P.UserAdded(name="ann"),
        P.TokenIssued(
            name="ann",
            token_id="t1",
            prefix=prefix,
            secret_sha256=digest,
            kind="session",
            expires_at=NOW + timedelta(hours=1),
        ),
    )
    assert not isinstance(identify(people, f"Bearer {token}", NOW), Exception)
    later = identify(people, f"Bearer {token}", NOW + timedelta(hours=2))
    assert isinstance(later, Exception) and later.code == "expired_credential"
    altered = identify(people, f"Bearer {token[:-2]}xx", NOW)
    assert isinstance(altered, Exception) and altered.code == "invalid_credential"
    missing = identify(people, "", NOW)
    assert isinstance(missing, Exception) and missing.status == 401 and "llmgw login" in missing.message


def test_a_token_prefix_is_never_issued_twice() -> None:
    _, prefix, digest = P.make_token("personal")
    people = folded(
        P.UserAdded(name="ann"),
        P.TokenIssued(name="ann", token_id="t1", prefix=prefix, secret_sha256=digest, kind="personal"),
    )
    with pytest.raises(Rejected, match=f"token prefix {prefix} is taken"):
        rules.decide(PeopleAndTree(people), P.IssueToken(name="ann", prefix=prefix, secret_sha256=digest), NOW)


# -- passwords and the throttle -----------------------------------------------------------------


def test_a_password_is_checked_against_its_hash_and_an_unknown_name_is_checked_all_the_same() -> None:
    assert verify_now(HASH, "correct horse battery staple")
    assert not verify_now(HASH, "correct horse battery stapler")
    assert not verify_now(None, "correct horse battery staple")
    assert password_problem("short") is not None and password_problem("a long enough passphrase") is None


async def test_password_checks_run_at_most_the_bound_at_a_time() -> None:
    checker = PasswordChecker(concurrent=2)
    results = await asyncio.gather(*(checker.verify(HASH, "wrong password!") for _ in range(6)))
    assert results == [False] * 6
    assert checker.most_running == 2


def test_an_address_that_keeps_failing_is_blocked_for_longer_each_time() -> None:
    t = LoginThrottle(failures=3, window_s=60, block_s=10, max_block_s=40)
    now = 1000.0
    for _ in range(3):
        assert t.check("10.0.0.1", now).allowed
        t.failed("10.0.0.1", now)
    blocked = t.check("10.0.0.1", now)
    assert not blocked.allowed and blocked.retry_after_s == 11 and "10.0.0.1" in blocked.reason
    assert t.check("10.0.0.2", now).allowed, "another address is not affected"
    now += 11
    for _ in range(3):
        t.failed("10.0.0.1", now)
    assert t.check("10.0.0.1", now).retry_after_s == 21  # twice as long


def test_logins_still_being_checked_count_toward_the_limit_so_a_burst_from_one_address_is_cut_short() -> None:
    t = LoginThrottle(failures=5, window_s=300, block_s=60)
    now = 1000.0
    let_through = [t.begin("10.0.0.9", now) for _ in range(100)]  # 100 at once, none answered yet
    assert sum(v.allowed for v in let_through) == 5
    refused = next(v for v in let_through if not v.allowed)
    assert refused.retry_after_s == 1 and "5 logins from 10.0.0.9 are being checked already" in refused.reason
    assert t.begin("10.0.0.10", now).allowed, "another address is not affected"
    for _ in range(5):  # the five fail: the address is blocked, with nothing in flight left over
        t.end("10.0.0.9")
        t.failed("10.0.0.9", now)
    assert "10.0.0.9" not in t.in_flight
    assert not t.begin("10.0.0.9", now).allowed and "too many failed logins" in t.check("10.0.0.9", now).reason
    t.end("10.0.0.10")
    assert t.in_flight == {}


def test_ten_thousand_failing_addresses_never_wash_out_a_blocked_one() -> None:
    t = LoginThrottle(failures=3, window_s=300, block_s=600, capacity=1000)
    now = 0.0
    for _ in range(3):
        t.failed("attacker", now)
    assert not t.check("attacker", now).allowed
    refused_new = 0
    for i in range(10_000):
        now += 0.01
        address = f"10.{i // 65536}.{i // 256 % 256}.{i % 256}"
        if t.check(address, now).allowed:
            t.failed(address, now)
        else:
            refused_new += 1
    assert len(t.entries) <= 1000, "the table stays within its capacity"
    assert not t.check("attacker", now).allowed, "the blocked address is still blocked"
    assert refused_new > 0, "once full of live entries, new addresses are refused, not let in by evicting"
    # When their windows pass, the stale entries make room again.
    assert t.check("newcomer", now + 301).allowed


# -- end to end: the people service, the admin API, the first administrator ----------------------


@pytest.fixture
async def fleet(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=("people", "projections", "api"))
    yield f
    await f.stop()


async def call(fleet: Fleet, method: str, path: str, token: str | None = None, **kw) -> tuple[int, dict]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, f"http://127.0.0.1:{fleet.admin_port}{path}", headers=headers, **kw) as r,
    ):
        return r.status, await r.json()


async def test_the_first_administrator_signs_in_with_the_password_written_once(fleet: Fleet, tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    assert await ensure_admin(fleet.store, data)
    assert not await ensure_admin(fleet.store, data), "made once"
    for name in (PASSWORD_FILE, TOKEN_FILE):
        assert stat.S_IMODE(os.stat(data / name).st_mode) == 0o600
    password = (data / PASSWORD_FILE).read_text().strip()
    admin_token = (data / TOKEN_FILE).read_text().strip()

    async def known() -> bool:
        return (await call(fleet, "GET", "/api/v1/whoami", admin_token))[0] == 200

    await wait_until(known, what="the admin token to be folded by the API")
    status, me = await call(fleet, "GET", "/api/v1/whoami", admin_token)
    assert me["user"] == "admin" and me["token"] == "personal"

    status, got = await call(fleet, "POST", "/api/v1/login", json={"user": "admin", "password": password})
    assert status == 200, got
    status, me = await call(fleet, "GET", "/api/v1/whoami", got["token"])
    assert status == 200 and me == {"user": "admin", "token": "session", "token_id": me["token_id"]}

    # The log knows who signed in, and holds neither the password nor a token.
    events = await fleet.store.read(event_subject(P.AGGREGATE, "admin"))
    issued = [e for e in events if isinstance(e.payload, P.TokenIssued)]
    assert [e.envelope.actor for e in issued] == ["system:bootstrap", "user:admin"]
    raw = b"".join(str(e.payload).encode() for e in events)
    assert password.encode() not in raw and admin_token.encode() not in raw and got["token"].encode() not in raw


async def test_a_wrong_password_is_refused_the_same_as_an_unknown_name_and_then_throttled(fleet: Fleet) -> None:
    await fleet.client.send(P.SERVICE, "user.add", P.AddUser(name="bob", password_hash=HASH), actor="user:test")
    answers = []
    for who in ("bob", "nobody", "bob", "bob", "bob"):
        answers.append(await call(fleet, "POST", "/api/v1/login", json={"user": who, "password": "wrong wrong wrong"}))
    assert all(status == 401 for status, _ in answers)
    assert {body["error"]["message"] for _, body in answers} == {"the user name or the password is wrong"}
    status, body = await call(
        fleet, "POST", "/api/v1/login", json={"user": "bob", "password": "correct horse battery staple"}
    )
    assert status == 429 and "too many failed logins" in body["error"]["message"]


async def test_a_disabled_person_is_refused_at_once_and_can_be_let_back(fleet: Fleet) -> None:
    await fleet.client.send(P.SERVICE, "user.add", P.AddUser(name="cy", password_hash=HASH), actor="user:test")
    status, got = await call(
        fleet, "POST", "/api/v1/login", json={"user": "cy", "password": "correct horse battery staple"}
    )
    assert status == 200, got
    await fleet.client.send(P.SERVICE, "user.disable", P.DisableUser(name="cy", reason="on leave"), actor="user:test")

    async def refused() -> bool:
        return (await call(fleet, "GET", "/api/v1/whoami", got["token"]))[0] == 403

    await wait_until(refused, what="the disabled person's session to be refused")
    status, body = await call(fleet, "GET", "/api/v1/users", got["token"])
    assert status == 403 and "cy is disabled (on leave)" in body["error"]["message"]
    await fleet.client.send(P.SERVICE, "user.enable", P.EnableUser(name="cy"), actor="user:test")

    async def back() -> bool:
        return (await call(fleet, "GET", "/api/v1/whoami", got["token"]))[0] == 200

    await wait_until(back, what="the enabled person's session to work again")


async def test_the_cli_adds_a_person_who_logs_in_and_out(fleet: Fleet, nats: NatsServer, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "LLMGW_NATS_URL": nats.url,
        "LLMGW_API_URL": f"http://127.0.0.1:{fleet.admin_port}",
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
    }
    env.pop("LLMGW_TOKEN", None)

    admin_env = {**env, "LLMGW_TOKEN": fleet.admin_token}

    async def cli(*args: str, stdin: str = "", as_admin: bool = False) -> subprocess.CompletedProcess[str]:
        # In a thread: the services answering the CLI run on this test's event loop.
        return await asyncio.to_thread(
            subprocess.run,
            [LLMGW, *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=admin_env if as_admin else env,
            timeout=60,
        )

    nobody = await cli("ctl", "user", "add", "dee", "--password-stdin", stdin="a long enough passphrase\n")
    assert nobody.returncode != 0 and "sign in first" in nobody.stderr
    weak = await cli("ctl", "user", "add", "dee", "--password-stdin", stdin="short\n", as_admin=True)
    assert weak.returncode != 0 and "at least 12 characters" in weak.stderr
    pw = "a long enough passphrase\n"
    added = await cli("ctl", "user", "add", "dee", "--password-stdin", stdin=pw, as_admin=True)
    assert added.returncode == 0, added.stderr
    again = await cli("ctl", "user", "add", "dee", "--password-stdin", stdin=pw, as_admin=True)
    assert again.returncode == 2 and "user dee exists" in again.stderr

    login = await cli("login", "--user", "dee", "--password-stdin", stdin="a long enough passphrase\n")
    assert login.returncode == 0 and "signed in as dee" in login.stdout, login.stderr
    saved = tmp_path / "config" / "llmgw" / "credentials.json"
    assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600
    refused = await cli("ctl", "user", "list")
    assert refused.returncode != 0 and "needs viewer of the cluster; dee holds no role" in refused.stderr
    own = await cli("ctl", "user", "grant", "dee", "viewer", "cluster")
    assert own.returncode == 2 and "granting viewer of cluster needs cluster-admin of the cluster" in own.stderr
    granted = await cli("ctl", "user", "grant", "dee", "viewer", "cluster", as_admin=True)
    assert granted.returncode == 0 and "dee is viewer of the cluster" in granted.stdout, granted.stderr

    async def listed() -> subprocess.CompletedProcess[str] | None:
        done = await cli("ctl", "user", "list", "--json")
        return done if done.returncode == 0 else None

    shown = await wait_until(listed, what="dee's new role to let them list people")
    assert "dee" in shown.stdout and "$argon2id" not in shown.stdout and "secret" not in shown.stdout

    out = await cli("logout")
    assert out.returncode == 0 and "signed out" in out.stdout, out.stderr
    after = await cli("ctl", "user", "list")
    assert after.returncode != 0 and "sign in first" in after.stderr


async def test_every_admin_endpoint_but_the_login_refuses_a_call_without_a_valid_token(fleet: Fleet) -> None:
    from prometheus_client import CollectorRegistry

    from llmgw.services.api.app import OPEN_PATHS, AdminApi
    from llmgw.services.identity.sso import OPEN_PREFIX as SSO_OPEN_PREFIX

    app = AdminApi(fleet.store, None, None, CollectorRegistry()).app()  # type: ignore[arg-type]
    routes = sorted(
        {
            (r.method, r.resource.canonical.replace("{id}", "x").replace("{name}", "x"))
            for r in app.router.routes()
            if r.resource is not None and r.resource.canonical.startswith("/api/v1/") and r.method != "HEAD"
        }
    )
    assert len(routes) > 20 and ("POST", "/api/v1/login") in routes
    forged = P.make_token("personal")[0]  # well formed, never issued
    for method, path in routes:
        if path in OPEN_PATHS:  # the login, and the OpenAPI document (it holds no data)
            continue
        if path.startswith(SSO_OPEN_PREFIX):  # the device sign-in's calls: made before anyone holds a token
            continue
        for token in (None, forged):
            status, body = await call(fleet, method, path, token)
            assert status == 401, (method, path, status, body)
            assert body["error"]["code"] in ("missing_credential", "invalid_credential")
    # Health and metrics stay open (probes and Prometheus).
    assert (await call(fleet, "GET", "/healthz"))[0] == 200


# -- roles ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bindings", "need", "chain", "allowed"),
    [
        ([("viewer", "org:o")], "viewer", ["project:p", "team:t", "org:o", "cluster"], True),  # covers what is under
        ([("member", "project:p")], "viewer", ["team:t", "org:o", "cluster"], False),  # not what is above
        ([("member", "project:p")], "member", ["project:p", "team:t", "org:o", "cluster"], True),
        ([("viewer", "project:p")], "member", ["project:p", "team:t", "org:o", "cluster"], False),  # too low
        ([("team-admin", "team:t")], "member", ["project:p", "team:t", "org:o", "cluster"], True),  # higher includes
        ([("org-admin", "org:o2")], "viewer", ["project:p", "team:t", "org:o", "cluster"], False),  # another org
        ([("cluster-admin", "cluster")], "cluster-admin", ["cluster"], True),
        ([("viewer", "cluster")], "cluster-admin", ["cluster"], False),
        ([], "viewer", ["cluster"], False),
    ],
)
def test_a_role_covers_its_scope_and_what_is_under_it_and_includes_lower_roles(
    bindings: list[tuple[str, str]], need: str, chain: list[str], allowed: bool
) -> None:
    from llmgw.events.commands import roles as R

    assert R.allows(bindings, need, chain) is allowed


def test_a_role_is_granted_over_a_scope_by_path_and_kept_by_id() -> None:
    from llmgw.events.folds.tenancy import TenancyTree
    from llmgw.events.schema import tenancy as T
    from llmgw.events.schema.subjects import event_subject as subject

    tree = TenancyTree()
    for seq, p in enumerate(
        [T.OrgCreated(org_id="o1", name="acme"), T.TeamCreated(team_id="t1", org_id="o1", name="ml")], 1
    ):
        env = Envelope(id=f"t{seq}", type="x", at=NOW, actor="user:test")
        tree.apply(RecordedEvent(envelope=env, payload=p, subject=subject(T.AGGREGATE, T.TREE_ID), seq=seq))
    state = PeopleAndTree(folded(P.UserAdded(name="ann")), tree)
    d = rules.decide(state, P.GrantRole(name="ann", role="team-admin", scope="team:acme/ml"), NOW)
    assert d.payloads == [P.RoleGranted(name="ann", role="team-admin", scope="team:t1")]
    assert d.message == "ann is team-admin of team:acme/ml"
    with pytest.raises(Rejected, match="org-admin is bound to a org, not 'team:acme/ml'"):
        rules.decide(state, P.GrantRole(name="ann", role="org-admin", scope="team:acme/ml"), NOW)
    with pytest.raises(Rejected, match="there is no role 'owner'"):
        rules.decide(state, P.GrantRole(name="ann", role="owner", scope="cluster"), NOW)
    with pytest.raises(Rejected, match="there is no team 'acme/nope'"):
        rules.decide(state, P.GrantRole(name="ann", role="team-admin", scope="team:acme/nope"), NOW)


@pytest.fixture
async def tenants(store: EventStore, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    from llmgw.events.schema import tenancy as T

    f = await Fleet(store, nats.url, tmp_path).start(services=("tenancy", "people", "projections", "api"))
    for kind, path in (("org", "acme"), ("team", "acme/ml"), ("project", "acme/ml/chat"), ("project", "acme/ml/rag")):
        await f.command("create", T.CreateScope(kind=kind, path=path), service=T.SERVICE)
    yield f
    await f.stop()


async def person_with(fleet: Fleet, name: str, *roles: tuple[str, str]) -> str:
    """A person holding ``roles`` (role, scope), signed in: their session token."""
    await fleet.client.send(P.SERVICE, "user.add", P.AddUser(name=name, password_hash=HASH), actor="user:test")
    for role, scope in roles:
        grant = P.GrantRole(name=name, role=role, scope=scope)
        await fleet.client.send(P.SERVICE, "role.grant", grant, actor="user:test")
    status, got = await call(
        fleet, "POST", "/api/v1/login", json={"user": name, "password": "correct horse battery staple"}
    )
    assert status == 200, got

    async def holds_them() -> bool:
        status, people = await call(fleet, "GET", "/api/v1/users", fleet.admin_token)
        person = next((p for p in people if p["name"] == name), None) if status == 200 else None
        return person is not None and len(person["roles"]) == len(roles)

    await wait_until(holds_them, what=f"the admin API to know {name}'s roles")
    return got["token"]


async def test_a_viewer_may_look_but_not_change_and_the_refusal_names_the_role_needed(tenants: Fleet) -> None:
    token = await person_with(tenants, "vic", ("viewer", "cluster"))
    for path in ("/api/v1/nodes", "/api/v1/models", "/api/v1/tree", "/api/v1/keys", "/api/v1/users"):
        status, body = await call(tenants, "GET", path, token)
        assert status == 200, (path, body)
    for path in ("/api/v1/projections/rebuild", "/api/v1/projections/verify"):
        status, body = await call(tenants, "POST", path, token)
        assert status == 403, (path, body)
        assert body["error"]["message"] == (
            f"POST {path} needs cluster-admin of the cluster; vic holds viewer of the cluster"
        )


async def test_a_project_member_sees_their_projects_keys_and_nothing_wider(tenants: Fleet) -> None:
    token = await person_with(tenants, "mo", ("member", "project:acme/ml/chat"))
    status, body = await call(tenants, "GET", "/api/v1/keys?project=acme/ml/chat", token)
    assert status == 200, body
    status, body = await call(tenants, "GET", "/api/v1/keys?project=acme/ml/rag", token)
    assert status == 403
    assert body["error"]["message"] == (
        "GET /api/v1/keys needs viewer of project:acme/ml/rag; mo holds member of project:acme/ml/chat"
    )
    status, body = await call(tenants, "GET", "/api/v1/nodes", token)
    assert status == 403 and "needs viewer of the cluster" in body["error"]["message"]
    # A team's viewer sees every project of the team.
    team = await person_with(tenants, "tess", ("viewer", "team:acme/ml"))
    for project in ("acme/ml/chat", "acme/ml/rag"):
        assert (await call(tenants, "GET", f"/api/v1/keys?project={project}", team))[0] == 200


async def test_an_admin_token_from_before_signed_commands_is_renewed_at_start_and_then_signs(
    fleet: Fleet, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    old, issue = P.issue("admin", "personal", label="this machine's CLI")
    unsigned = msgspec.structs.replace(issue, signing_key="")  # as issued before commands were signed
    await fleet.client.send(P.SERVICE, "user.add", P.AddUser(name="admin", password_hash=HASH), actor="system:tests")
    await fleet.client.send(
        P.SERVICE, "role.grant", P.GrantRole(name="admin", role="cluster-admin", scope="cluster"), actor="system:tests"
    )
    await fleet.client.send(P.SERVICE, "token.issue", unsigned, actor="system:tests")
    (data / TOKEN_FILE).write_text(old + "\n")
    with pytest.raises(CommandRejectedError) as caught:
        await CommandClient(fleet.store, TokenSigner(old)).send(
            P.SERVICE, "user.add", P.AddUser(name="x", password_hash=HASH), actor=""
        )
    assert "issued before commands were signed" in caught.value.reason

    assert not await ensure_admin(fleet.store, data)
    renewed = (data / TOKEN_FILE).read_text().strip()
    assert renewed != old and stat.S_IMODE(os.stat(data / TOKEN_FILE).st_mode) == 0o600
    out = await CommandClient(fleet.store, TokenSigner(renewed)).send(
        P.SERVICE, "user.add", P.AddUser(name="x", password_hash=HASH), actor=""
    )
    assert out.requested_by == "user:admin"
    assert (await call(fleet, "GET", "/api/v1/whoami", old))[0] == 401, "the old token is revoked"


async def test_a_cluster_server_makes_its_first_administrator_where_it_is_told(
    store: EventStore, nats: NatsServer, tmp_path: Path
) -> None:
    from llmgw.cli.runtime import serve
    from llmgw.cli.server_config import ServerConfig

    admin_dir = tmp_path / "etc" / "first-admin"  # not there yet: the server makes it
    config = ServerConfig(
        nats_url=nats.url,
        db_dsn=f"sqlite:///{tmp_path / 'projections.db'}",
        services=("people",),
        admin_port=free_port(),
        first_admin_dir=str(admin_dir),
    )
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(serve(config, stop, on_ready=ready.set))
    try:
        await asyncio.wait_for(ready.wait(), 30)
        token = (await wait_until(lambda: _read(admin_dir / TOKEN_FILE), what="the admin token")).strip()
        assert stat.S_IMODE(os.stat(admin_dir / PASSWORD_FILE).st_mode) == 0o600
        out = await CommandClient(store, TokenSigner(token)).send(
            P.SERVICE, "user.add", P.AddUser(name="ops", password_hash=HASH), actor=""
        )
        assert out.requested_by == "user:admin"
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def _read(path: Path) -> str | None:
    return path.read_text() if path.exists() else None
