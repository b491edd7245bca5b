"""Defective architectures: each builds transformers' model as the generic plugin does, then gets one thing wrong."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch

from patchbay.interfaces import Architecture, ArchitectureCapabilities, ArchitectureModel, ModelSource
from patchbay.toolkit.transformers_layers import attention_layer_specs


class _Generic(Architecture):
    contract_version = "1.1"

    def load(self, source: ModelSource) -> ArchitectureModel:
        module = source.load_transformers()
        return ArchitectureModel(module, attention_layer_specs(module, source.architecture))


class ForgetsWindowArchitecture(_Generic):
    """Declares every Mistral layer full attention: its sliding window is never applied."""

    capabilities: ClassVar[ArchitectureCapabilities] = ArchitectureCapabilities(architectures=("MistralForCausalLM",))

    def load(self, source: ModelSource) -> ArchitectureModel:
        built = super().load(source)
        specs = {index: dataclasses.replace(spec, sliding_window=None) for index, spec in built.layer_specs.items()}
        return ArchitectureModel(built.module, specs)


class OneCacheArchitecture(_Generic):
    """Every Llama layer attends as layer 0: all of them write layer 0's cache, the others stay empty."""

    capabilities: ClassVar[ArchitectureCapabilities] = ArchitectureCapabilities(architectures=("LlamaForCausalLM",))

    def load(self, source: ModelSource) -> ArchitectureModel:
        built = super().load(source)
        for module in built.module.modules():
            if hasattr(module, "layer_idx") and hasattr(module, "scaling"):
                module.layer_idx = 0
        return built


class CountingPositions:
    """A decoder ``forward`` that numbers positions itself: a call of several tokens is a whole prompt from 0, a
    call of one token follows the previous call.  Right for one request prefilled at once, then decoded."""

    def __init__(self, decoder: Any) -> None:
        self.decoder = decoder
        self.next_position = 0

    def __call__(self, input_ids=None, position_ids=None, inputs_embeds=None, **kwargs):
        tokens = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        start = self.next_position if tokens == 1 else 0
        self.next_position = start + tokens
        positions = torch.arange(start, start + tokens).unsqueeze(0)
        return type(self.decoder).forward(
            self.decoder, input_ids=input_ids, position_ids=positions, inputs_embeds=inputs_embeds, **kwargs
        )


class CountsPositionsArchitecture(_Generic):
    """Ignores the runner's positions and counts them itself (:class:`CountingPositions`)."""

    capabilities: ClassVar[ArchitectureCapabilities] = ArchitectureCapabilities(architectures=("LlamaForCausalLM",))

    def load(self, source: ModelSource) -> ArchitectureModel:
        built = super().load(source)
        decoder = built.module.base_model
        decoder.forward = CountingPositions(decoder)
        return built
