"""A real OpenID provider for the tests: tests/idp/provider.mjs (the `oidc-provider` npm package) run by
Debian's node on a free loopback port, with its own people, passwords and groups.

The harness keeps the provider's signing keys (it makes them and hands them to the provider), so a test
can forge a token exactly as the provider would sign it, then change one thing (an expiry, an audience);
and it makes other keys for tokens the provider never signed. ``sign_in_over_http`` walks the provider's
own login page with plain HTTP (no browser) and returns where it sends the person back to.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urljoin

import aiohttp
import msgspec
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from llmgw.services.identity.oidc import DEVICE_GRANT, b64url_encode

HERE = Path(__file__).resolve().parent
START_DEADLINE_S = 30.0

# People of the test provider: alice and bob have groups, carol has none.
USERS: dict[str, dict[str, Any]] = {
    "alice": {"password": "alice-wonderland-7", "groups": ["ml-admins", "ml-users"], "name": "Alice Liddell"},
    "bob": {"password": "bob-builder-7", "groups": ["everyone"], "name": "Bob Builder"},
    "carol": {"password": "carol-singer-7", "groups": [], "name": "Carol Singer"},
}


def _int_b64(n: int) -> str:
    return b64url_encode(n.to_bytes((n.bit_length() + 7) // 8 or 1, "big"))


class SigningKey(msgspec.Struct):
    """A key that signs JWTs: the provider's (in its JWKS) or another one (a forger's)."""

    kid: str
    private: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey
    alg: str = "RS256"

    @staticmethod
    def rsa(kid: str) -> SigningKey:
        return SigningKey(kid, rsa.generate_private_key(public_exponent=65537, key_size=2048))

    @staticmethod
    def ec256(kid: str) -> SigningKey:
        return SigningKey(kid, ec.generate_private_key(ec.SECP256R1()), "ES256")

    def public_jwk(self) -> dict[str, Any]:
        if isinstance(self.private, rsa.RSAPrivateKey):
            pub = self.private.public_key().public_numbers()
            return {
                "kty": "RSA",
                "kid": self.kid,
                "use": "sig",
                "alg": self.alg,
                "n": _int_b64(pub.n),
                "e": _int_b64(pub.e),
            }
        pub_ec = self.private.public_key().public_numbers()
        return {
            "kty": "EC",
            "kid": self.kid,
            "use": "sig",
            "alg": self.alg,
            "crv": "P-256",
            "x": b64url_encode(pub_ec.x.to_bytes(32, "big")),
            "y": b64url_encode(pub_ec.y.to_bytes(32, "big")),
        }

    def private_jwk(self) -> dict[str, Any]:
        jwk = self.public_jwk()
        if isinstance(self.private, rsa.RSAPrivateKey):
            n = self.private.private_numbers()
            jwk |= {
                "d": _int_b64(n.d),
                "p": _int_b64(n.p),
                "q": _int_b64(n.q),
                "dp": _int_b64(n.dmp1),
                "dq": _int_b64(n.dmq1),
                "qi": _int_b64(n.iqmp),
            }
        else:
            jwk["d"] = b64url_encode(self.private.private_numbers().private_value.to_bytes(32, "big"))
        return jwk


def sign_jwt(claims: dict[str, Any], key: SigningKey | None, *, header: dict[str, Any] | None = None) -> str:
    """A compact JWS of ``claims``; ``key=None`` makes an unsigned one (alg none)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding
    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

    head = {"alg": key.alg if key else "none", "typ": "JWT", **({"kid": key.kid} if key else {})} | (header or {})
    signing_input = (
        b64url_encode(json.dumps(head).encode()) + "." + b64url_encode(json.dumps(claims).encode())
    ).encode()
    if key is None:
        return signing_input.decode() + "."
    if isinstance(key.private, rsa.RSAPrivateKey):
        signature = key.private.sign(signing_input, padding.PKCS1v15(), hashes.SHA256())
    else:
        r, s = decode_dss_signature(key.private.sign(signing_input, ec.ECDSA(hashes.SHA256())))
        signature = r.to_bytes(32, "big") + s.to_bytes(32, "big")
    return signing_input.decode() + "." + b64url_encode(signature)


