"""Every `llmgw …` command line a person is shown parses against the click tree.

The lines come from the docs (`docs/*.md`, `README.md`: backticked code spans and lines of code
blocks that start with `llmgw `), from `ops/` (backticked spans, systemd `ExecStart=` lines, compose
`command:` lists) and from
backticked `llmgw …` in the string literals of the package's own source (the messages and help the
services and the CLI print). Each is walked down the tree with click's own parser, one
`make_context` per level, so a command that does not exist, an option given to the wrong command
(`llmgw restore --data-dir`, where `--data-dir` is `llmgw`'s own) or a value click refuses fails,
naming the file, the line and the command.

Placeholders are read as the docs mean them: `[--opt]` is the option, `a\\|b` is each alternative
in turn, `NAME`, `<x>`, `{{ $labels.x }}` and an f-string's `{value}` stand for a value (a dummy of
the option's or argument's type takes their place), `…` for "and so on". A line that leaves out a
required argument or option still names its command: the missing ones are filled in with dummies,
so only what is written is judged.
"""

from __future__ import annotations

import ast
import re
import shlex
import uuid
from collections.abc import Iterator
from pathlib import Path

import click
import msgspec
import pytest

from llmgw.cli.main import main as llmgw_root

ROOT = Path(__file__).resolve().parent.parent
SOURCE_FOLDERS = ("events", "infra", "projections", "services", "agent", "cli", "bench", "modelfiles")


class CommandLine(msgspec.Struct, frozen=True):
    """One `llmgw …` line as written, and where: ``where`` is ``path:line``."""

    where: str
    text: str


# --- finding the lines -------------------------------------------------------------------------

_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.DOTALL)
_FENCE = re.compile(r"^\s*(```|~~~)")
_ENV_PREFIX = re.compile(r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)+")
_SHELL_SPLIT = re.compile(r"&&|\|\||;|(?<!\\)\|")


def _commands_in(snippet: str) -> list[str]:
    """The `llmgw …` commands in a snippet of shell: split at `&&`, `;`, pipes (not `\\|`, which
    the docs' tables use for alternatives), each without its leading `VAR=value`s or `sudo`."""
    found = []
    for part in _SHELL_SPLIT.split(" ".join(snippet.split())):
        part = _ENV_PREFIX.sub("", part.strip())
        part = part.removeprefix("sudo ").strip()
        part = re.split(r"\s(?:\d?>|<)", f" {part}", maxsplit=1)[0].strip()  # a redirection is the shell's
        if part == "llmgw" or part.startswith("llmgw "):
            found.append(part)
    return found


def _spans(text: str, first_line: int) -> Iterator[tuple[int, str]]:
    """Backticked code spans of a block of markdown (or of a message), with the line each starts on."""
    for match in _SPAN.finditer(text):
        if "\n\n" not in match.group(2):
            yield first_line + text.count("\n", 0, match.start()), match.group(2)


def lines_in_markdown(path: Path) -> Iterator[CommandLine]:
    """Lines of code blocks starting with `llmgw ` and backticked `llmgw …` spans elsewhere."""
    rel = path.relative_to(ROOT).as_posix()
    prose: list[tuple[int, str]] = []  # (line number, text) outside code blocks
    in_block = False
    pending = ""  # a code line continued with a backslash
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if _FENCE.match(line):
            in_block = not in_block
            prose.append((n, ""))
            continue
        if not in_block:
            prose.append((n, line))
            continue
        line = pending + line.strip()
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        pending = ""
        code = re.sub(r"\s+#.*$", "", line.removeprefix("$ "))
        for command in _commands_in(code):
            yield CommandLine(f"{rel}:{n}", command)
    # Spans never cross a blank line; each paragraph is searched on its own.
    start, block = 1, []
    for n, line in [*prose, (0, "")]:
        if line.strip():
            if not block:
                start = n
            block.append(line)
            continue
        for at, span in _spans("\n".join(block), start):
            for command in _commands_in(span):
                yield CommandLine(f"{rel}:{at}", command)
        block = []


def lines_in_ops(path: Path) -> Iterator[CommandLine]:
    """Backticked `llmgw …` spans (alert descriptions, comments), systemd `ExecStart=` lines and the
    `command:` lists of ops/cluster/compose.yaml."""
    rel = path.relative_to(ROOT).as_posix()
    text = re.sub(r"\{\{.*?\}\}", "VALUE", path.read_text())
    for at, span in _spans(text, 1):
        for command in _commands_in(span):
            yield CommandLine(f"{rel}:{at}", command)
    lines = text.splitlines()
    for n, line in enumerate(lines, 1):
        exec_start = re.match(r"\s*ExecStart=\S*/(llmgw\s.*)$", line)
        if exec_start:
            yield CommandLine(f"{rel}:{n}", exec_start.group(1).strip())
        if re.match(r"\s*command:\s*$", line):  # a compose service's command, one word per item
            words = _yaml_items(lines[n:])
            if words[:1] == ["llmgw"]:
                yield CommandLine(f"{rel}:{n}", shlex.join(words))


