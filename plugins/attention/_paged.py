"""What the built-in backends share: paged-cache arithmetic (writing new keys and values, finding cached ones).

A slot is ``block_id * block_size + offset``: the row of a token in the cache
viewed as ``[num_blocks * block_size, num_kv_heads, head_size]``.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from patchbay.toolkit.int8_kv import dequantize_rows, quantize_rows

if TYPE_CHECKING:
    from patchbay.interfaces import AttentionBackend


def write_kv(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key[i]`` and ``value[i]`` at cache slot ``slot_mapping[i]`` for every ``i < len(slot_mapping)``.

    ``key_cache`` and ``value_cache`` are ``[num_blocks, block_size, num_kv_heads, head_size]``
    views (as :meth:`AttentionBackend.split_kv_cache` returns them); rows of
    ``key``/``value`` past ``len(slot_mapping)`` are padding and are not written.  An int8 cache
    (rows of ``head_size + 4``) gets each row rounded by :func:`~patchbay.toolkit.int8_kv.quantize_rows`.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    slots = slot_mapping.long()
    for cache, new in ((key_cache, key), (value_cache, value)):
        flat = cache.view(-1, cache.shape[-2], cache.shape[-1])
        rows = quantize_rows(new[:num_tokens]) if cache.dtype == torch.int8 else new[:num_tokens].to(cache.dtype)
        flat.index_copy_(0, slots, rows)


def write_latent_rows(kv_cache: torch.Tensor, key: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store a latent (MLA) layer's ``key[i]`` (``[tokens, 1, row]``: its one cache row, the value inside it) at
    slot ``slot_mapping[i]`` of ``kv_cache`` (``[num_blocks, block_size, 1, row]``), for every
    ``i < len(slot_mapping)``; an int8 cache gets each row rounded as :func:`write_kv` does."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    flat = kv_cache.view(-1, kv_cache.shape[-2], kv_cache.shape[-1])
    new = key[:num_tokens]
    flat.index_copy_(0, slot_mapping.long(), quantize_rows(new) if kv_cache.dtype == torch.int8 else new.to(flat.dtype))


def as_cached(rows: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Keys or values ``[..., head_size]`` as a cache of ``cache_dtype`` gives them back: rounded through an int8
    cache's rows, else unchanged (a path that attends a step's new keys without reading them from the cache then
    attends what every other path reads)."""
    if cache_dtype == torch.int8:
        return dequantize_rows(quantize_rows(rows), rows.dtype)
    return rows


