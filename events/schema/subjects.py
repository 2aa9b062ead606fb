"""Subjects, stream names and header names as named constants, and id → subject-token encoding.

NATS subject tokens may not contain ``.``, ``*``, ``>``, whitespace or be empty, and model names
contain dots. Ids are encoded so that every id maps to one valid token and back: characters
outside ``[A-Za-z0-9_-]`` become ``~XX`` per UTF-8 byte (``~`` itself included), and the empty
string becomes ``~``.
"""

from __future__ import annotations

import re

PREFIX = "llmgw"

STREAM_EVENTS = "LLMGW_EVENTS"
STREAM_COMMANDS = "LLMGW_COMMANDS"
STREAM_USAGE = "LLMGW_USAGE"
STREAM_TELEMETRY = "LLMGW_TELEMETRY"
STREAM_QUARANTINE = "LLMGW_QUARANTINE"

EVENTS_ROOT = f"{PREFIX}.evt"
COMMANDS_ROOT = f"{PREFIX}.cmd"
USAGE_ROOT = f"{PREFIX}.usage"
TELEMETRY_ROOT = f"{PREFIX}.tel"
QUARANTINE_ROOT = f"{PREFIX}.quarantine"

# JetStream headers we set or read.
HDR_MSG_ID = "Nats-Msg-Id"
HDR_EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
HDR_EXPECTED_LAST_SUBJECT_SEQ_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
HDR_BATCH_ID = "Nats-Batch-Id"
HDR_BATCH_SEQ = "Nats-Batch-Sequence"
HDR_BATCH_COMMIT = "Nats-Batch-Commit"

_SAFE = re.compile(r"[A-Za-z0-9_-]")
_ESCAPE = "~"


def encode_token(value: str) -> str:
    """One valid NATS subject token for any string, reversible with :func:`decode_token`."""
    if value == "":
        return _ESCAPE
    out: list[str] = []
    for ch in value:
        if _SAFE.fullmatch(ch):
            out.append(ch)
        else:
            out.extend(f"~{b:02X}" for b in ch.encode("utf-8"))
    return "".join(out)


def decode_token(token: str) -> str:
    """The string :func:`encode_token` was given. Raises ``ValueError`` on a malformed token."""
    if token == _ESCAPE:
        return ""
    raw = bytearray()
    i = 0
    while i < len(token):
        ch = token[i]
        if ch == _ESCAPE:
            hexpair = token[i + 1 : i + 3]
            if len(hexpair) != 2 or not re.fullmatch(r"[0-9A-F]{2}", hexpair):
                raise ValueError(f"malformed escape in subject token {token!r} at {i}")
            raw.append(int(hexpair, 16))
            i += 3
        elif _SAFE.fullmatch(ch):
            raw.extend(ch.encode("ascii"))
            i += 1
        else:
            raise ValueError(f"character {ch!r} is not allowed in an encoded subject token")
    return raw.decode("utf-8")


def event_subject(aggregate: str, aggregate_id: str) -> str:
    """``llmgw.evt.<aggregate>.<id>``: one subject per aggregate instance."""
    return f"{EVENTS_ROOT}.{aggregate}.{encode_token(aggregate_id)}"


def aggregate_of(subject: str) -> tuple[str, str]:
    """(aggregate, id) of an event subject."""
    parts = subject.split(".")
    if len(parts) != 4 or f"{parts[0]}.{parts[1]}" != EVENTS_ROOT:
        raise ValueError(f"{subject!r} is not an event subject")
    return parts[2], decode_token(parts[3])


def command_outcome_subject(command_id: str) -> str:
    """Where a command's single outcome event is written (the ``command`` aggregate)."""
    return event_subject("command", command_id)
