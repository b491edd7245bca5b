"""The server's periodic stats line, as vLLM logs one: throughput, requests running and waiting, KV-cache use
and the prefix-cache hit rate, every ``server.stats_interval`` seconds, and nothing while the server is idle.

Each line covers the interval since the one before, from two of the engine's snapshots
(:attr:`AsyncLLM.snapshot`, taken after every step), so it costs the engine nothing::

    INFO:     engine: prompt 812.4 tok/s, generation 96.1 tok/s; running 12, waiting 0; KV cache 8.2% used;
              prefix cache hit rate 43.7%
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from patchbay.engine import AsyncLLM, EngineSnapshot

logger = logging.getLogger(__name__)


def stats_line(before: EngineSnapshot, after: EngineSnapshot, seconds: float) -> str | None:
    """The line for the interval from ``before`` to ``after`` (``seconds`` long); ``None`` when it was idle:
    no token in or out and nothing running or waiting at its end."""
    prompt = after.num_prompt_tokens - before.num_prompt_tokens
    generated = after.num_generated_tokens - before.num_generated_tokens
    if not prompt and not generated and not after.num_running and not after.num_waiting:
        return None
    queries = after.prefix_cache_queries - before.prefix_cache_queries
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    hit_rate = f"{100 * hits / queries:.1f}%" if queries else "-"
    seconds = max(seconds, 1e-9)
    return (
        f"engine: prompt {prompt / seconds:.1f} tok/s, generation {generated / seconds:.1f} tok/s; "
        f"running {after.num_running}, waiting {after.num_waiting}; KV cache {100 * after.kv_cache_usage:.1f}% used; "
        f"prefix cache hit rate {hit_rate}"
    )


class IntervalStats:
    """Successive snapshots as lines: each :meth:`tick`'s line covers the interval since the one before."""

    def __init__(self, snapshot: EngineSnapshot, now: float) -> None:
        self._before, self._since = snapshot, now

    def tick(self, snapshot: EngineSnapshot, now: float) -> str | None:
        """The line of the interval ending now (``None`` if it was idle); the next interval starts now."""
        line = stats_line(self._before, snapshot, now - self._since)
        self._before, self._since = snapshot, now
        return line


async def log_stats(llm: AsyncLLM, interval: float, emit: Callable[[str], None] = logger.info) -> None:
    """Log the stats line of every busy ``interval`` seconds until cancelled."""
    stats = IntervalStats(llm.snapshot, time.monotonic())
    while True:
        await asyncio.sleep(interval)
        line = stats.tick(llm.snapshot, time.monotonic())
        if line is not None:
            emit(line)


@contextlib.asynccontextmanager
async def stats_logging(llm: AsyncLLM, interval: float) -> AsyncIterator[None]:
    """Log the stats line while the block runs (``interval`` 0: never)."""
    if interval <= 0:
        yield
        return
    task = asyncio.create_task(log_stats(llm, interval))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
