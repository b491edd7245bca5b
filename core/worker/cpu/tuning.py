"""Defaults measured on the machine at hand: the dtype and the linear-layer paths a CPU runs fastest.

CPUs differ too much for fixed defaults: on one, bfloat16 matrix products are
several times float32 (AVX512-BF16, AMX); on another bfloat16 is emulated and
slow; on one torch runs few-row products on a single core (so cutting weights
into per-thread slices pays), on another its own kernel is faster. So on the
first start on a machine (and by ``patchbay tune``), a few seconds of
micro-benchmarks at the model's real shapes — one decoder layer's linears at
a few row counts, :data:`TUNING_ROUNDS` times over, the fastest kept — decide:

- the dtype, among those this CPU computes natively (float32 always;
  bfloat16 with ``avx512_bf16`` or ``amx_bf16``; float16 with ``avx512_fp16``
  or ``amx_fp16``): the fastest over the row counts, which must beat float32
  by :data:`MIN_GAIN` to be chosen;
- up to how many rows float32 linears run row-split (:mod:`patchbay.worker.cpu.row_split`);
- up to how many rows q/k/v and gate/up run as one product (:mod:`patchbay.worker.cpu.fused_projections`);
- for each native dtype, whether its linears run over weights packed once into oneDNN's layout
  (:mod:`patchbay.worker.cpu.onednn`), fused projections whole, instead of the paths above;
- for each native dtype, whether they run over weights in patchbay's output tiles
  (:mod:`patchbay.toolkit.tiles`) instead, where that beats the best path above (geometric mean over
  the row counts: the tiles win few-row products by streaming weights on every core, oneDNN may win many-row
  products where only its kernels use the CPU's matrix units);
- for bfloat16 tiles, which kernel multiplies them (:data:`patchbay.toolkit.tiles.BFLOAT16_KERNELS`):
  the pair dot product, or float32 FMA on weights widened in registers, whichever is faster over the row counts
  (an Intel Xeon without AMX issues the pair product at half its FMA rate, AMD Zen 4 the other way round), and
  where the FMA kernel wins, up to how many rows the pair product still runs (it streams a row's weights in
  fewer instructions); and where the CPU has AMX, from how many rows its tile product takes over;
- where the CPU has AMX-INT8, from how many rows W8A8 products (``model.weight_format: w8a8`` with
  ``products: tiles``) run through it;
- for each native dtype, up to how many rows a step runs on one thread: OpenMP threads that sleep between
  parallel regions (``OMP_WAIT_POLICY=PASSIVE``, see ``patchbay/__init__.py``) cost a wake-up per product,
  more than a second core gains on a product bound by memory bandwidth.  Tiled products keep their own
  helper threads, which spin briefly between products instead of sleeping, so for a dtype whose linears run
  tiled the limit is :data:`STREAMED_MAX_ROWS` by rule: only the small ops around the products go to one thread.

The result is cached per CPU model, CPU flags, torch version, thread count
and model shape in patchbay's cache directory, unless it was measured under
noise (:mod:`patchbay.worker.cpu.tuning_noise`: a reference kernel timed beside
every case, the time the threads waited for a core, rounds that disagree):
such a tuning is *provisional*, used by this process only and measured again
at the next start. The choice (:func:`choose`) is a pure function of the CPU's
flags and the measured times, so it can be checked for any CPU. Attention
paths are not tuned here.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from patchbay.toolkit.cpu import CpuInfo
from patchbay.worker.cpu.row_split import DEFAULT_MAX_ROWS, row_split_linear, use_row_split_linears
from patchbay.worker.cpu.fused_projections import FUSE_MAX_ROWS, fuse_shared_input_projections
from patchbay.worker.cpu.quantization import W8A8TileLayout, use_w8a8_amx_from, w8a8_amx_available
from patchbay.worker.cpu.tuning_noise import (
    RECHECK_SAMPLES,
    ROUNDS_AGREE,
    Clock,
    NoiseCheck,
    WallClock,
    assess,
    measured_under_load,
)
from patchbay.worker.cpu.onednn import (
    ONEDNN,
    OneDnnLayout,
    pack,
    packed_linear,
    packing_supported,
    use_packed_linears,
)
from patchbay.toolkit.tiles import (
    BFLOAT16_KERNELS,
    TileLayout,
    TiledWeight,
    bfloat16_amx_available,
    tiles_unavailable,
    use_bfloat16_amx_from,
    use_bfloat16_kernel,
    use_bfloat16_pairs_up_to,
)

logger = logging.getLogger(__name__)

ROW_BUCKETS = (1, 8, 64, 256)
"""Rows per product measured: a decode of one request, of a few, of a batch, and a prefill chunk."""
MIN_GAIN = 1.1
"""A lower-precision dtype is chosen only when it is this much faster than float32 (geometric mean over buckets)."""
PATH_GAIN = 1.05
"""A linear path replaces torch's own product up to the largest bucket where it is this much faster."""
TUNING_ROUNDS = 2
"""Every path is measured this many times over, a whole measurement apart, and its fastest time kept: on a
shared machine a neighbour's burst that slowed one path's turn alone decided the choice, and stayed cached (a
2-core Xeon kept oneDNN for bfloat16 instead of its AMX tiles and ran at half speed until the cache was cleared)."""
MAX_TUNING_ROUNDS = 4
"""Rounds that disagree by more than :data:`ROUNDS_AGREE` are followed by another, up to this many; the last two
still disagreeing make the tuning provisional."""
TUNING_FORMAT = 11
"""Bumped whenever what is measured or chosen changes, so cached results from older rules are measured again."""


