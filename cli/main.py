"""`llmgw`: the command line's root — its global options, and where each command lives.

`up` runs everything here; the rest talk to a running system. Each command is imported only when it
runs (cli/lazy_group.py), so `llmgw --help` and `llmgw ctl …` do not wait for the services' imports.
"""

from __future__ import annotations

import click

from llmgw.cli.lazy_group import LazyCommand, LazyGroup

# name → where the command lives, and the line `llmgw --help` shows for it (its help's first sentence;
# tests/test_cli_imports.py holds the two equal).
COMMANDS = {
    "agent": LazyCommand(
        "llmgw.cli.agent_cmd:agent", "Run the node agent: report this machine, run the engines placed on it."
    ),
    "backup": LazyCommand(
        "llmgw.cli.backup_cmd:backup",
        "Copy every stream and key-value bucket, the CA and the NATS users into one archive (0600).",
    ),
    "bench": LazyCommand(
        "llmgw.cli.bench:bench", "Benchmarks: figures compared as ratios within one run, never pass/fail."
    ),
    "config": LazyCommand(
        "llmgw.cli.config_cmd:config",
        "The settings of `llmgw server` (its --config FILE, flags and $LLMGW_… variables).",
    ),
    "ctl": LazyCommand(
        "llmgw.cli.ctl:ctl", "Operate the system: tenancy, keys, limits, prices, budgets, models, nodes."
    ),
    "events": LazyCommand("llmgw.cli.events_cmd:events", "Read the event log: every change, who made it, and why."),
    "login": LazyCommand(
        "llmgw.cli.people_cmd:login",
        "Sign in to the admin API: the session token (12 h) is kept for it in your config directory (0600).",
    ),
    "logout": LazyCommand("llmgw.cli.people_cmd:logout", "Forget this admin API's session token here and revoke it."),
    "mirror": LazyCommand(
        "llmgw.cli.mirror_cmd:mirror",
        "Model weights on the mirror: fetch them from a Hugging Face hub, list, remove.",
    ),
    "projections": LazyCommand(
        "llmgw.cli.projections_cmd:projections", "Rebuild read models from the log, or check them against it."
    ),
    "restore": LazyCommand(
        "llmgw.cli.backup_cmd:restore",
        "Recreate the streams, buckets and secrets of ARCHIVE in an empty cluster, and its files in DATA_DIR.",
    ),
    "server": LazyCommand(
        "llmgw.cli.server_cmd:server",
        "Run services against an external NATS and PostgreSQL (the cluster shape).",
    ),
    "streams": LazyCommand("llmgw.cli.streams_cmd:streams", "llmgw's JetStream streams and key-value buckets."),
    "up": LazyCommand(
        "llmgw.cli.up_cmd:up",
        "Run everything on this machine: embedded NATS, SQLite projections, every service.",
    ),
}


@click.group(cls=LazyGroup, lazy=COMMANDS)
@click.option("--nats", envvar="LLMGW_NATS_URL", help="NATS URL of the system (default: the running `llmgw up`).")
@click.option("--api", envvar="LLMGW_API_URL", help="Admin API URL (default: the running `llmgw up`).")
@click.option(
    "--data-dir", envvar="LLMGW_DATA_DIR", help="Data directory of `llmgw up` (default ~/.local/share/llmgw)."
)
@click.option(
    "--ca",
    envvar="LLMGW_CA",
    help="The CA certificate an https admin API is checked against (default: DATA_DIR/pki/ca.crt if any).",
)
@click.option(
    "--nats-creds",
    envvar="LLMGW_NATS_CREDS",
    help="The NATS credential file to connect with ($LLMGW_NATS_CREDS; default on the `llmgw up` machine: "
    "DATA_DIR/nats/users/operator.json).",
)
@click.pass_context
@click.option(
    "--log-format",
    type=click.Choice(["auto", "console", "json"]),
    envvar="LLMGW_LOG_FORMAT",
    default="auto",
    show_default=True,
    help="Log lines of up, server and agent: readable on a terminal and JSON otherwise (auto), or as said.",
)
def main(
    ctx: click.Context,
    nats: str | None,
    api: str | None,
    data_dir: str | None,
    ca: str | None,
    nats_creds: str | None,
    log_format: str,
) -> None:
    """llmgw: one OpenAI-compatible gateway in front of a fleet of inference engines."""
    ctx.obj = {
        "nats": nats,
        "api": api,
        "data_dir": data_dir,
        "ca": ca,
        "nats_creds": nats_creds,
        "log_format": log_format,
    }


if __name__ == "__main__":
    main()
