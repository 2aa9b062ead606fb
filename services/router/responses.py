"""The Responses API (`POST /v1/responses`, GW-1) as current SDKs and agent frameworks call it, over the
chat engines.

A translation, not a second request path: the body becomes a chat completion request, which goes
through the gateway's own path — key, limits, budget, queue, routing, usage record — on a private
unix socket of this router (so nothing is counted twice or skipped), and the chat answer becomes a
response object, or, streamed, the Responses API's server-sent events. :func:`to_chat`,
:func:`from_chat` and :class:`StreamTranslator` are pure; :class:`ResponsesApi` is the thin I/O.

Stateless: ``previous_response_id``, ``conversation`` and tools llmgw does not run are refused with
what to send instead; ``store`` is accepted and nothing is stored.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from llmgw.events.schema.ids import new_id
from llmgw.services.router.validation import Invalid, check_responses

_enc = msgspec.json.Encoder()
SOCKET_NAME = "gateway.sock"
# Chat request fields with the same meaning under the same name.
_SAME = ("temperature", "top_p", "user", "metadata", "parallel_tool_calls", "tool_choice")


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


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request that serves a Responses API request. Raises :class:`ResponsesError`."""
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise ResponsesError("model is required: the name of a model in `GET /v1/models`", "model", "missing_required")
    for field in ("previous_response_id", "conversation"):
        if body.get(field):
            raise ResponsesError(
                f"{field} is not supported: llmgw keeps no responses; send the earlier turns in input", field
            )
    if body.get("tools"):
        raise ResponsesError(
            "tools are not supported on /v1/responses: use /v1/chat/completions, which passes tools through",
            "tools",
        )
    messages: list[dict[str, str]] = []
    instructions = body.get("instructions")
    if instructions:
        messages.append({"role": "system", "content": _text_of(instructions, "instructions")})
    given = body.get("input")
    if isinstance(given, str):
        messages.append({"role": "user", "content": given})
    elif isinstance(given, list):
        for i, item in enumerate(given):
            if not isinstance(item, dict):
                raise ResponsesError(f"input[{i}] must be an object (a message)", "input")
            kind = item.get("type", "message")
            if kind != "message":
                raise ResponsesError(f"input[{i}] is of type {kind!r}: only messages are supported", "input")
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise ResponsesError(
                    f"input[{i}].role must be user, assistant, system or developer (got {role!r})", "input"
                )
            chat_role = "system" if role == "developer" else role
            messages.append({"role": chat_role, "content": _text_of(item.get("content", ""), f"input[{i}]")})
    else:
        raise ResponsesError("input is required: a string, or a list of messages", "input", "missing_required")
    chat: dict[str, Any] = {"model": body["model"], "messages": messages, "stream": bool(body.get("stream"))}
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    for field in _SAME:
        if body.get(field) is not None:
            chat[field] = body[field]
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


def response_object(
    response_id: str,
    message_id: str,
    body: dict[str, Any],
    created: int,
    *,
    status: str,
    text: str = "",
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
        "output": [_message(message_id, text, "completed")] if status != "in_progress" else [],
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": None,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "usage": usage,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
        "store": bool(body.get("store", True)),
    }


def from_chat(chat: dict[str, Any], body: dict[str, Any], response_id: str, message_id: str) -> dict[str, Any]:
    """The response object for a whole chat completion."""
    choice = (chat.get("choices") or [{}])[0]
    text = (choice.get("message") or {}).get("content") or ""
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    return response_object(
        response_id,
        message_id,
        body,
        int(chat.get("created") or time.time()),
        status=status,
        text=text,
        usage=_usage(chat.get("usage")),
        model=chat.get("model"),
    )


