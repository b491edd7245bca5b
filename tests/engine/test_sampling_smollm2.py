"""Seeded sampling on the bundled SmolLM2: a request's text does not depend on the rest of the batch."""

from __future__ import annotations

import random

import pytest

import patchbay
from patchbay.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm():
    # A small step budget: the batch's long prompts are prefilled in chunks next to the seeded request.
    return patchbay.LLM(runtime__threads=2, scheduler__max_num_batched_tokens=128)


def _mixed_batch(rng: random.Random) -> list[tuple[dict, SamplingParams]]:
    topics = ["the sea", "a robot", "autumn", "prime numbers", "a city at night", "coffee", "mountains", "trains"]
    batch = []
    for index in range(31):
        words = " ".join(rng.choice(topics) for _ in range(rng.randint(1, 40)))
        prompt = {"messages": [{"role": "user", "content": f"Write about {words}."}]}
        params = SamplingParams(
            max_tokens=rng.randint(4, 24),
            temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
            top_k=rng.choice([0, 20]),
            top_p=rng.choice([1.0, 0.9]),
            frequency_penalty=rng.choice([0.0, 0.5]),
            seed=rng.choice([None, index]),
        )
        batch.append((prompt, params))
    return batch


def test_a_seeded_request_gives_the_same_text_alone_and_in_a_mixed_batch(llm):
    prompt = {"messages": [{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}]}
    params = SamplingParams(max_tokens=32, temperature=0.9, top_p=0.95, seed=1234)
    (alone,) = llm.generate([prompt], params)
    again = llm.generate([prompt], params)[0]
    assert again.token_ids == alone.token_ids

    rng = random.Random(5)
    others = _mixed_batch(rng)
    for position in (0, 31):
        batch = [*others[:position], (prompt, params), *others[position:]]
        outputs = llm.generate([p for p, _ in batch], [s for _, s in batch])
        assert outputs[position].text == alone.text, f"seeded request at position {position} of 32 changed"


def test_different_seeds_give_different_samples(llm):
    prompt = {"messages": [{"role": "user", "content": "Name a colour."}]}
    outputs = llm.generate([prompt] * 4, [SamplingParams(max_tokens=16, temperature=1.2, seed=s) for s in range(4)])
    assert len({tuple(o.token_ids) for o in outputs}) > 1
