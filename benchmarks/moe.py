"""Decode throughput of a Mixtral-shaped random MoE checkpoint: patchbay's routed experts against transformers'.

    .venv/bin/python benchmarks/moe.py --batches 1 16 --quantizations none int8 int4 --threads 2

The checkpoint (``--hidden``, ``--experts``, ``--intermediate``, ``--layers``; the defaults make about 1.1 B
parameters, top-2 of 8 experts) is a seeded random ``MixtralForCausalLM`` with the bundled tokenizer, built once in
bfloat16 under patchbay's cache folder.  For each batch size, ``--batches`` requests of ``--prompt`` tokens each
generate ``--tokens`` greedy tokens; the figure is generated tokens per second of the whole run (prefill
included), best of ``--repeats``:

- patchbay, bfloat16, with each ``--quantizations`` (``none``: bfloat16 weights; ``int8``, ``int4``: the experts'
  and every other linear's integer paths, ``model.quantization``);
- transformers' ``generate`` in bfloat16, its experts through its own experts implementation (the config's
  default), the batch padded to one length.

The CPU, the thread count and the load average are printed with the table: on a shared machine the load says how
much the figures mean.  ``--out`` appends them as JSON lines.
"""

from __future__ import annotations

import patchbay  # noqa: F401 - first: it sets the OpenMP wait policy, which torch reads when it starts
import argparse
import os
import random
import time
from pathlib import Path

import torch

from patchbay.bench.report import append_json_lines
from patchbay.toolkit.cpu import CpuInfo
from patchbay.toolkit.model_files import bundled_gguf, convert_gguf
from patchbay.toolkit.paths import cache_dir


def checkpoint(hidden: int, experts: int, intermediate: int, layers: int) -> Path:
    """The Mixtral-shaped random checkpoint, built once (bfloat16) and reused."""
    from transformers import AutoTokenizer, MixtralConfig, MixtralForCausalLM

    directory = cache_dir() / "bench-checkpoints" / f"mixtral-h{hidden}-e{experts}-i{intermediate}-l{layers}-v1"
    if (directory / "config.json").is_file():
        return directory
    tokenizer = AutoTokenizer.from_pretrained(convert_gguf(bundled_gguf()))
    config = MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        num_local_experts=experts,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        architectures=["MixtralForCausalLM"],
    )
    torch.manual_seed(0)
    model = MixtralForCausalLM._from_config(config, dtype=torch.bfloat16)  # built in bfloat16: half the memory
    staging = directory.with_name(directory.name + ".building")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    os.replace(staging, directory)
    return directory


def prompts(batch: int, length: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(100, 40_000) for _ in range(length)] for _ in range(batch)]


def patchbay_rate(model_dir: Path, batch: int, args: argparse.Namespace, quantization: str) -> float:
    from patchbay.sampling_params import SamplingParams

    llm = patchbay.LLM(
        model__path=str(model_dir),
        model__dtype="bfloat16",
        model__quantization=quantization,
        model__max_model_len=args.prompt + args.tokens + 16,
        runtime__threads=args.threads,
        cache__memory="512MiB",
    )
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0.0)
    best = 0.0
    for _ in range(args.repeats):
        start = time.perf_counter()
        llm.generate(prompts(batch, args.prompt), params)
        best = max(best, batch * args.tokens / (time.perf_counter() - start))
    return best


def transformers_rate(model_dir: Path, batch: int, args: argparse.Namespace) -> tuple[float, str]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    ids = torch.tensor(prompts(batch, args.prompt))
    best = 0.0
    with torch.inference_mode():
        for _ in range(args.repeats):
            start = time.perf_counter()
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.tokens,
                min_new_tokens=args.tokens,
                do_sample=False,
                pad_token_id=0,
            )
            best = max(best, batch * args.tokens / (time.perf_counter() - start))
    return best, str(model.config._experts_implementation)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=3584)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--quantizations", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--out", default=None, help="append the figures as JSON lines to this file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = checkpoint(args.hidden, args.experts, args.intermediate, args.layers)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    experts = config.num_hidden_layers * config.num_local_experts * 3 * config.hidden_size * config.intermediate_size
    total = (
        experts
        + 2 * config.vocab_size * config.hidden_size
        + config.num_hidden_layers * 2 * (config.hidden_size**2 + config.hidden_size * config.num_key_value_heads * 64)
    )
    cpu = CpuInfo.read().model_name
    print(f"CPU: {cpu}, {args.threads} threads, load average {os.getloadavg()[0]:.1f}, torch {torch.__version__}")
    print(f"model: {model_dir.name}, {total / 1e9:.2f} B parameters ({experts / 1e9:.2f} B in experts), top-2")
    print("| engine | weights | " + " | ".join(f"batch {b} (tok/s)" for b in args.batches) + " |")
    print("|---|---|" + "---|" * len(args.batches))
    rows = []
    for quantization in args.quantizations:
        rates = [patchbay_rate(model_dir, batch, args, quantization) for batch in args.batches]
        weights = "bfloat16" if quantization == "none" else quantization
        print(f"| patchbay | {weights} | " + " | ".join(f"{rate:.2f}" for rate in rates) + " |")
        rows.append({"engine": "patchbay", "weights": weights, "rates": rates})
    if not args.skip_transformers:
        measured = [transformers_rate(model_dir, batch, args) for batch in args.batches]
        implementation = measured[0][1]
        cells = " | ".join(f"{rate:.2f}" for rate, _ in measured)
        print(f"| transformers (experts: {implementation}) | bfloat16 | {cells} |")
        rows.append({"engine": "transformers", "weights": "bfloat16", "rates": [rate for rate, _ in measured]})
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    if args.out:
        extra = {"cpu": cpu, "threads": args.threads, "batches": args.batches, "model": model_dir.name}
        append_json_lines(Path(args.out), rows, **extra)


if __name__ == "__main__":
    main()
