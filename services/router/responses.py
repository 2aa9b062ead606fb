"""The Responses API (`POST /v1/responses`, GW-1) as current SDKs and agent frameworks call it, over the
chat engines.

A translation, not a second request path: the body becomes a chat completion request, which goes
through the gateway's own path — key, limits, budget, queue, routing, usage record — on a private
unix socket of this router (so nothing is counted twice or skipped), and the chat answer becomes a
response object, or, streamed, the Responses API's server-sent events. :func:`to_chat`,
:func:`from_chat` and :class:`StreamTranslator` are pure; :class:`ResponsesApi` is the thin I/O.

Function tools become chat tools and the chat answer's tool calls ``function_call`` items;
``function_call`` and ``function_call_output`` input items become the assistant's tool calls and
tool-role messages. With ``store`` (the default, as OpenAI's) a response is kept for the key's
project (:mod:`.response_store`), and ``previous_response_id`` puts the earlier responses' inputs and
outputs before the input. ``conversation`` and tools llmgw does not run are refused with what to
send instead.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import structlog
from aiohttp import web
from nats.js import JetStreamContext

from llmgw.events.schema.ids import new_id
from llmgw.services.router.config import RouterConfig
from llmgw.services.router.errors import ApiError, id_headers
from llmgw.services.router.response_store import ResponseStore, StoredResponse, StoreUnavailable, page
from llmgw.services.router.state import KeyInfo
from llmgw.services.router.validation import Invalid, check_responses

log = structlog.get_logger("llmgw.router")

_enc = msgspec.json.Encoder()
SOCKET_NAME = "gateway.sock"
# Chat request fields with the same meaning under the same name.
_SAME = ("temperature", "top_p", "user", "metadata", "parallel_tool_calls")
# Chat request fields the Responses API lacks, passed on when a client sends them (the SDKs' extra_body):
# llama.cpp and vLLM take them, and they steer a small model as its chat request could.
_CHAT_EXTENSIONS = ("logit_bias", "seed")


class ResponsesError(Exception):
    """A request the translation refuses: 400 in OpenAI's error shape, naming the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "unsupported_parameter") -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def response(self) -> web.Response:
        error = {"message": self.message, "type": "invalid_request_error", "param": self.param, "code": self.code}
        return web.json_response({"error": error}, status=400)


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts (``input_text``/``output_text``/``text``)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for i, part in enumerate(content):
            if not isinstance(part, dict):
                raise ResponsesError(f"{where}.content[{i}] must be an object with a type", f"{where}.content")
            kind = part.get("type")
            if kind in ("input_text", "output_text", "text"):
                out.append(str(part.get("text", "")))
            else:
                raise ResponsesError(
                    f"{where}.content[{i}] is {kind!r}: llmgw's engines take text only (input_text)",
                    f"{where}.content",
                )
        return "".join(out)
    raise ResponsesError(f"{where}.content must be a string or a list of input_text parts", f"{where}.content")


