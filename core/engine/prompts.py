"""Prompts in the shapes the front ends accept, turned into token ids."""

from __future__ import annotations

from typing import Any

Prompt = str | list[int] | dict[str, Any]
"""A text prompt, prompt token ids, or ``{"prompt": ...}`` / ``{"prompt_token_ids": ...}`` / ``{"messages": [...]}``."""


def encode_prompt(tokenizer: Any, prompt: Prompt) -> tuple[str | None, list[int]]:
    """Prompt text (if any) and token ids; ``messages`` go through the tokenizer's chat template."""
    if isinstance(prompt, str):
        return prompt, tokenizer.encode(prompt)
    if isinstance(prompt, list):
        return None, [int(token) for token in prompt]
    if "prompt_token_ids" in prompt:
        return prompt.get("prompt"), [int(token) for token in prompt["prompt_token_ids"]]
    if "messages" in prompt:
        text = tokenizer.apply_chat_template(prompt["messages"], tokenize=False, add_generation_prompt=True)
        return text, tokenizer.encode(text, add_special_tokens=False)
    if "prompt" in prompt:
        return prompt["prompt"], tokenizer.encode(prompt["prompt"])
    raise ValueError(f"a prompt object needs 'prompt', 'prompt_token_ids' or 'messages'; got keys {sorted(prompt)}")
