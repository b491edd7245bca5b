"""What four OpenAI client libraries nobody here wrote send, with every optional field they take, gets 2xx.

The openai client, the OpenAI Agents SDK (``openai-agents``), ``langchain-openai`` and LiteLLM each talk to a
small recording proxy set up here, which keeps each request's body and passes it on to ``patchbay serve``
(the bundled model) and its answer back, streams included.  So the bodies are captured from the clients as
they run, never written by hand, and each is replayed to patchbay at once: every exchange must be 2xx and
every client call must succeed.  The optional fields are those each library's own API takes (OpenAI-only
ones included: ``store``, ``metadata``, ``reasoning_effort``, ``prompt_cache_key`` ...), at values a client
would send; fields that would ask patchbay for what it cannot do (audio output, web search) are left out,
as they are 400s by design (test_unused_fields.py).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from serving import running_server

from patchbay.contract.settings import load_settings
from patchbay.entrypoints.serve.command import bind

pytestmark = pytest.mark.slow

MODEL = "smollm2"
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}
CHAT_TOOL = {
    "type": "function",
    "function": {"name": "get_weather", "description": "The weather in a city.", "parameters": WEATHER_SCHEMA},
}
RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather.",
    "parameters": WEATHER_SCHEMA,
}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


@dataclass
class Exchange:
    client: str
    method: str
    path: str
    body: dict[str, Any] | None
    status: int


@dataclass
class RecordingProxy:
    """An ASGI app that records each request and forwards it to ``target``, streaming the answer back."""

    target: str
    client: str = ""
    """The library whose requests arrive now (set by the test before driving it)."""
    exchanges: list[Exchange] = field(default_factory=list)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        skipped = {b"host", b"content-length", b"accept-encoding"}
        headers = [(key, value) for key, value in scope["headers"] if key.lower() not in skipped]
        query = scope.get("query_string", b"").decode()
        url = f"{self.target}{scope['path']}" + (f"?{query}" if query else "")
        async with httpx.AsyncClient(timeout=600) as client:
            request = client.build_request(scope["method"], url, headers=headers, content=body)
            response = await client.send(request, stream=True)
            self.exchanges.append(
                Exchange(
                    self.client,
                    scope["method"],
                    scope["path"],
                    json.loads(body) if body else None,
                    response.status_code,
                )
            )
            dropped = {"content-length", "transfer-encoding", "content-encoding", "connection"}
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": [
                        (k.encode(), v.encode()) for k, v in response.headers.items() if k.lower() not in dropped
                    ],
                }
            )
            async for chunk in response.aiter_bytes():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            await response.aclose()


@pytest.fixture(scope="module")
def proxy() -> Iterator[tuple[RecordingProxy, str]]:
    """patchbay serve on the bundled model behind a recording proxy: the proxy and its ``/v1`` URL."""
    import uvicorn

    settings = load_settings(
        None, overrides=["cache.num_blocks=512", "model.max_model_len=2048", f"server.served_model_name={MODEL}"]
    )
    with running_server(settings) as server:
        recorder = RecordingProxy(server.url)
        sock = bind("127.0.0.1", 0)
        front = uvicorn.Server(uvicorn.Config(recorder, log_level="warning", lifespan="on"))
        thread = threading.Thread(target=lambda: asyncio.run(front.serve(sockets=[sock])), daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not front.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the recording proxy did not start"
            time.sleep(0.01)
        try:
            yield recorder, f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
        finally:
            front.should_exit = True
            thread.join(30)
            sock.close()


def exchanges_of(recorder: RecordingProxy, client: str) -> list[Exchange]:
    found = [exchange for exchange in recorder.exchanges if exchange.client == client]
    assert found, f"{client} sent nothing"
    refused = [(e.path, e.status, e.body) for e in found if not 200 <= e.status < 300]
    assert not refused, f"{client}'s requests patchbay refused: {refused}"
    return found


def fields_sent(exchanges: list[Exchange], path: str) -> set[str]:
    return {key for exchange in exchanges if exchange.path == path for key in exchange.body or {}}


# -- the openai client --------------------------------------------------------------------------------------


def test_the_openai_client_with_every_optional_field(proxy):
    from openai import OpenAI

    recorder, url = proxy
    recorder.client = "openai"
    client = OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    everything = dict(
        model=MODEL,
        messages=USER,
        max_completion_tokens=8,
        temperature=0.2,
        top_p=0.9,
        frequency_penalty=0.1,
        presence_penalty=0.1,
        logit_bias={"42": -1},
        logprobs=True,
        top_logprobs=2,
        n=1,
        seed=7,
        stop=["\n\n"],
        user="user-1",
        store=True,
        metadata={"session": "s1"},
        reasoning_effort="low",
        service_tier="auto",
        verbosity="low",
        prompt_cache_key="tenant-1",
        prompt_cache_retention="24h",
        safety_identifier="hashed-user",
        modalities=["text"],
        prediction={"type": "content", "content": "It is sunny."},
        audio=None,
        function_call=None,
        functions=None,
        web_search_options=None,
        moderation=None,
        response_format={"type": "text"},
    )
    client.chat.completions.create(**everything)
    for _ in client.chat.completions.create(
        **everything, stream=True, stream_options={"include_usage": True, "include_obfuscation": False}
    ):
        pass
    reply = client.chat.completions.create(
        model=MODEL, messages=USER, tools=[CHAT_TOOL], tool_choice="required", parallel_tool_calls=True, max_tokens=40
    )
    assert reply.choices[0].message.tool_calls
    client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=8,
        best_of=1,
        echo=False,
        logprobs=2,
        n=1,
        seed=1,
        stop=["\n"],
        suffix=None,
        temperature=0.5,
        top_p=0.9,
        user="user-1",
        stream=False,
    )
    responses_fields = dict(
        model=MODEL,
        input="What is the weather in Paris?",
        instructions="Be brief.",
        max_output_tokens=16,
        temperature=0.2,
        top_p=0.9,
        store=True,
        metadata={"session": "s1"},
        reasoning={"effort": "low", "summary": "auto"},
        service_tier="auto",
        top_logprobs=0,
        background=False,
        max_tool_calls=2,
        truncation="auto",
        include=[],
        prompt_cache_key="tenant-1",
        prompt_cache_retention="24h",
        safety_identifier="hashed-user",
        text={"format": {"type": "text"}, "verbosity": "low"},
        tools=[RESPONSES_TOOL],
        tool_choice="auto",
        parallel_tool_calls=True,
        user="user-1",
    )
    first = client.responses.create(**responses_fields)
    for _ in client.responses.create(
        **{**responses_fields, "previous_response_id": first.id},
        stream=True,
        stream_options={"include_obfuscation": False},
    ):
        pass
    sent = exchanges_of(recorder, "openai")
    assert {"store", "metadata", "reasoning_effort", "service_tier", "prompt_cache_key", "safety_identifier"} <= (
        fields_sent(sent, "/v1/chat/completions")
    )
    assert {"reasoning", "service_tier", "top_logprobs", "background", "max_tool_calls", "stream_options"} <= (
        fields_sent(sent, "/v1/responses")
    )


# -- the OpenAI Agents SDK -------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_class", ["OpenAIChatCompletionsModel", "OpenAIResponsesModel"])
def test_the_agents_sdk_with_every_model_setting(proxy, model_class):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI
    from openai.types.shared import Reasoning

    recorder, url = proxy
    recorder.client = f"agents-{model_class}"
    ran: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        ran.append(city)
        return f"Sunny in {city}."

    agents.set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    settings = agents.ModelSettings(
        temperature=0.0,
        top_p=0.9,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        tool_choice="required",
        # One call a turn: a 135M model given a free list of calls rarely closes it (the list is then cut at
        # max_tokens, and the Responses model of the SDK stops on the incomplete response, as it should).
        parallel_tool_calls=False,
        truncation="auto",
        max_tokens=200,  # test_agent_framework.py holds the loop to 60
        reasoning=Reasoning(effort="low"),
        verbosity="low",
        metadata={"session": "s1"},
        store=True,
        prompt_cache_retention="24h",
        include_usage=True,
        top_logprobs=0,
    )
    agent = agents.Agent(
        name="assistant",
        instructions="Use the tools to answer.",
        tools=[get_weather],
        model=getattr(agents, model_class)(model=MODEL, openai_client=client),
        model_settings=settings,
    )
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert ran and isinstance(result.final_output, str)
    sent = exchanges_of(recorder, f"agents-{model_class}")
    path = "/v1/chat/completions" if model_class == "OpenAIChatCompletionsModel" else "/v1/responses"
    expected = {"reasoning_effort", "store", "metadata"} if path == "/v1/chat/completions" else {"reasoning", "store"}
    assert expected <= fields_sent(sent, path)


# -- langchain-openai ------------------------------------------------------------------------------------------


def test_langchain_openai_invoke_stream_tools_and_structured_output(proxy):
    langchain_openai = pytest.importorskip("langchain_openai")
    from pydantic import BaseModel

    recorder, url = proxy
    recorder.client = "langchain"
    options = dict(
        model=MODEL,
        base_url=url,
        api_key="none",
        max_retries=0,
        timeout=600,
        temperature=0.2,
        top_p=0.9,
        frequency_penalty=0.1,
        presence_penalty=0.1,
        seed=7,
        max_tokens=16,
        n=1,
        stop=["\n\n"],
        logprobs=True,
        top_logprobs=2,
        reasoning_effort="low",
        service_tier="auto",
        verbosity="low",
        stream_usage=True,
        store=True,
        metadata={"session": "s1"},
        model_kwargs={"user": "user-1", "prompt_cache_key": "tenant-1"},
    )
    chat = langchain_openai.ChatOpenAI(**options)
    chat.invoke("Name a colour.")
    list(chat.stream("Name a fruit."))

    class Weather(BaseModel):
        """The weather in a city."""

        city: str

    with_tools = langchain_openai.ChatOpenAI(**{**options, "max_tokens": 40}).bind_tools(
        [Weather], tool_choice="required"
    )
    assert with_tools.invoke("What is the weather in Paris?").tool_calls
    # Through an enforced tool call (compact JSON); json_schema's free whitespace lets a 135M model ramble.
    langchain_openai.ChatOpenAI(**{**options, "max_tokens": 40}).with_structured_output(
        Weather, method="function_calling"
    ).invoke("Which city is the capital of France?")
    responses_chat = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=url,
        api_key="none",
        max_retries=0,
        timeout=600,
        use_responses_api=True,
        max_tokens=16,
        reasoning={"effort": "low"},
        truncation="auto",
        store=True,
    )
    responses_chat.invoke("Name a colour.")
    sent = exchanges_of(recorder, "langchain")
    assert {"/v1/chat/completions", "/v1/responses"} <= {exchange.path for exchange in sent}


# -- LiteLLM ------------------------------------------------------------------------------------------------


def test_litellm_completion_streaming_tools_and_responses(proxy, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import
    litellm = pytest.importorskip("litellm")
    litellm.telemetry = False

    recorder, url = proxy
    recorder.client = "litellm"
    common = dict(model=f"openai/{MODEL}", api_base=url, api_key="none", num_retries=0, timeout=600)
    everything = dict(
        messages=USER,
        max_tokens=8,
        temperature=0.2,
        top_p=0.9,
        n=1,
        stop=["\n\n"],
        presence_penalty=0.1,
        frequency_penalty=0.1,
        logit_bias={"42": -1},
        user="user-1",
        seed=7,
        logprobs=True,
        top_logprobs=2,
        reasoning_effort="low",
        service_tier="auto",
        safety_identifier="hashed-user",
        prompt_cache_key="tenant-1",
        metadata={"session": "s1"},
    )  # not verbosity: LiteLLM itself refuses it for the openai provider
    litellm.completion(**common, **everything)
    for _ in litellm.completion(**common, **everything, stream=True, stream_options={"include_usage": True}):
        pass
    reply = litellm.completion(
        **common, messages=USER, tools=[CHAT_TOOL], tool_choice="required", parallel_tool_calls=True, max_tokens=60
    )
    assert reply.choices[0].message.tool_calls
    litellm.responses(
        **common,
        input="Name a colour.",
        max_output_tokens=16,
        temperature=0.2,
        reasoning={"effort": "low"},
        truncation="auto",
        store=True,
        metadata={"session": "s1"},
    )
    sent = exchanges_of(recorder, "litellm")
    assert {"reasoning_effort", "service_tier"} <= fields_sent(sent, "/v1/chat/completions")
