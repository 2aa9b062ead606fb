"""Signing in through an OpenID provider in Chromium: the console's button, the provider's own login page
(tests/idp: oidc-provider on node), and back into the console; the CLI's device flow finished in the
browser. One `llmgw up` for the module, with the provider added and its groups mapped by `llmgw ctl sso`."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Browser, BrowserContext, Page, expect

from tests.browser.console import Console
from tests.browser.pages import SESSION_COOKIE
from tests.idp.harness import USERS, Client, Idp, unavailable_reason
from tests.up import LLMGW, wait_for

pytestmark = pytest.mark.timeout(300)

CLIENT_ID = "llmgw-console"
SECRET = "the-browser-providers-client-secret-0123456789"
SECRET_ENV = "LLMGW_TEST_SSO_CLIENT_SECRET"


class SsoConsole:
    """`llmgw up` (only the first administrator) and a provider it signs people in with."""

    def __init__(self, base: Path) -> None:
        self.console = Console(base)
        self.idp = Idp(
            [Client(CLIENT_ID, SECRET, [f"{self.console.url}/console/sso/corp/callback"])], device_interval_s=1
        )

    @property
    def url(self) -> str:
        return self.console.url

    def start(self) -> SsoConsole:
        self.idp.start()
        # `llmgw up` reads the client secret from its environment at each sign-in.
        with pytest.MonkeyPatch.context() as env:
            env.setenv(SECRET_ENV, SECRET)
            self.console.up.start()
        self.console.ctl(
            "sso", "add", "corp", "--issuer", self.idp.issuer, "--client-id", CLIENT_ID,
            "--client-secret-env", SECRET_ENV, "--display-name", "Corp",
        )  # fmt: skip
        self.console.ctl("sso", "map", "corp", "ml-admins", "--role", "cluster-admin", "--scope", "cluster")
        self.console.ctl("sso", "map", "corp", "everyone", "--role", "viewer", "--scope", "cluster")
        wait_for(
            lambda: self.console.http("GET", "/console/sso/corp")[0] == 303,
            "the console to know the provider corp",
        )
        return self

    def stop(self) -> None:
        try:
            self.console.stop()
        finally:
            self.idp.stop()


@pytest.fixture(scope="module")
def sso(tmp_path_factory: pytest.TempPathFactory, browser: Browser) -> Iterator[SsoConsole]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    s = SsoConsole(tmp_path_factory.mktemp("sso"))
    try:
        yield s.start()
    finally:
        s.stop()


@pytest.fixture
def context(sso: SsoConsole, browser: Browser) -> Iterator[BrowserContext]:
    c = browser.new_context(base_url=sso.url, locale="en-US")
    c.set_default_timeout(30_000)
    yield c
    c.close()


def at_the_provider(page: Page, login: str) -> None:
    """On the provider's own login page: the person types their name and password there."""
    page.locator("#login").fill(login)
    page.locator("#password").fill(USERS[login]["password"])
    page.locator("#submit").click()


def session_of(context: BrowserContext) -> str:
    return next((c["value"] for c in context.cookies() if c["name"] == SESSION_COOKIE), "")


def test_a_person_signs_in_at_the_providers_page_and_lands_on_the_console_page_they_asked_for(
    sso: SsoConsole, context: BrowserContext
) -> None:
    page = context.new_page()
    page.goto("/console/usage")
    expect(page).to_have_url(re.compile(r"/console/login"))
    page.locator("#sso-corp").click()
    expect(page).to_have_url(re.compile(re.escape(sso.idp.issuer) + r"/interaction/"))
    at_the_provider(page, "alice")
    expect(page).to_have_url(re.compile(r"/console/usage$"))
    expect(page.locator("#signed-in-as")).to_contain_text("alice")
    # Her roles follow her groups: ml-admins is mapped to cluster-admin, which the admin API says granted it.
    status, body = sso.console.http("GET", "/api/v1/users", headers={"Authorization": f"Bearer {session_of(context)}"})
    assert status == 200, body
    assert re.search(r'"name": ?"alice".*?"role": ?"cluster-admin".*?"group": ?"ml-admins"', body, re.S), body


def test_a_callback_whose_state_this_server_never_sent_is_refused(sso: SsoConsole, context: BrowserContext) -> None:
    page = context.new_page()
    page.goto("/console/sso/corp")
    at_the_provider(page, "bob")  # a real sign-in, so the provider holds a session for bob…
    expect(page).to_have_url(re.compile(r"/console$"))
    context.clear_cookies()
    page.goto("/console/sso/corp/callback?code=a-stolen-code&state=a-state-of-the-attackers")  # …and a forged callback
    expect(page.locator("#login-error")).to_contain_text("this sign-in's state is unknown, expired or already used")
    assert session_of(context) == ""


def test_a_next_pointing_at_another_host_lands_on_the_console(sso: SsoConsole, context: BrowserContext) -> None:
    page = context.new_page()
    page.goto("/console/sso/corp?next=https://evil.example.org/console")
    at_the_provider(page, "bob")
    expect(page).to_have_url(re.compile(re.escape(sso.url) + r"/console$"))


def test_a_person_in_no_mapped_group_is_told_so_on_the_sign_in_page(sso: SsoConsole, context: BrowserContext) -> None:
    page = context.new_page()
    page.goto("/console/sso/corp")
    at_the_provider(page, "carol")
    expect(page.locator("#login-error")).to_contain_text("carol is in no group at Corp")  # its display name
    assert session_of(context) == ""


def test_llmgw_login_sso_is_finished_in_the_browser_at_the_address_it_prints(
    sso: SsoConsole, context: BrowserContext, tmp_path: Path
) -> None:
    env = {**os.environ, "LLMGW_DATA_DIR": str(sso.console.up.data_dir), "XDG_CONFIG_HOME": str(tmp_path)}
    for variable in ("LLMGW_NATS_URL", "LLMGW_API_URL", "LLMGW_TOKEN"):
        env.pop(variable, None)
    cli = subprocess.Popen(
        [LLMGW, "login", "--sso", "corp"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        assert cli.stdout is not None
        said = re.match(r"open (\S+) and enter the code (\S+)", cli.stdout.readline())
        assert said is not None
        page = context.new_page()
        page.goto(said.group(1))
        page.locator("input[name=user_code]").fill(said.group(2))
        page.locator("#submit").click()
        page.locator("#confirm").click()
        at_the_provider(page, "bob")
        expect(page.locator("#done")).to_be_visible()
        out, _ = cli.communicate(timeout=60)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.wait()
    assert cli.returncode == 0, out
    assert "signed in as bob" in out
    assert (tmp_path / "llmgw" / "credentials.json").exists()
