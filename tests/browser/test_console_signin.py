"""Signing in and out of the console, CSRF, the viewer's console and the person's language, in Chromium
against a running `llmgw up`."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
from playwright.sync_api import Page, expect

from tests.browser.console import ADMIN, LEAVER, POLYGLOT, PROJECT, TEAM_ADMIN, VIEWER, Console, cookie_header
from tests.browser.pages import SESSION_COOKIE, console_links, csrf_of, form_fields, posting_forms
from tests.up import wait_for

pytestmark = pytest.mark.timeout(300)


def test_signing_in_through_the_form_shows_the_console_as_that_person(
    console: Console, open_as: Callable[..., Page]
) -> None:
    page = open_as(None, "/console/nodes")
    expect(page).to_have_url(re.compile(r"/console/login"))
    console.sign_in(page, VIEWER)
    expect(page).to_have_url(re.compile(r"/console/nodes$"))  # back where it was going
    expect(page.locator("#signed-in-as")).to_contain_text(VIEWER.name)
    session = next(c for c in page.context.cookies() if c["name"] == SESSION_COOKIE)
    assert session["httpOnly"] and session["sameSite"] == "Strict", session


def test_a_wrong_password_is_refused_on_the_form_and_signs_no_one_in(
    console: Console, open_as: Callable[..., Page]
) -> None:
    page = open_as(None, "/console/login")
    page.locator("#user").fill(VIEWER.name)
    page.locator("#password").fill("not the password at all")
    page.locator("#sign-in").click()
    expect(page.locator("#login-error")).to_be_visible()
    assert not [c for c in page.context.cookies() if c["name"] == SESSION_COOKIE]


def test_logout_revokes_the_session_so_its_old_cookie_no_longer_works(
    console: Console, open_as: Callable[..., Page]
) -> None:
    page = open_as(None, "/console/login")
    console.sign_in(page, LEAVER)
    cookie = cookie_header(page.context)
    token = next(c["value"] for c in page.context.cookies() if c["name"] == SESSION_COOKIE)
    assert console.http("GET", "/console", headers={"Cookie": cookie})[0] == 200, "signed in, the cookie works"

    page.locator("#logout").click()
    expect(page).to_have_url(re.compile(r"/console/login"))
    assert not [c for c in page.context.cookies() if c["name"] == SESSION_COOKIE], "the browser forgot it"

    # The cookie a thief copied before: revoked on the log, so the console and the API refuse it.
    wait_for(
        lambda: console.http("GET", "/console", headers={"Cookie": cookie})[0] == 303,
        "the console to send the old cookie to the sign-in form",
    )
    status, body = console.http("GET", "/api/v1/whoami", headers={"Authorization": f"Bearer {token}"})
    assert status == 401, body


def test_a_viewer_finds_no_control_to_act_on_any_page(console: Console, open_as: Callable[..., Page]) -> None:
    page = open_as(VIEWER, "/console")
    seen = []
    for path in console_links(page):
        page.goto(path)
        seen.append(path)
        assert posting_forms(page, VIEWER.name) == [], f"{path} shows the viewer controls that change something"
    assert len(seen) >= 2, f"the viewer sees the pages of the console: {seen}"


def test_a_hand_made_post_by_a_viewer_is_refused_as_is_one_without_the_csrf_token(
    console: Console, open_as: Callable[..., Page]
) -> None:
    secret = console.ctl("key", "create", "--project", PROJECT, "--name", "viewer-target").split()[0]
    admin = open_as(ADMIN, "/console/tenants")
    action, fields = form_fields(admin.locator(f"#revoke-{secret.split('-')[1]}"))  # the admin's own control

    viewer = open_as(VIEWER, "/console/tenants")
    as_viewer = {**fields, "csrf": csrf_of(viewer)}
    status, body = console.http("POST", action, form=as_viewer, headers={"Cookie": cookie_header(viewer.context)})
    assert status == 403, f"a viewer's own {action} (with its CSRF token) is refused by the service: {status} {body}"

    without_csrf = {k: v for k, v in fields.items() if k != "csrf"}
    status, body = console.http("POST", action, form=without_csrf, headers={"Cookie": cookie_header(admin.context)})
    assert status == 403, f"an admin's {action} without the CSRF token is refused: {status} {body}"
    wrong_csrf = {**fields, "csrf": csrf_of(viewer)}  # another session's token is no better
    status, body = console.http("POST", action, form=wrong_csrf, headers={"Cookie": cookie_header(admin.context)})
    assert status == 403, f"an admin's {action} with another session's CSRF token is refused: {status} {body}"


def test_the_language_switch_shows_german_and_keeps_it_after_signing_in_again(
    console: Console, open_as: Callable[..., Page]
) -> None:
    page = open_as(None, "/console/login")
    console.sign_in(page, POLYGLOT)
    expect(page.locator("html")).to_have_attribute("lang", "en")
    english = page.locator("#logout").inner_text()

    page.locator("#language").select_option("de")
    page.locator("form[action='/console/language'] [type=submit]").click()
    expect(page.locator("html")).to_have_attribute("lang", "de")
    assert page.locator("#logout").inner_text() != english, "the page's words are German"

    page.locator("#logout").click()
    expect(page).to_have_url(re.compile(r"/console/login"))
    # A new browser that asks for English: the choice is the person's (an event), not this browser's cookie.
    again = open_as(None, "/console/login", locale="en-US")
    console.sign_in(again, POLYGLOT)
    expect(again.locator("html")).to_have_attribute("lang", "de")
    events = console.api(f"/api/v1/audit?actor=user:{POLYGLOT.name}&type=user.language_set")
    assert events["events"], "the person's choice is an event of theirs on the log"


def test_a_team_admin_who_signs_in_lands_on_a_page_it_may_see(console: Console, open_as: Callable[..., Page]) -> None:
    page = open_as(None, "/console/login")
    console.sign_in(page, TEAM_ADMIN)
    expect(page.locator("#main")).to_be_visible()
    assert page.locator("#error-message").count() == 0, f"{page.url}: {page.locator('#main').inner_text()}"
    nav = page.eval_on_selector_all("nav a", "as => as.map(a => a.getAttribute('href'))")
    assert "/console/tenants" in nav, f"its team's keys, usage and people are in reach: {nav}"
