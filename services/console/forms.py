"""What a console action answers when the form itself cannot become a command: one error type and one
refusal, shared by every page (the core turns an uncaught :class:`BadInput` into the same refusal)."""

from __future__ import annotations

from llmgw.services.api.act import Outcome


class BadInput(ValueError):
    """A form field that cannot become the command's field; its message says what to give."""


def refused(kind: str, message: str, code: str = "invalid") -> Outcome:
    """A refusal made before any command was sent: the form's input cannot be one (a 400, never a 500)."""
    return Outcome(command="", kind=kind, outcome="refused", message=message, code=code)
