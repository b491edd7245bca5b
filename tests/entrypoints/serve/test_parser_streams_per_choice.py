"""The server makes each request's parser streams once per choice, not once per streamed chunk (issue 58).

A stream made per chunk and dropped is wasted work on every token, and a parser whose streams share state
(against the contract, but the kit of contract 1.1 let one through) answered every streamed request wrong.
"""

from __future__ import annotations

import json
import threading
from collections import Counter

import httpx
import pytest
from serving import running_server

from patchbay.contract.settings import load_settings
from patchbay.entrypoints.chat import BUNDLED_TOOLS_TEMPLATE
from patchbay.plugins.reasoning_parsers.think import ThinkReasoningParser
from patchbay.plugins.tool_parsers.hermes import HermesToolParser

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
    },
}


@pytest.fixture
def streams_made(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """How many streams the built-in ``hermes`` and ``think`` parsers have made, by kind."""
    made: Counter = Counter()
    lock = threading.Lock()
    for kind, parser in (("tool_parser", HermesToolParser), ("reasoning_parser", ThinkReasoningParser)):
        original = parser.stream

        def counting(self, _original=original, _kind=kind):
            with lock:
                made[_kind] += 1
            return _original(self)

        monkeypatch.setattr(parser, "stream", counting)
    return made


def stream_chat(url: str, n: int) -> list[str]:
    """A streamed chat request with tools (``auto``) and ``n`` choices of 12 tokens; its data lines."""
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [ADD],
        "n": n,
        "max_tokens": 12,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        return [line[6:] for line in response.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]


def test_one_parser_stream_per_request_and_choice(tiny_llama, streams_made):
    settings = load_settings(
        None,
        overrides=[
            f"model.path={tiny_llama}",
            f"chat.template={BUNDLED_TOOLS_TEMPLATE}",
            "chat.reasoning_parser=think",
            "server.served_model_name=m",
            "cache.num_blocks=64",
        ],
    )
    with running_server(settings) as server:
        first = stream_chat(server.url, n=2)
        chunks = [json.loads(line) for line in first]
        per_choice = Counter(choice["index"] for chunk in chunks for choice in chunk["choices"])
        assert per_choice[0] > 3 and per_choice[1] > 3, f"too few chunks to tell one stream from many: {per_choice}"
        assert streams_made == {"tool_parser": 2, "reasoning_parser": 2}, streams_made
        stream_chat(server.url, n=1)
        assert streams_made == {"tool_parser": 3, "reasoning_parser": 3}, streams_made
