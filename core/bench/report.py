"""The bench's outputs: a table on the terminal and a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, TextIO

from patchbay.bench.roofline import Roofline

PHASES = ("schedule", "update", "prepare", "forward", "sample", "output", "draft", "finish")


def _ratio(value: float | None) -> str:
    return f"{value:.2f}x" if value else "-"


def _figure(row: dict[str, Any]) -> str:
    """The row's workload-specific figure: latency and roofline, or share of the compute ceiling."""
    if row["workload"] == "latency":
        text = f"TTFT {row['ttft_s'] * 1e3:.0f} ms, decode {row['decode_ms_per_token']:.1f} ms/token"
        if row.get("bandwidth_roofline_fraction"):
            text += f" ({100 * row['bandwidth_roofline_fraction']:.0f}% of bandwidth roofline"
            if row.get("stream_roofline_fraction"):
                text += f"; weights at {100 * row['stream_roofline_fraction']:.0f}% of STREAM triad"
            text += ")"
        if row.get("same_tokens_as_patchbay"):
            text += f", same tokens {row['same_tokens_as_patchbay']}, first {row['same_first_token_as_patchbay']}"
        return text
    parts = [f"{100 * row['compute_ceiling_fraction']:.0f}% of compute ceiling"]
    if row.get("same_tokens_as_patchbay"):
        parts.append(f"same tokens {row['same_tokens_as_patchbay']}, first {row['same_first_token_as_patchbay']}")
    if row.get("spec"):
        parts.append(f"acceptance {row['spec']['acceptance_rate']:.2f}")
    return ", ".join(parts)


def print_table(
    rows: list[dict[str, Any]], roofline: Roofline, stream: TextIO, skipped: dict[str, str] | None = None
) -> None:
    """The roofline, one line per row (ratios: x gen, x cb against transformers; x vllm: patchbay against vLLM at
    the row's dtype; x llama: against llama.cpp), perplexities, the engines ``skipped`` with their reasons, and
    patchbay's step breakdowns."""
    for line in roofline.describe():
        print(line, file=stream)
    header = (
        f"{'workload':<34} {'engine':<52} {'s':>7} {'gen tok/s':>9} {'x gen':>6} {'x cb':>6} {'x vllm':>6}"
        f" {'x llama':>7}  notes"
    )
    print("\n" + header + "\n" + "-" * len(header), file=stream)
    for row in rows:
        if "perplexity" in row:
            continue
        name = f"{row['workload']} ({row['label']})"
        print(
            f"{name:<34} {row['engine']:<52} {row['seconds']:>7.2f} {row['generated_tokens_per_s']:>9.1f} "
            f"{_ratio(row.get('x_generate')):>6} {_ratio(row.get('x_continuous')):>6} "
            f"{_ratio(row.get('x_vllm')):>6} {_ratio(row.get('x_llamacpp')):>7}  {_figure(row)}",
            file=stream,
        )
    for row in rows:
        if "perplexity" in row:
            agreement = row.get("greedy_agreement_with_float32")
            print(
                f"perplexity on held text, {row['engine']}: {row['perplexity']:.3f}"
                + (f"; greedy agreement with float32 {100 * agreement:.1f}%" if agreement is not None else ""),
                file=stream,
            )
    for name, reason in (skipped or {}).items():
        print(f"skipped {name}: {reason}", file=stream)
    provisional = dict.fromkeys(row["engine"] for row in rows if row.get("tuning_provisional"))
    if provisional:
        print(
            f"warning: {', '.join(provisional)} ran a PROVISIONAL CPU tuning (measured on a busy machine, not the "
            "quiet machine's choice of paths): measure again when the machine is quiet",
            file=stream,
        )
    for row in rows:
        breakdown = row.get("step_breakdown_s") or {}
        total = sum(breakdown.values())
        if total:
            shares = ", ".join(
                f"{phase} {100 * seconds / total:.1f}%" for phase, seconds in breakdown.items() if seconds
            )
            print(f"step time, {row['engine']} on {row['workload']} ({row['label']}): {shares}", file=stream)


def append_json_lines(path: Path, rows: list[dict[str, Any]], *, drop: tuple[str, ...] = (), **extra: Any) -> None:
    """Append each row (less the ``drop`` keys, plus ``extra``) to ``path`` as one JSON line."""
    with path.open("a", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps({**{k: v for k, v in row.items() if k not in drop}, **extra}) + "\n")


def write_plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Throughput against concurrency per engine, and patchbay's step-time breakdown per run."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no plot: matplotlib is not installed (pip install 'patchbay[bench]')")
        return None
    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    throughput = [row for row in rows if row["workload"] == "throughput"]
    for engine in dict.fromkeys(row["engine"] for row in throughput):
        points = sorted(
            (row["concurrency"], row["generated_tokens_per_s"]) for row in throughput if row["engine"] == engine
        )
        left.plot([c for c, _ in points], [t for _, t in points], marker="o", label=engine)
    left.set_xlabel("concurrent requests")
    left.set_ylabel("generated tokens/s")
    left.set_title("throughput workload")
    if throughput:
        left.legend(fontsize=8)
    timed = [row for row in rows if sum((row.get("step_breakdown_s") or {}).values())]
    labels = [f"{row['workload']}\n{row['label']}\n{row['engine']}" for row in timed]
    offsets = [0.0] * len(timed)
    for phase in PHASES:
        shares = []
        for row in timed:
            breakdown = row["step_breakdown_s"]
            shares.append(100 * breakdown.get(phase, 0.0) / sum(breakdown.values()))
        if any(shares):
            right.barh(range(len(timed)), shares, left=offsets, label=phase)
            offsets = [o + s for o, s in zip(offsets, shares, strict=True)]
    right.set_yticks(range(len(timed)), labels, fontsize=6)
    right.set_xlabel("% of step time")
    right.set_title("patchbay step-time breakdown")
    if timed:
        right.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
