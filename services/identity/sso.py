"""Signing in through an OpenID provider (SPEC ID-1), over HTTP: the console's code flow and the CLI's
device flow, served by the admin API (``Sso(api, console).routes(app)``).

Console: ``GET /console/sso/{provider}?next=…`` sends the browser to the provider (code flow, PKCE S256,
state, nonce); ``GET /console/sso/{provider}/callback`` checks the state (taken once), exchanges the code,
checks the ID token, signs the person in (``SignIn.sign_in_external``) and sets the console's session
cookie. The session cookie is SameSite=Strict, and a browser does not send such a cookie on a navigation
that a redirect chain from another site started; so the callback answers a small page that moves on
from this site itself (a meta refresh) rather than a redirect, and the page asked for sees the cookie.

CLI: ``POST /api/v1/login/sso/{provider}/device`` starts a device authorization and answers an opaque
handle (the device code and the client secret stay on this server); ``POST /api/v1/login/sso/device/poll``
``{"handle"}`` answers 202 while the person has not finished, then the session token. A handle is polled
at the provider at most once per interval, whatever the caller does.
"""

from __future__ import annotations

import html
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
import structlog
from aiohttp import web

from llmgw.events.schema.identity import OidcSettings
from llmgw.services.api.signin import Refused, SignIn, secret_from_env
from llmgw.services.console import session as SES
from llmgw.services.identity.oidc import DeviceStart, OidcClient, OidcError, PendingLogins

if TYPE_CHECKING:
    from llmgw.services.api.app import AdminApi
    from llmgw.services.console.app import Console

log = structlog.get_logger("llmgw.services.identity.sso")

OPEN_PREFIX = "/api/v1/login/sso/"  # the device flow's calls: made before anyone holds a token
# Binds a sign-in to the browser that started it, so a callback link made by someone else (their code, their
# state) cannot sign this browser in as them. SameSite=Lax: it must come along on the provider's redirect back.
BROWSER_COOKIE = "llmgw_sso_browser"
DEVICE_LIMIT = 10_000
PER_ADDRESS = 10  # device sign-ins one address may have under way (each asks the provider for a code)
SLOW_DOWN_S = 5


class DeviceLogin(msgspec.Struct, kw_only=True):
    """A CLI's device sign-in in progress, by its handle."""

    provider: str
    device_code: str
    interval: float
    expires_at: float
    next_poll: float  # not asked of the provider before this
    address: str = ""  # who started it


class PollRequest(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    handle: str


class PendingDevices:
    """Device sign-ins by handle: bounded (the oldest go first) and forgotten once expired or finished."""

    def __init__(self, *, limit: int = DEVICE_LIMIT, clock: Callable[[], float] = time.time) -> None:
        self.limit, self.clock = limit, clock
        self._by_handle: OrderedDict[str, DeviceLogin] = OrderedDict()

    def under_way(self, address: str) -> int:
        """How many device sign-ins ``address`` has started that are neither finished nor expired."""
        self._expire(self.clock())
        return sum(1 for d in self._by_handle.values() if d.address == address)

    def add(self, provider: str, start: DeviceStart, address: str = "") -> str:
        now = self.clock()
        self._expire(now)
        handle = secrets.token_urlsafe(32)
        self._by_handle[handle] = DeviceLogin(
            provider=provider,
            device_code=start.device_code,
            interval=float(max(start.interval, 1)),
            expires_at=now + max(start.expires_in, 1),
            next_poll=now,
            address=address,
        )
        while len(self._by_handle) > self.limit:
            self._by_handle.popitem(last=False)
        return handle

    def get(self, handle: str) -> DeviceLogin | None:
        self._expire(self.clock())
        return self._by_handle.get(handle)

    def drop(self, handle: str) -> None:
        self._by_handle.pop(handle, None)

    def _expire(self, now: float) -> None:
        for handle in [h for h, d in self._by_handle.items() if d.expires_at <= now]:
            del self._by_handle[handle]


def _json_error(status: int, code: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "code": code}}, status=status)


def _status_of(exc: OidcError) -> int:
    """The HTTP status a refusal from the provider's side reads as."""
    if exc.code in ("unknown_state", "invalid_request"):
        return 400
    if exc.code in ("access_denied", "expired_token"):
        return 403 if exc.code == "access_denied" else 410
    if exc.code == "unavailable":
        return 503
    if exc.code == "no_device_flow":
        return 409
    return 502  # the provider answered something llmgw may not accept (a token that fails a check)


