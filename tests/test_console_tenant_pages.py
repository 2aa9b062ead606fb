"""The console's tenants, people, usage, audit and mirror pages, rendered by the real admin API over a
real nats-server and the command services: what each page shows, to whom, and what its forms send."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from urllib.parse import quote

import aiohttp
import msgspec
import pytest
from click.testing import CliRunner

from llmgw.cli.main import main
from llmgw.events.commands.client import CommandClient
from llmgw.events.runtime.store import NewEvent
from llmgw.events.schema import mirror as E
from llmgw.events.schema import models as M
from llmgw.events.schema import people as P
from llmgw.events.schema import tenancy as T
from llmgw.events.schema.envelope import utc_now
from llmgw.events.schema.subjects import event_subject
from llmgw.services.console import session as SES
from llmgw.services.console.svg import Series, line_chart
from tests.fleet import Fleet
from tests.signin import PASSWORD, TESTER
from tests.signin import tester_hash as the_password_hash
from tests.support import NatsServer, wait_until
from tests.test_external import KEY_A, Provider, add_external, chat
from tests.test_gateway import FAST_ROUTER

pytestmark = [pytest.mark.timeout(180)]

TENANT_SERVICES = ("projections", "api", "people", "tenancy", "access")
HERE = Path(__file__).resolve().parent.parent / "services" / "console"
AREAS = ("tenants", "people", "usage", "audit", "mirror")


@pytest.fixture
async def console(store, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    f = await Fleet(store, nats.url, tmp_path).start(services=TENANT_SERVICES)
    try:
        yield f
    finally:
        await f.stop()


class Browser:
    """One signed-in person's cookie jar against the console, as a browser without scripts uses it."""

    def __init__(self, fleet: Fleet, session: aiohttp.ClientSession) -> None:
        self.fleet = fleet
        self.s = session

    @property
    def csrf(self) -> str:
        token = next(c.value for c in self.s.cookie_jar if c.key == SES.COOKIE)
        return SES.csrf_token(token)

    async def page(self, path: str) -> str:
        async with self.s.get(f"{self.fleet.admin_url}{path}") as r:
            text = await r.text()
            assert r.status == 200, f"{path}: {r.status} {text[:2000]}"
            return text

    async def act(self, page: str, action: str, **form: str) -> tuple[int, str]:
        data = {"csrf": self.csrf, **form}
        async with self.s.post(f"{self.fleet.admin_url}/console/act/{page}/{action}", data=data) as r:
            return r.status, await r.text()


async def signed_in(fleet: Fleet, session: aiohttp.ClientSession, user: str = TESTER) -> Browser:
    r = await session.post(
        f"{fleet.admin_url}/console/login", data={"user": user, "password": PASSWORD}, allow_redirects=False
    )
    assert r.status == 303, await r.text()
    return Browser(fleet, session)


def jar() -> aiohttp.CookieJar:
    return aiohttp.CookieJar(unsafe=True)


async def tenancy(fleet: Fleet, *paths: str) -> None:
    for path in paths:
        kind = ("org", "team", "project")[path.count("/")]
        await fleet.command("create", T.CreateScope(kind=kind, path=path), service=T.SERVICE)


async def person(fleet: Fleet, name: str, role: str, scope: str) -> None:
    """A person who signs in with the tester's password, holding ``role`` over ``scope``."""
    client = CommandClient.for_service(fleet.store, "tests")
    await client.send(P.SERVICE, "user.add", P.AddUser(name=name, password_hash=the_password_hash()), actor="user:test")
    await client.send(P.SERVICE, "role.grant", P.GrantRole(name=name, role=role, scope=scope), actor="user:test")
    signin = fleet.handles["signin"]

    def known() -> bool:
        return name in signin.people.by_name and bool(signin.people.by_name[name].roles)

    await wait_until(known, what=f"the admin API to know {name}")


def secret_in(html: str) -> str | None:
    found = re.search(r'value="(llmgw-[A-Za-z0-9]{8}-[A-Za-z0-9_-]+)"', html)
    return found.group(1) if found else None


