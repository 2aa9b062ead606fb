"""TLS (SPEC OPS-4): the CA and its certificates, HTTPS for the gateway and admin API, NATS with mutual TLS,
and the certificate expiry metric. An expired certificate is refused: when served, when presented to NATS."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import pytest
import yaml
from click.testing import CliRunner, Result
from prometheus_client.parser import text_string_to_metric_families

from llmgw.cli.client import Session, trusted_ca
from llmgw.cli.context import Target
from llmgw.cli.main import main
from llmgw.cli.server_config import ServerConfig, tls_setup
from llmgw.events.commands.errors import Unreachable
from llmgw.events.runtime.connection import StoreError
from llmgw.events.runtime.store import EventStore, NewEvent
from llmgw.events.schema.catalog import default_registry
from llmgw.events.schema.subjects import event_subject
from llmgw.events.schema.tenancy import OrgCreated
from llmgw.infra import natsd, pki
from tests.support import NatsServer, free_port, free_ports, wait_until
from tests.up import wait_for

LLMGW = str(Path(sys.executable).parent / "llmgw")
ALERTS = Path(__file__).resolve().parent.parent / "ops" / "prometheus" / "alerts.yml"
DAY = 86400.0


@pytest.fixture
def ca(tmp_path: Path) -> tuple[pki.Issued, Path]:
    """A CA in ``tmp/pki`` (ca.crt, ca.key), as `llmgw ctl cert ca` writes it."""
    where = tmp_path / "pki"
    issued = pki.make_ca("test CA", now=time.time())
    pki.save(issued, where / "ca.crt", where / "ca.key")
    return issued, where


def leaf(ca: tuple[pki.Issued, Path], name: str, **kwargs: object) -> tuple[Path, Path]:
    """A certificate issued by ``ca`` saved as NAME.crt/NAME.key beside it; its paths."""
    issued_ca, where = ca
    issued = pki.issue(issued_ca, name, now=time.time(), **kwargs)  # type: ignore[arg-type]
    pki.save(issued, where / f"{name}.crt", where / f"{name}.key")
    return where / f"{name}.crt", where / f"{name}.key"


# -- the PKI ------------------------------------------------------------------------------------


def test_a_certificate_issued_by_the_ca_says_its_names_uses_and_dates_and_matches_its_key_only() -> None:
    now = 1_800_000_000.0
    ca = pki.make_ca("llmgw CA", now=now, days=3650)
    issued = pki.issue(ca, "gateway", now=now, dns=["gw.example"], ips=["127.0.0.1", "::1"], days=90, client=True)
    info = pki.describe(issued.cert_pem)
    assert info.subject == "CN=gateway" and info.issuer == "CN=llmgw CA"
    assert info.dns == ("gw.example",) and info.ips == ("127.0.0.1", "::1")
    assert info.server and info.client and not info.is_ca
    assert info.not_after == now + 90 * DAY
    assert pki.expires_in(info, now) == 90 * DAY
    assert pki.describe(ca.cert_pem).is_ca
    assert pki.key_matches(issued.cert_pem, issued.key_pem)
    assert not pki.key_matches(issued.cert_pem, ca.key_pem)
    assert pki.validity_problem(info, now, "gw.crt") is None
    assert pki.expiry_mark(info, now) == ""
    assert pki.expiry_mark(info, info.not_after - 10 * DAY) == "expires soon"
    assert pki.expiry_mark(info, info.not_after - DAY) == "expires very soon"
    assert pki.expiry_mark(info, info.not_after) == "EXPIRED"


def test_an_expired_or_not_yet_valid_certificate_is_named_with_its_dates() -> None:
    now = 1_800_000_000.0
    ca = pki.make_ca("llmgw CA", now=now)
    old = pki.describe(
        pki.issue(ca, "old", now=now, dns=["a"], not_before=now - 10 * DAY, not_after=now - DAY).cert_pem
    )
    early = pki.describe(
        pki.issue(ca, "early", now=now, dns=["a"], not_before=now + DAY, not_after=now + 9 * DAY).cert_pem
    )
    assert pki.validity_problem(old, now, "old.crt") == (
        "the certificate old.crt expired (valid from 2027-01-05 08:00 UTC to 2027-01-14 08:00 UTC): "
        "issue a new one with `llmgw ctl cert rotate NAME`"
    )
    assert "old.crt expired" in (pki.validity_problem(old, now, "old.crt") or "")
    assert "early.crt is not valid yet" in (pki.validity_problem(early, now, "early.crt") or "")


def test_keys_are_written_for_their_owner_only_and_certificates_for_all_to_read(ca: tuple[pki.Issued, Path]) -> None:
    crt, key = leaf(ca, "gateway", dns=["localhost"])
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert stat.S_IMODE(crt.stat().st_mode) == 0o644
    assert not [p for p in crt.parent.iterdir() if p.name.startswith(".")]  # no temporary file left behind


def test_a_server_refuses_at_start_a_certificate_that_expired_or_is_not_its_key_s(ca: tuple[pki.Issued, Path]) -> None:
    now = time.time()
    expired_crt, expired_key = leaf(ca, "expired", dns=["localhost"], not_before=now - 10 * DAY, not_after=now - DAY)
    good_crt, good_key = leaf(ca, "good", dns=["localhost"])
    config = ServerConfig(
        nats_url="nats://x", db_dsn="sqlite:///x", tls_cert=str(expired_crt), tls_key=str(expired_key)
    )
    with pytest.raises(pki.PkiError, match=rf"the certificate {expired_crt} expired \(valid from .* to .*\)"):
        tls_setup(config, now)
    mismatched = ServerConfig(
        nats_url="nats://x", db_dsn="sqlite:///x", tls_cert=str(good_crt), tls_key=str(expired_key)
    )
    with pytest.raises(pki.PkiError, match=rf"the key {expired_key} is not the key of the certificate {good_crt}"):
        tls_setup(mismatched, now)
    half = ServerConfig(nats_url="nats://x", db_dsn="sqlite:///x", tls_cert=str(good_crt))
    with pytest.raises(pki.PkiError, match="needs both --tls-cert FILE and --tls-key FILE"):
        tls_setup(half, now)
    assert tls_setup(ServerConfig(nats_url="x", db_dsn="x", tls_cert=str(good_crt), tls_key=str(good_key)), now).https


# -- `llmgw ctl cert` ---------------------------------------------------------------------------


def cert_cli(where: Path, *args: str) -> Result:
    """`llmgw ctl cert ARGS --dir WHERE`, in this process (the installed command is run once, below)."""
    return CliRunner().invoke(main, ["ctl", "cert", *args, "--dir", str(where)])


def test_the_installed_command_refuses_to_replace_a_ca_with_exit_2(tmp_path: Path) -> None:
    argv = [LLMGW, "ctl", "cert", "ca", "--dir", str(tmp_path)]
    assert subprocess.run(argv, capture_output=True, text=True, timeout=60).returncode == 0
    again = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2
    assert again.stderr.startswith(f"error: a CA is already in {tmp_path / 'ca.crt'}")


def test_ctl_cert_makes_a_ca_issues_lists_and_rotates_keeping_the_previous_one(tmp_path: Path) -> None:
    where = tmp_path / "pki"
    done = cert_cli(where, "issue", "gateway", "--dns", "localhost")
    assert done.exit_code == 2 and "no CA in" in done.stderr and "`llmgw ctl cert ca`" in done.stderr
    assert cert_cli(where, "ca").exit_code == 0
    again = cert_cli(where, "ca")
    assert again.exit_code == 2 and f"a CA is already in {where / 'ca.crt'}" in again.stderr
    assert "--force" in again.stderr
    done = cert_cli(where, "issue", "gateway", "--dns", "localhost", "--ip", "127.0.0.1", "--days", "30")
    assert done.exit_code == 0, done.stderr
    assert cert_cli(where, "issue", "agent-1", "--client", "--days", "5").exit_code == 0
    assert cert_cli(where, "issue", "ca", "--dns", "x").exit_code == 2
    assert cert_cli(where, "issue", "nothing").exit_code == 2
    first = pki.describe((where / "gateway.crt").read_bytes())

    rows = {r["name"]: r for r in json.loads(cert_cli(where, "list", "--json").stdout)}
    assert set(rows) == {"ca", "gateway", "agent-1"}
    assert rows["gateway"]["sans"] == ["localhost", "127.0.0.1"] and rows["gateway"]["uses"] == "server"
    assert rows["agent-1"]["uses"] == "client" and rows["agent-1"]["mark"] == "expires soon"
    table = cert_cli(where, "list").stdout
    assert "agent-1" in table and "expires soon" in table

    done = cert_cli(where, "rotate", "gateway")
    assert done.exit_code == 0, done.stderr
    rotated = pki.describe((where / "gateway.crt").read_bytes())
    assert rotated.sans == first.sans and rotated.serial != first.serial
    assert round((rotated.not_after - rotated.not_before) / DAY) == 30  # the old one's lifetime
    assert pki.describe((where / "gateway.previous.crt").read_bytes()).serial == first.serial
    assert pki.key_matches((where / "gateway.crt").read_bytes(), (where / "gateway.key").read_bytes())
    assert stat.S_IMODE((where / "gateway.previous.key").stat().st_mode) == 0o600
    cert_cli(where, "rotate", "gateway", "--days", "7")
    assert pki.describe((where / "gateway.previous.crt").read_bytes()).serial == rotated.serial
    assert cert_cli(where, "rotate", "ghost").exit_code == 2


# -- NATS with mutual TLS -----------------------------------------------------------------------


class TlsNats:
    """A JetStream nats-server that speaks TLS only and verifies client certificates (``verify: true``);
    in a cluster, its routes too are mutual TLS."""

    def __init__(
        self, base: Path, cert: Path, key: Path, ca: Path, *, cluster: natsd.ClusterConfig | None = None
    ) -> None:
        base.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"nats://127.0.0.1:{self.port}"
        config = natsd.NatsConfig(
            port=self.port,
            store_dir=str(base / "js"),
            ports_file_dir=str(base),
            server_name=cluster and f"n-{cluster.port}",
            cluster=cluster,
        )
        tls = (
            f'tls {{\n  cert_file: "{cert}"\n  key_file: "{key}"\n  ca_file: "{ca}"\n  verify: true\n  timeout: 5\n}}\n'
        )
        text = natsd.render_config(config)
        if cluster is not None:  # the routes' block goes inside `cluster { … }`, the file's last block
            text = text.removesuffix("}\n") + tls + "}\n"
        self.conf = base / "nats-tls.conf"
        self.conf.write_text(text + tls)
        self.log = base / "nats-tls.log"
        self.base = base
        self.proc: subprocess.Popen | None = None

    def start(self) -> TlsNats:
        binary = natsd.nats_server_binary()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen([binary, "-c", str(self.conf)], stdout=out, stderr=out)
        ports = self.base / f"{Path(binary).name}_{self.proc.pid}.ports"

        def listening() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            return natsd.listening(ports, self.port)

        wait_for(listening, "the TLS nats-server to listen")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)


@pytest.fixture
def tls_nats(tmp_path: Path, ca: tuple[pki.Issued, Path]) -> Iterator[TlsNats]:
    crt, key = leaf(ca, "nats-1", dns=["localhost"], ips=["127.0.0.1"], client=True)
    server = TlsNats(tmp_path, crt, key, ca[1] / "ca.crt").start()
    yield server
    server.stop()


def presenting(ca_file: Path, crt: Path | None = None, key: Path | None = None) -> ssl.SSLContext:
    """A client context that presents whatever it is given, unchecked: what the server refuses is the test."""
    ctx = ssl.create_default_context(cafile=str(ca_file))
    if crt is not None:
        ctx.load_cert_chain(str(crt), str(key))
    return ctx


async def connects_and_appends(url: str, ctx: ssl.SSLContext | None) -> str:
    """``appended``, or why the connection was refused."""
    try:
        store = await EventStore.connect(url, default_registry(), tls=ctx)
    except StoreError as exc:
        return str(exc)
    try:
        await store.ensure_streams()
        done = await store.append(
            event_subject("tenancy", "o-tls"),
            [NewEvent(payload=OrgCreated(org_id="o-tls", name="tls"), actor="user:test")],
        )
        return "appended" if done.last_seq > 0 else "nothing appended"
    finally:
        await store.close()


@pytest.mark.timeout(120)
async def test_nats_with_mutual_tls_takes_a_client_certificate_from_the_ca_and_refuses_none_or_an_expired_one(
    tls_nats: TlsNats, ca: tuple[pki.Issued, Path]
) -> None:
    ca_file = ca[1] / "ca.crt"
    now = time.time()
    agent_crt, agent_key = leaf(ca, "agent-1", client=True, server=False)
    old_crt, old_key = leaf(ca, "agent-old", client=True, server=False, not_before=now - 9 * DAY, not_after=now - DAY)

    ctx = pki.client_context(ca_file, agent_crt, agent_key, now=now)
    assert await connects_and_appends(tls_nats.url, ctx) == "appended"
    refused = "refused this client's TLS certificate"
    assert refused in await connects_and_appends(tls_nats.url, presenting(ca_file))
    expired = await connects_and_appends(tls_nats.url, presenting(ca_file, old_crt, old_key))
    assert refused in expired and "CERTIFICATE_EXPIRED" in expired
    assert "--nats-ca FILE" in await connects_and_appends(tls_nats.url, None)
    untrusting = ssl.create_default_context()  # the system's CAs only: not the one that signed the server
    assert "is not trusted" in await connects_and_appends(tls_nats.url, untrusting)
    # The client itself says why, before the server's handshake would refuse it without a reason.
    with pytest.raises(pki.PkiError, match=rf"the certificate {old_crt} expired"):
        pki.client_context(ca_file, old_crt, old_key, now=now)


# -- HTTPS for the gateway and the admin API ----------------------------------------------------


def get(url: str, ctx: ssl.SSLContext | None = None) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=5, context=ctx) as r:
        return r.status, r.read().decode()


class Served:
    """`llmgw server` with a few services, its own ports and files, as a person starts it."""

    def __init__(self, tmp: Path, nats_url: str, *extra: str) -> None:
        self.port, self.admin_port = free_ports(2)
        self.log = tmp / f"server-{self.port}.log"
        argv = [
            LLMGW,
            "server",
            "--nats",
            nats_url,
            "--db",
            f"sqlite:///{tmp / 'projections.db'}",
            "--services",
            "projections,api,router",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--admin-port",
            str(self.admin_port),
            "--usage-journal",
            str(tmp / "usage-journal"),
            "--mirror-dir",
            str(tmp / "mirror"),
            *extra,
        ]
        env = {**os.environ, "LLMGW_DATA_DIR": str(tmp)}
        self.proc = subprocess.Popen(argv, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, env=env)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(60)


@pytest.mark.timeout(120)
async def test_a_server_given_a_certificate_answers_https_trusting_the_ca_refuses_plain_http_and_says_when_it_expires(
    tmp_path: Path, nats: NatsServer, ca: tuple[pki.Issued, Path]
) -> None:
    crt, key = leaf(ca, "gateway", dns=["localhost"], ips=["127.0.0.1"])
    ca_file = ca[1] / "ca.crt"
    trusting = pki.client_context(ca_file, now=time.time())
    served = Served(tmp_path, nats.url, "--tls-cert", str(crt), "--tls-key", str(key))
    try:

        def answers() -> bool:
            # The admin API listens first; the gateway once its router has caught up with the log.
            assert served.proc.poll() is None, f"llmgw server exited:\n{served.output()}"
            with contextlib.suppress(OSError):
                return (
                    get(f"https://127.0.0.1:{served.admin_port}/healthz", trusting)[0] == 200
                    and get(f"https://localhost:{served.port}/healthz", trusting)[0] == 200  # by the name it holds
                )
            return False

        wait_for(answers, f"the admin API and the gateway to answer https; its output:\n{served.output()}")
        for port in (served.admin_port, served.port):
            with pytest.raises((OSError, http.client.HTTPException)):
                get(f"http://127.0.0.1:{port}/healthz")
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):  # a client not trusting the CA
            get(f"https://127.0.0.1:{served.admin_port}/healthz", ssl.create_default_context())

        _, text = get(f"https://127.0.0.1:{served.admin_port}/metrics", trusting)
        [family] = [
            f for f in text_string_to_metric_families(text) if f.name == "llmgw_certificate_expiry_timestamp_seconds"
        ]
        [sample] = family.samples
        assert sample.labels == {"name": "https", "path": str(crt)}
        assert sample.value == pki.describe(crt.read_bytes()).not_after

        # The CLI's session: the CA in DATA_DIR/pki is trusted without being named; another is refused.
        target = Target(nats.url, f"https://127.0.0.1:{served.admin_port}")
        session = Session(target, ca=trusted_ca(None, str(tmp_path)))
        assert session.ca == str(ca_file)
        try:
            assert (await session.api("GET", "/healthz"))["status"]
        finally:
            await session.close()
        other = pki.make_ca("another CA", now=time.time())
        pki.save(other, tmp_path / "other" / "ca.crt", tmp_path / "other" / "ca.key")
        stranger = Session(target, ca=trusted_ca(str(tmp_path / "other" / "ca.crt"), str(tmp_path)))
        try:
            with pytest.raises(Unreachable, match=r"does not vouch for .*: give the CA that issued it with --ca FILE"):
                await stranger.api("GET", "/healthz")
        finally:
            await stranger.close()
    finally:
        served.stop()


def test_an_expired_serving_certificate_is_refused_at_start_naming_the_file_and_its_dates(
    tmp_path: Path, ca: tuple[pki.Issued, Path]
) -> None:
    now = time.time()
    crt, key = leaf(ca, "gateway", dns=["localhost"], not_before=now - 30 * DAY, not_after=now - DAY)
    served = Served(tmp_path, "nats://127.0.0.1:1", "--tls-cert", str(crt), "--tls-key", str(key))
    assert served.proc.wait(60) != 0
    [line] = [x for x in served.output().splitlines() if x.strip()]
    assert f"the certificate {crt} expired (valid from " in line
    assert pki.when(now - DAY)[:10] in line


def test_the_expiry_alerts_fire_when_cert_list_marks_a_certificate_as_expiring_soon_and_very_soon() -> None:
    rules = yaml.safe_load(ALERTS.read_text())["groups"][0]["rules"]
    exprs = {r["alert"]: (r["expr"], r["labels"]["severity"]) for r in rules}
    soon, soon_severity = exprs["CertificateExpiresSoon"]
    very_soon, very_soon_severity = exprs["CertificateExpiresVerySoon"]
    series = "llmgw_certificate_expiry_timestamp_seconds - time() <"
    assert soon == f"{series} {pki.SOON_S // 86400} * 86400" and soon_severity == "warning"
    assert very_soon == f"{series} {pki.VERY_SOON_S // 86400} * 86400" and very_soon_severity == "critical"


@pytest.mark.timeout(120)
async def test_a_nats_cluster_whose_routes_and_clients_use_mutual_tls_replicates_what_a_certified_client_appends(
    tmp_path: Path, ca: tuple[pki.Issued, Path]
) -> None:
    ca_file = ca[1] / "ca.crt"
    route_ports = tuple(free_ports(3))
    nodes = []
    try:
        for i, route_port in enumerate(route_ports):
            # A node's certificate serves clients and routes and, for the routes it dials, is a client's too.
            crt, key = leaf(ca, f"nats-{i}", dns=["localhost"], ips=["127.0.0.1"], client=True)
            cluster = natsd.ClusterConfig(name="llmgw-tls", port=route_port, routes=route_ports)
            nodes.append(TlsNats(tmp_path / f"n{i}", crt, key, ca_file, cluster=cluster).start())
        agent_crt, agent_key = leaf(ca, "agent-1", client=True, server=False)
        ctx = pki.client_context(ca_file, agent_crt, agent_key, now=time.time())
        urls = ",".join(n.url for n in nodes)

        async def replicated() -> bool:
            store = await EventStore.connect(urls, default_registry(), tls=ctx, replicas=3)
            try:
                await store.ensure_streams()
                await store.append(
                    event_subject("tenancy", "o-tls"),
                    [NewEvent(payload=OrgCreated(org_id="o-tls", name="tls"), actor="user:test")],
                )
                info = await store.js.stream_info(store.stream)
                return info.config.num_replicas == 3 and len(info.cluster.replicas or []) == 2
            except (StoreError, nats.errors.Error, TimeoutError):
                return False  # no meta leader yet
            finally:
                await store.close()

        # The meta leader is elected over the TLS routes; until then the streams cannot be created.
        await wait_until(replicated, deadline_s=60, what="a stream with 3 replicas over TLS routes")
    finally:
        for n in nodes:
            n.stop()


async def test_a_client_told_to_use_tls_refuses_a_nats_that_does_not_speak_it(
    nats: NatsServer, ca: tuple[pki.Issued, Path]
) -> None:
    ctx = pki.client_context(ca[1] / "ca.crt", now=time.time())
    refused = await connects_and_appends(nats.url, ctx)
    assert refused.startswith(f"NATS at {nats.url} does not speak TLS, yet a NATS CA was given")
