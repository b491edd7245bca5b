"""Pooling models: transformers' base models (decoders and encoder-only ones) and their classification heads.

A pooling engine loads the model's base (``AutoModel``: a Qwen3-Embedding's decoder, a BERT or XLM-R encoder),
or, for a ``*ForSequenceClassification`` checkpoint (a cross-encoder, a classifier), the whole model, whose head
the ``classify`` and ``score`` poolers apply to the pooled row.  Attention goes through patchbay like a decoder's:
a causal model's over the paged KV cache, an encoder-only model's (BERT, RoBERTa, XLM-R: every token sees the
whole prompt) over the step's own keys, without a KV cache (:attr:`HFPoolingModel.causal`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from patchbay.interfaces import AttentionLayerSpec, ClassificationHead
from patchbay.scheduling.kv_cache_spec import KVCacheSpec
from patchbay.toolkit.model_files import ModelLoadError
from patchbay.toolkit.transformers_layers import attention_layer_specs
from patchbay.worker.model.hf_model import (
    ATTN_IMPLEMENTATION,
    HFCausalLM,
    ModelShape,
    _shape,
    register_attention_function,
    torch_dtype,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class HFPoolingModel(HFCausalLM):
    """A transformers model whose final hidden states are pooled, never turned into logits."""

    def __init__(
        self,
        model: PreTrainedModel,
        layer_specs: dict[int, AttentionLayerSpec],
        shape: ModelShape,
        *,
        causal: bool,
        position_offset: int = 0,
        head: ClassificationHead | None = None,
        num_labels: int | None = None,
        type_vocab_size: int | None = None,
    ) -> None:
        super().__init__(model, layer_specs, shape)
        self.causal = causal
        """Whether the model attends causally (a decoder) or bidirectionally (encoder-only: no KV cache)."""
        self.position_offset = position_offset
        """Added to each token's position: RoBERTa and XLM-R number positions from their padding index + 1."""
        self.head = head
        """The classification head (pooled rows to logits); ``None``: the model has none."""
        self.num_labels = num_labels
        self.type_vocab_size = type_vocab_size
        """Token types the model embeds (a BERT pair's two segments); ``None``: it takes none."""

    @classmethod
    def load(cls, model_dir: Path, *, dtype: str, device: torch.device) -> HFPoolingModel:
        """Load ``model_dir``'s base model (or whole classifier) with patchbay attention; unsupported
        architectures raise :class:`ModelLoadError`."""
        from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification

        register_attention_function()
        config = AutoConfig.from_pretrained(model_dir)
        architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        if getattr(config, "is_encoder_decoder", False):
            raise ModelLoadError(f"{architecture}: encoder-decoder models do not pool here; use an encoder or decoder")
        classifier = architecture.endswith("ForSequenceClassification")
        auto = AutoModelForSequenceClassification if classifier else AutoModel
        model_class = auto._model_mapping.get(type(config), None)
        if model_class is None:
            raise ModelLoadError(f"{architecture} ({config.model_type}) is not a model transformers can load to pool")
        if not getattr(model_class, "_supports_attention_backend", False):
            raise ModelLoadError(
                f"{architecture} does not support transformers' AttentionInterface, so its attention "
                "cannot be routed to patchbay"
            )
        model = auto.from_pretrained(model_dir, dtype=torch_dtype(dtype), attn_implementation=ATTN_IMPLEMENTATION)
        model.to(device).eval()
        layer_specs = attention_layer_specs(model, architecture)
        shape = _shape(model_dir, config, architecture, len(layer_specs))
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        return cls(
            model,
            layer_specs,
            shape,
            causal=_attends_causally(model, architecture),
            position_offset=_position_offset(model.base_model),
            head=classification_head(model, architecture) if classifier else None,
            num_labels=int(config.num_labels) if classifier else None,
            type_vocab_size=getattr(text_config, "type_vocab_size", None),
        )

    def kv_cache_specs(self, block_size: int, dtype: str) -> dict[str, KVCacheSpec]:
        """A causal model's layers' KV-cache specs; none for an encoder-only model, which keeps no cache."""
        return super().kv_cache_specs(block_size, dtype) if self.causal else {}

    @torch.inference_mode()
    def hidden_states(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[num_tokens, hidden]`` of one flattened step (inside a forward context);
        ``token_type_ids`` (``[num_tokens]``): each token's segment, for a model that embeds them."""
        extra: dict[str, Any] = {}
        if token_type_ids is not None:
            extra["token_type_ids"] = token_type_ids.unsqueeze(0)
        output = self._decoder(
            input_ids=input_ids.unsqueeze(0),
            position_ids=(positions + self.position_offset).unsqueeze(0),
            use_cache=False,
            **extra,
        )
        return output.last_hidden_state[0]

    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """A pooling model computes no logits (its runner pools instead of sampling)."""
        raise RuntimeError(f"{self.shape.architecture} is loaded to pool: it has no language-model head")


def _attends_causally(model: PreTrainedModel, architecture: str) -> bool:
    """Whether the attention layers attend causally (their ``is_causal``, as transformers' modules declare it)."""
    flags = {
        bool(getattr(module, "is_causal", True))
        for module in model.modules()
        if getattr(module, "layer_idx", None) is not None and hasattr(module, "scaling")
    }
    if len(flags) != 1:
        raise ModelLoadError(f"{architecture}: its attention layers mix causal and bidirectional attention")
    return flags.pop()


def _position_offset(base_model: Any) -> int:
    """RoBERTa-style embeddings number a prompt's positions from ``padding_idx + 1`` (their
    ``create_position_ids_from_input_ids``); BERT's and decoders' from 0."""
    embeddings = getattr(base_model, "embeddings", None)
    if embeddings is not None and hasattr(embeddings, "create_position_ids_from_input_ids"):
        return int(embeddings.padding_idx) + 1
    return 0


def classification_head(model: PreTrainedModel, architecture: str) -> ClassificationHead:
    """The head of a ``*ForSequenceClassification`` model as a function of the pooled rows ``[n, hidden]``:

    - a decoder's ``score`` linear (Llama, Qwen: it reads the last token);
    - BERT's pooler (dense and tanh over ``[CLS]``) and ``classifier``;
    - RoBERTa's and XLM-R's ``classifier`` (dense, tanh, ``out_proj``), which reads the first token itself.
    """
    score = getattr(model, "score", None)
    if isinstance(score, torch.nn.Linear):
        return _inference(score)
    classifier = getattr(model, "classifier", None)
    if isinstance(classifier, torch.nn.Module):
        pooler = getattr(model.base_model, "pooler", None)
        dense = getattr(pooler, "dense", None)
        if isinstance(dense, torch.nn.Linear):
            activation = getattr(pooler, "activation", torch.tanh)
            return _inference(lambda rows: classifier(activation(dense(rows))))
        if hasattr(classifier, "out_proj"):  # reads features[:, 0]: hand it each pooled row as a one-token sequence
            return _inference(lambda rows: classifier(rows[:, None, :]))
        if isinstance(classifier, torch.nn.Linear):
            return _inference(classifier)
    raise ModelLoadError(
        f"{architecture}: its classification head is none patchbay knows (a `score` linear, BERT's pooler and "
        "`classifier`, or a RoBERTa-style `classifier` with `out_proj`)"
    )


def _inference(function: ClassificationHead) -> ClassificationHead:
    def head(rows: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return function(rows)

    return head
