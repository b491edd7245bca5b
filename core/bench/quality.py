"""What a faster setting costs in quality: perplexity on a held text, and greedy agreement with a reference.

The held text is prose that ships with patchbay itself (the docstrings of its
own modules), so the figure can be reproduced wherever patchbay is installed.
Perplexity is ``exp`` of the mean negative log-likelihood of every token after
the first of each window, from the engine's own prompt logprobs.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

WINDOW_TOKENS = 256
"""Tokens per scored window (each window is one request, scored from its own start)."""
SCORING_STEP_TOKENS = 16
"""The bench scores in steps of at most this many tokens: integer weights serve only steps of few rows."""


def held_text() -> str:
    """patchbay's module docstrings, in a fixed order: a few thousand words of technical English."""
    import patchbay

    root = Path(patchbay.__file__).parent
    docstrings = [ast.get_docstring(ast.parse(path.read_text())) for path in sorted(root.rglob("*.py"))]
    return "\n\n".join(text for text in docstrings if text)


def perplexity(llm: Any, token_ids: list[int], window: int = WINDOW_TOKENS, max_windows: int = 16) -> float:
    """Perplexity of ``llm`` (a :class:`patchbay.LLM`) on ``token_ids``, scored in windows of ``window`` tokens."""
    from patchbay.sampling_params import SamplingParams

    windows = [token_ids[start : start + window] for start in range(0, len(token_ids), window)][:max_windows]
    windows = [w for w in windows if len(w) > 1]
    outputs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0))
    total, count = 0.0, 0
    for output, prompt in zip(outputs, windows, strict=True):
        for position, entry in enumerate(output.prompt_logprobs or []):
            if entry is None:
                continue  # the first token has no context
            if entry.token_ids[0] != prompt[position]:
                raise AssertionError("prompt logprobs do not start with the prompt token")
            total -= entry.logprobs[0]
            count += 1
    return math.exp(total / count)
