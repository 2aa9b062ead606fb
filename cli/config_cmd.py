"""`llmgw config …`: the reference of every setting `llmgw server --config FILE` takes, and an example file."""

from __future__ import annotations

from pathlib import Path

import click


@click.group("config")
def config() -> None:
    """The settings of `llmgw server` (its --config FILE, flags and $LLMGW_… variables)."""


@config.command("reference")
@click.option(
    "--write",
    "page",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Replace the reference between the markers of this page (docs/operations.md) instead of printing it.",
)
def config_reference(page: Path | None) -> None:
    """Every setting: its key, what it takes, its default, its environment variable and what it does."""
    from llmgw.cli import config_file as C  # the services' settings structs: only when asked for them

    reference = C.render_reference()
    if page is None:
        click.echo(reference, nl=False)
        return
    try:
        page.write_text(C.spliced(page.read_text(), reference))
    except (OSError, C.ConfigError) as exc:
        click.echo(f"error: {page}: {exc}", err=True)
        raise SystemExit(2) from None


@config.command("example")
def config_example() -> None:
    """A config file holding every setting, each with what it does (ops/llmgw.yaml)."""
    from llmgw.cli import config_file as C

    click.echo(C.render_example(), nl=False)
