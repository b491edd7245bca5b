"""The built-in samplers against the sampler conformance suite, and the suite shown to catch wrong samplers."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from patchbay.interfaces import SamplerOutput, SamplingMetadata, SpecDecodeMetadata
from patchbay.plugins.samplers import _processing
from patchbay.plugins.samplers.greedy import GreedySampler
from patchbay.plugins.samplers.rejection import StandardRejectionSampler
from patchbay.plugins.samplers.standard import StandardSampler
from patchbay.testing import SamplerSuite
from patchbay.testing import sampler as kit
from patchbay.testing.sampler import RowParams, build_metadata, build_verify_batch


class TestStandard(SamplerSuite):
    plugin_name = "standard"


class TestStandardProcessedLogprobs(SamplerSuite):
    plugin_name = "standard"
    plugin_options = {"logprobs_mode": "processed"}
    logprobs_mode = "processed"


class TestRejection(SamplerSuite):
    plugin_name = "rejection"


class TestGreedy(SamplerSuite):
    plugin_name = "greedy"


def test_greedy_skips_random_tests_by_capability() -> None:
    with pytest.raises(pytest.skip.Exception, match="greedy only"):
        kit.require(GreedySampler(), "sample", random=True)
    with pytest.raises(pytest.skip.Exception, match="does not declare top_k"):
        kit.require(GreedySampler(), "sample", ["top_k"], random=True)
    with pytest.raises(pytest.skip.Exception, match="checks the 'verify' role"):
        kit.require(GreedySampler(), "verify")


# -- the suite is not vacuous: each deliberately wrong sampler fails the check of its mistake ---------------


class TemperatureIgnored(StandardSampler):
    """Samples every random row at temperature 1."""

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        temperature = torch.where(metadata.temperature > 0, 1.0, 0.0)
        return super().sample(logits, dataclasses.replace(metadata, temperature=temperature))


class SeedsIgnored(StandardSampler):
    """Draws seeded rows from the default generator."""

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return super().sample(logits, dataclasses.replace(metadata, generators={}))


class FrequencyWithoutCounts(StandardSampler):
    """Subtracts the frequency penalty once per token seen, like a presence penalty."""

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        wrong = dataclasses.replace(metadata, presence_penalties=metadata.frequency_penalties, frequency_penalties=None)
        return super().sample(logits, wrong)


class TiesRankedLast(StandardSampler):
    """Ranks the sampled token among tokens at least as likely (itself included): ties take the worse rank."""

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        output = super().sample(logits, metadata)
        if output.logprobs is not None:
            logprobs = torch.log_softmax(logits, dim=-1)
            output.sampled_token_ranks = (logprobs >= output.logprobs[:, :1]).sum(dim=-1)
        return output


def keep_one_token_fewer(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Stops once the mass *including* a token exceeds p, so the kept set falls short of p."""
    outside = sorted_probs.cumsum(dim=-1) > top_p.unsqueeze(1)
    outside[:, 0] = False
    return outside & (top_p < 1.0).unsqueeze(1)


