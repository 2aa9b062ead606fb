"""The command envelope: what people and tools ask for (ARCHITECTURE §4).

A :class:`Command` names its kind (``<service>.<verb>``), its actor and its data, and is signed
(:mod:`llmgw.events.commands.signing`) over every field but the signature. It travels on
``llmgw.cmd.<service>.<verb>`` (:func:`command_subject`); :mod:`~llmgw.events.commands.client`
sends it and :mod:`~llmgw.events.commands.processor` carries it out.
"""

from __future__ import annotations

import re
from datetime import datetime

import msgspec

from llmgw.events.commands import signing
from llmgw.events.schema import subjects as S

_VERB = re.compile(r"^[a-z][a-z0-9_-]*(\.[a-z][a-z0-9_-]*)*$")


class Command(msgspec.Struct, frozen=True, kw_only=True):
    """The command envelope. ``data`` is decoded by the owning service, strictly."""

    id: str
    kind: str  # "<service>.<verb>", e.g. "tenancy.create"
    actor: str
    at: datetime
    expected: int | None = None
    correlation: str | None = None
    data: msgspec.Raw = msgspec.Raw(b"{}")
    signer: str = ""  # the key that signed it: token:<prefix> (a person) or svc:<name> (events/commands/auth.py)
    signature: str = ""  # Ed25519 over :meth:`signed_bytes`

    def signed_bytes(self) -> bytes:
        """What the signature covers: every field but the signature itself, the data as sent."""
        return signing.signed_bytes(
            id=self.id,
            kind=self.kind,
            actor=self.actor,
            at=self.at,
            expected=self.expected,
            correlation=self.correlation,
            signer=self.signer,
            data=bytes(self.data),
        )

    @property
    def thread(self) -> str:
        """The correlation of every event the command causes: the one it carries (a job's id when a job
        sent it), else its own id (docs/decisions.md, "One command-handling shell")."""
        return self.correlation or self.id


command_decoder = msgspec.json.Decoder(Command)


def command_subject(service: str, verb: str) -> str:
    if not _VERB.match(service) or "." in service or not _VERB.match(verb):
        raise ValueError(f"bad command name {service}.{verb}: lower-case words separated by dots")
    return f"{S.COMMANDS_ROOT}.{service}.{verb}"
