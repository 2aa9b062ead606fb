"""The console in a real browser: one `llmgw up` serving the tiny GGUF, people for each role made with the
real CLI, and Chromium (Debian's, never one Playwright downloads) signed in once per role through the real
/console/login form. Shared by the browser tests (tests/browser/conftest.py) and the screenshot script
(``python -m tests.browser.screenshots``)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
from playwright.sync_api import Browser, BrowserContext, Page, Playwright, sync_playwright

from tests.gguf_tiny import write_tiny_gguf
from tests.up import LLMGW, Up, nats_servers, wait_for

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
MODEL = "tiny"  # served from the start, for the gateway requests the tests make
PASSWORD = "correct horse battery staple"  # every test person's (12 characters at least)

# The tenants the people are bound to: a team admin of acme/ml must not reach acme/web's keys.
ORG, TEAM, PROJECT = "acme", "acme/ml", "acme/ml/chat"
OTHER_TEAM, OTHER_PROJECT = "acme/web", "acme/web/site"


class Person(msgspec.Struct, frozen=True):
    name: str
    role: str  # as `ctl user grant` names it; "" for the first administrator (cluster-admin already)
    scope: str
    password: str = PASSWORD


# One person per role the console shows differently, plus people of their own for the tests that change
# the person itself (language; logout revokes the session, so it must not be one the others share).
ADMIN = Person("admin", "", "cluster")
VIEWER = Person("vera", "viewer", "cluster")
TEAM_ADMIN = Person("tom", "team-admin", f"team:{TEAM}")
POLYGLOT = Person("lena", "viewer", "cluster")
LEAVER = Person("otto", "viewer", "cluster")
PEOPLE = (VIEWER, TEAM_ADMIN, POLYGLOT, LEAVER)


def chromium() -> str | None:
    """The Chromium to drive: ``$LLMGW_TEST_CHROMIUM``, else the first on PATH (Debian's ``chromium``)."""
    chosen = os.environ.get("LLMGW_TEST_CHROMIUM")
    if chosen:
        return chosen if Path(chosen).exists() else None
    return next((found for name in CHROMIUM_NAMES if (found := shutil.which(name))), None)


NO_CHROMIUM = (
    "no Chromium to drive: install Debian's 'chromium' package (`sh ops/install-test-tools.sh` does) "
    "or set LLMGW_TEST_CHROMIUM to a Chromium or Chrome binary"
)


@contextmanager
def launched(executable: str) -> Iterator[tuple[Playwright, Browser]]:
    """Playwright with the given Chromium; stopped on exit."""
    pw = sync_playwright().start()
    try:
        browser = pw.chromium.launch(executable_path=executable, args=["--no-sandbox", "--disable-gpu"])
        try:
            yield pw, browser
        finally:
            browser.close()
    finally:
        pw.stop()


class Console:
    """One `llmgw up` on a data directory of its own, its people, and the tiny model added."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.up = Up(base / "data")
        self.states: dict[str, Path] = {}  # person's name → the signed-in context's storage state

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.up.admin_port}"

    @property
    def gateway(self) -> str:
        return f"http://127.0.0.1:{self.up.port}"

    def start(self) -> Console:
        self.up.start()
        self.ctl("org", "create", ORG)
        for team in (TEAM, OTHER_TEAM):
            self.ctl("team", "create", team)
        for project in (PROJECT, OTHER_PROJECT):
            self.ctl("project", "create", project)
        for person in PEOPLE:
            self.ctl("user", "add", person.name, "--password-stdin", stdin=person.password + "\n")
            self.ctl("user", "grant", person.name, person.role, person.scope)
        tiny = write_tiny_gguf(self.base / "tiny.gguf")
        self.ctl("model", "add", MODEL, "--source", str(tiny), "--cpu-cores", "1", "--memory-gb", "0.1")
        return self

    def restart(self) -> None:
        """Stop `llmgw up` and start it again on the same data directory and ports (the admin API with it:
        `up` has no way to restart the admin API alone)."""
        assert self.up.stop() == 0, self.up.output()
        for pid in nats_servers(self.up.data_dir):  # its nats-server goes with it; wait rather than race it
            wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists(), f"nats-server {pid} to end")
        self.up.start()

    def stop(self) -> None:
        proc = self.up.proc
        if proc is not None and proc.poll() is None:
            self.up.stop()
        for pid in nats_servers(self.up.data_dir):
            os.kill(pid, signal.SIGKILL)

    def admin_password(self) -> str:
        return (self.up.data_dir / "admin-password").read_text().strip()

    def password(self, person: Person) -> str:
        return self.admin_password() if person is ADMIN else person.password

    def ctl(self, *args: str, stdin: str | None = None) -> str:
        """``llmgw ctl ARGS`` as the first administrator; its stdout. Fails the test when it fails."""
        done = self.cli("ctl", *args, stdin=stdin)
        assert done.returncode == 0, f"llmgw ctl {' '.join(args)} failed ({done.returncode}): {done.stderr}"
        return done.stdout

    def cli(self, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
        env = {**os.environ, "LLMGW_DATA_DIR": str(self.up.data_dir)}
        env.pop("LLMGW_NATS_URL", None)
        env.pop("LLMGW_API_URL", None)
        env.pop("LLMGW_TOKEN", None)
        return subprocess.run([LLMGW, *args], capture_output=True, text=True, env=env, input=stdin, timeout=120)

    # --- the browser side ---------------------------------------------------------------------------

    def context(self, browser: Browser, person: Person | None = None, **options: Any) -> BrowserContext:
        """A new context, signed in as ``person`` (from the storage state its first sign-in left), or
        signed out (None). English unless ``locale`` says otherwise."""
        options.setdefault("locale", "en-US")
        if person is not None:
            if person.name not in self.states:
                self.states[person.name] = self.sign_in_once(browser, person)
            options["storage_state"] = str(self.states[person.name])
        context = browser.new_context(base_url=self.url, **options)
        context.set_default_timeout(30_000)
        return context

    def sign_in_once(self, browser: Browser, person: Person) -> Path:
        context = browser.new_context(base_url=self.url, locale="en-US")
        try:
            page = context.new_page()
            self.sign_in(page, person)
            state = self.base / f"state-{person.name}.json"
            context.storage_state(path=str(state))
            return state
        finally:
            context.close()

    def sign_in(self, page: Page, person: Person) -> None:
        """Through the real /console/login form, as a person would; waits until the console is shown."""
        if "/console/login" not in page.url:  # else keep the form's ?next= (where the person was going)
            page.goto("/console/login")
        page.locator("#user").fill(person.name)
        page.locator("#password").fill(self.password(person))
        page.locator("#sign-in").click()
        page.wait_for_url(lambda url: "/console/login" not in url)

    # --- the gateway and the admin API over plain HTTP ----------------------------------------------

    def chat(self, key: str, model: str = MODEL) -> tuple[int, str]:
        """One chat request to the gateway: its status and body (0: nothing answered)."""
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        request = urllib.request.Request(
            f"{self.gateway}/v1/chat/completions",
            data=body.encode(),
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
        )
        return _send(request)

    def http(
        self, method: str, path: str, *, form: dict[str, str] | None = None, headers: dict[str, str] | None = None
    ) -> tuple[int, str]:
        """A hand-made request to the admin API (no browser): its status and body; redirects not followed."""
        data = urllib.parse.urlencode(form).encode() if form is not None else None
        request = urllib.request.Request(f"{self.url}{path}", data=data, method=method, headers=headers or {})
        if form is not None:
            request.add_header("Content-Type", "application/x-www-form-urlencoded")
        return _send(request, follow=False)

    def api(self, path: str) -> Any:
        """``GET path`` of the admin API as the first administrator (its token in the data directory), as JSON."""
        token = (self.up.data_dir / "admin-token").read_text().strip()
        status, body = self.http("GET", path, headers={"Authorization": f"Bearer {token}"})
        assert status == 200, f"GET {path}: {status} {body}"
        return json.loads(body)

    def wait_model_answers(self, key: str, model: str = MODEL, deadline_s: float = 120.0) -> None:
        wait_for(lambda: self.chat(key, model)[0] == 200, f"model {model} to answer with the key", deadline_s)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


def _send(request: urllib.request.Request, follow: bool = True) -> tuple[int, str]:
    opener = urllib.request.build_opener() if follow else urllib.request.build_opener(_NoRedirect)
    try:
        with opener.open(request, timeout=60) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except OSError as e:
        return 0, str(e)


def cookie_header(context: BrowserContext) -> str:
    """The context's cookies for the admin API, as a Cookie header a hand-made request sends."""
    return "; ".join(f"{c['name']}={c['value']}" for c in context.cookies())
