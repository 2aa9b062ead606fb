"""OpenLDAP's ``slapd`` run by the tests: its own config and database in a temporary directory, as the
current user, on free loopback ports (ldap:// with StartTLS, and ldaps://), with a test CA made here.

Debian's ``slapd`` and ``ldap-utils`` packages provide the binaries (ops/install-test-tools.sh installs
them); the system's own slapd instance, if any, is never used. Every wait has a deadline.
"""

from __future__ import annotations

import base64
import contextlib
import datetime
import hashlib
import ipaddress
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tests.support import free_ports, stop_process, wait_for_port

HERE = Path(__file__).parent
SUFFIX = "dc=example,dc=org"
PEOPLE = f"ou=people,{SUFFIX}"
GROUPS = f"ou=groups,{SUFFIX}"
ADMIN_DN = f"cn=admin,{SUFFIX}"
ADMIN_PASSWORD = "admin-Root-9"
READER_DN = f"cn=reader,ou=services,{SUFFIX}"
READER_PASSWORD = "reader-Search-0"
PASSWORDS = {
    "alice": "alice-Wonder-1",
    "bob": "bob-Builds-2",
    "carol": "carol-Marvel-3",
    "dave": "dave-Dwarf-4",
    "erin": "erin-Nogroup-6",
    "smith, jo": "jo-Comma-5",
}

NO_SLAPD = (
    "OpenLDAP's slapd is not installed: run ops/install-test-tools.sh (it installs Debian's slapd and "
    "ldap-utils), or set LLMGW_TEST_SLAPD to a slapd binary"
)
_SCHEMA_DIRS = ("/etc/ldap/schema", "/etc/openldap/schema", "/usr/local/etc/openldap/schema")
_MODULE_DIRS = ("/usr/lib/ldap", "/usr/lib64/openldap", "/usr/lib/openldap", "/usr/libexec/openldap")