def input_items(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's ``input`` as a list of items (a string is one user message)."""
    given = body.get("input")
    if isinstance(given, str):
        return [{"type": "message", "role": "user", "content": given}]
    if isinstance(given, list):
        return given
    raise ResponsesError("input is required: a string, or a list of items", "input", "missing_required")


def _string(item: dict[str, Any], field: str, where: str) -> str:
    value = item.get(field)
    if not isinstance(value, str) or (field != "arguments" and not value):
        raise ResponsesError(f"{where}.{field} must be a non-empty string", f"{where}.{field}")
    return value


def _messages(items: list[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    """Responses items as chat messages: ``function_call`` items become an assistant message's
    ``tool_calls`` (those of one turn in one message, as the chat API has them), and
    ``function_call_output`` items tool-role messages."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"{label}[{i}]"
        if not isinstance(item, dict):
            raise ResponsesError(f"{where} must be an object (a message or a function call's item)", label)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ResponsesError(f"{where}.role must be user, assistant, system or developer (got {role!r})", label)
            chat_role = "system" if role == "developer" else role
            messages.append({"role": chat_role, "content": _text_of(item.get("content", ""), where)})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where), "content": text})
        else:
            raise ResponsesError(
                f"{where} is of type {kind!r}: llmgw serves message, function_call and function_call_output items",
                label,
            )
    return messages


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Function tools (Responses' flat shape) as chat tools; any other tool is one llmgw does not run."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ResponsesError(
                f"tools[{i}] is of type {kind!r}, a tool llmgw does not run: only function tools (type function, "
                "run by your code and answered with a function_call_output item) are served",
                "tools",
            )
        fn = dict(tool["function"]) if isinstance(tool.get("function"), dict) else {}  # the chat shape, accepted too
        for field in ("name", "description", "parameters", "strict"):
            if tool.get(field) is not None:
                fn[field] = tool[field]
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ResponsesError(f"tools[{i}].name is required: the function's name", f"tools[{i}].name")
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice in ("auto", "required", "none"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ResponsesError(
        f'tool_choice must be "auto", "required", "none" or {{"type": "function", "name": ...}} (got {choice!r})',
        "tool_choice",
    )


def to_chat(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat completion request that serves a Responses API request; ``history``: the items of its
    previous responses (their inputs and outputs), which come before its input. Raises
    :class:`ResponsesError`."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise ResponsesError("model is required: the name of a model in `GET /v1/models`", "model", "missing_required")
    if body.get("conversation"):
        raise ResponsesError(
            "conversation is not supported: llmgw keeps responses, not conversations; "
            "chain them with previous_response_id",
            "conversation",
        )
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": _text_of(instructions, "instructions")})
    if history:
        messages += _messages(history, "previous_response_id")
    messages += _messages(input_items(body), "input")
    chat: dict[str, Any] = {"model": body["model"], "messages": messages, "stream": bool(body.get("stream"))}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for field in (*_SAME, *_CHAT_EXTENSIONS):
        if body.get(field) is not None:
            chat[field] = body[field]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    if chat["stream"]:
        chat["stream_options"] = {"include_usage": True}
    return chat


def _usage(chat_usage: dict[str, Any] | None) -> dict[str, Any] | None:
    if not chat_usage:
        return None
    given, made = int(chat_usage.get("prompt_tokens", 0)), int(chat_usage.get("completion_tokens", 0))
    return {
        "input_tokens": given,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": made,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": given + made,
    }


def _message(message_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": message_id,
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else [],
    }


def _function_call(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _call_ids(response_id: str, i: int, given: Any) -> tuple[str, str]:
    """(the item's id, the call id) of the response's ``i``-th function call; the engine's call id kept."""
    base = response_id.removeprefix("resp_")
    return f"fc_{base}_{i}", given if isinstance(given, str) and given else f"call_{base}_{i}"


def response_object(
    response_id: str,
    body: dict[str, Any],
    created: int,
    *,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """A response object as the API returns it (``status``: in_progress, completed or incomplete)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": model or body.get("model"),
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": usage,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
        "store": bool(body.get("store", True)),
    }


def from_chat(chat: dict[str, Any], body: dict[str, Any], response_id: str, message_id: str) -> dict[str, Any]:
    """The response object for a whole chat completion: its text a message item, its tool calls
    ``function_call`` items."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    text = message.get("content") or ""
    calls = message.get("tool_calls") or []
    output = [_message(message_id, text, "completed")] if text or not calls else []
    for i, call in enumerate(calls):
        fn = call.get("function") or {}
        item_id, call_id = _call_ids(response_id, i, call.get("id"))
        output.append(_function_call(item_id, call_id, fn.get("name") or "", fn.get("arguments") or "", "completed"))
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    return response_object(
        response_id,
        body,
        int(chat.get("created") or time.time()),
        status=status,
        output=output,
        usage=_usage(chat.get("usage")),
        model=chat.get("model"),
    )


class StreamTranslator:
    """Chat completion chunks in, the Responses API's stream events out (each a dict with its ``type``
    and ``sequence_number``). An output item opens when its first delta comes (the text's message, or
    a tool call by its index) and all close at the end, in the order they opened."""

    def __init__(self, body: dict[str, Any], response_id: str, message_id: str, created: int) -> None:
        self.body, self.id, self.message_id, self.created = body, response_id, message_id, created
        self.items: list[dict[str, Any]] = []  # the output items, in progress, in output order
        self.text: list[str] = []
        self.message_index: int | None = None
        self.calls: dict[int, int] = {}  # the chat tool call's index -> its output index
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None
        self.finish: str | None = None
        self.seq = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _done_items(self) -> list[dict[str, Any]]:
        out = []
        for item in self.items:
            if item["type"] == "message":
                out.append(_message(self.message_id, "".join(self.text), "completed"))
            else:
                out.append({**item, "status": "completed"})
        return out

    def response(self, status: str) -> dict[str, Any]:
        """The response object as it stands (``in_progress``: no output yet)."""
        output = [] if status == "in_progress" else self._done_items()
        return response_object(
            self.id, self.body, self.created, status=status, output=output, usage=self.usage, model=self.model
        )

    @property
    def status(self) -> str:
        return "incomplete" if self.finish == "length" else "completed"

    def start(self) -> Iterator[dict[str, Any]]:
        yield self._event("response.created", response=self.response("in_progress"))
        yield self._event("response.in_progress", response=self.response("in_progress"))

    def _open_message(self) -> Iterator[dict[str, Any]]:
        self.message_index = len(self.items)
        self.items.append(_message(self.message_id, "", "in_progress"))
        yield self._event(
            "response.output_item.added", output_index=self.message_index, item=self.items[self.message_index]
        )
        part = {"type": "output_text", "text": "", "annotations": []}
        yield self._event(
            "response.content_part.added",
            item_id=self.message_id,
            output_index=self.message_index,
            content_index=0,
            part=part,
        )

    def _tool_delta(self, delta: dict[str, Any]) -> Iterator[dict[str, Any]]:
        index = delta.get("index", 0)
        fn = delta.get("function") or {}
        if index not in self.calls:
            item_id, call_id = _call_ids(self.id, len(self.calls), delta.get("id"))
            self.calls[index] = len(self.items)
            self.items.append(_function_call(item_id, call_id, fn.get("name") or "", "", "in_progress"))
            yield self._event("response.output_item.added", output_index=self.calls[index], item=dict(self.items[-1]))
        elif fn.get("name"):
            self.items[self.calls[index]]["name"] += fn["name"]
        item = self.items[self.calls[index]]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            yield self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=self.calls[index],
                delta=fn["arguments"],
            )

    def chunk(self, chunk: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self.model = chunk.get("model") or self.model
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                if self.message_index is None:
                    yield from self._open_message()
                self.text.append(delta["content"])
                yield self._event(
                    "response.output_text.delta",
                    item_id=self.message_id,
                    output_index=self.message_index,
                    content_index=0,
                    delta=delta["content"],
                )
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    yield from self._tool_delta(call)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def close_items(self) -> Iterator[dict[str, Any]]:
        """The events that end each output item (an answer with nothing in it is an empty message)."""
        if not self.items:
            yield from self._open_message()
        for index, item in enumerate(self._done_items()):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                yield self._event(
                    "response.output_text.done", item_id=item["id"], output_index=index, content_index=0, text=text
                )
                part = {"type": "output_text", "text": text, "annotations": []}
                yield self._event(
                    "response.content_part.done", item_id=item["id"], output_index=index, content_index=0, part=part
                )
            else:
                yield self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            yield self._event("response.output_item.done", output_index=index, item=item)

    def final(self, response: dict[str, Any]) -> dict[str, Any]:
        """The last event: ``response.completed`` (or ``.incomplete``) with the whole response."""
        return self._event(f"response.{response['status']}", response=response)

    def end(self) -> Iterator[dict[str, Any]]:
        yield from self.close_items()
        yield self.final(self.response(self.status))


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + _enc.encode(event) + b"\n\n"


# Headers of the client's request the chat request carries on (the key, the client's id, a trace).
_FORWARDED = ("authorization", "x-request-id", "traceparent", "tracestate")
NOT_STORED_HEADER = "x-llmgw-response-not-stored"  # why a response asked to be stored was not


def _with_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as stored and listed by ``input_items``: each with an id and its type, a message's
    text as a list of parts (as OpenAI lists them)."""
    out = []
    for item in items:
        item = {"type": "message", **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        if not item.get("id"):
            prefix = {"function_call": "fc", "function_call_output": "fco"}.get(item["type"], "msg")
            item["id"] = f"{prefix}_{new_id()}"
        out.append(item)
    return out


def _not_found(response_id: str, param: str | None = None) -> ApiError:
    return ApiError(
        404,
        f"no response {response_id!r} for this key's project: it was never stored (store: false), was deleted, "
        "has expired, or belongs to another project",
        "response_not_found",
        param=param,
    )


def _unavailable(exc: StoreUnavailable) -> ApiError:
    return ApiError(503, str(exc), "response_store_unavailable", {"Retry-After": "5"})


class ResponsesApi:
    """``POST /v1/responses``: the body translated, sent along the gateway's own chat path over a unix
    socket only this process can reach, the answer translated back and, with ``store``, kept for the
    key's project; ``GET``/``DELETE /v1/responses/{id}`` and ``GET /v1/responses/{id}/input_items``."""

    def __init__(
        self,
        cfg: RouterConfig,
        js: JetStreamContext,
        authenticate: Callable[[web.Request], KeyInfo],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.max_body_bytes = cfg.max_body_bytes
        self.ttl_s = cfg.response_ttl_s
        self.store = ResponseStore(js, cfg.response_ttl_s, cfg.response_max_bytes, cfg.response_store_timeout_s, clock)
        self.authenticate = authenticate
        self.clock = clock
        self.dir = Path(tempfile.mkdtemp(prefix="llmgw-gateway-"))
        os.chmod(self.dir, 0o700)
        self.socket = self.dir / SOCKET_NAME
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/responses", self.handle)
        app.router.add_get("/v1/responses/{id}", self.retrieve)
        app.router.add_delete("/v1/responses/{id}", self.delete)
        app.router.add_get("/v1/responses/{id}/input_items", self.list_input_items)

    async def start(self, app: web.Application) -> None:
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.UnixSite(self._runner, str(self.socket)).start()
        self._session = aiohttp.ClientSession(
            connector=aiohttp.UnixConnector(path=str(self.socket)),
            timeout=aiohttp.ClientTimeout(total=None),
            auto_decompress=False,
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._runner is not None:
            await self._runner.cleanup()
        with contextlib.suppress(OSError):
            self.socket.unlink(missing_ok=True)
            self.dir.rmdir()

    async def _stored(self, request: web.Request) -> StoredResponse:
        """The stored response the path names, of the key's project; ApiError 401, 404 or 503."""
        key = self.authenticate(request)
        response_id = request.match_info["id"]
        try:
            entry = await self.store.get(key.project_id, response_id)
        except StoreUnavailable as exc:
            raise _unavailable(exc) from exc
        if entry is None:
            raise _not_found(response_id)
        return entry

    async def retrieve(self, request: web.Request) -> web.Response:
        rid = new_id()
        try:
            entry = await self._stored(request)
        except ApiError as exc:
            return exc.response(rid)
        return web.json_response(entry.response, headers=id_headers(rid, None))

    async def delete(self, request: web.Request) -> web.Response:
        rid = new_id()
        try:
            key = self.authenticate(request)
            response_id = request.match_info["id"]
            try:
                deleted = await self.store.delete(key.project_id, response_id)
            except StoreUnavailable as exc:
                raise _unavailable(exc) from exc
            if not deleted:
                raise _not_found(response_id)
        except ApiError as exc:
            return exc.response(rid)
        body = {"id": response_id, "object": "response", "deleted": True}
        return web.json_response(body, headers=id_headers(rid, None))

    async def list_input_items(self, request: web.Request) -> web.Response:
        rid = new_id()
        try:
            order = request.query.get("order", "desc")
            if order not in ("asc", "desc"):
                raise ApiError(400, f"order must be asc or desc (got {order!r})", "invalid_order", param="order")
            limit_text = request.query.get("limit", "20")
            if not limit_text.isdigit() or not 1 <= int(limit_text) <= 100:
                raise ApiError(
                    400,
                    f"limit must be a whole number from 1 to 100 (got {limit_text!r})",
                    "invalid_limit",
                    param="limit",
                )
            entry = await self._stored(request)
        except ApiError as exc:
            return exc.response(rid)
        listed = page(entry.input, order, int(limit_text), request.query.get("after"))  # type: ignore[arg-type]
        return web.json_response(listed, headers=id_headers(rid, None))

    async def handle(self, request: web.Request) -> web.StreamResponse:
        rid = new_id()
        try:
            key = self.authenticate(request)  # the key before the body, as on the chat path
            body = msgspec.json.decode(await request.read())
            if not isinstance(body, dict):
                raise ResponsesError("the body must be a JSON object", None, "invalid_json")
            check_responses(body)
            history: list[dict[str, Any]] = []
            if body.get("previous_response_id"):
                previous_id = body["previous_response_id"]
                try:
                    before = await self.store.get(key.project_id, previous_id)
                except StoreUnavailable as exc:
                    raise _unavailable(exc) from exc
                if before is None:
                    raise _not_found(previous_id, "previous_response_id")
                history = [*before.history, *before.input, *before.response.get("output", [])]
            chat = to_chat(body, history)
        except msgspec.DecodeError as exc:
            return ResponsesError(f"the body is not JSON: {exc}", None, "invalid_json").response()
        except RecursionError:  # past the decoder's stack; the chat path counts depth, this decode comes first
            return ResponsesError("the body nests too deeply to decode", None, "too_deeply_nested").response()
        except Invalid as exc:
            return ResponsesError(exc.message, exc.param, exc.code).response()
        except ResponsesError as exc:
            return exc.response()
        except ApiError as exc:
            return exc.response(rid)
        assert self._session is not None, "the Responses API is used before the router started"
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}
        headers["Content-Type"] = "application/json"
        response_id, message_id = f"resp_{new_id()}", f"msg_{new_id()}"
        turn = _Turn(key.project_id, response_id, history, _with_ids(input_items(body)), bool(body.get("store", True)))
        async with self._session.post(
            "http://gateway/v1/chat/completions", data=_enc.encode(chat), headers=headers
        ) as upstream:
            passed = {k: v for k, v in upstream.headers.items() if k.lower().startswith(("x-", "retry-after"))}
            if upstream.status != 200:  # the gateway's own refusal, already in OpenAI's shape
                return web.Response(
                    status=upstream.status, body=await upstream.read(), content_type="application/json", headers=passed
                )
            if not chat["stream"]:
                answer = from_chat(await upstream.json(), body, response_id, message_id)
                why = await self._keep(turn, answer)
                if why:
                    passed[NOT_STORED_HEADER] = why
                return web.json_response(answer, headers=passed)
            return await self._stream(request, upstream, body, turn, message_id, passed)

    async def _keep(self, turn: _Turn, answer: dict[str, Any]) -> str | None:
        """Store the answer when asked to; why not when it could not be (it is then answered ``store: false``)."""
        if not turn.store:
            return None
        entry = StoredResponse(
            project_id=turn.project_id,
            expires_at=self.clock() + self.ttl_s,
            history=turn.history,
            input=turn.input,
            response=answer,
        )
        why = await self.store.put(turn.response_id, entry)
        if why:
            answer["store"] = False
            log.warning("response not stored", response_id=turn.response_id, reason=why)
        return why

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        body: dict[str, Any],
        turn: _Turn,
        message_id: str,
        passed: dict[str, str],
    ) -> web.StreamResponse:
        out = web.StreamResponse(headers={**passed, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        translator = StreamTranslator(body, turn.response_id, message_id, int(time.time()))
        for event in translator.start():
            await out.write(_sse(event))
        async for raw in upstream.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            try:
                chunk = msgspec.json.decode(data)
            except msgspec.DecodeError:
                continue
            if isinstance(chunk, dict) and "error" in chunk:
                error = {"code": chunk["error"].get("code"), "message": chunk["error"].get("message")}
                await out.write(_sse({"type": "error", "sequence_number": translator.seq, **error}))
                return out
            for event in translator.chunk(chunk):
                await out.write(_sse(event))
        for event in translator.close_items():
            await out.write(_sse(event))
        answer = translator.response(translator.status)
        await self._keep(turn, answer)  # before the last event, so its `store` says whether it was kept
        await out.write(_sse(translator.final(answer)))
        await out.write_eof()
        return out


class _Turn(msgspec.Struct):
    """What storing one response needs besides its answer."""

    project_id: str
    response_id: str
    history: list[dict[str, Any]]
    input: list[dict[str, Any]]
    store: bool
