"""Sign-in against an LDAP directory or Active Directory (SPEC ID-2): bind as the person, read their groups.

The person is who the directory says after binding with their own password: by a DN template
(``uid={user},ou=people,dc=example,dc=org``), by a bind name (``{user}@corp`` for Active Directory)
followed to the entry the directory says was bound ("Who am I?", RFC 4532), or by a search for exactly
one entry (``user_base`` + ``user_filter``) made as ``bind_dn`` (or anonymously). Their
groups are DNs: Active Directory answers nested membership itself in one search
(LDAP_MATCHING_RULE_IN_CHAIN); another directory is walked level by level under ``group_base``
(``member`` / ``uniqueMember``), bounded and cycle-safe; with no ``group_base``, the person's
``memberOf``.

Only TLS is spoken unless plain text is asked for by name: ``ldaps://``, or ``ldap://`` upgraded by
StartTLS, with the certificate verified against ``ca_file`` (or the system's CAs) and the host name.
``ldap3`` is synchronous: every call runs in a thread, each network step bounded by ``timeout_s``.

Pure rules (escaping, the transport check, the group walk's next step) are separate from the I/O so
they are tested on their own.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import ssl
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

import ldap3
import msgspec
import structlog
from ldap3.core import exceptions as lx
from ldap3.utils.dn import parse_dn

from llmgw.events.schema.identity import ExternalIdentity, LdapSettings

log = structlog.get_logger("llmgw.services.identity.ldap")

CODES = ("invalid_login", "unavailable", "insecure", "misconfigured")
INVALID_LOGIN = "the user name or the password is wrong"
IN_CHAIN = "1.2.840.113556.1.4.1941"  # LDAP_MATCHING_RULE_IN_CHAIN (Active Directory)
MAX_DEPTH = 16  # group nesting walked at most this deep (Active Directory walks its own)
MAX_USER_LENGTH = 256
_CHUNK = 64  # DNs per OR filter in one level's search


class LdapError(Exception):
    """A sign-in the directory did not vouch for; ``code`` is one of CODES, ``message`` says what to do."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Transport(msgspec.Struct, frozen=True, kw_only=True):
    """How to reach the directory, as check_transport decided it."""

    host: str
    port: int
    use_ssl: bool  # ldaps://
    start_tls: bool  # ldap:// upgraded
    plain: bool  # ldap:// without TLS (allowed by name)


# -- pure rules --------------------------------------------------------------------------------


def escape_filter_value(value: str) -> str:
    """``value`` as an assertion value in a search filter (RFC 4515): ``* ( ) \\`` and NUL as ``\\xx``."""
    out: list[str] = []
    for ch in value:
        if ch in "*()\\\x00":
            out.append(f"\\{ord(ch):02x}")
        else:
            out.append(ch)
    return "".join(out)


def escape_dn_value(value: str) -> str:
    """``value`` as an attribute value in a DN (RFC 4514): specials escaped, and a leading ``#`` or
    space and a trailing space, so a user name can never add an RDN or end the DN early."""
    out: list[str] = []
    for i, ch in enumerate(value):
        if ch in ',+"\\<>;=':
            out.append("\\" + ch)
        elif ch == "\x00":
            out.append("\\00")
        elif (i == 0 and ch in " #") or (i == len(value) - 1 and ch == " "):
            out.append("\\" + ch)
        else:
            out.append(ch)
    return "".join(out)


def in_chain_filter(user_dn: str) -> str:
    """Active Directory's filter for every group ``user_dn`` is in, nested included."""
    return f"(member:{IN_CHAIN}:={escape_filter_value(user_dn)})"


def member_filter(dns: Iterable[str], group_filter: str) -> str:
    """The groups (``group_filter``) that have any of ``dns`` as a member or unique member."""
    terms = "".join(f"(member={escape_filter_value(dn)})(uniqueMember={escape_filter_value(dn)})" for dn in dns)
    return f"(&{group_filter}(|{terms}))"


def next_level(found: dict[str, str], frontier: Iterable[str]) -> list[str]:
    """The groups of ``frontier`` not seen yet (``found`` maps a DN's lower-cased form to it), added to
    ``found``: what the walk searches next. A group met again (a cycle) ends there."""
    fresh: list[str] = []
    for dn in sorted(frontier, key=str.lower):
        key = _dn_key(dn)
        if key not in found:
            found[key] = dn
            fresh.append(dn)
    return fresh


