"""Request/reply with one node's agent: the subjects and the messages, shared by the agent and its callers.

These are questions, not facts: nothing here is written to the log. ``logs`` returns recent lines (the
agent's own, or one replica's engine log); ``weights`` lists the node's weights cache or deletes files
from it. Subjects are per node, so a request reaches exactly the agent it names.
"""

from __future__ import annotations

import msgspec

from llmgw.events.schema import subjects as S
from llmgw.events.schema.subjects import encode_token


def logs_subject(node_id: str) -> str:
    return f"{S.PREFIX}.rpc.agent.{encode_token(node_id)}.logs"


class LogsRequest(msgspec.Struct, frozen=True, kw_only=True):
    replica: str | None = None  # None: the agent's own log
    lines: int = 100


class LogsReply(msgspec.Struct, frozen=True, kw_only=True):
    lines: list[str] = []
    error: str = ""


def weights_subject(node_id: str) -> str:
    return f"{S.PREFIX}.rpc.agent.{encode_token(node_id)}.weights"


class WeightsRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``list`` what the cache holds; ``collect`` deletes every file not in ``keep``; ``remove`` deletes
    the files named in ``remove`` that are not in ``keep``. Files a running engine uses always stay."""

    action: str = "list"  # list | collect | remove
    keep: list[str] = []  # MODEL/VERSION/FILE refs that models in the catalog use
    remove: list[str] = []


class WeightsReply(msgspec.Struct, frozen=True, kw_only=True):
    held: list[str] = []  # after the action
    removed: list[str] = []
    error: str = ""
