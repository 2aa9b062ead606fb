"""The Responses API (`POST /v1/responses`) through the `openai` SDK's own calls, over a real llama.cpp
engine: answered, streamed, counted as any chat request, and refused in OpenAI's shape."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

from llmgw.services.router.responses import ResponsesError, StreamTranslator, to_chat
from tests.fleet import Fleet
from tests.support import usage_records, wait_until
from tests.test_gateway import client, gw, make_key, make_tenant, router_caught_up, tiny  # noqa: F401

pytestmark = [pytest.mark.timeout(180)]


@pytest.mark.asyncio
async def test_responses_create_answers_streams_and_is_billed_like_a_chat_request(
    gw: Fleet,  # noqa: F811
    tiny: Path,  # noqa: F811
) -> None:
    tenant = await make_tenant(gw.store)
    key, _ = await make_key(gw.store, tenant)
    await gw.add_model("tiny", tiny)
    await gw.wait_ready("tiny", 1)
    await router_caught_up(gw, 0)
    c = client(gw, key)

    answer = await c.responses.create(model="tiny", input="Say hi", instructions="Be brief.", max_output_tokens=3)
    assert answer.object == "response" and answer.status in ("completed", "incomplete")
    assert answer.output[0].type == "message" and answer.output[0].role == "assistant"
    assert answer.output_text == answer.output[0].content[0].text
    assert answer.usage is not None and answer.usage.output_tokens > 0 and answer.usage.input_tokens > 0

    kinds: list[str] = []
    deltas: list[str] = []
    final = None
    stream = await c.responses.create(
        model="tiny", input=[{"role": "user", "content": [{"type": "input_text", "text": "Count"}]}], stream=True,
        max_output_tokens=3,
    )  # fmt: skip
    async for event in stream:
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and "response.output_text.done" in kinds
    assert final is not None and final.output_text == "".join(deltas) and final.usage.output_tokens > 0

    # Counted as the chat requests they are: one usage record each, on the key's project.
    async def two() -> list | None:
        records = await usage_records(gw.store, tenant.project)
        return records if len(records) == 2 else None

    records = await wait_until(two, what="a usage record per response")
    assert {(r.model_served, r.endpoint) for r in records} == {("tiny", "/v1/chat/completions")}

    with pytest.raises(openai.NotFoundError) as refused:
        await c.responses.create(model="tiny", input="hi", previous_response_id="resp_123")
    assert refused.value.code == "response_not_found" and refused.value.param == "previous_response_id"

    with pytest.raises(openai.NotFoundError) as unknown:
        await c.responses.create(model="nope", input="hi")
    assert unknown.value.status_code == 404


def test_a_responses_request_becomes_the_chat_request_that_serves_it() -> None:
    chat = to_chat(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use French."},
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Bonjour"}]},
            ],
            "max_output_tokens": 5,
            "temperature": 0.2,
            "store": False,
        }
    )
    assert chat == {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Use French."},
            {"role": "user", "content": "Bonjour"},
        ],
        "stream": False,
        "max_tokens": 5,
        "temperature": 0.2,
    }


@pytest.mark.parametrize(
    ("body", "param", "said"),
    [
        ({"input": "hi"}, "model", "model is required"),
        ({"model": "m"}, "input", "input is required"),
        ({"model": "m", "input": "hi", "tools": [{"type": "web_search"}]}, "tools", "a tool llmgw does not run"),
        ({"model": "m", "input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role must be"),
        (
            {"model": "m", "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content",
            "text only",
        ),
    ],
)
def test_a_request_the_translation_cannot_serve_is_refused_naming_the_field(body: dict, param: str, said: str) -> None:
    with pytest.raises(ResponsesError) as refused:
        to_chat(body)
    assert refused.value.param == param and said in refused.value.message


def test_chat_chunks_become_the_responses_stream_events_in_order() -> None:
    t = StreamTranslator({"model": "m"}, "resp_1", "msg_1", 0)
    events = [*t.start()]
    events += t.chunk({"model": "m", "choices": [{"delta": {"content": "He"}}]})
    events += t.chunk({"model": "m", "choices": [{"delta": {"content": "llo"}, "finish_reason": "stop"}]})
    events += t.chunk({"model": "m", "choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}})
    events += t.end()
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-1]["response"]
    assert done["output"][0]["content"][0]["text"] == "Hello" and done["usage"]["total_tokens"] == 6
