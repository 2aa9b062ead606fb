"""Tool calls on every engine (issue 26, part 1): the openai SDK with ``tools`` through the gateway to a
real llama.cpp engine, and how engines are started for them.

The engine serves a tiny random-weight GGUF whose chat template supports tools
(:data:`tests.gguf_tiny.TOOL_CHAT_TEMPLATE`). llama.cpp reads the call syntax off that template and,
for ``tool_choice: "required"``, holds the output to it with a grammar; it still lets a model write
text before its first call, which noise weights would do until ``max_tokens``. So the requests lean
the noise towards a call with ``logit_bias`` (the token that opens a call, a closing quote, the end
of the answer), as a model trained on the template leans by itself, and ask for one call at a time
(``parallel_tool_calls: false``: the grammar then ends the answer after it): which tokens the grammar lets
through, and so whether the call is well formed, is llama.cpp's work and the gateway's, not the bias.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from llmgw.agent.engines.commands import vllm_launch, vllm_tool_args, with_chat_templates
from llmgw.agent.engines.xllama_server import ServerArgs, build_params
from llmgw.agent.supervisor import Supervisor, SupervisorConfig
from llmgw.events.schema import models as M
from llmgw.events.schema.replicas import ReplicaPlaced
from llmgw.services.router.tool_choice import named_tool_as_required
from tests.fleet import Fleet
from tests.gguf_tiny import write_tool_gguf
from tests.support import NatsServer, usage_records, wait_until
from tests.test_gateway import make_key, make_tenant
from tests.tool_gateway import leaning_to_a_call, tool_gateway

pytestmark = [pytest.mark.timeout(240)]

KEY = "llmgw-test-engine-key-7d2e4b19"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
    },
}
TOOLS: list[Any] = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


# --- how engines start (pure) ---------------------------------------------------------------------


def _placed(profile: M.Profile) -> ReplicaPlaced:
    return ReplicaPlaced(
        replica_id="r1", model="m", node_id="n1", source="/m/a.gguf", profile=profile, spec_hash="h", gpus=[0]
    )


def _supervisor(tmp_path: Path) -> Supervisor:
    return Supervisor(SupervisorConfig(data_dir=tmp_path, llama_server_binary="/usr/bin/llama-server"), cpus=4)


def test_a_llamacpp_engine_starts_with_jinja_chat_templates_unless_its_profile_says_otherwise(tmp_path: Path) -> None:
    sup = _supervisor(tmp_path)
    default = sup.launch_for(_placed(M.Profile()), 20001, KEY, "/m/a.gguf").argv
    assert default.count("--jinja") == 1
    off = sup.launch_for(_placed(M.Profile(args=["--no-jinja"])), 20001, KEY, "/m/a.gguf").argv
    assert "--no-jinja" in off and "--jinja" not in off
    assert with_chat_templates(["--jinja", "--temp", "0"]) == ["--jinja", "--temp", "0"]


def test_the_xllamacpp_engine_maps_both_jinja_flags_onto_llama_cpp() -> None:
    args = ServerArgs(model="m.gguf", host="h", port=1, threads=1, parallel=1, ctx_size=0)
    assert build_params(msgspec_replace(args, extra=["--no-jinja"]), KEY).use_jinja is False
    assert build_params(msgspec_replace(args, extra=["--jinja"]), KEY).use_jinja is True


def msgspec_replace(args: ServerArgs, **changes: Any) -> ServerArgs:
    import msgspec

    return msgspec.structs.replace(args, **changes)


def test_a_vllm_profile_with_a_tool_parser_starts_vllm_with_auto_tool_choice_and_that_parser(tmp_path: Path) -> None:
    profile = M.Profile(engine="vllm", tool_parser="hermes", gpus=M.GpuRequest(count=1))
    argv = _supervisor(tmp_path).launch_for(_placed(profile), 20001, KEY, "/m/qwen").argv
    at = argv.index("--tool-call-parser")
    assert argv[at + 1] == "hermes" and argv.count("--enable-auto-tool-choice") == 1
    plain = _supervisor(tmp_path).launch_for(_placed(M.Profile(engine="vllm")), 20001, KEY, "/m/qwen").argv
    assert "--tool-call-parser" not in plain and "--enable-auto-tool-choice" not in plain


def test_a_tool_parser_in_the_profiles_own_args_wins_over_its_tool_parser_setting() -> None:
    own = ["--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"]
    argv = vllm_launch(
        "/m/x", host="h", port=1, gpus=[0], tensor_parallel=1, key=KEY, served_name="x", extra_args=own,
        tool_parser="hermes",
    ).argv  # fmt: skip
    assert argv.count("--tool-call-parser") == 1 and argv[argv.index("--tool-call-parser") + 1] == "llama3_json"
    assert vllm_tool_args("mistral", ["--enable-auto-tool-choice"]) == ["--tool-call-parser", "mistral"]
    assert vllm_tool_args(None, []) == []


def test_a_profile_names_its_tool_parser_in_the_catalog_and_older_profiles_read_without_one() -> None:
    import msgspec

    assert msgspec.json.decode(b'{"engine": "vllm"}', type=M.Profile).tool_parser is None
    raw = msgspec.json.encode(M.Profile(engine="vllm", tool_parser="hermes"))
    assert msgspec.json.decode(raw, type=M.Profile).tool_parser == "hermes"


def test_a_named_tool_choice_becomes_that_tool_alone_and_required() -> None:
    body = {
        "model": "m",
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
    }
    sent = named_tool_as_required(body)
    assert sent["tool_choice"] == "required" and sent["tools"] == [TIME]
    assert body["tools"] == TOOLS  # the client's body is left as it was
    for unchanged in (
        {**body, "tool_choice": "auto"},
        {**body, "tool_choice": {"type": "function", "function": {"name": "no_such_tool"}}},
        {**body, "tool_choice": {"type": "function"}},
        {"model": "m", "messages": ASK, "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    ):
        assert named_tool_as_required(unchanged) is unchanged


# --- through the gateway to a real engine ---------------------------------------------------------


@pytest.fixture
def tool_model(tmp_path: Path) -> Path:
    return write_tool_gguf(tmp_path / "tools.gguf")


@pytest.fixture
async def gw(store: Any, nats: NatsServer, tmp_path: Path, tool_model: Path) -> AsyncIterator[Fleet]:
    f = await tool_gateway(store, nats.url, tmp_path, tool_model)
    yield f
    await f.stop()


async def _client(gw: Fleet, project: str = "acme") -> tuple[openai.AsyncOpenAI, str]:
    tenant = await make_tenant(gw.store, project)
    key, _ = await make_key(gw.store, tenant)
    await gw.router_caught_up()
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{gw.port}/v1", api_key=key, max_retries=0), tenant.project


def _valid_for(tool: dict[str, Any], arguments: str) -> dict[str, Any]:
    """The call's arguments, decoded, after checking them against the tool's (flat) JSON schema."""
    args = json.loads(arguments)
    schema = tool["function"]["parameters"]
    assert isinstance(args, dict), arguments
    assert set(schema["required"]) <= set(args) <= set(schema["properties"]), arguments
    for name, value in args.items():
        assert schema["properties"][name]["type"] == "string" and isinstance(value, str), arguments
    return args


async def test_tool_choice_required_and_a_named_function_give_a_parsable_call_and_its_result_is_answered(
    gw: Fleet, tool_model: Path
) -> None:
    c, _ = await _client(gw)
    bias = leaning_to_a_call(tool_model)

    required = await c.chat.completions.create(
        model="tiny-tools",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        logit_bias=bias,
    )
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and not choice.message.content
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    _valid_for(tool, call.function.arguments)

    named = await c.chat.completions.create(
        model="tiny-tools",
        messages=ASK,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        max_tokens=120,
        logit_bias=bias,
    )
    assert named.choices[0].finish_reason == "tool_calls", named.choices[0]
    assert [t.function.name for t in named.choices[0].message.tool_calls or []] == ["get_time"]
    _valid_for(TIME, named.choices[0].message.tool_calls[0].function.arguments)  # type: ignore[index]

    auto = await c.chat.completions.create(
        model="tiny-tools", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=8
    )  # the model's choice: text or a call, either in OpenAI's shape
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")

    # The call and its result go back; the model answers from them (noise text, no call asked for).
    result = "Sunny, 21 degrees, light wind from the west"
    history: list[Any] = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": result},
    ]
    answer = await c.chat.completions.create(model="tiny-tools", messages=history, tools=TOOLS, max_tokens=6)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert not answer.choices[0].message.tool_calls
    # The result is in the prompt the engine read: a token per word at least, over an empty result.
    empty = [*history[:-1], {**history[-1], "content": ""}]
    without = await c.chat.completions.create(model="tiny-tools", messages=empty, tools=TOOLS, max_tokens=1)
    assert answer.usage and without.usage
    assert answer.usage.prompt_tokens >= without.usage.prompt_tokens + len(result.split())


async def test_a_streamed_tool_call_arrives_as_deltas_that_assemble_into_one_call_and_is_counted(
    gw: Fleet, tool_model: Path
) -> None:
    c, project = await _client(gw, "streamer")
    stream = await c.chat.completions.create(
        model="tiny-tools",
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        logit_bias=leaning_to_a_call(tool_model),
        stream=True,
        stream_options={"include_usage": True},
    )
    calls: dict[int, dict[str, str]] = {}
    finishes: list[str] = []
    usage = None
    text = ""
    async for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                assembled = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                assembled["id"] = delta.id or assembled["id"]
                if delta.function:
                    assembled["name"] += delta.function.name or ""
                    assembled["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
    assert finishes == ["tool_calls"] and text == ""
    assert list(calls) == [0] and calls[0]["id"] and calls[0]["name"] == "get_weather"
    _valid_for(WEATHER, calls[0]["arguments"])
    assert usage and usage.completion_tokens > 0

    async def recorded() -> list[Any]:
        return [r for r in await usage_records(gw.store, project) if r.stream]

    await wait_until(recorded, deadline_s=30, what="the streamed tool call's usage record")
    record = (await recorded())[-1]
    assert record.status == 200 and record.tokens_out == usage.completion_tokens
    assert record.tokens_in == usage.prompt_tokens


async def test_parallel_tool_calls_come_back_as_several_calls_each_with_its_own_id(gw: Fleet, tool_model: Path) -> None:
    c, _ = await _client(gw, "parallel")
    bias = leaning_to_a_call(tool_model)
    del bias[next(k for k, v in bias.items() if v == 100)]  # no leaning to end: the model keeps calling
    answer = await c.chat.completions.create(
        model="tiny-tools",
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=True,
        max_tokens=300,
        logit_bias=bias,
    )
    calls = answer.choices[0].message.tool_calls or []
    # Cut at max_tokens mid-call: the calls before the cut are whole.
    assert answer.choices[0].finish_reason == "length" and len(calls) >= 2, answer.choices[0]
    assert len({call.id for call in calls}) == len(calls)
    for call in calls[:-1]:
        _valid_for({"get_weather": WEATHER, "get_time": TIME}[call.function.name], call.function.arguments)
