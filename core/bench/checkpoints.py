"""Random-weight Llama-shaped checkpoints of a few sizes, for the bench's model-size axis.

Each is transformers' ``save_pretrained`` of a seeded, randomly initialised
``LlamaForCausalLM`` (safetensors, ``architectures`` set, the tied embedding
saved under its own name) with the bundled model's tokenizer, so patchbay and
the out-of-process peers (vLLM) load the same standard checkpoint.  They are
built once, on first use, under patchbay's cache directory
(``bench-checkpoints/``), written to a temporary sibling and renamed into
place; the larger ones are built in bfloat16 (a 3B float32 model is 12 GB),
after checking the memory free.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_FORMAT = "v2"
"""Part of each directory's name: bumped when the shapes or the way they are built change (v2: 65,536 positions)."""
MAX_POSITIONS = 65536
"""``max_position_embeddings`` of every checkpoint: the context axis's 32,768-token prompts fit with their outputs."""
MEMORY_HEADROOM = 2.5
"""Free memory a build needs, in multiples of the model's bytes (the model, and ``save_pretrained``'s copies)."""


class CheckpointUnavailable(Exception):
    """Why a checkpoint cannot be built here (not enough free memory); the bench skips the size with it."""


@dataclass(frozen=True)
class LlamaShape:
    """The shape of a Llama decoder; the vocabulary is the bundled tokenizer's, the embedding tied."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    dtype: str = "bfloat16"
    """The dtype the weights are built and saved in."""

    def config(self, vocab_size: int, bos_token_id: int | None, eos_token_id: int | None) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=MAX_POSITIONS,
            tie_word_embeddings=True,
            bos_token_id=bos_token_id,
            eos_token_id=eos_token_id,
            architectures=["LlamaForCausalLM"],
        )

    def num_parameters(self, vocab_size: int) -> int:
        """Parameters of the model with a ``vocab_size`` tied embedding (norms included)."""
        head_dim = self.hidden_size // self.num_attention_heads
        kv = self.num_key_value_heads * head_dim
        attention = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * kv
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attention + mlp + 2 * self.hidden_size
        return self.num_hidden_layers * per_layer + vocab_size * self.hidden_size + self.hidden_size

    def key(self, seed: int) -> str:
        """The directory name of this shape built with ``seed``."""
        parts = [
            f"h{self.hidden_size}",
            f"i{self.intermediate_size}",
            f"l{self.num_hidden_layers}",
            f"a{self.num_attention_heads}",
            f"kv{self.num_key_value_heads}",
            self.dtype,
        ]
        return f"llama-{'-'.join(parts)}-seed{seed}-{CHECKPOINT_FORMAT}"


SIZES: dict[str, LlamaShape] = {
    # SmolLM2-135M's shape.
    "135m": LlamaShape(576, 1536, 30, 9, 3),
    # Llama-3.2-1B's shape (with SmolLM2's 49,152-token vocabulary): 1.07B parameters.
    "1b": LlamaShape(2048, 8192, 16, 32, 8),
    # Llama-3.2-3B's shape: 2.97B parameters.
    "3b": LlamaShape(3072, 8192, 28, 24, 8),
}
"""The model-size axis: ``--model-sizes`` names."""


def available_memory_bytes() -> int | None:
    """Memory free for the build (the machine's, or its cgroup's where lower); ``None`` when it cannot be told."""
    from patchbay.engine.memory_check import available_memory

    return available_memory(torch.device("cpu"))


def random_checkpoint(shape: LlamaShape, store: Path, seed: int = 0, *, tokenizer_dir: Path | None = None) -> Path:
    """The checkpoint of ``shape`` built with ``seed`` under ``store``, built now if it is not there yet.

    ``tokenizer_dir``: where the tokenizer comes from (default: the bundled
    model's).  :class:`CheckpointUnavailable` when the memory free is short of
    :data:`MEMORY_HEADROOM` times the model's bytes.
    """
    target = store / shape.key(seed)
    if (target / "config.json").is_file():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if tokenizer_dir is None:
        from patchbay.toolkit.model_files import bundled_gguf, convert_gguf

        tokenizer_dir = convert_gguf(bundled_gguf())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    dtype = getattr(torch, shape.dtype)
    needed = shape.num_parameters(len(tokenizer)) * dtype.itemsize * MEMORY_HEADROOM
    free = available_memory_bytes()
    if free is not None and free < needed:
        raise CheckpointUnavailable(
            f"building {target.name} needs about {needed / 2**30:.1f} GiB of free memory, "
            f"{free / 2**30:.1f} GiB is free"
        )
    config = shape.config(len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id)
    store.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=store))
    try:
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.save_pretrained(partial, safe_serialization=True)
        del model
        tokenizer.save_pretrained(partial)
        try:
            partial.rename(target)
        except OSError:  # another run put it there first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target


def checkpoint_store() -> Path:
    """Where the checkpoints are kept: ``bench-checkpoints/`` in patchbay's cache directory."""
    from patchbay.toolkit.paths import cache_dir

    return cache_dir() / "bench-checkpoints"


def size_checkpoint(name: str, seed: int = 0) -> Path:
    """The checkpoint of the size ``name`` (a key of :data:`SIZES`), built on first use."""
    if name not in SIZES:
        raise ValueError(f"bench --model-sizes: unknown size {name!r} (known: {', '.join(SIZES)})")
    return random_checkpoint(SIZES[name], checkpoint_store(), seed)
