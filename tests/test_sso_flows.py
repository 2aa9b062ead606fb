"""Signing in through an OpenID provider over HTTP (services/identity/sso.py): the console's code flow and
the CLI's device flow, through the admin API on a real bus, against a real provider (tests/idp) whose
own login page is walked over plain HTTP (the browser's walk is tests/browser/test_sso.py)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

import aiohttp
import msgspec
import pytest

from llmgw.events.runtime.store import EventStore
from llmgw.events.schema import identity as I
from llmgw.events.schema import people as P
from llmgw.events.schema.subjects import event_subject
from llmgw.services.console import session as SES
from llmgw.services.identity.oidc import DeviceStart
from llmgw.services.identity.sso import PER_ADDRESS, PendingDevices, Sso
from tests.fleet import Fleet
from tests.idp.harness import (
    USERS,
    Client,
    Idp,
    cancel_over_http,
    confirm_device_over_http,
    sign_in_over_http,
    unavailable_reason,
)
from tests.support import NatsServer, wait_until

CLIENT_ID = "llmgw-console"
SECRET = "the-test-providers-client-secret-0123456789abcdef"
SECRET_ENV = "LLMGW_TEST_CORP_CLIENT_SECRET"
LLMGW = str(Path(sys.executable).with_name("llmgw"))


class World(msgspec.Struct):
    fleet: Fleet
    idp: Idp

    @property
    def url(self) -> str:
        return self.fleet.admin_url

    @property
    def callback(self) -> str:
        return f"{self.url}/console/sso/corp/callback"


async def setup_provider(fleet: Fleet, issuer: str) -> None:
    """The provider and its group mappings, as `llmgw ctl sso add` and `… map` send them."""
    settings = I.OidcSettings(issuer=issuer, client_id=CLIENT_ID, client_secret_env=SECRET_ENV)
    await fleet.client.send(
        I.SERVICE, "idp.set", I.SetProvider(name="corp", kind="oidc", oidc=settings), actor="user:tester"
    )
    for group, role in (("ml-admins", "cluster-admin"), ("everyone", "viewer")):
        await fleet.client.send(
            I.SERVICE,
            "idp.map",
            I.MapGroup(provider="corp", group=group, role=role, scope="cluster"),
            actor="user:tester",
        )


@pytest.fixture
async def world(
    store: EventStore, nats: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[World]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    monkeypatch.setenv(SECRET_ENV, SECRET)  # the admin API runs in this process and reads it at sign-in
    fleet = await Fleet(store, nats.url, tmp_path).start(services=("people", "identity", "projections", "api"))
    idp = Idp([Client(CLIENT_ID, SECRET, [f"{fleet.admin_url}/console/sso/corp/callback"])], device_interval_s=1)
    try:
        idp.start()
        await setup_provider(fleet, idp.issuer)

        async def knows_provider() -> bool:
            async with (
                aiohttp.ClientSession() as s,
                s.get(f"{fleet.admin_url}/console/sso/corp", allow_redirects=False) as r,
            ):
                return r.status == 303

        await wait_until(knows_provider, what="the admin API to know the provider corp")
        yield World(fleet, idp)
    finally:
        idp.stop()
        await fleet.stop()


def browser() -> aiohttp.ClientSession:
    """A person's browser: keeps cookies (on an IP address too), follows nothing by itself."""
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


async def console_sign_in(
    world: World, b: aiohttp.ClientSession, login: str, next_path: str = "/console"
) -> aiohttp.ClientResponse:
    """From the console's SSO link through the provider's login page to the callback's answer."""
    async with b.get(f"{world.url}/console/sso/corp?{urlencode({'next': next_path})}", allow_redirects=False) as r:
        assert r.status == 303, await r.text()
        to_provider = r.headers["Location"]
    back = await sign_in_over_http(b, to_provider, login, USERS[login]["password"], stop_at=world.callback)
    r = await b.get(back, allow_redirects=False)
    await r.read()
    return r


def session_cookie(b: aiohttp.ClientSession) -> str:
    return next((c.value for c in b.cookie_jar if c.key == SES.COOKIE), "")


async def whoami(world: World, token: str) -> dict:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{world.url}/api/v1/whoami", headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        assert r.status == 200, await r.text()
        return await r.json()


