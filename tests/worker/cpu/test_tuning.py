"""Machine-measured defaults: the choice for AVX2-only and AMX CPUs, from faked flags and timings.

The measurements themselves are benchmarks (``patchbay tune``); here the
decision is checked for CPUs this machine is not.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from patchbay.worker.cpu import tuning
from patchbay.toolkit.cpu import CpuInfo
from patchbay.worker.cpu.tuning import LayerShapes, Measurements, apply_linear_paths, choose

AVX2_EPYC = CpuInfo("AMD EPYC 7B13", frozenset({"avx2", "fma", "avx512f"}))
AMX_XEON = CpuInfo(
    "Intel(R) Xeon(R) Platinum 8481C",
    frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16"}),
)
XEON_WITHOUT_AMX = CpuInfo("Intel(R) Xeon(R) Processor", frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}))
SHAPES = LayerShapes(hidden=64, qkv=(64, 16, 16), intermediate=128)


def _times(**per_bucket: list[float]) -> dict[str, dict[int, float]]:
    return {name: dict(zip(tuning.ROW_BUCKETS, values, strict=True)) for name, values in per_bucket.items()}


def _measured(
    float32,
    bfloat16=None,
    float16=None,
    row_split=None,
    fused=None,
    packed=None,
    single_thread=None,
    tiled=None,
    bfloat16_kernels=None,
    bfloat16_amx=None,
) -> Measurements:
    by_dtype = _times(
        float32=float32, **({"bfloat16": bfloat16} if bfloat16 else {}), **({"float16": float16} if float16 else {})
    )
    few_rows = {
        dtype: dict(zip(tuning.ROW_BUCKETS, values, strict=False)) for dtype, values in (single_thread or {}).items()
    }
    return Measurements(
        by_dtype=by_dtype,
        row_split=_times(x=row_split or float32)["x"],
        fused=_times(x=fused or float32)["x"],
        packed=_times(**(packed or {})),
        single_thread=few_rows,
        tiled=_times(**(tiled or {})),
        bfloat16_kernels=_times(**(bfloat16_kernels or {})),
        bfloat16_amx=_times(x=bfloat16_amx)["x"] if bfloat16_amx else {},
    )


def test_native_dtypes_follow_the_flags():
    assert AVX2_EPYC.native_dtypes() == ("float32",)
    assert AMX_XEON.native_dtypes() == ("float32", "bfloat16", "float16")
    arm = CpuInfo("Neoverse-V1", frozenset({"asimd", "bf16", "sve"}))
    assert arm.native_dtypes() == ("float32", "bfloat16")


def test_an_avx2_cpu_keeps_float32_even_where_emulated_bf16_measured_faster():
    # bf16 without native instructions is emulated; a lucky measurement must not pick it.
    chosen = choose(AVX2_EPYC, _measured(float32=[1, 2, 8, 30], bfloat16=[0.5, 1, 4, 15]), threads=2)
    assert chosen.dtype == "float32"
    assert chosen.native_dtypes == ["float32"] and set(chosen.speedup) == {"float32"}


def test_an_amx_cpu_picks_bfloat16_when_it_is_measured_faster():
    chosen = choose(
        AMX_XEON, _measured(float32=[1, 2, 8, 30], bfloat16=[1.2, 1, 2.5, 8], float16=[1, 2, 8, 30]), threads=2
    )
    assert chosen.dtype == "bfloat16"
    assert chosen.speedup["bfloat16"] > tuning.MIN_GAIN > chosen.speedup["float16"]


def test_a_native_dtype_must_beat_float32_clearly_to_be_chosen():
    chosen = choose(AMX_XEON, _measured(float32=[1, 2, 8, 30], bfloat16=[0.97, 1.95, 7.8, 29]), threads=2)
    assert chosen.dtype == "float32"


def test_linear_paths_win_up_to_the_last_bucket_of_an_unbroken_run_of_wins():
    measured = _measured(float32=[1, 2, 8, 30], row_split=[0.5, 1, 9, 10], fused=[0.9, 1.5, 7, 20])
    chosen = choose(AVX2_EPYC, measured, threads=2)
    assert chosen.row_split_max_rows == 8  # wins at 1 and 8 rows, loses at 64: the win at 256 does not count
    assert chosen.fuse_max_rows == 256
    assert choose(AVX2_EPYC, measured, threads=1).row_split_max_rows == 0  # one thread: nothing to split over
    losing = choose(AVX2_EPYC, _measured(float32=[1, 2, 8, 30], row_split=[1.02, 1, 1, 1]), threads=2)
    assert losing.row_split_max_rows == 0


def test_packing_is_chosen_per_dtype_and_dtypes_compare_on_their_fastest_paths():
    measured = _measured(
        float32=[1, 2, 8, 30],
        bfloat16=[1.2, 1, 2.5, 8],
        packed={"float32": [0.5, 1, 4, 15], "bfloat16": [1.15, 0.95, 2.4, 7.9]},
    )
    chosen = choose(AMX_XEON, measured, threads=2)
    assert chosen.packed_dtypes == ["float32"]  # packed bfloat16 gains under PATH_GAIN over its torch products
    # bfloat16 beats float32's torch products 1.8x, but packed float32 nearly as fast: float32 stays.
    assert chosen.dtype == "float32" and chosen.speedup["bfloat16"] < tuning.MIN_GAIN
    assert "oneDNN-packed linears for float32" in chosen.describe()
    assert chosen.measurements["packed_float32"]["64"] == 4


def test_an_avx2_cpu_packs_float32_and_never_an_emulated_dtype():
    measured = _measured(
        float32=[1, 2, 8, 30],
        bfloat16=[0.5, 1, 4, 15],
        packed={"float32": [0.5, 1, 4, 15], "bfloat16": [0.2, 0.4, 2, 7]},
    )
    chosen = choose(AVX2_EPYC, measured, threads=2)
    assert (chosen.dtype, chosen.packed_dtypes) == ("float32", ["float32"])


def test_tiles_replace_oneDNN_only_where_they_win_over_the_row_counts():
    # An AVX512-BF16 CPU without AMX: tiles stream few-row products faster and match oneDNN on many rows.
    measured = _measured(
        float32=[1, 2, 8, 30],
        bfloat16=[0.8, 1, 2, 8],
        packed={"bfloat16": [0.4, 0.45, 0.8, 2]},
        tiled={"bfloat16": [0.11, 0.17, 0.46, 1.9], "float32": [0.9, 1.9, 8.5, 31]},
    )
    chosen = choose(AMX_XEON, measured, threads=2)
    assert (chosen.dtype, chosen.tiled_dtypes) == ("bfloat16", ["bfloat16"])  # float32 tiles gain nothing
    # The tiled products keep their own threads: only the ops around them go to one thread, up to 8 tokens.
    assert chosen.single_thread_max_tokens["bfloat16"] == tuning.STREAMED_MAX_ROWS
    assert "tiled linears for bfloat16 (pairs), oneDNN-packed linears for none" in chosen.describe()  # tiles replace it
    assert chosen.measurements["tiled_bfloat16"]["256"] == 1.9
    # With AMX, oneDNN is several times faster on many rows: over the row counts the tiles lose, oneDNN stays.
    amx = _measured(
        float32=[1, 2, 8, 30],
        bfloat16=[0.8, 1, 2, 8],
        packed={"bfloat16": [0.4, 0.45, 0.3, 0.6]},
        tiled={"bfloat16": [0.11, 0.17, 0.9, 3.5]},
    )
    chosen = choose(AMX_XEON, amx, threads=2)
    assert chosen.tiled_dtypes == [] and chosen.packed_dtypes == ["bfloat16"]


def test_amx_takes_bfloat16_tiles_from_the_bucket_where_it_wins_on_and_tiles_then_beat_onednn():
    def chosen_with(amx: list[float]) -> tuning.Tuning:
        measured = _measured(
            float32=[1, 2, 8, 30],
            bfloat16=[0.8, 1, 2, 8],
            packed={"bfloat16": [0.4, 0.45, 0.3, 0.6]},
            bfloat16_kernels={"pairs": [0.11, 0.17, 0.9, 3.5]},
            bfloat16_amx=amx,
        )
        return choose(AMX_XEON, measured, threads=2)

    # AMX wins at 1 row, loses at 8, wins from 64 on: it takes over where the straight lines between 8 and 64
    # cross by PATH_GAIN (0.17 + 0.73 (r - 8) / 56 = 1.05 (0.2 + 0 (r - 8) / 56) at r = 11.07), and tiles then
    # beat oneDNN throughout.
    chosen = chosen_with([0.1, 0.2, 0.2, 0.5])
    assert (chosen.bfloat16_amx_from_rows, chosen.tiled_dtypes, chosen.dtype) == (12, ["bfloat16"], "bfloat16")
    assert "tiled linears for bfloat16 (pairs, AMX from 12 rows)" in chosen.describe()
    assert chosen.measurements["tiled_bfloat16_amx"]["256"] == 0.5
    assert chosen_with([0.1, 0.1, 0.1, 0.2]).bfloat16_amx_from_rows == 1
    slow = chosen_with([0.5, 0.5, 0.9, 3.4])  # under PATH_GAIN at 256: no AMX, and oneDNN keeps bfloat16
    assert (slow.bfloat16_amx_from_rows, slow.tiled_dtypes, slow.packed_dtypes) == (0, [], ["bfloat16"])
    assert "AMX" not in slow.describe()


def test_a_path_wins_from_where_its_straight_line_crosses_the_baselines_between_buckets():
    def wins_from(path: list[float], baseline: list[float]) -> int:
        return tuning._wins_from(*(dict(zip(tuning.ROW_BUCKETS, times, strict=True)) for times in (path, baseline)))

    # W8A8 through AMX against VNNI on the Xeon with AMX (ms per layer): behind at 8 rows, twice as fast at 64;
    # a step of 16 rows measured it 1.07x and one of 32 rows 1.6x faster. The bucket alone would say 64.
    assert wins_from([0.223, 0.226, 0.277, 0.882], [0.178, 0.207, 0.545, 1.926]) == 14
    assert wins_from([0.1, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2]) == 1  # wins everywhere
    assert wins_from([0.3, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2]) == 8  # from 1 to 8 rows the times stay flat
    assert wins_from([0.3, 0.3, 0.3, 0.1], [0.2, 0.2, 0.2, 0.2]) == 170  # crossing at 169.1 rows, between 64 and 256
    assert wins_from([0.3, 0.3, 0.3, 0.3], [0.2, 0.2, 0.2, 0.2]) == 0  # never
    assert wins_from([0.1, 0.3, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2]) == 39  # 0.2 = 1.05 (0.3 - 0.2 (r - 8) / 56) at 38.7
    assert tuning._wins_from({64: 0.1, 256: 0.1}, {1: 0.2, 8: 0.2, 64: 0.2, 256: 0.2}) == 64  # 8 unmeasured


def test_auto_tiles_run_amx_from_the_tuned_row_count():
    from patchbay.toolkit import tiles as streaming_linear

    if streaming_linear.tiles_unavailable(torch.bfloat16) is not None:
        pytest.skip(streaming_linear.tiles_unavailable(torch.bfloat16))
    measured = _measured(
        float32=[1, 2, 8, 30],
        bfloat16=[2, 4, 16, 60],
        bfloat16_kernels={"pairs": [0.3, 0.6, 6, 24], "fma": [0.3, 0.5, 3.5, 14]},
        bfloat16_amx=[0.5, 0.4, 0.5, 1],
    )
    chosen = choose(AMX_XEON, measured, threads=2)
    assert chosen.bfloat16_amx_from_rows == 8  # under 8 rows the weights stream: no straight line to cross
    previous = (
        streaming_linear.use_bfloat16_amx_from(0),
        streaming_linear.use_bfloat16_kernel("pairs"),
        streaming_linear.use_bfloat16_pairs_up_to(0),
    )
    try:
        layer = _Layer(torch.bfloat16)
        apply_linear_paths(
            layer,
            linear_kernel="auto",
            fuse_projections=True,
            dtype="bfloat16",
            device=torch.device("cpu"),
            tuning=chosen,
        )
        assert streaming_linear.use_bfloat16_amx_from(previous[0]) == 8
    finally:
        streaming_linear.use_bfloat16_amx_from(previous[0])
        streaming_linear.use_bfloat16_kernel(previous[1])
        streaming_linear.use_bfloat16_pairs_up_to(previous[2])


def test_steps_run_on_one_thread_up_to_the_last_bucket_where_one_thread_wins():
    measured = _measured(
        float32=[1, 2, 8, 30],
        bfloat16=[0.8, 1, 2, 8],
        packed={"bfloat16": [0.5, 0.6, 1.5, 6]},
        single_thread={"bfloat16": [0.3, 0.5], "float32": [1.2, 1.9]},
    )
    chosen = choose(AMX_XEON, measured, threads=2)
    # bfloat16 runs packed, and its packed layer is faster on one thread at 1 and 8 rows; float32's is not.
    assert chosen.single_thread_max_tokens == {"float32": 0, "bfloat16": 8}
    assert "one thread for steps up to 8 tokens" in chosen.describe()
    assert choose(AMX_XEON, measured, threads=1).single_thread_max_tokens["bfloat16"] == 0


def test_cpuinfo_is_read_for_x86_and_arm(tmp_path):
    x86 = tmp_path / "x86"
    x86.write_text(
        "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n\n"
        "processor\t: 1\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2 avx512_bf16\n"
    )
    assert CpuInfo.read(x86) == CpuInfo("AMD EPYC", frozenset({"fpu", "avx2", "avx512_bf16"}))
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\nCPU implementer\t: 0x41\n")
    assert CpuInfo.read(arm).flags == frozenset({"fp", "asimd", "bf16"})


def test_tune_measures_once_caches_per_cpu_and_measures_again_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_measure(shapes, dtypes, threads, budget_seconds=1.5, clock=None):
        calls.append(dtypes)
        return _measured(float32=[1, 2, 8, 30], bfloat16=[1, 1, 2, 8])

    monkeypatch.setattr(tuning, "measure", fake_measure)
    first = tuning.tune(SHAPES, threads=2, cpu=AMX_XEON)
    again = tuning.tune(SHAPES, threads=2, cpu=AMX_XEON)
    assert (first.dtype, first.cached, again.dtype, again.cached) == ("bfloat16", False, "bfloat16", True)
    assert len(calls) == tuning.TUNING_ROUNDS  # rounds that agree: no more
    assert tuning.tune(SHAPES, threads=2, cpu=AVX2_EPYC).dtype == "float32"  # another CPU: its own entry
    tuning.tune(SHAPES, threads=2, cpu=AMX_XEON, fresh=True)
    assert len(calls) == 3 * tuning.TUNING_ROUNDS
    (cached_file,) = [
        p for p in (tmp_path / "tuning").iterdir() if json.loads(p.read_text())["cpu"] == AMX_XEON.model_name
    ]
    cached_file.write_text("{not json")  # a damaged entry is measured again, not an error
    assert tuning.tune(SHAPES, threads=2, cpu=AMX_XEON).cached is False


def test_a_burst_that_slows_one_rounds_tiles_does_not_decide(monkeypatch):
    clean = {
        "float32": [1, 2, 8, 30],
        "bfloat16": [0.8, 1, 2, 8],
        "packed": {"bfloat16": [0.4, 0.45, 0.3, 0.6]},
        "bfloat16_kernels": {"pairs": [0.11, 0.17, 0.9, 3.5]},
        "bfloat16_amx": [0.1, 0.2, 0.2, 0.5],
    }
    # A neighbour's burst while the tiles were timed, and only then: alone, this round keeps oneDNN.
    burst = {**clean, "bfloat16_kernels": {"pairs": [0.5, 0.6, 3, 10]}, "bfloat16_amx": [0.4, 0.8, 0.9, 2]}
    assert choose(AMX_XEON, _measured(**burst), threads=2).tiled_dtypes == []
    rounds = [_measured(**burst), _measured(**clean), _measured(**clean), _measured(**burst)]
    calls = []

    def fake_measure(shapes, dtypes, threads, budget_seconds=1.5, clock=None):
        calls.append(dtypes)
        return rounds[len(calls) - 1]

    monkeypatch.setattr(tuning, "measure", fake_measure)
    rounds = tuning.measure_in_rounds(SHAPES, ("float32", "bfloat16"), threads=2)
    chosen = choose(AMX_XEON, rounds.measurements, threads=2)
    assert (chosen.tiled_dtypes, chosen.bfloat16_amx_from_rows) == (["bfloat16"], 12)  # the clean round's times
    assert len(calls) == 3  # the first two rounds disagreed: a third, which agreed with the second
    assert chosen.measurements["tiled_bfloat16_amx"]["256"] == 0.5


def test_decode_timings_stream_no_more_layers_than_the_model_has():
    """A tiny model was timed as thousands of layer copies (minutes per start) though it runs from the cache."""
    overflowing = tuning._layers(SHAPES, torch.float32)
    layer_bytes = sum(weight.numel() * weight.element_size() for weight in overflowing[0])
    assert len(overflowing) * layer_bytes >= 64 << 20  # depth unknown: enough copies to overflow the cache
    four_layers = LayerShapes(SHAPES.hidden, SHAPES.qkv, SHAPES.intermediate, layers=4)
    copies = tuning._layers(four_layers, torch.float32)
    assert len(copies) == 4 and copies[1][0] is not copies[0][0] and torch.equal(copies[1][0], copies[0][0])


class _Layer(nn.Module):
    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(64, 64, bias=False, dtype=dtype) for _ in range(3))
        self.o_proj = nn.Linear(64, 64, bias=False, dtype=dtype)


@pytest.mark.parametrize(
    "kernel, row_split_rows, expect_split",
    [("auto", 8, True), ("auto", 0, False), ("torch", 8, False), ("row_split", 0, True)],
)
def test_linear_paths_follow_the_setting_or_the_tuning(kernel, row_split_rows, expect_split):
    chosen = choose(AVX2_EPYC, _measured(float32=[1, 2, 8, 30]), threads=2)
    chosen.row_split_max_rows, chosen.fuse_max_rows = row_split_rows, 8
    layer = _Layer(torch.float32)
    inputs = torch.randn(3, 64)
    expected = [linear(inputs) for linear in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)]
    torch.set_num_threads(2)
    paths = apply_linear_paths(
        layer, linear_kernel=kernel, fuse_projections=True, dtype="float32", device=torch.device("cpu"), tuning=chosen
    )
    assert paths.fused_groups == 1 and (paths.row_split > 0) == expect_split and paths.packed == 0
    got = [linear(inputs) for linear in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)]
    for want, have in zip(expected, got, strict=True):
        torch.testing.assert_close(have, want)


def test_auto_packs_the_linears_of_a_dtype_the_tuning_packs():
    chosen = choose(AVX2_EPYC, _measured(float32=[1, 2, 8, 30], packed={"float32": [0.5, 1, 4, 15]}), threads=2)
    layer = _Layer(torch.float32)
    inputs = torch.randn(3, 64)
    expected = [linear(inputs).detach() for linear in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)]
    paths = apply_linear_paths(
        layer, linear_kernel="auto", fuse_projections=True, dtype="float32", device=torch.device("cpu"), tuning=chosen
    )
    assert (paths.fused_groups, paths.packed, paths.row_split) == (1, 4, 0)
    for want, linear in zip(expected, (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj), strict=True):
        torch.testing.assert_close(linear(inputs), want)
    # A dtype the tuning did not pack keeps the other paths.
    other = _Layer(torch.bfloat16)
    unpacked = apply_linear_paths(
        other, linear_kernel="auto", fuse_projections=True, dtype="bfloat16", device=torch.device("cpu"), tuning=chosen
    )
    assert unpacked.packed == 0 and not other.q_proj.weight.is_meta


def test_auto_tiles_the_linears_of_a_dtype_the_tuning_tiles():
    from patchbay.toolkit.tiles import tiles_unavailable

    if tiles_unavailable(torch.float32) is not None:
        pytest.skip(tiles_unavailable(torch.float32))
    chosen = choose(
        AVX2_EPYC,
        _measured(float32=[1, 2, 8, 30], packed={"float32": [0.5, 1, 4, 15]}, tiled={"float32": [0.2, 0.5, 4, 15]}),
        threads=2,
    )
    assert chosen.tiled_dtypes == ["float32"]
    layer = _Layer(torch.float32)
    inputs = torch.randn(3, 64)
    expected = [linear(inputs).detach() for linear in (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj)]
    paths = apply_linear_paths(
        layer, linear_kernel="auto", fuse_projections=True, dtype="float32", device=torch.device("cpu"), tuning=chosen
    )
    assert (paths.layout, paths.fused_groups, paths.packed) == ("output tiles", 1, 4)
    for want, linear in zip(expected, (layer.q_proj, layer.k_proj, layer.v_proj, layer.o_proj), strict=True):
        torch.testing.assert_close(linear(inputs), want, rtol=2e-5, atol=2e-5)


def test_bfloat16_tiles_run_the_faster_kernel_and_it_decides_the_dtype():
    def chosen_with(**kernels: list[float]) -> tuning.Tuning:
        measured = _measured(
            float32=[1, 2, 8, 30], bfloat16=[2, 4, 16, 60], tiled={"float32": [0.5, 1, 4, 15]}, bfloat16_kernels=kernels
        )
        return choose(XEON_WITHOUT_AMX, measured, threads=2)

    pairs, fma = [0.3, 0.6, 6, 24], [0.3, 0.5, 3.5, 14]  # the pair product at half float32's rate once rows grow
    xeon = chosen_with(pairs=pairs, fma=fma)
    assert (xeon.bfloat16_kernel, xeon.dtype, xeon.tiled_dtypes) == ("fma", "bfloat16", ["float32", "bfloat16"])
    assert xeon.measurements["tiled_bfloat16_pairs"]["64"] == 6 and "(fma)" in xeon.describe()
    pairs_only = chosen_with(pairs=pairs)
    assert (pairs_only.bfloat16_kernel, pairs_only.dtype) == ("pairs", "float32")  # 1.04x: under MIN_GAIN
    assert xeon.bfloat16_pairs_max_rows == 0  # a tie at one row: fma throughout
    # The pair product 1.2x faster at one row, slower from 8: it keeps the one-row products.
    one_row = chosen_with(pairs=[0.25, 0.6, 6, 24], fma=fma)
    assert (one_row.bfloat16_kernel, one_row.bfloat16_pairs_max_rows) == ("fma", 1)
    assert "(fma, pairs up to 1 row)" in one_row.describe()
    assert one_row.speedup["bfloat16"] > xeon.speedup["bfloat16"]  # the dtype is chosen on the mixed times
    zen4 = chosen_with(pairs=[0.3, 0.5, 2, 7], fma=fma)
    assert (zen4.bfloat16_kernel, zen4.dtype, zen4.bfloat16_pairs_max_rows) == ("pairs", "bfloat16", 0)
    assert choose(AVX2_EPYC, _measured(float32=[1, 2, 8, 30]), threads=2).bfloat16_kernel == "pairs"  # none measured


@pytest.mark.parametrize("kernel", ["fma", "pairs"])
def test_auto_tiles_bfloat16_with_the_tuned_kernel(kernel):
    from patchbay.toolkit import tiles as streaming_linear

    if streaming_linear.tiles_unavailable(torch.bfloat16) is not None:
        pytest.skip(streaming_linear.tiles_unavailable(torch.bfloat16))
    kernels = {"pairs": [0.3, 0.6, 6, 24], "fma": [0.3, 0.5, 3.5, 14]}
    kernels[kernel] = [0.1, 0.2, 1, 4]
    kernels["pairs"][0] = 0.05  # pairs wins one-row products, so under fma it keeps them
    measured = _measured(float32=[1, 2, 8, 30], bfloat16=[2, 4, 16, 60], bfloat16_kernels=kernels)
    chosen = choose(XEON_WITHOUT_AMX, measured, threads=2)
    assert chosen.bfloat16_kernel == kernel and chosen.tiled_dtypes == ["bfloat16"]
    assert chosen.bfloat16_pairs_max_rows == (1 if kernel == "fma" else 0)
    other = "pairs" if kernel == "fma" else "fma"
    previous = streaming_linear.use_bfloat16_kernel(other)
    previous_rows = streaming_linear.use_bfloat16_pairs_up_to(5)
    try:
        layer = _Layer(torch.bfloat16)
        paths = apply_linear_paths(
            layer,
            linear_kernel="auto",
            fuse_projections=True,
            dtype="bfloat16",
            device=torch.device("cpu"),
            tuning=chosen,
        )
        assert paths.layout == "output tiles"
        assert streaming_linear.use_bfloat16_kernel(other) == kernel  # the tuned kernel ran until put back here
        assert streaming_linear.use_bfloat16_pairs_up_to(previous_rows) == chosen.bfloat16_pairs_max_rows
    finally:
        streaming_linear.use_bfloat16_kernel(previous)
        streaming_linear.use_bfloat16_pairs_up_to(previous_rows)


def test_an_engine_left_on_auto_runs_the_tuned_dtype(tiny_llama, tmp_path, monkeypatch):
    import patchbay

    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PATCHBAY_MODEL__DTYPE", raising=False)
    monkeypatch.setattr(tuning.CpuInfo, "read", classmethod(lambda cls, cpuinfo=None: AMX_XEON))
    monkeypatch.setattr(
        tuning,
        "measure",
        lambda shapes, dtypes, threads, budget_seconds=1.5, clock=None: _measured(
            float32=[1, 2, 8, 30], bfloat16=[1, 1, 2, 8]
        ),
    )
    llm = patchbay.LLM(model__path=str(tiny_llama))
    assert llm.engine.dtype == "bfloat16" and llm.engine.tuning.dtype == "bfloat16"
    pinned = patchbay.LLM(model__path=str(tiny_llama), model__dtype="float32")
    assert pinned.engine.dtype == "float32"


FLOAT32_FASTEST = {"float32": [1, 2, 8, 30], "bfloat16": [1.5, 3, 16, 60]}


def test_auto_is_bfloat16_under_integer_products_where_the_cpu_has_it():
    from patchbay.engine.builder import resolve_dtype

    cpu = torch.device("cpu")
    float32_chosen = choose(XEON_WITHOUT_AMX, _measured(**FLOAT32_FASTEST), threads=2)
    assert float32_chosen.dtype == "float32"
    assert resolve_dtype("auto", cpu, float32_chosen, integer_products=True) == "bfloat16"
    assert resolve_dtype("auto", cpu, float32_chosen) == "float32"  # float products keep the measured choice
    assert resolve_dtype("float32", cpu, float32_chosen, integer_products=True) == "float32"  # a pinned dtype stays
    avx2_chosen = choose(AVX2_EPYC, _measured(float32=[1, 2, 8, 30]), threads=2)
    assert resolve_dtype("auto", cpu, avx2_chosen, integer_products=True) == "float32"  # no native bfloat16
    assert resolve_dtype("auto", cpu, None, integer_products=True) == "float32"
    assert resolve_dtype("auto", torch.device("cuda"), None) == "bfloat16"


def test_only_integer_tiles_count_as_integer_products():
    from patchbay.worker.cpu.quantization import (
        int4_tiles_unavailable,
        rounds_activations_to_int8,
        w8a8_tiles_unavailable,
    )

    assert not rounds_activations_to_int8("none")
    assert not rounds_activations_to_int8("int8")  # weight-only: its products multiply activations of the dtype
    assert rounds_activations_to_int8("int4") == (int4_tiles_unavailable() is None)
    assert rounds_activations_to_int8("w8a8") == (w8a8_tiles_unavailable() is None)


def test_an_int4_engine_left_on_auto_runs_bfloat16_where_float32_measured_faster(tiny_llama, tmp_path, monkeypatch):
    from patchbay.worker.cpu.quantization import int4_tiles_unavailable

    if (reason := int4_tiles_unavailable()) is not None:
        pytest.skip(reason)
    import patchbay

    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PATCHBAY_MODEL__DTYPE", raising=False)
    monkeypatch.setattr(tuning.CpuInfo, "read", classmethod(lambda cls, cpuinfo=None: XEON_WITHOUT_AMX))
    monkeypatch.setattr(
        tuning, "measure", lambda shapes, dtypes, threads, budget_seconds=1.5, clock=None: _measured(**FLOAT32_FASTEST)
    )
    llm = patchbay.LLM(model__path=str(tiny_llama), model__weight_format="int4")
    assert llm.engine.tuning.dtype == "float32" and llm.engine.dtype == "bfloat16"
    (output,) = llm.generate([[1, 2, 3]], patchbay.SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(output.token_ids) == 4


def test_patchbay_tune_measures_afresh_and_prints_the_choice(tiny_llama, tmp_path, monkeypatch, capsys):
    from patchbay.entrypoints.cli import main

    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning.CpuInfo, "read", classmethod(lambda cls, cpuinfo=None: AMX_XEON))
    calls = []
    monkeypatch.setattr(
        tuning,
        "measure",
        lambda shapes, dtypes, threads, budget_seconds=1.5, clock=None: (
            calls.append(shapes) or _measured(float32=[1, 2, 8, 30], bfloat16=[1, 1, 2, 8], row_split=[0.5, 3, 9, 31])
        ),
    )
    assert main(["tune", "--set", f"model.path={tiny_llama}"]) == 0
    printed = capsys.readouterr().out
    assert f"cpu: {AMX_XEON.model_name}; native dtypes: float32, bfloat16, float16" in printed
    assert "chosen: dtype bfloat16" in printed and "row-split up to 1 rows" in printed
    assert main(["tune", "--json", "--set", f"model.path={tiny_llama}"]) == 0
    assert json.loads(capsys.readouterr().out)["dtype"] == "bfloat16"
    assert len(calls) == 2 * tuning.TUNING_ROUNDS  # each call measures again, whatever is cached
    assert main(["tune", "--if-missing", "--set", f"model.path={tiny_llama}"]) == 0
    assert len(calls) == 2 * tuning.TUNING_ROUNDS and "(cached)" in capsys.readouterr().out  # make's keeps it
    config = json.loads((tiny_llama / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    kv_width = config["num_key_value_heads"] * head_dim  # 8 query heads, 2 KV heads: GQA shapes
    assert calls[0] == LayerShapes(
        config["hidden_size"],
        (config["hidden_size"], kv_width, kv_width),
        config["intermediate_size"],
        config["num_hidden_layers"],
    )


def test_a_full_cache_disk_at_start_runs_with_an_unsaved_tuning_and_one_warning(
    tiny_llama, tmp_path, monkeypatch, caplog
):
    """Finding (issue 30): a cache folder that could not take the tuning made every start crash."""
    import errno
    import logging
    from pathlib import Path

    import patchbay

    cache = tmp_path / "cache"
    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(cache))
    monkeypatch.delenv("PATCHBAY_MODEL__DTYPE", raising=False)
    monkeypatch.setattr(tuning.CpuInfo, "read", classmethod(lambda cls, cpuinfo=None: AMX_XEON))
    monkeypatch.setattr(
        tuning,
        "measure",
        lambda shapes, dtypes, threads, budget_seconds=1.5, clock=None: _measured(
            float32=[1, 2, 8, 30], bfloat16=[1, 1, 2, 8]
        ),
    )
    write_text = Path.write_text

    def full_disk(path, *args, **kwargs):
        if cache in path.parents:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return write_text(path, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", full_disk)
    with caplog.at_level(logging.WARNING, logger="patchbay"):
        llm = patchbay.LLM(model__path=str(tiny_llama), runtime__threads=2)
        (output,) = llm.generate([[5, 6, 7]], patchbay.SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(output.token_ids) == 3
    assert llm.engine.tuning.dtype == "bfloat16", "the measured tuning is used although it was not saved"
    warnings = [r.getMessage() for r in caplog.records if "could not save the CPU tuning" in r.getMessage()]
    assert len(warnings) == 1 and str(cache / "tuning") in warnings[0] and "No space left" in warnings[0]
    assert not list((cache / "tuning").glob("*")), "no half-written tuning is left behind"
