"""``patchbay bench serve``: arrivals as asked, and end to end on a tiny model (no timing checks)."""

from __future__ import annotations

import json
import math
import statistics
from itertools import pairwise

import pytest

from patchbay.bench import workloads as wl
from patchbay.bench.serve_load import arrival_offsets, percentiles
from patchbay.entrypoints.cli import main


def test_arrivals_are_all_at_once_evenly_spaced_or_a_seeded_poisson_process():
    assert arrival_offsets(5, math.inf, "poisson", 0) == [0.0] * 5
    assert arrival_offsets(4, 2.0, "fixed", 0) == [0.0, 0.5, 1.0, 1.5]
    poisson = arrival_offsets(4000, 8.0, "poisson", 1)
    assert poisson == arrival_offsets(4000, 8.0, "poisson", 1) != arrival_offsets(4000, 8.0, "poisson", 2)
    gaps = [b - a for a, b in pairwise(poisson)]
    # Exponential gaps of mean 1/8 s: mean and standard deviation agree (to sampling error of ~3 %).
    assert abs(statistics.mean(gaps) - 0.125) < 0.01 and abs(statistics.stdev(gaps) - 0.125) < 0.01


def test_percentiles_are_in_milliseconds():
    assert percentiles([]) == {"p50_ms": None, "p90_ms": None, "p99_ms": None}
    cuts = percentiles([i / 1000 for i in range(101)])
    assert cuts == pytest.approx({"p50_ms": 50.0, "p90_ms": 90.0, "p99_ms": 99.0})


@pytest.mark.slow
def test_bench_serve_streams_every_requested_token_and_reports_the_overhead(tiny_llama, tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "serve",
            "--model",
            str(tiny_llama),
            "--num-requests",
            "12",
            "--prompt-range",
            "8",
            "32",
            "--output-range",
            "4",
            "12",
            "--rates",
            "30",
            "inf",
            "--concurrency",
            "8",
            "--max-concurrency",
            "8",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "serving overhead" in printed
    rows = [json.loads(line) for line in (out / "serve.jsonl").read_text().splitlines()]
    assert [row["run"] for row in rows] == [
        "serve @ 30 req/s",
        "serve @ inf req/s",
        "offline (patchbay run)",
        "in-process AsyncLLM",
    ]
    from transformers import AutoTokenizer

    workload = wl.throughput(
        wl.source_corpus(AutoTokenizer.from_pretrained(tiny_llama)),
        num_requests=12,
        prompt_range=(8, 32),
        output_range=(4, 12),
    )
    for row in rows:
        assert row["errors"] == 0 and row["generated_tokens"] == workload.generated_tokens, row
        assert row["ttft"]["p50_ms"] > 0 and row["itl"]["p50_ms"] > 0
    assert rows[1]["overhead_x"] > 0 and rows[1]["http_overhead_x"] > 0
    assert (out / "serve.png").stat().st_size > 0
