"""structlog set up for JSON lines on stderr: one event per line (SPEC OBS-4)."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info", json_lines: bool = True, extra: list | None = None) -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    logging.basicConfig(stream=sys.stderr, level=lvl, format="%(message)s")
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            *(extra or []),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
