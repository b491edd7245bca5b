"""Where one decode step's time goes, patchbay beside vLLM-CPU, with instruments a busy machine does not spoil.

    .venv/bin/python benchmarks/profile_step.py --requests 32 64 --dtype bfloat16 --threads 2 --peers vllm

For each batch size an engine on the bundled model takes that many requests (prompts of 16-256 tokens of the
bench's corpus, as the bench's mixed workload; the same token ids for every engine), prefills them, runs a few
decode steps to warm up, and then measures ``--steps`` decode steps with each instrument of
``step_profiler.py`` in turn: calls per step (the same on a quiet or a busy machine), the main thread's CPU
time by part (fused decoder layers, decode attention, products, sampling, other torch calls, Python), torch
operators by their own CPU time, and wall time.  patchbay's engine phases (``Engine.step_timings``) come too.

``--peers vllm`` runs ``profile_step_vllm.py`` in vLLM's interpreter (``make bench-peers``) on the bench's
standard copy of the model, with the bench's environment for vLLM (threads, tcmalloc, Intel OpenMP), in-process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so that its engine's steps are on the profiled thread).  ``--json FILE``
writes every figure.
"""

from __future__ import annotations

import patchbay  # first: it sets the OpenMP wait policy, which torch reads when it starts
import argparse
import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import step_profiler  # noqa: E402 - beside this script, shared with profile_step_vllm.py

PATCHBAY_PARTS = step_profiler.by_name(
    (
        ("fused decoder layers", ("decoder_attention_inputs", "decoder_attention_output_and_mlp")),
        ("decode attention", ("paged_decode_attention", "write_kv_and_attend", "write_kv")),
        ("products (tiled, packed, torch)", ("tiled_", "linear", "mkldnn", "addmm", "matmul")),
        ("norms, rotary, activations", ("rms_norm", "rotary", "silu_and_mul")),
        ("sampling", ("argmax_rows", "inverse_cdf_rows", "argmax", "topk", "softmax", "multinomial")),
    )
)


def prompts(tokenizer: Any, count: int, prompt_range: tuple[int, int]) -> list[list[int]]:  # noqa: ANN401
    """``count`` prompts of the bench's corpus, lengths drawn from ``prompt_range`` (seeded)."""
    from patchbay.bench.workloads import source_corpus

    corpus = source_corpus(tokenizer)
    rng = random.Random(0)
    drawn = []
    for _ in range(count):
        length = rng.randint(*prompt_range)
        start = rng.randrange(0, len(corpus) - length)
        drawn.append(corpus[start : start + length])
    return drawn


def profile_patchbay(llm: Any, batch: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:  # noqa: ANN401
    from patchbay.sampling_params import SamplingParams

    engine = llm.engine
    engine.scheduler.max_num_seqs = len(batch)
    ids = [engine.add_request(prompt, SamplingParams(max_tokens=100_000, ignore_eos=True)) for prompt in batch]
    while engine.scheduler.waiting or any(
        request.num_computed_tokens < request.num_prompt_tokens for request in engine.scheduler.running
    ):
        engine.step()
    for _ in range(args.warmup):
        engine.step()
    figures: dict[str, Any] = {"engine": "patchbay", "requests": len(batch), "dtype": engine.dtype}
    figures.update(step_profiler.counts(engine.step, args.steps))
    figures.update(step_profiler.cpu_split(engine.step, args.steps, PATCHBAY_PARTS))
    figures.update(step_profiler.torch_op_times(engine.step, args.steps))
    engine.reset_step_timings()
    figures.update(step_profiler.wall(engine.step, args.steps))
    phases = engine.step_timings()
    figures["phase_share"] = {phase: seconds / sum(phases.values()) for phase, seconds in phases.items() if seconds}
    if engine.tuning is not None:
        figures["tuning"] = engine.tuning.describe()
    engine.discard(ids)  # the next batch starts from an empty engine
    return figures


def profile_vllm(model_dir: Path, batches: list[list[list[int]]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``profile_step_vllm.py`` in vLLM's interpreter on the same prompts; its figures, or the reason it failed."""
    from patchbay.bench.peers import check_interpreter, peer_environment, standard_checkpoint, vllm_environment
    from patchbay.toolkit.paths import cache_dir

    python = check_interpreter("vllm", args.vllm_python)
    model = standard_checkpoint(model_dir, cache_dir() / "peer-checkpoints")
    config = {"model": str(model), "dtype": args.dtype, "threads": args.threads, "batches": batches}
    config.update(steps=args.steps, warmup=args.warmup)
    environment = {
        **peer_environment(),
        **dict(vllm_environment(python, args.threads)),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    script = Path(__file__).with_name("profile_step_vllm.py")
    done = subprocess.run(
        [str(python), str(script)], input=json.dumps(config), capture_output=True, text=True, env=environment
    )
    if done.returncode != 0:
        return [{"engine": "vLLM", "error": done.stderr[-2000:]}]
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--prompt-range", type=int, nargs=2, default=(16, 256))
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--peers", nargs="*", choices=["vllm"], default=[])
    parser.add_argument("--vllm-python", type=Path, default=Path(".peers/vllm/bin/python"))
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY.PATH=VALUE",
        help="a patchbay setting (runtime.linear_kernel=tiles: the quiet machine's paths whatever the tuning)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    overrides = {key.replace(".", "__"): value for key, _, value in (item.partition("=") for item in args.set)}
    llm = patchbay.LLM(
        model__dtype=args.dtype,
        runtime__threads=args.threads,
        scheduler__max_num_seqs=max(args.requests),
        scheduler__max_num_batched_tokens=2048,
        **overrides,
    )
    batches = [prompts(llm.tokenizer, count, tuple(args.prompt_range)) for count in args.requests]
    results = []
    for batch in batches:
        results.append(profile_patchbay(llm, batch, args))
        print(json.dumps(results[-1], indent=1), flush=True)
    model_dir = Path(llm.engine.model_dir)
    llm.engine.close()
    if "vllm" in args.peers:
        for figures in profile_vllm(model_dir, batches, args):
            results.append(figures)
            print(json.dumps(figures, indent=1), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