class Client(msgspec.Struct):
    """A client registered at the provider (llmgw, as the provider knows it)."""

    client_id: str
    client_secret: str
    redirect_uris: list[str] = msgspec.field(default_factory=list)
    grant_types: list[str] = msgspec.field(default_factory=lambda: ["authorization_code", DEVICE_GRANT])


def unavailable_reason() -> str | None:
    """Why the provider cannot run here, or None. Its npm packages are installed (``npm ci``, from the
    committed lock file) when missing and npm is there, as ops/install-test-tools.sh does."""
    if shutil.which("node") is None:
        return "node is not installed: install Debian's nodejs and npm (sh ops/install-test-tools.sh does)"
    if (HERE / "node_modules" / "oidc-provider").is_dir():
        return None
    if shutil.which("npm") is None:
        return "npm is not installed, so tests/idp's packages are not: install Debian's npm (ops/install-test-tools.sh)"
    try:
        done = subprocess.run(
            ["npm", "ci", "--prefix", str(HERE), "--no-audit", "--no-fund"], capture_output=True, text=True, timeout=300
        )
    except subprocess.TimeoutExpired:
        return "npm ci in tests/idp did not finish within 300 s (no registry reachable?)"
    if done.returncode != 0 or not (HERE / "node_modules" / "oidc-provider").is_dir():
        return f"npm ci in tests/idp failed (no registry reachable?): {done.stderr.strip()[-300:]}"
    return None


