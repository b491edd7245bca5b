"""What each engine step of a bench run did: its time, its tokens, the KV blocks held after it.

:class:`StepRecorder` wraps one patchbay engine's ``step`` (and its scheduler's ``schedule``, to see what the
step ran) for the length of a run.  From its records the bench tells the KV memory a workload held at its peak
(blocks in use x every layer's page of a block), and how a decode step over long contexts compares with the
bandwidth it needs: every weight once, and the K and V of every context token of every request in the step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any


@dataclass(frozen=True)
class StepRecord:
    seconds: float
    tokens: int
    """Tokens the step ran (prompt chunks and decodes)."""
    decode_contexts: tuple[int, ...] | None
    """Where the step only decoded (one token per request, no new request): each request's context, the token
    decoded included; ``None`` otherwise."""
    blocks_in_use: int
    """The KV pool's blocks in use right after the step."""


@dataclass
class StepRecorder:
    """``with StepRecorder(engine) as steps: llm.generate(...)`` records every step run inside the block."""

    engine: Any
    records: list[StepRecord] = field(default_factory=list)

    def __enter__(self) -> StepRecorder:
        engine, scheduler = self.engine, self.engine.scheduler
        schedule, step = scheduler.schedule, engine.step
        last: list[Any] = []

        def recording_schedule() -> Any:  # noqa: ANN401 - the scheduler's output
            output = schedule()
            last[:] = [output]
            return output

        def recording_step() -> Any:  # noqa: ANN401 - the engine's outputs
            last.clear()
            started = time.perf_counter()
            outputs = step()
            seconds = time.perf_counter() - started
            if last:
                self.records.append(self._record(last[0], seconds))
            return outputs

        scheduler.schedule, engine.step = recording_schedule, recording_step
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        del self.engine.scheduler.schedule, self.engine.step  # the class's own methods again

    def _record(self, output: Any, seconds: float) -> StepRecord:  # noqa: ANN401 - a SchedulerOutput
        cached = output.scheduled_cached_reqs
        decoding = (
            not output.scheduled_new_reqs
            and output.total_num_scheduled_tokens > 0
            and all(count == 1 for count in output.num_scheduled_tokens.values())
            and not output.scheduled_spec_decode_tokens
        )
        manager = self.engine.scheduler.kv_cache_manager
        return StepRecord(
            seconds,
            output.total_num_scheduled_tokens,
            tuple(computed + 1 for computed in cached.num_computed_tokens) if decoding else None,
            manager.num_blocks - 1 - manager.num_free_blocks,
        )


@dataclass(frozen=True)
class DecodeBandwidth:
    """The decode steps of a run against the bytes they must read."""

    steps: int
    seconds_per_step: float
    kv_bytes_per_step: float
    """The K and V of every context token of the step's requests, all layers (mean over the decode steps)."""
    weight_bytes_per_step: float
    bandwidth_gb_s: float
    """The machine's measured read bandwidth."""

    @property
    def needed_gb_s(self) -> float:
        """The bandwidth the decode steps ran at, counting only the bytes they must read."""
        return (self.kv_bytes_per_step + self.weight_bytes_per_step) / self.seconds_per_step / 1e9

    @property
    def roofline_fraction(self) -> float:
        """The least time those bytes take at the measured bandwidth over the time the steps took (1.0: at it)."""
        return self.needed_gb_s / self.bandwidth_gb_s

    def as_dict(self) -> dict[str, float]:
        return {
            "decode_steps": self.steps,
            "decode_ms_per_step": self.seconds_per_step * 1e3,
            "decode_kv_mb_per_step": self.kv_bytes_per_step / 1e6,
            "decode_weight_mb_per_step": self.weight_bytes_per_step / 1e6,
            "decode_gb_s": self.needed_gb_s,
            "decode_bandwidth_fraction": self.roofline_fraction,
        }


def decode_bandwidth(
    records: list[StepRecord], kv_bytes_per_token: float, weight_bytes: float, bandwidth_gb_s: float
) -> DecodeBandwidth | None:
    """The decode steps among ``records`` against what they read: ``weight_bytes`` once per step and
    ``kv_bytes_per_token`` (K and V, all layers) per context token; ``None`` where no step only decoded."""
    decodes = [record for record in records if record.decode_contexts]
    if not decodes:
        return None
    seconds = sum(record.seconds for record in decodes) / len(decodes)
    tokens = sum(sum(record.decode_contexts or ()) for record in decodes) / len(decodes)
    return DecodeBandwidth(len(decodes), seconds, tokens * kv_bytes_per_token, weight_bytes, bandwidth_gb_s)


def peak_blocks(records: list[StepRecord]) -> int:
    """The most KV blocks in use after any step (0: no step)."""
    return max((record.blocks_in_use for record in records), default=0)
