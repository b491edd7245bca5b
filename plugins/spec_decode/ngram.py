"""``ngram``: prompt lookup decoding.

The drafter needs no model: it looks for the request's last few tokens
earlier in the request (prompt and output alike) and proposes what followed
them there.  Text that copies from its context -- editing code, quoting a
document, repeating a list -- is drafted well; other text mostly gets no
drafts at all, which costs nothing.

Matching, for one request (``prompt_lookup_min=1``, ``prompt_lookup_max=3``)::

    tokens   a b c d x b c d y b c d      suffixes: "b c d" (n=3), "c d", "d"
    "b c d" occurs ending at 3 and at 7; the most recent wins -> propose y b c ...

The search is vectorised over the whole batch: the last tokens of every
request are laid out right-aligned in one array, and each n-gram length costs
one comparison of that array with the requests' suffix tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

import numpy as np
from pydantic import BaseModel, ConfigDict, PositiveInt, model_validator

from patchbay.interfaces import DraftBatch, Drafter, DrafterCapabilities, DraftProposals

GRID_PADDING = -1
"""Fills the grid left of a request shorter than the grid; never equal to a token id."""
SUFFIX_PADDING = -2
"""Fills suffix slots beyond a request's length; differs from :data:`GRID_PADDING`, so padding never matches."""


class NgramOptions(BaseModel):
    """Options of ``spec_decode: {name: ngram, options: {...}}``.

    The number of drafts per step is the run's ``spec_decode.num_speculative_tokens``.
    """

    model_config = ConfigDict(extra="forbid")

    prompt_lookup_min: PositiveInt = 1
    """The shortest suffix (in tokens) worth matching."""
    prompt_lookup_max: PositiveInt = 4
    """The longest suffix tried first; shorter ones are tried down to ``prompt_lookup_min``."""

    @model_validator(mode="after")
    def _min_at_most_max(self) -> NgramOptions:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self


def find_continuations(sequences: Sequence[np.ndarray], min_n: int, max_n: int, window: int) -> np.ndarray:
    """For each sequence, where the continuation of its longest repeated suffix starts; -1 where none.

    The suffix of length ``n`` (``max_n`` down to ``min_n``) must occur
    earlier, ending at least one token before the end; among its earlier
    occurrences the most recent counts.  The result is an index into the
    sequence: the token right after that occurrence.  Only the last
    ``window`` tokens of each sequence are searched.

    ``[5, 6, 7, 5, 6]`` with ``min_n=1, max_n=2`` -> suffix ``[5, 6]`` occurs at 0..1 -> continuation at 2.
    """
    num_seqs = len(sequences)
    starts = np.full(num_seqs, -1, dtype=np.int64)
    if num_seqs == 0:
        return starts
    lengths = np.fromiter((len(seq) for seq in sequences), dtype=np.int64, count=num_seqs)
    width = int(min(lengths.max(), window))
    if width < 2:
        return starts
    # Right-aligned: lengths [3, 5], width 5 -> [[-1, -1, a0, a1, a2], [b0, b1, b2, b3, b4]].
    grid = np.full((num_seqs, width), GRID_PADDING, dtype=np.int64)
    for row, seq in enumerate(sequences):
        tail = np.asarray(seq[-width:])
        if len(tail):
            grid[row, width - len(tail) :] = tail
    max_n = min(max_n, width - 1)
    # suffix[r, j] is row r's j-th token from the end (j = 0: the last token).
    suffix = grid[:, ::-1][:, :max_n].copy()
    suffix[suffix == GRID_PADDING] = SUFFIX_PADDING

    # matches[r, e]: the n tokens of row r ending at column e equal its last n tokens.  Only columns
    # 0 .. width-2 are candidates (the last column ends the suffix itself).  Grown one n at a time:
    # an n-gram match is an (n-1)-gram match whose token n-1 places further back also matches.
    matches = grid[:, : width - 1] == suffix[:, :1]
    for n in range(1, max_n + 1):
        if n > 1:
            matches[:, n - 1 :] &= grid[:, : width - n] == suffix[:, n - 1, None]
            matches[:, n - 2] = False  # would start left of column 0
        if n < min_n:
            continue
        found = matches.any(axis=1)
        if not found.any():
            break  # no longer n-gram can match either
        # The most recent occurrence is the last True of the row: [F, T, F, T, F] -> column 3.
        last_end = width - 2 - np.argmax(matches[:, ::-1], axis=1)
        # A longer n overwrites a shorter one's answer: the longest match wins.
        starts = np.where(found, last_end + 1 - width + lengths, starts)
    return starts


class NgramDrafter(Drafter):
    """Prompt lookup decoding: drafts by copying from earlier in the request, needing no model.

    Proposes the tokens that followed the most recent earlier occurrence of
    the request's longest matching suffix (``prompt_lookup_max`` down to
    ``prompt_lookup_min`` tokens); no drafts where no suffix recurs.
    """

    contract_version = "1.1"

    Options: ClassVar[type[BaseModel]] = NgramOptions
    options: NgramOptions  # an instance of Options: plugin_options() validated it
    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities(devices=("cpu", "cuda", "mps"))

    lookup_window: ClassVar[int] = 4096
    """Only the last this many tokens of a request are searched (bounds the cost of very long contexts)."""

    def propose(self, batch: DraftBatch) -> DraftProposals:
        drafts: list[list[int]] = [[] for _ in batch.token_ids]
        limit = batch.num_speculative_tokens
        # A request of n tokens may grow by at most max_model_len - n drafts.
        rooms = [batch.max_model_len - len(tokens) for tokens in batch.token_ids]
        rows = [
            index
            for index, tokens in enumerate(batch.token_ids)
            if index not in batch.skip and len(tokens) >= 2 and rooms[index] > 0
        ]
        if limit <= 0 or not rows:
            return DraftProposals(draft_token_ids=drafts)
        options = self.options
        sequences = [batch.token_ids[index] for index in rows]
        starts = find_continuations(sequences, options.prompt_lookup_min, options.prompt_lookup_max, self.lookup_window)
        for index, tokens, start in zip(rows, sequences, starts.tolist(), strict=True):
            if start < 0:
                continue
            count = min(limit, rooms[index])
            follow = np.asarray(tokens[start : start + count])
            if len(follow) < count:
                # The occurrence overlaps the suffix (periodic text): keep copying, from the drafts themselves.
                # tokens "a b a b", continuation "a b" from index 2, 3 drafts -> "a b a".
                follow = np.resize(np.asarray(tokens[start:]), count)
            drafts[index] = [int(token) for token in follow]
        return DraftProposals(draft_token_ids=drafts)
