"""A temperature sampler written against sampler contract 1.0, using only what that version offered."""

from __future__ import annotations

from typing import ClassVar

import torch

from patchbay.interfaces import Sampler, SamplerCapabilities, SamplerOutput, SamplingMetadata


class LegacyTemperatureSampler(Sampler):
    """Greedy rows take the argmax; the others draw from softmax(logits / temperature) with their generator."""

    contract_version = "1.0"

    capabilities: ClassVar[SamplerCapabilities] = SamplerCapabilities(
        devices=("cpu",), dtypes=("float32",), supported_params=frozenset({"temperature", "seed"})
    )

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        if metadata.max_num_logprobs is not None:
            raise ValueError("legacy_temperature does not return logprobs")
        chosen = logits.argmax(dim=-1)
        for row in range(logits.shape[0]):
            temperature = float(metadata.temperature[row]) if metadata.temperature is not None else 0.0
            if temperature <= 0.0:
                continue
            probs = torch.softmax(logits[row].double() / temperature, dim=-1)
            generator = metadata.generators.get(row)
            chosen[row] = torch.multinomial(probs, 1, generator=generator)[0]
        return SamplerOutput(sampled_token_ids=chosen.unsqueeze(-1))