def keep_one_token_more(sorted_probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keeps the token after the last one needed to reach p."""
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    outside = torch.zeros_like(mass_before, dtype=torch.bool)
    outside[:, 2:] = mass_before[:, 1:-1] >= top_p.unsqueeze(1)
    return outside


@pytest.mark.parametrize("wrong_mask", [keep_one_token_fewer, keep_one_token_more])
def test_top_p_off_by_one_fails_the_support_check(monkeypatch: pytest.MonkeyPatch, wrong_mask) -> None:
    kit.check_support(StandardSampler(), "top_p")
    monkeypatch.setattr(_processing, "top_p_mask", wrong_mask)
    with pytest.raises(AssertionError, match=r"top_p=0\.(31: never drew|2: drew) the tokens ranked \[2\]"):
        kit.check_support(StandardSampler(), "top_p")
    with pytest.raises(AssertionError, match="chi-square|whose probability is 0"):
        kit.check_frequencies(StandardSampler(), kit.FREQUENCY_CASES["top_p_0.75"])


def test_ignoring_temperature_fails_the_frequency_and_low_temperature_checks() -> None:
    with pytest.raises(AssertionError, match="chi-square"):
        kit.check_frequencies(TemperatureIgnored(), kit.FREQUENCY_CASES["temperature_0.6"])
    with pytest.raises(AssertionError, match="temperature 1e-4 missed the argmax"):
        kit.check_low_temperature_is_greedy(TemperatureIgnored())


def test_ignoring_seeds_fails_the_batch_independence_check() -> None:
    with pytest.raises(AssertionError, match="alone but .* in a shuffled batch of 32"):
        kit.check_seeded_rows(SeedsIgnored())


def test_a_frequency_penalty_that_ignores_counts_fails() -> None:
    with pytest.raises(AssertionError, match="frequency_penalty: case 1"):
        kit.check_processor(FrequencyWithoutCounts(), "frequency_penalty")


def test_ranking_ties_last_fails_the_logprobs_check() -> None:
    with pytest.raises(AssertionError, match="rank 2, expected 1"):
        kit.check_logprobs(TiesRankedLast(), logprobs_mode="raw")


def test_logprobs_of_the_wrong_mode_fail() -> None:
    processed = StandardSampler(StandardSampler.Options(logprobs_mode="processed"))
    with pytest.raises(AssertionError, match="raw logprobs"):
        kit.check_logprobs(processed, logprobs_mode="raw")
    with pytest.raises(AssertionError, match="processed logprobs"):
        kit.check_logprobs(StandardSampler(), logprobs_mode="processed")


class AlwaysAccept(StandardRejectionSampler):
    """Accepts every draft and appends the bonus token."""

    def verify(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        bonus_token_ids: torch.Tensor,
        sampling: SamplingMetadata,
    ) -> torch.Tensor:
        width = max(metadata.num_draft_tokens) + 1
        output = torch.full((len(metadata.num_draft_tokens), width), -1, dtype=torch.int64)
        for request, drafts in enumerate(metadata.draft_token_ids.split(metadata.num_draft_tokens)):
            output[request, : len(drafts)] = drafts
            output[request, len(drafts)] = bonus_token_ids[request, 0]
        return output


class TargetTemperatureIgnored(StandardRejectionSampler):
    """Verifies against the target at temperature 1, whatever the request asked."""

    def verify(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        bonus_token_ids: torch.Tensor,
        sampling: SamplingMetadata,
    ) -> torch.Tensor:
        temperature = torch.where(sampling.temperature > 0, 1.0, 0.0)
        return super().verify(
            metadata,
            draft_probs,
            target_logits,
            bonus_token_ids,
            dataclasses.replace(sampling, temperature=temperature),
        )


@pytest.mark.parametrize("case", ["draft_probs", "no_draft_probs"])
def test_a_rejection_sampler_that_always_accepts_fails(case: str) -> None:
    with pytest.raises(AssertionError, match="first token: frequencies do not match"):
        kit.check_verify_distribution(AlwaysAccept(), kit.VERIFY_CASES[case])
    with pytest.raises(AssertionError, match="greedy request \\d+ with drafts \\[7\\]"):
        kit.check_verify_greedy(AlwaysAccept())


def test_a_rejection_sampler_ignoring_temperature_fails() -> None:
    with pytest.raises(AssertionError, match="chi-square"):
        kit.check_verify_distribution(TargetTemperatureIgnored(), kit.VERIFY_CASES["draft_probs"])


# -- the standard sampler beyond the suite ---------------------------------------------------------------------


def test_greedy_rows_ignore_their_sampling_filters() -> None:
    # The runner passes top-k / top-p values of greedy requests as they were set; greedy rows must not use them.
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0]] * 2)
    metadata = build_metadata([RowParams(top_k=1, top_p=0.1), RowParams(temperature=1.0, top_k=1)], 4)
    assert StandardSampler().sample(logits, metadata).sampled_token_ids[:, 0].tolist() == [1, 1]


def test_logits_processors_follow_the_documented_order() -> None:
    # Bias applies to the raw logit, then the repetition penalty divides the sum: (1.0 + 2.0) / 2 = 1.5 > 1.25.
    logits = torch.tensor([[1.0, 1.25, -5.0]])
    row = RowParams(output=(0,), repetition_penalty=2.0, logit_bias={0: 2.0})
    processed = _processing.apply_logits_processors(logits, build_metadata([row], 3))
    assert processed.tolist() == [[1.5, 1.25, -5.0]]
    assert processed.tolist() == [kit.reference_logits(logits[0].tolist(), row)]


def test_output_token_counts() -> None:
    counts = _processing.output_token_counts([[3, 1, 3], []], 2, 4, torch.device("cpu"))
    assert counts.tolist() == [[0, 1, 0, 2], [0, 0, 0, 0]]


# -- the rejection sampler beyond the suite --------------------------------------------------------------------


def test_verification_sees_earlier_drafts_as_output() -> None:
    # Target argmax is token 2 at both positions; the repetition penalty for token 2 only applies at position 1,
    # once the accepted draft 2 is part of the output, so the draft 2 there is rejected for token 1.
    target = torch.tensor([[0.0, 1.5, 2.0, 0.0], [0.0, 1.5, 2.0, 0.0]])
    row = RowParams(repetition_penalty=1.5, output=(0,))
    batch = build_verify_batch([[2, 2]], [target], [3], [row])
    assert batch.run(StandardRejectionSampler()).tolist() == [[2, 1, -1]]


def test_verification_bans_bad_words_completed_by_drafts() -> None:
    target = torch.tensor([[0.0, 1.0, 3.0, 0.0], [0.0, 1.0, 3.0, 0.0]])
    row = RowParams(bad_words=((2, 2),))
    batch = build_verify_batch([[2, 2]], [target], [3], [row])
    assert batch.run(StandardRejectionSampler()).tolist() == [[2, 1, -1]]


def test_verification_without_drafts_returns_the_bonus_tokens() -> None:
    target = torch.zeros(0, 4)
    batch = build_verify_batch([[], []], [target, target], [3, 1], [RowParams(), RowParams(temperature=1.0)])
    assert batch.run(StandardRejectionSampler()).tolist() == [[3], [1]]
