"""A small PKI for one llmgw installation (SPEC OPS-4): a CA, the certificates it issues, TLS contexts.

Keys are ECDSA P-256: every TLS stack llmgw meets (nats-server's Go, OpenSSL under aiohttp and
nats-py) takes them. Making and reading certificates are functions over PEM bytes; the few that
touch files write them atomically (a temporary file, then a rename), keys mode 0600, certificates
0644. :func:`validity_problem` is the one rule for "may this certificate be used now", so a server
refuses an expired or not-yet-valid certificate at start with the same words `ctl cert list` uses.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import ssl
import tempfile
from collections.abc import Sequence
from pathlib import Path

import msgspec
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from prometheus_client import CollectorRegistry, Gauge

CA_NAME = "ca"
SOON_S = 14 * 86400  # matches the CertificateExpiresSoon alert
VERY_SOON_S = 3 * 86400  # matches CertificateExpiresVerySoon


class PkiError(Exception):
    """A certificate or key cannot be made, read or used; the message names the file and what to do."""


class Issued(msgspec.Struct, frozen=True):
    """A private key and its certificate, both PEM."""

    key_pem: bytes
    cert_pem: bytes


class CertInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a certificate says, as plain data (`ctl cert list --json`)."""

    subject: str
    issuer: str
    dns: tuple[str, ...] = ()
    ips: tuple[str, ...] = ()
    not_before: float  # Unix seconds
    not_after: float
    serial: str  # hex
    fingerprint: str  # SHA-256 of the DER, hex
    is_ca: bool = False
    server: bool = False  # extended key usage serverAuth
    client: bool = False  # clientAuth

    @property
    def sans(self) -> tuple[str, ...]:
        return (*self.dns, *self.ips)


def _utc(ts: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(ts, dt.UTC)


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def make_ca(common_name: str, *, now: float, days: float = 3650) -> Issued:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    key = _new_key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_utc(now - 300))  # a little slack for clocks a few minutes apart
        .not_valid_after(_utc(now + days * 86400))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256())
    )
    return Issued(_key_pem(key), cert.public_bytes(serialization.Encoding.PEM))


def issue(
    ca: Issued,
    common_name: str,
    *,
    now: float,
    dns: Sequence[str] = (),
    ips: Sequence[str] = (),
    days: float = 90,
    server: bool = True,
    client: bool = False,
    not_before: float | None = None,
    not_after: float | None = None,
) -> Issued:
    """A leaf certificate signed by ``ca`` for ``dns`` names and ``ips``; ``server``/``client`` its TLS usages.

    ``not_before``/``not_after`` (Unix seconds) override ``now`` and ``days``: tests make certificates
    that expired or are not valid yet with them.
    """
    if not (server or client):
        raise PkiError("a certificate needs a use: server, client or both")
    if server and not (dns or ips):
        raise PkiError(f"a server certificate for {common_name} needs a name to serve: give --dns NAME or --ip ADDRESS")
    try:
        addresses = [ipaddress.ip_address(ip) for ip in ips]
    except ValueError as exc:
        raise PkiError(f"{exc}: give --ip an IPv4 or IPv6 address (names go in --dns)") from exc
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    key = _new_key()
    start = now - 300 if not_before is None else not_before
    end = now + days * 86400 if not_after is None else not_after
    usages = [
        u for u, on in ((ExtendedKeyUsageOID.SERVER_AUTH, server), (ExtendedKeyUsageOID.CLIENT_AUTH, client)) if on
    ]
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_utc(start))
        .not_valid_after(_utc(end))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)  # type: ignore[arg-type]
    )
    if dns or addresses:
        sans: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
        sans += [x509.IPAddress(a) for a in addresses]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    return Issued(_key_pem(key), cert.public_bytes(serialization.Encoding.PEM))


def describe(cert_pem: bytes) -> CertInfo:
    """What the (first) certificate in ``cert_pem`` says."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    dns: list[str] = []
    ips: list[str] = []
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = san.get_values_for_type(x509.DNSName)
        ips = [str(a) for a in san.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        pass
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        is_ca = False
    try:
        eku = set(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)
    except x509.ExtensionNotFound:
        eku = set()
    return CertInfo(
        subject=cert.subject.rfc4514_string(),
        issuer=cert.issuer.rfc4514_string(),
        dns=tuple(dns),
        ips=tuple(ips),
        not_before=cert.not_valid_before_utc.timestamp(),
        not_after=cert.not_valid_after_utc.timestamp(),
        serial=format(cert.serial_number, "x"),
        fingerprint=cert.fingerprint(hashes.SHA256()).hex(),
        is_ca=bool(is_ca),
        server=ExtendedKeyUsageOID.SERVER_AUTH in eku,
        client=ExtendedKeyUsageOID.CLIENT_AUTH in eku,
    )


def expires_in(info: CertInfo, now: float) -> float:
    """Seconds until ``info`` expires (negative: it has)."""
    return info.not_after - now


def when(ts: float) -> str:
    """A certificate date as people read it: ``2026-12-01 12:00 UTC``."""
    return _utc(ts).strftime("%Y-%m-%d %H:%M UTC")


def validity_problem(info: CertInfo, now: float, path: str) -> str | None:
    """Why the certificate at ``path`` may not be used at ``now`` (one line), or None."""
    dates = f"valid from {when(info.not_before)} to {when(info.not_after)}"
    if now >= info.not_after:
        return f"the certificate {path} expired ({dates}): issue a new one with `llmgw ctl cert rotate NAME`"
    if now < info.not_before:
        return f"the certificate {path} is not valid yet ({dates}): check this machine's clock, or issue a new one"
    return None


def expiry_mark(info: CertInfo, now: float) -> str:
    """``EXPIRED``, ``expires very soon`` (3 days), ``expires soon`` (14 days) or nothing: `cert list`'s mark."""
    left = expires_in(info, now)
    if left <= 0:
        return "EXPIRED"
    if left < VERY_SOON_S:
        return "expires very soon"
    if left < SOON_S:
        return "expires soon"
    return ""