async def test_a_key_created_from_the_page_shows_its_secret_once_and_only_its_prefix_after(console: Fleet) -> None:
    await tenancy(console, "acme", "acme/ml", "acme/ml/chat")
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s)
        page = await b.page("/console/tenants")
        assert 'id="key-create"' in page and "acme/ml/chat" in page
        status, answer = await b.act("tenants", "key_create", project="project:acme/ml/chat", name="web", rpm="")
        assert status == 200, answer
        secret = secret_in(answer)
        assert secret is not None, answer
        prefix = secret.split("-")[1]

        async def listed() -> str | None:
            html = await b.page("/console/tenants")
            return html if f'id="key-{prefix}"' in html else None

        html = await wait_until(listed, what="the new key on the tenants page")
        assert secret not in html and secret.split("-", 2)[2] not in html  # never again, not even in part
        assert f"llmgw-{prefix}-…" in html
    events = await console.store.read("llmgw.evt.key.>")
    assert events and all(secret.split("-", 2)[2] not in msgspec.json.encode(e.payload).decode() for e in events)


async def test_a_team_admin_sees_only_its_teams_keys_and_its_revoke_of_another_teams_key_is_refused(
    console: Fleet,
) -> None:
    await tenancy(console, "acme", "acme/ml", "acme/ml/chat", "acme/ops", "acme/ops/batch")
    await person(console, "lead", "team-admin", "team:acme/ml")
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        admin = await signed_in(console, s)
        _, mine = await admin.act("tenants", "key_create", project="acme/ml/chat", name="ml-key")
        _, theirs = await admin.act("tenants", "key_create", project="acme/ops/batch", name="ops-key")
    mine_prefix, theirs_prefix = secret_in(mine).split("-")[1], secret_in(theirs).split("-")[1]  # type: ignore[union-attr]
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        lead = await signed_in(console, s, "lead")

        async def both_known() -> str | None:
            html = await lead.page("/console/tenants")
            return html if f'id="key-{mine_prefix}"' in html else None

        html = await wait_until(both_known, what="the team's key on its admin's page")
        assert f'id="key-{theirs_prefix}"' not in html and "ops-key" not in html
        assert "acme/ops/batch" not in html  # nor the other team's projects
        assert f'id="revoke-{mine_prefix}"' in html  # a member of its team's projects may revoke their keys
        # A hand-made POST for the other team's key: the access service refuses it, whatever the page showed.
        keys = {e.payload.prefix: e.payload.key_id for e in await console.store.read("llmgw.evt.key.>")}
        status, answer = await lead.act("tenants", "key_revoke", key=keys[theirs_prefix])
        assert status == 403, answer
        assert "forbidden" in answer
        # The people and usage pages open for a team admin too (tenant pages), showing only its team.
        people = await lead.page("/console/people")
        assert 'id="person-lead"' in people and 'id="user-add"' not in people
        usage = await lead.page("/console/usage")
        assert "team:acme/ml" in usage and "acme/ops" not in usage
        other = await lead.page("/console/usage?scope=project:acme/ops/batch")
        assert 'id="usage-problem"' in other and 'id="usage-totals"' not in other  # not its usage to see


async def test_a_limit_and_a_budget_set_from_the_page_are_listed_with_the_budgets_spend(console: Fleet) -> None:
    await tenancy(console, "acme", "acme/ml", "acme/ml/chat")
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s)
        status, answer = await b.act("tenants", "limit_set", scope="project:acme/ml/chat", rpm="7", tpm="")
        assert status == 200, answer
        status, answer = await b.act("tenants", "budget_set", scope="team:acme/ml", usd="12.5", period="day")
        assert status == 200, answer
        status, answer = await b.act("tenants", "limit_set", scope="project:acme/ml/chat", rpm="seven")
        assert status == 400 and "not a whole number" in answer  # a form's mistake is answered, never a 500
        for action, form in (
            ("quota_set", {"scope": "team:acme/ml", "memory_gb": "1e308"}),
            ("budget_set", {"scope": "team:acme/ml", "usd": "nan"}),
            ("key_create", {"project": "acme/ml/chat", "expires": "999999999w"}),
        ):
            status, answer = await b.act("tenants", action, **form)
            assert status == 400, (action, answer)
        status, answer = await b.act("people", "token_create", days="99999999")
        assert status == 400, answer

        async def both() -> str | None:
            html = await b.page("/console/tenants")
            return html if "budget-team-" in html and "limit-project-" in html else None

        html = await wait_until(both, what="the limit and the budget on the page")
        assert "project:acme/ml/chat" in html and "team:acme/ml" in html
        assert "$12.50" in html and "$0.00" in html  # the budget, and nothing spent yet


