"""Tool calling and reasoning through ``patchbay serve``, driven by the official ``openai`` client.

The bundled SmolLM2-135M-Instruct serves (through patchbay's copy of its
template with a tools section): ``required`` and named tool choices must give
calls whose arguments validate against the tools' schemas (``jsonschema`` is
the oracle) for every prompt of a held set, streamed and not, identically;
``auto`` answers are read by the Hermes parser and round-trip into the next
turn; reasoning is split from the answer in both modes.  The bad-input cases
run on a tiny random model with the same template.
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

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
HELD_PROMPTS = [
    "What is the weather in Paris?",
    "Add 17 and 25.",
    "Is it raining in Tokyo right now?",
    "What is 3 plus 4?",
]


def settings(*extra: str):
    return load_settings(
        None,
        overrides=[
            "cache.num_blocks=256",
            "model.max_model_len=2048",
            "server.served_model_name=m",
            # JSON without free whitespace: a small model cannot ramble in it
            "structured_output.options.any_whitespace=false",
            *extra,
        ],
    )


def client_of(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)


def calls_of(message) -> list[tuple[str, dict]]:
    return [(call.function.name, json.loads(call.function.arguments)) for call in message.tool_calls or []]


def streamed(stream) -> tuple[str | None, str | None, list[tuple[str, dict]], str]:
    """content, reasoning, calls and finish reason put together from a stream's chunks, the way clients do."""
    content, reasoning, calls, finish = [], [], {}, None
    for chunk in stream:
        choice = chunk.choices[0]
        delta = choice.delta
        content.append(delta.content or "")
        reasoning.append(getattr(delta, "reasoning_content", None) or "")
        for piece in delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = [piece.function.name, ""]
            calls[piece.index][1] += piece.function.arguments or ""
        finish = choice.finish_reason or finish
    text = "".join(content)
    return (
        text or None,
        "".join(reasoning) or None,
        [(name, json.loads(arguments)) for name, arguments in (calls[i] for i in sorted(calls))],
        finish,
    )


# -- the bundled model --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled():
    with running_server(settings()) as server:
        yield server


@pytest.mark.slow
@pytest.mark.parametrize("choice", ["required", "add", "get_weather"])
def test_enforced_tool_choices_give_valid_calls_on_every_held_prompt_streamed_or_not(bundled, choice):
    client = client_of(bundled)
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    for prompt in HELD_PROMPTS:
        request = dict(
            model="m",
            messages=[{"role": "user", "content": prompt}],
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            max_tokens=80,
            temperature=0,
        )
        reply = client.chat.completions.create(**request)
        message = reply.choices[0].message
        calls = calls_of(message)
        assert reply.choices[0].finish_reason == "tool_calls", (prompt, message)
        assert len(calls) == 1 and message.content is None
        name, arguments = calls[0]
        assert name == choice or (choice == "required" and name in SCHEMAS)
        jsonschema.validate(arguments, SCHEMAS[name])
        assert streamed(client.chat.completions.create(**request, stream=True)) == (None, None, calls, "tool_calls")


@pytest.mark.slow
def test_complete_calls_survive_a_later_call_cut_by_max_tokens(bundled):
    """LiteLLM's case: parallel calls, the list cut by ``max_tokens``; the calls it completed come back."""
    client = client_of(bundled)
    request = dict(
        model="m",
        messages=[{"role": "user", "content": "What is 3 plus 4, and is it raining in Tokyo?"}],
        tools=TOOLS,
        tool_choice="required",
        temperature=0,
    )
    longer = client.chat.completions.create(**request, max_tokens=120)
    calls = calls_of(longer.choices[0].message)
    assert longer.choices[0].finish_reason == "length" and len(calls) >= 3, calls  # the held prompt's long list
    reply = client.chat.completions.create(**request, max_tokens=60)
    cut = calls_of(reply.choices[0].message)
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content is None
    assert cut and cut == calls[: len(cut)] and len(cut) < len(calls)
    for name, arguments in cut:
        jsonschema.validate(arguments, SCHEMAS[name])
    assert streamed(client.chat.completions.create(**request, max_tokens=60, stream=True)) == (
        None,
        None,
        cut,
        "length",
    )


