"""A plugin that raises on one request fails that request alone (500 naming the plugin); the others complete.

Needs the engine's per-request failure (a step that raises is replayed request
by request, ``finish_reason="error"``); skipped on an engine without it.
"""

from __future__ import annotations

import importlib.util
import json

import asyncio
from typing import ClassVar

import httpx
import pytest
from serving import running_server

from patchbay import hookimpl
from patchbay.contract.registry import Registry
from patchbay.contract.settings import load_settings
from patchbay.interfaces import DraftBatch, Drafter, DrafterCapabilities, DraftProposals

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("patchbay.engine.step_failures") is None,
    reason="this engine stops on a plugin error instead of failing the request alone",
)

POISON = 31337
"""A prompt token id the failing drafter refuses."""


class PoisonedDrafter(Drafter):
    """Drafts nothing, and raises for a request whose tokens contain :data:`POISON`."""

    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities(devices=("cpu",))

    def propose(self, batch: DraftBatch) -> DraftProposals:
        for tokens in batch.token_ids:
            if POISON in tokens.tolist():
                raise RuntimeError("poisoned drafter: refusing a request")
        return DraftProposals([[] for _ in batch.token_ids])


class PoisonedPlugin:
    @hookimpl
    def register_drafters(self, register):
        register("poisoned", PoisonedDrafter)


@pytest.fixture(scope="module")
def server(tiny_llama):
    registry = Registry.from_entry_points()
    registry.add_plugin(PoisonedPlugin(), name="poisoned-test")
    settings = load_settings(
        None,
        overrides=[
            f"model.path={tiny_llama}",
            "cache.num_blocks=256",
            "spec_decode.name=poisoned",
            "spec_decode.num_speculative_tokens=2",
        ],
    )
    with running_server(settings, registry) as running:
        yield running


def body(prompt: list[int], **extra) -> dict:
    return {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, **extra}


def test_a_failing_plugin_fails_one_request_while_the_others_complete(server):
    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as http:
            prompts = [[100, 200, 300, 400 + i] for i in range(4)]
            prompts.insert(2, [100, 200, POISON, 400])
            return await asyncio.gather(
                *(http.post(f"{server.url}/v1/completions", json=body(prompt)) for prompt in prompts)
            )

    responses = asyncio.run(scenario())
    statuses = [r.status_code for r in responses]
    assert statuses == [200, 200, 500, 200, 200], [r.text for r in responses]
    error = responses[2].json()["error"]
    assert "poisoned" in error["message"]
    assert all(r.json()["usage"]["completion_tokens"] == 16 for i, r in enumerate(responses) if i != 2)
    server.wait_until_idle(timeout=10)
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_failing_plugin_ends_a_stream_with_an_error_event(server):
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body([7, 8, POISON], stream=True), timeout=60
    ) as response:
        assert response.status_code == 200
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "poisoned" in error["message"] and error["code"] == "engine_error"
    server.wait_until_idle(timeout=10)
