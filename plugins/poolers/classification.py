"""The head poolers: ``classify`` (the model's classification head, softmax over its labels) and ``score`` (a
cross-encoder's relevance of the pair in the prompt, the sigmoid of its head's one logit)."""

from __future__ import annotations

from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import Pooler, PoolerCapabilities, PoolerConfig, PoolingBatch, Positions
from patchbay.plugins.poolers._rows import reduce_rows

_POSITIONS: dict[str, Positions] = {"cls": "first", "last": "last", "mean": "all"}


class HeadOptions(BaseModel):
    """Options of the ``classify`` and ``score`` poolers."""

    model_config = ConfigDict(extra="forbid")

    token: Literal["auto", "cls", "last", "mean"] = "auto"
    """What the head reads: the first token's hidden state (``cls``), the last one's (``last``) or their mean;
    ``auto``: ``cls`` for an encoder-only model (BERT, XLM-R), ``last`` for a causal one (as transformers'
    sequence classifiers do)."""
    activation: bool = True
    """Softmax over the labels (the sigmoid for one label) unless a request says otherwise; off: the logits."""


class ClassifyPooler(Pooler):
    """The model's classification head over the pooled token: softmax over its labels (sigmoid for one)."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = HeadOptions
    options: HeadOptions
    capabilities: ClassVar[PoolerCapabilities] = PoolerCapabilities(tasks=("classify",))

    def __init__(self, options: BaseModel | None = None, *, config: PoolerConfig | None = None) -> None:
        super().__init__(options, config=config)
        token = self.options.token
        if token == "auto":
            token = "last" if self.config.causal else "cls"
        self.positions = _POSITIONS[token]

    def pool(self, batch: PoolingBatch) -> list[torch.Tensor]:
        """Each request's label values: the head's logits, through the activation where asked."""
        if batch.head is None:
            raise ValueError(f"{type(self).__name__} needs the model's classification head; the batch has none")
        pooled = reduce_rows(batch, self.positions).to(batch.hidden_states.dtype)
        logits = batch.head(pooled).float()
        found = []
        for row, request in zip(logits, batch.params, strict=True):
            activation = self.options.activation if request.activation is None else request.activation
            if activation:
                row = torch.sigmoid(row) if row.shape[0] == 1 else torch.softmax(row, dim=0)
            found.append(row)
        return found


class ScorePooler(ClassifyPooler):
    """A cross-encoder's relevance of the (query, document) pair in the prompt: the sigmoid of its head's one
    logit (sentence-transformers' ``CrossEncoder.predict``)."""

    contract_version = "1.1"
    capabilities: ClassVar[PoolerCapabilities] = PoolerCapabilities(tasks=("score",))
