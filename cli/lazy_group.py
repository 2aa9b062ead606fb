"""A click group whose subcommands are imported when one is run, not when the CLI starts.

`llmgw --help` and `llmgw ctl models` should answer at once; importing every command's module up
front pulled in the router, the jobs service, the mirror's hub client and the config loader first
(docs/benchmarks.md, "The CLI's start"). Each subcommand is named here by where it lives
(``"llmgw.cli.up_cmd:up"``) and by the one-line summary the group's help lists, so listing the
commands imports none of them. tests/test_cli_imports.py holds each summary to the command's own help.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence

import click
import msgspec


class LazyCommand(msgspec.Struct, frozen=True):
    """Where a subcommand lives (``"module:attribute"``) and what the group's help says of it."""

    where: str
    summary: str

    def load(self) -> click.Command:
        module, _, attribute = self.where.partition(":")
        command = getattr(importlib.import_module(module), attribute)
        if not isinstance(command, click.Command):
            raise TypeError(f"{self.where} is not a click command")
        return command


class LazyGroup(click.Group):
    """A group of commands given as :class:`LazyCommand`: one is imported when it is run (or asked
    for its own help); the group's help lists their summaries without importing any.

    ``registering``: modules that add their own commands to this group as they are imported, each with
    the names it adds or adds to (`ctl`'s: they import the group from its module, so they can only be
    imported after it). Asked for one of those names, the group imports the modules naming it; listing
    its commands imports them all.
    """

    def __init__(
        self,
        *args: object,
        lazy: dict[str, LazyCommand] | None = None,
        registering: Mapping[str, Sequence[str]] | None = None,
        **kwargs: object,
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.lazy = dict(lazy or {})
        self.registering = dict(registering or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        self._import_registering(lambda names: True)
        return sorted({*super().list_commands(ctx), *self.lazy})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in self.lazy:
            self.add_command(self.lazy[cmd_name].load(), cmd_name)
        self._import_registering(lambda names: cmd_name in names)  # each at most once: Python keeps modules
        return super().get_command(ctx, cmd_name)

    def _import_registering(self, wanted: Callable[[Sequence[str]], bool]) -> None:
        for module, names in self.registering.items():
            if wanted(names):
                importlib.import_module(module)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's own listing, with each lazy command's summary instead of its imported help."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            if name in self.commands:
                command = self.commands[name]
                if command.hidden:
                    continue
                rows.append((name, command.get_short_help_str(limit)))
            else:
                # shortened as click shortens a command's own help, so the listing reads the same
                rows.append((name, click.Command(name, help=self.lazy[name].summary).get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)
