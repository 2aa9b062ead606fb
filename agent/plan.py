"""The agent's own choices (SPEC FLEET-5, FLEET-6) as a pure function: what the log wants on this
node, and what runs on it → what to start, stop, or report failed.

The fleet is authoritative about what runs; the log about what should. An engine found running
after an agent restart is adopted (kept, reported), not restarted.
"""

from __future__ import annotations

import msgspec


class Desired(msgspec.Struct, frozen=True, kw_only=True):
    """A replica of this node as the log has it."""

    replica_id: str
    state: str  # placed | starting | ready | draining | stopped | failed


class Start(msgspec.Struct, frozen=True):
    replica_id: str


class StopEngine(msgspec.Struct, frozen=True):
    replica_id: str
    reason: str


class ReportFailed(msgspec.Struct, frozen=True):
    replica_id: str
    reason: str


class ReportStopped(msgspec.Struct, frozen=True):
    replica_id: str
    reason: str


Action = Start | StopEngine | ReportFailed | ReportStopped


def plan(desired: dict[str, Desired], running: set[str], pending: set[str]) -> list[Action]:
    """``running``: engines this agent has (started or adopted); ``pending``: starts or stops under way."""
    actions: list[Action] = []
    for rid in sorted(desired):
        d = desired[rid]
        if rid in pending:
            continue
        here = rid in running
        if d.state == "placed" and not here:
            actions.append(Start(rid))
        elif d.state in ("starting", "ready") and not here:
            # The log says it runs here, but no engine does: it died while nobody watched.
            actions.append(ReportFailed(rid, "engine not running on its node (it exited while the agent was away)"))
        elif d.state == "draining":
            if here:
                actions.append(StopEngine(rid, "stop requested"))
            else:
                actions.append(ReportStopped(rid, "stop requested; the engine was not running"))
        elif d.state in ("stopped", "failed") and here:
            actions.append(StopEngine(rid, f"replica is {d.state} in the log"))
    for rid in sorted(running - set(desired) - pending):
        actions.append(StopEngine(rid, "stray: no such replica placed on this node"))
    return actions