@dataclass(frozen=True)
class LayerShapes:
    """The linears of one decoder layer: hidden size, q/k/v output sizes, MLP intermediate size; and how many
    such layers the model has."""

    hidden: int
    qkv: tuple[int, int, int]
    intermediate: int
    layers: int | None = None
    """Decoder layers in the model (``None``: not known). A decode step reads every layer's weights once, so
    :func:`measure` streams no more copies of a layer than the model has: a model small enough to stay in the
    cache is timed in the cache, and timing it costs seconds, not minutes of thousands of tiny products."""

    @classmethod
    def of(cls, config: Any) -> LayerShapes:
        """From a transformers config (``hidden_size``, heads, ``head_dim``, ``intermediate_size``)."""
        hidden = int(config.hidden_size)
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        intermediate = int(getattr(config, "intermediate_size", None) or 4 * hidden)
        layers = getattr(config, "num_hidden_layers", None)
        return cls(
            hidden,
            (heads * head_dim, kv_heads * head_dim, kv_heads * head_dim),
            intermediate,
            int(layers) if layers else None,
        )

    def products(self) -> list[tuple[int, int]]:
        """``(in_features, out_features)`` of each linear, projections of one input listed one by one."""
        q, k, v = self.qkv
        return [
            (self.hidden, q),
            (self.hidden, k),
            (self.hidden, v),
            (q, self.hidden),
            (self.hidden, self.intermediate),
            (self.hidden, self.intermediate),
            (self.intermediate, self.hidden),
        ]


@dataclass
class Measurements:
    """Seconds for one decoder layer's linears, per path and rows."""

    by_dtype: dict[str, dict[int, float]] = field(default_factory=dict)
    """torch's own products, per dtype."""
    row_split: dict[int, float] = field(default_factory=dict)
    """float32, every linear row-split over the threads."""
    fused: dict[int, float] = field(default_factory=dict)
    """float32, q/k/v and gate/up each as one product."""
    packed: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per dtype torch can pack: weights packed for oneDNN, q/k/v and gate/up each as one product."""
    single_thread: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per dtype, its packed path (torch's own where it cannot pack) on one thread, at few rows."""
    tiled: dict[str, dict[int, float]] = field(default_factory=dict)
    """Per dtype the tiled kernels run here: weights in output tiles, q/k/v and gate/up each as one product."""
    bfloat16_kernels: dict[str, dict[int, float]] = field(default_factory=dict)
    """Where bfloat16 tiles run: the tiled path once per bfloat16 kernel (``tiled`` has none for bfloat16)."""
    bfloat16_amx: dict[int, float] = field(default_factory=dict)
    """Where bfloat16 tiles can run through AMX: the tiled path with every product on AMX."""
    w8a8: dict[int, float] = field(default_factory=dict)
    """Where W8A8 tiles can run through AMX: W8A8 tiles on VNNI (bfloat16 activations)..."""
    w8a8_amx: dict[int, float] = field(default_factory=dict)
    """... and the same with every product on AMX."""


