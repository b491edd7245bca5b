"""Per-layer KV-cache specs and their grouping into KV-cache groups.

Layers with the same spec share one block table per request: full-attention
layers form one group, sliding-window layers (per window size) another.
Each group has its own block pool, so a request holds one list of block ids
per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from patchbay.interfaces.int8_kv import row_size

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def cache_dtype(setting: str, model_dtype: str) -> str:
    """The KV cache's dtype for ``cache.dtype`` (``auto``: the model's dtype)."""
    return model_dtype if setting == "auto" else setting


@dataclass(frozen=True)
class KVCacheSpec:
    """The cache shape of one attention layer."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str = "float32"
    """The cache's dtype: the model's, or ``int8`` (rows of :mod:`patchbay.interfaces.int8_kv`)."""
    sliding_window: int | None = None
    """``None`` for full attention."""

    @property
    def row_size(self) -> int:
        """Elements of one token's row per KV head: :attr:`head_size`, plus an int8 cache's scale bytes."""
        return row_size(self.head_size, self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of this layer takes (keys and values)."""
        return 2 * self.block_size * self.num_kv_heads * self.row_size * _DTYPE_BYTES[self.dtype]

    def max_blocks_needed(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens occupies (before any sliding-window freeing)."""
        return -(-num_tokens // self.block_size)


@dataclass
class KVCacheGroup:
    """Layers sharing one spec, and so one block table per request."""

    spec: KVCacheSpec
    layer_names: list[str] = field(default_factory=list)


def group_layers(specs: dict[str, KVCacheSpec]) -> list[KVCacheGroup]:
    """Group layers by identical spec, in order of first appearance.

    Example: layers ``[full, window, full, window]`` give two groups,
    ``[layer0, layer2]`` and ``[layer1, layer3]``.
    """
    groups: dict[KVCacheSpec, KVCacheGroup] = {}
    for layer_name, spec in specs.items():
        groups.setdefault(spec, KVCacheGroup(spec)).layer_names.append(layer_name)
    return list(groups.values())
