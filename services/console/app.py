"""The console at ``/console``: pages over the read models, served by the admin API (and so by ``llmgw up``).

Server-rendered pages (Jinja2) with a little progressive enhancement (htmx, vendored, and one small
script of our own): every page works as plain HTML forms and links; with scripts, actions answer in place
and pages follow the log live through server-sent events. docs/decisions.md, "The console is
server-rendered".

Who: the session cookie holds the person's session token (services/console/session.py); a page without
one sends the browser to the sign-in form. What: every change is one command signed with that token
(services/api/act.py), decided by its service like the CLI's; a control the person may not use is not
shown, and the command is refused anyway. When: ``?at=`` shows any page as it was at a moment, marked
against now (services/console/source.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlencode, urlsplit

import jinja2
import msgspec
import structlog
from aiohttp import web

from llmgw.events.commands import roles as R
from llmgw.events.schema import people as P
from llmgw.events.schema import subjects as S
from llmgw.events.schema.envelope import RecordedEvent, utc_now
from llmgw.events.schema.subjects import EVENTS_ROOT
from llmgw.projections.usage import parse_since
from llmgw.services.api.act import Outcome, act
from llmgw.services.api.signin import Identity, Refused
from llmgw.services.console import session as SES
from llmgw.services.console.forms import BadInput, refused
from llmgw.services.console.i18n import LANGUAGES, Catalog, Formats, negotiate
from llmgw.services.console.page import IDEMPOTENCY, Ctx, Page
from llmgw.services.console.pages.identity import login_choices
from llmgw.services.console.source import Moments, Source, live_source, source_at

if TYPE_CHECKING:
    from llmgw.services.api.app import AdminApi

log = structlog.get_logger("llmgw.services.console")

HERE = Path(__file__).parent
LIVE_HEARTBEAT_S = 15.0  # a comment line keeps proxies from closing a quiet stream
LIVE_RETRY_MS = 1000  # how soon a browser reconnects after the stream ends (a restart)
USAGE_EVERY_S = 1.0  # usage changes a live page at most this often
SESSION_CSRF = web.RequestKey("console_session", str)


class Console:
    """The console's routes over one admin API."""

    def __init__(self, api: AdminApi, pages: list[Page] | None = None) -> None:
        from llmgw.services.console.pages import PAGES

        self.api = api
        self.pages = list(PAGES if pages is None else pages)
        self.by_name = {p.name: p for p in self.pages}
        self.catalog = Catalog.load()
        self.env = jinja2.Environment(
            loader=jinja2.FileSystemLoader(HERE / "templates"),
            autoescape=True,
            undefined=jinja2.ChainableUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self._live: set[asyncio.Task] = set()  # the event streams being served
        self.moments = Moments(api.store)  # the time slider's last moments, kept replayed
        self._closing = asyncio.Event()

    # -- routes ------------------------------------------------------------------------------

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/console/login", self.login_form)
        app.router.add_post("/console/login", self.login)
        app.router.add_post("/console/logout", self.logout)
        app.router.add_post("/console/language", self.language)
        app.router.add_get("/console/live", self.live)
        app.router.add_post("/console/act/{page}/{action}", self.action)
        app.router.add_static("/console/static", HERE / "static", append_version=False)
        for page in self.pages:
            app.router.add_get(page.path, self._page_handler(page))
        app.on_shutdown.append(self._close_live)

    @web.middleware
    async def headers(self, request: web.Request, handler: Callable[[web.Request], Awaitable[Any]]) -> Any:
        """Every console answer carries the CSP and refuses framing; pages are never cached."""
        response = await handler(request)
        if request.path.startswith("/console") and isinstance(response, web.StreamResponse):
            response.headers.setdefault("Content-Security-Policy", SES.CSP)
            response.headers.setdefault("X-Content-Type-Options", "nosniff")
            response.headers.setdefault("Referrer-Policy", "same-origin")
            if not request.path.startswith("/console/static"):
                response.headers.setdefault("Cache-Control", "no-store")
        return response

    # -- who ---------------------------------------------------------------------------------

    def session_token(self, request: web.Request) -> str | None:
        token = request.cookies.get(SES.COOKIE)
        return token or None

    def identify(self, request: web.Request) -> tuple[Identity, str] | None:
        """The person the session cookie stands for, and its token; None when there is none that works."""
        token = self.session_token(request)
        signin = self.api.signin
        if not token or signin is None:
            return None
        who = signin.identify(f"Bearer {token}")
        return None if isinstance(who, Refused) else (who, token)

    def lang_of(self, request: web.Request, who: Identity | None) -> str:
        person = self.api.signin.people.by_name.get(who.name) if who and self.api.signin else None
        return negotiate(getattr(person, "language", "") or "", request.headers.get("Accept-Language", ""))

    def _csrf_ok(self, request: web.Request, token: str, form: dict[str, str]) -> bool:
        sent = request.headers.get(SES.CSRF_HEADER) or form.get(SES.CSRF_FIELD)
        return SES.csrf_valid(token, sent)

    # -- rendering ---------------------------------------------------------------------------

    def render(self, template: str, status: int = 200, **variables: Any) -> web.Response:
        # ctx, t and fmt go in as the template's globals, so macros imported without context see them; the
        # render is synchronous, so no other request's render can come between setting and using them.
        shared = {k: variables.get(k) for k in ("ctx", "t", "fmt", "lang")}
        body = self.env.get_template(template, globals=shared).render(**variables)
        return web.Response(text=body, status=status, content_type="text/html", charset="utf-8")

    def _bare(self, request: web.Request, lang: str) -> dict[str, Any]:
        """What every template has, signed in or not."""
        return {
            "t": self.catalog.translator(lang),
            "fmt": Formats(lang),
            "lang": lang,
            "languages": LANGUAGES,
            "request": request,
        }

    def _page_handler(self, page: Page) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        async def handler(request: web.Request) -> web.StreamResponse:
            return await self.show(page, request)

        return handler

    async def show(self, page: Page, request: web.Request) -> web.StreamResponse:
        found = self.identify(request)
        if found is None:
            return self._to_login(request)
        who, token = found
        lang = self.lang_of(request, who)
        base = self._bare(request, lang)
        try:
            at = parse_moment(request.query.get("at", ""))
        except ValueError as exc:
            return self.render("error.html", 400, **base, message=str(exc), who=who)
        now = await live_source(self.api)
        ctx = self._ctx(request, who, token, lang, now, now, page)
        if not self.visible(ctx, page):
            pages = self.nav(ctx)
            if page.path == "/console" and pages:
                # The console's front door: a team admin starts where they may look (their tenants).
                raise web.HTTPSeeOther(location=pages[0].path)
            message = ctx.t("core.forbidden", need=R.needs("viewer", R.CLUSTER))
            return self.render("error.html", 403, **base, ctx=ctx, nav=pages, message=message)
        if at is None:
            data = await page.gather(ctx)
            return self.render(page.template, **base, ctx=ctx, nav=self.nav(ctx), idem=new_idem, **data)
        async with source_at(self.api, at, self.moments) as then:
            ctx.source = then
            data = await page.gather(ctx)
            return self.render(page.template, **base, ctx=ctx, nav=self.nav(ctx), idem=new_idem, **data)

    def visible(self, ctx: Ctx, page: Page) -> bool:
        """Whether the person may look at the page: fleet pages need a viewer of the cluster; a tenant's
        pages (``scope == "tenant"``) are open to anyone signed in and show only what they may see."""
        return getattr(page, "scope", "cluster") == "tenant" or ctx.can("viewer")

    def _ctx(
        self, request: web.Request, who: Identity, token: str, lang: str, source: Source, now: Source, page: Page | None
    ) -> Ctx:
        ctx = Ctx(
            request=request,
            api=self.api,
            who=who,
            token=token,
            lang=lang,
            t=self.catalog.translator(lang),
            fmt=Formats(lang),
            csrf=SES.csrf_token(token),
            source=source,
            now=now,
            params=dict(request.match_info),
            page=page,
        )
        return ctx

    def nav(self, ctx: Ctx) -> list[Page]:
        return [p for p in self.pages if p.nav and self.visible(ctx, p)]

    def _to_login(self, request: web.Request) -> web.Response:
        target = SES.safe_next(str(request.rel_url))
        raise web.HTTPSeeOther(location=f"/console/login?{_query(next=target)}")

    # -- signing in and out --------------------------------------------------------------------

    async def login_form(self, request: web.Request) -> web.StreamResponse:
        if self.identify(request) is not None:
            raise web.HTTPSeeOther(location=SES.safe_next(request.query.get("next")))
        lang = self.lang_of(request, None)
        base = {**self._bare(request, lang), **login_choices(self.api.signin)}
        return self.render("login.html", **base, next=SES.safe_next(request.query.get("next")))

    async def login(self, request: web.Request) -> web.StreamResponse:
        form = await _form(request)
        lang = self.lang_of(request, None)
        provider = form.get("provider", "").strip()  # an LDAP directory's name ("" : this server's password)
        base = {**self._bare(request, lang), **login_choices(self.api.signin), "provider": provider}
        target = SES.safe_next(form.get("next"))
        user, password = form.get("user", "").strip(), form.get("password", "")
        if self.api.signin is None:
            return self.render("login.html", 503, **base, next=target, error="signing in is not set up here")
        if not user or not password:
            return self.render("login.html", 400, **base, next=target, user=user, error=base["t"]("core.login.empty"))
        try:
            token, expires, _ = await self.api.signin.login(
                user, password, request.remote or "unknown", provider=provider
            )
        except Refused as exc:
            response = self.render(
                "login.html",
                exc.status,
                **base,
                next=target,
                user=user,
                error=self.catalog.refusal(lang, exc.code, exc.message),
            )
            if exc.retry_after_s:
                response.headers["Retry-After"] = str(exc.retry_after_s)
            return response
        response = web.HTTPSeeOther(location=target)
        max_age = max(int((expires - utc_now()).total_seconds()), 0)
        response.set_cookie(SES.COOKIE, token, **SES.cookie_options(request.secure, max_age))  # type: ignore[arg-type]
        raise response

    async def logout(self, request: web.Request) -> web.StreamResponse:
        """Revoke the session's token (a command signed with it, so the log says who ended it) and forget it."""
        form = await _form(request)
        found = self.identify(request)
        if found is not None:
            who, token = found
            if not self._csrf_ok(request, token, form):
                return self._csrf_refused(request, who)
            await act(
                self.api.store, token, P.SERVICE, "token.revoke", P.RevokeToken(name=who.name, token=who.token_id)
            )
        response = web.HTTPSeeOther(location="/console/login")
        response.del_cookie(SES.COOKIE, path="/")
        raise response

    async def language(self, request: web.Request) -> web.StreamResponse:
        """Keep the person's language with them: a ``user.language`` command, so it follows them everywhere."""
        form = await _form(request)
        found = self.identify(request)
        if found is None:
            return self._to_login(request)
        who, token = found
        if not self._csrf_ok(request, token, form):
            return self._csrf_refused(request, who)
        chosen = form.get("language", "")
        outcome = await act(
            self.api.store, token, P.SERVICE, "user.language", P.SetLanguage(name=who.name, language=chosen)
        )
        if outcome.applied:
            if self.api.signin is not None:  # the next page is in the language chosen
                await self.api.signin.folded(lambda: _language_of(self.api, who.name) == chosen)
            raise web.HTTPSeeOther(location=SES.safe_next(form.get("next")))
        lang = self.lang_of(request, who)
        return self._outcome_page(request, who, token, lang, outcome)

    # -- acting --------------------------------------------------------------------------------

    async def action(self, request: web.Request) -> web.StreamResponse:
        form = await _form(request)
        found = self.identify(request)
        if found is None:
            raise web.HTTPUnauthorized(reason="sign in first: /console/login")
        who, token = found
        if not self._csrf_ok(request, token, form):
            return self._csrf_refused(request, who)
        page = self.by_name.get(request.match_info["page"])
        handler = page.actions.get(request.match_info["action"]) if page else None
        lang = self.lang_of(request, who)
        if page is None or handler is None:
            raise web.HTTPNotFound(
                reason=f"no console action {request.match_info['page']}/{request.match_info['action']}"
            )
        if form.get("idem"):
            request[IDEMPOTENCY] = form["idem"]
        now = await live_source(self.api)
        ctx = self._ctx(request, who, token, lang, now, now, page)
        try:
            outcome = await handler(ctx, form)
        except BadInput as exc:  # a form a person filled in wrongly: a refusal saying what to give
            outcome = refused(f"{page.name}.{request.match_info['action']}", str(exc))
        return self._outcome_page(request, who, token, lang, outcome)

    def _outcome_page(
        self, request: web.Request, who: Identity, token: str, lang: str, outcome: Outcome
    ) -> web.Response:
        base = self._bare(request, lang)
        status = outcome.status if not outcome.applied else 200
        message = outcome.message if outcome.applied else self.catalog.refusal(lang, outcome.code, outcome.message)
        variables = {**base, "outcome": outcome, "message": message, "back": _back(request)}
        if request.headers.get("HX-Request"):
            # htmx swaps only 2xx answers by default: a refusal is still an answer to show, in place.
            response = self.render("outcome.html", 200, **variables)
            response.headers["X-Outcome-Status"] = str(status)
            return response
        return self.render("outcome_page.html", status, **variables, csrf=SES.csrf_token(token), who=who)

    def _csrf_refused(self, request: web.Request, who: Identity) -> web.Response:
        lang = self.lang_of(request, who)
        t = self.catalog.translator(lang)
        return self.render("error.html", 403, **self._bare(request, lang), message=t("core.csrf"), who=who)

    # -- live ----------------------------------------------------------------------------------

    async def live(self, request: web.Request) -> web.StreamResponse:
        """``text/event-stream``: one ``change`` per event of the page's aggregates, its id the event's
        sequence, so a reconnecting browser (``Last-Event-ID``) misses nothing written meanwhile."""
        found = self.identify(request)
        if found is None:
            raise web.HTTPUnauthorized(reason="sign in first: /console/login")
        page = self.by_name.get(request.query.get("page", ""))
        aggregates = set(page.live) if page is not None else set()
        try:
            after = int(request.headers.get("Last-Event-ID") or request.query.get("after") or -1)
        except ValueError:
            after = -1
        if after < 0:
            after = await self.api.store.stream_last_seq()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        response.headers["X-Accel-Buffering"] = "no"
        await response.prepare(request)
        task = asyncio.current_task()
        if task is not None:
            self._live.add(task)
        try:
            await self._follow(response, after, aggregates)
        except (ConnectionResetError, asyncio.CancelledError):
            pass
        finally:
            if task is not None:
                self._live.discard(task)
        return response

    async def _follow(self, response: web.StreamResponse, after: int, aggregates: set[str]) -> None:
        """Write one ``change`` per event of ``aggregates`` (all when empty) after ``after``; with ``usage``
        among them, also one (at most a second) once requests' usage records have been folded into the
        rollups the page reads — usage records are not events, so they come on their own subject."""
        events = self.api.store.subscribe(f"{EVENTS_ROOT}.>", after=after, follow=True)
        usage = asyncio.Event()
        subscription = None
        if "usage" in aggregates:
            subscription = await self.api.store.nc.subscribe(f"{S.USAGE_ROOT}.>", cb=_setter(usage))
            await self.api.store.nc.flush()  # the server has it: no record after the hello goes unseen
        last, usage_sent = after, 0.0
        next_batch: asyncio.Task | None = None
        usage_seen: asyncio.Task | None = None
        try:
            # Hello once following: whatever is written after the browser reads it reaches the browser.
            await response.write(f"retry: {LIVE_RETRY_MS}\nid: {after}\nevent: hello\ndata: {{}}\n\n".encode())
            while not self._closing.is_set():
                if next_batch is None:
                    next_batch = asyncio.ensure_future(anext(events))
                if usage_seen is None and subscription is not None:
                    usage_seen = asyncio.ensure_future(usage.wait())
                waiting = {t for t in (next_batch, usage_seen) if t is not None}
                done, _ = await asyncio.wait(waiting, timeout=LIVE_HEARTBEAT_S, return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    await response.write(b": still here\n\n")
                    continue
                lines = []
                if next_batch in done:
                    batch, next_batch = next_batch.result(), None
                    for event in batch:
                        if not isinstance(event, RecordedEvent):
                            continue
                        aggregate = event.subject.removeprefix(EVENTS_ROOT + ".").split(".", 1)[0]
                        if aggregates and aggregate not in aggregates:
                            continue
                        last = event.seq
                        data = msgspec.json.encode({"type": event.type, "aggregate": aggregate}).decode()
                        lines.append(f"id: {last}\nevent: change\ndata: {data}\n\n")
                if usage_seen is not None and usage_seen in done:
                    usage_seen = None
                    # At most one a second however busy the gateway, and only once the rollups hold them.
                    await asyncio.sleep(max(0.0, usage_sent + USAGE_EVERY_S - asyncio.get_running_loop().time()))
                    usage.clear()
                    await self.api._usage_caught_up()
                    usage_sent = asyncio.get_running_loop().time()
                    lines.append(f'id: {last}\nevent: change\ndata: {{"aggregate": "usage"}}\n\n')
                if lines:
                    await response.write("".join(lines).encode())
        finally:
            for task in (next_batch, usage_seen):
                if task is not None:
                    task.cancel()
            if subscription is not None:
                with contextlib.suppress(Exception):
                    await subscription.unsubscribe()
            with contextlib.suppress(Exception):
                await events.aclose()

    async def _close_live(self, app: web.Application) -> None:
        """A stopping server ends its event streams (the browsers reconnect to whoever serves next)."""
        self._closing.set()
        for task in list(self._live):
            task.cancel()
        await self.moments.close()


def _setter(flag: asyncio.Event) -> Callable[[Any], Awaitable[None]]:
    async def seen(msg: Any) -> None:
        flag.set()

    return seen


def parse_moment(text: str) -> datetime | None:
    """The moment ``?at=`` asks for: an ISO time (a browser's ``datetime-local`` value is UTC here), or a
    duration back (``30m``, ``2h``, ``1d``); None for now. ``ValueError`` naming what to give."""
    text = text.strip()
    if not text:
        return None
    now = utc_now()
    try:
        when = parse_since(text, now)
    except ValueError as exc:
        raise ValueError(f"?at={text!r}: {exc}".replace("since", "at")) from exc
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    if when > now:
        raise ValueError(f"?at={text!r} is in the future; the log holds the past only")
    return when


def _back(request: web.Request) -> str:
    """The console page an action came from (its form's page), to go back to."""
    referer = urlsplit(request.headers.get("Referer", ""))
    return SES.safe_next(referer.path + (f"?{referer.query}" if referer.query else ""))


def _language_of(api: AdminApi, name: str) -> str:
    person = api.signin.people.by_name.get(name) if api.signin else None
    return getattr(person, "language", "") or ""


async def _form(request: web.Request) -> dict[str, str]:
    if request.method != "POST" or request.content_type not in (
        "application/x-www-form-urlencoded",
        "multipart/form-data",
    ):
        return {}
    data = await request.post()
    return {k: v for k, v in data.items() if isinstance(v, str)}


def _query(**params: str) -> str:
    return urlencode(params)


def new_idem() -> str:
    """A fresh Idempotency-Key for one rendered form: submitted twice (a double click, a retry), one command."""
    return uuid.uuid4().hex
