"""Where a Hugging Face parameter lies in a GGUF file, and what llama.cpp's converter did to it on the way.

Names follow gguf-py's own table (``gguf.get_tensor_name_map``: ``model.layers.0.self_attn.q_proj`` is
``blk.0.attn_q``).  llama.cpp's converter permutes the rows of a Llama-architecture model's query and key
projections (it stores rotary pairs interleaved; transformers keeps them in halves) and stores Gemma's norm
weights plus one; :func:`query_key_rows` and :data:`NORM_OFFSET_ARCHITECTURES` undo both exactly, the first by
reordering whole rows, which keeps every quantized block as the file has it.
"""

from __future__ import annotations

import numpy as np

ROW_PERMUTED_ARCHITECTURES = frozenset({"llama"})
"""GGUF architectures whose ``attn_q`` and ``attn_k`` rows llama.cpp's converter permuted."""

NORM_OFFSET_ARCHITECTURES = frozenset({"gemma", "gemma2", "gemma3"})
"""GGUF architectures whose norm weights llama.cpp stores plus one (transformers' Gemma norms scale by 1 + w)."""

SUPPORTED_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3", "mistral"})
"""GGUF architectures whose tensors map onto transformers' modules one to one (with the two fixes above)."""


def gguf_name(hf_name: str, name_map: object) -> str | None:
    """The GGUF tensor name of Hugging Face parameter ``hf_name`` (``None`` when the table has none)."""
    base, _, suffix = hf_name.rpartition(".")
    if suffix not in ("weight", "bias"):
        base, suffix = hf_name, ""
    mapped = name_map.get_name(base)  # type: ignore[attr-defined]
    if mapped is None:
        return None
    return f"{mapped}.{suffix}" if suffix else mapped


def query_key_rows(gguf_tensor_name: str, rows: int, num_heads: int, num_kv_heads: int) -> np.ndarray | None:
    """For a Llama-architecture ``attn_q`` / ``attn_k`` tensor of ``rows`` rows, the file row that holds each of
    transformers' rows (``None`` for any other tensor).

    The converter wrote, per head of ``d`` rows, row ``2i + j`` of the file from transformers' row ``j * d/2 +
    i``; undoing it reads transformers' row ``j * d/2 + i`` from file row ``2i + j``.
    """
    if ".attn_q." in gguf_tensor_name:
        heads = num_heads
    elif ".attn_k." in gguf_tensor_name:
        heads = num_kv_heads
    else:
        return None
    half = rows // heads // 2
    # file row of (head h, pair member j, index i) is h*2*half + 2*i + j; transformers' row is h*2*half + j*half + i
    file_rows = np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)
    return file_rows
