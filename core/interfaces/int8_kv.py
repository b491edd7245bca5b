"""The int8 KV cache's row format (``cache.dtype: int8``).

A backend that lists ``"int8"`` in :attr:`~patchbay.interfaces.AttentionCapabilities.cache_dtypes` writes
and reads it.

Each (token, KV head) row of an int8 cache holds the ``head_size`` features rounded to int8, then the row's
scale as the 4 bytes of a float32 (native byte order): feature ``d`` is ``q[d] * scale``.  The cache tensor is
``torch.int8`` with rows of :func:`row_size` bytes: the runner asks the backend's
:meth:`~patchbay.interfaces.AttentionBackend.kv_cache_shape` for ``head_size + 4``.  The torch side
(rounding rows, reading them back) is :mod:`patchbay.toolkit.int8_kv`.  A row's scale is
``max |x| / 127`` (0 for a row of zeros), so every row keeps its own range: a scale per block would have to
grow, and re-round the block's earlier rows, whenever a later token's features are larger.  A zeroed block
reads as zeros.

The built-in backends attend a step's own keys and values rounded too, as the cache gives them back, so a
request's tokens do not depend on which of their paths attended it.
"""

from __future__ import annotations

CACHE_DTYPES = ("int8",)
"""The cache dtypes a run may ask for besides its model's dtype (``cache.dtype``)."""

SCALE_BYTES = 4
"""Bytes of a row's float32 scale, after its features."""

LEVELS = 127
"""The largest magnitude a feature is rounded to: int8 without -128, so the range is symmetric."""


def row_size(head_size: int, cache_dtype: str | None) -> int:
    """The last dimension of a cache of ``cache_dtype`` (``None``: the model's dtype) for ``head_size``."""
    return head_size + SCALE_BYTES if cache_dtype == "int8" else head_size
