"""The caller-side errors of sending a command: refused, timed out, unreachable.

Apart from the client (:mod:`llmgw.events.commands.client`) so that what only reports them — the
CLI's read commands — need not import NATS to name them.
"""

from __future__ import annotations


class CommandError(Exception):
    """Base of the caller-side errors; each maps to an exit code in the CLI."""

    exit_code = 1


class CommandRejectedError(CommandError):
    """The owning service refused the command; ``reason`` says what to do."""

    exit_code = 2

    def __init__(self, reason: str, code: str = "rejected") -> None:
        self.reason = reason
        self.code = code
        super().__init__(reason)


class CommandTimeoutError(CommandError):
    exit_code = 3


class Unreachable(CommandError):
    exit_code = 4
