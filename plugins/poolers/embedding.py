"""The embedding poolers: ``mean``, ``cls`` and ``last``, as sentence-transformers' pooling modes."""

from __future__ import annotations

from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import Pooler, PoolerCapabilities, PoolingBatch, Positions
from patchbay.plugins.poolers._rows import finish_embeddings, reduce_rows


class EmbeddingOptions(BaseModel):
    """Options of the ``mean``, ``cls`` and ``last`` poolers."""

    model_config = ConfigDict(extra="forbid")

    normalize: bool = True
    """L2-normalize embeddings unless a request says otherwise (sentence-transformers' ``Normalize`` module;
    ``pooling.name: auto`` sets it from the model's ``modules.json``)."""


class _EmbeddingPooler(Pooler):
    """An embedding of the rows :attr:`positions` names: their mean, or the one row."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = EmbeddingOptions
    options: EmbeddingOptions
    capabilities: ClassVar[PoolerCapabilities] = PoolerCapabilities(tasks=("embed",))

    def pool(self, batch: PoolingBatch) -> list[torch.Tensor]:
        """Each request's embedding, cut to its ``dimensions`` and normalized as asked."""
        return finish_embeddings(reduce_rows(batch, self.positions), batch.params, self.options.normalize)


class MeanPooler(_EmbeddingPooler):
    """The mean of every prompt token's hidden state (sentence-transformers' ``pooling_mode_mean_tokens``)."""

    contract_version = "1.1"
    positions: Positions = "all"


class CLSPooler(_EmbeddingPooler):
    """The first token's hidden state (BERT's ``[CLS]``; sentence-transformers' ``pooling_mode_cls_token``)."""

    contract_version = "1.1"
    positions: Positions = "first"


class LastTokenPooler(_EmbeddingPooler):
    """The last token's hidden state: a causal model's last token has read the whole prompt (Qwen3-Embedding,
    e5-mistral; sentence-transformers' ``pooling_mode_lasttoken``)."""

    contract_version = "1.1"
    positions: Positions = "last"
