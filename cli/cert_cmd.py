"""`llmgw ctl cert ca|issue|list|rotate` (SPEC OPS-4): the installation's CA and the certificates it issues.

Everything happens in one directory (``--dir``, default ``DATA_DIR/pki``) on this machine, with no
running system needed: ``ca.crt``/``ca.key``, and ``NAME.crt``/``NAME.key`` per certificate. A rotation
keeps the certificate it replaces as ``NAME.previous.crt``/``.key`` until the next rotation, so a
process not yet restarted onto the new one can be found. Refusals exit 2 and say what to do.
"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path
from typing import NoReturn

import click
import msgspec

from llmgw.cli.context import default_data_dir
from llmgw.cli.table import table
from llmgw.infra import pki

NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
PREVIOUS = ".previous"
EXIT_REFUSED = 2  # docs/cli.md


def refuse(message: str) -> NoReturn:
    click.echo(f"error: {message}", err=True)
    sys.exit(EXIT_REFUSED)


def pki_dir(ctx: click.Context, chosen: str | None) -> Path:
    """``--dir``, else ``DATA_DIR/pki`` (``--data-dir``/``$LLMGW_DATA_DIR``, else the default data directory)."""
    if chosen:
        return Path(chosen).expanduser()
    data_dir = (ctx.find_root().obj or {}).get("data_dir")
    return (Path(data_dir).expanduser() if data_dir else default_data_dir()) / "pki"


def cert_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a certificate (it becomes a file name), or None; pure."""
    if not NAME_RE.fullmatch(name):
        return f"certificate name {name!r} must be letters, digits, '.', '_' or '-' (at most 63), e.g. gateway"
    if name == pki.CA_NAME:
        return "the name 'ca' is the CA's own: choose another name (e.g. gateway, nats-1, agent-gpu07)"
    if name.endswith(PREVIOUS):
        return f"names ending in {PREVIOUS!r} are kept for rotated certificates: choose another name"
    return None


def _load_ca(where: Path) -> pki.Issued:
    cert, key = where / f"{pki.CA_NAME}.crt", where / f"{pki.CA_NAME}.key"
    if not cert.exists() or not key.exists():
        refuse(f"no CA in {where} ({cert.name} and {key.name}): create one with `llmgw ctl cert ca`")
    try:
        return pki.Issued(pki.read(key, "key"), pki.read(cert))
    except pki.PkiError as exc:
        refuse(str(exc))


def _dir_option(fn: click.decorators.FC) -> click.decorators.FC:
    return click.option("--dir", "dir_", help="Where the CA and certificates are kept (default: DATA_DIR/pki).")(fn)


@click.group("cert")
def cert() -> None:
    """The installation's CA and its certificates: HTTPS for the gateway and admin API, NATS TLS."""


@cert.command("ca")
@_dir_option
@click.option("--days", type=click.FloatRange(min=1), default=3650, show_default=True, help="How long the CA is valid.")
@click.option("--name", "common_name", default="llmgw CA", show_default=True, help="The CA's common name.")
@click.option(
    "--force", is_flag=True, help="Replace an existing CA (every certificate it issued must be issued again)."
)
@click.pass_context
def cert_ca(ctx: click.Context, dir_: str | None, days: float, common_name: str, force: bool) -> None:
    """Create the CA: DIR/ca.crt (give it to clients) and DIR/ca.key (keep it on this machine)."""
    where = pki_dir(ctx, dir_)
    existing = [p for p in (where / "ca.crt", where / "ca.key") if p.exists()]
    if existing and not force:
        refuse(
            f"a CA is already in {existing[0]}: its certificates would no longer be trusted if it were replaced; "
            "pass --force to replace it anyway"
        )
    ca = pki.make_ca(common_name, now=time.time(), days=days)
    pki.save(ca, where / "ca.crt", where / "ca.key")
    info = pki.describe(ca.cert_pem)
    click.echo(f"CA {where / 'ca.crt'} (key {where / 'ca.key'}, mode 0600), valid until {pki.when(info.not_after)}")


def _issue_and_save(
    where: Path, name: str, dns: tuple[str, ...], ips: tuple[str, ...], days: float, server: bool, client: bool
) -> pki.CertInfo:
    ca = _load_ca(where)
    try:
        issued = pki.issue(ca, name, now=time.time(), dns=dns, ips=ips, days=days, server=server, client=client)
    except pki.PkiError as exc:
        refuse(str(exc))
    pki.save(issued, where / f"{name}.crt", where / f"{name}.key")
    return pki.describe(issued.cert_pem)


def _uses(info: pki.CertInfo) -> str:
    return "+".join(u for u, on in (("server", info.server), ("client", info.client), ("CA", info.is_ca)) if on) or "-"


