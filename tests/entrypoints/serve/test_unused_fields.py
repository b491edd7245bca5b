"""OpenAI fields patchbay has no use for are accepted (and logged once each); fields that would change the
answer are accepted at their neutral values only, any other value a 400 naming the field and saying why."""

from __future__ import annotations

import logging

import httpx
import pytest
from serving import running_server

from patchbay.contract.settings import load_settings
from patchbay.entrypoints.chat import BUNDLED_TOOLS_TEMPLATE
from patchbay.entrypoints.serve import unused_fields
from patchbay.entrypoints.serve.unused_fields import CHAT, COMPLETIONS, IGNORED, NEUTRAL_ONLY, RESPONSES

BASE = {
    CHAT: {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    COMPLETIONS: {"model": "m", "prompt": "hi", "max_tokens": 2},
    RESPONSES: {"model": "m", "input": "hi", "max_output_tokens": 2},
}
SAMPLES = {
    "metadata": {"user_id": "u1"},
    "service_tier": "auto",
    "prompt_cache_key": "tenant-1",
    "safety_identifier": "hashed-user",
    "store": True,
    "reasoning_effort": "low",
    "verbosity": "low",
    "prediction": {"type": "content", "content": "Hello"},
    "reasoning": {"effort": "low", "summary": "auto"},
    "top_logprobs": 2,
    "max_tool_calls": 3,
    "stream_options": {"include_obfuscation": False},
    "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit"},
    "background_options": {"completion_window": "soonest"},
    "access_programs": {"cyber": "standard"},
    "image": {"context_compression": "auto"},
}
"""A value a client sends for each ignored field."""
NEUTRAL = {
    "modalities": (["text"], ["text", "audio"]),
    "audio": (None, {"voice": "alloy", "format": "wav"}),
    "web_search_options": (None, {}),
    "functions": ([], [{"name": "f", "parameters": {"type": "object"}}]),
    "function_call": ("auto", {"name": "f"}),
    "background": (False, True),
    "conversation": (None, "conv_1"),
    "prompt": (None, {"id": "pmpt_1"}),
    "moderation": (None, {"model": "omni-moderation-latest"}),
    "context_management": (None, [{"type": "compaction", "compact_threshold": 1000}]),
}
"""Each neutral-only field's neutral value, and a value that asks for what patchbay cannot do."""


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    settings = load_settings(
        None,
        overrides=[
            f"model.path={tiny_llama}",
            f"chat.template={BUNDLED_TOOLS_TEMPLATE}",
            "cache.num_blocks=64",
            "server.served_model_name=m",
        ],
    )
    with running_server(settings) as server:
        yield server


def post(server, endpoint: str, **fields) -> httpx.Response:
    return httpx.post(f"{server.url}{endpoint}", json={**BASE[endpoint], **fields}, timeout=300)


def test_every_table_entry_has_a_sample_here():
    assert {name for fields in IGNORED.values() for name in fields} <= set(SAMPLES)
    assert {name for fields in NEUTRAL_ONLY.values() for name in fields} <= set(NEUTRAL)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS, RESPONSES])
def test_fields_patchbay_does_not_use_are_accepted_and_logged_once_each(tiny, endpoint, caplog, monkeypatch):
    monkeypatch.setattr(unused_fields, "_logged", set())
    fields = {name: SAMPLES[name] for name in IGNORED[endpoint]}
    with caplog.at_level(logging.WARNING, logger=unused_fields.__name__):
        for _ in range(2):
            response = post(tiny, endpoint, **fields)
            assert response.status_code == 200, response.text
    logged = [record.getMessage() for record in caplog.records if record.name == unused_fields.__name__]
    assert sorted(logged) == sorted(
        f"{endpoint}: field {name!r} accepted and ignored ({why}); logged once"
        for name, why in IGNORED[endpoint].items()
    )


@pytest.mark.parametrize(
    ("endpoint", "name"), [(endpoint, name) for endpoint, fields in NEUTRAL_ONLY.items() for name in fields]
)
def test_fields_that_would_change_the_answer_are_accepted_only_at_their_neutral_value(tiny, endpoint, name):
    neutral, asking = NEUTRAL[name]
    assert post(tiny, endpoint, **{name: neutral}).status_code == 200
    response = post(tiny, endpoint, **{name: asking})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    rule = NEUTRAL_ONLY[endpoint][name]
    assert error["param"] == name and error["message"] == f"{name}: {rule.why} (accepted: {rule.neutral})"


def test_an_unknown_field_is_still_a_400_naming_it(tiny):
    response = post(tiny, CHAT, temprature=0.5)
    assert response.status_code == 400 and response.json()["error"]["param"] == "temprature"


def test_responses_truncation_auto_answers_as_disabled_does(tiny):
    response = post(tiny, RESPONSES, truncation="auto")
    assert response.status_code == 200 and response.json()["truncation"] == "disabled"
