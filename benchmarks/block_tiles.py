"""GGUF block tiles' products at Llama-1B's shapes, per type, against bfloat16 tiles on the same shapes.

    .venv/bin/python benchmarks/block_tiles.py --types Q4_0 Q4_K Q8_0 --threads 2

For each shape (2048x2048, 8192x2048, 2048x8192 as [out, in]) and type, the
weight is random valid blocks (random levels, float16 scales around 1e-3)
packed into tiles. One-row products run over enough copies of the weight to
stream it from memory, as a decode step does (every weight once per token):
the script reports the time per product and the weight bytes read per second,
and the same for the bfloat16 tiled product (``TileLayout``) of that shape.
Products of 16, 64 and 256 rows run on one copy, as a prefill chunk does, and
report GFLOP/s (2 * rows * out * in per second). Each figure is the fastest of
repeated rounds after a warm-up (on a shared machine the fastest is the one
least disturbed); on one thread the rounds are timed in the thread's CPU time,
which a busy neighbour's time slices do not inflate. Name the CPU and the
threads when you report them.
"""

from __future__ import annotations

import patchbay  # noqa: F401  first: it sets the OpenMP wait policy, which torch reads when it starts
import argparse
import functools
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from patchbay.toolkit.block_tiles import BLOCK_FORMATS, BlockTiles, block_linear, pack_gguf
from patchbay.toolkit.tiles import TiledWeight, TileLayout

SHAPES = ((2048, 2048), (8192, 2048), (2048, 8192))
STREAMED_BYTES = 512 << 20
"""Bytes of weight copies a one-row product cycles through: well beyond the last-level cache."""


def random_blocks(name: str, out_features: int, in_features: int, seed: int) -> np.ndarray:
    """Random bytes as a GGUF tensor of type ``name``, with float16 scales around 1e-3."""
    format = BLOCK_FORMATS[name]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (out_features, in_features // format.block_inputs, format.block_bytes), np.uint8)
    for at in format.float16_at:
        halves = (rng.random(blocks.shape[:2]) * 2e-3).astype(np.float16)
        blocks[..., at : at + 2] = halves.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(out_features, -1)


def fastest_seconds(products: Sequence[Callable[[], object]], rounds: int, clock: Callable[[], float]) -> float:
    """The fastest round's time per product, each round running every product once, after one warm-up round."""
    for product in products:
        product()
    best = float("inf")
    for _ in range(rounds):
        start = clock()
        for product in products:
            product()
        best = min(best, (clock() - start) / len(products))
    return best


def copies(nbytes: int) -> int:
    return max(1, STREAMED_BYTES // nbytes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=list(BLOCK_FORMATS), choices=list(BLOCK_FORMATS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", nargs="+", type=int, default=[16, 64, 256])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layout = TileLayout(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter  # one thread: the products run on this one
    print(f"{args.threads} threads; one row streamed from memory, many rows from cache")
    header = f"{'shape':>11} {'type':>5} {'MB':>6} {'1 row us':>9} {'GB/s':>6} {'bf16 us':>8} {'bf16 GB/s':>9}"
    print(header + "".join(f" {f'GF/s@{rows}':>9}" for rows in args.rows))
    for out_features, in_features in SHAPES:
        first = layout.pack(torch.randn(out_features, in_features).bfloat16())
        streamed = [
            first,
            *(
                TiledWeight(first.tiles.clone(), *first.shape, first.dtype)
                for _ in range(1, copies(first.tiles.nbytes))
            ),
        ]
        one_bf16 = torch.randn(1, in_features).bfloat16()
        bf16_seconds = fastest_seconds(
            [functools.partial(layout.product, one_bf16, w, None) for w in streamed], args.rounds, clock
        )
        del streamed
        for name in args.types:
            raw = random_blocks(name, out_features, in_features, 0)
            weight = pack_gguf(name, raw, out_features, in_features, threads=args.threads)
            weights = [
                weight,
                *(
                    BlockTiles(weight.tiles.clone(), weight.format, *weight.shape)
                    for _ in range(1, copies(weight.nbytes))
                ),
            ]
            one = torch.randn(1, in_features)
            seconds = fastest_seconds(
                [functools.partial(block_linear, one, w, threads=args.threads) for w in weights], args.rounds, clock
            )
            del weights
            line = (
                f"{out_features:>5}x{in_features:<5} {name:>5} {weight.nbytes / 1e6:6.2f} {seconds * 1e6:9.1f} "
                f"{weight.nbytes / seconds / 1e9:6.1f} {bf16_seconds * 1e6:8.1f} "
                f"{out_features * in_features * 2 / bf16_seconds / 1e9:9.1f}"
            )
            for rows in args.rows:
                many = torch.randn(rows, in_features)
                seconds = fastest_seconds(
                    [functools.partial(block_linear, many, weight, threads=args.threads)], args.rounds, clock
                )
                line += f" {2 * rows * out_features * in_features / seconds / 1e9:9.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
