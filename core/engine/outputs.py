"""What a finished request returns, with its timing metrics, and the stop-string check."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

from patchbay.sampling_params import SamplingParams


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic``) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    first_scheduled_time: float | None = None
    """When a step first ran part of the request (its prompt's first chunk)."""
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    num_draft_tokens: int = 0
    """Speculative draft tokens verified for this request."""
    num_accepted_tokens: int = 0
    """Of those, the ones accepted."""

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [later - earlier for earlier, later in pairwise(self.token_times)]

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        """Arrival to the first step that ran it."""
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        """First scheduled to first token."""
        if self.first_scheduled_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        """First token to finish."""
        if self.first_token_time is None or self.finish_time is None:
            return None
        return self.finish_time - self.first_token_time

    @property
    def inference_time(self) -> float | None:
        """First scheduled to finish."""
        if self.first_scheduled_time is None or self.finish_time is None:
            return None
        return self.finish_time - self.first_scheduled_time

    def as_dict(self) -> dict[str, Any]:
        itl = self.inter_token_latencies
        return {
            "time_to_first_token_s": self.time_to_first_token,
            "e2e_latency_s": self.e2e_latency,
            "mean_inter_token_latency_s": sum(itl) / len(itl) if itl else None,
            "num_cached_tokens": self.num_cached_tokens,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
        }


@dataclass
class Completion:
    """One generated sequence of a request (a request with ``n > 1`` has several)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    """``"stop"`` (EOS, stop token or stop string), ``"length"``, ``"abort"`` or ``"error"``."""
    stop_reason: int | str | None = None
    logprobs: list[Any] | None = None
    """Per generated token, its logprobs (when the request asked for ``logprobs``)."""

    def as_dict(self) -> dict[str, Any]:
        result: dict[str, Any] = {
            "index": self.index,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
        }
        if self.logprobs is not None:
            result["logprobs"] = [_logprobs_dict(entry) for entry in self.logprobs]
        return result


@dataclass
class RequestOutput:
    """The result of one request.

    ``token_ids``, ``text``, ``finish_reason``, ``stop_reason`` and
    ``logprobs`` are those of the first completion; ``completions`` holds all
    ``n`` of them.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[Any] | None = None
    prompt_logprobs: list[Any] | None = None
    """Per prompt token, its logprobs (``None`` for the first); set when the request asked for ``prompt_logprobs``."""
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    completions: list[Completion] = field(default_factory=list)
    error: str | None = None
    """Why the request failed, when ``finish_reason`` is ``"error"`` (what raised, naming the plugin if one did)."""
    pooled: list[float] | None = None
    """A pooling request's vector: its embedding, class probabilities or score (``None``: a generation)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def completion(self, index: int = 0) -> Completion:
        """This sequence as a :class:`Completion`."""
        return Completion(index, self.token_ids, self.text, self.finish_reason, self.stop_reason, self.logprobs)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form, as ``patchbay run`` writes it."""
        result: dict[str, Any] = {
            "id": self.request_id,
            "prompt": self.prompt,
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stop_reason": self.stop_reason,
            "num_prompt_tokens": len(self.prompt_token_ids),
            "num_generated_tokens": sum(len(c.token_ids) for c in self.completions) or len(self.token_ids),
            "metrics": self.metrics.as_dict(),
        }
        if self.error is not None:
            result["error"] = self.error
        if self.pooled is not None:
            result["pooled"] = self.pooled
        if self.logprobs is not None:
            result["logprobs"] = [_logprobs_dict(entry) for entry in self.logprobs]
        if self.prompt_logprobs is not None:
            result["prompt_logprobs"] = [_logprobs_dict(entry) for entry in self.prompt_logprobs]
        if len(self.completions) > 1:
            result["completions"] = [completion.as_dict() for completion in self.completions]
        return result


def _logprobs_dict(entry: Any) -> dict[str, Any] | None:
    if entry is None:
        return None
    return {"token_ids": entry.token_ids, "logprobs": entry.logprobs, "rank": entry.sampled_rank}


def merge_completions(request_id: str, sequences: list[RequestOutput]) -> RequestOutput:
    """One :class:`RequestOutput` for a request whose ``n`` sequences ran as separate requests."""
    first = sequences[0]
    metrics = RequestMetrics(
        arrival_time=first.metrics.arrival_time,
        first_token_time=min(
            (s.metrics.first_token_time for s in sequences if s.metrics.first_token_time), default=None
        ),
        finish_time=max((s.metrics.finish_time for s in sequences if s.metrics.finish_time), default=None),
        first_scheduled_time=min(
            (s.metrics.first_scheduled_time for s in sequences if s.metrics.first_scheduled_time), default=None
        ),
        token_times=sorted(t for s in sequences for t in s.metrics.token_times),
        num_cached_tokens=first.metrics.num_cached_tokens,
        num_draft_tokens=sum(s.metrics.num_draft_tokens for s in sequences),
        num_accepted_tokens=sum(s.metrics.num_accepted_tokens for s in sequences),
    )
    return RequestOutput(
        request_id,
        first.prompt,
        first.prompt_token_ids,
        first.sampling_params,
        first.token_ids,
        first.text,
        first.finish_reason,
        first.stop_reason,
        first.logprobs,
        first.prompt_logprobs,
        metrics,
        completions=[sequence.completion(index) for index, sequence in enumerate(sequences)],
        error=next((sequence.error for sequence in sequences if sequence.error is not None), None),
    )


def find_stop_string(text: str, stops: list[str], new_chars: int) -> tuple[str, int] | None:
    """The first stop string that appears in ``text`` overlapping its last ``new_chars`` characters.

    Returns the stop string and where it starts, or ``None``.  Only the tail
    is searched, so each step costs the length of the stop strings, not of
    the whole text.
    """
    best: tuple[str, int] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and (best is None or index < best[1]):
            best = (stop, index)
    return best