@dataclass
class Tuning:
    """What the measurements chose, and why (the figures behind the choice)."""

    dtype: str
    row_split_max_rows: int
    """float32 linears run row-split up to this many rows; 0: never."""
    fuse_max_rows: int
    """q/k/v and gate/up run as one product up to this many rows; 0: never."""
    packed_dtypes: list[str]
    """Dtypes whose linears run packed for oneDNN (every step, projections fused), replacing the two paths above."""
    tiled_dtypes: list[str]
    """Dtypes whose linears run over weights in output tiles (projections fused), replacing every path above."""
    single_thread_max_tokens: dict[str, int]
    """Per dtype, steps of up to this many tokens run on one thread; 0: never."""
    speedup: dict[str, float]
    """Each native dtype's geometric-mean speed over float32, each on its fastest path."""
    cpu: str
    native_dtypes: list[str]
    threads: int
    torch_version: str
    measurements: dict[str, dict[str, float]]
    """Seconds per layer, by path (``float32``, ``bfloat16``, ``row_split``, ``fused``, ``packed_<dtype>``) and rows."""
    bfloat16_kernel: str = "pairs"
    """The kernel bfloat16 tiles run (:data:`patchbay.toolkit.tiles.BFLOAT16_KERNELS`)."""
    bfloat16_pairs_max_rows: int = 0
    """Under the ``fma`` kernel, products of up to this many rows run ``pairs`` all the same; 0: none."""
    bfloat16_amx_from_rows: int = 0
    """bfloat16 tile products of at least this many rows run through AMX's tile product; 0: never."""
    w8a8_amx_from_rows: int = 0
    """W8A8 products of at least this many rows run through AMX's byte product; 0: never."""
    noise: NoiseCheck | None = None
    """What the noise check said while this was measured (``None``: not checked, a fake's measurements)."""
    cached: bool = False

    @property
    def provisional(self) -> bool:
        """Measured under noise: this process uses it, nothing caches it, the next start measures again."""
        return self.noise is not None and self.noise.provisional

    @classmethod
    def from_json(cls, text: str) -> Tuning:
        """A cached tuning (as :func:`tune` saves it), marked ``cached``."""
        fields = json.loads(text)
        return cls(**{**fields, "noise": NoiseCheck.from_dict(fields.get("noise")), "cached": True})

    def describe(self) -> str:
        """One line for the run summary and the bench."""
        speedups = ", ".join(f"{dtype} {gain:.2f}x" for dtype, gain in self.speedup.items() if dtype != "float32")
        packed = ", ".join(dtype for dtype in self.packed_dtypes if dtype not in self.tiled_dtypes) or "none"
        tiled = (
            ", ".join(
                f"{dtype} ({self._bfloat16_kernels()})" if dtype == "bfloat16" else dtype for dtype in self.tiled_dtypes
            )
            or "none"
        )
        return (
            f"dtype {self.dtype} ({speedups or 'float32 only'} vs float32), "
            f"tiled linears for {tiled}, oneDNN-packed linears for {packed}, otherwise "
            f"row-split up to {self.row_split_max_rows} rows, fused projections up to {self.fuse_max_rows} rows"
            f"{f'; W8A8 through AMX from {self.w8a8_amx_from_rows} rows' if self.w8a8_amx_from_rows else ''}; "
            f"one thread for steps up to {self.single_thread_max_tokens.get(self.dtype, 0)} tokens; "
            f"{self.cpu}, {self.threads} threads, torch {self.torch_version}"
            f"{' (cached)' if self.cached else ''}"
            f"{self._provisional_note()}"
        )

    def _provisional_note(self) -> str:
        if self.noise is None or not self.noise.provisional:
            return ""
        return (
            f"; PROVISIONAL, measured on a busy machine ({'; '.join(self.noise.reasons)}): "
            "used by this run only, measured again at the next start"
        )

    def _bfloat16_kernels(self) -> str:
        kernels = self.bfloat16_kernel
        if self.bfloat16_kernel == "fma" and self.bfloat16_pairs_max_rows:
            rows = self.bfloat16_pairs_max_rows
            kernels += f", pairs up to {rows} row{'s' if rows > 1 else ''}"
        if self.bfloat16_amx_from_rows:
            rows = self.bfloat16_amx_from_rows
            kernels += f", AMX from {rows} row{'s' if rows > 1 else ''}"
        return kernels


