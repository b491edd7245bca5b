"""Logprobs on the bundled SmolLM2 agree with transformers' log-softmax of the same model's logits."""

from __future__ import annotations

from pathlib import Path

import pytest
from bundled_model import FLOAT_WEIGHTS, float_model_dir
import torch

import patchbay
from patchbay.sampling_params import SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm(shared_engines, request):
    # A small step budget, so the 300-token prompt is prefilled in chunks.
    with shared_engines.loans(request.node.nodeid) as borrow:
        yield borrow(runtime__threads=2, scheduler__max_num_batched_tokens=64, model__weight_format=FLOAT_WEIGHTS)


@pytest.fixture(scope="module")
def reference(llm):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(float_model_dir(), dtype=torch.float32).eval()

    def log_softmax(token_ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)

    return log_softmax


@pytest.fixture(scope="module")
def prompt(llm) -> list[int]:
    text = (Path(patchbay.__file__).parent / "scheduling" / "scheduler.py").read_text()
    return llm.tokenizer.encode(text)[:300]


def test_logprobs_of_greedy_tokens_match_transformers(llm, reference, prompt):
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, logprobs=5))
    expected = reference(prompt + output.token_ids)
    assert len(output.logprobs) == 8
    for step, (token, entry) in enumerate(zip(output.token_ids, output.logprobs, strict=True)):
        row = expected[len(prompt) - 1 + step]
        assert entry.token_ids[0] == token and entry.sampled_rank == 1
        assert entry.logprobs[0] == pytest.approx(row[token].item(), abs=1e-4)
        top_values, top_ids = row.topk(5)
        assert entry.token_ids[1:] == top_ids.tolist()
        assert entry.logprobs[1:] == pytest.approx(top_values.tolist(), abs=1e-4)


def test_prompt_logprobs_match_transformers_under_chunked_prefill(llm, reference, prompt):
    steps_before = llm.engine.stats.num_steps  # a shared engine: earlier tests' steps count too
    (output,) = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=3))
    assert llm.engine.stats.num_steps - steps_before > 1
    expected = reference(prompt)
    assert len(output.prompt_logprobs) == len(prompt) and output.prompt_logprobs[0] is None
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        row = expected[position - 1]
        token = prompt[position]
        assert entry.token_ids[0] == token
        assert entry.logprobs[0] == pytest.approx(row[token].item(), abs=1e-4)
        # The rank among ~49k logits: exact up to logits within float rounding (1e-4) of the token's.
        value = row[token].item()
        assert int((row > value + 1e-4).sum()) + 1 <= entry.sampled_rank <= int((row > value - 1e-4).sum()) + 1
        assert entry.token_ids[1:] == row.topk(3).indices.tolist()
