"""Reading the console's pages in a test: its links, its forms, its CSRF token, what axe-core finds."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from axe_playwright_python.sync_playwright import Axe
from playwright.sync_api import Locator, Page

SESSION_COOKIE = "llmgw_session"
# Forms every signed-in page has that change only the person's own session or language.
OWN_FORMS = ("/console/language", "/console/logout")
OWN_PEOPLE_ACTIONS = "/console/act/people/"
SERIOUS = ("serious", "critical")


def csrf_of(page: Page) -> str:
    """The CSRF token the page was served with (every form carries it; the body holds it for scripts)."""
    token = page.locator("body").get_attribute("data-csrf")
    assert token, f"{page.url} carries no CSRF token"
    return token


def posting_forms(page: Page, person: str = "") -> list[str]:
    """The action of each form on the page that would change something (POST), but the person's own: the
    language and logout forms, and a people action on ``person`` themself (a person manages their own
    tokens and password whatever their role)."""
    found: list[list[Any]] = page.eval_on_selector_all(
        "form",
        """fs => fs.filter(f => f.method.toLowerCase() === 'post')
                   .map(f => [new URL(f.action).pathname, Object.fromEntries(new FormData(f).entries())])""",
    )
    return [
        action
        for action, fields in found
        if action not in OWN_FORMS and not (action.startswith(OWN_PEOPLE_ACTIONS) and fields.get("name") == person)
    ]


def action_forms(page: Page, action: str = "") -> list[tuple[str, dict[str, str]]]:
    """Each console action form on the page (its path under /console/act/, optionally ending in ``action``)
    with the fields it would send as they stand."""
    found: list[list[Any]] = page.eval_on_selector_all(
        "form[action^='/console/act/']",
        "fs => fs.map(f => [new URL(f.action).pathname, Object.fromEntries(new FormData(f).entries())])",
    )
    return [(path, fields) for path, fields in found if not action or path.endswith("/" + action)]


def submit(form: Locator) -> Locator:
    """Submit an action form and wait for its own outcome (not the one an earlier action left shown);
    the outcome (``#outcome-message``, its ``data-outcome`` applied or refused)."""
    page = form.page
    before = page.locator("#outcome").inner_text()
    form.locator("[type=submit]").click()
    page.wait_for_function(
        """old => {
            const o = document.getElementById('outcome-message');
            return o !== null && document.getElementById('outcome').innerText !== old;
        }""",
        arg=before,
    )
    return page.locator("#outcome-message")


def choose(field: Locator, value: str) -> None:
    """Put ``value`` in a form's choice: a select's option, or a text field with its list of suggestions."""
    if field.evaluate("e => e.tagName") == "SELECT":
        field.select_option(value)
    else:
        field.fill(value)


def choices(field: Locator) -> list[str]:
    """The values a form's choice offers: a select's options, or the options of a text field's datalist."""
    found: list[str] = field.evaluate(
        "e => [...(e.tagName === 'SELECT' ? e.options : (e.list ? e.list.options : []))].map(o => o.value)"
    )
    return found


def form_fields(form: Locator) -> tuple[str, dict[str, str]]:
    """A form's action path and the fields it would send as they stand."""
    found: list[Any] = form.evaluate("f => [new URL(f.action).pathname, Object.fromEntries(new FormData(f).entries())]")
    return found[0], found[1]


def console_links(page: Page, details: bool = True) -> list[str]:
    """The pages a person can reach from here: the navigation's, and (``details``) the first link of each
    list page to a page of its own kind (a node, a model), so detail pages are visited too."""
    nav = _paths(page, "nav a[href^='/console']")
    found = list(nav)
    if details:
        for path in nav:
            page.goto(path)
            for link in _paths(page, "#main a[href^='/console/']"):
                if link.startswith(path.rstrip("/") + "/") and link not in found:
                    found.append(link)
                    break
    return found


def _paths(page: Page, selector: str) -> list[str]:
    hrefs: list[str] = page.eval_on_selector_all(selector, "as => as.map(a => a.getAttribute('href'))")
    paths = []
    for href in hrefs:
        parts = urlsplit(href)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        if path not in paths:
            paths.append(path)
    return paths


def serious_violations(page: Page) -> list[str]:
    """axe-core's serious and critical violations on the page as it stands, one line each with where."""
    results = Axe().run(page)
    lines = []
    for v in results.response["violations"]:
        if v.get("impact") in SERIOUS:
            targets = [", ".join(str(t) for t in n["target"]) for n in v["nodes"][:5]]
            lines.append(f"{v['id']} ({v['impact']}): {v['help']} — at {targets}")
    return lines
