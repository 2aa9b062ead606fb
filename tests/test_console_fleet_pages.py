"""The console's fleet pages (overview, nodes, node, models, model) through the real admin API and its
console, against a real nats-server, the fleet's services and agents running real llama.cpp engines:
what a person sees, and that what they do from a page is the command the CLI sends."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import quote

import aiohttp
import msgspec
import pytest

from llmgw.events.runtime.store import NewEvent
from llmgw.events.schema import jobs as J
from llmgw.events.schema import models as M
from llmgw.events.schema import people as P
from llmgw.events.schema.subjects import event_subject
from llmgw.events.schema.usage import UsageRecord, usage_subject
from llmgw.services.console import session as SES
from llmgw.services.console.pages.models import standing
from llmgw.services.console.pages.nodes import paged
from llmgw.services.console.pages.overview import traffic_minutes
from tests import signin
from tests.fakehub import FakeHub
from tests.fleet import Fleet
from tests.gguf_tiny import write_tiny_gguf
from tests.signin import PASSWORD, TESTER
from tests.support import wait_until
from tests.test_serve import REPO, Rig

VIEWER = "vera"


class Browser:
    """One signed-in person's HTTP session with the console: pages read, forms posted with the CSRF token."""

    def __init__(self, url: str, session: aiohttp.ClientSession) -> None:
        self.url = url
        self.s = session

    @property
    def csrf(self) -> str:
        return SES.csrf_token(next(c.value for c in self.s.cookie_jar if c.key == SES.COOKIE))

    async def page(self, path: str) -> str:
        async with self.s.get(f"{self.url}{path}") as r:
            body = await r.text()
            assert r.status == 200, body[-2000:]
            return body

    async def act(self, page: str, action: str, **fields: str) -> tuple[int, str]:
        """Post one of a page's forms as htmx does; the outcome's status (X-Outcome-Status) and its text."""
        data = {"csrf": self.csrf, **fields}
        async with self.s.post(
            f"{self.url}/console/act/{page}/{action}", data=data, headers={"HX-Request": "true"}
        ) as r:
            return int(r.headers.get("X-Outcome-Status", r.status)), await r.text()


async def signed_in(url: str, session: aiohttp.ClientSession, user: str) -> Browser:
    async with session.post(
        f"{url}/console/login", data={"user": user, "password": PASSWORD, "next": "/console"}, allow_redirects=False
    ) as r:
        assert r.status == 303, await r.text()
    return Browser(url, session)


@pytest.fixture
async def admin(fleet: Fleet) -> AsyncIterator[Browser]:
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        yield await signed_in(fleet.admin_url, s, TESTER)


@pytest.fixture
async def viewer(fleet: Fleet) -> AsyncIterator[Browser]:
    await fleet.client.send(
        P.SERVICE, "user.add", P.AddUser(name=VIEWER, password_hash=signin.tester_hash()), actor="user:test", timeout=20
    )
    grant = P.GrantRole(name=VIEWER, role="viewer", scope="cluster")
    await fleet.client.send(P.SERVICE, "role.grant", grant, actor="user:test", timeout=20)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as s:
        async with s.post(f"{fleet.admin_url}/console/login", data={"user": VIEWER, "password": PASSWORD}) as r:
            assert r.status in (200, 303)
        yield Browser(fleet.admin_url, s)


def row(html: str, element_id: str) -> str:
    """The element with this id (a table row, a section) up to its end tag, for asserting what it says."""
    m = re.search(
        rf'<(tr|section|div|p|ul|li|dd|td|span)\b[^>]*\bid="{re.escape(element_id)}"[^>]*>(.*?)</\1>', html, re.S
    )
    assert m is not None, f"no element id={element_id!r} on the page"
    return m.group(0)