async def test_a_person_added_from_the_page_is_kept_as_a_hash_and_can_sign_in(console: Fleet) -> None:
    password = "a page-made password, long"
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s)
        status, answer = await b.act(
            "people", "user_add", name="carol", display_name="Carol", password=password, password2=password
        )
        assert status == 200, answer
        status, answer = await b.act("people", "role_grant", name="carol", role="viewer", scope="cluster")
        assert status == 200, answer
        status, answer = await b.act("people", "token_create", name="carol", label="ci")
        assert status == 200 and re.search(r'value="llmgw-pat-', answer), answer
        html = await b.page("/console/people")
        assert 'id="person-carol"' in html and "viewer of cluster" in html
    logged = b"".join(msgspec.json.encode(e.payload) for e in await console.store.read("llmgw.evt.user.carol"))
    assert password.encode() not in logged and b"$argon2id$" in logged
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        r = await s.post(
            f"{console.admin_url}/console/login", data={"user": "carol", "password": password}, allow_redirects=False
        )
        assert r.status == 303


async def test_the_audit_page_lists_a_cli_action_with_its_signature_verified(console: Fleet) -> None:
    argv = ["--nats", console.nats_url, "--api", console.admin_url, "ctl", "org", "create", "globex"]
    done = await asyncio.to_thread(CliRunner().invoke, main, argv, env=console.cli_env())
    assert done.exit_code == 0, done.output
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s)

        async def listed() -> str | None:
            html = await b.page("/console/audit?type=org.created")
            return html if "org.created" in html and f"user:{TESTER}" in html else None

        html = await wait_until(listed, what="the CLI's org on the audit page")
        assert 'id="audit-list"' in html
        assert 'data-verify="verified"' in html and "tenancy.create" in html
        assert '"name": "globex"' in html.replace("&#34;", '"')
        # Filtered by another actor, it is not there; the time filter's mistake is said, not a 500.
        assert (
            "org.created"
            not in (await b.page("/console/audit?actor=user:nobody&type=org.created")).split('id="audit-list"')[1]
        )
        assert "neither a duration" in await b.page("/console/audit?since=yesterday")
        assert "neither a duration" in await b.page("/console/audit?until=99999999d&before=x")


async def test_every_page_renders_empty_and_in_german_with_no_control_for_a_viewer(console: Fleet) -> None:
    await person(console, "vera", "viewer", "cluster")
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s, "vera")
        for area in AREAS:
            async with s.get(f"{console.admin_url}/console/{area}", headers={"Accept-Language": "de"}) as r:
                html = await r.text()
                assert r.status == 200, (area, html[:2000])
                assert '<html lang="de">' in html
                # A viewer may make and revoke its own tokens, and nothing else.
                acts = set(re.findall(r'action="/console/act/([a-z_]+/[a-z_]+)"', html))
                assert acts <= {"people/token_create", "people/token_revoke"}, (area, acts)
                if area == "people":
                    tester_row = html.split('id="person-tester"')[1].split("</tr>")[0]
                    assert "/console/act/" not in tester_row
        status, answer = await b.act("tenants", "limit_set", scope="project:nothing", rpm="3")
        assert status in (403, 404), answer


async def test_usage_at_a_moment_and_the_mirror_in_the_past_render(console: Fleet) -> None:
    await tenancy(console, "acme")
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s)
        for area in AREAS:
            html = await b.page(f"/console/{area}?at=1m")
            assert 'id="past-banner"' in html
            assert "/console/act/" not in html.split('id="main"')[1], area  # nothing to change in the past


