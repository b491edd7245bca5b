"""Offline throughput: patchbay against transformers `generate`, same model, prompts and lengths, one run.

    .venv/bin/python benchmarks/offline_throughput.py --num-requests 32 --batch-size 8

Every request has a fixed prompt length (drawn from --prompt-range) and a
fixed output length (drawn from --output-range, generated with ignore_eos /
min_new_tokens so both engines produce exactly those tokens).  transformers
runs static batches of --batch-size with left padding; a batch runs until its
longest request is done, and only the requested tokens count.  patchbay gets
every request at once and batches continuously.  Timings drift on a shared
machine; the ratio from one run is the figure to quote.
"""

from __future__ import annotations

import patchbay  # first: it sets the OpenMP wait policy, which torch reads when it starts
import argparse
import json
import random
import time
from pathlib import Path

import torch


def make_workload(tokenizer, num_requests: int, prompt_range: tuple[int, int], output_range: tuple[int, int],
                  seed: int) -> list[tuple[list[int], int]]:

    corpus_text = "\n".join(p.read_text() for p in sorted(Path(patchbay.__file__).parent.rglob("*.py")))
    corpus = tokenizer.encode(corpus_text)
    rng = random.Random(seed)
    workload = []
    for _ in range(num_requests):
        length = rng.randint(*prompt_range)
        start = rng.randrange(0, len(corpus) - length)
        workload.append((corpus[start : start + length], rng.randint(*output_range)))
    return workload


def run_patchbay(args, workload) -> dict:
    from patchbay.sampling_params import SamplingParams

    llm = patchbay.LLM(attention__backend=args.backend, runtime__threads=args.threads,
                       scheduler__max_num_seqs=args.max_num_seqs,
                       scheduler__max_num_batched_tokens=args.max_num_batched_tokens)
    llm.generate([workload[0][0]], SamplingParams(max_tokens=2))  # warm-up
    llm.engine.runner.timings.clear()
    prompts = [prompt for prompt, _ in workload]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for _, n in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    assert generated == sum(n for _, n in workload)
    return {"engine": f"patchbay ({llm.engine.backend_name})", "seconds": elapsed, "generated_tokens": generated,
            "runner_breakdown_s": dict(llm.engine.runner.timings), "model_dir": str(llm.engine.model_dir)}


def run_transformers(args, workload, model_dir: str) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        model.generate(torch.tensor([workload[0][0]]), max_new_tokens=2, do_sample=False, pad_token_id=pad)
        start = time.perf_counter()
        for first in range(0, len(workload), args.batch_size):
            batch = workload[first : first + args.batch_size]
            width = max(len(prompt) for prompt, _ in batch)
            input_ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])
            attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            longest = max(n for _, n in batch)
            model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=longest,
                           min_new_tokens=longest, do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - start
    return {"engine": f"transformers generate (static batches of {args.batch_size})", "seconds": elapsed,
            "generated_tokens": sum(n for _, n in workload)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(16, 512))
    parser.add_argument("--output-range", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--batch-size", type=int, default=8, help="transformers' static batch size")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also append the results as JSON lines here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    patchbay_result = None
    from transformers import AutoTokenizer

    from patchbay.model_loader import resolve_model_dir

    model_dir = str(resolve_model_dir("default"))
    workload = make_workload(AutoTokenizer.from_pretrained(model_dir), args.num_requests,
                             tuple(args.prompt_range), tuple(args.output_range), args.seed)
    patchbay_result = run_patchbay(args, workload)
    hf_result = run_transformers(args, workload, model_dir)
    rows = [patchbay_result, hf_result]
    print(f"\n{args.num_requests} requests, prompts {args.prompt_range[0]}-{args.prompt_range[1]} tokens, "
          f"outputs {args.output_range[0]}-{args.output_range[1]} tokens, {args.threads} threads, float32")
    print(f"{'engine':<48} {'seconds':>8} {'gen tok/s':>10}")
    for row in rows:
        row["tokens_per_s"] = row["generated_tokens"] / row["seconds"]
        print(f"{row['engine']:<48} {row['seconds']:>8.2f} {row['tokens_per_s']:>10.1f}")
    ratio = patchbay_result["tokens_per_s"] / hf_result["tokens_per_s"]
    print(f"patchbay / transformers generate: {ratio:.2f}x")
    breakdown = patchbay_result["runner_breakdown_s"]
    total = sum(breakdown.values()) or 1.0
    print("patchbay runner time: " + ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in breakdown.items()))
    if args.json:
        with args.json.open("a") as handle:
            for row in rows:
                handle.write(json.dumps({**row, "ratio_vs_transformers": ratio}) + "\n")


if __name__ == "__main__":
    main()
