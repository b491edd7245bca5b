"""Logprobs the runner returns: of sampled tokens, and of prompt tokens across chunked prefill."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from patchbay.worker.model.hf_model import HFCausalLM
    from patchbay.worker.input_batch import InputBatch

PROMPT_LOGPROBS_CHUNK = 256
"""Prompt positions scored at once (a chunk of float32 logits is 256 x vocab)."""


@dataclass
class Logprobs:
    """Logprobs of one sampled token: the sampled token first, then the top-``n`` alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


class PromptLogprobs:
    """Scores prompt tokens chunk by chunk as prefill proceeds.

    Hands each request's list over once its prompt is done.
    """

    def __init__(self, model: HFCausalLM, batch: InputBatch) -> None:
        self.model = model
        self.batch = batch
        self._pending: dict[str, list[Logprobs | None]] = {}

    def forget(self, req_id: str) -> None:
        """Drop what was collected for a request (finished, preempted, or starting over)."""
        self._pending.pop(req_id, None)

    def collect(
        self,
        rows: np.ndarray,
        seq_lens: np.ndarray,
        num_scheduled: np.ndarray,
        query_start_loc: np.ndarray,
        complete: np.ndarray,
        hidden_states: torch.Tensor,
    ) -> dict[str, Any]:
        """Logprobs of the prompt tokens this step's chunks cover; a request's list is returned once its prompt is done.

        The hidden state at position ``p`` scores prompt token ``p + 1``, so a
        chunk covering positions ``a..b-1`` contributes tokens ``a+1..min(b, P-1)``
        of a ``P``-token prompt (the first prompt token has no logprob: ``None``).
        """
        batch = self.batch
        finished: dict[str, Any] = {}
        for i, row in enumerate(rows):
            params = batch.sampling_params[row]
            if params.prompt_logprobs is None:
                continue
            req_id = batch.req_ids[row]
            start = int(seq_lens[i] - num_scheduled[i])
            end = min(int(seq_lens[i]), int(batch.num_prompt_tokens[row]) - 1)
            entries = self._pending.setdefault(req_id, [None] if start == 0 else [])
            first = int(query_start_loc[i])
            for chunk in range(start, end, PROMPT_LOGPROBS_CHUNK):
                chunk_end = min(chunk + PROMPT_LOGPROBS_CHUNK, end)
                hidden = hidden_states[first + chunk - start : first + chunk_end - start]
                targets = torch.from_numpy(batch.token_ids[row, chunk + 1 : chunk_end + 1].astype(np.int64))
                entries.extend(score(self.model.logits(hidden), targets.to(hidden.device), params.prompt_logprobs))
            if complete[i]:
                finished[req_id] = self._pending.pop(req_id)
        return finished


def score(logits: torch.Tensor, targets: torch.Tensor, top_n: int) -> list[Logprobs]:
    """Logprobs of ``targets`` under ``logits`` (one row each), with rank and the top ``top_n`` alternatives."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, targets[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    ids = targets[:, None]
    values = chosen
    if top_n:
        top_values, top_ids = logprobs.topk(top_n, dim=-1)
        ids, values = torch.cat([ids, top_ids], dim=-1), torch.cat([chosen, top_values], dim=-1)
    return [Logprobs(i, v, r) for i, v, r in zip(ids.tolist(), values.tolist(), ranks, strict=True)]