def walk_groups(direct_of: Callable[[list[str]], list[str]], user_dn: str, max_depth: int = MAX_DEPTH) -> list[str]:
    """Every group ``user_dn`` is in, nested included: ``direct_of(dns)`` says the groups having any of
    ``dns`` as a member. Nearest first; at most ``max_depth`` levels; a cycle ends the walk there."""
    found: dict[str, str] = {_dn_key(user_dn): user_dn}
    frontier = [user_dn]
    groups: list[str] = []
    for _ in range(max_depth):
        if not frontier:
            break
        frontier = next_level(found, direct_of(frontier))
        groups.extend(frontier)
    return groups


def check_transport(name: str, settings: LdapSettings) -> Transport:
    """Where and how to connect, or LdapError before any connection: only TLS unless plain is asked for."""
    url = settings.url.strip()
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise LdapError("misconfigured", f"the LDAP provider {name}'s URL {url!r} is not a URL ({exc})") from None
    scheme = parts.scheme.lower()
    if scheme not in ("ldap", "ldaps") or not parts.hostname:
        raise LdapError(
            "misconfigured",
            f"the LDAP provider {name}'s URL {url!r} is not ldaps://host[:port] or ldap://host[:port]",
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
        raise LdapError(
            "misconfigured",
            f"the LDAP provider {name}'s URL {url!r} has more than a host and a port: set the search base "
            "with user_base, and the user with user_dn or bind_dn",
        )
    if settings.timeout_s <= 0:
        raise LdapError("misconfigured", f"the LDAP provider {name}'s timeout_s must be more than 0 seconds")
    if scheme == "ldaps":
        if settings.start_tls:
            raise LdapError(
                "misconfigured",
                f"the LDAP provider {name} asks for StartTLS on {url}, which is TLS already: "
                "drop --start-tls, or use ldap:// with it",
            )
        return Transport(host=parts.hostname, port=port or 636, use_ssl=True, start_tls=False, plain=False)
    if settings.start_tls:
        return Transport(host=parts.hostname, port=port or 389, use_ssl=False, start_tls=True, plain=False)
    if settings.allow_plain:
        return Transport(host=parts.hostname, port=port or 389, use_ssl=False, start_tls=False, plain=True)
    raise LdapError(
        "insecure",
        f"{url} is plain text: use ldaps://, --start-tls, or --insecure-plain-ldap if you mean it",
    )


def check_settings(name: str, settings: LdapSettings) -> Transport:
    """check_transport, and how the person is found: a template with {user}, or a search base and filter."""
    transport = check_transport(name, settings)
    if settings.user_dn:
        if "{user}" not in settings.user_dn:
            raise LdapError(
                "misconfigured",
                f"the LDAP provider {name}'s user_dn {settings.user_dn!r} has no {{user}}: "
                "write where the user name goes, e.g. uid={user},ou=people,dc=example,dc=org",
            )
    elif not settings.user_base:
        raise LdapError(
            "misconfigured",
            f"the LDAP provider {name} has neither user_dn nor user_base: set a DN template "
            "(uid={user},ou=people,…) or where to search for people",
        )
    if not settings.user_dn:
        if "{user}" not in settings.user_filter:
            raise LdapError(
                "misconfigured",
                f"the LDAP provider {name}'s user_filter {settings.user_filter!r} has no {{user}}: "
                "e.g. (uid={user}) or (sAMAccountName={user})",
            )
    for what, text in (("user_filter", settings.user_filter), ("group_filter", settings.group_filter)):
        if not balanced_filter(text):
            raise LdapError(
                "misconfigured",
                f"the LDAP provider {name}'s {what} {text!r} is not one filter in parentheses: "
                "e.g. (uid={user}) or (objectClass=groupOfNames)",
            )
    return transport


def balanced_filter(text: str) -> bool:
    """Whether ``text`` is one parenthesised filter, its parentheses balanced (an RFC 4515 shape check;
    the directory judges the rest)."""
    text = text.strip()
    if not (text.startswith("(") and text.endswith(")")):
        return False
    depth = 0
    for i, ch in enumerate(text):
        depth += 1 if ch == "(" else -1 if ch == ")" else 0
        if depth < 0 or (depth == 0 and i != len(text) - 1):
            return False
    return depth == 0


def whoami_lookup(answer: str, bind_name: str) -> tuple[str, str]:
    """How to find the entry a "Who am I?" ``answer`` names: ("dn", DN) for ``dn:…``; ("filter", …) by
    sAMAccountName for Active Directory's ``u:DOMAIN\\name``, by uid for another ``u:name``; with no
    answer, the bind name as Active Directory's userPrincipalName."""
    if answer.startswith("dn:") and answer[3:].strip():
        return "dn", answer[3:].strip()
    if answer.startswith("u:") and answer[2:].strip():
        account = answer[2:].strip()
        _domain, backslash, name = account.rpartition("\\")
        if backslash:
            return "filter", f"(sAMAccountName={escape_filter_value(name)})"
        return "filter", f"(uid={escape_filter_value(account)})"
    return "filter", f"(userPrincipalName={escape_filter_value(bind_name)})"


def domain_of(dn: str) -> str:
    """The ``DC=`` part of a DN (``DC=corp,DC=example``): where Active Directory's groups are by default."""
    try:
        parts = parse_dn(dn, escape=False)
    except lx.LDAPInvalidDnError:
        return ""
    return ",".join(f"{attr}={value}" for attr, value, _ in parts if attr.lower() == "dc")


def _is_dn(template: str) -> bool:
    """A user_dn template that is a DN (``uid={user},…``), not a bind name such as ``{user}@corp``."""
    first = template.split(",", 1)[0]
    return "=" in first


def _dn_key(dn: str) -> str:
    return ",".join(part.strip() for part in dn.lower().split(","))


def _first(attributes: dict[str, Any], name: str) -> str:
    if not name:
        return ""
    for key, value in attributes.items():
        if key.lower() == name.lower():
            if isinstance(value, list | tuple):
                value = value[0] if value else ""
            if isinstance(value, bytes):
                value = value.decode(errors="replace")
            return str(value)
    return ""


def _all(attributes: dict[str, Any], name: str) -> list[str]:
    for key, value in attributes.items():
        if key.lower() == name.lower():
            values = value if isinstance(value, list | tuple) else [value]
            return [v.decode(errors="replace") if isinstance(v, bytes) else str(v) for v in values if v]
    return []


def describe_failure(name: str, settings: LdapSettings, text: str, doing: str) -> tuple[str, str]:
    """(code, message) for what ldap3 said went wrong while ``doing``: a certificate that does not verify
    or names another host is ``insecure`` and says which setting to fix; the rest is ``unavailable``."""
    url = settings.url
    where = f"ca_file {settings.ca_file}" if settings.ca_file else "the system's CAs (no ca_file set)"
    if "timed out" in text:
        return (
            "unavailable",
            f"the directory {name} at {url} did not answer within {settings.timeout_s:g} s ({doing}): check the URL, "
            "that the directory answers there, or give it longer (timeout_s)",
        )
    if "mismatch, certificate is not valid" in text:
        host = urlsplit(url).hostname or url
        return (
            "insecure",
            f"the certificate of the directory {name} at {url} is not for the host {host}: connect by a name "
            "or address the certificate lists",
        )
    verify = re.search(r"certificate verify failed: ?([^(]*?)\s*\(_ssl", text)
    if verify or "CERTIFICATE_VERIFY_FAILED" in text:
        why = verify.group(1) if verify and verify.group(1) else "not signed by a CA trusted here"
        return (
            "insecure",
            f"the certificate of the directory {name} at {url} does not verify against {where} ({why}): "
            "set ca_file (--ca-file) to the CA that signed it",
        )
    tls = re.search(r"\[SSL: ?([A-Z_]+)\]", text)
    if tls or "ssl" in text.lower() or "tls" in text.lower():
        why = tls.group(1).lower().replace("_", " ") if tls else text[:200]
        return (
            "unavailable",
            f"TLS with the directory {name} at {url} failed ({why}): check that it speaks "
            + ("ldaps:// there" if url.lower().startswith("ldaps:") else "StartTLS there"),
        )
    return (
        "unavailable",
        f"the directory {name} at {url} cannot be reached ({doing}: {text[:300]}): check the URL and that "
        "the directory answers there",
    )


# -- the directory -----------------------------------------------------------------------------


class LdapDirectory:
    """One LDAP provider (``name``), as its settings say; ``bind_password`` is bind_dn's, read by the
    caller from the environment variable the settings name."""

    def __init__(self, name: str, settings: LdapSettings, *, bind_password: str = "") -> None:
        self.name = name
        self.settings = settings
        self.bind_password = bind_password

    async def authenticate(self, user: str, password: str) -> ExternalIdentity:
        """The person ``user`` is at the directory once it accepted ``password``, with every group they
        are in; LdapError otherwise (the same invalid_login for a wrong password and an unknown user)."""
        transport = check_settings(self.name, self.settings)
        # An empty password would be an "unauthenticated bind" (RFC 4513 5.1.2): some directories accept
        # it for any name. Control characters never belong in a user name.
        if not password or not user.strip() or len(user) > MAX_USER_LENGTH or any(ord(c) < 32 for c in user):
            raise LdapError("invalid_login", INVALID_LOGIN)
        if self.settings.bind_dn and not self.bind_password and not self.settings.user_dn:
            env = self.settings.bind_password_env or "the bind password's environment variable"
            raise LdapError(
                "misconfigured",
                f"the LDAP provider {self.name} searches as {self.settings.bind_dn} but has no password for it: "
                f"set {env} where the server runs",
            )
        try:
            return await asyncio.to_thread(self._authenticate, transport, user, password)
        except LdapError:
            raise
        except Exception as exc:  # ldap3 raising outside its own hierarchy: the directory's trouble, never a 500
            log.exception("the LDAP sign-in failed unexpectedly", provider=self.name, url=self.settings.url)
            raise LdapError(
                "unavailable",
                f"the directory {self.name} at {self.settings.url} could not be asked ({type(exc).__name__}: {exc})",
            ) from exc

    # Everything below runs in a worker thread: ldap3 blocks.

    def _authenticate(self, transport: Transport, user: str, password: str) -> ExternalIdentity:
        s = self.settings
        wanted = [a for a in (s.username_attr, s.display_name_attr, s.email_attr, "memberOf") if a]
        if s.user_dn and _is_dn(s.user_dn):
            bind_name = s.user_dn.replace("{user}", escape_dn_value(user))
            conn = self._bound(transport, bind_name, password)
            try:
                entry = self._read(conn, bind_name, wanted)
                return self._identity(conn, entry, user)
            finally:
                _close(conn)
        if s.user_dn:  # a bind name that is not a DN ({user}@corp): bind, then find the entry bound as
            bind_name = s.user_dn.replace("{user}", user)
            conn = self._bound(transport, bind_name, password)
            try:
                entry = self._bound_entry(conn, bind_name, wanted)
                return self._identity(conn, entry, user)
            finally:
                _close(conn)
        finder = self._bound(transport, s.bind_dn or None, self.bind_password or None, searching=True)
        try:
            found = self._find_person(finder, user, wanted)
        finally:
            _close(finder)
        conn = self._bound(transport, found[0], password)
        try:
            return self._identity(conn, found, user)
        finally:
            _close(conn)

    def _identity(self, conn: ldap3.Connection, entry: tuple[str, dict[str, Any]], user: str) -> ExternalIdentity:
        dn, attributes = entry
        s = self.settings
        return ExternalIdentity(
            provider=self.name,
            subject=dn,
            username=_first(attributes, s.username_attr) or user,
            display_name=_first(attributes, s.display_name_attr),
            email=_first(attributes, s.email_attr),
            groups=tuple(self._groups(conn, dn, attributes)),
        )

    def _groups(self, conn: ldap3.Connection, dn: str, attributes: dict[str, Any]) -> list[str]:
        s = self.settings
        if s.active_directory:
            base = s.group_base or domain_of(dn)
            if not base:
                raise LdapError(
                    "misconfigured",
                    f"the LDAP provider {self.name} cannot tell where the groups of {dn} are: set group_base",
                )
            found = self._search(conn, base, f"(&{s.group_filter}{in_chain_filter(dn)})", [])
            return sorted((d for d, _ in found), key=str.lower)
        if not s.group_base:
            return sorted(_all(attributes, "memberOf"), key=str.lower)

        def direct_of(dns: list[str]) -> list[str]:
            groups: list[str] = []
            for i in range(0, len(dns), _CHUNK):
                found = self._search(conn, s.group_base, member_filter(dns[i : i + _CHUNK], s.group_filter), [])
                groups.extend(d for d, _ in found)
            return groups

        return walk_groups(direct_of, dn)

    def _bound_entry(self, conn: ldap3.Connection, bind_name: str, wanted: list[str]) -> tuple[str, dict[str, Any]]:
        """The entry the directory says ``conn`` is bound as ("Who am I?", RFC 4532), never one found by the
        typed name alone: another account's user principal name may be someone else's account name."""
        try:
            answer = conn.extend.standard.who_am_i() or ""
        except lx.LDAPException:
            answer = ""
        kind, value = whoami_lookup(answer if isinstance(answer, str) else "", bind_name)
        if kind == "dn":
            dn, attributes = self._read(conn, value, wanted)
            return dn, attributes
        return self._find_person(conn, "", wanted, query=value)

    def _find_person(
        self, conn: ldap3.Connection, user: str, wanted: list[str], *, query: str = ""
    ) -> tuple[str, dict[str, Any]]:
        s = self.settings
        base = s.user_base or self._default_base(conn)
        query = query or s.user_filter.replace("{user}", escape_filter_value(user))
        found = self._search(conn, base, query, wanted, size_limit=2)
        if not found:
            raise LdapError("invalid_login", INVALID_LOGIN)
        if len(found) > 1:
            raise LdapError(
                "misconfigured",
                f"the LDAP provider {self.name}'s user_filter {s.user_filter} matches more than one entry under "
                f"{base} for one user name: make it match one person (e.g. add (objectClass=person))",
            )
        return found[0]

    def _default_base(self, conn: ldap3.Connection) -> str:
        """Active Directory's default naming context, when no user_base says where people are."""
        found = self._search(conn, "", "(objectClass=*)", ["defaultNamingContext"], scope=ldap3.BASE)
        base = _first(found[0][1], "defaultNamingContext") if found else ""
        if not base:
            raise LdapError(
                "misconfigured",
                f"the LDAP provider {self.name} does not say where people are: set user_base",
            )
        return base

    def _read(self, conn: ldap3.Connection, dn: str, wanted: list[str]) -> tuple[str, dict[str, Any]]:
        found = self._search(conn, dn, "(objectClass=*)", wanted, scope=ldap3.BASE)
        if not found:  # bound, yet cannot read their own entry: the directory's rights forbid it
            return dn, {}
        return found[0]

    def _search(
        self,
        conn: ldap3.Connection,
        base: str,
        query: str,
        attributes: list[str],
        *,
        scope: str = ldap3.SUBTREE,
        size_limit: int = 0,
    ) -> list[tuple[str, dict[str, Any]]]:
        """Entries (DN, attributes) found, every page read; search references (referrals) skipped."""
        entries: list[tuple[str, dict[str, Any]]] = []
        cookie: bytes | None = None
        while True:
            try:
                conn.search(
                    base,
                    query,
                    search_scope=scope,
                    attributes=attributes or [ldap3.NO_ATTRIBUTES],
                    size_limit=size_limit,
                    time_limit=max(1, math.ceil(self.settings.timeout_s)),
                    paged_size=None if scope == ldap3.BASE else 500,
                    paged_cookie=cookie,
                )
            except lx.LDAPException as exc:
                raise self._failure(exc, f"searching {base}") from None
            result = conn.result or {}
            code = result.get("result", 0)
            if code == 32:  # noSuchObject: the base is not there
                if scope == ldap3.BASE:
                    return entries
                raise LdapError(
                    "misconfigured",
                    f"the LDAP provider {self.name}'s search base {base} does not exist in the directory",
                )
            if code not in (0, 4):  # 4: sizeLimitExceeded, the entries up to the limit are answered
                raise LdapError(
                    "unavailable",
                    f"the directory {self.name} refused a search under {base}: "
                    f"{result.get('description', code)} {result.get('message', '')}".strip(),
                )
            for item in conn.response or []:
                if item.get("type") == "searchResEntry":
                    entries.append((item["dn"], dict(item.get("attributes") or {})))
            controls = result.get("controls") or {}
            cookie = controls.get("1.2.840.113556.1.4.319", {}).get("value", {}).get("cookie")
            if not cookie or code == 4:
                return entries

    def _bound(
        self, transport: Transport, who: str | None, password: str | None, *, searching: bool = False
    ) -> ldap3.Connection:
        """A connection over the transport, bound as ``who`` (None: anonymous). A refused bind is the
        person's invalid_login, or when ``searching``, the search account's misconfiguration."""
        s = self.settings
        tls = None
        if not transport.plain:
            if s.ca_file and not os.path.isfile(s.ca_file):
                raise LdapError(
                    "misconfigured",
                    f"the LDAP provider {self.name}'s ca_file {s.ca_file} does not exist on this server",
                )
            try:
                context = ssl.create_default_context(cafile=s.ca_file or None)
            except (OSError, ssl.SSLError) as exc:
                raise LdapError(
                    "misconfigured",
                    f"the LDAP provider {self.name}'s ca_file {s.ca_file} is not a PEM certificate ({exc})",
                ) from None
            tls = _VerifiedTls(context, transport.host)
        server = ldap3.Server(
            transport.host,
            port=transport.port,
            use_ssl=transport.use_ssl,
            tls=tls,
            get_info=ldap3.NONE,
            connect_timeout=s.timeout_s,
        )
        conn = ldap3.Connection(
            server,
            user=who,
            password=password,
            auto_bind=ldap3.AUTO_BIND_NONE,
            receive_timeout=max(1, math.ceil(s.timeout_s)),  # ldap3 packs it as whole seconds
            raise_exceptions=False,
            auto_referrals=False,
            read_only=True,
            client_strategy=ldap3.SYNC,
        )
        try:
            conn.open()
            if transport.start_tls and not conn.start_tls():
                _close(conn)
                raise LdapError(
                    "insecure",
                    f"the directory {self.name} at {s.url} did not start TLS "
                    f"({(conn.result or {}).get('description', 'no answer')}): check it offers StartTLS, or use ldaps://",
                )
            bound = conn.bind()
        except lx.LDAPException as exc:
            _close(conn)
            raise self._failure(exc, "connecting") from None
        if bound:
            return conn
        result = conn.result or {}
        _close(conn)
        code = result.get("result")
        if searching and code == 49:  # invalidCredentials
            env = s.bind_password_env or "the bind password's environment variable"
            raise LdapError(
                "misconfigured",
                f"the directory {self.name} refused the search account {s.bind_dn or '(anonymous)'}: "
                f"check bind_dn and the password in {env}",
            )
        if not searching and code in (34, 49):  # 34 invalidDNSyntax: a name the template made into no DN is nobody
            raise LdapError("invalid_login", INVALID_LOGIN)
        if searching and not s.bind_dn and result.get("result") in (48, 50, 53):
            raise LdapError(
                "misconfigured",
                f"the directory {self.name} does not let anyone search anonymously: set bind_dn and its password",
            )
        raise LdapError(
            "unavailable",
            f"the directory {self.name} at {s.url} refused the bind: "
            f"{result.get('description', '')} {result.get('message', '')}".strip(),
        )

    def _failure(self, exc: lx.LDAPException, doing: str) -> LdapError:
        """An ldap3 exception as the error people can act on."""
        code, message = describe_failure(self.name, self.settings, str(exc), doing)
        return LdapError(code, message)


class _VerifiedTls(ldap3.Tls):
    """TLS by the standard library's verification: the chain against the context's CAs and the host
    name (or IP address) by OpenSSL itself, not by ldap3's own, deprecated host-name matching."""

    def __init__(self, context: ssl.SSLContext, host: str) -> None:
        super().__init__(validate=ssl.CERT_REQUIRED)
        self.context = context
        self.host = host

    def wrap_socket(self, connection: Any, do_handshake: bool = False) -> None:
        connection.socket = self.context.wrap_socket(
            connection.socket, server_side=False, do_handshake_on_connect=do_handshake, server_hostname=self.host
        )


def _close(conn: ldap3.Connection) -> None:
    try:
        conn.unbind()
    except lx.LDAPException:  # already closed by the server: nothing left to release
        pass
