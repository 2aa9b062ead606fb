"""The console's session: a cookie that holds the person's session token, and the CSRF token derived from it.

The cookie holds the very session token ``POST /api/v1/login`` would hand out (``llmgw-ses-…``), so the
console signs its commands with it like the CLI does (services/api/act.py) and logging out revokes it.
The CSRF token is an HMAC of that token: a page served to the person carries it, a page of another site
cannot know it, and nothing is kept on the server to check it with. Everything here is pure.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from urllib.parse import urlsplit

COOKIE = "llmgw_session"
CSRF_FIELD = "csrf"
CSRF_HEADER = "X-CSRF-Token"
CSRF_LABEL = b"llmgw console csrf v1"


def csrf_token(session_token: str) -> str:
    """The CSRF token of a session: HMAC-SHA256 of a fixed label, keyed by the session token."""
    mac = hmac.new(session_token.encode(), CSRF_LABEL, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def csrf_valid(session_token: str, sent: str | None) -> bool:
    return bool(sent) and hmac.compare_digest(csrf_token(session_token), sent or "")


def cookie_options(secure: bool, max_age_s: int | None) -> dict[str, object]:
    """How the session cookie is set: never readable by scripts, never sent by another site's request,
    only over TLS when the console is served over TLS."""
    options: dict[str, object] = {"httponly": True, "samesite": "Strict", "path": "/", "secure": secure}
    if max_age_s is not None:
        options["max_age"] = max_age_s
    return options


def safe_next(target: str | None, default: str = "/console") -> str:
    """Where to go after signing in: a path of the console only, never another site (no open redirect)."""
    if not target:
        return default
    parts = urlsplit(target)
    if parts.scheme or parts.netloc or not parts.path.startswith("/console") or target.startswith("//"):
        return default
    if "\\" in target or any(ord(c) < 32 for c in target):
        return default
    return target


CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'; object-src 'none'"
)