@pytest.mark.slow
def test_auto_reads_a_hermes_call_and_the_call_round_trips_into_the_next_turn(bundled):
    client = client_of(bundled)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    # The small model rarely calls on its own; a regex holds it to the Hermes format, the parser does the rest.
    hermes_call = (
        r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,8}", '
        r'"unit": "celsius"\}\}\n</tool_call>'
    )
    request = dict(
        model="m",
        messages=messages,
        tools=TOOLS,
        tool_choice="auto",
        max_tokens=60,
        temperature=0,
        extra_body={"structured_output": {"regex": hermes_call}},
    )
    reply = client.chat.completions.create(**request)
    message = reply.choices[0].message
    [(name, arguments)] = calls_of(message)
    assert name == "get_weather" and reply.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(arguments, SCHEMAS[name])
    assert streamed(client.chat.completions.create(**request, stream=True)) == (
        None,
        None,
        [(name, arguments)],
        "tool_calls",
    )
    follow_up = [
        *messages,
        message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": '{"temperature": 21}'},
    ]
    answer = client.chat.completions.create(model="m", messages=follow_up, tools=TOOLS, max_tokens=20, temperature=0)
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.slow
def test_reasoning_is_split_from_the_answer_streamed_and_not(bundled):
    client = client_of(bundled)
    request = dict(
        model="m",
        messages=[{"role": "user", "content": "What is 2 plus 2?"}],
        max_tokens=40,
        temperature=0,
        extra_body={
            "reasoning_parser": "think",
            "structured_output": {
                "regex": r"<think>[a-z ]{1,30}</think>\n\n"
                r"The answer is [0-9]{1,2}\."
            },
        },
    )
    reply = client.chat.completions.create(**request)
    message = reply.choices[0].message
    reasoning = message.model_extra["reasoning_content"]
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning
    assert message.content.startswith("The answer is ") and "think>" not in message.content
    content, streamed_reasoning, calls, _ = streamed(client.chat.completions.create(**request, stream=True))
    assert (content, streamed_reasoning, calls) == (message.content, reasoning, [])


# -- bad input, on a tiny random model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    with running_server(settings(f"model.path={tiny_llama}", f"chat.template={BUNDLED_TOOLS_TEMPLATE}")) as server:
        yield server


def post(server, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json={"model": "m", "max_tokens": 4, **body}, timeout=300)


USER = [{"role": "user", "content": "hi"}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
BROKEN = {"type": "function", "function": {"name": "broken", "parameters": {"type": "nonsense"}}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [WEATHER, BROKEN], "tool_choice": "required"}, "tools.1.function.parameters"),
        (
            {"tools": [BROKEN], "tool_choice": {"type": "function", "function": {"name": "broken"}}},
            "tools.0.function.parameters",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "multiply"}}},
            "tool_choice.function.name",
        ),
        (
            {
                "messages": [
                    *USER,
                    {"role": "assistant", "content": None, "tool_calls": [CALL]},
                    {"role": "tool", "tool_call_id": "call_2", "content": "3"},
                ]
            },
            "messages.2.tool_call_id",
        ),
        ({"tools": TOOLS, "tool_parser": "no_such_parser"}, "tool_parser"),
        ({"reasoning_parser": "no_such_parser"}, "reasoning_parser"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ],
)
def test_bad_tool_input_is_400_naming_the_field_and_fails_alone(tiny, body, param):
    response = post(tiny, {"messages": USER, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error
    assert post(tiny, {"messages": USER}).status_code == 200  # the server serves the next request


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_an_enforced_call_cut_by_max_tokens_is_length_without_content(tiny, choice):
    client = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="none", max_retries=0, timeout=300)
    request = dict(model="m", messages=USER, tools=TOOLS, tool_choice=choice, max_tokens=3, temperature=0)
    reply = client.chat.completions.create(**request)
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 3
    assert not message.content and not message.tool_calls  # the cut JSON is not passed off as the answer
    assert streamed(client.chat.completions.create(**request, stream=True)) == (None, None, [], "length")


def test_a_tool_conversation_renders_and_runs(tiny):
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    response = post(tiny, {"messages": messages, "tools": TOOLS})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["role"] == "assistant"


def test_offline_chat_returns_parsed_calls_like_the_server(tiny_llama):
    import patchbay
    from patchbay import SamplingParams

    llm = patchbay.LLM(settings(f"model.path={tiny_llama}", f"chat.template={BUNDLED_TOOLS_TEMPLATE}"))
    units = {
        "type": "function",
        "function": {
            "name": "set_unit",
            "parameters": {
                "type": "object",
                "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["unit"],
                "additionalProperties": False,
            },
        },
    }
    for choice in ("required", {"type": "function", "function": {"name": "set_unit"}}):
        # A random model: only enums to choose from and one call, so the grammar ends within max_tokens.
        answer = llm.chat(
            USER, SamplingParams(max_tokens=40), tools=[units], tool_choice=choice, parallel_tool_calls=False
        )
        assert answer.content is None and len(answer.tool_calls) == 1, answer
        (call,) = answer.tool_calls
        assert call.id.startswith("call_") and call.name == "set_unit"
        jsonschema.validate(json.loads(call.arguments), units["function"]["parameters"])
    with pytest.raises(ValueError, match="tool_choice.function.name"):
        llm.chat(USER, tools=[units], tool_choice={"type": "function", "function": {"name": "nope"}})
