"""OpenAI's own OpenAPI document as a judge of the gateway (tests/openapi/): schemathesis generates
requests from it for every operation the gateway serves and sends them to a real router in front of
real llama.cpp engines. No generated request may get a 5xx; the model list's answers must match
OpenAI's response schemas. And the typed decode (services/router/openai_types.py) refuses a wrong
type in any field with a 400 naming it, as OpenAI's ``param`` does."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error, response_schema_conformance
from schemathesis.core.failures import FailureGroup

from llmgw.services.router.openai_types import REQUEST_TYPES
from llmgw.services.router.proxy import engine_refusal
from llmgw.services.router.validation import Invalid, RequestLimits, check_body, typed
from tests.fleet import Fleet
from tests.test_gateway import gw, make_key, make_tenant, ready_model, tiny  # noqa: F401

pytestmark = [pytest.mark.timeout(300)]

SUBSET = Path(__file__).parent / "openapi" / "openai-subset.json"
EXAMPLES = 25
CHAT, COMPLETIONS, EMBEDDINGS, RESPONSES = REQUEST_TYPES
LIMITS = RequestLimits(max_messages=100, max_json_depth=64, max_prompt_tokens=10**6, max_output_tokens=4096)
HI = [{"role": "user", "content": "hi"}]
VALID: dict[str, dict[str, Any]] = {
    CHAT: {"model": "m", "messages": HI},
    COMPLETIONS: {"model": "m", "prompt": "hi"},
    EMBEDDINGS: {"model": "m", "input": "hi"},
}


class Served(msgspec.Struct):
    url: str
    key: str


@pytest.fixture
async def served(gw: Fleet, tiny: Path) -> Served:  # noqa: F811
    """A router serving ``tiny`` (chat, completions; at most 3 tokens an answer, so whatever a
    generated request asks costs little) and ``tiny-embed`` (embeddings), and a key for them."""
    key, _ = await make_key(gw.store, await make_tenant(gw.store))
    await gw.add_model("tiny-embed", tiny, args=["--embeddings"], route="embedding")
    await ready_model(gw, tiny, max_output=3)
    await gw.wait_ready("tiny-embed", 1)
    await gw.router_caught_up()
    return Served(url=f"http://127.0.0.1:{gw.port}", key=key)


def _aimed(case: schemathesis.Case, served_model: bool) -> schemathesis.Case:
    """The generated request, naming a model the gateway serves: with a model name drawn at random
    every request would stop at 404, short of the engines."""
    model = "tiny-embed" if case.path == "/embeddings" else "tiny"
    if isinstance(case.body, dict):
        case.body["model"] = model
    if case.path_parameters and served_model:
        case.path_parameters["model"] = model
    return case


def _explore(operation: schemathesis.APIOperation, served: Served) -> list[str]:
    """Send EXAMPLES generated requests for one operation; the failed checks, each with its request."""
    checks = [not_a_server_error]
    if operation.method.upper() == "GET":
        checks.append(response_schema_conformance)
    failures: list[str] = []

    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],  # every failure is collected below; shrinking would resend to the fleet
        suppress_health_check=list(HealthCheck),
    )
    @given(st.tuples(operation.as_strategy(), st.booleans()).map(lambda c: _aimed(*c)))
    def send(case: schemathesis.Case) -> None:
        response = case.call(
            base_url=served.url + "/v1", headers={"Authorization": f"Bearer {served.key}"}, timeout=120
        )
        try:
            case.validate_response(response, checks=checks)
        except (AssertionError, FailureGroup) as failed:
            body = response.text[:600]
            failures.append(f"{case.as_curl_command()[:1500]}\n  → {response.status_code} {body}\n  {failed}")

    send()
    return failures


async def test_no_request_generated_from_openai_s_document_gets_a_5xx_and_the_model_list_matches_its_schema(
    served: Served,
) -> None:
    schema = schemathesis.openapi.from_path(SUBSET)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {f"{o.method.upper()} {o.path}" for o in operations} == {
        "GET /models",
        "GET /models/{model}",
        "POST /chat/completions",
        "POST /completions",
        "POST /embeddings",
        "POST /responses",
    }
    failures: list[str] = []
    for operation in operations:
        # Hypothesis and schemathesis's client are synchronous; the gateway answers on this loop.
        failures += await asyncio.to_thread(_explore, operation, served)
    assert not failures, "\n\n".join(failures)


async def post(served_url: str, key: str, path: str, data: bytes) -> tuple[int, dict]:
    async with (
        aiohttp.ClientSession() as s,
        s.post(served_url + path, data=data, headers={"Authorization": f"Bearer {key}"}) as r,
    ):
        return r.status, await r.json()


async def test_a_role_that_is_an_object_is_a_400_naming_messages_0_role_not_a_500(gw: Fleet) -> None:  # noqa: F811
    key, _ = await make_key(gw.store, await make_tenant(gw.store))
    await gw.router_caught_up()
    url = f"http://127.0.0.1:{gw.port}"
    body = json.dumps({"model": "m", "messages": [{"role": {}}]}).encode()
    status, answer = await post(url, key, "/v1/chat/completions", body)
    assert status == 400, answer
    error = answer["error"]
    assert error["param"] == "messages[0].role" and error["code"] == "invalid_role"
    assert error["message"] == (
        "messages[0].role is {}; it must be one of assistant, developer, function, system, tool, user"
    )
    # The Responses API decodes its body before the chat path counts its depth: too deep is a 400 there too.
    status, answer = await post(url, key, "/v1/responses", b"[" * 100_000)
    assert status == 400 and answer["error"]["code"] == "too_deeply_nested", answer
    status, answer = await post(url, key, "/v1/responses", json.dumps({"model": "m", "input": 5}).encode())
    assert status == 400 and answer["error"]["param"] == "input", answer


# -- a wrong type in each typed field --------------------------------------------------------------

# One value of each JSON kind; for each field, the first its type refuses is the wrong one.
KINDS: list[Any] = [{"wrong": 1}, "wrong", 7, 0.5, True, [{"wrong": 1}], None]


def _wrong_for(kind: type[msgspec.Struct], field: str) -> Any:
    for value in KINDS:
        try:
            msgspec.convert({"model": "m", **VALID.get(_endpoint(kind), {}), field: value}, kind)
        except msgspec.ValidationError:
            return value
    raise AssertionError(f"{kind.__name__}.{field} takes a value of every kind")


def _endpoint(kind: type[msgspec.Struct]) -> str:
    return next(e for e, k in REQUEST_TYPES.items() if k is kind)


WRONG = [
    pytest.param(endpoint, f.name, _wrong_for(kind, f.name), id=f"{endpoint.removeprefix('/v1/')}.{f.name}")
    for endpoint, kind in REQUEST_TYPES.items()
    for f in msgspec.structs.fields(kind)
]


@pytest.mark.parametrize(("endpoint", "field", "value"), WRONG)
def test_a_wrong_type_in_each_typed_field_is_a_400_naming_that_field(endpoint: str, field: str, value: Any) -> None:
    body = {**VALID.get(endpoint, {"model": "m", "input": "hi"}), field: value}
    with pytest.raises(Invalid) as refused:
        if endpoint == RESPONSES:
            typed(body, endpoint)
        else:
            check_body(body, endpoint, LIMITS)
    # An object where a tagged union is wanted lacks its tag: then the tag is named (`tool_choice.type`).
    param = refused.value.param
    assert refused.value.status == 400 and param is not None, refused.value.message
    assert param == field or param.startswith((f"{field}.", f"{field}[")), (param, refused.value.message)
    assert refused.value.code == f"invalid_{field}" and f"`{param}`" in refused.value.message


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["role", "type", "text", "x"]), inner, max_size=3)
    ),
    max_leaves=8,
)
FIELDS = [
    (endpoint, f.name)
    for endpoint, kind in REQUEST_TYPES.items()
    if endpoint != RESPONSES
    for f in msgspec.structs.fields(kind)
]


@settings(max_examples=400, derandomize=True, database=None)
@given(where=st.sampled_from(FIELDS), value=json_values)
def test_any_json_in_any_field_is_accepted_or_refused_naming_it_and_never_raises_anything_else(
    where: tuple[str, str], value: Any
) -> None:
    endpoint, field = where
    body = {**VALID[endpoint], field: value}
    try:
        msgspec.convert(body, REQUEST_TYPES[endpoint])
        well_typed = True
    except msgspec.ValidationError:
        well_typed = False
    try:
        check_body(body, endpoint, LIMITS)
    except Invalid as refused:
        if not well_typed:
            assert refused.status == 400 and refused.param is not None, refused.message
            assert refused.param == field or refused.param.startswith((f"{field}[", f"{field}.")), refused.param
    else:
        assert well_typed, f"{field}={value!r} is not of its type, yet the body was taken"


def test_llama_cpp_s_500_for_a_message_it_cannot_parse_or_media_it_cannot_see_is_a_400_not_retried() -> None:
    for said in (
        "audio input is not supported - hint: if this is unexpected, you may need to provide the mmproj",
        'Failed to parse messages: Unsupported tool call type: {"type":"custom"}',
    ):
        text = json.dumps({"error": {"code": 500, "message": said, "type": "server_error"}})
        refusal = engine_refusal(500, text, "tiny", CHAT)
        assert refusal is not None and (refusal.status, refusal.code) == (400, "engine_refused")
        assert refusal.message == f"the model tiny refused the request: {said}"
    assert engine_refusal(500, '{"error": {"message": "out of memory"}}', "tiny", CHAT) is None, "retried"
