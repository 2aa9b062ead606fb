"""structlog set up on stderr: JSON lines, or readable lines on a terminal; one event per line (SPEC OBS-4)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import click
import msgspec
import structlog

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


def configure(level: str = "info", json_lines: bool | None = None, extra: list | None = None) -> None:
    """Logging for one process: structlog to stderr, each line with the request's or command's ids.
    ``json_lines`` None: as ``--log-format`` chose (:func:`json_wanted`)."""
    if json_lines is None:
        json_lines = json_wanted()
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(stream=sys.stderr, level=lvl, format="%(message)s")
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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
