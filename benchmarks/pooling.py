"""Embeddings per second at batch sizes 1, 32 and 256, and a rerank workload: patchbay against sentence-transformers.

    .venv/bin/python benchmarks/pooling.py                    # MiniLM-L6-shaped BERT, 2 threads, float32
    .venv/bin/python benchmarks/pooling.py --repeats 1 --batches 1 32   # a quick check that it works

The checkpoints are random-weight models of a real embedder's and reranker's shape (all-MiniLM-L6-v2's and
ms-marco-MiniLM-L-6-v2's: 6 layers, 384 features, 12 heads), saved by sentence-transformers, so both engines load
the same directory; speed does not depend on the weights' values.  Texts are 8 to 48 words of the tokenizer's
vocabulary (one token each).  For each batch size ``B`` both engines embed the same texts ``B`` at a time
(``SentenceTransformer.encode(batch_size=B)`` over them, ``LLM.embed`` called with ``B`` texts at a time); the
rerank workload scores one query against 100 documents (``CrossEncoder.predict`` at its default batch of 32,
``LLM.score``).  The best of ``--repeats`` timed runs after a warm-up is reported, with both engines on the same
threads.  Results append to ``--out`` as JSON lines, with the machine's description.
"""

from __future__ import annotations

import patchbay  # first: it sets the OpenMP wait policy, which torch reads when it starts
import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from patchbay.bench.machine import describe_machine
from patchbay.bench.report import append_json_lines

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
import pooling_models  # noqa: E402  # the tests' builders of sentence-transformers checkpoints

MINILM_L6 = dict(
    hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536, max_position_embeddings=512
)
"""all-MiniLM-L6-v2's and ms-marco-MiniLM-L-6-v2's shape."""


def texts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(pooling_models.WORDS) for _ in range(rng.randint(8, 48))) for _ in range(count)]


def best_of(repeats: int, threads: int, runs: dict[str, Any]) -> dict[str, float]:
    """Each engine's shortest of ``repeats`` timed calls (after an untimed warm-up), the engines taking turns so
    that a busy neighbour slows both alike."""
    import torch

    times: dict[str, list[float]] = {engine: [] for engine in runs}
    for timed in [False, *[True] * repeats]:
        for engine, run in runs.items():
            torch.set_num_threads(threads)
            started = time.perf_counter()
            run()
            if timed:
                times[engine].append(time.perf_counter() - started)
    return {engine: min(seconds) for engine, seconds in times.items()}


def embeddings(args: argparse.Namespace, model_dir: Path) -> list[dict[str, Any]]:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(model_dir), device="cpu")
    llm = patchbay.LLM(
        model__path=str(model_dir),
        pooling={"name": "auto"},
        runtime__threads=args.threads,
        runtime__device="cpu",
        model__dtype="float32",
        scheduler__max_num_seqs=max(args.batches),
        scheduler__max_num_batched_tokens=max(args.batches) * 64,
    )
    rows = []
    for batch in args.batches:
        inputs = texts(max(batch, args.min_texts), seed=batch)
        chunks = [inputs[start : start + batch] for start in range(0, len(inputs), batch)]

        def run_patchbay(chunks: list[list[str]] = chunks) -> None:
            for chunk in chunks:
                llm.embed(chunk)

        def run_reference(inputs: list[str] = inputs, batch: int = batch) -> None:
            reference.encode(inputs, batch_size=batch)

        timed = best_of(args.repeats, args.threads, {"patchbay": run_patchbay, "sentence-transformers": run_reference})
        for engine, seconds in timed.items():
            rows.append({"workload": f"embed batch {batch}", "engine": engine, "items_per_s": len(inputs) / seconds})
            print(f"embed batch {batch:>3}  {engine:<22} {len(inputs) / seconds:8.1f} embeddings/s", flush=True)
    return rows


def rerank(args: argparse.Namespace, model_dir: Path) -> list[dict[str, Any]]:
    from sentence_transformers import CrossEncoder

    query = "what is the capital of france"
    documents = texts(100, seed=7)
    reference = CrossEncoder(str(model_dir), device="cpu")
    llm = patchbay.LLM(
        model__path=str(model_dir),
        pooling={"name": "auto"},
        runtime__threads=args.threads,
        runtime__device="cpu",
        model__dtype="float32",
        scheduler__max_num_seqs=128,
        scheduler__max_num_batched_tokens=8192,
    )
    rows = []
    timed = best_of(
        args.repeats,
        args.threads,
        {
            "patchbay": lambda: llm.score(query, documents),
            "sentence-transformers": lambda: reference.predict([(query, document) for document in documents]),
        },
    )
    for engine, seconds in timed.items():
        rows.append({"workload": "rerank 1x100", "engine": engine, "items_per_s": len(documents) / seconds})
        print(f"rerank 1x100     {engine:<22} {len(documents) / seconds:8.1f} pairs/s", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--min-texts", type=int, default=64, help="texts embedded per timed run, at least")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-results/pooling.jsonl"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        embedder = pooling_models.build_embedding_model(Path(folder) / "minilm", "bert", **MINILM_L6)
        reranker = pooling_models.build_classifier(Path(folder) / "reranker", "bert", 1, **MINILM_L6)
        rows = embeddings(args, embedder) + rerank(args, reranker)
    for workload in dict.fromkeys(row["workload"] for row in rows):
        ours, theirs = (next(r["items_per_s"] for r in rows if r["workload"] == workload and r["engine"] == e)
                        for e in ("patchbay", "sentence-transformers"))  # fmt: skip
        print(f"{workload:<16} patchbay / sentence-transformers: {ours / theirs:.2f}x")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    append_json_lines(args.out, rows, machine=describe_machine(), threads=args.threads)


if __name__ == "__main__":
    main()
