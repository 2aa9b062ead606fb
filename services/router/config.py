"""The router's settings (docs/gateway.md names each)."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True):
    first_token_s: float = 60.0
    idle_s: float = 30.0
    total_s: float = 600.0
    connect_s: float = 5.0
    max_body_bytes: int = 4 * 1024 * 1024
    activation_s: float = 60.0  # how long a request waits for an on-demand replica
    default_max_tokens: int = 4096  # what a request without max_tokens may cost, for budgets
    saturation: int = 4  # a replica's slots when its profile does not say `parallel` (llama.cpp's default)
    # Requests wait in the gateway when every ready replica of their model is saturated, served
    # round-robin by project as slots free (docs/gateway.md, "The queue").
    queue: bool = True  # requests wait in the gateway while every replica is saturated (false: in the engines)
    queue_max_per_model: int = 256  # requests waiting for one model; past it 429 `queue_full`
    queue_max_per_project: int = 64  # requests of one project waiting for one model; past it 429 `queue_full`
    queue_wait_s: float = 30.0  # the longest a request waits for a slot; then 503 `queue_timeout`
    queue_report_s: float = 1.0  # how often what waits here is told to the schedulers (load for autoscaling)
    gossip_s: float = 0.1
    max_attempts: int = 3
    # Limits on what reaches an engine (docs/gateway.md, "Limits on requests").
    max_messages: int = 2048  # messages (or batched prompts/inputs) in one request
    max_json_depth: int = 64  # how deeply arrays and objects in a body may nest
    max_prompt_tokens: int = 1_048_576  # the prompt's upper-bound estimate: one token per byte + 16 per message
    max_output_tokens: int = 131_072  # max_tokens / max_completion_tokens above this are refused
    # A connection that has not sent a whole request head within header_s is closed (also the idle
    # keep-alive timeout); a body that has not arrived within body_s is answered 408.
    header_s: float = 10.0
    body_s: float = 30.0
    # usage records the bus has not acknowledged go to this directory (None: memory only, see docs/usage.md)
    usage_journal: str | None = None
    usage_memory_records: int = 10_000  # held in memory before they go to the journal
    # while the bus does not acknowledge and the disk is full: strict refuses billable requests at once
    # (no answer whose usage record lives only in memory); available serves on, up to
    # usage_memory_records held in memory only (docs/usage.md, "A full disk")
    usage_mode: Literal["strict", "available"] = "strict"
    # room preallocated on the journal's disk for the usage records of requests in progress when it
    # fills (up to 1.5 times this; about 450 bytes a record)
    usage_reserve_bytes: Annotated[int, msgspec.Meta(ge=4096)] = 1 << 20
    usage_ack_timeout_s: float = 5.0  # a usage record not acknowledged within this is retried
    # Traces (GW-9): OTLP/HTTP spans of each request to this collector URL (http://host:4318/v1/traces);
    # None: off. A trace a client did not start is kept at this ratio (1: every one, 0: off).
    trace_endpoint: str | None = None
    trace_sample_ratio: float = 1.0
    trace_export_delay_s: float = 2.0  # spans are batched and sent at most this long after they end
    # how long a stored response of /v1/responses is kept (docs/gateway.md, "The Responses API")
    response_ttl_s: Annotated[float, msgspec.Meta(gt=0)] = 30 * 86400.0
    # the most bytes a stored response takes with the conversation before it; a larger one is answered, not stored
    response_max_bytes: Annotated[int, msgspec.Meta(ge=1024, le=1_000_000)] = 1_000_000
    # how long a read or write of the stored responses waits for NATS (then 503, or answered unstored)
    response_store_timeout_s: Annotated[float, msgspec.Meta(gt=0)] = 2.0