async def projected_node(fleet: Fleet, node_id: str) -> dict:
    async with (
        aiohttp.ClientSession() as s,
        s.get(f"{fleet.admin_url}/api/v1/nodes/{node_id}", headers=fleet.api_headers()) as r,
    ):
        return await r.json() if r.status == 200 else {}


# -- pure parts ----------------------------------------------------------------------------------


def test_a_model_is_satisfied_short_parked_or_stopped_in_that_order_of_precedence() -> None:
    base = {"stopped": False, "parked": None, "ready": 1, "min_replicas": 1, "external": []}
    assert standing(base) == "satisfied"
    assert standing({**base, "ready": 0}) == "short"
    assert standing({**base, "ready": 0, "parked": "5 failed starts"}) == "parked"
    assert standing({**base, "ready": 0, "parked": "x", "stopped": True}) == "stopped"
    assert standing({**base, "ready": 0, "external": ["api.example.com"]}) == "satisfied"


def test_the_traffic_counts_every_minute_of_the_window_and_the_last_one_as_still_counting() -> None:
    end = datetime(2026, 12, 3, 16, 5, 30, tzinfo=UTC)
    minutes = traffic_minutes([("2026-12-03T16:04:00Z", 120, 6), ("2026-12-03T16:05:00Z", 30, 0)], end, window=3)
    assert [m["requests"] for m in minutes] == [0, 120, 30]
    assert minutes[1]["rps"] == 2.0 and minutes[1]["errors"] == 6
    assert minutes[2]["counting"] and minutes[2]["rps"] == 1.0  # 30 requests in the 30 s so far


def test_a_long_list_is_drawn_a_page_at_a_time_and_a_page_past_the_end_is_the_last() -> None:
    rows = [{"id": i} for i in range(250)]
    first = paged(rows, {})
    assert (first["page"], first["pages"], first["total"], len(first["rows"])) == (1, 3, 250, 100)
    last = paged(rows, {"page": "9"})
    assert last["page"] == 3 and [r["id"] for r in last["rows"]] == list(range(200, 250))
    assert paged(rows, {"page": "soon"})["page"] == 1
    assert paged([], {})["pages"] == 1


# -- the pages -----------------------------------------------------------------------------------


async def test_a_model_added_from_the_page_is_shown_ready_with_its_replica_explain_and_log_tail(
    fleet: Fleet, admin: Browser, tmp_path: Path
) -> None:
    fleet.agent("n1")
    await wait_until(lambda: projected_node(fleet, "n1"), what="node n1 to register")
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    status, text = await admin.act(
        "models", "add", name="tiny", source=str(gguf), min="1", cpu_cores="1", memory_gb="0.05", ctx_size="1024"
    )
    assert status == 200, text
    [replica] = await fleet.wait_ready("tiny", 1)

    async def serving() -> str | None:
        html = await admin.page("/console/models")
        return html if 'data-status="satisfied"' in row(html, "model-tiny") else None

    html = await wait_until(serving, what="the models page to show tiny satisfied")
    assert "serving" in row(html, "model-tiny")

    html = await admin.page("/console/models/tiny")
    assert 'data-status="satisfied"' in row(html, "model-standing")
    assert 'data-status="ready"' in row(html, f"replica-{replica['id']}")
    assert "1 of 1 nodes could take another replica" in html or "of 1 nodes" in row(html, "explain-summary")
    assert 'id="explain-n1"' in html
    assert 'id="headroom-line"' in html
    assert 'id="scale"' in html and 'id="remove-purge"' in html  # a cluster admin's controls

    html = await admin.page("/console/nodes/n1")
    assert 'data-status="ready"' in row(html, "node-state")
    assert replica["id"] in row(html, f"replica-{replica['id']}")
    assert 'id="memory-available"' in html  # the last heartbeat's sensors
    assert f'id="log-{replica["id"]}"' in html or f'id="log-{replica["id"]}-empty"' in html

    html = await admin.page("/console")
    assert 'data-count="1"' in row(html, "models-satisfied")
    assert 'data-count="1"' in row(html, "nodes-ready")
    assert 'id="nothing-wrong"' in html

    fleet.agents["n1"].kill9()  # its engine lives on, but nobody answers for the node any more
    html = await admin.page("/console/nodes/n1")
    assert "did not answer" in row(html, "logs-unreached")


