"""``patchbay bench`` end to end on a tiny model: every workload, both peers, the report files (no timing checks)."""

from __future__ import annotations

import json

import pytest

from patchbay.bench import workloads as wl
from patchbay.bench.roofline import ModelCost
from patchbay.entrypoints.cli import main


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 100 for c in text]


def test_workloads_are_seeded_and_sized_as_asked():
    corpus = wl.source_corpus(_Tokenizer())
    first = wl.throughput(corpus, num_requests=10, prompt_range=(16, 32), output_range=(4, 8), seed=3)
    assert first == wl.throughput(corpus, num_requests=10, prompt_range=(16, 32), output_range=(4, 8), seed=3)
    assert all(16 <= len(r.prompt_token_ids) <= 32 and 4 <= r.max_tokens <= 8 for r in first.requests)
    shared = wl.shared_prefix(corpus, num_requests=4, prefix_length=50)
    assert len({tuple(r.prompt_token_ids[:50]) for r in shared.requests}) == 1
    assert len({tuple(r.prompt_token_ids) for r in shared.requests}) == 4


def test_request_flops_count_the_lm_head_only_where_tokens_are_sampled():
    cost = ModelCost(
        linear_params=100, lm_head_params=10, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, bytes_per_param=4
    )
    # 3 prompt tokens + 2 generated: 4 tokens go through the model, 2 through the lm head,
    # causal attention over 1 + 2 + 3 + 4 positions at 4 FLOPs each.
    assert cost.request_flops(3, 2) == 2 * 100 * 4 + 2 * 10 * 2 + 4 * (1 + 2 + 3 + 4)


@pytest.mark.slow
def test_bench_runs_every_workload_against_both_peers(tiny_llama, tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "all",
            "--model",
            str(tiny_llama),
            "--num-requests",
            "4",
            "--concurrency",
            "2",
            "4",
            "--prompt-range",
            "8",
            "64",
            "--output-range",
            "4",
            "24",
            "--latency-prompts",
            "32",
            "--prefix-length",
            "200",
            "--threads",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "ceilings: batch-1 decode" in printed
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    engines = {row["engine"] for row in rows}
    assert {"patchbay", "transformers generate", "transformers continuous batching", "patchbay + ngram"} <= engines
    assert {row["workload"] for row in rows} == set(wl.WORKLOADS)
    for row in rows:
        assert row["machine"]["read_bandwidth_gb_s"] > 0 and row["model"]["linear_params"] > 0
        if row["workload"] == "quality":
            # A random model is near uniform over its vocabulary: its perplexity is in the thousands, not ~1.
            assert (
                row["engine"] == "patchbay" and 100 < row["perplexity"] < 10 * 49152
            )  # the tiny models share SmolLM2's vocabulary
            continue
        if row["workload"] != "latency":
            # Greedy, float32: patchbay with a drafter is exact; transformers' padded batches may flip a
            # near-tie of the random tiny model now and then, but misaligned tokens would match nowhere.
            same, total = map(int, row["same_tokens_as_patchbay"].split("/"))
            assert same == total if row["engine"].startswith("patchbay") else same >= 0.75 * total, row
            assert row.get("x_generate") and row.get("x_continuous")
    throughput = [row for row in rows if row["workload"] == "throughput" and row["engine"] == "patchbay"]
    assert sorted(row["concurrency"] for row in throughput) == [2, 4]
    assert all(row["step_breakdown_s"]["forward"] > 0 for row in throughput)
    assert (out / "bench.png").stat().st_size > 0


@pytest.mark.slow
def test_bench_over_two_ranks_reports_the_all_reduce_share_and_the_whole_model(tiny_llama, tmp_path, capsys):
    out = tmp_path / "bench"
    code = main(
        [
            "bench",
            "throughput",
            "--model",
            str(tiny_llama),
            "--num-requests",
            "4",
            "--concurrency",
            "4",
            "--prompt-range",
            "8",
            "32",
            "--output-range",
            "4",
            "8",
            "--peers",
            "--tensor-parallel-size",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    assert "all_reduce" in capsys.readouterr().out
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert rows[0]["step_breakdown_s"]["all_reduce"] > 0
    # Rank 0 holds half of each decoder linear; the roofline counts the whole model: 4 layers of 64-wide
    # q, o (64 x 64), k, v (16 x 64: 2 KV heads of 8) and gate, up, down (128 x 64).
    assert rows[0]["model"]["linear_params"] == 4 * (2 * 64 * 64 + 2 * 16 * 64 + 3 * 128 * 64)


@pytest.mark.slow
def test_kv_cache_dtypes_pair_with_the_first_engine_and_each_quantization(tiny_llama, tmp_path):
    out = tmp_path / "bench"
    args = ["bench", "throughput", "--model", str(tiny_llama), "--num-requests", "4", "--concurrency", "4"]
    args += ["--prompt-range", "8", "32", "--output-range", "4", "8", "--threads", "2", "--dtype", "float32"]
    # int8 weights run on every CPU (W8A8 needs AVX512-VNNI).
    code = main([*args, "--quantization", "int8", "--kv-cache-dtype", "int8", "--peers", "--out", str(out)])
    assert code == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    built = {(row["weight_format"], row["kv_cache_dtype"]) for row in rows}
    assert built == {("auto", "auto"), ("auto", "int8"), ("int8", "auto"), ("int8", "int8")}
    paired = next(row for row in rows if row["weight_format"] == "int8" and row["kv_cache_dtype"] == "int8")
    assert paired["engine"].endswith(", int8, int8 KV)"), paired["engine"]


def test_json_lines_drop_the_named_keys_and_add_the_context(tmp_path):
    from patchbay.bench.report import append_json_lines

    path = tmp_path / "rows.jsonl"
    append_json_lines(path, [{"a": 1, "token_ids": [1]}], drop=("token_ids",), machine="m")
    append_json_lines(path, [{"a": 2}])
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"a": 1, "machine": "m"}, {"a": 2}]


def test_the_table_warns_when_an_engine_ran_a_provisional_tuning():
    """Figures measured on a busy machine's choice of paths are not the machine's (issue 55)."""
    import io

    from patchbay.bench.machine import MachineLimits
    from patchbay.bench.report import print_table
    from patchbay.bench.roofline import Roofline

    cost = ModelCost(
        linear_params=100, lm_head_params=10, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, bytes_per_param=4
    )
    roofline = Roofline(cost, MachineLimits("m", 2, read_bandwidth_gb_s=5.0, gemm_gflop_s=1.0))
    row = {
        "workload": "throughput",
        "label": "concurrency 2",
        "engine": "patchbay",
        "seconds": 1.0,
        "generated_tokens_per_s": 10.0,
        "compute_ceiling_fraction": 0.5,
    }
    quiet, printed = io.StringIO(), io.StringIO()
    print_table([{**row, "tuning_provisional": False}], roofline, quiet)
    print_table([{**row, "tuning_provisional": True}, {**row, "engine": "vLLM"}], roofline, printed)
    assert "PROVISIONAL" not in quiet.getvalue()
    assert "warning: patchbay ran a PROVISIONAL CPU tuning" in printed.getvalue()
