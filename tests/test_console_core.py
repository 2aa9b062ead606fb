"""The console's core: signing in with a cookie, CSRF, the CSP, logout that revokes, the live stream,
the moment a page shows — against a real admin API, people service and nats-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path

import aiohttp
import msgspec
import pytest

from llmgw.events.schema import people as P
from llmgw.events.schema import subjects as S
from llmgw.events.schema.envelope import utc_now
from llmgw.events.schema.ids import new_id
from llmgw.events.schema.usage import UsageRecord, usage_subject
from llmgw.services.console import session as SES
from llmgw.services.console.app import parse_moment
from llmgw.services.console.source import Moments, marked
from tests.fleet import Fleet
from tests.signin import PASSWORD, TESTER
from tests.signin import tester_hash as hashed_password
from tests.support import wait_until


@pytest.fixture
async def console(store, nats, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=("projections", "api", "people", "tenancy", "accountant"))
    try:
        yield f
    finally:
        await f.stop()


async def sign_in(session: aiohttp.ClientSession, url: str, next_: str = "/console") -> aiohttp.ClientResponse:
    return await session.post(
        f"{url}/console/login",
        data={"user": TESTER, "password": PASSWORD, "next": next_},
        allow_redirects=False,
    )


def cookie_of(session: aiohttp.ClientSession) -> str:
    return next(c.value for c in session.cookie_jar if c.key == SES.COOKIE)


async def test_signing_in_sets_a_cookie_scripts_cannot_read_and_other_sites_do_not_send(console: Fleet) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        r = await sign_in(s, console.admin_url, "/console/nodes")
        assert r.status == 303
        assert r.headers["Location"] == "/console/nodes"
        set_cookie = r.headers["Set-Cookie"]
        assert "HttpOnly" in set_cookie and "SameSite=Strict" in set_cookie
        assert "Secure" not in set_cookie  # plain http here: a Secure cookie would never come back
        assert cookie_of(s).startswith("llmgw-ses-")


async def test_a_page_without_a_session_sends_the_browser_to_sign_in_and_back_after(console: Fleet) -> None:
    async with aiohttp.ClientSession() as s:
        r = await s.get(f"{console.admin_url}/console/login", allow_redirects=False)
        assert r.status == 200
        assert 'name="password"' in await r.text()
        assert "default-src 'self'" in r.headers["Content-Security-Policy"]
        assert "unsafe-inline" not in r.headers["Content-Security-Policy"]


async def test_a_wrong_password_is_answered_on_the_form_and_sets_no_cookie(console: Fleet) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        r = await s.post(f"{console.admin_url}/console/login", data={"user": TESTER, "password": "wrong"})
        assert r.status == 401
        assert "wrong" in await r.text()
        assert not [c for c in s.cookie_jar if c.key == SES.COOKIE]


def test_after_signing_in_the_browser_goes_only_to_a_page_of_the_console() -> None:
    assert SES.safe_next("/console/models?x=1") == "/console/models?x=1"
    for elsewhere in ("https://evil.example/console", "//evil.example/console", "/api/v1/users", "/\\evil", None, ""):
        assert SES.safe_next(elsewhere) == "/console"


async def test_a_change_sent_with_the_cookie_but_without_the_csrf_token_is_refused(console: Fleet) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        await sign_in(s, console.admin_url)
        token = cookie_of(s)
        # The management API with the console's cookie: the header must carry the CSRF token.
        r = await s.post(f"{console.admin_url}/api/v1/projections/verify")
        assert r.status == 403
        assert (await r.json())["error"]["code"] == "csrf"
        r = await s.post(
            f"{console.admin_url}/api/v1/projections/verify?name=tenancy",
            headers={SES.CSRF_HEADER: SES.csrf_token(token)},
        )
        assert r.status == 200
        # The console's own forms: the field, or the header.
        r = await s.post(f"{console.admin_url}/console/language", data={"language": "de"})
        assert r.status == 403
        assert "CSRF" in await r.text()


async def test_the_language_chosen_is_kept_with_the_person_as_an_event(console: Fleet) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        await sign_in(s, console.admin_url)
        token = cookie_of(s)
        r = await s.post(
            f"{console.admin_url}/console/language",
            data={"language": "de", "csrf": SES.csrf_token(token), "next": "/console/login"},
            allow_redirects=False,
        )
        assert r.status == 303
    events = await console.store.read(f"llmgw.evt.{P.AGGREGATE}.{TESTER}")
    assert any(e.type == "user.language_set" and e.envelope.actor == f"user:{TESTER}" for e in events)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        await sign_in(s, console.admin_url)  # a new session, a browser asking for English: still German
        r = await s.get(f"{console.admin_url}/console/people", headers={"Accept-Language": "en"})
        assert r.status == 200
        assert '<html lang="de">' in await r.text()


async def test_logging_out_revokes_the_session_so_the_old_cookie_opens_nothing(console: Fleet) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        await sign_in(s, console.admin_url)
        token = cookie_of(s)
        r = await s.get(f"{console.admin_url}/api/v1/whoami")
        assert r.status == 200
        r = await s.post(
            f"{console.admin_url}/console/logout", data={"csrf": SES.csrf_token(token)}, allow_redirects=False
        )
        assert r.status == 303
    async with aiohttp.ClientSession() as s:

        async def refused() -> bool:
            r = await s.get(f"{console.admin_url}/api/v1/whoami", headers={"Authorization": f"Bearer {token}"})
            return r.status == 401

        await wait_until(refused, what="the revoked session token to be refused")
    events = await console.store.read(f"llmgw.evt.{P.AGGREGATE}.{TESTER}")
    assert any(e.type == "user.token_revoked" and e.envelope.actor == f"user:{TESTER}" for e in events)


async def test_the_live_stream_sends_each_event_by_its_sequence_and_resumes_after_the_last_one_seen(
    console: Fleet,
) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        await sign_in(s, console.admin_url)
        head = await console.store.stream_last_seq()
        r = await s.get(f"{console.admin_url}/console/live", headers={"Last-Event-ID": str(head)})
        assert r.headers["Content-Type"].startswith("text/event-stream")
        add = P.AddUser(name="watched", password_hash=hashed_password())
        await console.client.send(P.SERVICE, "user.add", add, actor="user:test", timeout=20)
        seen = ""
        async with asyncio.timeout(20):
            while "event: change" not in seen:
                seen += (await r.content.readline()).decode()
        ids = [int(line[4:]) for line in seen.splitlines() if line.startswith("id: ")]
        assert max(ids) > head
        r.close()


def test_a_moment_is_an_iso_time_or_a_duration_back_and_never_the_future() -> None:
    assert parse_moment("") is None
    assert abs(parse_moment("2h") - (utc_now() - timedelta(hours=2))) < timedelta(seconds=5)
    assert parse_moment("2026-01-02T03:04:05").tzinfo is not None
    with pytest.raises(ValueError, match="future"):
        parse_moment((utc_now() + timedelta(days=1)).isoformat())
    with pytest.raises(ValueError, match="at"):
        parse_moment("yesterday-ish")
    with pytest.raises(ValueError, match="shorter"):
        parse_moment("99999999d")  # past the calendar's start: a 400, never a 500


def test_rows_as_they_were_are_marked_changed_gone_or_added_against_now() -> None:
    then = [{"id": "a", "state": "ready"}, {"id": "b", "state": "ready"}, {"id": "c", "state": "live"}]
    now = [{"id": "a", "state": "ready"}, {"id": "b", "state": "draining"}, {"id": "d", "state": "new"}]
    rows = {r["id"]: r for r in marked(then, now)}
    assert rows["a"]["_diff"] == "same"
    assert rows["b"]["_diff"] == "changed" and rows["b"]["_changed"] == ["state"]
    assert rows["b"]["state"] == "ready"  # shown as it was
    assert rows["c"]["_diff"] == "gone"
    assert rows["d"]["_diff"] == "added"


async def test_a_page_that_shows_usage_is_told_once_a_request_s_record_is_in_the_rollups(console: Fleet) -> None:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        await sign_in(s, console.admin_url)
        r = await s.get(f"{console.admin_url}/console/live?page=usage")
        seen = ""
        async with asyncio.timeout(20):
            while "event: hello" not in seen:
                seen += (await r.content.readline()).decode()
        record = UsageRecord(request_id=new_id(), at=utc_now(), status=429, model_asked="m", endpoint="chat")
        await console.store.js.publish(
            usage_subject(None), msgspec.json.encode(record), headers={S.HDR_MSG_ID: record.request_id}
        )
        seen = ""
        async with asyncio.timeout(20):
            while '"aggregate": "usage"' not in seen:
                seen += (await r.content.readline()).decode()
        r.close()
        # Told only once the rollups hold it: a page that fetches itself now counts the request.
        r = await s.get(f"{console.admin_url}/api/v1/usage?since=1h", headers=console.api_headers())
        assert (await r.json())["total"]["requests"] == 1


async def test_pages_at_one_moment_share_one_replay_and_an_older_one_is_closed_for_a_new_one(console: Fleet) -> None:
    await console.client.send(
        P.SERVICE, "user.add", P.AddUser(name="earlier", password_hash=hashed_password()), actor="user:test", timeout=20
    )
    first = utc_now()
    await console.client.send(
        P.SERVICE, "user.add", P.AddUser(name="later", password_hash=hashed_password()), actor="user:test", timeout=20
    )
    second = utc_now()
    moments = Moments(console.store, size=1)
    try:
        a = await moments.get(first)
        again = await moments.get(first + timedelta(microseconds=1))  # no event between: the same moment
        assert again is a
        b = await moments.get(second)
        assert b.position > a.position
        assert list(moments._kept) == [b.position]  # the first was closed to make room
        async with b.using:
            assert await b.backend.query("tenancy", "SELECT COUNT(*) FROM {scopes}") is not None
    finally:
        await moments.close()
