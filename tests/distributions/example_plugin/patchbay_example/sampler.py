"""``example_argmax``: greedy decoding, the smallest sampler that can serve a run."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, PositiveInt

from patchbay.interfaces import (
    RejectionSampler,
    Sampler,
    SamplerCapabilities,
    SamplerOutput,
    SamplingMetadata,
    SpecDecodeMetadata,
)


class ArgmaxOptions(BaseModel):
    """Options of ``sampler: {name: example_argmax, options: {...}}``."""

    model_config = ConfigDict(extra="forbid")

    vocab_limit: PositiveInt | None = None
    """Consider only token ids below this (models often pad their vocabulary); ``None``: all of it."""


class ArgmaxSampler(Sampler):
    """Takes the most likely token of every row; greedy only, no logprobs, no sampling parameters."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = ArgmaxOptions
    capabilities: ClassVar[SamplerCapabilities] = SamplerCapabilities(
        devices=("cpu", "cuda"),
        supported_params=frozenset(),
        supports_random=False,
    )

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.max_num_logprobs is not None:
            raise ValueError("example_argmax does not return logprobs; choose another sampler for this run")
        if self.options.vocab_limit is not None:
            logits = logits[:, : self.options.vocab_limit]
        return SamplerOutput(sampled_token_ids=logits.argmax(dim=-1, keepdim=True))


class ArgmaxVerifier(RejectionSampler):
    """Greedy verification: accepts drafts while they equal the target's argmax, then adds the target's token."""

    contract_version = "1.1"

    capabilities: ClassVar[SamplerCapabilities] = SamplerCapabilities(
        role="verify",
        devices=("cpu", "cuda"),
        supported_params=frozenset(),
        supports_random=False,
    )

    def verify(
        self,
        metadata: SpecDecodeMetadata,
        draft_probs: torch.Tensor | None,
        target_logits: torch.Tensor,
        bonus_token_ids: torch.Tensor,
        sampling: SamplingMetadata,
    ) -> torch.Tensor:
        target = target_logits.argmax(dim=-1).tolist()
        drafts = metadata.draft_token_ids.tolist()
        width = max(metadata.num_draft_tokens, default=0) + 1
        output = torch.full((len(metadata.num_draft_tokens), width), -1, dtype=torch.long)
        start = 0
        for row, count in enumerate(metadata.num_draft_tokens):
            accepted = []
            for draft, best in zip(drafts[start : start + count], target[start : start + count], strict=True):
                accepted.append(best)
                if draft != best:
                    break
            else:
                accepted.append(int(bonus_token_ids[row, 0]))
            output[row, : len(accepted)] = torch.tensor(accepted)
            start += count
        return output
