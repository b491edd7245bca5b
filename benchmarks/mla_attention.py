"""One MLA layer's decode attention: patchbay's latent paths against expanding the latent as transformers does.

    .venv/bin/python benchmarks/mla_attention.py --requests 8 --contexts 512 2048 --threads 2

At a DeepSeek-V2-Lite-shaped layer (16 heads, ``kv_lora_rank`` 512, rotary 64, ``qk_nope_head_dim`` 128,
``v_head_dim`` 128), ``--requests`` requests each decode one token after ``context`` cached ones.  Timed per
layer call, best of ``--repeats``:

- ``expanded``: what transformers does every step: ``kv_b_proj`` expands every cached latent into the heads'
  keys and values, then SDPA (the keys' rotary part broadcast to every head);
- ``latent, reference``: patchbay's ``reference`` backend over the latent cache (float32, per request);
- ``latent, torch_sdpa``: ``torch_sdpa``'s latent path, the C++ decode kernel reading each cached row once for
  all 16 heads.

Also printed: the bytes a token takes in the layer's cache, latent against expanded.  The figures go to stdout
as a Markdown table and, with ``--out``, as JSON lines.
"""

from __future__ import annotations

import patchbay  # noqa: F401 - first: it sets the OpenMP wait policy, which torch reads when it starts
import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from patchbay.bench.report import append_json_lines
from patchbay.interfaces import AttentionLayerSpec, CommonAttentionMetadata
from patchbay.plugins.attention.reference import ReferenceBackend
from patchbay.plugins.attention.torch_sdpa import TorchSDPABackend, TorchSDPAMetadataBuilder
from patchbay.toolkit.cpu import CpuInfo

HEADS, LATENT, ROPE, NOPE, VALUE = 16, 512, 64, 128, 128
BLOCK = 16


def metadata(requests: int, context: int) -> CommonAttentionMetadata:
    """``requests`` decodes, each after ``context`` cached tokens, in consecutive blocks."""
    blocks_each = -(-(context + 1) // BLOCK)
    table = torch.arange(1, 1 + requests * blocks_each, dtype=torch.int32).view(requests, blocks_each)
    seq = torch.full((requests,), context + 1, dtype=torch.int32)
    slots = (table[:, context // BLOCK].long() * BLOCK + context % BLOCK).contiguous()
    starts = torch.arange(requests + 1, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=starts,
        query_start_loc_cpu=starts,
        seq_lens=seq,
        seq_lens_cpu=seq,
        num_computed_tokens_cpu=seq - 1,
        block_table=table,
        slot_mapping=slots,
        num_reqs=requests,
        num_actual_tokens=requests,
        max_query_len=1,
        max_seq_len=context + 1,
        block_size=BLOCK,
    )


def best(call, repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times)


def run(requests: int, context: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    torch.manual_seed(0)
    common = metadata(requests, context)
    num_blocks = 1 + int(common.block_table.max())
    row = LATENT + ROPE
    cache = torch.randn(num_blocks, BLOCK, 1, row, dtype=dtype) * 0.1
    spec = AttentionLayerSpec("layer", HEADS, 1, row, (NOPE + ROPE) ** -0.5, value_size=LATENT)
    query = torch.randn(requests, HEADS, row, dtype=dtype)
    key = torch.randn(requests, 1, row, dtype=dtype)
    timings = {}
    sdpa = TorchSDPABackend(TorchSDPABackend.Options(decode_kernel="paged_cpp"))
    built = TorchSDPAMetadataBuilder(block_size=BLOCK).build(common)
    impl = sdpa.make_impl(spec)
    timings["latent, torch_sdpa"] = best(lambda: impl.forward(query, key, key[..., :LATENT], cache, built), repeats)
    reference = ReferenceBackend().make_impl(spec)
    timings["latent, reference"] = best(
        lambda: reference.forward(query, key, key[..., :LATENT], cache, common), max(1, repeats // 4)
    )
    # transformers' way: expand every cached latent into per-head keys and values, every step.
    kv_b = torch.randn(HEADS * (NOPE + VALUE), LATENT, dtype=dtype) * 0.05
    q_full = torch.randn(requests, HEADS, NOPE + ROPE, dtype=dtype)
    latents = torch.randn(requests, context + 1, row, dtype=dtype)

    def expanded() -> None:
        for r in range(requests):
            latent, k_pe = latents[r, :, :LATENT], latents[r, :, LATENT:]
            kv = F.linear(latent, kv_b).view(-1, HEADS, NOPE + VALUE)
            keys = torch.cat([kv[..., :NOPE], k_pe[:, None].expand(-1, HEADS, ROPE)], dim=-1)
            F.scaled_dot_product_attention(
                q_full[r][:, None], keys.transpose(0, 1), kv[..., NOPE:].transpose(0, 1), scale=spec.scale
            )

    timings["expanded (transformers)"] = best(expanded, repeats)
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None, help="append the figures as JSON lines to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu = CpuInfo.read().model_name
    print(f"CPU: {cpu}, {args.threads} threads, {args.requests} decodes per call, torch {torch.__version__}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        size = torch.tensor([], dtype=dtype).element_size()
        latent_bytes, expanded_bytes = (LATENT + ROPE) * size, HEADS * (NOPE + ROPE + VALUE) * size
        print(f"\n{dtype_name}: KV bytes per token per layer: latent {latent_bytes}, expanded {expanded_bytes}")
        print(
            "| context | " + " | ".join(["expanded (transformers)", "latent, reference", "latent, torch_sdpa"]) + " |"
        )
        print("|---|---|---|---|")
        for context in args.contexts:
            timings = run(args.requests, context, dtype, args.repeats)
            cells = [
                f"{timings[name] * 1e3:.3f} ms"
                for name in ("expanded (transformers)", "latent, reference", "latent, torch_sdpa")
            ]
            print(f"| {context} | " + " | ".join(cells) + " |")
            if args.out:
                append_json_lines(
                    Path(args.out),
                    [
                        {
                            "cpu": CpuInfo.read().model_name,
                            "dtype": dtype_name,
                            "context": context,
                            "requests": args.requests,
                            "threads": args.threads,
                            **{k: v for k, v in timings.items()},
                        }
                    ],
                )


if __name__ == "__main__":
    main()
