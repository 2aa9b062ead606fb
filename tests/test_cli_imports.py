"""The CLI answers at once: a command imports what it needs, not the services.

`llmgw --help` and `llmgw ctl models` once waited 1.2 s for the router app, the jobs service, the
mirror's hub client and the config loader to be imported before any command ran (docs/benchmarks.md,
"The CLI's start"). Each light command is imported here in a fresh interpreter (so ``sys.modules``
starts clean) and asked for its help; what it pulled into ``sys.modules`` must hold none of the heavy
modules, and a failure names the chain of imports that brought one in.
"""

from __future__ import annotations

import json
import subprocess
import sys

import click
import pytest

from llmgw.cli import from_services
from llmgw.cli.ctl import SUBCOMMAND_MODULES, ctl
from llmgw.cli.main import COMMANDS

# Modules no light command may import: the services, a web server, tracing, the hub client, the
# projections, `up`/`server`'s runtime and the config file's loader.
HEAVY = (
    "llmgw.services",
    "llmgw.projections",
    "llmgw.cli.runtime",
    "llmgw.cli.config_file",
    "aiohttp.web",
    "opentelemetry",
    "huggingface_hub",
    "yaml",
)

# The commands a person runs by hand, often, on `up`'s machine or a laptop; each with its help asked.
LIGHT = (
    (),
    ("ctl",),
    ("ctl", "models"),
    ("ctl", "model", "add"),
    ("ctl", "user", "add"),
    ("ctl", "key", "list"),
    ("events",),
    ("events", "tail"),
    ("login",),
    ("logout",),
    ("config",),
    ("config", "reference"),
)

# Run in a fresh interpreter: notes which module first imported each module (the first frame outside
# the import machinery), asks for the help of `llmgw ARGS`, then prints each new module and its importer.
_SCRIPT = """
import contextlib, io, json, sys

importer = {}


class Watch:
    def find_spec(self, name, path=None, target=None):
        frame = sys._getframe(1)
        while frame is not None and (
            "importlib" in frame.f_code.co_filename or frame.f_code.co_filename.startswith("<frozen")
        ):
            frame = frame.f_back
        importer.setdefault(name, frame.f_globals.get("__name__", "?") if frame is not None else "?")
        return None


before = set(sys.modules)
sys.meta_path.insert(0, Watch())
from llmgw.cli.main import main

with contextlib.redirect_stdout(io.StringIO()):
    try:
        main.main([*sys.argv[1:], "--help"], prog_name="llmgw", standalone_mode=False)
    except SystemExit:
        pass
print(json.dumps({name: importer.get(name, "?") for name in sys.modules if name not in before}))
"""


def imports_of(args: tuple[str, ...]) -> dict[str, str]:
    """Each module `llmgw ARGS --help` imports, in a fresh interpreter, and the module that imported it."""
    done = subprocess.run([sys.executable, "-c", _SCRIPT, *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def chain(imports: dict[str, str], name: str) -> str:
    """``name``, then who imported it, and who imported that, … joined by ``<-``."""
    names = [name]
    while (name := imports.get(name, "?")) not in ("?", "__main__") and name not in names:
        names.append(name)
    return " <- ".join(names)


def heavy_chains(imports: dict[str, str]) -> list[str]:
    """A chain for each heavy module pulled in (its top package's, when the package came with it)."""
    found = {}
    for name in imports:
        heavy = next((h for h in HEAVY if name == h or name.startswith(h + ".")), None)
        if heavy is not None and heavy not in found:
            found[heavy] = chain(imports, heavy if heavy in imports else name)
    return list(found.values())


@pytest.mark.parametrize("args", LIGHT, ids=lambda a: " ".join(("llmgw", *a)))
def test_a_light_command_imports_no_service_web_server_tracing_or_config_loader(args: tuple[str, ...]) -> None:
    imports = imports_of(args)
    assert "llmgw.cli.main" in imports, "the probe saw no import"
    chains = heavy_chains(imports)
    assert not chains, f"`llmgw {' '.join(args)} --help` pulled in (module <- its importers):\n" + "\n".join(chains)


def test_up_and_server_are_imported_only_when_run() -> None:
    assert not set(imports_of(())) & {"llmgw.cli.up_cmd", "llmgw.cli.server_cmd"}, "`llmgw --help` imported up"
    assert set(imports_of(("up",))) >= {"llmgw.cli.up_cmd", "llmgw.cli.runtime"}


def test_the_root_help_shows_each_command_as_its_own_help_summarises_it() -> None:
    for name, lazy in COMMANDS.items():
        command = lazy.load()
        assert command.name == name, f"{lazy.where} is named {command.name!r}, listed as {name!r}"
        shown = click.Command(name, help=lazy.summary).get_short_help_str(1000)
        assert shown == command.get_short_help_str(1000), f"cli/main.py's summary of `llmgw {name}` drifted"


def test_ctl_imports_for_each_subcommand_every_module_that_adds_to_it() -> None:
    named = ctl.list_commands(click.Context(ctl))  # imports every module, as `llmgw ctl --help` does

    def modules(command: click.Command) -> set[str]:
        mine = {command.callback.__module__} if command.callback else set()
        below = command.commands.values() if isinstance(command, click.Group) else ()
        return mine.union(*(modules(c) for c in below))

    for name in named:
        if name in ctl.lazy:
            continue
        made_by = modules(ctl.commands[name]) - {"llmgw.cli.ctl"}
        said = {module for module, names in SUBCOMMAND_MODULES.items() if name in names}
        assert made_by == said, f"`ctl {name}` is made in {sorted(made_by)}; cli/ctl.py says {sorted(said)}"


def test_what_the_cli_knows_of_the_services_is_what_they_say() -> None:
    from llmgw.services.access.bootstrap import DEMO_KEY_FILE
    from llmgw.services.api.views import KEYS_LIMIT, KEYS_LIMIT_MAX
    from llmgw.services.people.bootstrap import TOKEN_FILE

    assert from_services.ADMIN_TOKEN_FILE == TOKEN_FILE
    assert from_services.DEMO_KEY_FILE == DEMO_KEY_FILE
    assert (from_services.KEYS_LIMIT, from_services.KEYS_LIMIT_MAX) == (KEYS_LIMIT, KEYS_LIMIT_MAX)
