"""Errors in OpenAI's shape with OpenAI's codes (GW-1), where the engine's own would leak: a prompt past the
context, a role an engine does not know. The `openai` SDK sees them as it would OpenAI's."""

from __future__ import annotations

import json
from pathlib import Path

import openai
import pytest

from llmgw.services.router.proxy import engine_refusal
from llmgw.services.router.validation import Invalid, RequestLimits, check_body
from tests.fleet import Fleet
from tests.test_gateway import client, gw, make_key, make_tenant, ready_model, router_caught_up, tiny  # noqa: F401

LIMITS = RequestLimits(max_messages=100, max_json_depth=64, max_prompt_tokens=10**6, max_output_tokens=4096)


def test_llama_cpp_s_context_overflow_is_said_as_context_length_exceeded_with_the_sizes() -> None:
    body = {
        "error": {
            "code": 400,
            "message": "the request exceeds the available context size, try increasing it",
            "type": "exceed_context_size_error",
            "n_prompt_tokens": 1450,
            "n_ctx": 512,
        }
    }
    refusal = engine_refusal(400, json.dumps(body), "tiny", "/v1/chat/completions")
    assert refusal is not None and refusal.status == 400 and refusal.code == "context_length_exceeded"
    assert refusal.message == (
        "the request is longer than model tiny's context (1450 prompt tokens; the context holds 512): "
        "shorten the messages or lower max_tokens"
    )


@pytest.mark.parametrize("role", ["robot", None, "", "Assistant"])
def test_a_message_with_a_role_no_engine_knows_is_refused_naming_it(role: object) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": role, "content": "x"}]}
    with pytest.raises(Invalid) as refused:
        check_body(body, "/v1/chat/completions", LIMITS)
    assert refused.value.code == "invalid_role" and refused.value.param == "messages[1].role"
    assert "it must be one of assistant, developer, function, system, tool, user" in refused.value.message


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_the_sdk_sees_a_prompt_past_the_context_and_a_bad_role_as_openai_errors(
    gw: Fleet,  # noqa: F811
    tiny: Path,  # noqa: F811
) -> None:
    key, _ = await make_key(gw.store, await make_tenant(gw.store))
    await ready_model(gw, tiny)
    await router_caught_up(gw, 0)
    c = client(gw, key)
    with pytest.raises(openai.BadRequestError) as long:
        await c.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * 3000}], max_tokens=2
        )
    assert long.value.code == "context_length_exceeded", long.value.body
    assert "longer than model tiny's context" in long.value.message
    with pytest.raises(openai.BadRequestError) as role:
        await c.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "hi"}], max_tokens=2)  # type: ignore[list-item]
    assert role.value.code == "invalid_role"


@pytest.mark.asyncio
@pytest.mark.timeout(180)
async def test_a_model_s_output_bound_is_the_default_max_tokens_and_its_ceiling(
    gw: Fleet,  # noqa: F811
    tiny: Path,  # noqa: F811
) -> None:
    key, _ = await make_key(gw.store, await make_tenant(gw.store))
    await ready_model(gw, tiny, max_output=3)
    await router_caught_up(gw, 0)
    c = client(gw, key)
    # No max_tokens, and an engine that would not stop by itself: the model's bound stops it.
    chat = await c.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "tell me a long story"}], extra_body={"ignore_eos": True}
    )
    assert chat.usage is not None and chat.usage.completion_tokens == 3
    with pytest.raises(openai.BadRequestError) as refused:
        await c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10)
    assert refused.value.code == "max_tokens_too_large"
    assert "`max_tokens` is 10; model tiny answers at most 3 tokens" in refused.value.message
