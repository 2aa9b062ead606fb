"""structlog set up on stderr: JSON lines, or readable lines on a terminal; one event per line (SPEC OBS-4).

Every line — structlog's, the standard library's (aiohttp, nats-py) and the status lines a command
says (:func:`say`) — goes through one :class:`~llmgw.cli.log_sink.LineSink`: a log that cannot be
written never fails, delays or changes the work (docs/operations.md, "Logs")."""

from __future__ import annotations

import atexit
import json
import logging
import sys
from typing import Any

import click
import msgspec
import structlog

from llmgw.cli.log_sink import LineSink
from llmgw.events.runtime import log_context

_encoder = msgspec.json.Encoder(enc_hook=str)  # a field of another type (a path, an id object) as its text


def _dumps(event: dict[str, Any], **kw: Any) -> str:
    """One log line's JSON: msgspec's encoder (a tenth of json.dumps's time; the router writes a line per
    request), json.dumps for what msgspec cannot take (keys that are not strings)."""
    try:
        return _encoder.encode(event).decode()
    except (TypeError, msgspec.EncodeError):
        return json.dumps(event, default=str)


def chosen_format() -> str:
    """``llmgw --log-format`` of the command running (auto when none is)."""
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_root().obj if ctx is not None else None
    return (obj or {}).get("log_format") or "auto"


def json_wanted(chosen: str | None = None, stream: Any = None) -> bool:
    """JSON lines unless a person reads them: ``console`` asked for, or ``auto`` on a terminal."""
    chosen = chosen or chosen_format()
    if chosen == "auto":
        return not (stream or sys.stderr).isatty()
    return chosen == "json"


class SinkLogger:
    """structlog's logger for rendered lines: each goes to the sink, whatever its level."""

    def __init__(self, sink: LineSink) -> None:
        self._sink = sink

    def msg(self, message: str) -> None:
        self._sink.write(message)

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class SinkLoggerFactory:
    """Makes :class:`SinkLogger` s over one sink; where :func:`current_sink` finds the process's sink."""

    def __init__(self, sink: LineSink) -> None:
        self.sink = sink

    def __call__(self, *args: Any) -> SinkLogger:
        return SinkLogger(self.sink)


class SinkHandler(logging.Handler):
    """The standard library's records (aiohttp's, nats-py's) through the same sink."""

    def __init__(self, sink: LineSink) -> None:
        super().__init__()
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.sink.write(self.format(record))
        except Exception:  # a record that cannot be formatted is not the caller's failure either
            self.sink.write(f"{record.name}: {record.levelname}: a log record could not be formatted")


def current_sink() -> LineSink | None:
    """The sink :func:`configure` set up for this process (None before it did)."""
    factory = structlog.get_config().get("logger_factory")
    return factory.sink if isinstance(factory, SinkLoggerFactory) else None


def say(text: str) -> None:
    """A status line for the person running a command ("llmgw is up: …") on stderr, through the sink:
    a closed or full stderr never fails the command. Before :func:`configure`, written directly, its
    failure ignored."""
    sink = current_sink()
    if sink is not None:
        sink.write(text)
        return
    try:
        click.echo(text, err=True)
    except (OSError, ValueError):
        pass


def flush(timeout_s: float = 2.0) -> bool:
    """Wait (up to ``timeout_s``) for the lines logged so far to reach stderr; False if they did not."""
    sink = current_sink()
    return True if sink is None else sink.flush(timeout_s)


def configure(level: str = "info", json_lines: bool | None = None, extra: list | None = None) -> None:
    """Logging for one process: structlog to stderr, each line with the request's or command's ids.
    ``json_lines`` None: as ``--log-format`` chose (:func:`json_wanted`)."""
    if json_lines is None:
        json_lines = json_wanted()
    lvl = getattr(logging, level.upper(), logging.INFO)
    previous = current_sink()
    if previous is not None and previous.stream is sys.stderr:
        sink = previous  # configured again (tests, a command that configures twice): one writer thread
    else:
        if previous is not None:
            previous.close()
        sink = LineSink(sys.stderr)
        atexit.register(sink.close)
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, SinkHandler) or h.__class__ is logging.StreamHandler]:
        root.removeHandler(handler)
    handler = SinkHandler(sink)
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(lvl)
    # On a terminal, tracebacks as plain text: with rich installed the console renderer would print
    # every frame's local variables, and a frame may hold a secret (an outside provider's key).
    renderer = (
        structlog.processors.JSONRenderer(serializer=_dumps)
        if json_lines
        else structlog.dev.ConsoleRenderer(exception_formatter=structlog.dev.plain_traceback)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            log_context.add_context,  # the request's or command's ids (events/runtime/log_context.py)
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            # JSON carries the traceback as text; the console renderer prints it readably itself.
            *([structlog.processors.format_exc_info] if json_lines else []),
            *(extra or []),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=SinkLoggerFactory(sink),
        cache_logger_on_first_use=False,
    )
