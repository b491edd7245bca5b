"""Speculative decoding in the runner: layout arithmetic, exact verification, lossless outputs, acceptance stats."""

from __future__ import annotations

import math
import random
import re
from collections import Counter
from typing import ClassVar

import numpy as np
import pytest
import torch

import patchbay
from patchbay import hookimpl
from patchbay.contract.registry import Registry
from patchbay.interfaces import DraftBatch, Drafter, DrafterCapabilities, DraftProposals
from patchbay.sampling_params import SamplingParams
from patchbay.worker.spec_decode import arange_within, logits_layout
from tiny_models import transformers_greedy

NUM_TOKENS = 12


def test_arange_within_runs():
    assert arange_within(np.array([2, 3, 0, 1])).tolist() == [0, 1, 0, 1, 2, 0]


def test_logits_layout_of_a_mixed_step():
    layout = logits_layout(np.array([4, 9, 12, 13]), np.array([2, 0, 1, 0]), np.array([True, False, True, True]))
    assert layout.logits_indices.tolist() == [1, 2, 3, 10, 11, 12]
    assert layout.bonus_indices.tolist() == [2, 4, 5]
    assert layout.target_indices.tolist() == [0, 1, 3]
    assert layout.num_drafts.tolist() == [2, 1, 0]


class ScriptedDrafter(Drafter):
    """Proposes the known greedy continuation, corrupting the draft at a scripted position."""

    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities(devices=("cpu",))
    continuations: ClassVar[dict[tuple[int, ...], list[int]]] = {}
    """Prompt -> the greedy continuation transformers produces."""
    wrong_at: ClassVar[int] = 2
    proposed: ClassVar[list[list[int]]] = []

    def propose(self, batch: DraftBatch) -> DraftProposals:
        found = []
        for index, tokens in enumerate(batch.token_ids):
            tokens = tokens.tolist()
            prompt, continuation = next(
                (list(p), c) for p, c in self.continuations.items() if tokens[: len(p)] == list(p)
            )
            done = len(tokens) - len(prompt)
            room = min(batch.num_speculative_tokens, batch.max_model_len - len(tokens))
            drafts = continuation[done : done + room]
            if index in batch.skip:
                drafts = []
            elif len(drafts) > self.wrong_at:
                drafts[self.wrong_at] = (drafts[self.wrong_at] + 1) % 1000  # a wrong guess: rejected from here on
            type(self).proposed.append(drafts)
            found.append(drafts)
        return DraftProposals(found)


class ScriptedPlugin:
    @hookimpl
    def register_drafters(self, register):
        register("scripted", ScriptedDrafter)


@pytest.fixture(scope="module")
def registry() -> Registry:
    registry = Registry.from_entry_points()
    registry.add_plugin(ScriptedPlugin(), name="scripted-test")
    return registry


def _prompts() -> list[list[int]]:
    rng = random.Random(12)
    return [[rng.randrange(1000, 40000) for _ in range(rng.randint(4, 70))] for _ in range(6)]


def test_greedy_with_drafts_equals_transformers_and_counts_acceptance_exactly(tiny_llama, registry):
    prompts = _prompts()
    expected = transformers_greedy(tiny_llama, prompts, NUM_TOKENS)
    ScriptedDrafter.continuations = {tuple(p): e for p, e in zip(prompts, expected, strict=True)}
    ScriptedDrafter.proposed = []
    llm = patchbay.LLM(
        model__path=str(tiny_llama),
        registry=registry,
        scheduler__max_num_batched_tokens=32,
        spec_decode={"name": "scripted", "num_speculative_tokens": 4},
    )
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected

    stats = llm.engine.spec_stats
    assert stats.num_drafting_steps > 0 and any(ScriptedDrafter.proposed)
    # Drafts before the corrupted position are right and the one at it is wrong, so exactly the first two
    # positions are accepted whenever they are verified, and nothing after them.
    assert stats.num_accepted_tokens == stats.drafted_per_position[0] + stats.drafted_per_position[1]
    assert stats.acceptance_rate_per_position[:2] == [1.0, 1.0]
    assert stats.acceptance_rate_per_position[2] == 0.0
    assert stats.mean_accepted_length > 2.5


