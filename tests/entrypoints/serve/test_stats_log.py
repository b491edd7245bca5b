"""The server's periodic stats line: what it says of an interval, silence while idle, and the line a real
server logs once it has served a request."""

from __future__ import annotations

import logging
import time

import httpx
from serving import running_server

from patchbay.contract.settings import load_settings
from patchbay.engine import EngineSnapshot
from patchbay.entrypoints.serve.stats_log import IntervalStats, stats_line


def test_a_busy_interval_gives_throughput_load_kv_use_and_the_prefix_hit_rate():
    before = EngineSnapshot(
        num_prompt_tokens=100, num_generated_tokens=40, prefix_cache_queries=64, prefix_cache_hits=0
    )
    after = EngineSnapshot(
        num_running=3,
        num_waiting=1,
        kv_cache_usage=0.125,
        num_prompt_tokens=300,
        num_generated_tokens=90,
        prefix_cache_queries=264,
        prefix_cache_hits=80,
    )
    assert stats_line(before, after, 10.0) == (
        "engine: prompt 20.0 tok/s, generation 5.0 tok/s; running 3, waiting 1; KV cache 12.5% used; "
        "prefix cache hit rate 40.0%"
    )


def test_an_interval_without_lookups_shows_no_hit_rate_and_an_idle_one_no_line():
    busy = EngineSnapshot(num_running=2, kv_cache_usage=0.5)
    assert stats_line(EngineSnapshot(), busy, 5.0).endswith("prefix cache hit rate -")
    idle = EngineSnapshot(num_prompt_tokens=7, num_generated_tokens=9, prefix_cache_queries=7)
    assert stats_line(idle, idle, 10.0) is None


def test_successive_ticks_log_the_busy_intervals_only():
    snapshots = [
        EngineSnapshot(num_prompt_tokens=10, num_running=1),  # prefill
        EngineSnapshot(num_prompt_tokens=10, num_generated_tokens=5, num_running=1),
        EngineSnapshot(num_prompt_tokens=10, num_generated_tokens=8),  # finished during this interval
        EngineSnapshot(num_prompt_tokens=10, num_generated_tokens=8),  # idle
        EngineSnapshot(num_prompt_tokens=10, num_generated_tokens=8),  # idle
        EngineSnapshot(num_prompt_tokens=14, num_generated_tokens=8, num_waiting=1),  # busy again
    ]
    stats = IntervalStats(EngineSnapshot(), 0.0)
    lines = [stats.tick(snapshot, 2.0 * (number + 1)) for number, snapshot in enumerate(snapshots)]
    assert [line is not None for line in lines] == [True, True, True, False, False, True]
    assert lines[0].startswith("engine: prompt 5.0 tok/s, generation 0.0 tok/s; running 1, waiting 0;")
    assert lines[2].startswith("engine: prompt 0.0 tok/s, generation 1.5 tok/s; running 0, waiting 0;")
    assert lines[5].startswith("engine: prompt 2.0 tok/s, generation 0.0 tok/s; running 0, waiting 1;")


def test_a_server_logs_the_line_after_serving_and_says_nothing_more_while_idle(tiny_llama, caplog):
    settings = load_settings(
        None,
        overrides=[f"model.path={tiny_llama}", "cache.num_blocks=64", "server.stats_interval=0.2"],
    )
    with caplog.at_level(logging.INFO, logger="patchbay.entrypoints.serve.stats_log"):
        with running_server(settings) as server:
            body = {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
            assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=120).status_code == 200
            deadline = time.monotonic() + 30
            while not caplog.records and time.monotonic() < deadline:
                time.sleep(0.05)
            server.wait_until_idle()
            time.sleep(1.0)  # five idle intervals
            settled = len(caplog.records)
            time.sleep(1.0)
            assert len(caplog.records) == settled, [record.getMessage() for record in caplog.records]
    lines = [record.getMessage() for record in caplog.records]
    assert lines and lines[0].startswith("engine: prompt ")
    assert any("generation" in line and "generation 0.0 tok/s" not in line for line in lines)