@cert.command("issue")
@click.argument("name")
@_dir_option
@click.option("--dns", multiple=True, help="A DNS name the certificate is for (repeatable).")
@click.option("--ip", multiple=True, help="An IP address the certificate is for (repeatable).")
@click.option("--days", type=click.FloatRange(min=1), default=90, show_default=True, help="How long it is valid.")
@click.option(
    "--client",
    is_flag=True,
    help="It may also authenticate as a client (agents and servers connecting to NATS, cluster routes); "
    "without --dns/--ip it is a client certificate only.",
)
@click.option("--force", is_flag=True, help="Replace an existing certificate of that name (see also `rotate`).")
@click.pass_context
def cert_issue(
    ctx: click.Context,
    name: str,
    dir_: str | None,
    dns: tuple[str, ...],
    ip: tuple[str, ...],
    days: float,
    client: bool,
    force: bool,
) -> None:
    """Issue NAME.crt and NAME.key, signed by the CA, for the --dns names and --ip addresses given."""
    problem = cert_name_problem(name)
    if problem:
        refuse(problem)
    where = pki_dir(ctx, dir_)
    if not (dns or ip or client):
        refuse("a certificate needs what it is for: --dns NAME / --ip ADDRESS to serve them, --client to connect")
    if (where / f"{name}.crt").exists() and not force:
        refuse(f"{where / f'{name}.crt'} exists: renew it with `llmgw ctl cert rotate {name}`, or pass --force")
    info = _issue_and_save(where, name, dns, ip, days, server=bool(dns or ip), client=client)
    click.echo(
        f"{name}: {where / f'{name}.crt'} (key {where / f'{name}.key'}, mode 0600) for "
        f"{', '.join(info.sans) or 'client use'} ({_uses(info)}), valid until {pki.when(info.not_after)}"
    )


class Listed(msgspec.Struct, frozen=True, kw_only=True):
    """One certificate as `cert list --json` shows it."""

    name: str
    path: str
    uses: str
    sans: tuple[str, ...]
    not_before: float
    not_after: float
    days_left: float
    mark: str
    subject: str
    serial: str
    fingerprint: str


def listing(where: Path, now: float) -> list[Listed]:
    """Every certificate in ``where``: the CA first, then by name (a rotated one after its successor)."""
    paths = sorted(where.glob("*.crt"), key=lambda p: (p.stem != pki.CA_NAME, p.stem.removesuffix(PREVIOUS), p.stem))
    out = []
    for path in paths:
        try:
            info = pki.load_cert(path)
        except pki.PkiError as exc:
            click.echo(f"warning: {exc}", err=True)
            continue
        out.append(
            Listed(
                name=path.stem,
                path=str(path),
                uses=_uses(info),
                sans=info.sans,
                not_before=info.not_before,
                not_after=info.not_after,
                days_left=round(pki.expires_in(info, now) / 86400, 1),
                mark=pki.expiry_mark(info, now),
                subject=info.subject,
                serial=info.serial,
                fingerprint=info.fingerprint,
            )
        )
    return out


@cert.command("list")
@_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the certificates as JSON.")
@click.pass_context
def cert_list(ctx: click.Context, dir_: str | None, as_json: bool) -> None:
    """The CA and each certificate: what it is for, until when, and whether it expired or expires soon."""
    where = pki_dir(ctx, dir_)
    rows = listing(where, time.time())
    if as_json:
        click.echo(json.dumps(msgspec.to_builtins(rows), indent=2))
        return
    if not rows:
        click.echo(f"no certificates in {where}: create a CA with `llmgw ctl cert ca`")
        return
    cells = [
        [r.name, r.uses, pki.when(r.not_after), f"{r.days_left:.1f}", (", ".join(r.sans) or "-") + f"  {r.mark}"]
        for r in rows
    ]
    for line in table(["NAME", "USES", "NOT AFTER", "DAYS LEFT", "SANS"], cells, right={3}):
        click.echo(line)


@cert.command("rotate")
@click.argument("name")
@_dir_option
@click.option("--days", type=click.FloatRange(min=1), help="How long the new one is valid (default: as the old one).")
@click.pass_context
def cert_rotate(ctx: click.Context, name: str, dir_: str | None, days: float | None) -> None:
    """Issue NAME again with the same names and uses; the old one is kept as NAME.previous until the next rotate.

    Restart (or reload) what serves or presents NAME for it to use the new certificate."""
    problem = cert_name_problem(name)
    if problem:
        refuse(problem)
    where = pki_dir(ctx, dir_)
    crt, key = where / f"{name}.crt", where / f"{name}.key"
    if not crt.exists():
        refuse(f"no certificate {crt} to rotate: issue it with `llmgw ctl cert issue {name} --dns … --ip …`")
    try:
        old = pki.load_cert(crt)
        old_key = pki.read(key, "key")
    except pki.PkiError as exc:
        refuse(str(exc))
    _load_ca(where)  # refused before anything moves
    lifetime = days or max(1.0, round((old.not_after - old.not_before) / 86400))
    # The old pair is written aside first: at no moment is NAME missing or the old one lost.
    pki.save(pki.Issued(old_key, crt.read_bytes()), where / f"{name}{PREVIOUS}.crt", where / f"{name}{PREVIOUS}.key")
    info = _issue_and_save(where, name, old.dns, old.ips, lifetime, server=old.server, client=old.client)
    click.echo(
        f"{name}: rotated, valid until {pki.when(info.not_after)} (serial {info.serial}); the previous one "
        f"(until {pki.when(old.not_after)}) is kept as {where / f'{name}{PREVIOUS}.crt'}. Restart what serves it."
    )
