"""OpenAI request fields patchbay accepts without using them, and the values of them it must refuse.

OpenAI clients send fields that matter to OpenAI's service only (``store``, ``metadata``, ``service_tier``,
``prompt_cache_key``, ...); vLLM, llama.cpp and Ollama accept them, and so does patchbay: each is logged once
per endpoint and field (a warning, so an operator learns what clients send), then dropped.  A field that
would change the answer and that patchbay cannot honour (audio output, web search, legacy ``functions``,
background responses) is accepted only at its neutral value (``null``, ``false``, ``["text"]`` ...) and is
otherwise a 400 saying why.  docs/serving.md lists both tables.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"

_SHARED = {
    "metadata": "tags OpenAI stores with the request",
    "service_tier": "OpenAI's processing tiers; patchbay has one",
    "prompt_cache_key": "an OpenAI cache-routing hint; patchbay's prefix cache finds shared prefixes itself",
    "safety_identifier": "OpenAI's abuse monitoring",
    "store": "OpenAI keeps the completion for its dashboard",
    "prompt_cache_retention": "how long OpenAI keeps a prompt cached; patchbay's prefix cache keeps blocks until "
    "their room is needed",
    "prompt_cache_options": "OpenAI's cache breakpoints; patchbay's prefix cache finds shared prefixes itself",
}

IGNORED: dict[str, dict[str, str]] = {
    CHAT: {
        **_SHARED,
        "reasoning_effort": "a hint to OpenAI's reasoning models; the model and its chat template decide",
        "verbosity": "a hint to OpenAI's models on answer length",
        "prediction": "predicted output only makes OpenAI answer faster; the answer is the same",
    },
    COMPLETIONS: {
        key: why
        for key, why in _SHARED.items()
        if key in ("metadata", "service_tier", "prompt_cache_key", "safety_identifier")
    },
    RESPONSES: {
        **{key: why for key, why in _SHARED.items() if key not in ("store", "metadata")},
        "reasoning": "effort and summary hints to OpenAI's reasoning models; the model decides",
        "top_logprobs": "patchbay's Responses output carries no log probabilities",
        "max_tool_calls": "bounds OpenAI's built-in tools, which patchbay does not run",
        "stream_options": "patchbay's Responses stream has no options",
        "background_options": "options of background execution, which patchbay does not do",
        "access_programs": "OpenAI's domain access programs",
        "image": "OpenAI's image context compression; patchbay keeps images whole",
    },
}
"""Endpoint -> field -> why patchbay has no use for it: accepted with any value, logged once, dropped."""


@dataclass(frozen=True)
class NeutralOnly:
    """A field accepted only at a value that asks for nothing patchbay lacks."""

    accepts: Callable[[Any], bool]
    neutral: str
    """The accepted values, as the error names them (``null or ["text"]``)."""
    why: str
    """What any other value asks for, which patchbay cannot do."""


def _is_none(value: Any) -> bool:
    return value is None


def _is_none_or_empty(value: Any) -> bool:
    return value is None or value == [] or value == {}


NEUTRAL_ONLY: dict[str, dict[str, NeutralOnly]] = {
    CHAT: {
        "modalities": NeutralOnly(
            lambda value: value is None or value == ["text"], 'null or ["text"]', "audio output is not supported"
        ),
        "audio": NeutralOnly(_is_none, "null", "audio output is not supported"),
        "web_search_options": NeutralOnly(_is_none, "null", "patchbay does not search the web"),
        "functions": NeutralOnly(
            _is_none_or_empty, "null or []", "legacy function calling is not supported; send tools instead"
        ),
        "function_call": NeutralOnly(
            lambda value: value in (None, "none", "auto"),
            'null, "none" or "auto"',
            "legacy function calling is not supported; send tool_choice instead",
        ),
        "moderation": NeutralOnly(_is_none, "null", "patchbay runs no moderation model"),
    },
    COMPLETIONS: {},
    RESPONSES: {
        "background": NeutralOnly(
            lambda value: value in (None, False), "null or false", "background responses are not supported"
        ),
        "conversation": NeutralOnly(
            _is_none, "null", "OpenAI's stored conversations are not supported; send previous_response_id"
        ),
        "prompt": NeutralOnly(_is_none, "null", "OpenAI's stored prompt templates are not supported"),
        "moderation": NeutralOnly(_is_none, "null", "patchbay runs no moderation model"),
        "context_management": NeutralOnly(
            _is_none_or_empty, "null or []", "patchbay never compacts a conversation; one too long is a 400"
        ),
    },
}
"""Endpoint -> field -> the values it is accepted at (dropped, unlogged); any other value is a 400."""


class UnusableFieldValue(ValueError):
    """A field given at a value patchbay cannot honour; ``param`` names it (the server answers 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


_logged: set[tuple[str, str]] = set()


def drop_unused_fields(extra: Mapping[str, Any] | None, endpoint: str) -> dict[str, Any]:
    """``extra`` (a request's undeclared fields) without the OpenAI fields patchbay does not use; an
    :class:`UnusableFieldValue` naming the first one given at a value patchbay cannot honour.  What is left are
    patchbay's own sampling parameters (or unknown fields, which their validation refuses)."""
    ignored, neutral_only = IGNORED[endpoint], NEUTRAL_ONLY[endpoint]
    kept: dict[str, Any] = {}
    for name, value in (extra or {}).items():
        if name in neutral_only:
            rule = neutral_only[name]
            if not rule.accepts(value):
                raise UnusableFieldValue(name, f"{rule.why} (accepted: {rule.neutral})")
        elif name in ignored:
            if (endpoint, name) not in _logged:
                _logged.add((endpoint, name))
                logger.warning("%s: field %r accepted and ignored (%s); logged once", endpoint, name, ignored[name])
        else:
            kept[name] = value
    return kept