async def test_a_limit_set_from_the_page_shows_its_429s_on_the_usage_page(
    store, nats: NatsServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An external model (GW-12) served by a small provider started here: a gateway without engines.
    monkeypatch.setenv("EXT_KEY_A", KEY_A)
    services = (*TENANT_SERVICES, "catalog", "fleet", "scheduler", "router")
    gw = await Fleet(store, nats.url, tmp_path).start(services=services, router=FAST_ROUTER)
    provider = await Provider((KEY_A,)).start()
    try:
        await tenancy(gw, "acme", "acme/ml", "acme/ml/chat")
        await add_external(gw, "ext", M.ExternalProvider(url=provider.url, key_env=["EXT_KEY_A"]))
        async with aiohttp.ClientSession(cookie_jar=jar()) as s:
            b = await signed_in(gw, s)
            _, made = await b.act("tenants", "key_create", project="acme/ml/chat", name="app", external="on")
            key = secret_in(made)
            assert key is not None, made
            status, answer = await b.act("tenants", "limit_set", scope="project:acme/ml/chat", rpm="1")
            assert status == 200, answer

            async def refused() -> bool:
                async with s.post(
                    f"http://127.0.0.1:{gw.port}/v1/chat/completions",
                    json=chat("ext"),
                    headers={"Authorization": f"Bearer {key}"},
                ) as r:
                    return r.status == 429

            await wait_until(refused, deadline_s=30, what="the gateway to refuse past the limit")

            async def shown() -> str | None:
                html = await b.page("/console/usage?by=key&range=hour")
                return html if re.search(r'data-refusals="[1-9]', html) else None

            html = await wait_until(shown, deadline_s=30, what="the 429 on the usage page")
            assert 'id="usage-refusals"' in html and "<title" in html
            assert "key:" in html and "(app)" in html  # grouped by the key, named as people know it
    finally:
        await provider.stop()
        await gw.stop()


async def test_the_tenants_page_before_a_revocation_shows_the_key_active_and_marked_as_changed_since(
    console: Fleet,
) -> None:
    await tenancy(console, "acme", "acme/ml", "acme/ml/chat")
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s)
        _, made = await b.act("tenants", "key_create", project="acme/ml/chat", name="old")
        prefix = secret_in(made).split("-")[1]  # type: ignore[union-attr]
        key_id = (await console.store.read("llmgw.evt.key.>"))[-1].payload.key_id
        before = utc_now()
        status, answer = await b.act("tenants", "key_revoke", key=key_id, reason="leaked")
        assert status == 200, answer
        then = await b.page(f"/console/tenants?at={quote(before.isoformat())}")
        row = then.split(f'id="key-{prefix}"')[1].split("</tr>")[0]
        assert 'data-state="active"' in row and "diff-changed" in row, row  # live then, marked: changed since
        assert 'id="revoke-' not in then  # no control in the past
        now = await b.page("/console/tenants")
        assert 'data-state="revoked"' in now.split(f'id="key-{prefix}"')[1].split(">")[0]


async def test_a_limit_changed_since_a_moment_shows_its_old_figure_there_marked_changed(console: Fleet) -> None:
    await tenancy(console, "acme", "acme/ml", "acme/ml/chat")
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s)
        assert (await b.act("tenants", "limit_set", scope="project:acme/ml/chat", rpm="5"))[0] == 200
        before = utc_now()
        assert (await b.act("tenants", "limit_set", scope="project:acme/ml/chat", rpm="9"))[0] == 200
        assert (await b.act("tenants", "budget_set", scope="team:acme/ml", usd="3"))[0] == 200
        then = await b.page(f"/console/tenants?at={quote(before.isoformat())}")
        limit = then.split('id="limit-project-')[1].split("</tr>")[0]
        assert ">5<" in limit and "diff-changed" in limit, limit
        budget = then.split('id="budget-team-')[1].split("</tr>")[0]
        assert "diff-added" in budget, budget  # set after the moment: there now, not then
        await tenancy(console, "acme/web")  # a team made since: in the tree now, marked added there
        then = await b.page(f"/console/tenants?at={quote(before.isoformat())}")
        team = then.split('data-path="acme/web"')[1].split("</tr>")[0]
        assert "diff-added" in team, team
        now = await b.page("/console/tenants")
        assert ">9<" in now.split('id="limit-project-')[1].split("</tr>")[0]