class Sso:
    """The HTTP side of OpenID Connect sign-ins; ``routes(app)`` mounts it on the admin API."""

    def __init__(
        self,
        api: AdminApi,
        console: Console | None = None,
        *,
        public_url: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.api, self.console, self.public_url, self.clock = api, console, public_url.rstrip("/"), clock
        self.logins = PendingLogins(clock=clock)
        self.devices = PendingDevices(clock=clock)
        self._clients: dict[str, tuple[OidcSettings, str, OidcClient]] = {}
        self._http: aiohttp.ClientSession | None = None

    def routes(self, app: web.Application) -> None:
        app.router.add_get("/console/sso/{provider}", self.begin)
        app.router.add_get("/console/sso/{provider}/callback", self.callback)
        app.router.add_post(OPEN_PREFIX + "device/poll", self.device_poll)
        app.router.add_post(OPEN_PREFIX + "{provider}/device", self.device_start)
        app.on_cleanup.append(self._close)

    async def _close(self, _app: web.Application) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    # -- the provider's client ----------------------------------------------------------------

    def _signin(self) -> SignIn:
        if self.api.signin is None:
            raise Refused(503, "unavailable", "signing in is not set up in this process")
        return self.api.signin

    def client(self, name: str) -> OidcClient:
        """The client of the OpenID provider ``name`` (kept while its settings and secret stay the same)."""
        signin = self._signin()
        found = signin.provider(name)
        if found is None or found.oidc is None:
            oidc = ", ".join(sorted(p.name for p in signin.identity.providers.values() if p.kind == "oidc")) or "none"
            raise Refused(
                404 if found is None else 409,
                "unknown_provider",
                f"{name[:40]!r} is not an OpenID provider people sign in with here (OpenID providers: {oidc})",
            )
        settings = found.oidc
        secret = (
            secret_from_env(settings.client_secret_env, f"{name}'s client secret") if settings.client_secret_env else ""
        )
        kept = self._clients.get(name)
        if kept is not None and kept[0] == settings and kept[1] == secret:
            return kept[2]
        if self._http is None:
            self._http = aiohttp.ClientSession()
        try:
            made = OidcClient(settings, name=name, client_secret=secret, session=self._http, clock=self.clock)
        except OidcError as exc:
            raise Refused(409, exc.code, exc.message) from exc
        self._clients[name] = (settings, secret, made)
        return made

    def redirect_uri(self, request: web.Request, provider: str) -> str:
        """This server's own callback address: the configured public URL, else as the browser reached it
        (the provider matches it exactly against the client's registered redirect URIs)."""
        base = self.public_url or f"{request.scheme}://{request.host}"
        return f"{base}/console/sso/{provider}/callback"

    # -- the console's code flow --------------------------------------------------------------

    def _page(
        self, request: web.Request, status: int, message: str, next_path: str = "/console", code: str = ""
    ) -> web.Response:
        """The console's sign-in page with the refusal, or a bare page where no console is served."""
        if self.console is None:
            body = f"<!doctype html><title>Sign-in refused</title><p role='alert'>{html.escape(message)}</p>"
            return web.Response(text=body, status=status, content_type="text/html", charset="utf-8")
        lang = self.console.lang_of(request, None)
        shown = self.console.catalog.refusal(lang, code, message) if code else message
        from llmgw.services.console.pages.identity import login_choices  # the console loads only where served

        # The same variables the console's own sign-in page has: its buttons to try again among them.
        bare = {**self.console._bare(request, lang), **login_choices(self.api.signin)}
        return self.console.render("login.html", status, **bare, next=next_path, error=shown)

    async def begin(self, request: web.Request) -> web.StreamResponse:
        """``GET /console/sso/{provider}?next=…``: off to the provider's sign-in page."""
        name = request.match_info["provider"]
        next_path = SES.safe_next(request.query.get("next"))
        try:
            client = self.client(name)
            redirect_uri = self.redirect_uri(request, name)
            browser = request.cookies.get(BROWSER_COOKIE) or secrets.token_urlsafe(32)
            state, pending, pkce = self.logins.begin(name, redirect_uri, next_path, browser=browser[:64])
            url = await client.authorization_url(redirect_uri, state, pending.nonce, pkce.challenge)
        except Refused as exc:
            return self._page(request, exc.status, exc.message, next_path, exc.code)
        except OidcError as exc:
            return self._page(
                request,
                _status_of(exc),
                f"the identity provider {name} cannot sign anyone in: {exc.message}",
                next_path,
            )
        response = web.HTTPSeeOther(location=url)
        response.set_cookie(
            BROWSER_COOKIE,
            pending.browser,
            max_age=int(self.logins.ttl_s),
            path="/console/sso/",
            httponly=True,
            samesite="Lax",
            secure=request.secure,
        )
        raise response

    async def callback(self, request: web.Request) -> web.StreamResponse:
        """``GET /console/sso/{provider}/callback?code&state``: the person back from the provider."""
        name = request.match_info["provider"]
        query = request.query
        try:
            pending = self.logins.take(query.get("state", ""))
        except OidcError as exc:
            return self._page(request, 400, exc.message)
        if not secrets.compare_digest(pending.browser.encode(), request.cookies.get(BROWSER_COOKIE, "")[:64].encode()):
            return self._page(
                request,
                400,
                "this sign-in was started in another browser (or this one forgot its cookie): start it again here",
                pending.next,
            )
        if pending.provider != name:
            return self._page(
                request, 400, "this sign-in was started with another identity provider: start it again", pending.next
            )
        if query.get("error"):
            error = query["error"][:64]
            described = query.get("error_description", "")[:300]
            message = (
                f"the identity provider {name} did not sign you in ({error}{': ' + described if described else ''})"
            )
            return self._page(request, 403 if error == "access_denied" else 400, message, pending.next)
        code = query.get("code", "")
        if not code:
            return self._page(
                request, 400, "the identity provider sent no code back: start the sign-in again", pending.next
            )
        try:
            client = self.client(name)
            if "iss" in query and query["iss"] != client.settings.issuer:
                # RFC 9207: the answer names who sent it; another provider's answer is a mix-up attack.
                raise OidcError(
                    "wrong_issuer", f"the sign-in's answer came from {query['iss'][:200]!r}, not {name}'s issuer"
                )
            who = await client.sign_in_with_code(code, pending)
            token, expires, person = await self._signin().sign_in_external(
                who, f"oidc:{name}", request.remote or "unknown"
            )
        except Refused as exc:
            return self._page(request, exc.status, exc.message, pending.next, exc.code)
        except OidcError as exc:
            log.info("oidc sign-in refused", provider=name, code=exc.code, reason=exc.message)
            return self._page(request, _status_of(exc), exc.message, pending.next)
        log.info("oidc sign-in", provider=name, user=person)
        target = SES.safe_next(pending.next)
        shown = html.escape(target, quote=True)
        body = (
            "<!doctype html><html><head><meta charset='utf-8'>"
            f"<meta http-equiv='refresh' content='0;url={shown}'><title>Signed in</title></head>"
            f"<body><p>Signed in as {html.escape(person)}. <a href='{shown}' id='continue'>Continue</a></p>"
            "</body></html>"
        )
        response = web.Response(text=body, content_type="text/html", charset="utf-8")
        max_age = max(int((expires - datetime.now(UTC)).total_seconds()), 0)
        response.set_cookie(SES.COOKIE, token, **SES.cookie_options(request.secure, max_age))  # type: ignore[arg-type]
        return response

    # -- the CLI's device flow ---------------------------------------------------------------

    async def device_start(self, request: web.Request) -> web.Response:
        """``POST /api/v1/login/sso/{provider}/device``: a code for the person to enter at the provider."""
        name = request.match_info["provider"]
        address = request.remote or "unknown"
        if self.devices.under_way(address) >= PER_ADDRESS:
            response = _json_error(
                429,
                "too_many_logins",
                f"{PER_ADDRESS} device sign-ins from this address are under way: finish one, or wait until they expire",
            )
            response.headers["Retry-After"] = "60"
            return response
        try:
            client = self.client(name)
            start = await client.start_device()
        except Refused as exc:
            return _json_error(exc.status, exc.code, exc.message)
        except OidcError as exc:
            return _json_error(_status_of(exc), exc.code, exc.message)
        handle = self.devices.add(name, start, address)
        return web.json_response(
            {
                "handle": handle,
                "user_code": start.user_code,
                "verification_uri": start.verification_uri,
                "verification_uri_complete": start.verification_uri_complete,
                "interval": start.interval,
                "expires_in": start.expires_in,
            }
        )

    async def device_poll(self, request: web.Request) -> web.Response:
        """``POST /api/v1/login/sso/device/poll`` ``{"handle"}``: 202 while pending, then the session token."""
        try:
            body = msgspec.json.decode(await request.read(), type=PollRequest)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return _json_error(400, "invalid_request", f'send {{"handle": HANDLE}} as JSON: {exc}')
        device = self.devices.get(body.handle)
        if device is None:
            return _json_error(
                404,
                "unknown_handle",
                "this device sign-in is unknown, expired or finished: start it again (`llmgw login --sso NAME`)",
            )
        now = self.clock()
        if now < device.next_poll:
            return self._pending(device, now)
        device.next_poll = now + device.interval
        try:
            who = await self.client(device.provider).poll_device(device.device_code)
            if who is None:
                return self._pending(device, now)
            token, expires, person = await self._signin().sign_in_external(
                who, f"device:{device.provider}", request.remote or "unknown"
            )
        except OidcError as exc:
            if exc.code == "slow_down":
                device.interval += SLOW_DOWN_S
                device.next_poll = now + device.interval
                return self._pending(device, now)
            self.devices.drop(body.handle)
            return _json_error(_status_of(exc), exc.code, exc.message)
        except Refused as exc:
            self.devices.drop(body.handle)
            return _json_error(exc.status, exc.code, exc.message)
        self.devices.drop(body.handle)
        return web.json_response({"token": token, "expires_at": expires.isoformat(), "user": person})

    def _pending(self, device: DeviceLogin, now: float) -> web.Response:
        payload: dict[str, Any] = {"status": "pending", "interval": device.interval}
        payload["retry_after_s"] = max(round(device.next_poll - now, 1), 0.0)
        return web.json_response(payload, status=202)
