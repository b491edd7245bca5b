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
from torch import nn

from patchbay.interfaces import AttentionLayerSpec
from patchbay.scheduling.kv_cache_spec import KVCacheSpec
from patchbay.worker.model.forward_context import attend
from patchbay.worker.model.model_loader import ModelLoadError
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
        self._decoder = model.model.language_model if vision is not None else model.base_model
        self._embed_tokens = model.get_input_embeddings()
        self._lm_head = model.get_output_embeddings()
        self._final_soft_cap = getattr(model.config, "final_logit_softcapping", None)

    @classmethod
    def load(cls, model_dir: Path, *, dtype: str, device: torch.device) -> HFCausalLM:
        """Load ``model_dir`` with patchbay attention; unsupported architectures raise :class:`ModelLoadError`."""
        from transformers import AutoConfig, AutoModelForCausalLM

        register_attention_function()
        config = AutoConfig.from_pretrained(model_dir)
        architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        if getattr(config, "is_encoder_decoder", False):
            raise ModelLoadError(
                f"{architecture}: encoder-decoder models are not supported; patchbay runs decoder-only LMs"
            )
        if is_vision_language(config):
            return cls._load_vision_language(model_dir, config, architecture, dtype=dtype, device=device)
        model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
        if model_class is None:
            raise ModelLoadError(
                f"{architecture} ({config.model_type}) is not a causal language model transformers knows"
            )
        if not getattr(model_class, "_supports_attention_backend", False):
            raise ModelLoadError(
                f"{architecture} does not support transformers' AttentionInterface, so its attention "
                "cannot be routed to patchbay's paged KV cache"
            )
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch_dtype(dtype), attn_implementation=ATTN_IMPLEMENTATION
        )
        model.to(device).eval()  # type: ignore[arg-type]  # transformers' typing of its wrapped to() misses self
        return cls(model, *_specs_and_shape(model, model_dir, config, architecture))

    @classmethod
    def _load_vision_language(
        cls, model_dir: Path, config: Any, architecture: str, *, dtype: str, device: torch.device
    ) -> HFCausalLM:
        """A vision-language model: its language model attends through patchbay, its vision tower through
        transformers' own attention (sdpa), outside the paged cache."""
        from transformers import AutoModelForImageTextToText

        model_class = AutoModelForImageTextToText._model_mapping.get(type(config), None)
        if model_class is None:
            raise ModelLoadError(
                f"{architecture} ({config.model_type}) has a vision tower but is no image-text-to-text model "
                "transformers knows"
            )
        if not getattr(model_class, "_supports_attention_backend", False):
            raise ModelLoadError(
                f"{architecture} does not support transformers' AttentionInterface, so its attention "
                "cannot be routed to patchbay's paged KV cache"
            )
        attention = {"text_config": ATTN_IMPLEMENTATION, "vision_config": "sdpa", "": "sdpa"}
        model = AutoModelForImageTextToText.from_pretrained(
            model_dir, dtype=torch_dtype(dtype), attn_implementation=attention
        )
        model.to(device).eval()  # type: ignore[arg-type]  # transformers' typing of its wrapped to() misses self
        vision = VisionEncoder(model, architecture)
        return cls(model, *_specs_and_shape(model, model_dir, config, architecture), vision=vision)

    def kv_cache_specs(self, block_size: int, dtype: str) -> dict[str, KVCacheSpec]:
        """Each attention layer's KV-cache spec, by layer name (in layer order)."""
        return {
            spec.layer_name: KVCacheSpec(block_size, spec.num_kv_heads, spec.head_size, dtype, spec.sliding_window)
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

    @torch.inference_mode()
    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 logits ``[rows, vocab]`` of the given hidden states (with the vocabulary sharded over
        tensor-parallel ranks, the LM head's hook gathers every rank's slice: call it on all ranks alike)."""
        logits = self._lm_head(hidden_states).float()
        if self._final_soft_cap:
            logits = torch.tanh(logits / self._final_soft_cap) * self._final_soft_cap
        return logits


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

    def __init__(self, model: HFCausalLM | PreTrainedModel, layers: Sequence[int]) -> None:
        """Hook decoder layers ``layers`` (indices in ``[0, num_layers)``, repeats allowed) of ``model``.

        ``model`` is an :class:`HFCausalLM` or a plain transformers causal LM (the drafter trainer's).
        """
        decoder = model._decoder if isinstance(model, HFCausalLM) else model.base_model
        num_layers = (
            model.shape.num_layers
            if isinstance(model, HFCausalLM)
            else getattr(model.config.get_text_config(), "num_hidden_layers", None)
        )
        decoder_layers = getattr(decoder, "layers", None)
        if not isinstance(decoder_layers, nn.ModuleList) or len(decoder_layers) != num_layers:
            raise ModelLoadError(
                f"{type(model).__name__}: its decoder has no `layers` list of {num_layers} "
                "layers, so their hidden states cannot be captured"
            )
        held_elsewhere = model.layers_elsewhere if isinstance(model, HFCausalLM) else frozenset()
        elsewhere = sorted(held_elsewhere.intersection(layers))
        if elsewhere:
            raise ModelLoadError(
                f"decoder layers {elsewhere} run on other pipeline stages, so their hidden states "
                "cannot be captured here (runtime.pipeline_parallel_size)"
            )
        self.layers = tuple(layers)
        self._outputs: dict[int, torch.Tensor] = {}
        self._handles = [
            decoder_layers[index].register_forward_hook(self._keeper(index)) for index in sorted(set(self.layers))
        ]

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


def _specs_and_shape(
    model: PreTrainedModel, model_dir: Path, config: Any, architecture: str
) -> tuple[dict[int, AttentionLayerSpec], ModelShape]:
    from transformers import GenerationConfig

    layer_specs = _attention_layers(model, architecture)
    eos = _eos_token_ids(model_dir, config, GenerationConfig)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    shape = ModelShape(
        architecture=architecture,
        num_layers=len(layer_specs),
        vocab_size=text_config.vocab_size,
        hidden_size=text_config.hidden_size,
        max_position_embeddings=getattr(text_config, "max_position_embeddings", None),
        eos_token_ids=eos,
    )
    return layer_specs, shape


def _attention_layers(model: PreTrainedModel, architecture: str) -> dict[int, AttentionLayerSpec]:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    layer_types = getattr(config, "layer_types", None)
    soft_cap = getattr(config, "attn_logit_softcapping", None)
    specs: dict[int, AttentionLayerSpec] = {}
    for name, module in model.named_modules():
        layer_idx = getattr(module, "layer_idx", None)
        if layer_idx is None or not hasattr(module, "scaling") or layer_idx in specs:
            continue
        window = getattr(module, "sliding_window", None)
        if window is None and not hasattr(module, "sliding_window"):
            if layer_types is not None:
                window = config.sliding_window if layer_types[layer_idx] == "sliding_attention" else None
            elif getattr(config, "use_sliding_window", True):
                window = getattr(config, "sliding_window", None)
        specs[layer_idx] = AttentionLayerSpec(
            layer_name=name,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            scale=float(module.scaling),
            sliding_window=window,
            logits_soft_cap=soft_cap,
        )
    if len(specs) != config.num_hidden_layers:
        raise ModelLoadError(
            f"{architecture}: found {len(specs)} attention layers with a layer_idx, expected "
            f"{config.num_hidden_layers}; its attention modules do not follow transformers' conventions"
        )
    return specs


def _eos_token_ids(model_dir: Path, config: Any, generation_config_class: Any) -> tuple[int, ...]:
    try:
        eos = generation_config_class.from_pretrained(model_dir).eos_token_id
    except OSError:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
