"""Screenshots of every console page for the docs: ``python -m tests.browser.screenshots [OUT_DIR]``.

Not part of the suite. Starts its own `llmgw up` with the tiny GGUF (tests/browser/console.py), gives it
something to show (tenants, people, keys, a limit, requests and refusals, a revoked key), signs in as the
first administrator in Chromium and writes one PNG per page into OUT_DIR (default docs/console/), plus
the tenants page at a past moment with its marks against now.
"""

from __future__ import annotations

import math
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

from playwright.sync_api import Page

from tests.browser.console import ADMIN, MODEL, NO_CHROMIUM, PROJECT, Console, chromium, launched
from tests.up import wait_for

OUT = Path(__file__).resolve().parents[2] / "docs" / "console"
VIEWPORT = {"width": 1280, "height": 800}
PAGES = (  # file name, path ("{node}": the first node's page)
    ("overview", "/console"),
    ("nodes", "/console/nodes"),
    ("node", "{node}"),
    ("models", "/console/models"),
    ("model", f"/console/models/{MODEL}"),
    ("tenants", "/console/tenants"),
    ("people", "/console/people"),
    ("usage", "/console/usage?range=hour"),
    ("audit", "/console/audit"),
    ("mirror", "/console/mirror"),
)


def something_to_show(console: Console) -> tuple[str, int]:
    """Keys, a limit, answered and refused requests, a key revoked after the moment returned (unix s)."""
    secret = console.ctl("key", "create", "--project", PROJECT, "--name", "chat-app").split()[0]
    spare = console.ctl("key", "create", "--project", PROJECT, "--name", "old-batch").split()[0]
    console.ctl("key", "create", "--project", "acme/web/site", "--name", "site")
    console.wait_model_answers(secret)
    for _ in range(5):
        console.chat(secret)
    console.ctl("limit", "set", f"project:{PROJECT}", "--rpm", "3")
    wait_for(lambda: console.chat(secret)[0] == 429, "a request over the limit to be refused")
    console.ctl("budget", "set", "team:acme/ml", "--usd", "50", "--period", "month")
    moment = math.ceil(time.time())
    wait_for(lambda: time.time() > moment + 1, "the clock to pass the moment")
    console.ctl("key", "revoke", spare.split("-")[1], "--reason", "rotated")
    console.ctl("org", "create", "globex")
    return secret, moment


def shoot(page: Page, path: str, to: Path) -> None:
    page.goto(path)
    page.locator("#main").wait_for()
    page.wait_for_load_state("networkidle")
    page.screenshot(path=str(to), full_page=True)
    print(f"wrote {to}")


def main(out: Path = OUT) -> None:
    executable = chromium()
    if executable is None:
        sys.exit(NO_CHROMIUM)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmgw-shots-") as tmp:
        console = Console(Path(tmp))
        try:
            console.start()
            _, moment = something_to_show(console)
            with launched(executable) as (_, browser):
                signed_out = browser.new_context(base_url=console.url, locale="en-US", viewport=VIEWPORT)
                shoot(signed_out.new_page(), "/console/login", out / "login.png")
                page = console.context(browser, ADMIN, viewport=VIEWPORT).new_page()
                page.goto("/console/nodes")
                node = page.locator("#main a[href^='/console/nodes/']").first.get_attribute("href") or "/console/nodes"
                for name, path in PAGES:
                    shoot(page, path.format(node=node), out / f"{name}.png")
                at = datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%S")
                shoot(page, f"/console/tenants?at={at}", out / "tenants-past.png")
        finally:
            console.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
