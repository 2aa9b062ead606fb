"""What a log line is about, bound once per request or command (SPEC OBS-4).

A request's or a command's ids are set here when it begins, and every log line written while it is
handled — in any function it calls, in tasks it starts — carries them, added by :func:`add_context`
(a structlog processor, in cli/logs.py's chain). A ContextVar: each request and command runs in its
own asyncio task, so their ids never mix; setting one costs a fraction of a microsecond, so the
gateway binds on every request although it logs on few.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from typing import Any

Fields = tuple[tuple[str, str], ...]

_CURRENT: ContextVar[Fields] = ContextVar("llmgw_log_context", default=())


def bind(*pairs: tuple[str, str]) -> Token[Fields]:
    """Bind ``pairs`` (name, value) to every log line until :func:`unbind` with the token returned.
    Empty values are left out."""
    for _, value in pairs:
        if not value:
            return _CURRENT.set(tuple(p for p in pairs if p[1]))
    return _CURRENT.set(pairs)  # the common case (every value given): kept as passed, no copy


def unbind(token: Token[Fields]) -> None:
    _CURRENT.reset(token)


def current() -> Fields:
    return _CURRENT.get()


def add_context(_logger: Any, _method: str, event: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: the bound ids, unless the line names its own."""
    for name, value in _CURRENT.get():
        event.setdefault(name, value)
    return event
