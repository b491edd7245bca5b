"""Structured output in the runner: per-request grammar matchers, the step's token bitmask, and masking.

Each step, before sampling, every constrained request fills its rows of one
shared bitmask: the row of its last position and, under speculative
decoding, one row per draft position (its matcher accepts each draft in
turn to fill the next row, then rolls them all back).  The logits of those
rows only are masked, in one vectorised operation; unconstrained rows are
untouched.  After sampling, each matcher accepts the request's new tokens.

Matchers are keyed by request id, so row moves in the persistent batch do
not concern them.  A request that comes back as new (after preemption or a
KV load error) gets a fresh matcher advanced by the tokens it generated
before: the state is rebuilt, never advanced twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from patchbay.interfaces import GrammarMatcher
from patchbay.scheduling.structured_output import GrammarCompilations


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: Sequence[int]) -> None:
    """Set to ``-inf``, in place, the logits of ``rows`` whose token's bit is clear in the row's bitmask.

    Token ``t`` is allowed when bit ``t % 32`` of word ``t // 32`` is set:
    words ``[0b101]`` allow tokens 0 and 2 of a 3-token vocabulary.
    """
    if not len(rows):
        return
    with torch.inference_mode():  # the model's logits are inference tensors
        index = torch.as_tensor(np.asarray(rows, dtype=np.int64), device=logits.device)
        words = torch.from_numpy(bitmask[np.asarray(rows)]).to(logits.device)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        # [rows, words] -> [rows, words, 32] bits -> [rows, words * 32] allowed flags, one per token id.
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, : logits.shape[-1]].bool()
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


class ConstrainedDecoding:
    """The grammar matchers of the batch's constrained requests."""

    def __init__(self, grammars: GrammarCompilations) -> None:
        self.grammars = grammars
        self.matchers: dict[str, GrammarMatcher] = {}
        self.failed: dict[str, str] = {}
        """Requests whose backend failed, with the message; reported once, then the scheduler finishes them."""
        self._field_paths: dict[str, str] = {}
        """Where each request's constraint sits (``structured_output.regex``), for messages."""

    def add(self, req_id: str, grammar: Any, output_token_ids: Sequence[int], field_path: str) -> None:
        """A fresh matcher for a new or resumed request, advanced by the tokens it generated before."""
        self.matchers.pop(req_id, None)
        self._field_paths[req_id] = field_path
        try:
            matcher = self.grammars.backend.matcher(grammar)
            accepted = matcher.accept_tokens(output_token_ids)
        except Exception as exc:
            self._fail(req_id, f"failed to start its matcher: {type(exc).__name__}: {exc}")
            return
        if accepted != len(output_token_ids):
            self._fail(req_id, f"rejected the request's generated token {output_token_ids[accepted]} "
                               f"(output position {accepted}) when rebuilding its matcher")
            return
        self.matchers[req_id] = matcher

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.failed.pop(req_id, None)
        self._field_paths.pop(req_id, None)

    def mask(self, logits: torch.Tensor, req_ids: Sequence[str], drafts: Sequence[Sequence[int]],
             first_rows: np.ndarray) -> None:
        """Mask the logits rows of the constrained requests among ``req_ids`` (the step's sampling requests).

        Request ``i`` owns logits rows ``first_rows[i] ..`` : one per draft
        of ``drafts[i]`` (empty without speculative decoding), then its bonus row.
        Rows after a draft the grammar rejects are left as they are: the
        verifier rejects that draft (its probability is zero), so they are never used.
        """
        matchers = self.matchers
        if not any(req_id in matchers for req_id in req_ids):
            return
        bitmask = np.empty((logits.shape[0], self.grammars.backend.bitmask_width), dtype=np.int32)
        rows: list[int] = []
        for index, req_id in enumerate(req_ids):
            matcher = matchers.get(req_id)
            if matcher is None:
                continue
            request_drafts = drafts[index] if drafts else ()
            row = int(first_rows[index])
            num_accepted = 0
            try:
                for position in range(len(request_drafts) + 1):
                    matcher.fill_bitmask(bitmask, row + position)
                    rows.append(row + position)
                    if position == len(request_drafts) or matcher.accept_tokens([request_drafts[position]]) != 1:
                        break
                    num_accepted += 1
                    if matcher.is_terminated():
                        break  # a draft stop token: what follows it is dropped
                matcher.rollback(num_accepted)
            except Exception as exc:
                self._fail(req_id, f"failed to fill its token bitmask: {type(exc).__name__}: {exc}")
        apply_token_bitmask(logits, bitmask, rows)

    def advance(self, req_ids: Sequence[str], new_tokens: Sequence[Sequence[int]]) -> None:
        """Accept each sampling request's new tokens (accepted drafts and the sampled one)."""
        for req_id, tokens in zip(req_ids, new_tokens, strict=True):
            matcher = self.matchers.get(req_id)
            if matcher is None or not tokens:
                continue
            try:
                accepted = matcher.accept_tokens(tokens)
            except Exception as exc:
                self._fail(req_id, f"failed to accept tokens: {type(exc).__name__}: {exc}")
                continue
            # Tokens after an accepted stop token are dropped by the scheduler; any other refusal is a backend bug.
            if accepted != len(tokens) and not matcher.is_terminated():
                self._fail(req_id, f"rejected token {tokens[accepted]}, which its own bitmask allowed")

    def take_failed(self) -> dict[str, str]:
        """The failures since the last call (each reported once)."""
        failed, self.failed = self.failed, {}
        return failed

    def _fail(self, req_id: str, reason: str) -> None:
        self.matchers.pop(req_id, None)
        field_path = self._field_paths.get(req_id, "structured_output")
        self.failed[req_id] = f"structured_output backend {self.grammars.backend_name!r} ({field_path}) {reason}"
