"""Fixtures for the console's browser tests: per test module one `llmgw up` (with the tiny GGUF and a
person for each role) and one Chromium; per test a fresh context signed in as the person it asks for.

Playwright's sync API runs its own event loop in a greenlet of this thread; the suite's asyncio loop is
not running while a sync test runs, so the two never meet. Both are module-scoped so nothing of
Playwright outlives a module."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, expect

from tests.browser.console import NO_CHROMIUM, Console, Person, chromium, launched

# Waits on the page (expect) are for a condition with a deadline; generous, because a loaded 2-core
# machine runs the engines, the console and the browser at once.
expect.set_options(timeout=20_000)


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    executable = chromium()
    if executable is None:
        pytest.skip(NO_CHROMIUM)
    with launched(executable) as (_, b):
        yield b


@pytest.fixture(scope="module")
def console(tmp_path_factory: pytest.TempPathFactory, browser: Browser) -> Iterator[Console]:
    c = Console(tmp_path_factory.mktemp("console"))
    try:
        yield c.start()
    finally:
        c.stop()


class Signed:
    """Opens pages as a person; every context it made is closed after the test. Errors a page's script
    throws, and what the Content-Security-Policy refused, are kept per page (``errors``)."""

    def __init__(self, console: Console, browser: Browser) -> None:
        self.console = console
        self.browser = browser
        self.contexts: list[BrowserContext] = []
        self.errors: dict[Page, list[str]] = {}

    def __call__(self, person: Person | None, path: str = "/console", **options: object) -> Page:
        context = self.console.context(self.browser, person, **options)
        self.contexts.append(context)
        page = context.new_page()
        self.watch(page)
        if path:
            page.goto(path)
        return page

    def watch(self, page: Page) -> None:
        errors = self.errors.setdefault(page, [])
        page.on("pageerror", lambda e: errors.append(f"script error: {e}"))
        page.on(
            "console",
            lambda m: (
                errors.append(f"console {m.type}: {m.text}")
                if m.type == "error" and "Content Security Policy" in m.text
                else None
            ),
        )

    def close(self) -> None:
        for context in self.contexts:
            context.close()


@pytest.fixture
def open_as(console: Console, browser: Browser) -> Iterator[Callable[..., Page]]:
    """``open_as(person, path="/console")``: a page in a new context signed in as ``person`` (None: signed
    out), at ``path``."""
    signed = Signed(console, browser)
    yield signed
    signed.close()
