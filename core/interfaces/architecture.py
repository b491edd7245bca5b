"""Architectures: what turns a Hugging Face model directory into a decoder patchbay runs over its paged KV cache.

An architecture plugin serves one or more Hugging Face ``architectures`` names
(``LlamaForCausalLM``, ``DeepseekV3ForCausalLM``, ...).  The runner reads the
model's ``config.json``, picks the plugin (``model.architecture``: a name, or
``auto``, the highest-priority plugin that serves the config's first
``architectures`` name) and calls its :meth:`Architecture.load` with a
:class:`ModelSource`.  The plugin returns an :class:`ArchitectureModel`: the
module and, per attention layer, an :class:`~patchbay.interfaces.AttentionLayerSpec`
that says what the layer writes into the paged cache (full attention, a
sliding window, or MLA's latent rows).

Each attention layer reaches the run's attention backend through
:func:`patchbay.toolkit.forward_context.attend` with its layer index: the
runner sets up the forward context around every pass.  A plugin built on
transformers' own model code gets that for free from
:meth:`ModelSource.load_transformers`, which routes transformers'
``AttentionInterface`` there.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from patchbay.interfaces.base import Capabilities, Plugin, ServingConfig

if TYPE_CHECKING:
    from pydantic import BaseModel

    from patchbay.interfaces.attention import AttentionLayerSpec


@dataclass(frozen=True)
class ArchitectureConfig(ServingConfig):
    """The model a run asks an architecture plugin to serve."""

    architecture: str = "LlamaForCausalLM"
    """The first name of the model's ``config.json`` ``architectures`` (its transformers config class name when
    that list is missing)."""
    tensor_parallel_size: int = 1
    """Ranks the model is sharded over (``runtime.tensor_parallel_size``)."""


@dataclass(frozen=True)
class ArchitectureCapabilities(Capabilities):
    """Which Hugging Face architectures a plugin serves, and what of each it can shard."""

    architectures: tuple[str, ...] = ()
    """Hugging Face ``architectures`` names the plugin serves (``patchbay plugins`` lists them)."""
    other_transformers_architectures: bool = False
    """Also try any other architecture transformers knows (the generic plugin): whether it really runs is only
    known when :meth:`Architecture.load` reads its classes, which then refuses it with the reason."""
    tensor_parallel: tuple[str, ...] = ()
    """The served architectures the plugin's model can be sharded over tensor-parallel ranks."""
    priority: int = 0
    """Rank for ``model.architecture: auto``: among plugins that serve a model, the highest wins."""

    def serves(self, architecture: str) -> bool:
        """Whether ``architecture`` is one of :attr:`architectures` (or any, with
        :attr:`other_transformers_architectures`)."""
        return architecture in self.architectures or self.other_transformers_architectures

    def reasons(self, config: ServingConfig) -> list[str]:
        found = super().reasons(config)
        if not isinstance(config, ArchitectureConfig):
            return found
        if not self.serves(config.architecture):
            found.append(
                f"architecture {config.architecture} not served (serves {', '.join(self.architectures) or 'none'})"
            )
        elif config.tensor_parallel_size > 1 and config.architecture not in self.tensor_parallel:
            found.append(
                f"{config.architecture} cannot be sharded over {config.tensor_parallel_size} tensor-parallel ranks "
                f"(shards {', '.join(self.tensor_parallel) or 'none'})"
            )
        return found


@dataclass(frozen=True)
class ModelSource:
    """What :meth:`Architecture.load` reads a model from."""

    model_dir: Path
    """The model's Hugging Face directory (``config.json``, weights, tokenizer)."""
    config: Any
    """The model's transformers config (``AutoConfig.from_pretrained(model_dir)``)."""
    architecture: str
    """The name the plugin was chosen for (:attr:`ArchitectureConfig.architecture`)."""
    dtype: str
    """The weights' dtype: ``float32``, ``bfloat16`` or ``float16``."""
    device: str
    """Where the weights go: ``cpu``, ``cuda``, ``cuda:1``, ..."""
    load_transformers: Callable[..., Any]
    """``load_transformers(attention="patchbay")``: the model as transformers' own classes build it, with the
    weights of :attr:`model_dir` in :attr:`dtype` on :attr:`device`, in eval mode: what patchbay's generic path
    loads.  ``attention="patchbay"`` routes every layer's attention through transformers' ``AttentionInterface``
    to the run's backend (a class that does not take the interface is refused, naming it);
    ``attention="eager"`` loads any causal LM class, for a plugin that replaces its attention forwards with
    its own calls to :func:`patchbay.toolkit.forward_context.attend`.  Weights come only through this
    function, so the formats patchbay reads (safetensors, converted GGUF) stay one place's concern."""


@dataclass
class ArchitectureModel:
    """What :meth:`Architecture.load` returns: the module and what each attention layer writes to the cache."""

    module: Any
    """The causal LM as a ``torch.nn.Module`` shaped as transformers' are: ``module.base_model`` is the
    decoder, called as ``decoder(input_ids=..., position_ids=..., use_cache=False)`` (or ``inputs_embeds=``
    instead of ``input_ids``) on one flattened step (batch 1) and returning an object whose
    ``last_hidden_state`` is ``[1, tokens, hidden]``; ``module.get_input_embeddings()`` and
    ``module.get_output_embeddings()`` are the embedding and the LM head; ``module.config`` is the model's
    transformers config.  Its decoder's ``layers`` (an ``nn.ModuleList``) are what pipeline stages split, and
    projections named as Llama's (``q_proj`` ... ``down_proj``) are what tensor-parallel ranks shard."""
    layer_specs: dict[int, AttentionLayerSpec]
    """Each attention layer's spec, by the layer index it passes to ``attend``: its ``layer_name`` (the module's
    name, the key of its KV cache), heads and head size as it hands them to ``attend``, its scale, sliding window,
    soft cap, and for MLA its ``value_size``.  The runner sizes and groups the paged cache from these alone."""
    logits_scale: float = 1.0
    """Multiplies the LM head's output, where the model's own forward scales its logits after the head (Granite
    divides them by ``logits_scaling``, Cohere multiplies them by ``logit_scale``); a config's
    ``final_logit_softcapping`` (Gemma 2) is applied after it."""


class Architecture(Plugin):
    """An architecture plugin: loads the models of the Hugging Face architectures it serves, attention routed to
    patchbay's backends."""

    kind: ClassVar[str] = "architecture"
    capabilities: ClassVar[ArchitectureCapabilities] = ArchitectureCapabilities()

    def __init__(self, options: BaseModel | None = None) -> None:
        """Create the plugin with its validated ``options`` (``None``: the defaults)."""
        self.options = options if options is not None else self.Options()

    @abstractmethod
    def load(self, source: ModelSource) -> ArchitectureModel:
        """Build the model of ``source`` with its weights, and declare its attention layers.

        Called once per rank, before any step.  A model the plugin cannot run after all (a config value it does
        not implement) raises :class:`patchbay.toolkit.model_files.ModelLoadError` naming the architecture and
        the value.  The module's attention layers must call
        :func:`patchbay.toolkit.forward_context.attend` with the layer indices of :attr:`ArchitectureModel.layer_specs`,
        and with the shapes those specs declare.
        """