def test_random_sampling_with_drafts_keeps_the_output_distribution(tiny_llama, registry):
    """Two-sample chi-square on the second generated token: false-failure rate below 1e-4."""
    prompt = _prompts()[0]
    params = SamplingParams(max_tokens=2, temperature=1.0, top_k=4, n=300, ignore_eos=True)
    base = patchbay.LLM(model__path=str(tiny_llama), runtime__seed=1)
    (plain,) = base.generate([prompt], params)
    # The scripted drafter proposes greedy continuations: often right, sometimes rejected.
    ScriptedDrafter.continuations = {tuple(prompt): transformers_greedy(tiny_llama, [prompt], 2)[0]}
    spec = patchbay.LLM(
        model__path=str(tiny_llama),
        registry=registry,
        runtime__seed=2,
        spec_decode={"name": "scripted", "num_speculative_tokens": 1},
    )
    (drafted,) = spec.generate([prompt], params)
    assert spec.engine.spec_stats.num_draft_tokens > 0
    first = Counter(c.token_ids[1] for c in plain.completions)
    second = Counter(c.token_ids[1] for c in drafted.completions)
    statistic, dof = _two_sample_chi_square(first, second)
    assert dof >= 1
    assert _chi_square_survival(statistic, dof) > 1e-4, (first, second)


def _two_sample_chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    keys = sorted(set(a) | set(b))
    n_a, n_b = sum(a.values()), sum(b.values())
    statistic = 0.0
    for key in keys:
        total = a[key] + b[key]
        expected_a, expected_b = total * n_a / (n_a + n_b), total * n_b / (n_a + n_b)
        statistic += (a[key] - expected_a) ** 2 / expected_a + (b[key] - expected_b) ** 2 / expected_b
    return statistic, len(keys) - 1


def _chi_square_survival(statistic: float, dof: int) -> float:
    return float(
        torch.special.gammaincc(
            torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
        )
    )


def test_requests_asking_for_logprobs_decode_without_drafts(tiny_llama, registry):
    prompts = _prompts()[:2]
    ScriptedDrafter.continuations = {
        tuple(p): e for p, e in zip(prompts, transformers_greedy(tiny_llama, prompts, 6), strict=True)
    }
    llm = patchbay.LLM(
        model__path=str(tiny_llama), registry=registry, spec_decode={"name": "scripted", "num_speculative_tokens": 3}
    )
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2))
    assert all(len(o.logprobs) == 6 for o in outputs)
    assert llm.engine.spec_stats.num_draft_tokens == 0
    assert not math.isnan(outputs[0].logprobs[0].logprobs[0])


# -- proposals are checked where the runner receives them ------------------------------------------------


def test_draft_proposals_outside_the_contract_name_the_drafter_and_the_request():
    from patchbay.worker.spec_decode import DraftProposalError, check_draft_proposals

    def check(proposals, skip=frozenset(), num_tokens=(10, 10)):
        return check_draft_proposals(
            "drafter:mine",
            proposals,
            ["a", "b"],
            list(num_tokens),
            set(skip),
            vocab_size=100,
            max_drafts=3,
            max_model_len=12,
        )

    assert check([[1, 2], [99]]) == [[1, 2], [99]]
    assert check([[1, 2], [500, 600]], skip={1}) == [[1, 2], []]  # a skipped row's proposal is dropped unchecked
    for proposals, num_tokens, message in (
        (
            [[1], [100]],
            (10, 10),
            "drafter:mine proposed for request 'b' token ids outside the vocabulary (0..99): [100]",
        ),
        ([[-1], []], (10, 10), "drafter:mine proposed for request 'a' token ids outside the vocabulary (0..99): [-1]"),
        ([[1, 2, 3, 4], []], (5, 5), "drafter:mine proposed for request 'a' 4 drafts; at most 3 are allowed"),
        ([[], [1, 2, 3]], (10, 10), "drafter:mine proposed for request 'b' 3 drafts; at most 2 are allowed"),
        ([[1]], (10, 10), "drafter:mine returned 1 proposals for a batch of 2 requests"),
    ):
        with pytest.raises(DraftProposalError, match=re.escape(message)):
            check(proposals, num_tokens=num_tokens)