def choose(cpu: CpuInfo, measured: Measurements, threads: int) -> Tuning:
    """The dtype and linear paths for ``cpu`` given ``measured`` times (no measuring: a pure decision)."""
    natives = cpu.native_dtypes()
    baseline = measured.by_dtype["float32"]
    row_split_rows = _wins_up_to(measured.row_split, baseline) if threads > 1 else 0
    fuse_rows = _wins_up_to(measured.fused, baseline)
    unpacked = {dtype: dict(times) for dtype, times in measured.by_dtype.items() if dtype in natives}
    for rows in unpacked["float32"]:  # float32 also has the row-split and fused paths, within their limits
        for path, limit in ((measured.row_split, row_split_rows), (measured.fused, fuse_rows)):
            if rows <= limit:
                unpacked["float32"][rows] = min(unpacked["float32"][rows], path[rows])
    packed_dtypes = [
        dtype
        for dtype, times in unpacked.items()
        if dtype in measured.packed
        and _geometric_mean([times[rows] / measured.packed[dtype][rows] for rows in times]) >= PATH_GAIN
    ]
    fastest = {dtype: measured.packed[dtype] if dtype in packed_dtypes else times for dtype, times in unpacked.items()}
    kernels = measured.bfloat16_kernels
    bfloat16_kernel = min(
        kernels, key=lambda kernel: _geometric_mean(list(kernels[kernel].values())), default=BFLOAT16_KERNELS[0]
    )
    fma_chosen = bfloat16_kernel == "fma" and "pairs" in kernels
    pairs_rows = _wins_up_to(kernels["pairs"], kernels["fma"]) if fma_chosen else 0
    tiled = dict(measured.tiled)
    if kernels:  # the chosen kernel's times, the pair product's where it runs all the same
        chosen = kernels[bfloat16_kernel]
        tiled["bfloat16"] = {rows: kernels["pairs"][rows] if rows <= pairs_rows else chosen[rows] for rows in chosen}
    amx_rows = _wins_from(measured.bfloat16_amx, tiled["bfloat16"]) if "bfloat16" in tiled else 0
    if amx_rows:
        pairs_rows = min(pairs_rows, amx_rows - 1)  # AMX takes its rows whatever the kernel
        tiled["bfloat16"] = {
            rows: measured.bfloat16_amx[rows] if rows >= amx_rows else seconds
            for rows, seconds in tiled["bfloat16"].items()
        }
    tiled_dtypes = [
        dtype
        for dtype, times in fastest.items()
        if dtype in tiled and _geometric_mean([times[rows] / tiled[dtype][rows] for rows in times]) >= PATH_GAIN
    ]
    fastest.update({dtype: tiled[dtype] for dtype in tiled_dtypes})
    speedup = {
        dtype: _geometric_mean([fastest["float32"][rows] / times[rows] for rows in times])
        for dtype, times in fastest.items()
    }
    best = max(speedup, key=lambda dtype: speedup[dtype])
    dtype = best if speedup[best] >= MIN_GAIN else "float32"
    single_thread = (
        {
            name: STREAMED_MAX_ROWS
            if name in tiled_dtypes
            else _wins_up_to(
                measured.single_thread.get(name, {}),
                measured.packed[name] if name in packed_dtypes else measured.by_dtype[name],
            )
            for name in fastest
        }
        if threads > 1
        else {name: 0 for name in fastest}
    )
    return Tuning(
        dtype=dtype,
        row_split_max_rows=row_split_rows,
        fuse_max_rows=fuse_rows,
        packed_dtypes=packed_dtypes,
        tiled_dtypes=tiled_dtypes,
        single_thread_max_tokens=single_thread,
        speedup={name: round(gain, 3) for name, gain in speedup.items()},
        cpu=cpu.model_name,
        native_dtypes=list(natives),
        threads=threads,
        torch_version=torch.__version__,
        bfloat16_kernel=bfloat16_kernel,
        bfloat16_pairs_max_rows=pairs_rows,
        bfloat16_amx_from_rows=amx_rows,
        w8a8_amx_from_rows=_wins_from(measured.w8a8_amx, measured.w8a8),
        measurements={
            path: {str(rows): seconds for rows, seconds in times.items()}
            for path, times in [
                *measured.by_dtype.items(),
                ("row_split", measured.row_split),
                ("fused", measured.fused),
                *((f"packed_{dtype}", times) for dtype, times in measured.packed.items()),
                *((f"tiled_{dtype}", times) for dtype, times in measured.tiled.items()),
                *((f"tiled_bfloat16_{kernel}", times) for kernel, times in kernels.items()),
                *([("tiled_bfloat16_amx", measured.bfloat16_amx)] if measured.bfloat16_amx else []),
                *([("w8a8", measured.w8a8), ("w8a8_amx", measured.w8a8_amx)] if measured.w8a8_amx else []),
                *((f"one_thread_{dtype}", times) for dtype, times in measured.single_thread.items()),
            ]
        },
    )


def _geometric_mean(values: list[float]) -> float:
    return math.exp(sum(math.log(value) for value in values) / len(values))


def _wins_up_to(path: dict[int, float], baseline: dict[int, float]) -> int:
    """The largest bucket up to which ``path`` beats ``baseline`` by :data:`PATH_GAIN` at every bucket; 0: none."""
    limit = 0
    for rows in sorted(baseline):
        if rows not in path or baseline[rows] < path[rows] * PATH_GAIN:
            break
        limit = rows
    return limit


def _wins_from(path: dict[int, float], baseline: dict[int, float]) -> int:
    """The row count from which ``path`` beats ``baseline`` by :data:`PATH_GAIN` at every measured bucket too;
    0: none (or ``path`` unmeasured).

    Above :data:`STREAMED_MAX_ROWS` rows a product is bound by arithmetic and its time grows in step with its
    rows, so between the last bucket there where ``path`` loses and the first from which it wins, both times
    are read as straight lines and the row count where they cross by :data:`PATH_GAIN` is returned: a path that
    wins from 16 rows would otherwise wait for the 64-row bucket, and a decode batch of 32 would miss it.
    Fewer rows stream their weights in about the same time whatever their count: no line to draw there.
    """
    start = 0
    for rows in sorted(baseline, reverse=True):
        if rows not in path or baseline[rows] < path[rows] * PATH_GAIN:
            break
        start = rows
    losing = [rows for rows in baseline if rows < start]
    if not losing or max(losing) < STREAMED_MAX_ROWS:
        return start
    below = max(losing)
    deficit = PATH_GAIN * path[below] - baseline[below] if below in path else math.inf
    surplus = baseline[start] - PATH_GAIN * path[start]
    if math.isinf(deficit) or deficit + surplus <= 0:
        return start
    return min(start, math.ceil(below + (start - below) * deficit / (deficit + surplus)))


