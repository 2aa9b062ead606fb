"""One usage record per request (SPEC GW-8, USE-1), on ``llmgw.usage.<project id>``.

Published by the router with ``Nats-Msg-Id`` = the request id, so a record sent twice is stored
once. That id is the gateway's own (SPEC GW-2 as tightened by "Trust"): a client that repeats its
``X-Request-Id`` is billed for every request; its id is kept as ``client_request_id``.
The accountant folds them into per-minute rollups (USE-2).
"""

from __future__ import annotations

from datetime import datetime

import msgspec


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """An MCP tool call through ``/mcp`` (issue 26): which server's tool, the bytes each way, how it ended."""

    server: str
    tool: str
    bytes_in: int = 0  # the client's JSON-RPC request
    bytes_out: int = 0  # the gateway's answer
    outcome: str = "ok"  # ok | tool_error | not_allowed | rate_limited | server_down | server_error | timeout


class UsageRecord(msgspec.Struct, frozen=True, kw_only=True):
    request_id: str  # made by the gateway, never the client's (a client may repeat its own)
    client_request_id: str | None = None  # the client's X-Request-Id, when it sent a plain one
    at: datetime  # when the request arrived
    status: int
    key_id: str | None = None
    project_id: str | None = None
    team_id: str | None = None
    org_id: str | None = None
    user: str | None = None
    model_asked: str = ""
    model_served: str | None = None
    replica_id: str | None = None
    node_id: str | None = None
    endpoint: str = ""
    stream: bool = False
    tokens_in: int = 0
    tokens_out: int = 0
    queue_s: float = 0.0
    ttft_s: float | None = None
    total_s: float = 0.0
    cost_usd: float = 0.0
    error: str | None = None
    router: str = ""
    tool_call: ToolCall | None = None  # set on an MCP tool call's record (endpoint ``/mcp``)


def usage_subject(project_id: str | None) -> str:
    from llmgw.events.schema.subjects import USAGE_ROOT, encode_token

    return f"{USAGE_ROOT}.{encode_token(project_id or 'none')}"