async def test_a_person_signed_in_at_the_provider_lands_on_the_console_page_they_asked_for_with_their_mapped_roles(
    world: World,
) -> None:
    async with browser() as b:
        r = await console_sign_in(world, b, "alice", "/console/usage?window=7d")
        assert r.status == 200
        page = await r.text()
        assert "url=/console/usage?window=7d" in page  # moves on from this site: the Strict cookie goes along
        token = session_cookie(b)
        assert token.startswith("llmgw-ses-")
        async with b.get(f"{world.url}/console/usage?window=7d", allow_redirects=False) as shown:
            assert shown.status == 200  # signed in: not sent to the sign-in page
    assert (await whoami(world, token))["user"] == "alice"
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{world.url}/api/v1/users", headers={"Authorization": f"Bearer {token}"}) as r,
    ):
        alice = next(p for p in await r.json() if p["name"] == "alice")
    assert alice["source"] == "idp:corp"
    assert [(g["role"], g["via"]["group"]) for g in alice["roles"]] == [("cluster-admin", "ml-admins")]
    events = await world.fleet.store.read(event_subject(P.AGGREGATE, "alice"))
    issued = [e for e in events if isinstance(e.payload, P.TokenIssued)]
    assert issued[-1].payload.method == "oidc:corp"
    assert any(isinstance(e.payload, P.RoleGranted) and e.envelope.actor == "idp:corp" for e in events)


async def test_a_callback_with_a_state_this_server_never_sent_is_refused(world: World) -> None:
    async with browser() as b:
        async with b.get(f"{world.url}/console/sso/corp", allow_redirects=False) as r:
            to_provider = r.headers["Location"]
        back = await sign_in_over_http(b, to_provider, "alice", USERS["alice"]["password"], stop_at=world.callback)
        code = parse_qs(urlsplit(back).query)["code"][0]
        forged = f"{world.callback}?{urlencode({'code': code, 'state': 'a-state-of-the-attackers'})}"
        async with b.get(forged, allow_redirects=False) as r:
            assert r.status == 400
            assert "this sign-in&#39;s state is unknown, expired or already used" in await r.text()
        assert session_cookie(b) == ""


async def test_a_callback_replayed_after_it_signed_someone_in_is_refused(world: World) -> None:
    async with browser() as b:
        async with b.get(f"{world.url}/console/sso/corp", allow_redirects=False) as r:
            to_provider = r.headers["Location"]
        back = await sign_in_over_http(b, to_provider, "bob", USERS["bob"]["password"], stop_at=world.callback)
        async with b.get(back, allow_redirects=False) as r:
            assert r.status == 200
    async with browser() as other, other.get(back, allow_redirects=False) as r:
        assert r.status == 400
        assert "already used" in await r.text()


async def test_a_callback_link_made_in_another_browser_does_not_sign_this_one_in(world: World) -> None:
    async with browser() as attacker:
        async with attacker.get(f"{world.url}/console/sso/corp", allow_redirects=False) as r:
            to_provider = r.headers["Location"]
        link = await sign_in_over_http(attacker, to_provider, "bob", USERS["bob"]["password"], stop_at=world.callback)
    async with browser() as victim:
        async with victim.get(f"{world.url}/console/sso/corp", allow_redirects=False):
            pass  # the victim's browser has a sign-in of its own under way
        async with victim.get(link, allow_redirects=False) as r:
            assert r.status == 400
            assert "this sign-in was started in another browser" in await r.text()
        assert session_cookie(victim) == ""


async def test_a_next_that_points_at_another_host_lands_on_the_console(world: World) -> None:
    async with browser() as b:
        for target in ("https://evil.example.org/console", "//evil.example.org/console"):
            r = await console_sign_in(world, b, "bob", target)
            page = await r.text()
            assert r.status == 200
            assert re.search(r"url=/console'", page), page
            assert "evil" not in page


async def test_a_person_in_no_mapped_group_is_told_so_and_gets_no_session(world: World) -> None:
    async with browser() as b:
        r = await console_sign_in(world, b, "carol")
        assert r.status == 403
        page = await r.text()
        # carol is in no group at all: she is told which groups an administrator could add her to
        assert "carol is in no group at corp: ask its administrators to add them to one of everyone, ml-admins" in page
        assert session_cookie(b) == ""


async def test_a_sign_in_cancelled_at_the_provider_says_so(world: World) -> None:
    async with browser() as b:
        async with b.get(f"{world.url}/console/sso/corp", allow_redirects=False) as r:
            to_provider = r.headers["Location"]
        back = await cancel_over_http(b, to_provider, stop_at=world.callback)
        async with b.get(back, allow_redirects=False) as r:
            assert r.status == 403
            assert "the identity provider corp did not sign you in (access_denied" in await r.text()
        assert session_cookie(b) == ""