def measure(
    shapes: LayerShapes,
    dtypes: tuple[str, ...],
    threads: int,
    budget_seconds: float = 1.5,
    clock: Clock | None = None,
) -> Measurements:
    """Time one decoder layer's linears with each path at each of :data:`ROW_BUCKETS` rows (random weights), each
    case beside a run of ``clock``'s reference kernel (default: a :class:`WallClock` on ``threads``).

    Few-row products stream their weights from memory in a real model (every layer's weights are read once
    per step), so up to :data:`STREAMED_MAX_ROWS` rows the layer is timed as one of enough copies to overflow
    the CPU's last-level cache (no more copies than the model has layers); one layer whose weights stay cached
    would flatter whichever path reads them most often.
    """
    clock = clock if clock is not None else WallClock(threads)
    packable = [dtype for dtype in dtypes if packing_supported(getattr(torch, dtype))]
    tileable = [dtype for dtype in dtypes if tiles_unavailable(getattr(torch, dtype)) is None]
    streamed_buckets = sum(1 for rows in ROW_BUCKETS if rows <= STREAMED_MAX_ROWS)
    amx = "bfloat16" in tileable and bfloat16_amx_available()
    w8a8_amx = w8a8_amx_available()
    tiled_cases = len(tileable) + (len(BFLOAT16_KERNELS) - 1 + amx) * ("bfloat16" in tileable) + 2 * w8a8_amx
    per_case = budget_seconds / (
        len(ROW_BUCKETS) * (len(dtypes) + len(packable) + tiled_cases + 2) + streamed_buckets * len(dtypes)
    )
    measured = Measurements()

    def per_layer(
        path: str,
        product,  # noqa: ANN001 - a product
        layers: list[list[Any]],
        max_rows: int = ROW_BUCKETS[-1],
    ) -> dict[int, float]:
        timed = {}
        for rows in (bucket for bucket in ROW_BUCKETS if bucket <= max_rows):
            used = layers if rows <= STREAMED_MAX_ROWS else layers[:1]
            timed[rows] = _time(
                clock,
                f"{path}/{rows}",
                lambda x, used=used: [product(x[w.shape[1]], w) for layer in used for w in layer],
                rows,
                used[0],
                per_case,
            ) / len(used)
        return timed

    for dtype in dtypes:
        layers = _layers(shapes, getattr(torch, dtype))
        measured.by_dtype[dtype] = per_layer(dtype, F.linear, layers)
        product: Callable[..., torch.Tensor] = F.linear
        weights: list[list[Any]] = layers  # plain, packed or tiled weights, as product takes them
        if dtype in packable:
            product = lambda x, p: packed_linear(x, p, None)  # noqa: E731
            weights = [[pack(weight) for weight in _fused(layer)] for layer in layers]
            measured.packed[dtype] = per_layer(f"packed_{dtype}", product, weights)
        if threads > 1:
            previous = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                measured.single_thread[dtype] = per_layer(
                    f"one_thread_{dtype}", product, weights, max_rows=STREAMED_MAX_ROWS
                )
            finally:
                torch.set_num_threads(previous)
        if dtype in tileable:
            tiles = TileLayout(threads)
            weights = [[tiles.pack(weight) for weight in _fused(layer)] for layer in layers]
            tiled_product = functools.partial(_tiled_product, tiles)
            if dtype == "bfloat16":
                previous_amx = use_bfloat16_amx_from(0)
                try:

                    def timed_kernel(
                        kernel: str, product: Any = tiled_product, weights: Any = weights
                    ) -> dict[int, float]:
                        return per_layer(f"tiled_bfloat16_{kernel}", product, weights)

                    measured.bfloat16_kernels = _per_bfloat16_kernel(timed_kernel)
                    if amx:
                        use_bfloat16_amx_from(1)
                        measured.bfloat16_amx = per_layer("tiled_bfloat16_amx", tiled_product, weights)
                finally:
                    use_bfloat16_amx_from(previous_amx)
            else:
                measured.tiled[dtype] = per_layer(f"tiled_{dtype}", tiled_product, weights)
    if w8a8_amx:
        tiles = W8A8TileLayout(threads)
        weights = [[tiles.pack(weight) for weight in _fused(layer)] for layer in _layers(shapes, torch.bfloat16)]
        previous_amx = use_w8a8_amx_from(0)
        try:
            measured.w8a8 = per_layer("w8a8", functools.partial(_tiled_product, tiles), weights)
            use_w8a8_amx_from(1)
            measured.w8a8_amx = per_layer("w8a8_amx", functools.partial(_tiled_product, tiles), weights)
        finally:
            use_w8a8_amx_from(previous_amx)
    layers = _layers(shapes, torch.float32)
    measured.row_split = per_layer(
        "row_split", lambda x, w: row_split_linear(x, w, None, threads, max_rows=1 << 30), layers
    )
    measured.fused = per_layer("fused", F.linear, [_fused(layer) for layer in layers])
    return measured


