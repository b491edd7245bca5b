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

Over several ranks (tensor-parallel shards, pipeline stages) the matchers
live on rank 0 alone, the one source of truth: before it hands a step to
the other ranks, rank 0 fills each constrained request's rows
(:meth:`ConstrainedDecoding.fill_step`) and the rows travel inside the
step's ``SchedulerOutput`` (``grammar_bitmasks``); every rank, rank 0
included, masks its logits with those same rows
(:func:`apply_request_bitmasks`), so the seeded samplers draw the same
tokens everywhere.  Only rank 0 advances the matchers, after sampling, as
one process does.  The other ranks never see a compiled grammar or a
matcher, so a backend needs nothing (no pickling) to serve several ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from patchbay.interfaces import GrammarMatcher
from patchbay.scheduling.scheduler_output import NewRequestData
from patchbay.scheduling.structured_output import GrammarCompilations


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray, rows: Sequence[int]) -> None:
    """Set to ``-inf``, in place, the logits of ``rows`` whose token's bit is clear in the row's bitmask.

    Token ``t`` is allowed when bit ``t % 32`` of word ``t // 32`` is set:
    words ``[0b101]`` allow tokens 0 and 2 of a 3-token vocabulary.
    """
    if not len(rows):
        return
    _mask_rows(logits, bitmask[np.asarray(rows)], rows)


def apply_request_bitmasks(
    logits: torch.Tensor, bitmasks: Mapping[str, np.ndarray], req_ids: Sequence[str], first_rows: np.ndarray
) -> None:
    """Mask ``logits`` with bitmask rows filled per request (rank 0's ``SchedulerOutput.grammar_bitmasks``).

    Request ``req_ids[i]`` owns logits rows ``first_rows[i] ..``; its bitmask
    ``bitmasks[req_id]`` (``[k, words]``, ``k`` at most its drafts + 1) masks
    the first ``k`` of them.  Requests without one are left as they are:
    ``{"a": 2 rows}``, ``req_ids ["b", "a"]``, ``first_rows [0, 1]`` mask rows 1 and 2.
    """
    rows: list[int] = []
    words: list[np.ndarray] = []
    for req_id, first_row in zip(req_ids, first_rows.tolist(), strict=True):
        bitmask = bitmasks.get(req_id)
        if bitmask is not None:
            rows.extend(range(first_row, first_row + len(bitmask)))
            words.append(bitmask)
    if rows:
        _mask_rows(logits, np.concatenate(words), rows)


def _mask_rows(logits: torch.Tensor, words_by_row: np.ndarray, rows: Sequence[int]) -> None:
    """Mask logits row ``rows[i]`` by bitmask row ``words_by_row[i]`` (int32 ``[len(rows), words]``), in place."""
    with torch.inference_mode():  # the model's logits are inference tensors
        index = torch.as_tensor(np.asarray(rows, dtype=np.int64), device=logits.device)
        words = torch.from_numpy(words_by_row).to(logits.device)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        # [rows, words] -> [rows, words, 32] bits -> [rows, words * 32] allowed flags, one per token id.
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(len(rows), -1)[:, : logits.shape[-1]].bool()
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