async def test_an_unknown_provider_is_named_with_those_there_are(world: World) -> None:
    async with browser() as b, b.get(f"{world.url}/console/sso/nope", allow_redirects=False) as r:
        assert r.status == 404
        assert "OpenID providers: corp" in await r.text()


async def test_the_device_flow_through_the_api_is_pending_until_the_person_confirms_at_the_provider(
    world: World,
) -> None:
    async with aiohttp.ClientSession() as api:
        async with api.post(f"{world.url}/api/v1/login/sso/corp/device") as r:
            assert r.status == 200
            started = await r.json()
        assert set(started) == {
            "handle",
            "user_code",
            "verification_uri",
            "verification_uri_complete",
            "interval",
            "expires_in",
        }
        assert started["interval"] == 1
        poll = f"{world.url}/api/v1/login/sso/device/poll"
        async with api.post(poll, json={"handle": started["handle"]}) as r:
            assert r.status == 202 and (await r.json())["status"] == "pending"
        async with browser() as b:
            await confirm_device_over_http(b, started["verification_uri_complete"], "alice", USERS["alice"]["password"])

        async def done() -> dict | None:
            async with api.post(poll, json={"handle": started["handle"]}) as r:
                return await r.json() if r.status == 200 else None

        got = await wait_until(done, what="the device sign-in to finish")
    assert got["user"] == "alice"
    assert (await whoami(world, got["token"]))["user"] == "alice"
    events = await world.fleet.store.read(event_subject(P.AGGREGATE, "alice"))
    assert [e for e in events if isinstance(e.payload, P.TokenIssued)][-1].payload.method == "device:corp"


