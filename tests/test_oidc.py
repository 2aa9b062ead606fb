"""The OpenID Connect library (services/identity/oidc.py) against a real provider (tests/idp: oidc-provider
on node): its discovery, its JWKS, tokens it signs through its own login page, and tokens the tests forge
with the provider's key (one thing changed) or with keys of their own."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import time
from collections.abc import AsyncIterator, Iterator
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest

from llmgw.events.schema.identity import OidcSettings
from llmgw.services.identity.oidc import (
    OidcClient,
    OidcError,
    PendingLogins,
    b64url_encode,
    check_id_token,
    check_issuer_url,
)
from tests.idp.harness import (
    Client,
    Idp,
    SigningKey,
    confirm_device_over_http,
    sign_in_over_http,
    sign_jwt,
    unavailable_reason,
)

CLIENT_ID = "llmgw-test"
SECRET = "a-client-secret-long-enough-for-the-provider-0123456789"
REDIRECT = "http://127.0.0.1:9/console/sso/corp/callback"  # never reached: the test stops at the redirect


@pytest.fixture(scope="module")
def idp() -> Iterator[Idp]:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    server = Idp([Client(CLIENT_ID, SECRET, [REDIRECT])]).start()
    try:
        yield server
    finally:
        server.stop()


class Clock:
    """A clock the test moves: the library's notion of now, so messages with ages are exact."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


