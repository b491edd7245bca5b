"""The built-in drafters against the drafter conformance suite, ngram's matching, and the suite shown to catch
wrong drafters."""

from __future__ import annotations

import random
from typing import ClassVar

import numpy as np
import pytest
from pydantic import ValidationError

import patchbay.plugins.spec_decode.hooks as spec_decode_hooks
from patchbay.contract.registry import Registry, default_registry
from patchbay.interfaces import DraftBatch, Drafter, DrafterCapabilities, DrafterContext, DraftProposals
from patchbay.plugins.spec_decode.ngram import NgramDrafter, find_continuations
from patchbay.testing import DrafterSuite
from patchbay.testing import drafter as kit
from patchbay.testing.drafter import BatchShape, DraftCase, make_cases, make_draft_batch

VOCAB = kit.VOCAB_SIZE
MAX_LEN = 512


@pytest.fixture(scope="module")
def patchbay_registry() -> Registry:
    """The installed plugins; with the built-in drafters added by hand when the metadata seen predates them.

    Entry points come from the metadata written at install time: an install older than the
    ``spec_decode`` entry point, or a stale ``patchbay.egg-info`` of an in-tree build shadowing the
    install (``python -m pytest`` puts the working directory first on ``sys.path``), lacks them.
    The registration-hygiene check then skips, as for any plugin that is not installed.
    """
    registry = default_registry()
    if "ngram" in registry.names("drafter"):
        return registry
    registry = Registry.from_entry_points()
    registry.add_plugin(spec_decode_hooks, name="spec_decode")
    return registry


class TestNgram(DrafterSuite):
    plugin_name = "ngram"
    run_end_to_end = False  # runs in test_ngram_end_to_end, marked slow


class TestNgramLongestOnly(DrafterSuite):
    plugin_name = "ngram"
    plugin_options: ClassVar[dict] = {"prompt_lookup_min": 3, "prompt_lookup_max": 5}
    run_end_to_end = False


@pytest.mark.slow
def test_ngram_end_to_end(patchbay_registry: Registry) -> None:
    reason = kit.end_to_end_unavailable_reason(patchbay_registry)
    if reason:
        pytest.skip(reason)
    kit.check_end_to_end("ngram", {"prompt_lookup_max": 4}, registry=patchbay_registry)


# -- ngram matching ------------------------------------------------------------------------------------------------


def propose(tokens: list[int], k: int = 3, max_model_len: int = 1000, **options: int) -> list[int]:
    drafter = NgramDrafter(NgramDrafter.Options(**options))
    batch = DraftBatch(
        req_ids=["r"], token_ids=[np.array(tokens)], num_speculative_tokens=k, max_model_len=max_model_len
    )
    return drafter.propose(batch).draft_token_ids[0]


def test_the_longest_match_wins() -> None:
    # "3" recurs most recently at index 6 (followed by 8), but "1 2 3" recurs at 0..2 (followed by 4 5 6).
    tokens = [1, 2, 3, 4, 5, 6, 3, 8, 9, 1, 2, 3]
    assert propose(tokens) == [4, 5, 6]
    assert propose(tokens, prompt_lookup_max=1) == [8, 9, 1]


def test_the_most_recent_occurrence_wins() -> None:
    tokens = [7, 8, 1, 1, 1, 7, 8, 2, 2, 2, 7, 8]
    assert propose(tokens) == [2, 2, 2]


def test_prompt_lookup_min_excludes_shorter_matches() -> None:
    tokens = [5, 1, 2, 9, 9, 9, 6, 2]  # only the 1-gram "2" recurs
    assert propose(tokens) == [9, 9, 9]
    assert propose(tokens, prompt_lookup_min=2) == []


def test_prompt_lookup_max_caps_the_suffix_tried() -> None:
    # "4 5" recurs after 6 (most recent), "3 4 5" after 7.
    tokens = [3, 4, 5, 7, 7, 4, 5, 6, 6, 3, 4, 5]
    assert propose(tokens, prompt_lookup_max=2) == [6, 6, 3]
    assert propose(tokens, prompt_lookup_max=3) == [7, 7, 4]


def test_no_match_no_drafts() -> None:
    assert propose([1, 2, 3, 4, 5]) == []
    assert propose([1]) == []
    assert propose([]) == []


