"""An example pooler: the element-wise maximum over every prompt token's hidden state (sentence-transformers'
``max`` pooling mode, which patchbay does not build in)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import Pooler, PoolerCapabilities, PoolingBatch


class MaxOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    normalize: bool = True


class MaxPooler(Pooler):
    """Embeddings as the maximum of each feature over the prompt's tokens (example plugin)."""

    contract_version = "1.1"
    Options: ClassVar[type[BaseModel]] = MaxOptions
    capabilities: ClassVar[PoolerCapabilities] = PoolerCapabilities(tasks=("embed",))
    positions = "all"

    def pool(self, batch: PoolingBatch) -> list[torch.Tensor]:
        found = []
        for index, params in enumerate(batch.params):
            vector = batch.rows(index).float().amax(dim=0)
            if params.dimensions is not None:
                vector = vector[: params.dimensions]
            if self.options.normalize if params.normalize is None else params.normalize:
                vector = F.normalize(vector, dim=0)
            found.append(vector)
        return found
