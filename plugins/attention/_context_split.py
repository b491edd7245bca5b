"""A prefill chunk after cached tokens, attended on the CPU without a mask.

Every token of the chunk sees every cached token, and the chunk's own keys
causally. SDPA with a boolean mask over all of them reads the mask for every
score and skips no fully hidden block. Split instead: the cached keys
unmasked, the chunk's own keys with ``is_causal``, each through torch's CPU
flash kernel, which also returns each row's log-sum-exp of scores; the two
partial results are then weighted by their share of the total softmax mass,
which is exact up to rounding. An 8,192-token prefill in chunks of 2,048 ran
1.2x faster so (float32, Intel Xeon, 2 threads).
"""

from __future__ import annotations

import torch

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def attend_after_context(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int, scale: float
) -> torch.Tensor:
    """Attention of ``query [heads, q_len, head_size]`` over ``keys``/``values [kv_heads, context_len + q_len,
    head_size]``: all of the first ``context_len`` keys, then the last ``q_len`` causally. Query heads share KV
    heads in order (head ``h`` reads KV head ``h // (heads // kv_heads)``). Returns ``[heads, q_len, head_size]``
    in the query's dtype."""
    heads, q_len, head_size = query.shape
    kv_heads = keys.shape[0]
    group = heads // kv_heads
    # Without a mask, the query heads sharing a KV head are one longer query of that head: no copied keys.
    cached, cached_lse = _flash(
        query.reshape(1, kv_heads, group * q_len, head_size),
        keys[None, :, :context_len],
        values[None, :, :context_len],
        scale=scale,
    )
    own_keys, own_values = (
        rows[:, context_len:].repeat_interleave(group, 0) if group > 1 else rows[:, context_len:]
        for rows in (keys, values)
    )
    own, own_lse = _flash(query[None], own_keys[None], own_values[None], is_causal=True, scale=scale)
    cached_lse = cached_lse.reshape(heads, q_len)
    own_lse = own_lse.reshape(heads, q_len)
    total = torch.logaddexp(cached_lse, own_lse)
    merged = cached.reshape(heads, q_len, head_size).float() * (cached_lse - total).exp_().unsqueeze(-1)
    merged.addcmul_(own[0].float(), (own_lse - total).exp_().unsqueeze(-1))
    return merged.to(query.dtype)