def test_periodic_text_keeps_copying_past_the_end() -> None:
    assert propose([1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]
    assert propose([4, 4], k=3) == [4, 4, 4]


def test_max_model_len_cuts_the_drafts() -> None:
    tokens = [1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert propose(tokens, k=3, max_model_len=len(tokens) + 3) == [4, 5, 6]
    assert propose(tokens, k=3, max_model_len=len(tokens) + 2) == [4, 5]
    assert propose(tokens, k=3, max_model_len=len(tokens)) == []
    assert propose(tokens, k=3, max_model_len=len(tokens) - 1) == []


def test_num_speculative_tokens_comes_from_the_batch() -> None:
    tokens = list(range(10)) + list(range(5))
    assert propose(tokens, k=1) == [5]
    assert propose(tokens, k=4) == [5, 6, 7, 8]


def test_skipped_and_short_requests_get_nothing_in_a_mixed_batch() -> None:
    sequences = [np.array([1, 2, 1]), np.array([3, 3]), np.array([9]), np.array([1, 2, 1, 2])]
    batch = DraftBatch(req_ids=list("abcd"), token_ids=sequences, num_speculative_tokens=2, max_model_len=100, skip={1})
    assert NgramDrafter().propose(batch).draft_token_ids == [[2, 1], [], [], [1, 2]]


def test_only_the_lookup_window_is_searched() -> None:
    class Narrow(NgramDrafter):
        """ngram searching the last 6 tokens only."""

        lookup_window = 6

    tokens = [1, 2, 3, 9, 9, 9, 9, 9, 9, 1, 2]  # "1 2" recurs 9 tokens back, outside the window
    batch = DraftBatch(req_ids=["r"], token_ids=[np.array(tokens)], num_speculative_tokens=3, max_model_len=100)
    assert Narrow(NgramDrafter.Options(prompt_lookup_min=2)).propose(batch).draft_token_ids == [[]]
    assert NgramDrafter(NgramDrafter.Options(prompt_lookup_min=2)).propose(batch).draft_token_ids == [[3, 9, 9]]


def brute_force_continuation(tokens: list[int], min_n: int, max_n: int) -> int:
    """The oracle: try every n from the longest, every earlier occurrence from the latest."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[len(tokens) - n :]
        for end in range(len(tokens) - 2, n - 2, -1):
            if tokens[end - n + 1 : end + 1] == suffix:
                return end + 1
    return -1


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 4), (2, 3), (3, 6)])
def test_matching_agrees_with_a_brute_force_oracle(min_n: int, max_n: int) -> None:
    rng = random.Random(min_n * 10 + max_n)
    sequences = []
    for _ in range(300):
        alphabet = rng.choice([2, 3, 5, 50])  # small alphabets: many partial and overlapping matches
        sequences.append([rng.randrange(alphabet) for _ in range(rng.randrange(0, 40))])
    got = find_continuations([np.array(seq, dtype=np.int64) for seq in sequences], min_n, max_n, window=4096)
    want = [brute_force_continuation(seq, min_n, max_n) for seq in sequences]
    wrong = [(seq, int(g), w) for seq, g, w in zip(sequences, got, want, strict=True) if g != w]
    assert not wrong, f"{len(wrong)} mismatches, e.g. (tokens, got, expected) {wrong[:3]}"


def test_options_are_validated() -> None:
    assert NgramDrafter.Options().model_dump() == {"prompt_lookup_min": 1, "prompt_lookup_max": 4}
    with pytest.raises(ValidationError, match=r"prompt_lookup_min \(5\) must be <= prompt_lookup_max \(4\)"):
        NgramDrafter.Options(prompt_lookup_min=5)
    with pytest.raises(ValidationError):
        NgramDrafter.Options(prompt_lookup_max=0)
    with pytest.raises(ValidationError):
        NgramDrafter.Options.model_validate({"num_speculative_tokens": 3})  # a run setting, not an option


def test_registration_names_the_four_drafters() -> None:
    names = {}
    spec_decode_hooks.register_drafters(register=lambda name, target, **kwargs: names.update({name: target}))
    assert names == {
        "ngram": "patchbay.plugins.spec_decode.ngram:NgramDrafter",
        "medusa": "patchbay.plugins.spec_decode.medusa:MedusaDrafter",
        "eagle": "patchbay.plugins.spec_decode.eagle:EagleDrafter",
        "eagle3": "patchbay.plugins.spec_decode.eagle3:Eagle3Drafter",
    }


# -- the synthetic batches are consistent: what a drafter with model state is handed -----------------------------


class StepEchoDrafter(Drafter):
    """Proposes the lm-head argmax of each request's hidden state, after checking the step it was handed."""

    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities(
        needs_hidden_states=True, needs_attention_metadata=True, needs_aux_hidden_states=(0, 2)
    )

    def load(self, context: DrafterContext) -> None:
        self.lm_head = context.model.get_output_embeddings()
        self.hidden_size = context.model.config.hidden_size
        self.block_size = context.block_size

    def propose(self, batch: DraftBatch) -> DraftProposals:
        import torch

        step = batch.step
        assert batch.hidden_states.shape == (len(batch.req_ids), self.hidden_size)
        assert len(step.aux_hidden_states) == 2
        common = step.attention_metadata
        assert common.num_reqs == len(batch.req_ids) and common.block_size == self.block_size
        for index, tokens in enumerate(batch.token_ids):
            start, end = int(step.query_start_loc[index]), int(step.query_start_loc[index + 1])
            kept = end - start - int(step.num_rejected[index])
            positions = step.positions[start : start + kept].numpy()
            # The rows the target ran and kept are the request's own tokens at their positions: every token
            # up to the one it sampled last, which it has not run yet.
            assert kept >= 1 and positions[-1] == len(tokens) - 2
            assert np.array_equal(step.token_ids[start : start + kept].numpy(), tokens[positions])
            assert int(common.seq_lens_cpu[index]) == int(step.positions[end - 1]) + 1
            assert (
                batch.sampled_token_ids[index] == tokens[len(tokens) - len(batch.sampled_token_ids[index]) :].tolist()
            )
        with torch.no_grad():
            best = self.lm_head(batch.hidden_states).argmax(dim=-1).tolist()
        drafts = []
        for index, tokens in enumerate(batch.token_ids):
            count = min(batch.num_speculative_tokens, batch.max_model_len - len(tokens))
            drafts.append([] if index in batch.skip or count <= 0 else [best[index]] * count)
        return DraftProposals(draft_token_ids=drafts)


class TestModelStateDrafter(DrafterSuite):
    """The suite on a drafter needing hidden states and a step: the batches and context it builds are usable."""

    run_end_to_end = False

    @pytest.fixture
    def plugin_class(self) -> type[Drafter]:
        return StepEchoDrafter


def test_token_only_batches_carry_no_tensors() -> None:
    batch = make_draft_batch(make_cases(VOCAB, MAX_LEN)["repetitive"], num_speculative_tokens=3, max_model_len=MAX_LEN)
    assert batch.hidden_states is None and batch.step is None
    assert [
        tokens[-len(gained) :].tolist() for tokens, gained in zip(batch.token_ids, batch.sampled_token_ids, strict=True)
    ] == batch.sampled_token_ids


# -- the suite is not vacuous: each deliberately wrong drafter fails the check of its mistake -------------------


def ngram_batch(case: str, k: int = 3) -> DraftBatch:
    return make_draft_batch(make_cases(VOCAB, MAX_LEN)[case], num_speculative_tokens=k, max_model_len=MAX_LEN)


class ProposesTheVocabSize(NgramDrafter):
    """Off by one: draws ids up to and including vocab_size."""

    def propose(self, batch: DraftBatch) -> DraftProposals:
        proposals = super().propose(batch)
        return DraftProposals([[VOCAB] + drafts[1:] if drafts else drafts for drafts in proposals.draft_token_ids])


class IgnoresMaxModelLen(NgramDrafter):
    """Always proposes the full number of drafts."""

    def propose(self, batch: DraftBatch) -> DraftProposals:
        wide = DraftBatch(
            batch.req_ids, batch.token_ids, batch.num_speculative_tokens, max_model_len=1 << 30, skip=batch.skip
        )
        return super().propose(wide)


class IgnoresSkip(NgramDrafter):
    """Drafts for finished requests too."""

    def propose(self, batch: DraftBatch) -> DraftProposals:
        return super().propose(
            DraftBatch(batch.req_ids, batch.token_ids, batch.num_speculative_tokens, batch.max_model_len)
        )


class OneDraftTooMany(NgramDrafter):
    """Appends one more draft than asked for (where there is room)."""

    def propose(self, batch: DraftBatch) -> DraftProposals:
        drafts = super().propose(batch).draft_token_ids
        return DraftProposals(
            [
                d + d[-1:] if d and len(t) + len(d) < batch.max_model_len else d
                for d, t in zip(drafts, batch.token_ids, strict=True)
            ]
        )


class DropsEmptyLists(NgramDrafter):
    """Returns lists only for requests that got drafts."""

    def propose(self, batch: DraftBatch) -> DraftProposals:
        return DraftProposals([d for d in super().propose(batch).draft_token_ids if d])


class Nondeterministic(NgramDrafter):
    """Proposes random tokens."""

    def propose(self, batch: DraftBatch) -> DraftProposals:
        return DraftProposals([[] if i in batch.skip else [random.randrange(VOCAB)] for i in range(len(batch.req_ids))])


class ConsumesTheTokens(NgramDrafter):
    """Writes into the request's token array (a scratch buffer that is not its own)."""

    def propose(self, batch: DraftBatch) -> DraftProposals:
        proposals = super().propose(batch)
        for tokens in batch.token_ids:
            tokens[0] = 0
        return proposals


class ClaimsProbsItDoesNotDeclare(NgramDrafter):
    """Returns draft probabilities though produces_draft_probs is False."""

    def propose(self, batch: DraftBatch) -> DraftProposals:
        import torch

        proposals = super().propose(batch)
        total = sum(map(len, proposals.draft_token_ids))
        return DraftProposals(proposals.draft_token_ids, torch.full((total, VOCAB), 1 / VOCAB))


def test_ngram_passes_every_check_called_directly() -> None:
    drafter = NgramDrafter()
    for case in kit.CASE_NAMES:
        kit.check_proposals(drafter, ngram_batch(case), VOCAB)
    drafts = kit.check_proposals(drafter, ngram_batch("repetitive"), VOCAB)
    assert all(drafts), f"repetitive requests should all be drafted for: {drafts}"
    kit.check_max_model_len(drafter, ngram_batch("near_max_model_len"), VOCAB)
    kit.check_deterministic(drafter, ngram_batch("repetitive"), VOCAB)
    kit.check_inputs_unchanged(drafter, ngram_batch("repetitive"))
    kit.check_empty_batch(drafter, ngram_batch("empty"))


def test_an_id_equal_to_the_vocab_size_fails() -> None:
    with pytest.raises(AssertionError, match=rf"draft ids \[{VOCAB}\] are outside the vocabulary \[0, {VOCAB}\)"):
        kit.check_proposals(ProposesTheVocabSize(), ngram_batch("repetitive"), VOCAB)


def test_ignoring_max_model_len_fails() -> None:
    with pytest.raises(AssertionError, match="past max_model_len 512"):
        kit.check_max_model_len(IgnoresMaxModelLen(), ngram_batch("near_max_model_len"), VOCAB)


def test_drafting_for_skipped_requests_fails() -> None:
    with pytest.raises(AssertionError, match="request 0 .* is in skip but got drafts"):
        kit.check_proposals(IgnoresSkip(), ngram_batch("skipped_requests"), VOCAB)


def test_more_drafts_than_asked_fail() -> None:
    with pytest.raises(AssertionError, match="4 drafts, more than num_speculative_tokens=3"):
        kit.check_proposals(OneDraftTooMany(), ngram_batch("repetitive"), VOCAB)


def test_one_list_per_request_is_required() -> None:
    with pytest.raises(AssertionError, match=r"returned [0-5] draft lists for 6 requests"):
        kit.check_proposals(DropsEmptyLists(), ngram_batch("near_max_model_len"), VOCAB)


def test_random_drafts_fail_the_determinism_check() -> None:
    with pytest.raises(AssertionError, match="proposed differently for a second call"):
        kit.check_deterministic(Nondeterministic(), ngram_batch("random"), VOCAB)


def test_writing_into_the_inputs_fails() -> None:
    with pytest.raises(AssertionError, match=r"ConsumesTheTokens.propose modified DraftBatch.token_ids\[0\]"):
        kit.check_inputs_unchanged(ConsumesTheTokens(), ngram_batch("repetitive"))


def test_undeclared_draft_probs_fail() -> None:
    with pytest.raises(AssertionError, match="declare produces_draft_probs=False"):
        kit.check_proposals(ClaimsProbsItDoesNotDeclare(), ngram_batch("repetitive"), VOCAB)


def test_a_full_request_must_be_in_the_max_model_len_batch() -> None:
    case = DraftCase(((1, 2, 1),))
    batch = make_draft_batch(case, num_speculative_tokens=3, max_model_len=MAX_LEN, shape=BatchShape())
    with pytest.raises(AssertionError, match="must hold a request at max_model_len"):
        kit.check_max_model_len(NgramDrafter(), batch, VOCAB)