async def test_a_device_poll_with_a_handle_never_given_is_a_404_and_bad_json_a_400(world: World) -> None:
    async with aiohttp.ClientSession() as api:
        async with api.post(f"{world.url}/api/v1/login/sso/device/poll", json={"handle": "nope"}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "unknown_handle"
        async with api.post(f"{world.url}/api/v1/login/sso/device/poll", data=b"{not json") as r:
            assert r.status == 400


class CliLogin(msgspec.Struct):
    said: str  # what it printed first: where to go and the code
    complete: str  # the address with the code in it
    rc: int
    out: str  # everything it printed


async def llmgw_login_sso(world: World, config: Path, login: str) -> CliLogin:
    """`llmgw login --sso corp` as a subprocess, the person confirming at the address it prints."""
    env = {
        **os.environ,
        "XDG_CONFIG_HOME": str(config),
        "LLMGW_API_URL": world.url,
        "LLMGW_NATS_URL": world.fleet.nats_url,
    }
    env.pop("LLMGW_TOKEN", None)
    proc = await asyncio.create_subprocess_exec(
        LLMGW, "login", "--sso", "corp", env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    assert proc.stdout is not None
    try:
        first = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        second = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        complete = second.removeprefix("or open ").strip()
        assert complete.startswith(world.idp.issuer), first + second
        async with browser() as b:
            await confirm_device_over_http(b, complete, login, USERS[login]["password"])
        rest = (await asyncio.wait_for(proc.stdout.read(), 60)).decode()
        rc = await asyncio.wait_for(proc.wait(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return CliLogin(first, complete, rc, first + second + rest)


async def test_llmgw_login_sso_prints_where_to_go_and_keeps_the_token_once_the_browser_confirms(
    world: World, tmp_path: Path
) -> None:
    got = await llmgw_login_sso(world, tmp_path / "config", "bob")
    said = re.match(r"open (\S+) and enter the code (\S+)", got.said)
    assert said is not None, got.out
    assert said.group(1) == world.idp.issuer + "/device"
    assert got.complete.endswith(said.group(2))
    assert got.rc == 0, got.out
    assert "signed in as bob" in got.out
    saved = json.loads((tmp_path / "config" / "llmgw" / "credentials.json").read_text())
    assert (await whoami(world, saved[world.url]))["user"] == "bob"


async def test_llmgw_login_sso_for_a_person_in_no_mapped_group_says_why_and_keeps_nothing(
    world: World, tmp_path: Path
) -> None:
    got = await llmgw_login_sso(world, tmp_path / "config", "carol")
    assert got.rc == 2, got.out
    assert "carol is in no group at corp" in got.out
    assert not (tmp_path / "config" / "llmgw" / "credentials.json").exists()


async def test_an_answer_naming_another_issuer_is_refused_as_a_mix_up(world: World) -> None:
    async with browser() as b:
        async with b.get(f"{world.url}/console/sso/corp", allow_redirects=False) as r:
            to_provider = r.headers["Location"]
        back = await sign_in_over_http(b, to_provider, "bob", USERS["bob"]["password"], stop_at=world.callback)
        query = {k: v[0] for k, v in parse_qs(urlsplit(back).query).items()}
        assert query["iss"] == world.idp.issuer  # RFC 9207: the provider names itself in its answer
        mixed = f"{world.callback}?{urlencode({**query, 'iss': 'https://evil.example.org'})}"
        async with b.get(mixed, allow_redirects=False) as r:
            assert r.status == 502
            assert "the sign-in&#39;s answer came from &#39;https://evil.example.org&#39;" in await r.text()
        assert session_cookie(b) == ""


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/console/sso/%00%ff..", None),
        ("GET", "/console/sso/corp?next=javascript:alert(1)", None),
        ("GET", "/console/sso/corp/callback", None),
        ("GET", "/console/sso/corp/callback?state=&code=", None),
        ("GET", "/console/sso/corp/callback?state=x&error=%3Cscript%3E&error_description=" + "x" * 5000, None),
        ("POST", "/api/v1/login/sso/nope/device", b""),
        ("GET", "/console/sso/corp/callback?state=%C3%A9&code=%C3%A9&iss=%C3%A9", None),
        ("POST", "/api/v1/login/sso/corp/device", b"\xff\xfe not json at all"),
        ("POST", "/api/v1/login/sso/device/poll", b"[]"),
        ("POST", "/api/v1/login/sso/device/poll", b'{"handle": 5}'),
        ("POST", "/api/v1/login/sso/device/poll", b'{"handle": "x", "more": 1}'),
        ("POST", "/api/v1/login/sso/device/poll", b'{"handle": "' + b"h" * 100_000 + b'"}'),
    ],
)
async def test_whatever_a_client_sends_the_sign_in_answers_without_a_server_error(
    world: World, method: str, path: str, body: bytes | None
) -> None:
    async with aiohttp.ClientSession() as s, s.request(method, world.url + path, data=body, allow_redirects=False) as r:
        text = await r.text()
        assert r.status < 500, (r.status, text[:300])
        assert "<script>" not in text


async def test_a_refused_sign_in_shows_the_sign_in_page_with_the_button_to_try_again(world: World) -> None:
    async with browser() as b, b.get(f"{world.url}/console/sso/corp/callback?state=gone&code=x") as r:
        assert r.status == 400
        assert 'id="sso-corp"' in await r.text()


async def test_a_browser_cookie_that_is_not_ascii_is_a_refusal_not_a_server_error(world: World) -> None:
    async with browser() as b:
        async with b.get(f"{world.url}/console/sso/corp", allow_redirects=False) as r:
            to_provider = r.headers["Location"]
        back = await sign_in_over_http(b, to_provider, "bob", USERS["bob"]["password"], stop_at=world.callback)
    async with (
        aiohttp.ClientSession() as s,
        s.get(back, headers={"Cookie": "llmgw_sso_browser=été"}, allow_redirects=False) as r,
    ):
        assert r.status == 400
        assert "started in another browser" in await r.text()


def test_an_address_may_have_only_so_many_device_sign_ins_under_way_and_finished_ones_free_a_place() -> None:
    now = [1000.0]
    devices = PendingDevices(clock=lambda: now[0])
    start = DeviceStart(
        device_code="d", user_code="U", verification_uri="https://idp/device", interval=5, expires_in=600
    )
    handles = [devices.add("corp", start, "10.0.0.1") for _ in range(PER_ADDRESS)]
    assert devices.under_way("10.0.0.1") == PER_ADDRESS and devices.under_way("10.0.0.2") == 0
    devices.drop(handles[0])
    assert devices.under_way("10.0.0.1") == PER_ADDRESS - 1
    now[0] += 601  # expired: forgotten
    assert devices.under_way("10.0.0.1") == 0 and devices.get(handles[1]) is None


def test_the_redirect_uri_is_made_from_the_public_url_when_one_is_set_else_from_the_browsers_address() -> None:
    from aiohttp.test_utils import make_mocked_request

    request = make_mocked_request("GET", "/console/sso/corp", headers={"Host": "10.0.0.5:8081"})
    behind_proxy = Sso(api=None, public_url="https://llm.corp.example/")  # type: ignore[arg-type]
    assert behind_proxy.redirect_uri(request, "corp") == "https://llm.corp.example/console/sso/corp/callback"
    direct = Sso(api=None)  # type: ignore[arg-type]
    assert direct.redirect_uri(request, "corp") == "http://10.0.0.5:8081/console/sso/corp/callback"