@dataclass
class Rounds:
    """Rounds of :func:`measure`, combined: each path's fastest time at each bucket over all of them."""

    measurements: Measurements
    count: int
    spread: float
    """How far the last two rounds are apart (:func:`_disagreement`); over :data:`ROUNDS_AGREE`: they never
    agreed."""


def measure_in_rounds(
    shapes: LayerShapes,
    dtypes: tuple[str, ...],
    threads: int,
    budget_seconds: float = 1.5,
    clock: Clock | None = None,
) -> Rounds:
    """:func:`measure` :data:`TUNING_ROUNDS` times, and again while the last two rounds disagree (up to
    :data:`MAX_TUNING_ROUNDS`), every round on the same ``clock``; each path's fastest time at each bucket over
    all rounds."""
    clock = clock if clock is not None else WallClock(threads)
    rounds = [measure(shapes, dtypes, threads, budget_seconds, clock) for _ in range(TUNING_ROUNDS)]
    while (spread := _disagreement(rounds[-2], rounds[-1])) > ROUNDS_AGREE and len(rounds) < MAX_TUNING_ROUNDS:
        logger.info(
            "tuning rounds %d and %d differ by %.2fx (a busy machine?): measuring again",
            len(rounds) - 1,
            len(rounds),
            spread,
        )
        rounds.append(measure(shapes, dtypes, threads, budget_seconds, clock))
    combined = Measurements(**{name: _fastest([getattr(r, name) for r in rounds]) for name in _MEASURED_PATHS})
    return Rounds(combined, len(rounds), spread)


_MEASURED_PATHS = tuple(Measurements.__dataclass_fields__)


def _fastest(times: list[Any]) -> Any:  # noqa: ANN401 - nested dicts of seconds, as Measurements' fields
    """Per key of the first of ``times`` (dicts of seconds, or of such dicts), the smallest time any has."""
    if not isinstance(times[0], dict):
        return min(times)
    return {key: _fastest([t[key] for t in times if key in t]) for key in times[0]}


def _seconds(times: Any) -> list[tuple[str, float]]:  # noqa: ANN401 - as _fastest's
    """Every time in ``times`` (a Measurements field), under a key naming its path and bucket."""
    if not isinstance(times, dict):
        return [("", times)]
    return [(f"{key}/{name}", seconds) for key, value in times.items() for name, seconds in _seconds(value)]


def _disagreement(first: Measurements, second: Measurements) -> float:
    """How far two rounds' times are apart: the geometric mean, over every time both measured, of the larger
    over the smaller."""
    ratios = []
    for name in _MEASURED_PATHS:
        theirs = dict(_seconds(getattr(second, name)))
        for key, seconds in _seconds(getattr(first, name)):
            if key in theirs and min(seconds, theirs[key]) > 0:
                ratios.append(max(seconds, theirs[key]) / min(seconds, theirs[key]))
    return _geometric_mean(ratios) if ratios else 1.0


def _tiled_product(tiles: TileLayout, x: torch.Tensor, weight: TiledWeight) -> torch.Tensor:
    return tiles.product(x, weight, None)


def _per_bfloat16_kernel(timed: Callable[[str], dict[int, float]]) -> dict[str, dict[int, float]]:
    """``timed(kernel)`` with each bfloat16 tile kernel running; the kernel that ran before runs again afterwards."""
    previous = use_bfloat16_kernel(BFLOAT16_KERNELS[0])
    try:
        return {kernel: (use_bfloat16_kernel(kernel), timed(kernel))[1] for kernel in BFLOAT16_KERNELS}
    finally:
        use_bfloat16_kernel(previous)


STREAMED_MAX_ROWS = 8
"""Up to this many rows a product is bound by reading its weights from memory (the decode regime)."""


