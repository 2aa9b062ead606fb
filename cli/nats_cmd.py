"""`llmgw ctl nats …`: the NATS users and their credentials (issue "Trust", item 4).

These work on files, not over the bus: the credential files `llmgw up` keeps in DATA_DIR/nats/users/
(or ``--dir`` for a cluster's own NATS), the server's users file beside its configuration, and a
SIGHUP to the running `up` server so it reloads them. docs/operations.md (NATS users and permissions)
has the roles.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import click

from llmgw.cli.context import default_data_dir
from llmgw.cli.ctl import ctl
from llmgw.cli.natsd import (
    CredentialError,
    authorization_text,
    credential_path,
    ensure_credentials,
    reload_server,
    rotate_credentials,
    users_dir,
)
from llmgw.infra import nats_permissions as NP


def _data_dir(ctx: click.Context) -> Path:
    chosen = (ctx.find_root().obj or {}).get("data_dir")
    return Path(chosen).expanduser() if chosen else default_data_dir()


def _folder(ctx: click.Context, folder: str | None) -> tuple[Path, Path | None]:
    """(where the credentials are, the `up` data directory whose server reloads them, or None: --dir)."""
    if folder:
        return Path(folder).expanduser(), None
    data_dir = _data_dir(ctx)
    return users_dir(data_dir), data_dir


def _reload(data_dir: Path | None, rotated: Sequence[str] = ()) -> None:
    if data_dir is None:
        click.echo("give your NATS servers the new block (`llmgw ctl nats config --dir …`) and reload them", err=True)
        return
    pid = reload_server(data_dir)
    if pid is None:
        click.echo("no `llmgw up` NATS server runs on this data directory: its next start reads the files", err=True)
        return
    click.echo(f"the NATS server (pid {pid}) reloaded its users", err=True)
    if any(u == NP.CONTROL or u.startswith(NP.AGENT_PREFIX) for u in rotated):
        # The server has disconnected them, for good: only a restart gives them the new password.
        click.echo("warning: `llmgw up`'s services or agent were disconnected: restart `llmgw up`", err=True)


_DIR = click.option(
    "--dir",
    "folder",
    help="The credential folder of a NATS you run yourself (default: the `llmgw up` one, DATA_DIR/nats/users).",
)


@ctl.group("nats")
def nats_group() -> None:
    """NATS users: one per role (operator, control, router, cli, agent-NODE), with subject permissions."""


@nats_group.command("rotate")
@click.argument("role", required=False)
@_DIR
@click.pass_context
def rotate(ctx: click.Context, role: str | None, folder: str | None) -> None:
    """New random passwords for ROLE's user (default: every user), and the server reloads them.

    The server disconnects the rotated users' running clients: restart them (for `control` or the
    local agent: restart `llmgw up`); a remote agent needs its new file copied to its machine."""
    where, data_dir = _folder(ctx, folder)
    try:
        rotated = rotate_credentials(where, role)
    except (CredentialError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    for user in rotated:
        click.echo(f"{user}: new password in {credential_path(where, user)}")
    _reload(data_dir, rotated)


@nats_group.command("add-agent")
@click.argument("node")
@_DIR
@click.pass_context
def add_agent(ctx: click.Context, node: str, folder: str | None) -> None:
    """A NATS user for NODE's agent (it may use only that node's subjects); prints its credential file.

    Copy the file to NODE (mode 0600) and start its agent with `--nats-creds FILE --node-id NODE`."""
    where, data_dir = _folder(ctx, folder)
    user = NP.agent_user(node)
    try:
        ensure_credentials(where, [user])
    except (CredentialError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(str(credential_path(where, user)))
    _reload(data_dir)


@nats_group.command("config")
@_DIR
@click.pass_context
def config(ctx: click.Context, folder: str | None) -> None:
    """Print the `authorization` block (users, passwords, permissions) for a NATS cluster's configuration.

    With --dir, the fixed roles' credentials are made there first if missing (0600); add agents with
    `llmgw ctl nats add-agent NODE --dir …`. The block holds passwords: keep the file it goes to 0600."""
    where, _ = _folder(ctx, folder)
    try:
        ensure_credentials(where, list(NP.ROLES))
        click.echo(authorization_text(where), nl=False)
    except (CredentialError, ValueError) as exc:
        raise click.ClickException(str(exc)) from exc
