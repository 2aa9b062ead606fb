"""Every page of the console, checked by axe-core in Chromium (no serious or critical violation) and
shown without a script error or anything the Content-Security-Policy refused: signed out (the sign-in
form), as the cluster admin (every control), as a team admin, and at a past moment (the marks)."""

from __future__ import annotations

import re

import pytest
from playwright.sync_api import Page, expect

from tests.browser.conftest import Signed
from tests.browser.console import ADMIN, PROJECT, TEAM_ADMIN, Console
from tests.browser.pages import console_links, serious_violations

pytestmark = pytest.mark.timeout(300)


def checked(page: Page, signed: Signed, paths: list[str]) -> dict[str, list[str]]:
    """Each path's serious and critical violations and its script or CSP errors; only paths with some."""
    found: dict[str, list[str]] = {}
    for path in paths:
        page.goto(path)
        expect(page.locator("#main")).to_be_visible()
        problems = serious_violations(page) + signed.errors[page]
        signed.errors[page].clear()
        if problems:
            found[path] = problems
    return found


def report(found: dict[str, list[str]]) -> str:
    return "\n".join(f"{path}:\n  " + "\n  ".join(problems) for path, problems in found.items())


def test_the_sign_in_form_has_no_serious_accessibility_violation(console: Console, open_as: Signed) -> None:
    page = open_as(None, "")
    found = checked(page, open_as, ["/console/login"])
    assert not found, report(found)


def test_every_page_an_admin_sees_has_no_serious_accessibility_violation(console: Console, open_as: Signed) -> None:
    page = open_as(ADMIN)
    paths = console_links(page)
    assert len(paths) >= 8, f"the admin reaches every page of the console: {paths}"
    found = checked(page, open_as, paths)
    assert not found, report(found)


def test_pages_at_a_past_moment_with_their_marks_have_no_serious_accessibility_violation(
    console: Console, open_as: Signed
) -> None:
    console.ctl("org", "create", "later")  # something the past did not have, so now differs from it
    page = open_as(ADMIN)
    paths = [f"{p}{'&' if '?' in p else '?'}at=1m" for p in console_links(page, details=False)]
    found = checked(page, open_as, paths)
    assert not found, report(found)


def test_the_pages_a_team_admin_sees_have_no_serious_accessibility_violation(console: Console, open_as: Signed) -> None:
    page = open_as(TEAM_ADMIN, "/console/tenants")  # the fleet's pages are a cluster viewer's
    paths = console_links(page)
    assert paths, "the team admin reaches its pages"
    found = checked(page, open_as, paths)
    assert not found, report(found)


def test_a_person_signs_in_and_makes_a_key_with_the_keyboard_alone(console: Console, open_as: Signed) -> None:
    page = open_as(None, "/console/login")
    page.keyboard.press("Tab")
    assert page.evaluate("() => document.activeElement.classList.contains('skip')"), "the first stop skips to the page"
    tab_to(page, "user")
    page.keyboard.type(ADMIN.name)
    page.keyboard.press("Tab")
    page.keyboard.type(console.password(ADMIN))
    page.keyboard.press("Enter")
    expect(page.locator("#signed-in-as")).to_be_visible()

    page.goto("/console/tenants")
    tab_to(page, "key-create-project")
    page.keyboard.type(f"project:{PROJECT}")
    page.keyboard.press("Tab")
    page.keyboard.type("by-keyboard")
    page.keyboard.press("Enter")  # submits the form the field is in
    expect(page.locator("#outcome-message")).to_have_attribute("data-outcome", "applied")
    expect(page.locator("#outcome-message")).to_contain_text("by-keyboard")
    expect(page.locator("#new-secret")).to_have_value(re.compile(r"^llmgw-"))


def tab_to(page: Page, element_id: str, most: int = 200) -> None:
    """Press Tab until the element with ``element_id`` has the focus (fails after ``most`` presses)."""
    for _ in range(most):
        if page.evaluate("() => document.activeElement && document.activeElement.id") == element_id:
            return
        page.keyboard.press("Tab")
    raise AssertionError(f"#{element_id} cannot be reached with Tab on {page.url}")
