"""OpenID Connect, the client side (SPEC ID-1): discovery, the ID token checked in full, the code flow's
PKCE, state and nonce, and the device authorization grant (RFC 8628) for the CLI.

The checks are pure functions over plain data (``check_issuer_url``, ``check_id_token``,
``verify_signature``); ``OidcClient`` is the thin I/O around them, with the provider's discovery document
and JWKS cached. A JWKS is read again when an ID token names a kid it lacks (a provider rotated its keys),
at most once per ``jwks_refetch_s`` so a flood of tokens with made-up kids cannot hammer the provider.
Every refusal is an ``OidcError`` whose message says what happened and what to do.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import ipaddress
import json
import secrets
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import aiohttp
import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec, ed448, ed25519, padding, rsa
from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

from llmgw.events.schema.identity import ExternalIdentity, OidcSettings

DEVICE_GRANT = "urn:ietf:params:oauth:grant-type:device_code"
DISCOVERY_TTL_S = 3600.0
JWKS_TTL_S = 3600.0
LOOPBACK_HOSTS = frozenset({"localhost"})


class OidcError(Exception):
    """A sign-in through an OpenID provider that may not go on: a short code and a message a person can act on."""

    def __init__(self, code: str, message: str) -> None:
        self.code, self.message = code, message
        super().__init__(message)


class Discovery(msgspec.Struct, frozen=True, kw_only=True):
    """What a provider's /.well-known/openid-configuration says (only what llmgw uses)."""

    issuer: str
    authorization_endpoint: str
    token_endpoint: str
    jwks_uri: str
    userinfo_endpoint: str = ""
    device_authorization_endpoint: str = ""


class DeviceStart(msgspec.Struct, frozen=True, kw_only=True):
    """A device authorization (RFC 8628 §3.2): what the person is told, and the code the poller sends."""

    device_code: str
    user_code: str
    verification_uri: str
    verification_uri_complete: str = ""
    interval: int = 5
    expires_in: int = 600


class Pkce(msgspec.Struct, frozen=True):
    verifier: str
    challenge: str  # S256


class PendingLogin(msgspec.Struct, frozen=True, kw_only=True):
    """A console sign-in sent to a provider, kept until its callback comes back (by its ``state``)."""

    provider: str
    nonce: str
    code_verifier: str
    redirect_uri: str
    next: str
    created: float
    browser: str = ""  # the browser that started it (a cookie's value): only it may finish it


# -- pure parts ---------------------------------------------------------------------------------------------