def _fused(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """A layer's weights (as :meth:`LayerShapes.products` lists them) with q/k/v and gate/up concatenated."""
    return [torch.cat(weights[0:3]), weights[3], torch.cat(weights[4:6]), weights[6]]


def _layers(shapes: LayerShapes, dtype: torch.dtype) -> list[list[torch.Tensor]]:
    """Copies of one layer's random weights, together at least twice the last-level cache (64 MiB at least),
    or as many as the model has layers where that is fewer."""
    generator = torch.Generator().manual_seed(0)
    layer = [
        torch.randn(out_features, in_features, generator=generator).to(dtype) * in_features**-0.5
        for in_features, out_features in shapes.products()
    ]
    layer_bytes = sum(weight.numel() * weight.element_size() for weight in layer)
    copies = max(1, math.ceil(max(64 << 20, 2 * _last_level_cache_bytes()) / layer_bytes))
    copies = min(copies, shapes.layers or copies)
    return [layer] + [[weight.clone() for weight in layer] for _ in range(copies - 1)]


def _last_level_cache_bytes() -> int:
    """The largest CPU cache Linux reports for CPU 0 (0 where it reports none)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
        except OSError:
            continue
        multiplier = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * multiplier)
    return max(sizes, default=0)


def _time(
    clock: Clock,
    case: str,
    run,  # noqa: ANN001 - a closure
    rows: int,
    weights: list[Any],
    budget: float,
) -> float:
    """``clock``'s seconds for ``run(inputs)``, inputs of ``rows`` rows for each input width, right after a run of
    its reference kernel (the noise check's witness of the load at that moment)."""
    dtype = weights[0].dtype
    inputs = {width: torch.randn(rows, width).to(dtype) for width in {w.shape[1] for w in weights}}
    clock.reference()
    return clock.time(case, lambda: run(inputs), budget)


def apply_linear_paths(
    model: nn.Module,
    *,
    linear_kernel: str,
    fuse_projections: bool,
    dtype: str,
    device: torch.device,
    tuning: Tuning | None,
) -> LinearPaths:
    """Give ``model``'s linears the paths chosen (explicitly, or by ``tuning``); say how many took each.

    ``linear_kernel``: ``onednn`` (weights packed, every step), ``row_split`` (always, up to the default row
    limit), ``torch`` (torch's own products) or ``auto`` (as tuned: packed where the tuning measured packing
    faster for ``dtype``, else row-split up to the tuned limit; torch's own without a tuning).  Fused projections
    take their row limit from the tuning too, and run every step when packed.
    """
    cpu = device.type == "cpu"
    tuned = tuning if linear_kernel == "auto" else None
    layout: TileLayout | OneDnnLayout | None = None
    if cpu and (linear_kernel == "tiles" or (tuned is not None and dtype in tuned.tiled_dtypes)):
        layout = TileLayout(torch.get_num_threads())
        if dtype == "bfloat16":
            use_bfloat16_kernel(tuning.bfloat16_kernel if tuning is not None else BFLOAT16_KERNELS[0])
            use_bfloat16_pairs_up_to(tuning.bfloat16_pairs_max_rows if tuning is not None else 0)
            use_bfloat16_amx_from(tuning.bfloat16_amx_from_rows if tuning is not None else 0)
    elif cpu and (linear_kernel == "onednn" or (tuned is not None and dtype in tuned.packed_dtypes)):
        layout = ONEDNN
    if layout is not None:
        fused = fuse_shared_input_projections(model, max_rows=1 << 62) if fuse_projections else 0
        return LinearPaths(fused_groups=fused, packed=use_packed_linears(model, layout), layout=layout.name)
    cpu_float32 = cpu and dtype == "float32"
    if linear_kernel == "row_split":
        max_rows = DEFAULT_MAX_ROWS
    elif linear_kernel == "auto" and cpu_float32 and tuning is not None:
        max_rows = tuning.row_split_max_rows
    else:
        max_rows = 0
    slices = torch.get_num_threads() if cpu_float32 and max_rows else 1
    fused = 0
    if fuse_projections:
        fuse_rows = tuning.fuse_max_rows if tuning is not None else FUSE_MAX_ROWS
        product = functools.partial(row_split_linear, slices=slices, max_rows=max_rows) if slices > 1 else F.linear
        fused = fuse_shared_input_projections(model, product, max_rows=fuse_rows) if fuse_rows else 0
    return LinearPaths(
        fused_groups=fused, row_split=use_row_split_linears(model, slices, max_rows) if slices > 1 else 0
    )


@dataclass(frozen=True)
class LinearPaths:
    """How many of a model's linears (or projection groups) each path took."""

    fused_groups: int = 0
    row_split: int = 0
    packed: int = 0
    layout: str = "oneDNN blocks"
    """The layout the packed linears run over (:class:`patchbay.worker.cpu.onednn.WeightLayout`)."""


def cache_key(cpu: CpuInfo, shapes: LayerShapes, threads: int) -> str:
    """What a cached result depends on: CPU model and flags, torch version, threads, layer shapes, the rules."""
    text = json.dumps([TUNING_FORMAT, cpu.model_name, sorted(cpu.flags), torch.__version__, threads, asdict(shapes)])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def tuning_path(key: str) -> Path:
    """Where the result for ``key`` is cached."""
    from patchbay.toolkit.paths import cache_dir

    return cache_dir() / "tuning" / f"{key}.json"


def reference_record_path(cpu: CpuInfo, threads: int) -> Path:
    """Where the fastest time of the noise check's reference kernel on this machine is kept (whatever the model)."""
    from patchbay.toolkit.paths import cache_dir
    from patchbay.worker.cpu.tuning_noise import REFERENCE_SHAPE

    text = json.dumps([cpu.model_name, sorted(cpu.flags), torch.__version__, threads, REFERENCE_SHAPE])
    return cache_dir() / "tuning" / f"reference-{hashlib.sha256(text.encode()).hexdigest()[:20]}.json"


_PROVISIONAL: dict[Path, Tuning] = {}
"""Provisional tunings this process measured, by the path their cached form would have: later engines of the same
process (this run) use them instead of measuring again; nothing else sees them."""


def tune(
    shapes: LayerShapes,
    *,
    threads: int | None = None,
    cpu: CpuInfo | None = None,
    fresh: bool = False,
    budget_seconds: float = 1.5,
) -> Tuning:
    """The tuning for this machine and these shapes: cached, or measured now when absent, ``fresh``, or cached from
    a machine clearly slower than this one is now (measured under load the noise check missed).

    A tuning measured under noise is provisional (:mod:`patchbay.worker.cpu.tuning_noise`): returned, kept for
    this process, never cached, so the next start measures again; a quiet one is cached and replaces a
    provisional one this process kept."""
    cpu = cpu or CpuInfo.read()
    threads = threads or torch.get_num_threads()
    path = tuning_path(cache_key(cpu, shapes, threads))
    clock = WallClock(threads)
    if not fresh:
        if path in _PROVISIONAL:
            return _PROVISIONAL[path]
        cached = _read_cached(path)
        if cached is not None:
            then = cached.noise.reference_seconds if cached.noise is not None else None
            if not measured_under_load(then, now := clock.fastest_reference(RECHECK_SAMPLES)):
                return cached
            logger.info(
                "the cached CPU tuning was measured while the machine ran %.2fx slower than now (a neighbour the "
                "noise check missed): measuring again",
                (then or 0) / now,
            )
    started = time.perf_counter()
    record_path = reference_record_path(cpu, threads)
    record = _read_record(record_path)
    rounds = measure_in_rounds(shapes, cpu.native_dtypes(), threads, budget_seconds, clock)
    result = choose(cpu, rounds.measurements, threads)
    result.noise = assess(rounds.count, rounds.spread, clock.reference_times(), clock.cpu_wait(), record)
    if result.noise.reference_seconds is not None and (record is None or result.noise.reference_seconds < record):
        try:
            _write_json(record_path, {"seconds": result.noise.reference_seconds})
        except OSError as exc:  # the tuning's own save says so, once, where it matters
            logger.debug("could not keep the reference kernel's time in %s: %s", record_path, exc)
    seconds = time.perf_counter() - started
    if result.provisional:
        logger.warning("tuned for this machine in %.1f s, not cached: %s", seconds, result.describe())
        _PROVISIONAL[path] = result
        return result
    logger.info("tuned for this machine in %.1f s: %s", seconds, result.describe())
    _PROVISIONAL.pop(path, None)
    _save(result, path)
    return result


def _read_cached(path: Path) -> Tuning | None:
    """The tuning cached at ``path``; ``None`` where absent or unreadable (it is measured again)."""
    try:
        return Tuning.from_json(path.read_text())
    except (OSError, ValueError, TypeError):
        return None


def _read_record(path: Path) -> float | None:
    """The fastest reference time kept at ``path``; ``None`` where there is none (or it is unreadable)."""
    try:
        seconds = json.loads(path.read_text())["seconds"]
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return float(seconds) if isinstance(seconds, int | float) and seconds > 0 else None


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path`` whole (a staging file renamed into place); an ``OSError`` reaches the caller and
    leaves no staging file behind."""
    staging = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging.write_text(json.dumps(data, indent=1))
        staging.replace(path)
    except OSError:
        try:
            staging.unlink(missing_ok=True)
        except OSError:
            pass
        raise


def _save(result: Tuning, path: Path) -> None:
    """Cache ``result`` at ``path``; a cache folder that cannot take it (full disk, read-only) is warned about
    once, naming the folder: the run goes on with the tuning it measured, and the next start measures again."""
    try:
        _write_json(path, {k: v for k, v in asdict(result).items() if k != "cached"})
    except OSError as exc:
        logger.warning(
            "could not save the CPU tuning in %s (%s); this run uses it unsaved, the next start measures again "
            "(free space there or point PATCHBAY_CACHE_DIR elsewhere)",
            path.parent,
            exc.strerror or exc,
        )
