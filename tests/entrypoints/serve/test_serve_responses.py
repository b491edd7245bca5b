"""The Responses API (``POST /v1/responses``) through ``patchbay serve``, driven by the official ``openai``
client's ``client.responses.create``.

On a tiny random model with the bundled tools template: the shapes (whole and streamed, and the stream's
events add up to the response it completes with), enforced tool choices giving calls valid against the
tool's schema (``jsonschema`` the oracle), ``text.format`` json_schema, ``previous_response_id`` over the
bounded store, ``store: false``, and bad input answered in OpenAI's error shape naming the field.  On the
bundled model (``slow``): a function call, its output sent back by ``call_id``, and an answer.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from serving import running_server

from patchbay.contract.settings import load_settings
from patchbay.entrypoints.chat import BUNDLED_TOOLS_TEMPLATE

UNITS = {
    "type": "object",
    "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["unit"],
    "additionalProperties": False,
}
SET_UNIT = {"type": "function", "name": "set_unit", "description": "Choose a unit", "parameters": UNITS}
NAMED = {"type": "function", "name": "set_unit"}


def settings(*extra: str):
    return load_settings(
        None,
        overrides=[
            "cache.num_blocks=256",
            "model.max_model_len=2048",
            "server.served_model_name=m",
            "structured_output.options.any_whitespace=false",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    with running_server(
        settings(f"model.path={tiny_llama}", f"chat.template={BUNDLED_TOOLS_TEMPLATE}", "server.stored_responses=2")
    ) as server:
        yield server


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)


def streamed(stream) -> tuple[list, object]:
    """The stream's events and the response its ``response.completed``/``incomplete`` event carries, checking
    that the deltas add up to that response's output."""
    events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in (
        "response.completed",
        "response.incomplete",
    )
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    texts: dict[int, str] = {}
    arguments: dict[int, str] = {}
    for event in events:
        if event.type == "response.output_text.delta":
            texts[event.output_index] = texts.get(event.output_index, "") + event.delta
        elif event.type == "response.function_call_arguments.delta":
            arguments[event.output_index] = arguments.get(event.output_index, "") + event.delta
    for index, item in enumerate(final.output):
        if item.type == "message":
            assert item.content[0].text == texts[index]
        elif item.type == "function_call":
            assert item.arguments == arguments[index]
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert [item.model_dump() for item in done] == [item.model_dump() for item in final.output]
    return events, final


def without_ids(response) -> list[dict]:
    return [
        {key: value for key, value in item.model_dump().items() if key not in ("id", "call_id")}
        for item in response.output
    ]


def test_text_input_gives_a_message_whole_and_streamed_alike(tiny):
    client = client_of(tiny)
    request = dict(model="m", input="hello", instructions="Be brief.", max_output_tokens=6, temperature=0)
    response = client.responses.create(**request)
    assert response.object == "response" and response.status == "incomplete"  # 6 tokens of a random model
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["message"] and response.output_text
    assert response.usage.output_tokens == 6 and response.usage.input_tokens > 0
    _, final = streamed(client.responses.create(**request, stream=True))
    assert without_ids(final) == without_ids(response) and final.usage.output_tokens == 6


@pytest.mark.parametrize("tool_choice", ["required", NAMED])
def test_enforced_tool_choices_give_calls_valid_against_the_schema_streamed_or_not(tiny, tool_choice):
    client = client_of(tiny)
    request = dict(
        model="m",
        input=[{"role": "user", "content": "Which unit?"}],
        tools=[SET_UNIT],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        max_output_tokens=40,
        temperature=0,
    )
    response = client.responses.create(**request)
    assert response.status == "completed"
    [call] = response.output
    assert call.type == "function_call" and call.name == "set_unit" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), UNITS)
    events, final = streamed(client.responses.create(**request, stream=True))
    assert without_ids(final) == without_ids(response)
    [done] = [event for event in events if event.type == "response.function_call_arguments.done"]
    assert done.arguments == call.arguments


def test_text_format_json_schema_is_enforced(tiny):
    schema = {
        "type": "object",
        "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    response = client_of(tiny).responses.create(
        model="m",
        input="Which unit?",
        max_output_tokens=30,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "unit", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(response.output_text), schema)


