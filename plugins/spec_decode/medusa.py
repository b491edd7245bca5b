"""The ``medusa`` drafter: K heads over the target's last hidden state propose the next K tokens at once.

Medusa (Cai et al., 2024) adds heads to a frozen model; head ``i`` turns
the hidden state that produced a request's last token into a guess at the
token ``i + 1`` places after it.  Each head is one or more residual blocks
``h + SiLU(W h + b)``, then the target's own lm head, frozen (so only the
small blocks are trained), restricted to the draft vocabulary when the
heads were trained with one (the tokens the target emits most; as vLLM's
Medusa ``token_map``).  Proposals are each head's argmax: one chain of
drafts, no tree.

Weights come from ``options.path`` (a directory written by
``patchbay-train-drafter medusa``, or ``auto`` for its default location);
without it every head is an identity block over the lm head, which guesses
the last token again: valid, lossless, and rarely accepted.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict, PositiveInt

from patchbay.interfaces import DraftBatch, Drafter, DrafterCapabilities, DrafterContext, DraftProposals
from patchbay.plugins.spec_decode.heads import (
    MedusaHeads,
    load_state,
    load_trained,
    target_parts,
    warn_vocab_size,
)

logger = logging.getLogger(__name__)

KIND = "medusa"


class MedusaOptions(BaseModel):
    """Options of the ``medusa`` drafter."""

    model_config = ConfigDict(extra="forbid")

    path: str | None = None
    """Directory of trained heads (``config.json`` + ``model.safetensors``); ``auto``: the training command's
    default directory for the run's model; unset: untrained identity heads."""
    num_heads: PositiveInt | None = None
    """Untrained heads only: how many (default: ``num_speculative_tokens``)."""


class MedusaDrafter(Drafter):
    """Greedy chain proposals from Medusa heads over ``DraftBatch.hidden_states``."""

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = MedusaOptions
    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities(
        devices=("cpu", "cuda", "mps"),
        needs_hidden_states=True,
        reads_vocabulary_weights=True,
    )

    heads: MedusaHeads | None = None

    def load(self, context: DrafterContext) -> None:
        """Build the heads (trained from ``options.path``, else identity) on the run's device and dtype."""
        options: MedusaOptions = self.options  # type: ignore[assignment]
        parts = target_parts(context.model)
        if options.path is not None:
            if options.num_heads is not None:
                raise ValueError("medusa options: num_heads is for untrained heads; a trained path fixes it")
            directory, config, state = load_trained(options.path, context.model, KIND)
            heads = MedusaHeads(
                parts.hidden_size, config["num_heads"], config.get("num_layers", 1), config.get("draft_vocab_size")
            )
            load_state(heads, state, directory)
            self.source: str = str(directory)
        else:
            heads = MedusaHeads(parts.hidden_size, options.num_heads or self.config.num_speculative_tokens)
            self.source = "untrained (identity heads)"
        self.heads = heads.to(device=context.device, dtype=context.dtype).eval()
        warn_vocab_size(self.config.vocab_size, parts.vocab_size)
        self.vocab = heads.vocab(parts.lm_head, limit=self.config.vocab_size)
        if self.config.num_speculative_tokens > heads.num_heads:
            logger.warning(
                "medusa: %d heads (%s) propose at most %d of the %d speculative tokens asked for",
                heads.num_heads,
                self.source,
                heads.num_heads,
                self.config.num_speculative_tokens,
            )

    def propose(self, batch: DraftBatch) -> DraftProposals:
        """Head ``i``'s argmax for each request's token ``i + 1`` places after its last one."""
        if self.heads is None:
            raise RuntimeError("medusa drafter used before load()")
        counts = [
            0
            if index in batch.skip
            else max(0, min(batch.num_speculative_tokens, self.heads.num_heads, batch.max_model_len - len(tokens)))
            for index, tokens in enumerate(batch.token_ids)
        ]
        drafts: list[list[int]] = [[] for _ in counts]
        rows = [index for index, count in enumerate(counts) if count]
        if not rows:
            return DraftProposals(drafts)
        if batch.hidden_states is None:
            raise ValueError("medusa needs DraftBatch.hidden_states (it declares needs_hidden_states); got None")
        hidden = batch.hidden_states[torch.tensor(rows, device=batch.hidden_states.device)]
        with torch.inference_mode():
            hidden = hidden.to(next(self.heads.parameters()).dtype)
            per_head = [self.vocab.argmax(head(hidden)) for head in self.heads.heads[: max(counts)]]
        proposed = torch.stack(per_head, dim=1).cpu().tolist()
        for row, tokens in zip(rows, proposed, strict=True):
            drafts[row] = tokens[: counts[row]]
        return DraftProposals(drafts)
