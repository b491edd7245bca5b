"""``example_repeat``: proposes the request's last token again, ``k`` times.

Useless for speed on most text, but it exercises the whole speculative path
(drafts, verification, rejection) with a drafter anyone can predict.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, ConfigDict, PositiveInt

from patchbay.interfaces import DraftBatch, Drafter, DrafterCapabilities, DraftProposals


class RepeatOptions(BaseModel):
    """Options of ``spec_decode: {name: example_repeat, options: {...}}``."""

    model_config = ConfigDict(extra="forbid")

    max_draft_tokens: PositiveInt | None = None
    """Propose at most this many tokens even when ``num_speculative_tokens`` allows more."""


class RepeatLastTokenDrafter(Drafter):
    """Drafts the last token repeated num_speculative_tokens times; needs token ids only."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = RepeatOptions
    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities(devices=("cpu", "cuda"))

    def propose(self, batch: DraftBatch) -> DraftProposals:
        limit = batch.num_speculative_tokens
        if self.options.max_draft_tokens is not None:
            limit = min(limit, self.options.max_draft_tokens)
        drafts = []
        for index, token_ids in enumerate(batch.token_ids):
            # A request of n tokens may grow by at most max_model_len - n drafts.
            room = batch.max_model_len - len(token_ids)
            if index in batch.skip or len(token_ids) == 0 or room <= 0:
                drafts.append([])
                continue
            drafts.append([int(token_ids[-1])] * min(limit, room))
        return DraftProposals(draft_token_ids=drafts)