def as_float(cache_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``[..., row_size]`` as keys or values ``[..., head_size]`` in ``dtype``: an int8 cache's
    rows dequantized (:mod:`patchbay.interfaces.int8_kv`), a float cache's converted."""
    if cache_rows.dtype == torch.int8:
        return dequantize_rows(cache_rows, dtype)
    return cache_rows.to(dtype)


def split_and_write_kv(
    backend: type[AttentionBackend],
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``kv_cache`` with ``backend.split_kv_cache``, :func:`write_kv` the step's new keys and values into it.

    Returns the ``(key_cache, value_cache)`` views, new keys and values
    written: the first thing every built-in backend's ``forward`` does.
    """
    key_cache, value_cache = backend.split_kv_cache(kv_cache)
    write_kv(key_cache, value_cache, key, value, slot_mapping)
    return key_cache, value_cache


def gather_slots(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slots: torch.Tensor,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value rows at cache ``slots`` (long), each ``[len(slots), num_kv_heads, head_size]``.

    Converted to ``dtype`` when given (the cache's own dtype otherwise).
    """

    def rows(cache: torch.Tensor) -> torch.Tensor:
        found = cache.view(-1, *cache.shape[-2:]).index_select(0, slots)
        return found if dtype is None else as_float(found, dtype)

    # One cache at a time: the keys' unconverted copy is freed before the values are gathered.
    return rows(key_cache), rows(value_cache)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The cache rows of ``block_ids`` (flat, long), concatenated: ``[len(block_ids) * block_size, heads, head_size]``.

    ``index_select`` over whole blocks copies about twice as fast on CPU as
    advanced indexing of the 4-D cache.  ``out``, if given, is a flat buffer
    of exactly the gathered size to write into (see :class:`Workspace`).
    """
    num_blocks, block_size, num_heads, head_size = cache.shape
    flat = cache.view(num_blocks, -1)
    if out is None:
        rows = flat.index_select(0, block_ids)
    else:
        rows = torch.index_select(flat, 0, block_ids, out=out.view(block_ids.shape[0], flat.shape[1]))
    return rows.view(-1, num_heads, head_size)


class Workspace:
    """Scratch buffers reused by every layer of a backend, step after step.

    Layers run one after another, so one buffer per purpose suffices.  On
    CPU, gathering decode batches into fresh tensors of many megabytes can
    cost a round of page faults per allocation (the allocator hands them
    back to the OS); reusing buffers avoids it.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def buffer(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A flat tensor of ``numel`` elements, valid until the next request for ``name``."""
        found = self._buffers.get(name)
        if found is None or found.numel() < numel or found.dtype != dtype or found.device != device:
            found = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = found
        return found[:numel]


def ragged_slots(
    block_table: torch.Tensor,
    starts: list[int],
    ends: list[int],
    block_size: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cache slots of positions ``starts[i] .. ends[i] - 1`` of every request ``i``, concatenated.

    Returns ``(slots, request_ids, positions)``, each ``[sum(ends - starts)]``
    and long, on ``block_table``'s device.  Example with block size 4,
    ``starts = [0, 2]``, ``ends = [3, 5]``, block table ``[[7, 0], [2, 9]]``::

        request_ids = [0, 0, 0, 1, 1, 1]
        positions   = [0, 1, 2, 2, 3, 4]
        slots       = [28, 29, 30, 10, 11, 36]
    """
    device = block_table.device
    lengths_list = [end - start for start, end in zip(starts, ends, strict=True)]
    total = sum(lengths_list)
    lengths = torch.tensor(lengths_list, dtype=torch.long, device=device)
    request_ids = torch.repeat_interleave(torch.arange(len(lengths_list), device=device), lengths, output_size=total)
    # [3, 3] -> first output row of each request [0, 3]; subtracting it gives each row's offset in its request.
    first_row = torch.cumsum(lengths, 0) - lengths
    start_of = torch.tensor(starts, dtype=torch.long, device=device)
    positions = torch.arange(total, device=device) - first_row[request_ids] + start_of[request_ids]
    blocks = block_table[request_ids, positions // block_size].long()
    return blocks * block_size + positions % block_size, request_ids, positions


def window_start(first_query_position: int, sliding_window: int | None) -> int:
    """The first key position a query at ``first_query_position`` may see (0 without a window)."""
    if sliding_window is None:
        return 0
    return max(0, first_query_position - sliding_window + 1)


def cuda_unavailable_reason() -> str | None:
    """Why CUDA cannot be used here, or ``None``; cheap, and initialises no CUDA context."""
    if not torch.cuda.is_available():
        return "needs CUDA (torch.cuda.is_available() is False)"
    return None


def package_unavailable_reason(module: str, package: str | None = None) -> str | None:
    """Why ``module`` cannot be imported (``package`` not installed), or ``None``; checked without importing it.

    ``package`` is the distribution's name where it differs from the
    module's (``flash-attn`` for ``flash_attn``).
    """
    if importlib.util.find_spec(module) is None:
        return f"needs the {package or module} package (pip install 'patchbay[gpu]')"
    return None


def cuda_package_unavailable_reason(module: str, package: str | None = None) -> str | None:
    """Why a CUDA kernel library cannot be used here: no CUDA, or ``module`` not installed; ``None`` if it can.

    Cheap: initialises no CUDA context and imports nothing (see
    :func:`package_unavailable_reason` for ``package``).
    """
    return cuda_unavailable_reason() or package_unavailable_reason(module, package)
