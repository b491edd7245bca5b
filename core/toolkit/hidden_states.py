"""The outputs of chosen decoder layers, captured during the model's own forward pass (for drafters that read
intermediate layers, such as EAGLE-3, and for training them on what inference will see)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["AuxHiddenStates", "HiddenStatesError"]


class HiddenStatesError(RuntimeError):
    """Layers whose outputs cannot be captured here; the message says which and why."""


class AuxHiddenStates:
    """Keeps the outputs of chosen decoder layers from each forward pass, through forward hooks.

    For drafters reading intermediate layers (EAGLE-3): the hooks copy
    nothing and run no extra pass; they keep a reference to each chosen
    layer's output of the latest forward until the next forward replaces
    it.  Registered only when a drafter asks, so a run without one pays
    nothing.  Layer ``i``'s output is transformers'
    ``output_hidden_states[i + 1]``, except for the last layer, whose entry
    there has been through the final norm and whose output here has not.
    """

    def __init__(
        self,
        decoder: nn.Module,
        num_layers: int | None,
        layers: Sequence[int],
        *,
        held_elsewhere: frozenset[int] = frozenset(),
        name: str = "the model",
    ) -> None:
        """Hook layers ``layers`` (indices in ``[0, num_layers)``, repeats allowed) of ``decoder``'s ``layers`` list.

        ``held_elsewhere``: layers another pipeline stage runs (asking for one is an error); ``name`` names the
        model in errors.  :meth:`of_transformers_model` hooks a plain transformers causal LM.
        """
        decoder_layers = getattr(decoder, "layers", None)
        if not isinstance(decoder_layers, nn.ModuleList) or len(decoder_layers) != num_layers:
            raise HiddenStatesError(
                f"{name}: its decoder has no `layers` list of {num_layers} layers, so their hidden states "
                "cannot be captured"
            )
        elsewhere = sorted(held_elsewhere.intersection(layers))
        if elsewhere:
            raise HiddenStatesError(
                f"decoder layers {elsewhere} run on other pipeline stages, so their hidden states "
                "cannot be captured here (runtime.pipeline_parallel_size)"
            )
        self.layers = tuple(layers)
        self._outputs: dict[int, torch.Tensor] = {}
        self._handles = [
            decoder_layers[index].register_forward_hook(self._keeper(index)) for index in sorted(set(self.layers))
        ]

    @classmethod
    def of_transformers_model(cls, model: nn.Module, layers: Sequence[int]) -> AuxHiddenStates:
        """Hook ``layers`` of a plain transformers causal LM (its ``base_model``'s ``layers``)."""
        config = getattr(model, "config", None)
        text_config = config.get_text_config() if config is not None else None
        return cls(
            getattr(model, "base_model", model),
            getattr(text_config, "num_hidden_layers", None),
            layers,
            name=type(model).__name__,
        )

    def _keeper(self, index: int) -> Any:
        def keep(module: nn.Module, args: Any, output: Any) -> None:
            self._outputs[index] = output[0] if isinstance(output, tuple) else output

        return keep

    def latest(self) -> list[torch.Tensor]:
        """The chosen layers' outputs of the latest forward of one flattened step, ``[num_tokens, hidden]`` each,
        in :attr:`layers` order."""
        return [output[0] for output in self.latest_batched()]

    def latest_batched(self) -> list[torch.Tensor]:
        """As :meth:`latest`, keeping the batch dimension: ``[batch, tokens, hidden]`` each."""
        missing = [index for index in self.layers if index not in self._outputs]
        if missing:
            raise RuntimeError(f"no output captured yet for decoder layers {missing}: no forward pass has run")
        return [self._outputs[index] for index in self.layers]

    def remove(self) -> None:
        """Unhook the layers and drop the kept outputs."""
        for handle in self._handles:
            handle.remove()
        self._handles, self._outputs = [], {}