class ConstrainedDecoding:
    """The grammar matchers of the batch's constrained requests."""

    def __init__(self, grammars: GrammarCompilations, sampler_name: str = "sampler") -> None:
        self.grammars = grammars
        self.sampler_name = sampler_name
        """How messages name the sampler plugin (``sampler:NAME``), when a token it drew was masked."""
        self.matchers: dict[str, GrammarMatcher] = {}
        self._applied: dict[str, np.ndarray] = {}
        """This step's bitmask rows by request (its bonus row, or one per draft then the bonus row): the
        masks the engine applied, kept to tell a sampler that drew a masked token from a matcher that refused
        a token its own bitmask allowed."""
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
            self._fail(
                req_id,
                f"rejected the request's generated token {output_token_ids[accepted]} "
                f"(output position {accepted}) when rebuilding its matcher",
            )
            return
        self.matchers[req_id] = matcher

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.failed.pop(req_id, None)
        self._field_paths.pop(req_id, None)

    def mask(
        self, logits: torch.Tensor, req_ids: Sequence[str], drafts: Sequence[Sequence[int]], first_rows: np.ndarray
    ) -> None:
        """Mask the logits rows of the constrained requests among ``req_ids`` (the step's sampling requests).

        Request ``i`` owns logits rows ``first_rows[i] ..`` : one per draft
        of ``drafts[i]`` (empty without speculative decoding), then its bonus row.
        Rows after a draft the grammar rejects are left as they are: the
        verifier rejects that draft (its probability is zero), so they are never used.
        """
        matchers = self.matchers
        self._applied = {}
        if not any(req_id in matchers for req_id in req_ids):
            return
        bitmask = np.empty((logits.shape[0], self.grammars.backend.bitmask_width), dtype=np.int32)
        rows: list[int] = []
        for index, req_id in enumerate(req_ids):
            matcher = matchers.get(req_id)
            if matcher is None:
                continue
            row = int(first_rows[index])
            num_rows = self._fill_rows(req_id, matcher, drafts[index] if drafts else (), bitmask, row)
            rows.extend(range(row, row + num_rows))
            if num_rows:
                self._applied[req_id] = bitmask[row : row + num_rows]
        apply_token_bitmask(logits, bitmask, rows)

    def update(self, dropped: Iterable[str], new_requests: Iterable[NewRequestData]) -> None:
        """Apply a step's changes to the matchers: drop those of the requests it drops (finished, preempted,
        reset), then start those of its new and resumed requests."""
        for req_id in dropped:
            self.remove(req_id)
        for request in new_requests:
            if request.grammar is not None:
                self.add(
                    request.req_id,
                    request.grammar,
                    request.output_token_ids,
                    request.sampling_params.structured_output.field_path,
                )

    def fill_step(self, req_ids: Iterable[str], drafts: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
        """The bitmask rows of the constrained requests among ``req_ids``, by request (for the other ranks).

        Each request gets one row per draft of ``drafts[req_id]`` and its bonus
        row, fewer when a draft is refused or is a stop token (as :meth:`mask`
        fills them): ``[rows, bitmask_width]`` int32.  A request whose backend
        fails gets none and is reported by :meth:`take_failed`.
        """
        filled: dict[str, np.ndarray] = {}
        self._applied = filled
        for req_id in req_ids:
            matcher = self.matchers.get(req_id)
            if matcher is None:
                continue
            request_drafts = drafts.get(req_id, ())
            bitmask = np.empty((len(request_drafts) + 1, self.grammars.backend.bitmask_width), dtype=np.int32)
            num_rows = self._fill_rows(req_id, matcher, request_drafts, bitmask, 0)
            if num_rows:
                filled[req_id] = bitmask[:num_rows]
        return filled

    def _fill_rows(
        self, req_id: str, matcher: GrammarMatcher, drafts: Sequence[int], bitmask: np.ndarray, row: int
    ) -> int:
        """Fill ``bitmask`` rows ``row ..`` for one request: its next token, then after each draft in turn.

        Returns how many rows were filled (0 when the backend raised: the request is failed).  The drafts
        the matcher accepted to fill the later rows are rolled back.
        """
        num_rows = num_accepted = 0
        try:
            for position in range(len(drafts) + 1):
                matcher.fill_bitmask(bitmask, row + position)
                num_rows += 1
                if position == len(drafts) or matcher.accept_tokens([drafts[position]]) != 1:
                    break
                num_accepted += 1
                if matcher.is_terminated():
                    break  # a draft stop token: what follows it is dropped
            matcher.rollback(num_accepted)
        except Exception as exc:
            self._fail(req_id, f"failed to fill its token bitmask: {type(exc).__name__}: {exc}")
            return 0
        return num_rows

    def advance(self, req_ids: Sequence[str], new_tokens: Sequence[Sequence[int]]) -> None:
        """Accept each sampling request's new tokens (accepted drafts and the sampled one)."""
        for req_id, tokens in zip(req_ids, new_tokens, strict=True):
            matcher = self.matchers.get(req_id)
            applied = self._applied.pop(req_id, None)  # the rows masked these tokens; consumed here
            if matcher is None or not tokens:
                continue
            try:
                accepted = matcher.accept_tokens(tokens)
            except Exception as exc:
                self._fail(req_id, f"failed to accept tokens: {type(exc).__name__}: {exc}")
                continue
            # Tokens after an accepted stop token are dropped by the scheduler; any other refusal is a bug.
            if accepted != len(tokens) and not matcher.is_terminated():
                self._blame_refusal(req_id, tokens[accepted], accepted, applied)

    def _blame_refusal(self, req_id: str, token: int, position: int, applied: np.ndarray | None) -> None:
        """Fail a request whose matcher refused its new token ``token`` (``position`` among the step's tokens),
        naming the plugin at fault: the sampler, when the row the engine applied (``applied[position]``) had
        masked that token; the backend, when its own bitmask allowed it."""
        if applied is None or position >= len(applied):
            self._fail(req_id, f"rejected token {token}, for which no bitmask row was applied this step")
            return
        words = applied[position]
        in_row = 0 <= token < 32 * len(words)
        if in_row and (int(words[token // 32]) >> (token % 32)) & 1:
            self._fail(req_id, f"rejected token {token}, which its own bitmask allowed")
            return
        field_path = self._field_paths.get(req_id, "structured_output")
        self.matchers.pop(req_id, None)
        self.failed[req_id] = (
            f"{self.sampler_name} returned token {token}, which the grammar's bitmask masked (the engine set its "
            f"logit to -inf before sampling; {field_path} of structured_output backend "
            f"{self.grammars.backend_name!r}): the sampler drew a token of probability zero"
        )

    def take_failed(self) -> dict[str, str]:
        """The failures since the last call (each reported once)."""
        failed, self.failed = self.failed, {}
        return failed

    def _fail(self, req_id: str, reason: str) -> None:
        self.matchers.pop(req_id, None)
        field_path = self._field_paths.get(req_id, "structured_output")
        self.failed[req_id] = f"structured_output backend {self.grammars.backend_name!r} ({field_path}) {reason}"
