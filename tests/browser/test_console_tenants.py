"""Keys, limits and what a team admin may reach, on the console's tenants and usage pages, in Chromium
against a running `llmgw up` whose gateway serves the tiny GGUF."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from datetime import UTC, datetime

import pytest
from playwright.sync_api import Locator, Page, expect

from tests.browser.console import ADMIN, OTHER_PROJECT, PROJECT, TEAM_ADMIN, Console, cookie_header
from tests.browser.pages import choices, choose, csrf_of, submit
from tests.up import wait_for

pytestmark = pytest.mark.timeout(300)


def create_key(page: Page, project: str, name: str) -> str:
    """Fill the tenants page's key form and submit it; the secret it shows once."""
    choose(page.locator("#key-create-project"), f"project:{project}")
    page.locator("#key-create-name").fill(name)
    expect(submit(page.locator("#key-create"))).to_have_attribute("data-outcome", "applied")
    secret = page.locator("#new-secret").input_value()
    assert secret.startswith("llmgw-"), secret
    expect(key_row(page, secret)).to_be_visible()  # the page shows it live
    return secret


def prefix_of(secret: str) -> str:
    return secret.split("-")[1]


def key_row(page: Page, secret: str) -> Locator:
    return page.locator(f"#key-{prefix_of(secret)}")


def test_a_key_created_on_the_page_is_shown_once_then_only_by_its_prefix_and_answers_at_the_gateway(
    console: Console, open_as: Callable[..., Page]
) -> None:
    page = open_as(ADMIN, "/console/tenants")
    secret = create_key(page, PROJECT, "shown-once")
    expect(key_row(page, secret)).to_have_attribute("data-state", "active")  # the live list has it

    page.reload()
    expect(key_row(page, secret)).to_contain_text(prefix_of(secret))
    assert secret not in page.content(), "after the first answer the page never shows the secret again"
    console.wait_model_answers(secret)


def test_a_key_revoked_on_the_page_is_refused_and_the_time_slider_shows_it_live_before(
    console: Console, open_as: Callable[..., Page]
) -> None:
    page = open_as(ADMIN, "/console/tenants")
    page.on("dialog", lambda dialog: dialog.accept())  # the revoke button asks to confirm
    secret = create_key(page, PROJECT, "to-revoke")
    console.wait_model_answers(secret)
    # A moment after the key was made, on the second (the moment field's precision); revoked after it.
    between = math.ceil(time.time())
    wait_for(lambda: time.time() > between + 0.5, "the clock to pass the moment picked")

    expect(submit(page.locator(f"#revoke-{prefix_of(secret)}"))).to_have_attribute("data-outcome", "applied")
    expect(key_row(page, secret)).to_have_attribute("data-state", "revoked")
    wait_for(lambda: console.chat(secret)[0] == 401, "the gateway to refuse the revoked key")

    moment = datetime.fromtimestamp(between, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    page.locator("#at").fill(moment)
    page.locator("#moment [type=submit]").click()
    expect(page.locator("#past-banner")).to_be_visible()
    row = key_row(page, secret)
    expect(row).to_have_attribute("data-state", "active")  # as it was: live
    expect(row.locator(".diff")).to_contain_text("state")  # marked: its state differs from now
    assert page.locator(f"#revoke-{prefix_of(secret)}").count() == 0, "the past shows no control to act"


def test_a_limit_set_on_the_page_refuses_requests_and_the_429s_show_in_usage(
    console: Console, open_as: Callable[..., Page]
) -> None:
    limited = "acme/ml/limited"  # a project of its own, so its limit slows no other test
    console.ctl("project", "create", limited)
    page = open_as(ADMIN, "/console/tenants")
    secret = create_key(page, limited, "limited")
    console.wait_model_answers(secret)

    choose(page.locator("#limit-set-scope"), f"project:{limited}")
    page.locator("#limit-set-rpm").fill("1")
    expect(submit(page.locator("#limit-set"))).to_have_attribute("data-outcome", "applied")
    expect(page.locator("#limits")).to_contain_text(limited)

    wait_for(lambda: console.chat(secret)[0] == 429, "a request over the limit to be refused (429)")

    usage = open_as(ADMIN, f"/console/usage?scope=project:{limited}&by=key&range=hour")
    refusals = usage.locator("#usage-totals td[data-refusals]")

    def counted() -> bool:
        usage.reload()
        return refusals.count() > 0 and any(int(r.get_attribute("data-refusals") or 0) > 0 for r in refusals.all())

    wait_for(counted, "the 429 to show in the usage page's refusals", 60)


def test_a_team_admin_cannot_reach_another_teams_keys(console: Console, open_as: Callable[..., Page]) -> None:
    theirs = console.ctl("key", "create", "--project", OTHER_PROJECT).split()[0]
    ours = console.ctl("key", "create", "--project", PROJECT).split()[0]
    admin = open_as(ADMIN, "/console/tenants")
    expect(key_row(admin, theirs)).to_be_visible()
    their_id = key_row(admin, theirs).get_attribute("data-key-id")
    assert their_id

    page = open_as(TEAM_ADMIN, "/console/tenants")
    expect(key_row(page, ours)).to_be_visible()  # its own team's keys it sees
    assert key_row(page, theirs).count() == 0, "another team's key is not listed"
    offered = choices(page.locator("#key-create-project"))
    assert f"project:{PROJECT}" in offered and not [o for o in offered if OTHER_PROJECT in o], offered

    page.goto(f"/console/tenants?project={OTHER_PROJECT}")
    assert key_row(page, theirs).count() == 0, "nor when asked for by its project"
    assert prefix_of(theirs) not in page.content()

    page.goto(f"/console/usage?scope=project:{OTHER_PROJECT}")
    expect(page.locator("#usage-problem")).to_be_visible()  # not its usage either

    form = {"csrf": csrf_of(page), "key": their_id, "reason": "not mine", "idem": "team-admin-reaches"}
    status, body = console.http(
        "POST", "/console/act/tenants/key_revoke", form=form, headers={"Cookie": cookie_header(page.context)}
    )
    assert status == 403, f"revoking another team's key by hand is refused: {status} {body}"
    console.wait_model_answers(theirs)  # still working: nothing was revoked