def verified(version: str, digest: str) -> E.FileVerified:
    return E.FileVerified(version=version, file="a.gguf", size=4000, sha256=digest * 32)


async def test_the_mirror_page_shows_a_download_in_progress_what_is_held_and_what_a_peer_copied(
    console: Fleet,
) -> None:
    files = [
        E.MirrorFile(path="a.gguf", name="a.gguf", size=4000),
        E.MirrorFile(path="b.gguf", name="b.gguf", size=6000),
    ]
    started = E.FetchStarted(version="v1", repo="acme/tiny", revision="main", commit="c0ffee" * 6, files=files)
    await console.store.append(
        event_subject(E.AGGREGATE, "tiny"),
        [
            NewEvent(payload=started, actor="svc:mirror"),
            NewEvent(
                payload=E.FileVerified(version="v1", file="a.gguf", size=4000, sha256="ab" * 32), actor="svc:mirror"
            ),
        ],
    )
    done = E.FetchStarted(version="v0", repo="acme/old", revision="main", commit="beef" * 10, files=files[:1])
    await console.store.append(
        event_subject(E.AGGREGATE, "old"),
        [
            NewEvent(payload=done, actor="svc:mirror"),
            NewEvent(
                payload=E.FileVerified(version="v0", file="a.gguf", size=4000, sha256="cd" * 32), actor="svc:mirror"
            ),
            NewEvent(
                payload=E.FetchCompleted(version="v0", files=1, bytes=4000, downloaded=4000, seconds=1.0),
                actor="svc:mirror",
            ),
        ],
    )
    copied = E.PeerFileCopied(model="old", version="v0", file="a.gguf", size=4000, sha256="cd" * 32, source="primary")
    await console.store.append(
        event_subject(E.PEER_AGGREGATE, "edge-1"), [NewEvent(payload=copied, actor="svc:mirror")]
    )
    async with aiohttp.ClientSession(cookie_jar=jar()) as s:
        b = await signed_in(console, s)
        html = await b.page("/console/mirror")
        job = html.split('id="job-tiny-v1"')[1].split("</li>")[0]
        assert "<progress" in job and 'max="10000" value="4000"' in job and "40%" in job
        assert 'data-state="present"' in html.split('id="version-old-v0"')[1].split(">")[0]
        assert "4.0 kB" in html.split('id="mirror-space"')[1].split("</p>")[0]  # what is held
        row = html.split('id="peer-edge-1"')[1].split("</tr>")[0]
        assert ">1<" in row and "primary" in row
        assert 'id="mirror-fetch"' in html  # a cluster admin's control


def test_a_chart_is_labelled_and_says_nothing_by_colour_alone() -> None:
    svg = str(line_chart("c", "Requests <per> model", "desc", ["00:00", "01:00"], [Series(name="a", values=[1, 2])]))
    assert svg.startswith("<svg") and 'role="img"' in svg and 'aria-labelledby="c-title c-desc"' in svg
    assert '<title id="c-title">Requests &lt;per&gt; model</title>' in svg
    assert "style=" not in svg  # the CSP forbids inline style
    assert ">a</text>" in svg  # the legend names the line


def test_every_message_these_pages_use_is_in_english_and_german() -> None:
    used: set[str] = set()
    for area in AREAS:
        for path in [*(HERE / "templates").glob(f"{area}*.html"), HERE / "pages" / f"{area}.py"]:
            used |= set(re.findall(rf"""t\(["']({area}\.[a-z0-9_.]+[a-z0-9_])["']""", path.read_text()))
    for lang in ("en", "de"):
        known: set[str] = set()
        for area in AREAS:
            known |= set(json.loads((HERE / "messages" / lang / f"{area}.json").read_text()))
        assert not used - known, (lang, sorted(used - known))