async def test_a_cordon_from_the_nodes_page_takes_effect_and_an_uncordon_undoes_it(
    fleet: Fleet, admin: Browser
) -> None:
    fleet.agent("n1")
    await wait_until(lambda: projected_node(fleet, "n1"), what="node n1 to register")
    html = await admin.page("/console/nodes")
    assert 'data-status="ready"' in row(html, "node-n1")
    assert 'id="cordon-n1"' in html

    status, text = await admin.act("nodes", "cordon", node="n1", reason="disk swap")
    assert status == 200, text
    html = await admin.page("/console/nodes")
    assert 'data-status="cordoned"' in row(html, "node-n1")
    assert "disk swap" in row(html, "node-n1")
    assert 'id="uncordon-n1"' in html and 'id="cordon-n1"' not in html
    assert (await projected_node(fleet, "n1"))["cordoned"]
    assert 'id="node-n1"' in await admin.page("/console/nodes?state=cordoned")
    assert 'id="node-n1"' not in await admin.page("/console/nodes?state=ready")

    status, text = await admin.act("node", "uncordon", node="n1")
    assert status == 200, text
    assert 'data-status="ready"' in row(await admin.page("/console/nodes/n1"), "node-state")


async def test_a_viewer_finds_no_control_to_act_and_a_hand_made_cordon_is_refused(
    fleet: Fleet, viewer: Browser
) -> None:
    fleet.agent("n1")
    await wait_until(lambda: projected_node(fleet, "n1"), what="node n1 to register")
    html = await viewer.page("/console/nodes")
    assert 'data-status="ready"' in row(html, "node-n1")
    assert 'id="cordon-n1"' not in html and "/console/act/" not in html
    models = await viewer.page("/console/models")
    assert 'id="add-model"' not in models and 'id="serve-model"' not in models and "/console/act/" not in models

    status, text = await viewer.act("nodes", "cordon", node="n1", reason="not mine to do")
    assert status == 403, text
    assert 'data-outcome="refused"' in text
    assert not (await projected_node(fleet, "n1"))["cordoned"]


async def test_a_model_that_fits_nowhere_is_short_and_the_overview_says_why(fleet: Fleet, admin: Browser) -> None:
    fleet.agent("n1")
    await wait_until(lambda: projected_node(fleet, "n1"), what="node n1 to register")
    await fleet.add_model("huge", "/nowhere/huge.gguf", memory_gb=4096)

    async def told() -> str | None:
        html = await admin.page("/console")
        return html if 'data-kind="unplaceable"' in html else None

    html = await wait_until(told, what="the overview to say huge cannot be placed")
    assert 'data-count="1"' in row(html, "models-short")
    assert 'data-status="short"' in row(html, "model-huge")
    assert "huge" in row(html, "wrong-list")
    html = await admin.page("/console/models/huge")
    assert 'data-status="lacks"' in row(html, "explain-n1")


async def test_a_bad_number_in_a_form_is_refused_as_invalid_and_nothing_is_sent(fleet: Fleet, admin: Browser) -> None:
    status, text = await admin.act("model", "scale", name="tiny", min="lots")
    assert status == 400
    assert "whole number" in text
    status, text = await admin.act("nodes", "drain", node="n1", grace="soon")
    assert status == 400
    assert "seconds" in text
    status, text = await admin.act("models", "add", name="", source="")
    assert status == 400
    status, text = await admin.act("model", "scale", name="tiny", min="99999999999999999999999")
    assert status == 400
    status, text = await admin.act("nodes", "drain", node="n1", grace="inf")
    assert status == 400
    status, text = await admin.act("models", "add", name="x", source="/x.gguf", memory_gb="nan")
    assert status == 400


