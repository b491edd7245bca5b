"""The greedy sampler: the argmax of each row, with logprobs of the raw logits on request."""

from __future__ import annotations

from typing import ClassVar

import torch

from patchbay.interfaces import Sampler, SamplerCapabilities, SamplerOutput, SamplingMetadata
from patchbay.toolkit.fused_ops import argmax_rows


class GreedySampler(Sampler):
    """Picks the most likely token of every row; rejects requests that ask for random sampling."""

    contract_version = "1.1"

    capabilities: ClassVar[SamplerCapabilities] = SamplerCapabilities(
        devices=("cpu", "cuda", "mps"),
        supported_params=frozenset({"logprobs"}),
        supports_random=False,
        logprobs_mode="raw",
    )

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        sampled = argmax_rows(logits).unsqueeze(-1)
        if metadata.max_num_logprobs is None:
            return SamplerOutput(sampled_token_ids=sampled)
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        top_logprobs, top_ids = logprobs.topk(metadata.max_num_logprobs, dim=-1)
        sampled_logprob = logprobs.gather(-1, sampled)
        ranks = (logprobs > sampled_logprob).sum(dim=-1) + 1
        return SamplerOutput(
            sampled_token_ids=sampled,
            logprob_token_ids=torch.cat([sampled, top_ids], dim=-1),
            logprobs=torch.cat([sampled_logprob, top_logprobs], dim=-1),
            sampled_token_ranks=ranks,
        )
