"""Request bodies as OpenAI's API reference shapes them (openai/openai-openapi, cut into
tests/openapi/openai-subset.yaml), as msgspec Structs: what :mod:`.validation` decodes a body into
before any of it reaches an engine, so a field of the wrong type is a 400 naming it, by
construction, rather than a TypeError somewhere further on.

Types, not completeness: every field the gateway or an engine reads is typed; fields not named here
pass untouched (msgspec ignores unknown fields), since engines take parameters OpenAI does not
(llama.cpp's ``top_k``, ``min_p``, ``grammar``; vLLM's ``guided_json``). The decoded Struct is only a
verdict: the engine is sent the client's own body. Where an engine accepts more than OpenAI (a
number where OpenAI says integer, a part type of vLLM's), the wider type is taken and said so.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# -- chat messages: a tagged union on `role`, their content parts a tagged union on `type` --------


class _Part(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    pass


class TextPart(_Part, tag="text"):
    text: str


class ImageUrl(msgspec.Struct, kw_only=True, frozen=True):
    url: str
    detail: str | None = None


class ImagePart(_Part, tag="image_url"):
    image_url: ImageUrl


class InputAudio(msgspec.Struct, kw_only=True, frozen=True):
    data: str
    format: str


class AudioPart(_Part, tag="input_audio"):
    input_audio: InputAudio


class FileRef(msgspec.Struct, kw_only=True, frozen=True):
    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None


class FilePart(_Part, tag="file"):
    file: FileRef


class RefusalPart(_Part, tag="refusal"):
    refusal: str


class MediaUrl(msgspec.Struct, kw_only=True, frozen=True):
    url: str


# vLLM's own part types (not OpenAI's): refusing them would refuse what a vLLM engine serves.
class AudioUrlPart(_Part, tag="audio_url"):
    audio_url: MediaUrl


class VideoUrlPart(_Part, tag="video_url"):
    video_url: MediaUrl


UserPart = TextPart | ImagePart | AudioPart | FilePart | AudioUrlPart | VideoUrlPart


class FunctionCall(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    arguments: str


class _ToolCall(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    id: str


class FunctionToolCall(_ToolCall, tag="function"):
    function: FunctionCall


class CustomCall(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    input: str


class CustomToolCall(_ToolCall, tag="custom"):
    custom: CustomCall


class AudioRef(msgspec.Struct, kw_only=True, frozen=True):
    id: str


class _Message(msgspec.Struct, tag_field="role", kw_only=True, frozen=True):
    pass


class SystemMessage(_Message, tag="system"):
    content: str | list[TextPart]
    name: str | None = None


class DeveloperMessage(_Message, tag="developer"):
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(_Message, tag="user"):
    content: str | list[UserPart]
    name: str | None = None


class AssistantMessage(_Message, tag="assistant"):
    content: str | list[TextPart | RefusalPart] | None = None
    refusal: str | None = None
    name: str | None = None
    audio: AudioRef | None = None
    tool_calls: list[FunctionToolCall | CustomToolCall] | None = None
    function_call: FunctionCall | None = None


class ToolMessage(_Message, tag="tool"):
    content: str | list[TextPart]
    tool_call_id: str


class FunctionMessage(_Message, tag="function"):
    content: str | None
    name: str


Message = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage
ROLES: tuple[str, ...] = tuple(sorted(m.__struct_config__.tag for m in Message.__args__))  # type: ignore[attr-defined]

# -- tools, tool choice, response format ----------------------------------------------------------


class FunctionDef(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class _Tool(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    pass


class FunctionTool(_Tool, tag="function"):
    function: FunctionDef


class CustomDef(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    description: str | None = None
    format: dict[str, Any] | None = None


class CustomTool(_Tool, tag="custom"):
    custom: CustomDef


class NamedFunction(msgspec.Struct, kw_only=True, frozen=True):
    name: str


class AllowedTools(msgspec.Struct, kw_only=True, frozen=True):
    mode: Literal["auto", "required"]
    tools: list[dict[str, Any]]


class _ToolChoice(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    pass


class FunctionChoice(_ToolChoice, tag="function"):
    function: NamedFunction


class CustomChoice(_ToolChoice, tag="custom"):
    custom: NamedFunction


class AllowedToolsChoice(_ToolChoice, tag="allowed_tools"):
    allowed_tools: AllowedTools


ToolChoice = Literal["none", "auto", "required"] | FunctionChoice | CustomChoice | AllowedToolsChoice


class JsonSchema(msgspec.Struct, kw_only=True, frozen=True):
    # OpenAI requires `name`; llama.cpp and vLLM do not, and clients written for them leave it out.
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class _Format(msgspec.Struct, tag_field="type", kw_only=True, frozen=True):
    pass


class TextFormat(_Format, tag="text"):
    pass


class JsonObjectFormat(_Format, tag="json_object"):
    # llama.cpp's own: a JSON object constrained by this schema.
    schema: dict[str, Any] | None = None


class JsonSchemaFormat(_Format, tag="json_schema"):
    json_schema: JsonSchema


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaFormat


class StreamOptions(msgspec.Struct, kw_only=True, frozen=True):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


# A bias per token id. OpenAI says integers; llama.cpp takes numbers, and pairs [[id, bias], ...].
LogitBias = dict[str, float] | list[Any]

# -- the requests ---------------------------------------------------------------------------------


class _Sampling(msgspec.Struct, kw_only=True, frozen=True):
    """What the chat and completions requests share."""

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    logit_bias: LogitBias | None = None
    user: str | None = None


class ChatRequest(_Sampling, kw_only=True, frozen=True):
    """``POST /v1/chat/completions`` (OpenAI's ``CreateChatCompletionRequest``)."""

    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[FunctionTool | CustomTool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    functions: list[FunctionDef] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class CompletionRequest(_Sampling, kw_only=True, frozen=True):
    """``POST /v1/completions`` (OpenAI's ``CreateCompletionRequest``). ``prompt``: a string, strings,
    token ids, or lists of token ids — which of those a list is, :mod:`.validation` checks."""

    prompt: str | list[Any]
    best_of: int | None = None
    echo: bool | None = None
    logprobs: int | None = None
    suffix: str | None = None


class EmbeddingRequest(msgspec.Struct, kw_only=True, frozen=True):
    """``POST /v1/embeddings`` (OpenAI's ``CreateEmbeddingRequest``); ``input`` as ``prompt`` above."""

    model: str
    input: str | list[Any]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = None
    user: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True, frozen=True):
    """``POST /v1/responses`` (OpenAI's ``CreateResponse``): the fields the translation to a chat
    request reads. Its input items and instructions are judged by the translation
    (:func:`.responses.to_chat`), which serves messages only and says so for any other item."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    instructions: str | list[dict[str, Any]] | None = None
    stream: bool | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None


REQUEST_TYPES: dict[str, type[msgspec.Struct]] = {
    "/v1/chat/completions": ChatRequest,
    "/v1/completions": CompletionRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/responses": ResponsesRequest,
}
