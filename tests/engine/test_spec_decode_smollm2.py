"""Greedy speculative decoding on the bundled SmolLM2 is lossless: token for token the output without it."""

from __future__ import annotations

from pathlib import Path

import pytest

import patchbay
from patchbay.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NUM_TOKENS = 24


def _prompts() -> list:
    source = (Path(patchbay.__file__).parent / "worker" / "block_table.py").read_text().splitlines()
    code = "\n".join(source[:30])
    return [
        {"messages": [{"role": "user", "content": f"Copy this code exactly:\n\n{code}"}]},
        {"messages": [{"role": "user", "content": "List the numbers from 1 to 30, separated by commas."}]},
        {"messages": [{"role": "user", "content": "What is the capital of France?"}]},
        "The quick brown fox jumps over the lazy dog. The quick brown fox",
        {"messages": [{"role": "user", "content": "Repeat after me: red green blue, red green blue, red green blue."}]},
        code[:400],
        {"messages": [{"role": "user", "content": "Write a haiku about the sea."}]},
        "def fibonacci(n):\n    ",
    ]


@pytest.fixture(scope="module")
def expected(shared_engines, request) -> list[list[int]]:
    with shared_engines.loans(request.node.nodeid) as borrow:
        llm = borrow(runtime__threads=2)
        return [o.token_ids for o in llm.generate(_prompts(), SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))]


@pytest.mark.parametrize("method", ["ngram", "medusa", "eagle", "eagle3"])
@pytest.mark.parametrize("budget", [2048, 64], ids=["whole-prefill", "chunked-prefill"])
def test_greedy_output_is_unchanged_by_the_drafter(expected, method, budget):
    llm = patchbay.LLM(
        runtime__threads=2,
        scheduler__max_num_batched_tokens=budget,
        spec_decode={"name": method, "num_speculative_tokens": 3},
    )
    outputs = llm.generate(_prompts(), SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    assert llm.spec_stats.num_draft_tokens > 0