class Counted:
    """Counts the HTTP requests a session makes, by path: what the library really asked the provider."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        self.trace = aiohttp.TraceConfig()
        self.trace.on_request_start.append(self._started)

    async def _started(self, _session: object, _ctx: object, params: aiohttp.TraceRequestStartParams) -> None:
        self.paths.append(params.url.path)

    def count(self, path: str) -> int:
        return self.paths.count(path)


Http = tuple[aiohttp.ClientSession, Counted]


@pytest.fixture
async def http() -> AsyncIterator[tuple[aiohttp.ClientSession, Counted]]:
    counted = Counted()
    async with aiohttp.ClientSession(trace_configs=[counted.trace]) as session:
        yield session, counted


def settings(idp: Idp, **changes: object) -> OidcSettings:
    return OidcSettings(issuer=changes.pop("issuer", idp.issuer), client_id=CLIENT_ID, **changes)  # type: ignore[arg-type]


def client(idp: Idp, session: aiohttp.ClientSession, clock: Clock | None = None, **kw: object) -> OidcClient:
    return OidcClient(settings(idp), name="corp", client_secret=SECRET, session=session, clock=clock or time.time, **kw)  # type: ignore[arg-type]


async def test_discovery_names_the_providers_endpoints_and_its_device_flow(idp: Idp, http: Http) -> None:
    session, _ = http
    found = await client(idp, session).discovery()
    assert found.issuer == idp.issuer
    assert found.token_endpoint.startswith(idp.issuer)
    assert found.device_authorization_endpoint == idp.issuer + "/device/auth"


async def test_discovery_is_read_once_and_kept(idp: Idp, http: Http) -> None:
    session, counted = http
    c = client(idp, session)
    await c.discovery()
    await c.discovery()
    assert counted.count("/.well-known/openid-configuration") == 1


async def test_an_issuer_that_differs_even_by_a_trailing_slash_is_refused_at_discovery(idp: Idp, http: Http) -> None:
    session, _ = http
    c = OidcClient(settings(idp, issuer=idp.issuer + "/"), name="corp", client_secret=SECRET, session=session)
    with pytest.raises(OidcError) as refused:
        await c.discovery()
    assert refused.value.code == "wrong_issuer"
    assert f"says its issuer is '{idp.issuer}'" in refused.value.message


def test_a_plain_http_issuer_is_refused_unless_it_is_on_a_loopback_address() -> None:
    with pytest.raises(OidcError, match="is not https://") as refused:
        check_issuer_url("http://idp.example.org")
    assert refused.value.code == "insecure"
    for fine in ("https://idp.example.org", "http://127.0.0.1:5556", "http://[::1]:80", "http://localhost:8080"):
        check_issuer_url(fine)
    with pytest.raises(OidcError):
        OidcClient(OidcSettings(issuer="http://10.0.0.1", client_id="x"))


async def test_a_person_signed_in_at_the_providers_page_comes_back_with_their_groups(idp: Idp, http: Http) -> None:
    session, _ = http
    c = client(idp, session)
    logins = PendingLogins()
    state, pending, pkce = logins.begin("corp", REDIRECT, "/console/usage")
    url = await c.authorization_url(REDIRECT, state, pending.nonce, pkce.challenge)
    assert "code_challenge_method=S256" in url
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        back = await sign_in_over_http(browser, url, "alice", "alice-wonderland-7", stop_at=REDIRECT)
    query = parse_qs(urlsplit(back).query)
    assert query["state"] == [state]
    taken = logins.take(state)
    who = await c.sign_in_with_code(query["code"][0], taken)
    assert (who.provider, who.subject, who.username) == ("corp", "alice", "alice")
    assert who.groups == ("ml-admins", "ml-users")  # from userinfo: the provider's ID token carries only sub
    assert taken.next == "/console/usage"


async def test_the_code_is_refused_without_the_pkce_verifier_that_made_its_challenge(idp: Idp, http: Http) -> None:
    session, _ = http
    c = client(idp, session)
    state, pending, pkce = PendingLogins().begin("corp", REDIRECT, "/console")
    url = await c.authorization_url(REDIRECT, state, pending.nonce, pkce.challenge)
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        back = await sign_in_over_http(browser, url, "bob", "bob-builder-7", stop_at=REDIRECT)
    code = parse_qs(urlsplit(back).query)["code"][0]
    with pytest.raises(OidcError, match="refused this sign-in's code") as refused:
        await c.exchange_code(code, REDIRECT, "another-verifier-" + "x" * 40)
    assert refused.value.code == "invalid_grant"


async def test_a_token_the_provider_signed_is_accepted_with_its_groups_claim(idp: Idp, http: Http) -> None:
    session, _ = http
    token = sign_jwt(idp.id_claims(CLIENT_ID, nonce="n-1"), idp.key)
    who = await client(idp, session).verify_id_token(token, nonce="n-1")
    assert who.groups == ("ml-admins", "ml-users")
    assert who.email == "alice@example.org"


async def test_an_id_token_signed_with_another_key_is_refused_naming_its_kid_and_when_the_jwks_was_read(
    idp: Idp, http: Http
) -> None:
    session, _ = http
    clock = Clock()
    c = client(idp, session, clock)
    await c.verify_id_token(sign_jwt(idp.id_claims(CLIENT_ID), idp.key), nonce=None)  # reads the JWKS now
    clock.now += 12
    forged = sign_jwt(idp.id_claims(CLIENT_ID), SigningKey.rsa("abc"))
    with pytest.raises(OidcError) as refused:
        await c.verify_id_token(forged, nonce=None)
    assert refused.value.code == "unknown_key"
    assert "the identity provider's signing key kid=abc is not in its JWKS (fetched 12 s ago)" in refused.value.message


async def test_a_token_with_the_providers_kid_but_another_keys_signature_is_refused(idp: Idp, http: Http) -> None:
    session, _ = http
    forger = SigningKey.rsa(idp.key.kid)  # claims to be the provider's key
    with pytest.raises(OidcError, match=f"does not verify with the identity provider's key kid={idp.key.kid}"):
        await client(idp, session).verify_id_token(sign_jwt(idp.id_claims(CLIENT_ID), forger), nonce=None)


async def test_an_expired_id_token_is_refused_with_its_expiry_and_the_skew_allowed(idp: Idp, http: Http) -> None:
    session, _ = http
    clock = Clock()
    expired_at = int(clock.now) - 3600
    token = sign_jwt(idp.id_claims(CLIENT_ID, iat=expired_at - 600, exp=expired_at), idp.key)
    with pytest.raises(OidcError) as refused:
        await client(idp, session, clock).verify_id_token(token, nonce=None)
    assert refused.value.code == "expired"
    when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(expired_at))
    assert f"the ID token expired at {when} (clock skew allowed: 60 s)" in refused.value.message


async def test_a_token_expired_less_than_the_skew_ago_is_still_accepted(idp: Idp, http: Http) -> None:
    session, _ = http
    clock = Clock()
    token = sign_jwt(idp.id_claims(CLIENT_ID, exp=int(clock.now) - 30), idp.key)
    assert (await client(idp, session, clock).verify_id_token(token, nonce=None)).username == "alice"


async def test_a_token_issued_for_another_client_is_refused_naming_both(idp: Idp, http: Http) -> None:
    session, _ = http
    token = sign_jwt(idp.id_claims(CLIENT_ID, aud="another-app"), idp.key)
    with pytest.raises(OidcError) as refused:
        await client(idp, session).verify_id_token(token, nonce=None)
    assert refused.value.message == (
        f"the ID token was issued for another client (aud=another-app), not llmgw's client id {CLIENT_ID}"
    )


async def test_a_token_for_several_audiences_needs_llmgw_as_its_authorized_party(idp: Idp, http: Http) -> None:
    session, _ = http
    c = client(idp, session)
    shared = sign_jwt(idp.id_claims(CLIENT_ID, aud=[CLIENT_ID, "other"], azp="other"), idp.key)
    with pytest.raises(OidcError, match="authorized party is 'other'"):
        await c.verify_id_token(shared, nonce=None)
    ours = sign_jwt(idp.id_claims(CLIENT_ID, aud=[CLIENT_ID, "other"], azp=CLIENT_ID), idp.key)
    assert (await c.verify_id_token(ours, nonce=None)).subject == "alice"


async def test_a_token_from_another_issuer_is_refused(idp: Idp, http: Http) -> None:
    session, _ = http
    token = sign_jwt(idp.id_claims(CLIENT_ID, iss="https://evil.example.org"), idp.key)
    with pytest.raises(OidcError, match=r"issued by 'https://evil\.example\.org', not by the configured issuer") as r:
        await client(idp, session).verify_id_token(token, nonce=None)
    assert r.value.code == "wrong_issuer"


async def test_a_replayed_nonce_is_refused_the_second_time(idp: Idp, http: Http) -> None:
    session, _ = http
    c = client(idp, session)
    token = sign_jwt(idp.id_claims(CLIENT_ID, nonce="once"), idp.key)
    await c.verify_id_token(token, nonce="once")
    with pytest.raises(OidcError, match="nonce was already used") as refused:
        await c.verify_id_token(token, nonce="once")
    assert refused.value.code == "replayed_nonce"


async def test_a_nonce_other_than_the_one_sent_is_refused(idp: Idp, http: Http) -> None:
    session, _ = http
    token = sign_jwt(idp.id_claims(CLIENT_ID, nonce="theirs"), idp.key)
    with pytest.raises(OidcError, match="the sign-in's nonce does not match the one this server sent"):
        await client(idp, session).verify_id_token(token, nonce="ours")


async def test_an_unsigned_token_is_refused_whatever_it_claims(idp: Idp, http: Http) -> None:
    session, _ = http
    unsigned = sign_jwt(idp.id_claims(CLIENT_ID), None)
    with pytest.raises(OidcError, match="alg='none'") as refused:
        await client(idp, session).verify_id_token(unsigned, nonce=None)
    assert refused.value.code == "bad_alg"


async def test_a_token_signed_by_hmac_with_the_providers_public_key_is_refused(idp: Idp, http: Http) -> None:
    session, _ = http
    head = b64url_encode(json.dumps({"alg": "HS256", "kid": idp.key.kid}).encode())
    body = b64url_encode(json.dumps(idp.id_claims(CLIENT_ID)).encode())
    public = json.dumps(idp.key.public_jwk()).encode()
    mac = hmac.new(public, f"{head}.{body}".encode(), hashlib.sha256).digest()
    with pytest.raises(OidcError, match="never unsigned or HMAC ones"):
        await client(idp, session).verify_id_token(f"{head}.{body}.{b64url_encode(mac)}", nonce=None)


async def test_a_key_the_provider_rotated_in_is_fetched_once_and_made_up_kids_do_not_hammer_it(
    idp: Idp, http: Http
) -> None:
    session, counted = http
    clock = Clock()
    c = client(idp, session, clock, jwks_refetch_s=30)
    old = idp.key
    await c.verify_id_token(sign_jwt(idp.id_claims(CLIENT_ID), old), nonce=None)
    assert counted.count("/jwks") == 1
    rotated = SigningKey.ec256("idp-key-2")
    idp.restart([rotated, old])
    try:
        clock.now += 31
        who = await c.verify_id_token(sign_jwt(idp.id_claims(CLIENT_ID), rotated), nonce=None)
        assert who.username == "alice"
        assert counted.count("/jwks") == 2
        for n in range(20):
            with pytest.raises(OidcError, match=f"kid=made-up-{n} is not in its JWKS"):
                await c.verify_id_token(
                    sign_jwt(idp.id_claims(CLIENT_ID), SigningKey.ec256(f"made-up-{n}")), nonce=None
                )
        assert counted.count("/jwks") == 2
        clock.now += 31  # past the refetch interval: a flood at once reads the JWKS once, not once per token
        flood = [sign_jwt(idp.id_claims(CLIENT_ID), SigningKey.ec256(f"flood-{n}")) for n in range(20)]
        refused = await asyncio.gather(*(c.verify_id_token(t, nonce=None) for t in flood), return_exceptions=True)
        assert all(isinstance(r, OidcError) and r.code == "unknown_key" for r in refused)
        assert counted.count("/jwks") == 3
        clock.now += 31  # past the refetch interval: one more read for an unknown kid, no more
        with pytest.raises(OidcError, match="fetched 0 s ago"):
            await c.verify_id_token(sign_jwt(idp.id_claims(CLIENT_ID), SigningKey.ec256("later")), nonce=None)
        assert counted.count("/jwks") == 4
    finally:
        idp.restart([old])


def test_the_id_token_checks_are_pure_over_plain_claims() -> None:
    claims = {"iss": "https://idp", "aud": "c", "sub": "s", "iat": 1000, "exp": 1600, "nbf": 1000}
    check_id_token(claims, issuer="https://idp", client_id="c", nonce=None, now=1200)
    with pytest.raises(OidcError, match="not valid before"):
        check_id_token({**claims, "nbf": 1500}, issuer="https://idp", client_id="c", nonce=None, now=1200)
    with pytest.raises(OidcError, match="issued in the future"):
        check_id_token({**claims, "iat": 1300}, issuer="https://idp", client_id="c", nonce=None, now=1200, skew_s=10)
    with pytest.raises(OidcError, match="nonce does not match"):
        check_id_token({**claims, "nonce": "é"}, issuer="https://idp", client_id="c", nonce="ü", now=1200)
    with pytest.raises(OidcError, match="no exp time"):
        check_id_token(
            {k: v for k, v in claims.items() if k != "exp"}, issuer="https://idp", client_id="c", nonce=None, now=1200
        )


def test_a_state_is_taken_once_and_forgotten_after_its_time_or_when_too_many_wait() -> None:
    clock = Clock()
    logins = PendingLogins(limit=3, ttl_s=600, clock=clock)
    state, pending, pkce = logins.begin("corp", REDIRECT, "/console")
    assert base64.urlsafe_b64decode(pkce.challenge + "=") == hashlib.sha256(pending.code_verifier.encode()).digest()
    assert logins.take(state) == pending
    with pytest.raises(OidcError, match="unknown, expired or already used") as refused:
        logins.take(state)
    assert refused.value.code == "unknown_state"
    old, _, _ = logins.begin("corp", REDIRECT, "/console")
    clock.now += 601
    with pytest.raises(OidcError):
        logins.take(old)
    states = [logins.begin("corp", REDIRECT, "/console")[0] for _ in range(4)]
    assert len(logins) == 3
    with pytest.raises(OidcError):
        logins.take(states[0])
    assert logins.take(states[3]).provider == "corp"


async def test_the_device_flow_is_pending_until_the_person_confirms_then_names_them(idp: Idp, http: Http) -> None:
    session, _ = http
    c = client(idp, session)
    start = await c.start_device()
    assert start.user_code and start.verification_uri.startswith(idp.issuer)
    assert await c.poll_device(start.device_code) is None
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        await confirm_device_over_http(browser, start.verification_uri_complete, "bob", "bob-builder-7")
    who = await c.poll_device(start.device_code)
    assert who is not None and who.username == "bob" and who.groups == ("everyone",)


async def test_a_device_sign_in_cancelled_at_the_provider_is_refused_as_access_denied(idp: Idp, http: Http) -> None:
    session, _ = http
    c = client(idp, session)
    start = await c.start_device()
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as browser:
        await confirm_device_over_http(browser, start.verification_uri_complete, "bob", "", abort=True)
    with pytest.raises(OidcError) as refused:
        await c.poll_device(start.device_code)
    assert refused.value.code == "access_denied"
