"""Seeded random requests keep their stream across preemption and a replayed step (issue 30).

Finding: re-adding a request to the runner's batch re-seeded its generator
from the start, so a seeded request's tokens changed after it was preempted
(memory pressure) or after a neighbour's failure made the engine replay the
step request by request.  Each test compares with a run that has room enough.
"""

from __future__ import annotations

import pytest

import patchbay
from patchbay.sampling_params import SamplingParams

MAX_MODEL_LEN = 64
PROMPTS = [[101, 102, 103, 104, 105], [201, 202, 203], [301, 302, 303, 304], [401, 402, 403, 404, 405, 406]]
SEEDED = [SamplingParams(max_tokens=24, temperature=1.0, seed=7 + i, ignore_eos=True) for i in range(len(PROMPTS))]


def _llm(tiny_llama, num_blocks: int) -> patchbay.LLM:
    return patchbay.LLM(
        model__path=str(tiny_llama),
        attention__name="torch_sdpa",
        runtime__threads=2,
        model__max_model_len=MAX_MODEL_LEN,
        cache__num_blocks=num_blocks,
        cache__block_size=4,
    )


@pytest.fixture(scope="module")
def roomy(tiny_llama) -> patchbay.LLM:
    return _llm(tiny_llama, 128)


@pytest.fixture(scope="module")
def roomy_tokens(roomy) -> list[list[int]]:
    return [output.token_ids for output in roomy.generate(PROMPTS, SEEDED)]


def test_seeded_outputs_under_forced_preemption_equal_a_roomy_run(tiny_llama, roomy_tokens):
    """Finding: a preempted seeded request restarted its generator when it came back."""
    tight = _llm(tiny_llama, 18)  # 4 requests of up to 30 tokens need 32 blocks of 4: some must wait
    outputs = tight.generate(PROMPTS, SEEDED)
    assert tight.engine.stats.num_preemptions > 0
    assert [output.token_ids for output in outputs] == roomy_tokens
    tight.generate([[5, 6, 7]], SamplingParams(max_tokens=2))  # the runner hears of the last finished ones
    assert not tight.engine.runner.batch.sampling.generators, "finished requests leave no generator behind"


def test_seeded_outputs_after_a_replayed_step_equal_a_clean_run(roomy, roomy_tokens, monkeypatch):
    """Finding: the step replayed request by request after a neighbour's failure re-seeded the seeded ones."""
    engine = roomy.engine
    base = type(engine.sampler)

    class DrawsThenRaises(base):
        """Draws every row's sample (advancing the seeded generators), then raises for temperature 0.5."""

        def sample(self, logits, metadata):
            output = super().sample(logits, metadata)
            if (metadata.temperature == 0.5).any():
                raise RuntimeError("this sampler cannot take that temperature")
            return output

    request_ids = [engine.add_request(prompt, params) for prompt, params in zip(PROMPTS, SEEDED, strict=True)]
    engine.step()
    engine.step()  # the seeded requests are decoding when the failing one arrives
    monkeypatch.setattr(engine.runner, "sampler", DrawsThenRaises(engine.sampler.options))
    engine.add_request([7, 8, 9], SamplingParams(max_tokens=4, temperature=0.5), request_id="bad")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((output.request_id, output) for output in engine.step())
    assert finished["bad"].finish_reason == "error"
    assert [finished[request_id].token_ids for request_id in request_ids] == roomy_tokens