def _yaml_items(lines: list[str]) -> list[str]:
    """The items of the YAML list that starts at ``lines[0]`` (`- word` lines; comments skipped)."""
    items = []
    for line in lines:
        if line.strip().startswith("#"):
            continue
        item = re.match(r"\s*-\s+(.*?)\s*$", line)
        if item is None:
            break
        items.append(item.group(1).strip("\"'"))
    return items


def _literal(node: ast.Constant | ast.JoinedStr) -> str:
    """A string literal's text; an f-string's `{…}` parts read as one placeholder value."""
    if isinstance(node, ast.Constant):
        return node.value
    return "".join(v.value if isinstance(v, ast.Constant) else "VALUE" for v in node.values)


def lines_in_source(path: Path) -> Iterator[CommandLine]:
    """Backticked `llmgw …` in the string literals (messages, help, docstrings) of a Python module."""
    rel = path.relative_to(ROOT).as_posix()
    tree = ast.parse(path.read_text())
    inside_fstrings = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) for v in node.values}
    for node in ast.walk(tree):
        is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if not (is_text or isinstance(node, ast.JoinedStr)) or id(node) in inside_fstrings:
            continue
        for at, span in _spans(_literal(node), node.lineno):
            for command in _commands_in(span):
                yield CommandLine(f"{rel}:{at}", command)


def all_command_lines() -> list[CommandLine]:
    found = [*lines_in_markdown(ROOT / "README.md")]
    for page in sorted((ROOT / "docs").glob("*.md")):
        found += lines_in_markdown(page)
    for path in sorted((ROOT / "ops").rglob("*")):
        if path.is_file() and path.suffix not in (".json", ".py"):
            found += lines_in_ops(path)
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found += lines_in_source(path)
    return found


# --- reading a line as the docs mean it --------------------------------------------------------

_PLACEHOLDER = re.compile(r"^(?:[A-Z][A-Z0-9_]*(?:[-/.:,=][A-Z0-9_]*)*|<[^>]*>|VALUE)$")


def is_placeholder(token: str) -> bool:
    """`NAME`, `ID-OR-SEQ`, `OWNER/REPO`, `URL,URL,…`, `<model>`, `…`: a value the reader chooses."""
    return "…" in token or "..." in token or bool(_PLACEHOLDER.match(token))


_OR = "\x00"


def variants(text: str) -> list[list[str]]:
    """The command's words, once per alternative the docs list with `\\|` (`stop\\|start\\|remove`),
    without the brackets that mark what is optional."""
    text = text.replace("\\|", _OR)  # before shlex, which would eat the backslash
    try:
        words = shlex.split(text)
    except ValueError:  # an unbalanced quote in prose
        words = text.split()
    words = [w for w in words if w != _OR]  # `[--a] \\| --b`: each side's options are the command's
    choices = [w.split(_OR) for w in words]
    count = max(len(c) for c in choices)
    out = []
    for i in range(count):
        tokens = []
        for alternatives in choices:
            token = alternatives[i] if i < len(alternatives) else alternatives[0]
            token = token.strip("[]()").removesuffix("…").removesuffix("...").strip("[]()")
            if not token and (alternatives[0].strip("[]()") in ("…", "...")):
                token = "…"  # a bare "…": kept, a value where one is due, else dropped
            if token:
                tokens.append(token)
        out.append(tokens)
    return out


def dummy(param: click.Parameter) -> str:
    """A value ``param`` takes, for a placeholder or a required parameter the line leaves out."""
    kind = param.type
    if isinstance(kind, click.Choice):
        return str(kind.choices[0])
    if isinstance(kind, (click.IntRange, click.FloatRange)):
        low = kind.min if kind.min is not None else (kind.max if kind.max is not None else 1)
        return str(low + 1 if kind.min_open else low)
    if isinstance(kind, (click.types.IntParamType, click.types.FloatParamType)):
        return "1"
    if isinstance(kind, click.types.BoolParamType):
        return "true"
    if isinstance(kind, click.DateTime):
        return "2026-01-01"
    if isinstance(kind, click.types.UUIDParameterType):
        return str(uuid.uuid4())
    if isinstance(kind, click.Path) and not kind.file_okay:
        return str(ROOT)
    if isinstance(kind, (click.Path, click.File)):
        return __file__
    return "value"


def _option(command: click.Command, token: str) -> click.Option | None:
    name = token.split("=", 1)[0]
    for param in command.params:
        if isinstance(param, click.Option) and name in (*param.opts, *param.secondary_opts):
            return param
    return None


