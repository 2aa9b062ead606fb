"""The Responses API with function tools and stored responses: the translation both ways (streamed
too, from recorded chat chunks), and through the gateway over a real llama.cpp engine and a real
nats-server — a response kept for its project, chained, listed, deleted, expired, and never seen by
another project."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import agents
import aiohttp
import openai
import pytest

from llmgw.events.runtime.store import EventStore
from llmgw.services.router.config import RouterConfig
from llmgw.services.router.response_store import (
    ResponseStore,
    StoredResponse,
    StoreUnavailable,
    encode_entry,
    page,
    readable,
)
from llmgw.services.router.responses import ResponsesError, StreamTranslator, from_chat, to_chat
from tests.conftest import NatsServer
from tests.fleet import Fleet
from tests.gguf_tiny import write_tool_gguf
from tests.support import wait_until
from tests.test_gateway import FAST_ROUTER, GATEWAY, client, gw, make_key, make_tenant, router_caught_up, tiny  # noqa: F401
from tests.tool_gateway import leaning_to_a_call, tool_gateway

pytestmark = [pytest.mark.timeout(180)]

WEATHER = {
    "type": "function",
    "name": "weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}


# -- the translation, pure ---------------------------------------------------------------------


def test_function_tools_and_a_named_tool_choice_become_the_chat_requests_tools() -> None:
    chat = to_chat({"model": "m", "input": "Weather in Paris?", "tools": [WEATHER], "tool_choice": "required"})
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "description": "The weather in a city",
                "parameters": WEATHER["parameters"],
                "strict": True,
            },
        }
    ]
    assert chat["tool_choice"] == "required"
    named = to_chat(
        {"model": "m", "input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "weather"}}
    )
    assert named["tool_choice"] == {"type": "function", "function": {"name": "weather"}}
    assert to_chat({"model": "m", "input": "x", "tool_choice": "none"})["tool_choice"] == "none"


def test_function_calls_and_their_outputs_in_input_become_the_assistants_tool_calls_and_tool_messages() -> None:
    chat = to_chat(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "Weather in Paris and Rome?"},
                {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": '{"city":"Paris"}'},
                {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"city":"Rome"}'},
                {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
                {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
            ],
        }
    )
    assert chat["messages"] == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Paris"}'}},
                {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Rome"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
    ]


def test_the_previous_responses_items_come_before_the_input() -> None:
    history = [
        {"type": "message", "role": "user", "content": "Weather in Paris?", "id": "msg_1"},
        {
            "type": "function_call",
            "id": "fc_1",
            "call_id": "c1",
            "name": "weather",
            "arguments": "{}",
            "status": "completed",
        },
    ]
    chat = to_chat(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [{"type": "function_call_output", "call_id": "c1", "output": "sunny"}],
        },
        history,
    )
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert chat["messages"][2]["tool_calls"][0]["id"] == "c1"


@pytest.mark.parametrize(
    ("body", "param", "said"),
    [
        (
            {"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]},
            "tools",
            "'file_search', a tool llmgw does not run",
        ),
        ({"tools": [{"type": "computer_use_preview"}]}, "tools", "only function tools"),
        ({"tools": [{"type": "function"}]}, "tools[0].name", "the function's name"),
        ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice", 'tool_choice must be "auto"'),
        (
            {"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
            "input[0].call_id",
            "non-empty string",
        ),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
            "input[0].output.content",
            "string",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input", "function_call_output items"),
        ({"conversation": "conv_1"}, "conversation", "previous_response_id"),
    ],
)
def test_what_the_translation_cannot_serve_is_refused_naming_the_field(body: dict, param: str, said: str) -> None:
    with pytest.raises(ResponsesError) as refused:
        to_chat({"model": "m", "input": "hi", **body})
    assert refused.value.param == param and said in refused.value.message


def test_a_chat_answers_tool_calls_become_function_call_items() -> None:
    chat = {
        "model": "m",
        "created": 7,
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "abc",
                            "type": "function",
                            "function": {"name": "weather", "arguments": '{"city":"Paris"}'},
                        }
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 5},
    }
    answer = from_chat(chat, {"model": "m", "tools": [WEATHER]}, "resp_1", "msg_1")
    assert answer["status"] == "completed" and answer["tools"] == [WEATHER]
    assert answer["output"] == [
        {
            "type": "function_call",
            "id": "fc_1_0",
            "call_id": "abc",
            "name": "weather",
            "arguments": '{"city":"Paris"}',
            "status": "completed",
        }
    ]


# Chunks as llama.cpp streams a tool call (its id and name first, the arguments in pieces), recorded.
TOOL_CHUNKS = [
    {"model": "m", "choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
    {
        "model": "m",
        "choices": [
            {
                "index": 0,
                "delta": {
                    "tool_calls": [
                        {
                            "index": 0,
                            "id": "call_x",
                            "type": "function",
                            "function": {"name": "weather", "arguments": ""},
                        }
                    ]
                },
            }
        ],
    },
    {
        "model": "m",
        "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}}],
    },
    {
        "model": "m",
        "choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}}],
    },
    {"model": "m", "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    {"model": "m", "choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 8}},
]


def test_streamed_tool_call_chunks_become_the_function_call_events_in_order() -> None:
    t = StreamTranslator({"model": "m", "tools": [WEATHER]}, "resp_1", "msg_1", 0)
    events = [*t.start()]
    for chunk in TOOL_CHUNKS:
        events += t.chunk(chunk)
    events += t.end()
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = events[2]["item"]
    assert added["type"] == "function_call" and added["status"] == "in_progress" and added["name"] == "weather"
    assert events[5]["arguments"] == '{"city":"Paris"}' and events[5]["item_id"] == added["id"]
    done = events[-1]["response"]
    assert done["output"] == [{**added, "arguments": '{"city":"Paris"}', "status": "completed"}]
    assert done["usage"]["total_tokens"] == 28


def test_text_then_a_tool_call_streamed_are_two_output_items_each_closed() -> None:
    t = StreamTranslator({"model": "m"}, "resp_1", "msg_1", 0)
    events = [*t.start(), *t.chunk({"choices": [{"delta": {"content": "Let me look."}}]})]
    for chunk in TOOL_CHUNKS[1:]:
        events += t.chunk(chunk)
    events += t.end()
    added = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.added"]
    done = [(e["output_index"], e["item"]["type"]) for e in events if e["type"] == "response.output_item.done"]
    assert added == done == [(0, "message"), (1, "function_call")]
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["message", "function_call"]


# -- the store's decisions, pure --------------------------------------------------------------


def _entry(project: str = "p1", expires_at: float = 100.0, text: str = "x") -> StoredResponse:
    return StoredResponse(project_id=project, expires_at=expires_at, history=[], input=[], response={"t": text})


def test_a_stored_response_is_read_by_its_project_only_and_only_before_it_expires() -> None:
    entry = _entry()
    assert readable(entry, "p1", 99.0) is entry
    assert readable(entry, "p2", 99.0) is None
    assert readable(entry, "p1", 100.0) is None
    assert readable(None, "p1", 0.0) is None


def test_a_response_larger_than_the_limit_is_not_stored_and_the_reason_names_the_setting() -> None:
    assert isinstance(encode_entry(_entry(), 10_000), bytes)
    why = encode_entry(_entry(text="y" * 5000), 2000)
    assert isinstance(why, str) and "at most 2000 (router setting response_max_bytes)" in why


def test_input_items_are_paged_newest_first_by_default() -> None:
    items = [{"id": f"i{n}"} for n in range(5)]
    first = page(items, "desc", 2, None)
    assert [i["id"] for i in first["data"]] == ["i4", "i3"] and first["has_more"] and first["last_id"] == "i3"
    rest = page(items, "desc", 10, "i3")
    assert [i["id"] for i in rest["data"]] == ["i2", "i1", "i0"] and not rest["has_more"]
    assert [i["id"] for i in page(items, "asc", 1, None)["data"]] == ["i0"]


# -- through the gateway --------------------------------------------------------------------


@pytest.fixture
async def gw_short(store, nats: NatsServer, tmp_path: Path) -> AsyncIterator[Fleet]:
    """A gateway whose stored responses expire after a second."""
    cfg = RouterConfig(**{**_fields(FAST_ROUTER), "response_ttl_s": 1.0})
    f = await Fleet(store, nats.url, tmp_path).start(services=GATEWAY, router=cfg)
    f.agent("n1")
    yield f
    await f.stop()


def _fields(cfg: RouterConfig) -> dict:
    return {name: getattr(cfg, name) for name in cfg.__struct_fields__}


async def _get(fleet: Fleet, key: str, path: str, method: str = "GET") -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, f"http://127.0.0.1:{fleet.port}{path}", headers={"Authorization": f"Bearer {key}"}) as r,
    ):
        return r.status, await r.json()


@pytest.mark.asyncio
async def test_a_stored_response_is_retrieved_chained_listed_and_deleted_and_hidden_from_another_project(
    gw: Fleet,  # noqa: F811
    tiny: Path,  # noqa: F811
) -> None:
    tenant, other = await make_tenant(gw.store, "acme"), await make_tenant(gw.store, "globex")
    key, _ = await make_key(gw.store, tenant)
    stranger, _ = await make_key(gw.store, other)
    await gw.add_model("tiny", tiny)
    await gw.wait_ready("tiny", 1)
    await router_caught_up(gw, 0)
    c, s = client(gw, key), client(gw, stranger)

    first = await c.responses.with_raw_response.create(
        model="tiny",
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": [{"type": "input_text", "text": "And in Rome?"}]},
        ],
        max_output_tokens=3,
    )
    assert "x-llmgw-response-not-stored" not in first.headers
    answer = first.parse()
    assert answer.store is True
    got = await c.responses.retrieve(answer.id)
    assert got.id == answer.id and got.output_text == answer.output_text

    items = await c.responses.input_items.list(answer.id, order="asc")
    assert [(i.type, i.role) for i in items.data] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert all(i.id for i in items.data)

    second = await c.responses.create(
        model="tiny", input="And tomorrow?", previous_response_id=answer.id, max_output_tokens=3
    )
    assert second.previous_response_id == answer.id

    # Another project's key finds none of it: 404, the same as an id never stored.
    for call in (
        s.responses.retrieve(answer.id),
        s.responses.delete(answer.id),
        s.responses.input_items.list(answer.id),
        s.responses.create(model="tiny", input="hi", previous_response_id=answer.id, max_output_tokens=3),
    ):
        with pytest.raises(openai.NotFoundError) as hidden:
            await call
        assert hidden.value.code == "response_not_found"
    assert (await c.responses.retrieve(answer.id)).id == answer.id  # the stranger's delete deleted nothing

    status, deleted = await _get(gw, key, f"/v1/responses/{answer.id}", "DELETE")
    assert status == 200 and deleted == {"id": answer.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve(answer.id)

    # Not stored when asked not to be.
    unstored = await c.responses.create(model="tiny", input="hi", store=False, max_output_tokens=3)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        await c.responses.retrieve(unstored.id)

    assert (await c.responses.retrieve(second.id)).previous_response_id == answer.id


@pytest.mark.asyncio
async def test_a_streamed_response_is_stored_before_its_last_event(
    gw: Fleet,  # noqa: F811
    tiny: Path,  # noqa: F811
) -> None:
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    await gw.add_model("tiny", tiny)
    await gw.wait_ready("tiny", 1)
    await router_caught_up(gw, 0)
    c = client(gw, key)
    final = None
    async for event in await c.responses.create(model="tiny", input="Count", stream=True, max_output_tokens=3):
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert final is not None and final.store is True
    status, kept = await _get(gw, key, f"/v1/responses/{final.id}")
    assert status == 200 and kept["output"][0]["content"][0]["text"] == final.output_text


@pytest.mark.asyncio
async def test_a_stored_response_expires_after_the_routers_response_ttl(
    gw_short: Fleet,
    tiny: Path,  # noqa: F811
) -> None:
    gw = gw_short  # noqa: F811
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    await gw.add_model("tiny", tiny)
    await gw.wait_ready("tiny", 1)
    await router_caught_up(gw, 0)
    made = await client(gw, key).responses.with_raw_response.create(model="tiny", input="hi", max_output_tokens=3)
    # Stored (the gateway says when it could not store one), then gone once its second has passed.
    assert "x-llmgw-response-not-stored" not in made.headers and made.parse().store is True

    async def expired() -> dict | None:
        status, body = await _get(gw, key, f"/v1/responses/{made.parse().id}")
        return body if status == 404 else None

    gone = await wait_until(expired, what="the stored response to expire (response_ttl_s=1)")
    assert gone["error"]["code"] == "response_not_found"


@pytest.mark.asyncio
async def test_an_unreachable_store_fails_reads_naming_what_to_do_and_lets_a_create_answer_unstored(
    nats: NatsServer, store: EventStore
) -> None:
    kept = ResponseStore(store.js, ttl_s=60.0, max_bytes=10_000, timeout_s=0.5, clock=time.time)
    entry = _entry(expires_at=time.time() + 60)
    assert await kept.put("resp_a", entry) is None
    assert await kept.get("p1", "resp_a") == entry
    assert await kept.get("p2", "resp_a") is None

    nats.stop()
    why = await kept.put("resp_b", entry)
    assert why is not None and "could not be written within 0.5s" in why
    with pytest.raises(StoreUnavailable) as unreachable:
        await kept.get("p1", "resp_a")
    assert "try again when the gateway's NATS is reachable" in str(unreachable.value)


# -- function tools over the real engine ------------------------------------------------------

AGENT_WEATHER = {**WEATHER, "name": "get_weather"}


@pytest.fixture
def tool_model(tmp_path: Path) -> Path:
    return write_tool_gguf(tmp_path / "tools.gguf")


@pytest.fixture
async def gw_tools(store: EventStore, nats: NatsServer, tmp_path: Path, tool_model: Path) -> AsyncIterator[Fleet]:
    f = await tool_gateway(store, nats.url, tmp_path, tool_model)
    yield f
    await f.stop()


def _city(call: object) -> str:
    args = json.loads(call.arguments)  # type: ignore[attr-defined]
    assert isinstance(args, dict) and set(args) == {"city"} and isinstance(args["city"], str), call
    return args["city"]


@pytest.mark.asyncio
async def test_a_function_tool_is_called_its_output_goes_back_by_previous_response_id_and_the_model_answers(
    gw_tools: Fleet, tool_model: Path
) -> None:
    gw = gw_tools  # noqa: F811
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    await gw.router_caught_up()
    c = client(gw, key)
    # The noise model's one answer every run, one call in it (else it calls on until max_output_tokens).
    steady = {
        "extra_body": {"logit_bias": leaning_to_a_call(tool_model)},
        "temperature": 0,
        "parallel_tool_calls": False,
    }

    asked = await c.responses.create(
        model="tiny-tools",
        input="What is the weather in Paris?",
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=120,
        **steady,
    )
    calls = [item for item in asked.output if item.type == "function_call"]
    assert calls and calls[0].name == "weather" and calls[0].status == "completed", asked.output
    _city(calls[0])

    answered = await c.responses.create(
        model="tiny-tools",
        previous_response_id=asked.id,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 °C"}],
        tools=[WEATHER],
        max_output_tokens=5,
    )
    assert answered.status in ("completed", "incomplete") and answered.output[0].type == "message"
    assert answered.previous_response_id == asked.id
    listed = await c.responses.input_items.list(answered.id)
    assert [(i.type, i.call_id) for i in listed.data] == [("function_call_output", calls[0].call_id)]

    # Streamed: the call's events, its arguments in deltas that add up to the whole.
    kinds: list[str] = []
    deltas: dict[str, list[str]] = {}  # item id -> its argument pieces (a model may call more than once)
    final = None
    stream = await c.responses.create(
        model="tiny-tools",
        input="What is the weather in Rome?",
        tools=[WEATHER],
        tool_choice={"type": "function", "name": "weather"},
        max_output_tokens=120,
        stream=True,
        **steady,
    )
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            deltas.setdefault(event.item_id, []).append(event.delta)
        if event.type == "response.completed":
            final = event.response
    assert final is not None and kinds[-1] == "response.completed"
    assert {"response.output_item.added", "response.function_call_arguments.done", "response.output_item.done"} <= set(
        kinds
    )
    streamed = [item for item in final.output if item.type == "function_call"]
    assert streamed and {c.id: c.arguments for c in streamed} == {i: "".join(d) for i, d in deltas.items()}
    for call in streamed:
        _city(call)
    assert (await c.responses.retrieve(final.id)).output[-1].call_id == streamed[-1].call_id


@pytest.mark.asyncio
async def test_the_openai_agents_sdk_runs_an_agent_with_a_function_tool_over_the_gateways_responses_api(
    gw_tools: Fleet, tool_model: Path
) -> None:
    gw = gw_tools  # noqa: F811
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    await gw.router_caught_up()
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    agent = agents.Agent(
        name="forecaster",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel("tiny-tools", client(gw, key)),
        model_settings=agents.ModelSettings(
            tool_choice="required",
            max_tokens=120,
            temperature=0,  # the noise model's one answer, every run
            parallel_tool_calls=False,  # one call, then the answer ends (else the noise calls on to max_tokens)
            extra_body={"logit_bias": leaning_to_a_call(tool_model)},
        ),
        tool_use_behavior="stop_on_first_tool",  # the tool's answer is the agent's: no second turn to guess at
    )
    result = await agents.Runner.run(
        agent, "What is the weather in Paris?", run_config=agents.RunConfig(tracing_disabled=True)
    )
    assert len(cities) == 1 and result.final_output == f"sunny in {cities[0]}"
    called = [item.raw_item for item in result.new_items if item.type == "tool_call_item"]
    assert len(called) == 1 and called[0].name == "get_weather"  # type: ignore[union-attr]