class StreamTranslator:
    """Chat completion chunks in, the Responses API's stream events out (each a dict with its ``type``
    and ``sequence_number``)."""

    def __init__(self, body: dict[str, Any], response_id: str, message_id: str, created: int) -> None:
        self.body, self.id, self.message_id, self.created = body, response_id, message_id, created
        self.text: list[str] = []
        self.usage: dict[str, Any] | None = None
        self.model: str | None = None
        self.finish: str | None = None
        self.seq = 0

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _response(self, status: str) -> dict[str, Any]:
        return response_object(
            self.id,
            self.message_id,
            self.body,
            self.created,
            status=status,
            text="".join(self.text),
            usage=self.usage,
            model=self.model,
        )

    def start(self) -> Iterator[dict[str, Any]]:
        yield self._event("response.created", response=self._response("in_progress"))
        yield self._event("response.in_progress", response=self._response("in_progress"))
        yield self._event(
            "response.output_item.added", output_index=0, item=_message(self.message_id, "", "in_progress")
        )
        part = {"type": "output_text", "text": "", "annotations": []}
        yield self._event(
            "response.content_part.added", item_id=self.message_id, output_index=0, content_index=0, part=part
        )

    def chunk(self, chunk: dict[str, Any]) -> Iterator[dict[str, Any]]:
        self.model = chunk.get("model") or self.model
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        for choice in chunk.get("choices") or []:
            delta = (choice.get("delta") or {}).get("content")
            if delta:
                self.text.append(delta)
                yield self._event(
                    "response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0, delta=delta
                )
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]

    def end(self) -> Iterator[dict[str, Any]]:
        text = "".join(self.text)
        yield self._event(
            "response.output_text.done", item_id=self.message_id, output_index=0, content_index=0, text=text
        )
        part = {"type": "output_text", "text": text, "annotations": []}
        yield self._event(
            "response.content_part.done", item_id=self.message_id, output_index=0, content_index=0, part=part
        )
        yield self._event(
            "response.output_item.done", output_index=0, item=_message(self.message_id, text, "completed")
        )
        status = "incomplete" if self.finish == "length" else "completed"
        yield self._event(f"response.{status}", response=self._response(status))


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + _enc.encode(event) + b"\n\n"


# Headers of the client's request the chat request carries on (the key, the client's id, a trace).
_FORWARDED = ("authorization", "x-request-id", "traceparent", "tracestate")


class ResponsesApi:
    """``POST /v1/responses``: the body translated, sent along the gateway's own chat path over a unix
    socket only this process can reach, the answer translated back."""

    def __init__(self, max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes
        self.dir = Path(tempfile.mkdtemp(prefix="llmgw-gateway-"))
        os.chmod(self.dir, 0o700)
        self.socket = self.dir / SOCKET_NAME
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None

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

    async def handle(self, request: web.Request) -> web.StreamResponse:
        try:
            body = msgspec.json.decode(await request.read())
            if not isinstance(body, dict):
                raise ResponsesError("the body must be a JSON object", None, "invalid_json")
            check_responses(body)
            chat = to_chat(body)
        except msgspec.DecodeError as exc:
            return ResponsesError(f"the body is not JSON: {exc}", None, "invalid_json").response()
        except RecursionError:  # past the decoder's stack; the chat path counts depth, this decode comes first
            return ResponsesError("the body nests too deeply to decode", None, "too_deeply_nested").response()
        except Invalid as exc:
            return ResponsesError(exc.message, exc.param, exc.code).response()
        except ResponsesError as exc:
            return exc.response()
        assert self._session is not None, "the Responses API is used before the router started"
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARDED}
        headers["Content-Type"] = "application/json"
        response_id, message_id = f"resp_{new_id()}", f"msg_{new_id()}"
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
                return web.json_response(answer, headers=passed)
            return await self._stream(request, upstream, body, response_id, message_id, passed)

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        body: dict[str, Any],
        response_id: str,
        message_id: str,
        passed: dict[str, str],
    ) -> web.StreamResponse:
        out = web.StreamResponse(headers={**passed, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await out.prepare(request)
        translator = StreamTranslator(body, response_id, message_id, int(time.time()))
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
        for event in translator.end():
            await out.write(_sse(event))
        await out.write_eof()
        return out