async def test_scaling_stopping_and_starting_from_the_model_page_change_the_catalog(
    fleet: Fleet, admin: Browser
) -> None:
    await fleet.add_model("idle", "/nowhere/idle.gguf", min_=0)
    status, text = await admin.act("model", "scale", name="idle", min="0", max="2")
    assert status == 200, text
    status, text = await admin.act("model", "stop", name="idle")
    assert status == 200, text
    html = await admin.page("/console/models/idle")
    assert 'data-status="stopped"' in row(html, "model-standing")
    assert 'id="start"' in html and 'id="stop"' not in html
    assert "max 2" in row(html, "model-ready")
    status, text = await admin.act("model", "start", name="idle")
    assert status == 200, text
    status, text = await admin.act("model", "remove", name="idle", purge="on")
    assert status == 200, text
    removed = [e for e in await fleet.store.read(event_subject(M.AGGREGATE, "idle")) if e.type == "model.removed"]
    assert removed and removed[-1].payload.purge and removed[-1].envelope.actor == f"user:{TESTER}"
    assert 'id="no-model"' in await admin.page("/console/models/idle")


async def test_a_serve_job_shows_its_progress_as_its_steps_are_written(fleet: Fleet, admin: Browser) -> None:
    job = "job-1"
    subject = event_subject(J.AGGREGATE, job)

    async def write(payload: msgspec.Struct) -> None:
        await fleet.store.append(subject, [NewEvent(payload=payload, actor="svc:jobs", correlation=job)])

    await write(J.JobStarted(repo="acme/tiny-GGUF", quant="Q8_0", requested_by=f"user:{TESTER}"))
    await write(J.JobStep(step="validate", status=J.DONE, message="acme/tiny-GGUF is a repository id"))
    await write(J.JobStep(step="pick", status=J.DONE, message="tiny.Q8_0.gguf", data={"model": "tiny-q8-0"}))
    await write(J.JobStep(step="fetch", status=J.STARTED, message="fetching 1 file"))
    html = await admin.page("/console/models")
    progress = row(html, f"job-{job}")
    assert 'max="8" value="2"' in progress
    assert "Step 2 of 8 done" in progress and "running: fetch" in progress

    await write(J.JobStep(step="fetch", status=J.FAILED, message="the hub answered 404"))
    await write(J.JobFinished(ok=False, summary="fetch failed: the hub answered 404"))
    html = await admin.page("/console/models")
    assert 'data-status="failed"' in row(html, f"job-{job}")
    assert "the hub answered 404" in row(html, f"job-{job}")
    assert f'id="job-{job}"' in await admin.page("/console/models/tiny-q8-0")  # the model's page follows it too


async def test_a_model_served_from_a_hub_on_the_models_page_runs_its_job_to_the_end_with_its_progress(
    fleet: Fleet, admin: Browser, tmp_path: Path
) -> None:
    hub = await FakeHub().start()
    hub.add_repo(REPO)
    hub.add_file(REPO, "tiny-Q4_K_M.gguf", write_tiny_gguf(tmp_path / "tiny-Q4_K_M.gguf"))
    rig = await Rig(fleet.store, hub, tmp_path / "rig").start()  # the mirror and the jobs service
    try:
        fleet.agent("n1")
        status, text = await admin.act("models", "serve", repo=REPO, quant="Q4_K_M", cores="1", ctx_pool="1024")
        assert status == 200, text
        [job] = re.findall(r'class="job" id="job-([^"]+)"', await admin.page("/console/models"))

        async def finished() -> str | None:
            html = row(await admin.page("/console/models"), f"job-{job}")
            return html if 'data-status="running"' not in html else None

        html = await wait_until(finished, deadline_s=150, what="the serve job to finish")
        assert 'data-status="done"' in html, html
        assert 'max="8" value="8"' in html
        assert "tokens/s" in html  # the job's summary: its smoke test's answer
        events = await fleet.store.read(event_subject(J.AGGREGATE, job))
        assert events[0].payload.requested_by == f"user:{TESTER}"  # the command was the person's own
    finally:
        await rig.stop()
        await hub.stop()


