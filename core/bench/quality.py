"""What a faster setting costs in quality: perplexity on a held text, and greedy agreement with float32.

The held text is prose that ships with patchbay itself (the docstrings of its
own modules), so the figure can be reproduced wherever patchbay is installed.
Perplexity is ``exp`` of the mean negative log-likelihood of every token after
the first of each window, from the engine's own prompt logprobs.  Greedy
agreement is, per request, the share of the reference's tokens the engine
reproduced before its first different token, averaged over the requests.
"""

from __future__ import annotations

import ast
import math
from pathlib import Path
from typing import Any

WINDOW_TOKENS = 256
"""Tokens per scored window (each window is one request, scored from its own start)."""
AGREEMENT_PROMPTS = 8
"""Greedy-agreement requests: prompts cut from the held text."""
AGREEMENT_PROMPT_TOKENS = 64
AGREEMENT_OUTPUT_TOKENS = 32
SCORING_STEP_TOKENS = 16
"""The bench scores in steps of at most this many tokens: integer weights serve only steps of few rows."""


def held_text() -> str:
    """patchbay's module docstrings, in a fixed order: a few thousand words of technical English."""
    import patchbay

    root = Path(patchbay.__file__).parent
    docstrings = [ast.get_docstring(ast.parse(path.read_text())) for path in sorted(root.rglob("*.py"))]
    return "\n\n".join(text for text in docstrings if text)


MAX_WINDOWS = 16


def scoring_windows(
    token_ids: list[int], window: int = WINDOW_TOKENS, max_windows: int = MAX_WINDOWS
) -> list[list[int]]:
    """The first ``max_windows`` windows of ``window`` tokens of ``token_ids`` (a last one-token window dropped)."""
    windows = [token_ids[start : start + window] for start in range(0, len(token_ids), window)][:max_windows]
    return [w for w in windows if len(w) > 1]


def perplexity(llm: Any, token_ids: list[int], window: int = WINDOW_TOKENS, max_windows: int = MAX_WINDOWS) -> float:
    """Perplexity of ``llm`` (a :class:`patchbay.LLM`) on ``token_ids``, scored in windows of ``window`` tokens."""
    from patchbay.sampling_params import SamplingParams

    windows = scoring_windows(token_ids, window, max_windows)
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


def agreement_to_first_difference(tokens: list[int], reference: list[int]) -> float:
    """Share of ``reference`` (a non-empty token list) that ``tokens`` repeats before the first difference."""
    if not reference:
        raise ValueError("greedy agreement needs a non-empty reference")
    same = 0
    for ours, theirs in zip(tokens, reference, strict=False):
        if ours != theirs:
            break
        same += 1
    return same / len(reference)


def greedy_agreement(token_ids: list[list[int]], references: list[list[int]]) -> float:
    """Mean over requests of :func:`agreement_to_first_difference` (``token_ids[i]`` against ``references[i]``)."""
    if len(token_ids) != len(references) or not references:
        raise ValueError(f"greedy agreement needs one run per reference ({len(token_ids)} runs, {len(references)})")
    return sum(map(agreement_to_first_difference, token_ids, references)) / len(references)


def agreement_prompts(
    token_ids: list[int], count: int = AGREEMENT_PROMPTS, length: int = AGREEMENT_PROMPT_TOKENS
) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens, fixed slices spread evenly over ``token_ids`` (the held text)."""
    if len(token_ids) < length:
        raise ValueError(f"the held text has {len(token_ids)} tokens, fewer than one {length}-token prompt")
    stride = max(1, (len(token_ids) - length) // max(1, count - 1))
    return [token_ids[start : start + length] for start in range(0, len(token_ids) - length + 1, stride)][:count]


def greedy_tokens(llm: Any, prompts: list[list[int]], max_tokens: int = AGREEMENT_OUTPUT_TOKENS) -> list[list[int]]:
    """``llm``'s greedy continuation of each prompt, exactly ``max_tokens`` long (EOS ignored)."""
    from patchbay.sampling_params import SamplingParams

    outputs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0))
    return [list(output.token_ids) for output in outputs]
