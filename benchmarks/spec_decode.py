"""Speculative decoding on a workload with repetition: each drafter against no speculation, in one run.

    .venv/bin/python benchmarks/spec_decode.py --methods none ngram medusa eagle eagle3 \\
        --medusa-path DIR --eagle-path DIR --eagle3-path DIR

Every request asks the bundled SmolLM2-135M-Instruct to reproduce or lightly
edit a piece of patchbay's own source (so long stretches of the answer repeat
the prompt), greedily, with a fixed output length.  Each method runs the same
requests in the same process; the script checks that every method produced
the same tokens as no speculation (greedy speculative decoding is lossless)
and prints generated tokens per second, the speed-up over no speculation and
the acceptance statistics.
"""

from __future__ import annotations

import patchbay  # first: it sets the OpenMP wait policy, which torch reads when it starts
import argparse
import time
from pathlib import Path

from patchbay.bench.report import append_json_lines
from patchbay.bench.workloads import copy_prompts


def make_prompts(num_requests: int) -> list[dict]:
    """The bench's copy/edit conversations (``patchbay bench spec`` runs the same ones)."""
    return [{"messages": messages} for messages in copy_prompts(num_requests)]


def run(method: str, args: argparse.Namespace, prompts: list[dict]) -> dict:
    from patchbay.sampling_params import SamplingParams

    overrides: dict = {"runtime__threads": args.threads, "scheduler__max_num_seqs": args.max_num_seqs}
    if method != "none":
        options = {}
        path = getattr(args, f"{method}_path", None)
        if path:
            options["path"] = path
        overrides["spec_decode"] = {
            "name": method,
            "num_speculative_tokens": args.num_speculative_tokens,
            "options": options,
        }
    llm = patchbay.LLM(**overrides)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    drafted_before = llm.spec_stats.num_draft_tokens
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(o.token_ids) for o in outputs)
    stats = llm.spec_stats.as_dict() if llm.spec_stats.num_draft_tokens > drafted_before else {}
    return {
        "method": method,
        "seconds": elapsed,
        "generated_tokens": generated,
        "tokens_per_s": generated / elapsed,
        "spec": stats,
        "token_ids": [o.token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", default=["none", "ngram"])
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--medusa-path")
    parser.add_argument("--eagle-path")
    parser.add_argument("--eagle3-path")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also append the results as JSON lines here")
    args = parser.parse_args()

    prompts = make_prompts(args.num_requests)
    results = [run(method, args, prompts) for method in args.methods]
    baseline = next((r for r in results if r["method"] == "none"), None)
    print(
        f"\n{args.num_requests} requests, {args.max_tokens} greedy tokens each, k={args.num_speculative_tokens}, "
        f"{args.threads} threads, float32"
    )
    print(f"{'method':<8} {'seconds':>8} {'tok/s':>8} {'speed-up':>9} {'accept':>7} {'mean len':>9}  same tokens")
    for result in results:
        speedup = result["tokens_per_s"] / baseline["tokens_per_s"] if baseline else float("nan")
        same = "-" if baseline is None or result is baseline else str(result["token_ids"] == baseline["token_ids"])
        spec = result["spec"]
        print(
            f"{result['method']:<8} {result['seconds']:>8.2f} {result['tokens_per_s']:>8.1f} {speedup:>8.2f}x "
            f"{spec.get('acceptance_rate', 0):>7.2f} {spec.get('mean_accepted_length', 1.0):>9.2f}  {same}"
        )
        if spec:
            rates = ", ".join(f"{r:.2f}" for r in spec["acceptance_rate_per_position"])
            print(f"{'':<8} acceptance per position: {rates}")
    if args.json:
        append_json_lines(args.json, results, drop=("token_ids",))


if __name__ == "__main__":
    main()