async def test_the_overview_counts_requests_and_errors_from_the_usage_rollups(fleet: Fleet, admin: Browser) -> None:
    now = datetime.now(UTC)
    for i, status in enumerate((200, 200, 429)):
        record = UsageRecord(
            request_id=f"req-{i}",
            at=now,
            status=status,
            model_asked="tiny",
            model_served="tiny" if status == 200 else None,
            endpoint="/v1/chat/completions",
            error="rate limited: 60 requests per minute" if status == 429 else None,
            router="r1",
        )
        await fleet.store.js.publish(
            usage_subject(None), msgspec.json.encode(record), headers={"Nats-Msg-Id": record.request_id}
        )

    async def counted() -> str | None:
        html = await admin.page("/console")
        return html if "3 requests, 1 of them errors" in html else None

    html = await wait_until(counted, what="the overview to count the three requests")
    assert "rate limited" in row(html, "wrong")
    assert 'id="traffic-minutes"' in html


async def test_the_models_page_at_a_past_moment_marks_what_changed_and_offers_no_controls(
    fleet: Fleet, admin: Browser
) -> None:
    await fleet.add_model("idle", "/nowhere/idle.gguf", min_=0)
    await wait_until(lambda: _shown(admin, "idle"), what="idle on the models page")
    then = quote(datetime.now(UTC).isoformat())
    await fleet.command("stop", M.StopModel(name="idle"))
    html = await admin.page(f"/console/models?at={then}")
    assert 'id="past-banner"' in html
    idle = row(html, "model-idle")
    assert 'data-status="satisfied"' in idle  # as it was: on demand, not stopped
    assert "changed since" in idle
    assert 'id="add-model"' not in html and "/console/act/" not in html
    html = await admin.page(f"/console/models/idle?at={then}")
    assert "/console/act/" not in html
    assert "for the present only" in html


async def _shown(admin: Browser, name: str) -> bool:
    return f'id="model-{name}"' in await admin.page("/console/models")


def test_every_message_the_fleet_pages_name_is_written_in_english_and_german() -> None:
    from llmgw.services.console.i18n import Catalog

    catalog = Catalog.load()
    templates = Path(__file__).parent.parent / "services" / "console" / "templates"
    used: set[str] = set()
    for name in ("overview", "nodes", "node", "nodes_parts", "models", "model", "models_parts"):
        text = (templates / f"{name}.html").read_text()
        used |= set(re.findall(r"""t\(["']((?:overview|nodes|models)\.[a-z_.]+[a-z_])["']""", text))
        # Keys made from a prefix and a word: every word the pages can give it.
        for prefix, words in {
            "nodes.state.": ("ready", "cordoned", "draining", "lost"),
            "nodes.count.": ("ready", "cordoned", "draining", "lost"),
            "overview.nodes.": ("ready", "cordoned", "draining", "lost"),
            "models.standing.": ("satisfied", "short", "parked", "stopped"),
            "models.count.": ("satisfied", "short", "parked", "stopped"),
            "overview.models.": ("satisfied", "short", "parked", "stopped"),
            "nodes.replica_state.": ("placed", "starting", "ready", "draining", "stopped", "failed"),
            "models.replica_state.": ("placed", "starting", "ready", "draining", "stopped", "failed"),
            "models.restart.": ("queued", "replacing"),
            "models.measured.basis.": ("slo", "knee"),
        }.items():
            used |= {prefix + w for w in words}
    missing = {lang: sorted(k for k in used if catalog.text(lang, k) is None) for lang in ("en", "de")}
    assert missing == {"en": [], "de": []}
