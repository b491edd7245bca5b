"""Prompts in the shapes the front ends accept, turned into token ids."""

from __future__ import annotations

from typing import Any

Prompt = str | list[int] | dict[str, Any]
"""A text prompt, prompt token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` / ``{"messages": [...]}``."""


def encode_prompt(tokenizer: Any, prompt: Prompt) -> tuple[str | None, list[int]]:
    """Prompt text (if any) and token ids; ``messages`` go through the tokenizer's chat template.

    A malformed prompt raises ``ValueError`` saying what was expected.
    """
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, list):
        return None, _token_ids(prompt)
    if not isinstance(prompt, dict):
        raise ValueError(f"a prompt is a string, a list of token ids or an object; got {type(prompt).__name__}")
    if "prompt_token_ids" in prompt:
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise ValueError(f"'prompt' must be a string, got {type(text).__name__}")
        return text, _token_ids(prompt["prompt_token_ids"])
    if "messages" in prompt:
        messages = _chat_messages(prompt["messages"])
        if getattr(tokenizer, "chat_template", None) is None:
            raise ValueError("'messages' need a chat template, and this model's tokenizer has none")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, tokenizer.encode(text, add_special_tokens=False)
    if "prompt" in prompt:
        if not isinstance(prompt["prompt"], str):
            raise ValueError(f"'prompt' must be a string, got {type(prompt['prompt']).__name__}")
        return prompt["prompt"], tokenizer.encode(prompt["prompt"])
    raise ValueError(f"a prompt object needs 'prompt', 'prompt_token_ids' or 'messages'; got keys {sorted(prompt)}")


def _token_ids(values: Any) -> list[int]:
    if not isinstance(values, list):
        raise ValueError(f"prompt_token_ids must be a list of integers, got {type(values).__name__}")
    wrong = [value for value in values if isinstance(value, bool) or not isinstance(value, int)]
    if wrong:
        raise ValueError(f"prompt token ids must be integers; got {wrong[:5]!r}")
    return list(values)


def _chat_messages(messages: Any) -> list[dict[str, Any]]:
    """``messages`` checked to be a non-empty list of ``{"role": str, "content": str, ...}``."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            f"'messages' must be a non-empty list of {{'role': ..., 'content': ...}} objects, "
            f"got {type(messages).__name__}"
        )
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(
                f"messages[{index}] must be an object with 'role' and 'content', got {type(message).__name__}"
            )
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{index}].role must be a string, got {type(message.get('role')).__name__}")
        if not isinstance(message.get("content"), (str, list)):  # a list: content parts
            raise ValueError(f"messages[{index}].content must be a string, got {type(message.get('content')).__name__}")
    return messages
