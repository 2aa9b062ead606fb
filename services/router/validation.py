"""What a request body may be before any of it reaches an engine (docs/gateway.md, "Limits on requests").

Pure functions over the raw bytes and the decoded body. Each refusal is an :class:`Invalid` that
names the field, the limit and the value, so the client can fix the request; the gateway turns it
into OpenAI's error shape. Nothing here decodes recursively: the depth of a body is counted over
its bytes before it is decoded, so a body nested 5,000 deep costs one pass, not a stack.
"""

from __future__ import annotations

from itertools import accumulate
from typing import Any

import msgspec


class Invalid(Exception):
    """A request the gateway refuses as it is: status 400 or 413, a code, the field at fault."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        super().__init__(message)


class RequestLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_messages: int
    max_json_depth: int
    max_prompt_tokens: int
    max_output_tokens: int


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

ENDPOINT_INPUT = {"/v1/chat/completions": "messages", "/v1/completions": "prompt", "/v1/embeddings": "input"}


def json_depth(raw: bytes) -> int:
    """How deeply the arrays and objects in ``raw`` nest, counted without decoding or recursion.

    Brackets inside strings do not count. For malformed input the figure is still an upper bound
    of what a decoder would have to descend before it finds the fault."""
    # Inside a string, an escaped backslash or quote is no delimiter: drop them (pairs of backslashes
    # first, as JSON reads them), then every other piece between quotes is outside the strings.
    unescaped = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    outside = b"".join(unescaped.split(b'"')[::2])
    brackets = outside.translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    return max(0, max(accumulate(map(_STEP.__getitem__, brackets))))


def check_depth(raw: bytes, limits: RequestLimits) -> None:
    # Cheap first: a body with fewer brackets than the limit cannot nest past it.
    if raw.count(b"[") + raw.count(b"{") <= limits.max_json_depth:
        return
    depth = json_depth(raw)
    if depth > limits.max_json_depth:
        raise Invalid(
            400,
            f"the body nests arrays and objects {depth} deep; the limit is {limits.max_json_depth}",
            "too_deeply_nested",
        )


def check_body(body: Any, endpoint: str, limits: RequestLimits) -> tuple[dict[str, Any], str]:
    """The decoded body if it may go on to an engine, and its prompt's text (:func:`prompt_text`);
    else :class:`Invalid` saying why."""
    if not isinstance(body, dict):
        raise Invalid(400, "the body must be a JSON object", "invalid_body")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise Invalid(400, "`model` is required and must be a string", "invalid_model", "model")
    need = ENDPOINT_INPUT[endpoint]
    value = body.get(need)
    if endpoint == "/v1/chat/completions":
        if not isinstance(value, list) or not value or not all(isinstance(m, dict) for m in value):
            raise Invalid(400, "`messages` must be a non-empty list of message objects", "invalid_messages", need)
        if len(value) > limits.max_messages:
            raise Invalid(
                413,
                f"the request has {len(value)} messages; the limit is {limits.max_messages} per request",
                "too_many_messages",
                need,
            )
        for i, m in enumerate(value):
            # An engine given a role it does not know may ignore the message or generate until max_tokens.
            if m.get("role") not in ROLES:
                raise Invalid(
                    400,
                    f"messages[{i}].role is {m.get('role')!r}; it must be one of {', '.join(sorted(ROLES))}",
                    "invalid_role",
                    f"messages[{i}].role",
                )
    elif not isinstance(value, str | list) or (isinstance(value, list) and not value):
        raise Invalid(400, f"`{need}` must be a string or a non-empty list", f"invalid_{need}", need)
    elif isinstance(value, list) and len(value) > limits.max_messages and not _token_ids(value):
        # Several prompts in one request (a batch); one prompt given as token ids is counted in tokens.
        raise Invalid(
            413,
            f"`{need}` has {len(value)} items; the limit is {limits.max_messages} per request",
            f"too_many_{need}s",
            need,
        )
    if "stream" in body and not isinstance(body["stream"], bool):
        raise Invalid(400, "`stream` must be true or false", "invalid_stream", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise Invalid(
            400,
            f'`stream_options` must be an object such as {{"include_usage": true}}, not {type(options).__name__}',
            "invalid_stream_options",
            "stream_options",
        )
    for field in ("max_tokens", "max_completion_tokens"):
        v = body.get(field)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise Invalid(400, f"`{field}` must be a positive integer", f"invalid_{field}", field)
        if v > limits.max_output_tokens:
            raise Invalid(
                400,
                f"`{field}` is {v}; this gateway allows at most {limits.max_output_tokens} output tokens per request",
                "max_tokens_too_large",
                field,
            )
    text = prompt_text(body, endpoint)
    bound = max_prompt_tokens(body, endpoint, text)
    if bound > limits.max_prompt_tokens:
        raise Invalid(
            413,
            f"the prompt may be up to {bound} tokens (counted as one per byte plus 16 per message); "
            f"the limit is {limits.max_prompt_tokens} tokens per request",
            "prompt_too_long",
            need,
        )
    return body, text


def prompt_text(body: dict[str, Any], endpoint: str) -> str:
    """The text of the prompt, for estimates and prefix affinity; parts that are not text are left out."""
    if endpoint == "/v1/chat/completions":
        parts = []
        for m in body.get("messages", []):
            c = m.get("content")
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):
                parts.extend(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
        return "\n".join(parts)
    value = body.get("prompt" if endpoint == "/v1/completions" else "input")
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return "\n".join(v for v in value if isinstance(v, str))
    return ""


def max_prompt_tokens(body: dict[str, Any], endpoint: str, text: str | None = None) -> int:
    """An upper bound on the prompt's tokens, without a tokenizer: a token covers at least one byte,
    and a chat template adds a few special tokens per message. Budgets reserve with it, so a request
    can never cost more than was held for it. ``text``: the prompt's, when already found."""
    if text is None:
        text = prompt_text(body, endpoint)
    messages = body.get("messages")
    per_message = 16 * (len(messages) if isinstance(messages, list) else 1)
    value = body.get("prompt" if endpoint == "/v1/completions" else "input")
    ids = 0
    if isinstance(value, list):
        ids = sum(len(v) if isinstance(v, list) else 1 for v in value if isinstance(v, int | list))
    return len(text.encode(errors="replace")) + ids + per_message + 16


def _token_ids(value: list[Any]) -> bool:
    return all(isinstance(v, int) and not isinstance(v, bool) for v in value)
