"""Samplers of the defective plugin."""

import dataclasses

import torch

from patchbay.plugins.samplers.standard import StandardSampler
from patchbay_example.sampler import ArgmaxSampler


class UnavailableSampler(ArgmaxSampler):
    """Greedy argmax that claims to be unavailable everywhere, so each behavioural check would skip."""

    @classmethod
    def unavailable_reason(cls):
        return "needs the (imaginary) FooAccelerator"


class EagerSampler(ArgmaxSampler):
    """A correct greedy sampler; its defect is in how its plugin registers it."""


class MeanCentredSampler(StandardSampler):
    """The standard sampler, but random rows are centred on their mean first: a masked (-inf) row becomes NaN."""

    def sample(self, logits, metadata):
        if not metadata.all_greedy:
            random_rows = (metadata.temperature > 0)[:, None]
            logits = torch.where(random_rows, logits - logits.mean(dim=-1, keepdim=True), logits)
        return super().sample(logits, metadata)


class LogprobsAtTemperatureOneSampler(StandardSampler):
    """The standard sampler, but when the batch asks for logprobs its random rows are drawn at temperature 1."""

    def sample(self, logits, metadata):
        if metadata.max_num_logprobs is not None and not metadata.all_greedy:
            temperature = torch.where(metadata.temperature > 0, 1.0, 0.0)
            metadata = dataclasses.replace(metadata, temperature=temperature)
        return super().sample(logits, metadata)


class RestartingGeneratorSampler(StandardSampler):
    """The standard sampler drawing seeded rows from a copy of their generator: the stream restarts every step."""

    def sample(self, logits, metadata):
        copies = {}
        for row, generator in metadata.generators.items():
            copies[row] = torch.Generator(device=generator.device)
            copies[row].set_state(generator.get_state())
        return super().sample(logits, dataclasses.replace(metadata, generators=copies))