def fill_in(command: click.Command, tokens: list[str]) -> list[str]:
    """``tokens`` for one level, placeholders replaced by dummies of the type they stand for. A group's
    level ends at its first positional word (the subcommand); the rest is passed on as written."""
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    out: list[str] = []
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if isinstance(command, click.Group) and not token.startswith("-"):
            return out + tokens[i:]
        if token.startswith("-") and "=" in token and is_placeholder(token.split("=", 1)[1]):
            option = _option(command, token)
            token = f"{token.split('=', 1)[0]}={dummy(option)}" if option is not None else token
        option = _option(command, token) if token.startswith("-") else None
        if option is not None and "=" not in token and not option.is_flag and not option.count:
            out.append(token)
            values = tokens[i + 1 : i + 1 + option.nargs]
            out += [dummy(option) if is_placeholder(v) else v for v in values]
            out += [dummy(option)] * (option.nargs - len(values))  # `--port` named on its own
            i += 1 + len(values)
            continue
        if token in ("…", "..."):
            i += 1  # "and so on", where no value is due
            continue
        if not token.startswith("-") and is_placeholder(token):
            position = sum(1 for t in out if not t.startswith("-"))
            argument = arguments[min(position, len(arguments) - 1)] if arguments else None
            out.append(dummy(argument) if argument is not None else token)
        else:
            out.append(token)
        i += 1
    for param in command.params:  # an option that would prompt for what the line leaves out
        if isinstance(param, click.Option) and param.prompt and not any(t.split("=")[0] in param.opts for t in out):
            out += [param.opts[0], dummy(param)]
    return out


def parse(text: str) -> str | None:
    """Why click refuses ``text`` (``llmgw …``), or None when every word of it is understood."""
    for tokens in variants(text):
        problem = _parse_words(tokens[1:])
        if problem is not None:
            return problem
    return None


def _parse_words(words: list[str]) -> str | None:
    command: click.Command = llmgw_root
    name, parent, path = "llmgw", None, "llmgw"
    while True:
        args = fill_in(command, words)
        for _ in range(20):  # a required parameter the line leaves out: fill it in, parse again
            try:
                ctx = command.make_context(name, list(args), parent=parent, resilient_parsing=False)
                break
            except click.MissingParameter as missing:
                if isinstance(missing.param, click.Option):
                    args += [missing.param.opts[0], dummy(missing.param)]
                elif missing.param is not None:
                    args += [dummy(missing.param)] * max(missing.param.nargs, 1)
                else:
                    return f"{path}: {missing.format_message()}"
            except click.exceptions.NoArgsIsHelpError:
                return None  # a group (or command) named on its own
            except click.exceptions.Exit:
                return None  # --help
            except click.UsageError as refused:
                return f"{path}: {refused.format_message()}"
        else:
            return f"{path}: required parameters keep missing"
        if not isinstance(command, click.Group):
            return None
        rest = [*getattr(ctx, "_protected_args", []), *ctx.args]
        if not rest or rest[0] in ("…", "...", "VALUE"):
            return None  # a group named on its own, or "any of its commands"
        sub = command.get_command(ctx, rest[0])
        if sub is None:
            return f"{path}: no command {rest[0]!r} (it has: {', '.join(command.list_commands(ctx))})"
        command, name, parent, path, words = sub, rest[0], ctx, f"{path} {rest[0]}", rest[1:]


# --- the test ----------------------------------------------------------------------------------

LINES = all_command_lines()


def test_the_docs_and_messages_show_commands_at_all() -> None:
    places = {line.where.split(":")[0] for line in LINES}
    assert "README.md" in places and "docs/cli.md" in places
    assert any(place.startswith("services/") for place in places), "no `llmgw …` found in the services' messages"


@pytest.mark.parametrize("line", [pytest.param(line, id=line.where) for line in LINES])
def test_every_llmgw_command_line_shown_to_people_parses_against_the_cli(line: CommandLine) -> None:
    problem = parse(line.text)
    assert problem is None, f"{line.where}: `{line.text}`: {problem}"


@pytest.mark.parametrize(
    ("text", "refused"),
    [
        ("llmgw restore ARCHIVE --data-dir NEW_DIR", True),
        ("llmgw --data-dir NEW_DIR restore ARCHIVE", False),
        ("llmgw ctl model retry", True),
        ("llmgw ctl retry MODEL", False),
        ("llmgw model serve OWNER/REPO", True),
        ("llmgw ctl model stop\\|start\\|remove NAME", False),
        ("llmgw ctl model stop\\|begin NAME", True),
        ("llmgw streams replicas [N]", False),
        ("llmgw ctl model serve", False),
        ("llmgw ctl models --no-such-option", True),
        ("llmgw ctl --data-dir DIR models", True),
        ("llmgw ctl key create --project P --rpm many", True),
        ("llmgw events tail [-n 20] [--type T]… [--follow]", False),
    ],
)
def test_the_check_refuses_what_click_refuses_and_reads_placeholders_as_values(text: str, refused: bool) -> None:
    assert (parse(text) is not None) == refused, parse(text)
