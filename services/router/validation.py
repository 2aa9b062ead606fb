"""What a request body may be before any of it reaches an engine (docs/gateway.md, "Limits on requests").

Pure functions over the raw bytes and the decoded body. The body is judged by its type first: it
is converted to the Struct shaped like OpenAI's schema for its endpoint (:mod:`.openai_types`), so a
field of the wrong type anywhere is refused naming it (``messages[0].role``), then by the limits.
Each refusal is an :class:`Invalid` that names the field, the limit and the value, so the client
can fix the request; the gateway turns it into OpenAI's error shape. The depth of a body is counted
over its bytes before it is decoded, so a body nested 5,000 deep costs one pass, not a stack.
"""

from __future__ import annotations

import functools
import re
from itertools import accumulate
from typing import Any

import msgspec
import msgspec.inspect

from llmgw.services.router.openai_types import REQUEST_TYPES, ROLES


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
    else :class:`Invalid` saying why. The body is judged by its type in :mod:`.openai_types` first
    (:func:`typed`), then by the limits; it is returned as the client sent it."""
    if not isinstance(body, dict):
        raise Invalid(400, "the body must be a JSON object", "invalid_body")
    need = ENDPOINT_INPUT[endpoint]
    value = body.get(need)
    if endpoint == "/v1/chat/completions" and isinstance(value, list) and len(value) > limits.max_messages:
        # Counted before the typed decode: a refusal by count needs no look at each message.
        raise Invalid(
            413,
            f"the request has {len(value)} messages; the limit is {limits.max_messages} per request",
            "too_many_messages",
            need,
        )
    request = typed(body, endpoint)
    if not request.model:  # type: ignore[attr-defined]
        raise Invalid(400, "`model` is required and must be a string", "invalid_model", "model")
    if isinstance(value, list) and not value:
        raise Invalid(400, f"`{need}` must not be an empty list", f"invalid_{need}", need)
    if endpoint != "/v1/chat/completions" and isinstance(value, list):
        ids = _prompt_list(value, need)
        if len(value) > limits.max_messages and not ids:
            # Several prompts in one request (a batch); one prompt given as token ids is counted in tokens.
            raise Invalid(
                413,
                f"`{need}` has {len(value)} items; the limit is {limits.max_messages} per request",
                f"too_many_{need}s",
                need,
            )
    for field in ("max_tokens", "max_completion_tokens"):
        v = getattr(request, field, None)
        if v is None:
            continue
        if v < 1:
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


def typed(body: dict[str, Any], endpoint: str) -> msgspec.Struct:
    """``body`` as the Struct of ``endpoint``'s request (:data:`.openai_types.REQUEST_TYPES`), or
    :class:`Invalid` (400) naming the field at fault as OpenAI's ``param`` does (``messages[0].role``)."""
    kind = REQUEST_TYPES[endpoint]
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        raise _invalid(str(exc), body, kind) from None


def _invalid(error: str, body: dict[str, Any], kind: type[msgspec.Struct]) -> Invalid:
    """msgspec's ``Expected `str`, got `int` - at `$.messages[0].content``` as an :class:`Invalid`."""
    what, _, where = error.partition(" - at `")
    segments = _segments(where.rstrip("`"))
    missing = _MISSING.match(what)
    if missing:
        segments.append(missing[1])
    of_map = "..." in segments
    if of_map:  # a value in a map: msgspec does not say under which key; the map is named
        segments = segments[: segments.index("...")]
    param = _param(segments)
    if param is None:
        return Invalid(400, f"the body must be a JSON object of OpenAI's shape: {what}", "invalid_body")
    code = f"invalid_{segments[0]}"
    found, value = _value_at(body, segments)
    if _ROLE.fullmatch(param):
        said = repr(value) if found else "missing"
        return Invalid(400, f"{param} is {said}; it must be one of {', '.join(ROLES)}", "invalid_role", param)
    if missing:
        return Invalid(400, f"`{param}` is required", code, param)
    if what.startswith(("Invalid value", "Invalid enum value")):
        allowed = _allowed(_type_info(kind), segments, body)
        one_of = f"; it must be one of {', '.join(allowed)}" if allowed else ""
        return Invalid(400, f"`{param}` is {value!r}{one_of}", code, param)
    expected = _EXPECTED.match(what)
    if expected and of_map:
        return Invalid(400, f"the values of `{param}` must be `{expected[1]}`", code, param)
    if expected:
        return Invalid(400, f"`{param}` must be `{expected[1]}`, not `{_json_kind(value)}`", code, param)
    return Invalid(400, f"`{param}`: {what}", code, param)


