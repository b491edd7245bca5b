"""A drafter whose proposals leave the vocabulary."""

from patchbay.interfaces import DraftProposals
from patchbay_example.drafter import RepeatLastTokenDrafter


class OutOfRangeDrafter(RepeatLastTokenDrafter):
    """Like example_repeat, but its first draft of every request is ``vocab_size``, one past the last id."""

    def propose(self, batch):
        proposals = super().propose(batch)
        drafts = [[self.config.vocab_size, *row[1:]] if row else row for row in proposals.draft_token_ids]
        return DraftProposals(draft_token_ids=drafts)
