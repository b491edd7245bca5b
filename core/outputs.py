"""What a finished request returns, with its timing metrics, and the stop-string check."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from patchbay.sampling_params import SamplingParams


@dataclass
class RequestMetrics:
    """Timestamps (``time.monotonic``) of one request's life."""

    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [later - earlier for earlier, later in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    def as_dict(self) -> dict[str, Any]:
        itl = self.inter_token_latencies
        return {
            "time_to_first_token_s": self.time_to_first_token,
            "e2e_latency_s": self.e2e_latency,
            "mean_inter_token_latency_s": sum(itl) / len(itl) if itl else None,
            "num_cached_tokens": self.num_cached_tokens,
        }


@dataclass
class RequestOutput:
    """The result of one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    """``"stop"`` (EOS, stop token or stop string), ``"length"`` or ``"abort"``."""
    stop_reason: int | str | None = None
    logprobs: list[Any] | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

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
            "num_generated_tokens": len(self.token_ids),
            "metrics": self.metrics.as_dict(),
        }
        if self.logprobs is not None:
            result["logprobs"] = [
                None if entry is None else {"token_ids": entry.token_ids, "logprobs": entry.logprobs,
                                            "sampled_rank": entry.sampled_rank}
                for entry in self.logprobs
            ]
        return result


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