_MISSING = re.compile(r"Object missing required field `([^`]+)`")
_EXPECTED = re.compile(r"Expected `([^`]+)`")
_ROLE = re.compile(r"messages\[\d+\]\.role")
_SEGMENT = re.compile(r"\.([^.\[]+)|\[(\d+)\]|\[(\.\.\.)\]")


def _segments(path: str) -> list[str | int]:
    """``$.messages[0].role`` as ``["messages", 0, "role"]``; a map's key (``[...]``) as ``"..."``."""
    out: list[str | int] = []
    for name, index, key in _SEGMENT.findall(path.removeprefix("$")):
        out.append(name or key if not index else int(index))
    return out


def _param(segments: list[str | int]) -> str | None:
    if not segments:
        return None
    return "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in segments).lstrip(".")


def _value_at(body: Any, segments: list[str | int]) -> tuple[bool, Any]:
    value = body
    for s in segments:
        if isinstance(s, int) and isinstance(value, list) and s < len(value):
            value = value[s]
        elif isinstance(s, str) and isinstance(value, dict) and s in value:
            value = value[s]
        else:
            return False, None
    return True, value


def _json_kind(value: Any) -> str:
    return _KINDS.get(type(value), type(value).__name__)


_KINDS = {dict: "object", list: "array", str: "str", int: "int", float: "float", bool: "bool", type(None): "null"}


@functools.cache
def _type_info(kind: type[msgspec.Struct]) -> msgspec.inspect.Type:
    # Built on the first refusal that lists allowed values, once per type: most requests never need it.
    return msgspec.inspect.type_info(kind)


def _flat(types: list[Any]) -> list[Any]:
    out: list[Any] = []
    for t in types:
        out.extend(_flat(list(t.types)) if isinstance(t, msgspec.inspect.UnionType) else [t])
    return out


def _allowed(info: msgspec.inspect.Type, segments: list[str | int], body: Any) -> list[str]:
    """The values the field at ``segments`` may take: the tags of the tagged union it is the tag of,
    or its literal values. A union is narrowed by the tag the body gives it on the way down, so a
    user message's parts are not listed with an assistant's."""
    types, value = [info], body
    for i, seg in enumerate(segments):
        flat = _flat(types)
        structs = [t for t in flat if isinstance(t, msgspec.inspect.StructType)]
        if isinstance(value, dict):
            chosen = [t for t in structs if t.tag_field is not None and value.get(t.tag_field) == t.tag]
            structs = chosen or structs
        if i == len(segments) - 1:
            allowed = [str(t.tag) for t in structs if t.tag_field == seg]
            for t in structs:
                for f in t.fields:
                    if f.name == seg:
                        allowed += [
                            str(v)
                            for u in _flat([f.type])
                            if isinstance(u, msgspec.inspect.LiteralType)
                            for v in u.values
                        ]
            return sorted(set(allowed))
        nxt: list[Any] = []
        for t in flat:
            if isinstance(seg, int) and isinstance(t, msgspec.inspect.ListType):
                nxt.append(t.item_type)
        nxt += [f.type for t in structs for f in t.fields if f.name == seg]
        types = nxt
        value = _value_at(value, [seg])[1]
    return []


def _prompt_list(value: list[Any], need: str) -> bool:
    """Whether a ``prompt``/``input`` list is one prompt's token ids (else a batch of strings or of
    token id lists); :class:`Invalid` naming the item when it is none of OpenAI's four shapes."""
    first = value[0]
    shape: Any = list[str] if isinstance(first, str) else list[int] if _is_int(first) else list[list[int]]
    try:
        msgspec.convert(value, shape)
    except msgspec.ValidationError as exc:
        where = _segments(str(exc).partition(" - at `")[2].rstrip("`"))
        param = _param([need, *where])
        item = _json_kind(_value_at(value, where)[1])
        raise Invalid(
            400,
            f"`{need}` must be a string, a list of strings, a list of token ids or a list of lists of token ids; "
            f"`{param}` is {item} in a list whose first item is {_json_kind(first)}",
            f"invalid_{need}",
            param,
        ) from None
    return _is_int(first)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def check_responses(body: dict[str, Any]) -> None:
    """A ``/v1/responses`` body's fields have OpenAI's types; :class:`Invalid` (400) naming the one
    that does not. Its input items are the translation's to judge."""
    typed(body, "/v1/responses")


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
