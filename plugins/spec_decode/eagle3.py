"""The ``eagle3`` drafter (EAGLE-3): the ``eagle`` drafter fed a low, a middle and a high target layer.

EAGLE-3 (Li et al., 2025) replaces EAGLE-1's input feature, the target's
final hidden state, with the outputs of three of its layers: the runner
captures them during the target's own forward pass (see
:meth:`~patchbay.interfaces.Drafter.aux_hidden_state_layers`), and an fc
projects their concatenation ``[num_tokens, 3 * hidden]`` to hidden size
(:class:`~patchbay.plugins.spec_decode.heads.Eagle3DraftModel`).  The
drafting steps after the cache-filling pass feed back the draft layer's own
output instead, as EAGLE-3 does.

Why a subclass of :class:`~patchbay.plugins.spec_decode.eagle.EagleDrafter`
rather than a ``variant`` option: everything but that input projection, the
paged KV cache and scratch blocks, the shifted cache fill, the drafting
loop, is EAGLE-1's and stays in one place; the two kinds of weights stay
distinct names (``kind`` in ``config.json``, their own default directory),
so ``path: auto`` can never load one as the other.

Layers: the trained weights' ``config.json`` records the ones they were
trained on; an untrained layer reads ``options.aux_layers``, by default
vLLM's ``(2, L // 2, L - 3)`` of the target's ``L`` layers.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from pydantic import BaseModel

from patchbay.interfaces import DrafterCapabilities, DraftStep
from patchbay.interfaces.drafter import resolve_aux_layers
from patchbay.plugins.spec_decode.eagle import EagleDrafter, EagleOptions
from patchbay.plugins.spec_decode.heads import Eagle3DraftModel, TargetParts, default_aux_layers, text_config

KIND = "eagle3"


class Eagle3Options(EagleOptions):
    """Options of the ``eagle3`` drafter."""

    aux_layers: list[int] | None = None
    """Untrained layer only: the target layers it reads (negative: from the last), default ``(2, L // 2, L - 3)``."""


class Eagle3Drafter(EagleDrafter):
    """EAGLE-3 drafting: EAGLE-1's paged drafting over an fc of three target layers' outputs."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = Eagle3Options
    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities(
        devices=("cpu", "cuda", "mps"),
        needs_attention_metadata=True,
        reads_vocabulary_weights=True,
    )
    weights_kind: ClassVar[str] = KIND
    untrained_options: ClassVar[tuple[str, ...]] = ("intermediate_size", "aux_layers")

    draft_model: Eagle3DraftModel | None = None

    def aux_hidden_state_layers(self) -> tuple[int, ...]:
        """The layers the loaded draft model was built (or trained) to read."""
        if self.draft_model is None:
            raise RuntimeError("eagle3: its target layers are known only after load()")
        return self.draft_model.aux_layers

    def _trained_model(self, config: dict[str, Any]) -> Eagle3DraftModel:
        return Eagle3DraftModel(
            config["hidden_size"],
            config["num_heads"],
            config["num_kv_heads"],
            config["head_size"],
            config["intermediate_size"],
            config["rms_norm_eps"],
            config["aux_layers"],
            config.get("draft_vocab_size"),
        )

    def _untrained_model(self, parts: TargetParts, target: Any) -> Eagle3DraftModel:
        options: Eagle3Options = self.options  # type: ignore[assignment]
        num_layers = text_config(target).num_hidden_layers
        layers = (
            default_aux_layers(num_layers)
            if options.aux_layers is None
            else resolve_aux_layers(options.aux_layers, num_layers, drafter=KIND)
        )
        return Eagle3DraftModel.for_target(parts, options.intermediate_size, aux_layers=layers)

    def _target_inputs(self, step: DraftStep, rows: torch.Tensor) -> torch.Tensor:
        """The captured layers' outputs at ``rows``, concatenated: ``[len(rows), len(aux_layers) * hidden]``."""
        aux = step.aux_hidden_states
        expected = len(self.aux_hidden_state_layers())
        if aux is None or len(aux) != expected:
            raise ValueError(
                f"eagle3 needs DraftStep.aux_hidden_states of its {expected} layers "
                f"{self.aux_hidden_state_layers()}; got {'None' if aux is None else len(aux)}"
            )
        return torch.cat([states[rows] for states in aux], dim=-1)