class Idp:
    """One running provider. ``issuer`` is known once ``start`` returns."""

    def __init__(
        self,
        clients: list[Client],
        *,
        users: dict[str, dict[str, Any]] | None = None,
        keys: list[SigningKey] | None = None,
        device_interval_s: int = 0,
    ) -> None:
        self.clients = clients
        self.users = users if users is not None else USERS
        self.keys = keys if keys is not None else [SigningKey.rsa("idp-key-1")]
        self.device_interval_s = device_interval_s
        self.port = 0
        self.issuer = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.output: list[str] = []
        self._drainer: threading.Thread | None = None

    @property
    def key(self) -> SigningKey:
        """The key the provider signs with (the first of its JWKS)."""
        return self.keys[0]

    def start(self) -> Idp:
        env = {
            **os.environ,
            "IDP_PORT": str(self.port),
            "IDP_CLIENTS": msgspec.json.encode(self.clients).decode(),
            "IDP_JWKS": json.dumps({"keys": [k.private_jwk() for k in self.keys]}),
            "IDP_USERS": json.dumps(self.users),
            "IDP_DEVICE_INTERVAL": str(self.device_interval_s),
        }
        self.proc = subprocess.Popen(
            ["node", str(HERE / "provider.mjs")], cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + START_DEADLINE_S
        issuer = self._await_line(re.compile(r"^listening (\S+)"), deadline)
        self.issuer = issuer
        self.port = int(issuer.rsplit(":", 1)[1])
        self._await_discovery(deadline)
        # Keep reading what it prints (a full pipe would block it), the last lines kept for a failure's report.
        self._drainer = threading.Thread(target=self._drain, args=(self.proc,), daemon=True)
        self._drainer.start()
        return self

    def _drain(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        with contextlib.suppress(ValueError, OSError):  # closed by stop()
            for line in iter(proc.stdout.readline, b""):
                self.output = [*self.output[-199:], line.decode(errors="replace").rstrip()]

    def _await_line(self, pattern: re.Pattern[str], deadline: float) -> str:
        assert self.proc is not None and self.proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            buffer = b""
            while (left := deadline - time.monotonic()) > 0:
                if not sel.select(timeout=left):
                    break
                chunk = os.read(self.proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace")
                    self.output.append(text)
                    if m := pattern.match(text):
                        return m.group(1)
        self.stop()
        raise RuntimeError("the test identity provider did not start:\n" + "\n".join(self.output[-20:]))

    def _await_discovery(self, deadline: float) -> None:
        url = self.issuer + "/.well-known/openid-configuration"
        last: Exception | None = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=max(0.1, deadline - time.monotonic())) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError) as e:
                last = e
            time.sleep(0.05)  # polling a condition (discovery answers) under a deadline
        self.stop()
        raise RuntimeError(f"the test identity provider's discovery did not answer at {url}: {last}")

    def restart(self, keys: list[SigningKey]) -> None:
        """The same provider (same port and issuer, same clients and people) with other signing keys:
        a key rotation. Its sessions and codes are lost, as a restart loses them."""
        self.stop()
        self.keys = keys
        self.start()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._drainer is not None:
            self._drainer.join(timeout=10)  # it ends at the pipe's end, now the process has
            self._drainer = None
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None

    def id_claims(self, client_id: str, **changes: Any) -> dict[str, Any]:
        """Claims the provider would put in an ID token for alice now; ``changes`` overrides (None drops)."""
        now = int(time.time())
        claims: dict[str, Any] = {
            "iss": self.issuer,
            "sub": "alice",
            "aud": client_id,
            "iat": now,
            "exp": now + 600,
            "preferred_username": "alice",
            "email": "alice@example.org",
            "groups": ["ml-admins", "ml-users"],
        }
        claims.update(changes)
        return {k: v for k, v in claims.items() if v is not None}


async def sign_in_over_http(
    session: aiohttp.ClientSession, url: str, login: str, password: str, *, stop_at: str
) -> str:
    """Follows ``url`` through the provider's login form as a person would (without a browser) and returns
    the first redirect whose address starts with ``stop_at`` (the client's redirect URI) without following it."""
    async with session.get(url, allow_redirects=False) as resp:
        location = resp.headers.get("Location", "")
    for _ in range(20):
        target = urljoin(url, location)
        if target.startswith(stop_at):
            return target
        async with session.get(target, allow_redirects=False) as resp:
            if resp.status in (302, 303):
                location, url = resp.headers["Location"], target
                continue
            page = await resp.text()
        action = re.search(r'action="([^"]*/login)"', page)
        if action is None:
            raise AssertionError(f"no login form at {target}: {page[:300]}")
        async with session.post(
            urljoin(target, action.group(1)), data={"login": login, "password": password}, allow_redirects=False
        ) as resp:
            if resp.status not in (302, 303):
                raise AssertionError(f"the provider did not accept {login}'s sign-in: {(await resp.text())[:300]}")
            location, url = resp.headers["Location"], target
    raise AssertionError("the sign-in never came back to the client")


async def confirm_device_over_http(
    session: aiohttp.ClientSession, verification_uri_complete: str, login: str, password: str, *, abort: bool = False
) -> str:
    """Completes (or, with ``abort``, cancels) a device sign-in at the provider's own pages without a browser:
    submits each page's form as a person would (the login form with the credentials); returns the last page."""
    async with session.get(verification_uri_complete) as resp:
        page, base = await resp.text(), str(resp.url)
    for _ in range(10):
        form = re.search(r'<form[^>]*action="([^"]+)"[^>]*>(.*?)</form>', page, re.S)
        if form is None:
            return page
        action = urljoin(base, form.group(1))
        if action.endswith("/login"):
            fields = {"login": login, "password": password}
        else:
            fields = dict(re.findall(r'<input[^>]*name="([^"]+)"[^>]*value="([^"]*)"', form.group(2)))
            if abort and 'name="abort"' in page:
                fields["abort"] = "yes"
        async with session.post(action, data=fields) as resp:
            page, base = await resp.text(), str(resp.url)
        if "abort" in fields:
            return page
    raise AssertionError(f"the device sign-in did not end: {page[:300]}")


async def cancel_over_http(session: aiohttp.ClientSession, url: str, *, stop_at: str) -> str:
    """Follows ``url`` to the provider's login page and presses Cancel there; returns the redirect back to
    the client (``stop_at``), which carries ``error=access_denied``."""
    async with session.get(url) as resp:
        page, base = await resp.text(), str(resp.url)
    abort = re.search(r'action="([^"]*/abort)"', page)
    if abort is None:
        raise AssertionError(f"no cancel button at {base}: {page[:300]}")
    target = urljoin(base, abort.group(1))
    async with session.post(target, allow_redirects=False) as resp:
        location = resp.headers.get("Location", "")
    for _ in range(10):
        target = urljoin(target, location)
        if target.startswith(stop_at):
            return target
        async with session.get(target, allow_redirects=False) as resp:
            location = resp.headers.get("Location", "")
    raise AssertionError("the cancelled sign-in never came back to the client")
