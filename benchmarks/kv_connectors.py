"""Time to first token with a long shared prefix: each KV connector against none, in one run.

    .venv/bin/python benchmarks/kv_connectors.py --prefix-tokens 1000 --num-requests 8 \\
        --connectors none host_offload shared_storage redis --redis-url redis://127.0.0.1:6379/0

For each connector, a first engine (a "previous run") processes the
requests and saves their prompt KV; then a fresh engine, with an empty
prefix cache as a new process would have, runs the same requests one at a
time and the script reports their time to first token, the prompt tokens
the connector supplied, and whether the greedy tokens equal those of the run
without a connector.  The engines run without their local prefix cache, so
every prompt token is either computed or supplied by the connector.
"""

from __future__ import annotations

import patchbay  # first: it sets the OpenMP wait policy, which torch reads when it starts
import argparse
import statistics
import tempfile
import time
from pathlib import Path

from patchbay.bench.report import append_json_lines


def make_prompts(tokenizer, prefix_tokens: int, num_requests: int) -> list[list[int]]:

    text = "\n".join(p.read_text() for p in sorted(Path(patchbay.__file__).parent.glob("*.py")))
    corpus = tokenizer.encode(text)
    prefix = corpus[:prefix_tokens]
    return [prefix + corpus[prefix_tokens + 50 * i : prefix_tokens + 50 * i + 24] for i in range(num_requests)]


def measure(connector: str, args: argparse.Namespace, prompts: list[list[int]], store: Path) -> dict:
    from patchbay.sampling_params import SamplingParams

    # No local prefix cache: every prompt token is either computed or supplied by the connector.
    overrides: dict = {"runtime__threads": args.threads, "cache__prefix_caching": False}
    if connector != "none":
        options: dict = {}
        if connector == "shared_storage":
            options["path"] = str(store / "shared_storage")
        elif connector == "redis":
            options["url"] = args.redis_url
            options["key_prefix"] = f"patchbay-bench-{time.time_ns()}:"
        elif connector == "host_offload":
            options["namespace"] = f"bench-{time.time_ns()}"
        overrides["kv_connector"] = {"name": connector, "options": options}
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    patchbay.LLM(**overrides).generate(prompts, params)  # the previous run: fills the store
    llm = patchbay.LLM(**overrides)  # a fresh engine: empty prefix cache, like a new process
    ttfts, tokens = [], []
    for prompt in prompts:  # one at a time, so each TTFT is its own prefill
        (output,) = llm.generate([prompt], params)
        ttfts.append(output.metrics.time_to_first_token)
        tokens.append(output.token_ids)
    stats = llm.engine.scheduler.kv_connector_stats
    return {
        "connector": connector,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_mean_s": statistics.fmean(ttfts),
        "tokens_loaded": getattr(stats, "num_loaded_tokens", 0),
        "token_ids": tokens,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--connectors", nargs="+", default=["none", "host_offload", "shared_storage"])
    parser.add_argument("--prefix-tokens", type=int, default=1000)
    parser.add_argument("--num-requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also append the results as JSON lines here")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from patchbay.toolkit.model_files import resolve_model_dir

    prompts = make_prompts(
        AutoTokenizer.from_pretrained(resolve_model_dir("default")), args.prefix_tokens, args.num_requests
    )
    with tempfile.TemporaryDirectory(prefix="patchbay-kv-bench-") as store:
        results = [measure(name, args, prompts, Path(store)) for name in args.connectors]
    baseline = next((r for r in results if r["connector"] == "none"), None)
    print(
        f"\n{args.num_requests} requests sharing a {args.prefix_tokens}-token prefix, "
        f"{len(prompts[0])} prompt tokens each, run one at a time on a fresh engine"
    )
    print(f"{'connector':<16} {'TTFT p50':>9} {'TTFT mean':>10} {'vs none':>8} {'tokens loaded':>14}  same tokens")
    for result in results:
        ratio = baseline["ttft_p50_s"] / result["ttft_p50_s"] if baseline else float("nan")
        same = "-" if baseline is None or result is baseline else str(result["token_ids"] == baseline["token_ids"])
        print(
            f"{result['connector']:<16} {result['ttft_p50_s'] * 1e3:>7.1f}ms {result['ttft_mean_s'] * 1e3:>8.1f}ms "
            f"{ratio:>7.2f}x {result['tokens_loaded']:>14}  {same}"
        )
    if args.json:
        append_json_lines(args.json, results, drop=("token_ids",))


if __name__ == "__main__":
    main()
