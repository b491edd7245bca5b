"""Per-layer KV-cache specs and their grouping into KV-cache groups.

Layers with the same spec share one block table per request: full-attention
layers form one group, sliding-window layers (per window size) another, MLA's
latent layers (one row per token, keys and values in it) another.
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
    latent: bool = False
    """MLA's latent cache: one row per token (``num_kv_heads`` 1, ``head_size`` the compressed latent plus the
    rotary key), holding keys and values alike; ``False``: keys and values apart."""

    @property
    def row_size(self) -> int:
        """Elements of one token's row per KV head: :attr:`head_size`, plus an int8 cache's scale bytes."""
        return row_size(self.head_size, self.dtype)

    @property
    def rows_per_token(self) -> int:
        """Cache rows each token holds per KV head: 2 (its key and its value), 1 for a latent layer."""
        return 1 if self.latent else 2

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in one layer of this spec.

        Example: MLA with ``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64 in bfloat16 holds one row of
        576 features, 1,152 bytes; a layer of 8 KV heads of 128 holds 2 x 8 x 128 x 2 = 4,096.
        """
        return self.rows_per_token * self.num_kv_heads * self.row_size * _DTYPE_BYTES[self.dtype]

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of this layer takes (keys and values)."""
        return self.block_size * self.bytes_per_token


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


def kv_bytes_per_token(groups: list[KVCacheGroup]) -> int:
    """Bytes one token takes in every layer's cache together (each group's layers times their spec's)."""
    return sum(len(group.layer_names) * group.spec.bytes_per_token for group in groups)
