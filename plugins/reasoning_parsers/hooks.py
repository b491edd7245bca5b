"""Registers the built-in reasoning parsers (lazily)."""

from patchbay import hookimpl


@hookimpl
def register_reasoning_parsers(register):
    register(
        "think",
        "patchbay.plugins.reasoning_parsers.think:ThinkReasoningParser",
        description="<think> reasoning </think> answer (Qwen3, DeepSeek-R1, SmolLM3 ...)",
    )
