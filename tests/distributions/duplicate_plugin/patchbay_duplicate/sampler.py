"""A sampler that always picks token 0: enough to be a real class behind the clashing name."""

from __future__ import annotations

from typing import ClassVar

import torch

from patchbay.interfaces import Sampler, SamplerCapabilities, SamplerOutput, SamplingMetadata


class LowestIdSampler(Sampler):
    """Returns token 0 for every row (a stand-in for a real sampler)."""

    capabilities: ClassVar[SamplerCapabilities] = SamplerCapabilities(
        supported_params=frozenset(), supports_random=False
    )

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        return SamplerOutput(sampled_token_ids=torch.zeros(logits.shape[0], 1, dtype=torch.long))
