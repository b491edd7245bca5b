"""An agent framework nobody here wrote, the OpenAI Agents SDK (``openai-agents`` from PyPI), runs a two-tool
agent loop against ``patchbay serve`` on the bundled model, through chat completions and through the Responses
API (``OpenAIResponsesModel``: function calls come back as ``function_call_output`` items), to its final answer.

The first turn must call a tool (``tool_choice: required``, enforced by patchbay's grammar, as compact JSON by
default, so ``max_tokens=60`` holds a call); the SDK runs the tools, sends their results back as ``tool``
messages answering the calls' ids, resets the choice to ``auto`` and the model answers.  Nothing of the SDK is
mocked.
"""

from __future__ import annotations

import pytest
from serving import running_server

from patchbay.contract.settings import load_settings

agents = pytest.importorskip("agents")

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model_class", ["OpenAIChatCompletionsModel", "OpenAIResponsesModel"])
def test_an_agents_sdk_loop_with_two_tools_runs_to_its_final_answer(model_class):
    from openai import AsyncOpenAI

    ran: list[tuple[str, object]] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        ran.append(("get_weather", city))
        return f"It is sunny and 21 degrees in {city}."

    @agents.function_tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        ran.append(("add", (a, b)))
        return a + b

    settings = load_settings(
        None,
        overrides=[
            "cache.num_blocks=256",
            "model.max_model_len=2048",
            "server.served_model_name=smollm2",
        ],
    )
    agents.set_tracing_disabled(True)
    with running_server(settings) as server:
        client = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=600)
        agent = agents.Agent(
            name="assistant",
            instructions="Use the tools to answer.",
            tools=[get_weather, add],
            model=getattr(agents, model_class)(model="smollm2", openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
        )
        result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=6)

    assert ran and {name for name, _ in ran} <= {"get_weather", "add"}
    outputs = [item for item in result.new_items if isinstance(item, agents.ToolCallOutputItem)]
    assert len(outputs) == len(ran)  # every call the model made was run and answered
    assert isinstance(result.final_output, str) and result.final_output.strip()
