"""The ``standard`` sampler: vLLM's sampling pipeline, vectorised over the rows of a step."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import SAMPLING_PARAMS, Sampler, SamplerCapabilities, SamplerOutput, SamplingMetadata
from patchbay.plugins.samplers import _processing
from patchbay.toolkit.fused_ops import argmax_rows


class StandardOptions(BaseModel):
    """Options of ``sampler: {name: standard, options: {...}}``."""

    model_config = ConfigDict(extra="forbid")

    logprobs_mode: Literal["raw", "processed"] = "raw"
    """``raw``: log-softmax of the logits as given to the sampler, before any processing.
    ``processed``: log-softmax of the logits the token was chosen from (after the mask, bad words,
    min_tokens, logit bias and penalties; for random rows also after temperature, min-p, top-k and
    top-p, so filtered tokens have ``-inf``)."""


class StandardSampler(Sampler):
    """Greedy and random sampling with every sampling parameter, in vLLM's order.

    Per row: (a) allowed-token mask, (b) bad words, (c) ``min_tokens`` and
    logit bias, (d) repetition, frequency and presence penalties; then greedy
    rows (temperature 0) take the argmax, and random rows are divided by their
    temperature, filtered by min-p, top-k and top-p, and sampled.  Seeded rows
    draw only from their own generator; greedy rows draw nothing.  Logprobs
    are ``raw`` by default (the ``logprobs_mode`` option); the sampled token's
    rank is 1 plus the number of tokens with a strictly larger logprob.
    """

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = StandardOptions
    options: StandardOptions  # an instance of Options: plugin_options() validated it
    capabilities: ClassVar[SamplerCapabilities] = SamplerCapabilities(
        devices=("cpu", "cuda", "mps"),
        # prompt_logprobs is listed although the runner computes prompt logprobs itself (from the
        # prompt's logits, never through this sampler): a run asking for them is served.
        supported_params=SAMPLING_PARAMS,
        supports_random=True,
        logprobs_mode="raw",
    )

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row; see the class docstring for the order.  ``logits`` is not modified."""
        processed = _processing.apply_logits_processors(logits, metadata)
        sampled = argmax_rows(processed)
        processed_logprobs = metadata.max_num_logprobs is not None and self.options.logprobs_mode == "processed"
        if not metadata.all_greedy:
            random_rows = (metadata.temperature > 0).nonzero().squeeze(1)
            filtered = self._filter_random_rows(processed, random_rows, metadata)
            sampled[random_rows] = self._draw(filtered, random_rows, metadata.generators)
            if processed_logprobs:
                processed = processed.clone() if processed is logits else processed
                processed[random_rows] = filtered
        sampled = sampled.unsqueeze(1)
        if metadata.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        source = processed if processed_logprobs else logits
        return _with_logprobs(sampled, torch.log_softmax(source.float(), dim=-1), metadata.max_num_logprobs)

    @staticmethod
    def _filter_random_rows(
        processed: torch.Tensor, random_rows: torch.Tensor, metadata: SamplingMetadata
    ) -> torch.Tensor:
        def pick(values: torch.Tensor | None) -> torch.Tensor | None:
            return None if values is None else values[random_rows]

        return _processing.apply_sampling_filters(
            processed[random_rows],
            metadata.temperature[random_rows],
            min_p=pick(metadata.min_p),
            top_k=pick(metadata.top_k),
            top_p=pick(metadata.top_p),
        )

    @staticmethod
    def _draw(
        filtered: torch.Tensor, random_rows: torch.Tensor, generators: dict[int, torch.Generator]
    ) -> torch.Tensor:
        # Generators are keyed by batch row; the filtered rows are numbered among random rows only.
        by_position = {
            position: generators[row] for position, row in enumerate(random_rows.tolist()) if row in generators
        }
        return _processing.sample_from_probs(filtered.softmax(dim=-1), by_position)


def _with_logprobs(sampled: torch.Tensor, logprobs: torch.Tensor, num_logprobs: int) -> SamplerOutput:
    """The sampled token's logprob, then the top ``num_logprobs``; rank = 1 + tokens strictly more likely."""
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    sampled_logprob = logprobs.gather(1, sampled)
    ranks = (logprobs > sampled_logprob).sum(dim=-1) + 1
    return SamplerOutput(
        sampled_token_ids=sampled,
        logprob_token_ids=torch.cat([sampled, top_ids], dim=1),
        logprobs=torch.cat([sampled_logprob, top_logprobs], dim=1),
        sampled_token_ranks=ranks,
    )
