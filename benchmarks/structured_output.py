"""What structured output costs: grammar compile times, and a constrained batch against the same batch unconstrained.

    .venv/bin/python benchmarks/structured_output.py --backends xgrammar llguidance --num-requests 16

For each backend: the time to build it (tokenizer tables) and to compile
each constraint of the set, cold; then ``--num-requests`` chat requests with
JSON-schema, regex and choice constraints run greedily as one batch, and the
same prompts run unconstrained with ``ignore_eos`` and each request's
``max_tokens`` set to the length its constrained run produced, so both runs
schedule exactly the same steps.  The report gives the wall time, time per
step, the ``structure`` phase (bitmask fill and apply, matcher advance) per
step and the ratio of the constrained run to the unconstrained one.  The two
runs alternate ``--repeats`` times and the fastest of each counts, since a
shared machine makes single runs noisy.
"""

from __future__ import annotations

import patchbay  # first: it sets the OpenMP wait policy, which torch reads when it starts
import argparse
import time
from pathlib import Path

from patchbay.bench.report import append_json_lines

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "pets"],
    "additionalProperties": False,
}
WORKLOAD = [
    ("Describe a person as JSON.", {"json_schema": SCHEMA}),
    ("Describe a friend as JSON.", {"json_object": True}),
    ("What is the phone number of the bakery?", {"regex": r"\(\d{3}\) \d{3}-\d{4}"}),
    ("Which city is the capital of France?", {"choice": ["Paris", "London", "Berlin", "Madrid"]}),
]
EXTRA_CONSTRAINTS = [
    {"grammar": 'root ::= item ("," item)*\nitem ::= [a-z]+ | [0-9]+'},
    {"regex": r"[A-Z][a-z]+( [A-Z][a-z]+){0,3}\."},
]


def compile_times(llm: patchbay.LLM) -> dict:
    from patchbay.interfaces import StructuredOutputParams

    grammars = llm.engine.grammars
    started = time.perf_counter()
    backend = grammars.backend
    init_s = time.perf_counter() - started
    times = {}
    for constraint in [c for _, c in WORKLOAD] + EXTRA_CONSTRAINTS:
        params = StructuredOutputParams(**constraint)
        started = time.perf_counter()
        backend.compile(params)
        times[params.kind + (":" + params.spec[:24] if params.kind != "json_object" else "")] = (
            time.perf_counter() - started
        )
    return {"backend_init_s": init_s, "compile_s": times}


def run(llm: patchbay.LLM, prompts: list, params: list) -> dict:
    engine = llm.engine
    engine.reset_step_timings()
    steps_before = engine.stats.num_steps
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    wall = time.perf_counter() - started
    steps = engine.stats.num_steps - steps_before
    timings = engine.step_timings()
    return {
        "wall_s": wall,
        "steps": steps,
        "tokens": sum(len(o.token_ids) for o in outputs),
        "step_ms": 1e3 * wall / steps,
        "structure_ms_per_step": 1e3 * timings.get("structure", 0.0) / steps,
        "lengths": [len(o.token_ids) for o in outputs],
        "finish": [o.finish_reason for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"])
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs of each; the fastest counts")
    parser.add_argument("--json", type=Path, help="also append the results as JSON lines here")
    args = parser.parse_args()

    from patchbay.sampling_params import SamplingParams

    picked = [WORKLOAD[i % len(WORKLOAD)] for i in range(args.num_requests)]
    prompts = [{"messages": [{"role": "user", "content": text}]} for text, _ in picked]
    results = []
    for backend in args.backends:
        llm = patchbay.LLM(runtime__threads=args.threads, structured_output__name=backend)
        compiled = compile_times(llm)
        llm.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
        constrained_params = [SamplingParams(max_tokens=args.max_tokens, structured_output=c) for _, c in picked]
        constrained = run(llm, prompts, constrained_params)
        free_params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in constrained["lengths"]]
        free = run(llm, prompts, free_params)
        for _ in range(args.repeats - 1):
            constrained = min(constrained, run(llm, prompts, constrained_params), key=lambda r: r["wall_s"])
            free = min(free, run(llm, prompts, free_params), key=lambda r: r["wall_s"])
        results.append(
            {
                "backend": backend,
                **compiled,
                "constrained": constrained,
                "unconstrained": free,
                "wall_ratio": constrained["wall_s"] / free["wall_s"],
                "step_ratio": constrained["step_ms"] / free["step_ms"],
            }
        )
    print(
        f"\n{args.num_requests} greedy chat requests (JSON schema, JSON object, regex, choice), {args.threads} threads"
    )
    for result in results:
        c, f = result["constrained"], result["unconstrained"]
        print(
            f"\n{result['backend']}: backend init {result['backend_init_s'] * 1e3:.0f} ms; cold compile "
            + ", ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in result["compile_s"].items())
        )
        print(
            f"  constrained:   {c['steps']} steps, {c['tokens']} tokens, {c['wall_s']:.2f} s, "
            f"{c['step_ms']:.1f} ms/step, structure {c['structure_ms_per_step']:.2f} ms/step "
            f"({100 * c['structure_ms_per_step'] / c['step_ms']:.1f}%), "
            f"finish {sorted(set(c['finish']))}"
        )
        print(
            f"  unconstrained: {f['steps']} steps, {f['tokens']} tokens, {f['wall_s']:.2f} s, "
            f"{f['step_ms']:.1f} ms/step"
        )
        print(
            f"  ratio constrained/unconstrained: wall {result['wall_ratio']:.3f}, per step {result['step_ratio']:.3f}"
        )
    if args.json:
        append_json_lines(args.json, results)


if __name__ == "__main__":
    main()
