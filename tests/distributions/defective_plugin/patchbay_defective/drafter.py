"""A drafter whose proposals leave the vocabulary."""

import dataclasses

from patchbay.interfaces import DraftProposals
from patchbay_example.drafter import RepeatLastTokenDrafter


class OutOfRangeDrafter(RepeatLastTokenDrafter):
    """Like example_repeat, but its first draft of every request is ``vocab_size``, one past the last id."""

    def propose(self, batch):
        proposals = super().propose(batch)
        drafts = [[self.config.vocab_size, *row[1:]] if row else row for row in proposals.draft_token_ids]
        return DraftProposals(draft_token_ids=drafts)


class IgnoresSkipDrafter(RepeatLastTokenDrafter):
    """Like example_repeat, but drafts for every row, those in ``skip`` too."""

    def propose(self, batch):
        return super().propose(dataclasses.replace(batch, skip=set()))


class IndexCacheDrafter(RepeatLastTokenDrafter):
    """Like example_repeat, but remembers drafts by batch index and reuses them while a row's length is unchanged."""

    def propose(self, batch):
        cache = getattr(self, "_by_index", None)
        if cache is None:
            cache = self._by_index = {}
        fresh = super().propose(batch).draft_token_ids
        drafts = []
        for index, (tokens, row) in enumerate(zip(batch.token_ids, fresh, strict=True)):
            cached = cache.get(index)
            if cached is not None and cached[0] == len(tokens) and row:
                drafts.append(cached[1])
            else:
                drafts.append(row)
                cache[index] = (len(tokens), row)
        return DraftProposals(draft_token_ids=drafts)