def slapd_binary() -> str | None:
    """slapd's path: LLMGW_TEST_SLAPD, else on PATH or in the sbin directories PATH may lack."""
    named = os.environ.get("LLMGW_TEST_SLAPD")
    if named:
        return named if os.access(named, os.X_OK) else None
    found = shutil.which("slapd")
    if found:
        return found
    for candidate in ("/usr/sbin/slapd", "/usr/local/sbin/slapd", "/usr/libexec/slapd"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def missing() -> str | None:
    """Why slapd cannot be run here (the reason a test skips with), or None when it can."""
    binary = slapd_binary()
    if binary is None:
        return NO_SLAPD
    sbin = Path(binary).parent
    for tool in ("slapadd", "ldapmodify"):
        if shutil.which(tool) is None and not (sbin / tool).exists():
            return f"{tool} is not installed (Debian's slapd and ldap-utils packages): run ops/install-test-tools.sh"
    if _schema_dir() is None:
        return f"OpenLDAP's schema files are in none of {', '.join(_SCHEMA_DIRS)}"
    return None


def _tool(name: str) -> str:
    binary = slapd_binary()
    beside = Path(binary).parent / name if binary else None
    return shutil.which(name) or (str(beside) if beside and beside.exists() else name)


def _schema_dir() -> Path | None:
    return next((Path(d) for d in _SCHEMA_DIRS if (Path(d) / "core.schema").exists()), None)


def _module_dir() -> Path | None:
    """Where back_mdb is a loadable module (Debian's build); None when it is built in."""
    return next((Path(d) for d in _MODULE_DIRS if list(Path(d).glob("back_mdb*"))), None)


def ssha(password: str) -> str:
    """``{SSHA}`` of a password, as slapd checks it: base64(sha1(password + salt) + salt)."""
    salt = secrets.token_bytes(8)
    digest = hashlib.sha1(password.encode() + salt).digest()
    return "{SSHA}" + base64.b64encode(digest + salt).decode()


# -- a test CA ---------------------------------------------------------------------------------


class Authority:
    """A certificate authority made for one run: its certificate (PEM) and key."""

    def __init__(self, common_name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def server(self, hosts: tuple[str, ...]) -> tuple[bytes, bytes]:
        """(certificate, key) PEM for a server known by ``hosts`` (IP addresses or DNS names)."""
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hosts[0])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        return cert.public_bytes(serialization.Encoding.PEM), key_pem


# -- slapd -------------------------------------------------------------------------------------


class Slapd:
    """One slapd: ``ldap_url`` (plain, or StartTLS), ``ldaps_url``, ``ca_file`` (the CA that signed its
    certificate) and ``other_ca_file`` (a CA that did not), loaded from base.ldif and directory.ldif."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ldap_port, self.ldaps_port = free_ports(2)
        self.ldap_url = f"ldap://127.0.0.1:{self.ldap_port}"
        self.ldaps_url = f"ldaps://127.0.0.1:{self.ldaps_port}"
        self.ca_file = str(root / "ca.pem")
        self.other_ca_file = str(root / "other-ca.pem")
        self.log_path = root / "slapd.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, deadline_s: float = 20.0) -> Slapd:
        self.root.mkdir(parents=True, exist_ok=True)
        self._certificates()
        conf = self._config()
        (self.root / "db").mkdir(exist_ok=True)
        self._run([_tool("slapadd"), "-f", str(conf), "-l", str(HERE / "base.ldif")], "slapadd base.ldif")
        urls = f"{self.ldap_url}/ {self.ldaps_url}/"
        log = self.log_path.open("wb")
        # -d 0: stays in the foreground (the tests own its lifetime) and logs nothing past errors.
        self.proc = subprocess.Popen(
            [slapd_binary() or "slapd", "-f", str(conf), "-h", urls, "-d", "0"],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        try:
            wait_for_port(self.ldap_port, deadline_s, self.proc)
            wait_for_port(self.ldaps_port, deadline_s, self.proc)
        except (RuntimeError, TimeoutError) as exc:
            self.stop()
            raise RuntimeError(f"slapd did not start: {exc}\n{self.log_path.read_text(errors='replace')}") from exc
        self.add(_with_passwords((HERE / "directory.ldif").read_text()))
        return self

    def stop(self) -> None:
        stop_process(self.proc, grace_s=10.0)

    def modify(self, ldif: str) -> None:
        """Change the directory as its administrator (``ldapmodify``); an error fails the test."""
        self._ldapmodify(ldif, add=False)

    def add(self, ldif: str) -> None:
        self._ldapmodify(ldif, add=True)

    def _ldapmodify(self, ldif: str, *, add: bool) -> None:
        args = [_tool("ldapmodify"), "-x", "-H", self.ldap_url, "-D", ADMIN_DN, "-w", ADMIN_PASSWORD]
        self._run([*args, "-a"] if add else args, "ldapmodify", stdin=ldif)

    def _run(self, args: list[str], what: str, stdin: str | None = None) -> None:
        done = subprocess.run(args, input=(stdin or "").encode(), capture_output=True, timeout=30, check=False)
        if done.returncode != 0:
            output = (done.stdout + done.stderr).decode(errors="replace")
            raise RuntimeError(f"{what} failed ({done.returncode}): {output}")

    def _certificates(self) -> None:
        ca = Authority("llmgw tests LDAP CA")
        cert, key = ca.server(("127.0.0.1",))
        (self.root / "ca.pem").write_bytes(ca.pem())
        (self.root / "server.pem").write_bytes(cert)
        (self.root / "server.key").write_bytes(key)
        os.chmod(self.root / "server.key", 0o600)
        (self.root / "other-ca.pem").write_bytes(Authority("another CA").pem())

    def _config(self) -> Path:
        schema = _schema_dir()
        modules = _module_dir()
        loads = "" if modules is None else f"modulepath {modules}\nmoduleload back_mdb\nmoduleload memberof\n"
        includes = "".join(f"include {schema}/{name}.schema\n" for name in ("core", "cosine", "inetorgperson"))
        root = self.root
        text = f"""{includes}{loads}
pidfile {root}/slapd.pid
argsfile {root}/slapd.args
TLSCACertificateFile {root}/ca.pem
TLSCertificateFile {root}/server.pem
TLSCertificateKeyFile {root}/server.key

database mdb
maxsize 67108864
suffix "{SUFFIX}"
rootdn "{ADMIN_DN}"
rootpw {ssha(ADMIN_PASSWORD)}
directory {root}/db
index objectClass eq
index uid eq
index member,uniqueMember eq
overlay memberof
access to attrs=userPassword by self write by anonymous auth by * none
access to * by * read
"""
        path = root / "slapd.conf"
        path.write_text(text)
        return path


def _with_passwords(ldif: str) -> str:
    return re.sub(r"\{\{ssha:(.*?)\}\}", lambda m: ssha(m.group(1)), ldif)


@contextlib.contextmanager
def running(root: Path) -> Iterator[Slapd]:
    """A started slapd in ``root``, stopped at the end."""
    server = Slapd(root)
    try:
        yield server.start()
    finally:
        server.stop()