def b64url_decode(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def b64url_encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def new_pkce() -> Pkce:
    """A PKCE verifier (RFC 7636: 43 to 128 characters) and its S256 challenge."""
    verifier = secrets.token_urlsafe(48)
    return Pkce(verifier, b64url_encode(hashlib.sha256(verifier.encode()).digest()))


def is_loopback(host: str) -> bool:
    if host.lower() in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_issuer_url(url: str, what: str = "issuer") -> None:
    """https only; plain http only on this machine's loopback (a test provider), never across a network."""
    parts = urlsplit(url)
    if parts.scheme == "https" and parts.hostname:
        return
    if parts.scheme == "http" and parts.hostname and is_loopback(parts.hostname):
        return
    raise OidcError(
        "insecure",
        f"the identity provider's {what} {url!r} is not https:// (plain http:// is allowed only on a loopback "
        "address such as 127.0.0.1): give its https:// URL",
    )


def split_jws(token: str) -> tuple[dict[str, Any], dict[str, Any], bytes, bytes]:
    """A compact JWS's header, claims, signing input and signature; refuses what is not one."""
    parts = token.split(".") if isinstance(token, str) else []
    if len(parts) != 3:
        raise OidcError("malformed_token", "the identity provider's ID token is not a signed JWT (three parts)")
    try:
        header = json.loads(b64url_decode(parts[0]))
        claims = json.loads(b64url_decode(parts[1]))
        signature = b64url_decode(parts[2])
    except (ValueError, UnicodeDecodeError) as e:
        raise OidcError("malformed_token", f"the identity provider's ID token cannot be read: {e}") from None
    if not isinstance(header, dict) or not isinstance(claims, dict):
        raise OidcError("malformed_token", "the identity provider's ID token's header or claims are not JSON objects")
    return header, claims, f"{parts[0]}.{parts[1]}".encode(), signature


_RSA_ALGS = {"RS256": hashes.SHA256, "RS384": hashes.SHA384, "RS512": hashes.SHA512}
_PSS_ALGS = {"PS256": hashes.SHA256, "PS384": hashes.SHA384, "PS512": hashes.SHA512}
_EC_ALGS = {
    "ES256": ("P-256", hashes.SHA256, 32),
    "ES384": ("P-384", hashes.SHA384, 48),
    "ES512": ("P-521", hashes.SHA512, 66),
}
_EC_CURVES = {"P-256": ec.SECP256R1, "P-384": ec.SECP384R1, "P-521": ec.SECP521R1}


def algs_for_jwk(jwk: Mapping[str, Any]) -> frozenset[str]:
    """The signature algorithms a public key can verify: by its type (never ``none``, never an HMAC,
    whatever the token's header claims), narrowed to the key's own ``alg`` when it names one."""
    kty = jwk.get("kty")
    if kty == "RSA":
        algs = frozenset(_RSA_ALGS) | frozenset(_PSS_ALGS)
    elif kty == "EC":
        algs = frozenset(a for a, (crv, _, _) in _EC_ALGS.items() if crv == jwk.get("crv"))
    elif kty == "OKP" and jwk.get("crv") in ("Ed25519", "Ed448"):
        algs = frozenset({"EdDSA", jwk["crv"]})
    else:
        algs = frozenset()
    named = jwk.get("alg")
    return algs & {named} if isinstance(named, str) and named else algs


def verify_signature(alg: str, jwk: Mapping[str, Any], signing_input: bytes, signature: bytes) -> None:
    """Checks a JWS signature with a public JWK; raises OidcError naming the key when it does not hold."""
    kid = jwk.get("kid", "")
    allowed = algs_for_jwk(jwk)
    if alg not in allowed:
        raise OidcError(
            "bad_alg",
            f"the ID token says alg={alg!r}, which the identity provider's key kid={kid} "
            f"({jwk.get('kty')}) does not sign with (it signs with {', '.join(sorted(allowed)) or 'nothing known'})",
        )
    try:
        kty = jwk["kty"]
        if kty == "RSA":
            key = rsa.RSAPublicNumbers(
                int.from_bytes(b64url_decode(jwk["e"]), "big"), int.from_bytes(b64url_decode(jwk["n"]), "big")
            ).public_key()
            if alg in _RSA_ALGS:
                key.verify(signature, signing_input, padding.PKCS1v15(), _RSA_ALGS[alg]())
            else:
                digest = _PSS_ALGS[alg]()
                key.verify(
                    signature, signing_input, padding.PSS(padding.MGF1(digest), digest.digest_size), _PSS_ALGS[alg]()
                )
        elif kty == "EC":
            crv, digest_cls, size = _EC_ALGS[alg]
            key = ec.EllipticCurvePublicNumbers(
                int.from_bytes(b64url_decode(jwk["x"]), "big"),
                int.from_bytes(b64url_decode(jwk["y"]), "big"),
                _EC_CURVES[crv](),
            ).public_key()
            if len(signature) != 2 * size:
                raise InvalidSignature
            r, s = int.from_bytes(signature[:size], "big"), int.from_bytes(signature[size:], "big")
            key.verify(encode_dss_signature(r, s), signing_input, ec.ECDSA(digest_cls()))
        else:
            okp = ed25519.Ed25519PublicKey if jwk["crv"] == "Ed25519" else ed448.Ed448PublicKey
            okp.from_public_bytes(b64url_decode(jwk["x"])).verify(signature, signing_input)
    except InvalidSignature:
        raise OidcError(
            "bad_signature",
            f"the ID token's signature does not verify with the identity provider's key kid={kid}: "
            "it was not signed by the provider (or was changed on the way)",
        ) from None
    except (KeyError, ValueError, TypeError) as e:
        raise OidcError(
            "bad_jwks", f"the identity provider's key kid={kid} cannot be read from its JWKS: {e}"
        ) from None


def select_key(header: Mapping[str, Any], keys: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The JWKS key an ID token names by kid; without a kid, the only signing key there is."""
    signing = [k for k in keys if isinstance(k, dict) and k.get("use", "sig") == "sig"]
    kid = header.get("kid")
    if kid is not None:
        return next((k for k in signing if k.get("kid") == kid), None)
    alg = header.get("alg", "")
    fitting = [k for k in signing if alg in algs_for_jwk(k)]
    return fitting[0] if len(fitting) == 1 else None


def _when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def check_id_token(
    claims: Mapping[str, Any], *, issuer: str, client_id: str, nonce: str | None, now: float, skew_s: float = 60.0
) -> None:
    """An ID token's claims checked (OIDC Core §3.1.3.7): issuer, audience, expiry, issue and not-before
    times with a bounded clock skew, and the nonce this server sent (None: a flow without one, the device
    grant). The signature is checked apart (``verify_signature``)."""
    iss = claims.get("iss")
    if iss != issuer:
        raise OidcError(
            "wrong_issuer",
            f"the ID token was issued by {iss!r}, not by the configured issuer {issuer!r}: "
            "check the provider's --issuer (it must match exactly, trailing slash included)",
        )
    aud = claims.get("aud")
    audiences = [aud] if isinstance(aud, str) else list(aud) if isinstance(aud, list) else []
    if client_id not in audiences:
        shown = ",".join(str(a) for a in audiences) or "none"
        raise OidcError(
            "wrong_audience",
            f"the ID token was issued for another client (aud={shown}), not llmgw's client id {client_id}",
        )
    azp = claims.get("azp")
    if (len(audiences) > 1 or azp is not None) and azp != client_id:
        raise OidcError(
            "wrong_audience",
            f"the ID token names several audiences and its authorized party is {azp!r}, not llmgw's client id "
            f"{client_id}",
        )
    for name in ("exp", "iat"):
        if not isinstance(claims.get(name), int | float) or isinstance(claims.get(name), bool):
            raise OidcError("malformed_token", f"the ID token has no {name} time")
    skew = f"clock skew allowed: {skew_s:g} s"
    if now > claims["exp"] + skew_s:
        raise OidcError(
            "expired", f"the ID token expired at {_when(claims['exp'])} ({skew}): sign in again, or check this clock"
        )
    if claims["iat"] > now + skew_s:
        raise OidcError(
            "not_yet_valid",
            f"the ID token was issued in the future, at {_when(claims['iat'])} ({skew}): check the clocks of this "
            "server and the identity provider",
        )
    nbf = claims.get("nbf")
    if isinstance(nbf, int | float) and nbf > now + skew_s:
        raise OidcError("not_yet_valid", f"the ID token is not valid before {_when(nbf)} ({skew}): check the clocks")
    if nonce is not None and not (
        isinstance(claims.get("nonce"), str) and secrets.compare_digest(claims["nonce"].encode(), nonce.encode())
    ):
        raise OidcError(
            "wrong_nonce",
            "the sign-in's nonce does not match the one this server sent (a token from another sign-in, or a "
            "replayed one): sign in again",
        )
    if not isinstance(claims.get("sub"), str) or not claims["sub"]:
        raise OidcError("malformed_token", "the ID token names no subject (sub)")


def groups_from(value: Any) -> tuple[str, ...]:
    """A groups claim as a tuple of names: a list of strings, or one string (some providers send one)."""
    if isinstance(value, str):
        return (value,) if value else ()
    if isinstance(value, list):
        return tuple(str(g) for g in value if isinstance(g, str | int) and str(g))
    return ()


def identity_from_claims(provider: str, settings: OidcSettings, claims: Mapping[str, Any]) -> ExternalIdentity:
    username = claims.get(settings.username_claim)
    if not isinstance(username, str) or not username:
        raise OidcError(
            "no_username",
            f"the identity provider {provider} sent no {settings.username_claim} claim for sub={claims.get('sub')}: "
            "ask its administrator to release it, or set the provider's username claim to one it sends",
        )
    return ExternalIdentity(
        provider=provider,
        subject=str(claims["sub"]),
        username=username,
        email=claims.get("email", "") if isinstance(claims.get("email"), str) else "",
        display_name=claims.get("name", "") if isinstance(claims.get("name"), str) else "",
        groups=groups_from(claims.get(settings.groups_claim)),
    )


# -- state kept between a redirect and its callback ----------------------------------------------------------


class PendingLogins:
    """Console sign-ins on their way through a provider, by ``state``: each taken once, kept at most
    ``ttl_s``, at most ``limit`` of them (the oldest go first, so a flood of started sign-ins costs bounded
    memory and can only make the oldest of them start again)."""

    def __init__(self, *, limit: int = 10_000, ttl_s: float = 600.0, clock: Callable[[], float] = time.time) -> None:
        self.limit, self.ttl_s, self.clock = limit, ttl_s, clock
        self._pending: OrderedDict[str, PendingLogin] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pending)

    def begin(
        self, provider: str, redirect_uri: str, next_path: str, browser: str = ""
    ) -> tuple[str, PendingLogin, Pkce]:
        """A new sign-in: its state, what is kept for its callback, and the PKCE pair (the challenge goes out)."""
        self._expire()
        pkce = new_pkce()
        state = secrets.token_urlsafe(32)
        pending = PendingLogin(
            provider=provider,
            nonce=secrets.token_urlsafe(32),
            code_verifier=pkce.verifier,
            redirect_uri=redirect_uri,
            next=next_path,
            created=self.clock(),
            browser=browser,
        )
        self._pending[state] = pending
        while len(self._pending) > self.limit:
            self._pending.popitem(last=False)
        return state, pending, pkce

    def take(self, state: str) -> PendingLogin:
        """The sign-in a callback's state names, removed: a second callback with it is refused."""
        self._expire()
        pending = self._pending.pop(state, None) if state else None
        if pending is None:
            raise OidcError(
                "unknown_state",
                "this sign-in's state is unknown, expired or already used (a link from another sign-in, an old "
                "tab, or a replay): start the sign-in again",
            )
        return pending

    def _expire(self) -> None:
        horizon = self.clock() - self.ttl_s
        while self._pending:
            state, oldest = next(iter(self._pending.items()))
            if oldest.created >= horizon:
                break
            del self._pending[state]


# -- the client ----------------------------------------------------------------------------------------------


class OidcClient:
    """One provider, as llmgw's client of it: discovery and JWKS cached, the ID token checked in full."""

    def __init__(
        self,
        settings: OidcSettings,
        *,
        name: str = "",
        client_secret: str = "",
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.time,
        skew_s: float = 60.0,
        jwks_refetch_s: float = 30.0,
        timeout_s: float = 10.0,
        nonce_memory: int = 10_000,
    ) -> None:
        check_issuer_url(settings.issuer)
        self.settings, self.name, self.client_secret = settings, name or "oidc", client_secret
        self.clock, self.skew_s, self.jwks_refetch_s = clock, skew_s, jwks_refetch_s
        self._session, self._own_session = session, session is None
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._ssl: ssl.SSLContext | None = (
            ssl.create_default_context(cafile=settings.ca_file) if settings.ca_file else None
        )
        self._discovery: Discovery | None = None
        self._discovered_at = 0.0
        self._jwks: list[dict[str, Any]] = []
        self._jwks_fetched_at: float | None = None
        self._jwks_lock = asyncio.Lock()
        # Nonces of ID tokens already accepted, until their tokens expire: a token shown twice is refused.
        self._used_nonces: OrderedDict[str, float] = OrderedDict()
        self._nonce_memory = nonce_memory

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        return self._session

    async def _get_json(self, url: str, what: str, headers: Mapping[str, str] | None = None) -> Any:
        try:
            async with self._http().get(url, headers=headers, timeout=self._timeout, ssl=self._ssl) as resp:
                if resp.status != 200:
                    text = (await resp.text())[:200]
                    raise OidcError(
                        "unavailable", f"the identity provider's {what} ({url}) answered HTTP {resp.status}: {text}"
                    )
                return await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise OidcError(
                "unavailable", f"the identity provider's {what} ({url}) could not be read: {e or type(e).__name__}"
            ) from None

    async def _post_form(self, url: str, what: str, form: dict[str, str]) -> tuple[int, dict[str, Any]]:
        headers = {"Accept": "application/json"}
        if self.client_secret:
            # client_secret_basic (RFC 6749 §2.3.1): both parts form-url-encoded before base64.
            pair = f"{quote(self.settings.client_id, safe='')}:{quote(self.client_secret, safe='')}"
            headers["Authorization"] = "Basic " + base64.b64encode(pair.encode()).decode()
        else:
            form = {**form, "client_id": self.settings.client_id}
        try:
            async with self._http().post(url, data=form, headers=headers, timeout=self._timeout, ssl=self._ssl) as resp:
                body = await resp.json(content_type=None)
                return resp.status, body if isinstance(body, dict) else {}
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            raise OidcError(
                "unavailable", f"the identity provider's {what} ({url}) could not be reached: {e or type(e).__name__}"
            ) from None

    async def discovery(self) -> Discovery:
        """The provider's discovery document, cached; its issuer must be the configured one, exactly."""
        now = self.clock()
        if self._discovery is not None and now - self._discovered_at < DISCOVERY_TTL_S:
            return self._discovery
        url = self.settings.issuer.rstrip("/") + "/.well-known/openid-configuration"
        raw = await self._get_json(url, "discovery document")
        try:
            found = msgspec.convert(raw, Discovery)
        except msgspec.ValidationError as e:
            raise OidcError(
                "bad_discovery", f"the identity provider's discovery document ({url}) is incomplete: {e}"
            ) from None
        if found.issuer != self.settings.issuer:
            raise OidcError(
                "wrong_issuer",
                f"the identity provider at {url} says its issuer is {found.issuer!r}, not the configured "
                f"{self.settings.issuer!r}: set --issuer to exactly what it says",
            )
        for what in (
            "authorization_endpoint",
            "token_endpoint",
            "jwks_uri",
            "userinfo_endpoint",
            "device_authorization_endpoint",
        ):
            if getattr(found, what):
                check_issuer_url(getattr(found, what), what)
        self._discovery, self._discovered_at = found, now
        return found

    async def _fetch_jwks(self) -> None:
        found = await self.discovery()
        raw = await self._get_json(found.jwks_uri, "JWKS")
        keys = raw.get("keys") if isinstance(raw, dict) else None
        if not isinstance(keys, list):
            raise OidcError("bad_jwks", f"the identity provider's JWKS ({found.jwks_uri}) has no keys list")
        self._jwks, self._jwks_fetched_at = [k for k in keys if isinstance(k, dict)], self.clock()

    async def key_for(self, header: Mapping[str, Any]) -> dict[str, Any]:
        """The JWKS key an ID token names; the JWKS is read again for a kid it lacks, at most once per
        ``jwks_refetch_s`` (one read for many tokens at once: they wait on the same lock)."""
        async with self._jwks_lock:
            fetched = self._jwks_fetched_at
            if fetched is None or self.clock() - fetched >= JWKS_TTL_S:
                await self._fetch_jwks()
            key = select_key(header, self._jwks)
            if key is None and self.clock() - (self._jwks_fetched_at or 0.0) >= self.jwks_refetch_s:
                await self._fetch_jwks()
                key = select_key(header, self._jwks)
        if key is None:
            ago = self.clock() - (self._jwks_fetched_at or 0.0)
            kid = header.get("kid")
            named = f"kid={kid}" if kid is not None else "without a kid"
            raise OidcError(
                "unknown_key",
                f"the identity provider's signing key {named} is not in its JWKS (fetched {ago:.0f} s ago): "
                "the token was not signed by this provider, or it rotated its keys within the last "
                f"{self.jwks_refetch_s:g} s (try again then)",
            )
        return key

    async def authorization_url(self, redirect_uri: str, state: str, nonce: str, code_challenge: str) -> str:
        """Where the person's browser goes to sign in: the code flow with PKCE (S256), state and nonce."""
        found = await self.discovery()
        query = {
            "response_type": "code",
            "client_id": self.settings.client_id,
            "redirect_uri": redirect_uri,
            "scope": " ".join(self._scopes()),
            "state": state,
            "nonce": nonce,
            "code_challenge": code_challenge,
            "code_challenge_method": "S256",
        }
        sep = "&" if urlsplit(found.authorization_endpoint).query else "?"
        return found.authorization_endpoint + sep + urlencode(query)

    def _scopes(self) -> tuple[str, ...]:
        scopes = self.settings.scopes if "openid" in self.settings.scopes else ("openid", *self.settings.scopes)
        # The groups claim is usually released under a scope of the same name; asking for one the provider
        # does not know is ignored by it.
        return scopes if self.settings.groups_claim in scopes else (*scopes, self.settings.groups_claim)

    async def exchange_code(self, code: str, redirect_uri: str, code_verifier: str) -> dict[str, Any]:
        """The token endpoint's answer to the callback's code (with the PKCE verifier)."""
        found = await self.discovery()
        status, body = await self._post_form(
            found.token_endpoint,
            "token endpoint",
            {
                "grant_type": "authorization_code",
                "code": code,
                "redirect_uri": redirect_uri,
                "code_verifier": code_verifier,
            },
        )
        if status != 200 or "error" in body:
            raise OidcError(
                str(body.get("error") or "token_error"),
                f"the identity provider refused this sign-in's code ({body.get('error', f'HTTP {status}')}: "
                f"{body.get('error_description', '')}): sign in again",
            )
        if not isinstance(body.get("id_token"), str):
            raise OidcError(
                "no_id_token", "the identity provider's token endpoint sent no ID token: is openid a scope?"
            )
        return body

    async def verify_id_token(self, id_token: str, *, nonce: str | None, access_token: str = "") -> ExternalIdentity:
        """The person an ID token vouches for, after every check; groups and name from the userinfo
        endpoint (with ``access_token``) when the ID token does not carry them."""
        header, claims, signing_input, signature = split_jws(id_token)
        alg = header.get("alg")
        if not isinstance(alg, str) or alg.lower() == "none" or alg.upper().startswith("HS"):
            raise OidcError(
                "bad_alg",
                f"the ID token says alg={alg!r}: llmgw accepts only tokens signed with the provider's public keys "
                "(RS256, PS256, ES256, EdDSA …), never unsigned or HMAC ones",
            )
        key = await self.key_for(header)
        verify_signature(alg, key, signing_input, signature)
        now = self.clock()
        check_id_token(
            claims,
            issuer=self.settings.issuer,
            client_id=self.settings.client_id,
            nonce=nonce,
            now=now,
            skew_s=self.skew_s,
        )
        if nonce is not None:
            self._remember_nonce(nonce, float(claims["exp"]) + self.skew_s, now)
        merged = dict(claims)
        needs = self.settings.groups_claim not in claims or self.settings.username_claim not in claims
        if needs and access_token:
            info = await self.userinfo(access_token)
            if info.get("sub") != claims["sub"]:
                raise OidcError(
                    "wrong_subject",
                    f"the identity provider's userinfo names sub={info.get('sub')!r}, "
                    f"not the ID token's {claims['sub']!r}",
                )
            merged = {**info, **claims}  # the signed token's claims win; userinfo fills in the rest
        return identity_from_claims(self.name, self.settings, merged)

    def _remember_nonce(self, nonce: str, until: float, now: float) -> None:
        while self._used_nonces and next(iter(self._used_nonces.values())) < now:
            self._used_nonces.popitem(last=False)
        if nonce in self._used_nonces:
            raise OidcError(
                "replayed_nonce",
                "the sign-in's nonce was already used by an earlier sign-in (a replayed ID token): sign in again",
            )
        self._used_nonces[nonce] = until
        while len(self._used_nonces) > self._nonce_memory:
            self._used_nonces.popitem(last=False)

    async def userinfo(self, access_token: str) -> dict[str, Any]:
        found = await self.discovery()
        if not found.userinfo_endpoint:
            return {}
        info = await self._get_json(
            found.userinfo_endpoint, "userinfo endpoint", {"Authorization": f"Bearer {access_token}"}
        )
        if not isinstance(info, dict):
            raise OidcError("bad_userinfo", "the identity provider's userinfo endpoint did not answer a JSON object")
        return info

    async def sign_in_with_code(self, code: str, pending: PendingLogin) -> ExternalIdentity:
        """A console callback's code, exchanged and its ID token verified against the pending sign-in."""
        tokens = await self.exchange_code(code, pending.redirect_uri, pending.code_verifier)
        return await self.verify_id_token(
            tokens["id_token"], nonce=pending.nonce, access_token=str(tokens.get("access_token", ""))
        )

    async def start_device(self) -> DeviceStart:
        """A device authorization (RFC 8628 §3.1): the code the person enters at the provider's page."""
        found = await self.discovery()
        if not found.device_authorization_endpoint:
            raise OidcError(
                "no_device_flow",
                f"the identity provider {self.name} offers no device authorization endpoint: sign in through the "
                "console instead, or ask its administrator to enable the device flow for llmgw's client",
            )
        status, body = await self._post_form(
            found.device_authorization_endpoint, "device authorization endpoint", {"scope": " ".join(self._scopes())}
        )
        if status != 200 or "error" in body:
            raise OidcError(
                str(body.get("error") or "device_error"),
                f"the identity provider refused to start a device sign-in ({body.get('error', f'HTTP {status}')}: "
                f"{body.get('error_description', '')}); is the device grant allowed for client "
                f"{self.settings.client_id}?",
            )
        try:
            return msgspec.convert(body, DeviceStart, strict=False)
        except msgspec.ValidationError as e:
            raise OidcError(
                "device_error", f"the identity provider's device authorization is incomplete: {e}"
            ) from None

    async def poll_device(self, device_code: str) -> ExternalIdentity | None:
        """One poll of the token endpoint for a device sign-in: None while the person has not finished."""
        found = await self.discovery()
        status, body = await self._post_form(
            found.token_endpoint, "token endpoint", {"grant_type": DEVICE_GRANT, "device_code": device_code}
        )
        error = body.get("error")
        if error == "authorization_pending":
            return None
        if error == "slow_down":
            raise OidcError("slow_down", "the identity provider asks to poll less often: wait 5 s more between polls")
        if error == "expired_token":
            raise OidcError(
                "expired_token", "the device code expired before the sign-in was finished: start the sign-in again"
            )
        if error == "access_denied":
            raise OidcError("access_denied", "the sign-in was refused at the identity provider (cancelled or denied)")
        if status != 200 or error or not isinstance(body.get("id_token"), str):
            raise OidcError(
                str(error or "token_error"),
                f"the identity provider refused the device sign-in ({error or f'HTTP {status}'}: "
                f"{body.get('error_description', '')})",
            )
        return await self.verify_id_token(body["id_token"], nonce=None, access_token=str(body.get("access_token", "")))