def test_previous_response_id_continues_the_stored_conversation_and_tool_outputs_answer_its_calls(tiny):
    client = client_of(tiny)
    first = client.responses.create(
        model="m", input="Which unit?", tools=[SET_UNIT], tool_choice=NAMED, max_output_tokens=40, temperature=0
    )
    [call] = first.output
    second = client.responses.create(
        model="m",
        previous_response_id=first.id,
        max_output_tokens=4,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "done"}],
        tools=[SET_UNIT],
    )
    assert second.previous_response_id == first.id and second.output
    # The second's prompt holds the first's conversation: more input tokens than the first's.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert client.responses.retrieve(second.id).id == second.id
    # A call id the conversation never made names the item at fault.
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(
            model="m",
            previous_response_id=first.id,
            max_output_tokens=4,
            input=[{"type": "function_call_output", "call_id": "call_nope", "output": "x"}],
        )
    assert caught.value.body["param"] == "input.0.call_id"


def test_store_false_is_not_kept_and_the_store_is_bounded(tiny):
    client = client_of(tiny)
    unstored = client.responses.create(model="m", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model="m", input="again", previous_response_id=unstored.id, max_output_tokens=2)
    assert caught.value.body["param"] == "previous_response_id"
    kept = [client.responses.create(model="m", input="hi", max_output_tokens=2).id for _ in range(3)]
    with pytest.raises(openai.NotFoundError):  # server.stored_responses=2: the oldest was dropped
        client.responses.retrieve(kept[0])
    assert [client.responses.retrieve(response_id).id for response_id in kept[1:]] == kept[1:]


BROKEN = {"type": "function", "name": "broken", "parameters": {"type": "nonsense"}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [SET_UNIT, BROKEN], "tool_choice": "required"}, "tools.1.parameters"),
        ({"tools": [SET_UNIT], "tool_choice": {"type": "function", "name": "multiply"}}, "tool_choice.name"),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"input": [{"type": "function_call_output", "call_id": "call_1", "output": "3"}]}, "input.0.call_id"),
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input.0.arguments"),
        (  # this model takes text only
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input.0.content.0",
        ),
        ({"input": [{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]}, "input.0.content.0.type"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"tools": [SET_UNIT], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice"),
        ({"temperature": "hot"}, "temperature"),
        ({"truncation": "middle"}, "truncation"),
        ({"background": True}, "background"),
    ],
)
def test_bad_input_is_400_in_openais_shape_naming_the_field_and_fails_alone(tiny, body, param):
    response = httpx.post(
        f"{tiny.url}/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 2, **body}, timeout=300
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert client_of(tiny).responses.create(model="m", input="hi", max_output_tokens=2).output


def test_an_enforced_call_cut_by_max_output_tokens_is_incomplete_without_a_message(tiny):
    client = client_of(tiny)
    request = dict(model="m", input="hi", tools=[SET_UNIT], tool_choice="required", max_output_tokens=3)
    whole = client.responses.create(**request)
    _, final = streamed(client.responses.create(**request, stream=True))
    for response in (whole, final):
        assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
        assert [item.type for item in response.output] == []  # the cut call is neither a call nor text


# -- the bundled model --------------------------------------------------------------------------------------


WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 24}},
        "required": ["city"],
        "additionalProperties": False,
    },
}


@pytest.mark.slow
def test_a_bundled_model_call_its_output_and_the_answer_streamed_and_not():
    with running_server(settings()) as server:
        client = client_of(server)
        request = dict(
            model="m",
            input="What is the weather in Paris?",
            tools=[WEATHER],
            tool_choice="required",
            parallel_tool_calls=False,
            max_output_tokens=60,
            temperature=0,
        )
        first = client.responses.create(**request)
        [call] = first.output
        assert call.type == "function_call" and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
        _, final = streamed(client.responses.create(**request, stream=True))
        assert without_ids(final) == without_ids(first)
        answer = client.responses.create(
            model="m",
            previous_response_id=first.id,
            tools=[WEATHER],
            max_output_tokens=30,
            temperature=0,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees."}],
        )
        assert answer.output and answer.status in ("completed", "incomplete")
