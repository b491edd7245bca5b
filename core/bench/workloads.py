"""The bench's fixed, seeded workloads: token-id prompts with fixed output lengths.

Prompts are slices of patchbay's own source text, so every run on every
machine sees the same tokens for the same seed and tokenizer.  Output lengths
are generated with ``ignore_eos`` (every engine produces exactly that many
tokens), which makes the engines' work comparable token for token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WORKLOADS = ("throughput", "latency", "prefix", "spec", "quality")

COPY_TASKS = (
    "Copy the following Python code exactly, without any comment:\n\n{code}",
    "Rewrite the following Python code, renaming nothing, and keep every line:\n\n{code}",
    "Repeat this code block verbatim:\n\n{code}",
)


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    lora: str | None = None
    """The LoRA adapter the request runs with (``None``: the base model)."""


@dataclass(frozen=True)
class Workload:
    """Requests submitted together, at most ``concurrency`` running at once."""

    name: str
    requests: list[BenchRequest]
    concurrency: int
    label: str = ""
    """What varies inside a workload family (``prompt 1024``, say)."""

    @property
    def prompt_tokens(self) -> int:
        return sum(len(request.prompt_token_ids) for request in self.requests)

    @property
    def generated_tokens(self) -> int:
        return sum(request.max_tokens for request in self.requests)


def source_corpus(tokenizer: Any) -> list[int]:
    """patchbay's own Python sources as one token sequence (deterministic for a tokenizer)."""
    import patchbay

    root = Path(patchbay.__file__).parent
    text = "\n".join(path.read_text() for path in sorted(root.rglob("*.py")))
    return tokenizer.encode(text, add_special_tokens=False)


def throughput(
    corpus: list[int],
    *,
    num_requests: int = 64,
    prompt_range: tuple[int, int] = (16, 512),
    output_range: tuple[int, int] = (16, 256),
    concurrency: int = 64,
    seed: int = 0,
) -> Workload:
    """``num_requests`` requests of random prompt and output lengths, all submitted at once."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        length = rng.randint(*prompt_range)
        start = rng.randrange(0, len(corpus) - length)
        requests.append(BenchRequest(corpus[start : start + length], rng.randint(*output_range)))
    return Workload("throughput", requests, concurrency, f"concurrency {concurrency}")


def latency(corpus: list[int], *, prompt_length: int, max_tokens: int = 64, seed: int = 0) -> Workload:
    """One request alone: time to first token and decode time per token."""
    start = random.Random(seed).randrange(0, len(corpus) - prompt_length)
    return Workload(
        "latency", [BenchRequest(corpus[start : start + prompt_length], max_tokens)], 1, f"prompt {prompt_length}"
    )


def context(
    corpus: list[int], *, prompt_length: int, num_requests: int = 4, max_tokens: int = 64, seed: int = 0
) -> Workload:
    """``num_requests`` prompts of exactly ``prompt_length`` tokens, all submitted at once: the context axis."""
    if prompt_length >= len(corpus):
        raise ValueError(f"bench context: a {prompt_length}-token prompt is longer than the corpus ({len(corpus)})")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        start = rng.randrange(0, len(corpus) - prompt_length)
        requests.append(BenchRequest(corpus[start : start + prompt_length], max_tokens))
    return Workload("context", requests, num_requests, f"prompt {prompt_length}")


def shared_prefix(
    corpus: list[int],
    *,
    num_requests: int = 32,
    prefix_length: int = 1000,
    suffix_range: tuple[int, int] = (16, 64),
    max_tokens: int = 32,
    seed: int = 0,
) -> Workload:
    """``num_requests`` requests that share their first ``prefix_length`` tokens (a system prompt, a document)."""
    rng = random.Random(seed)
    prefix = corpus[:prefix_length]
    requests = []
    for _ in range(num_requests):
        length = rng.randint(*suffix_range)
        start = rng.randrange(prefix_length, len(corpus) - length)
        requests.append(BenchRequest(prefix + corpus[start : start + length], max_tokens))
    return Workload("prefix", requests, num_requests, f"{num_requests} x {prefix_length}-token prefix")


EXCERPT_CHARS = 1000
"""Longest source excerpt of a copy prompt, in characters."""


def copy_prompts(num_requests: int) -> list[list[dict[str, str]]]:
    """Chat messages asking to copy or lightly edit excerpts of patchbay's sources (answers repeat them).

    Each excerpt is up to 24 lines and :data:`EXCERPT_CHARS` characters, so prompts stay a few hundred tokens.
    """
    import patchbay

    sources = sorted(Path(patchbay.__file__).parent.rglob("*.py"))
    conversations = []
    for index in range(num_requests):
        lines = sources[index % len(sources)].read_text().splitlines()
        start = (index * 7) % max(1, len(lines) - 24)
        excerpt: list[str] = []
        for line in lines[start : start + 24]:
            if excerpt and sum(map(len, excerpt)) + len(line) > EXCERPT_CHARS:
                break
            excerpt.append(line)
        code = "\n".join(excerpt)
        conversations.append([{"role": "user", "content": COPY_TASKS[index % len(COPY_TASKS)].format(code=code)}])
    return conversations


def repetitive(tokenizer: Any, *, num_requests: int = 8, max_tokens: int = 96) -> Workload:
    """The speculative-decoding workload: :func:`copy_prompts` through the chat template, greedy."""
    requests = []
    for messages in copy_prompts(num_requests):
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        requests.append(BenchRequest(tokenizer.encode(text, add_special_tokens=False), max_tokens))
    return Workload("spec", requests, num_requests, f"{num_requests} copy/edit requests")
