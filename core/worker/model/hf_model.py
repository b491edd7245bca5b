"""Running Hugging Face decoder-only models through patchbay's attention backends.

patchbay registers an attention function with transformers'
``AttentionInterface``.  The model runs on one flattened sequence of this
step's tokens (batch size 1, explicit ``position_ids``); every layer's
attention call is routed to the selected backend, which reads and writes
the paged KV cache.  transformers builds no attention mask for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from patchbay.interfaces import AttentionLayerSpec, Checkpoint, WeightFormat
from patchbay.scheduling.kv_cache_spec import KVCacheSpec
from patchbay.toolkit.forward_context import attend
from patchbay.worker.model.packed_weights import build_empty_model, fill_weights, packed_weight_of, parameter_slots
from patchbay.toolkit.hidden_states import AuxHiddenStates
from patchbay.toolkit.model_files import ModelLoadError
from patchbay.toolkit.transformers_layers import architecture_name, attention_layer_specs, text_config
from patchbay.worker.model.vision import VisionEncoder, is_vision_language

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ATTN_IMPLEMENTATION = "patchbay"

LlamaStyleModule = Any
"""A transformers module used through its architecture's attribute names (``self_attn.q_proj``, ``layer_idx``,
``variance_epsilon`` ...): torch types such attributes only as ``Tensor | Module``, so code relying on them
types the module as this."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.int8}


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def patchbay_attention(
    module: LlamaStyleModule,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-interface function for ``attn_implementation="patchbay"``: layer ``module``'s
    queries, keys and values (``[1, heads, tokens, head_size]``, any strides) through the step's backend over
    the paged cache; returns ``([1, tokens, heads, head_size], None)``."""
    # Backends take [tokens, heads, head_size]: transposed views of what transformers hands.
    output = attend(module.layer_idx, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1))
    return output.unsqueeze(0), None


def register_attention_function() -> None:
    """Make ``attn_implementation="patchbay"`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, patchbay_attention)


@dataclass(frozen=True)
class ModelShape:
    """What the runner needs to know of a loaded model."""

    architecture: str
    num_layers: int
    vocab_size: int
    hidden_size: int
    max_position_embeddings: int | None
    eos_token_ids: tuple[int, ...]


class HFCausalLM:
    """A transformers causal LM whose attention runs through patchbay.

    A vision-language model (LLaVA, Qwen2-VL) is one too: its language model is the decoder, and
    :attr:`vision` encodes its images.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        layer_specs: dict[int, AttentionLayerSpec],
        shape: ModelShape,
        vision: VisionEncoder | None = None,
    ) -> None:
        self.model = model
        self.layer_specs = layer_specs
        self.shape = shape
        self.vision = vision
        """The image encoder of a vision-language model (``None``: the model takes text only)."""
        self.layers_elsewhere: frozenset[int] = frozenset()
        """Decoder layers another pipeline stage runs (set when the model is split into stages)."""
        self.served_by = ""
        """The architecture plugin that built the model (``""``: loaded by :meth:`load`, outside a run)."""
        self._decoder = model.model.language_model if vision is not None else model.base_model
        self._embed_tokens = model.get_input_embeddings()
        self._lm_head = model.get_output_embeddings()
        self._final_soft_cap = getattr(model.config, "final_logit_softcapping", None)
        self.logits_scale = 1.0
        """Multiplies the LM head's output (the architecture plugin's ``ArchitectureModel.logits_scale``)."""

    @classmethod
    def load(cls, model_dir: Path, *, dtype: str, device: torch.device) -> HFCausalLM:
        """Load ``model_dir`` as the generic path does (transformers' classes, attention through patchbay); an
        architecture that path cannot run raises :class:`ModelLoadError`.  A run loads through its architecture
        plugin instead (:func:`patchbay.worker.model.architectures.load_architecture`)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_dir)
        architecture = architecture_name(config)
        model = load_transformers_model(model_dir, config, architecture, dtype=dtype, device=device)
        return cls.from_module(model, attention_layer_specs(model, architecture), model_dir, architecture)

    @classmethod
    def from_module(
        cls, model: Any, layer_specs: dict[int, AttentionLayerSpec], model_dir: Path, architecture: str
    ) -> HFCausalLM:
        """Wrap a loaded transformers-shaped ``model`` (an architecture plugin's) with its layer specs; a
        vision-language model's image encoder comes with it."""
        config = model.config
        vision = VisionEncoder(model, architecture) if is_vision_language(config) else None
        return cls(model, layer_specs, _shape(model_dir, config, architecture, len(layer_specs)), vision=vision)

    @property
    def holds_packed_weights(self) -> bool:
        """Whether a weight format holds some of the model's weights packed (its own products multiply by them)."""
        return any(packed_weight_of(module) is not None for module in self.model.modules())

    def kv_cache_specs(self, block_size: int, dtype: str) -> dict[str, KVCacheSpec]:
        """Each attention layer's KV-cache spec, by layer name (in layer order)."""
        return {
            spec.layer_name: KVCacheSpec(
                block_size, spec.num_kv_heads, spec.head_size, dtype, spec.sliding_window, latent=spec.latent
            )
            for _, spec in sorted(self.layer_specs.items())
        }

    @torch.inference_mode()
    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, inputs_embeds: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]`` of one flattened step (inside a forward context).

        ``positions`` is ``[num_tokens]``, or ``[3, num_tokens]`` M-RoPE positions for a Qwen2-VL;
        ``inputs_embeds`` (``[num_tokens, hidden]``, images merged in) replaces the embedding of ``input_ids``.
        """
        if inputs_embeds is None:
            output = self._decoder(
                input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(-2), use_cache=False
            )
        else:
            output = self._decoder(
                inputs_embeds=inputs_embeds.unsqueeze(0), position_ids=positions.unsqueeze(-2), use_cache=False
            )
        return output.last_hidden_state[0]

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The language model's input embeddings ``[num_tokens, hidden]`` of ``input_ids``."""
        return self._embed_tokens(input_ids)

    def capture_hidden_states(self, layers: Sequence[int]) -> AuxHiddenStates:
        """Keep the outputs of decoder ``layers`` from each forward pass (see
        :class:`~patchbay.toolkit.hidden_states.AuxHiddenStates`); layers of other pipeline stages are an error."""
        return AuxHiddenStates(
            self._decoder,
            self.shape.num_layers,
            layers,
            held_elsewhere=self.layers_elsewhere,
            name=type(self.model).__name__,
        )

    @torch.inference_mode()
    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` of the given hidden states (with the vocabulary sharded over
        tensor-parallel ranks, the LM head's hook gathers every rank's slice: call it on all ranks alike)."""
        logits = self._lm_head(hidden_states).float()
        if self.logits_scale != 1.0:
            logits = logits * self.logits_scale
        if self._final_soft_cap:
            logits = torch.tanh(logits / self._final_soft_cap) * self._final_soft_cap
        return logits


def load_transformers_model(
    model_dir: Path,
    config: Any,
    architecture: str,
    *,
    dtype: str,
    device: torch.device,
    attention: str = "patchbay",
    weight_format: WeightFormat | None = None,
    checkpoint: Checkpoint | None = None,
) -> PreTrainedModel:
    """``model_dir``'s model through transformers' own classes, in ``dtype`` on ``device``, in eval mode: a causal
    LM, or a vision-language model (its language model attending through ``attention``, its vision tower through
    sdpa).  ``attention="patchbay"`` routes attention to patchbay's backends and refuses a class that does not
    take transformers' AttentionInterface; another implementation (``"eager"``) loads any class, for an
    architecture plugin that replaces the attention forwards itself.  Unsupported models raise
    :class:`ModelLoadError`.  With a ``weight_format``, the modules are built empty and the format fills them from
    ``checkpoint`` (linear weights packed where it packs them, :mod:`patchbay.worker.model.packed_weights`)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(
            f"{architecture}: encoder-decoder models are not supported; patchbay runs decoder-only LMs"
        )
    if attention == ATTN_IMPLEMENTATION:
        register_attention_function()
    vision_language = is_vision_language(config)
    auto_class: Any = AutoModelForImageTextToText if vision_language else AutoModelForCausalLM
    model_class = auto_class._model_mapping.get(type(config), None)
    if model_class is None:
        what = "image-text-to-text model" if vision_language else "causal language model"
        raise ModelLoadError(f"{architecture} ({config.model_type}) is not a {what} transformers knows")
    if attention == ATTN_IMPLEMENTATION and not getattr(model_class, "_supports_attention_backend", False):
        raise ModelLoadError(
            f"{architecture} does not support transformers' AttentionInterface, so its attention "
            "cannot be routed to patchbay's paged KV cache"
        )
    implementation: Any = (
        {"text_config": attention, "vision_config": "sdpa", "": "sdpa"} if vision_language else attention
    )
    if weight_format is not None:
        if vision_language:
            raise ModelLoadError(
                f"{architecture}: a vision-language model loads through transformers, not a weight format"
            )
        source = checkpoint if checkpoint is not None else Checkpoint(model_dir, config.to_dict())
        model = build_empty_model(config, dtype=torch_dtype(dtype), attn_implementation=implementation)
        slots = parameter_slots(model)
        tensors = weight_format.load(source, slots, dtype=dtype)
        fill_weights(model, tensors, slots, dtype=torch_dtype(dtype), source=str(source.path))
        return model
    model = auto_class.from_pretrained(model_dir, dtype=torch_dtype(dtype), attn_implementation=implementation)
    model.to(device).eval()
    return model


def _shape(model_dir: Path, config: Any, architecture: str, num_layers: int) -> ModelShape:
    from transformers import GenerationConfig

    eos = _eos_token_ids(model_dir, config, GenerationConfig)
    language = text_config(config)
    return ModelShape(
        architecture=architecture,
        num_layers=num_layers,
        vocab_size=language.vocab_size,
        hidden_size=language.hidden_size,
        max_position_embeddings=getattr(language, "max_position_embeddings", None),
        eos_token_ids=eos,
    )


def _eos_token_ids(model_dir: Path, config: Any, generation_config_class: Any) -> tuple[int, ...]:
    try:
        eos = generation_config_class.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