def key_matches(cert_pem: bytes, key_pem: bytes) -> bool:
    """Whether ``key_pem`` is the private key of the certificate in ``cert_pem``."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    key = serialization.load_pem_private_key(key_pem, password=None)
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return cert.public_key().public_bytes(*fmt) == key.public_key().public_bytes(*fmt)


# -- files ---------------------------------------------------------------------------------------


def write_atomic(path: Path, data: bytes, mode: int) -> None:
    """Write ``data`` to ``path`` with ``mode``: whole or not at all, never readable by others first."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save(issued: Issued, cert_path: Path, key_path: Path) -> None:
    """The key (0600) first, then the certificate (0644): a certificate on disk always has its key."""
    write_atomic(key_path, issued.key_pem, 0o600)
    write_atomic(cert_path, issued.cert_pem, 0o644)


def read(path: str | Path, what: str = "certificate") -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise PkiError(f"cannot read the {what} {path} ({exc.strerror or exc}): check the path") from exc


def load_cert(path: str | Path) -> CertInfo:
    data = read(path)
    try:
        return describe(data)
    except ValueError as exc:
        raise PkiError(
            f"{path} is not a PEM certificate ({exc}): give the .crt file `llmgw ctl cert issue` wrote"
        ) from exc


def check_pair(cert_path: str | Path, key_path: str | Path, now: float) -> CertInfo:
    """The certificate at ``cert_path`` if it may be served now with the key at ``key_path``, else PkiError."""
    info = load_cert(cert_path)
    problem = validity_problem(info, now, str(cert_path))
    if problem:
        raise PkiError(problem)
    try:
        matches = key_matches(read(cert_path), read(key_path, "key"))
    except (ValueError, TypeError) as exc:
        raise PkiError(f"{key_path} is not an unencrypted PEM private key ({exc})") from exc
    if not matches:
        raise PkiError(
            f"the key {key_path} is not the key of the certificate {cert_path} "
            f"(valid from {when(info.not_before)} to {when(info.not_after)}): give the key issued with it"
        )
    return info


# -- TLS contexts --------------------------------------------------------------------------------


def server_context(
    cert_path: str | Path, key_path: str | Path, now: float, *, client_ca: str | Path | None = None
) -> ssl.SSLContext:
    """A TLS ≥ 1.2 server context serving ``cert_path``; refuses a pair that is expired, early or mismatched.

    ``client_ca``: ask clients for a certificate signed by this CA (mutual TLS)."""
    check_pair(cert_path, key_path, now)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(str(cert_path), str(key_path))
    if client_ca is not None:
        ctx.load_verify_locations(cafile=str(client_ca))
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(
    ca_path: str | Path | None, cert_path: str | Path | None = None, key_path: str | Path | None = None, *, now: float
) -> ssl.SSLContext:
    """A TLS ≥ 1.2 client context trusting ``ca_path`` (None: the system's CAs), presenting ``cert_path`` if given.

    A client certificate is checked like a server's: an expired one is refused here, by name, rather
    than by the server's handshake with no reason given."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if ca_path is not None:
        load_cert(ca_path)
        ctx.load_verify_locations(cafile=str(ca_path))
    if cert_path is not None:
        if key_path is None:
            raise PkiError(f"the client certificate {cert_path} needs its key: give --nats-key FILE too")
        check_pair(cert_path, key_path, now)
        ctx.load_cert_chain(str(cert_path), str(key_path))
    return ctx


class CertificateExpiry:
    """``llmgw_certificate_expiry_timestamp_seconds{name, path}``: when each certificate a process serves or
    presents expires (the CertificateExpiresSoon/VerySoon alerts compare it with ``time()``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.gauge = Gauge(
            "llmgw_certificate_expiry_timestamp_seconds",
            "When a certificate this process serves or presents expires (its not-after), Unix seconds.",
            ["name", "path"],
            registry=registry,
        )

    def observe(self, name: str, path: str | Path, info: CertInfo) -> None:
        self.gauge.labels(name=name, path=str(path)).set(info.not_after)
