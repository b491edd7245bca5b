"""What one tensor-parallel rank keeps of each decoder layer, for the projection layouts transformers' families use.

A layer's attention keeps the rank's query heads and the KV heads they read, its MLP the rank's slice of the
intermediate features; the output projections keep the matching input columns and their partial outputs are
summed over the ranks.  Families lay the same projections out differently, and each layout is read here:

- separate ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (Llama, Qwen, Mistral, Gemma, Granite, StableLM);
- one fused ``qkv_proj`` of rows ``[q | k | v]`` (Phi-3): the rank keeps its rows of each of the three;
- one fused ``query_key_value`` of rows ``[q k v]`` per head, with ``dense`` after it (GPT-NeoX): a head's three
  row blocks are contiguous, so the rank keeps a contiguous run;
- ``gate_proj``, ``up_proj``, ``down_proj``, a fused ``gate_up_proj`` of rows ``[gate | up]`` (Phi-3), or
  ``dense_h_to_4h`` and ``dense_4h_to_h`` (GPT-NeoX).

Norms inside the attention are replicated where they normalize one head (Qwen3's ``q_norm`` of ``head_dim``
features); StableLM's per-head LayerNorms keep the rank's heads; a norm over all heads at once (OLMo 2) would
need every rank's heads, so such a layer is refused.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn


class UnshardableLayer(ValueError):
    """A decoder layer whose layout the planner does not know how to split (the message says what)."""


@dataclass(frozen=True)
class LinearShard:
    """What a rank keeps of one linear: output rows (column parallel) or input columns (row parallel, whose partial
    outputs are summed over the ranks)."""

    linear: nn.Linear
    keeps: Literal["outputs", "inputs"]
    index: torch.Tensor
    """long: the rows or columns kept, in order."""
    reduced: bool = True
    """For ``inputs``: whether this linear's own partial output is summed over the ranks (``False``: a module
    around it is, as a MoE layer's experts module sums every expert's)."""


@dataclass(frozen=True)
class HeadCounts:
    """A rank's heads: ``heads`` query heads from ``head_start``, ``kv_heads`` KV heads from ``kv_start``."""

    head_start: int
    heads: int
    kv_start: int
    kv_heads: int
    head_size: int


def _run(start: int, count: int, size: int) -> torch.Tensor:
    """Rows ``[start * size, (start + count) * size)``."""
    return torch.arange(start * size, (start + count) * size)


def attention_shards(attention: nn.Module, counts: HeadCounts, total_heads: int, total_kv: int) -> list[LinearShard]:
    """The linears of one attention module, each with what the rank keeps; raises :class:`UnshardableLayer`."""
    size = counts.head_size
    query_rows = _run(counts.head_start, counts.heads, size)
    kv_rows = _run(counts.kv_start, counts.kv_heads, size)
    linears: Any = attention  # a transformers attention module, read by its attribute names
    if hasattr(attention, "latent_expansion"):
        return _latent_attention_shards(linears, counts)
    if all(hasattr(attention, name) for name in ("q_proj", "k_proj", "v_proj", "o_proj")):
        shards = [
            LinearShard(linears.q_proj, "outputs", query_rows),
            LinearShard(linears.k_proj, "outputs", kv_rows),
            LinearShard(linears.v_proj, "outputs", kv_rows),
            LinearShard(linears.o_proj, "inputs", query_rows),
        ]
    elif hasattr(attention, "qkv_proj") and hasattr(attention, "o_proj"):
        query_width, kv_width = total_heads * size, total_kv * size
        rows = torch.cat([query_rows, query_width + kv_rows, query_width + kv_width + kv_rows])
        shards = [LinearShard(linears.qkv_proj, "outputs", rows), LinearShard(linears.o_proj, "inputs", query_rows)]
    elif hasattr(attention, "query_key_value") and hasattr(attention, "dense"):
        if total_kv != total_heads:
            raise UnshardableLayer("a fused query_key_value with fewer KV heads than query heads")
        rows = _run(counts.head_start, counts.heads, 3 * size)
        shards = [
            LinearShard(linears.query_key_value, "outputs", rows),
            LinearShard(linears.dense, "inputs", query_rows),
        ]
    else:
        raise UnshardableLayer(
            f"its attention ({type(attention).__name__}) has none of the projection layouts patchbay shards "
            "(q_proj/k_proj/v_proj/o_proj, qkv_proj/o_proj, query_key_value/dense)"
        )
    for name in ("q_norm", "k_norm"):
        norm = getattr(attention, name, None)
        weight = getattr(norm, "weight", None)
        if weight is not None and weight.numel() != size:
            raise UnshardableLayer(
                f"its {name} normalizes {weight.numel()} features, all heads at once, so no rank holds what it needs"
            )
    return shards


def _latent_attention_shards(attention: Any, counts: HeadCounts) -> list[LinearShard]:
    """MLA (DeepSeek, as ``deepseek_mla`` runs it): the rank keeps its heads' query rows (``qk_head_dim`` each) and
    ``o_proj``'s matching inputs (``v_head_dim`` each); the latent and rotary key (``kv_a_proj_with_mqa``) are every
    head's, so every rank computes and caches them whole."""
    query = attention.q_proj if attention.q_lora_rank is None else attention.q_b_proj
    query_size = int(attention.qk_nope_head_dim) + int(attention.qk_rope_head_dim)
    return [
        LinearShard(query, "outputs", _run(counts.head_start, counts.heads, query_size)),
        LinearShard(attention.o_proj, "inputs", _run(counts.head_start, counts.heads, int(attention.v_head_dim))),
    ]


def moe_shards(block: nn.Module, rank: int, world_size: int) -> tuple[list[LinearShard], list[nn.Module]]:
    """A MoE layer's linears, each with what the rank keeps, and the modules whose outputs are summed over the
    ranks: each expert keeps its share of its intermediate features (split by
    :mod:`patchbay.worker.model.experts`), the experts module sums them once; a shared expert is sharded as a
    dense MLP.  The router stays whole.  Raises :class:`UnshardableLayer`."""
    experts: Any = block.experts  # checked by the caller: the block has experts
    linears = getattr(experts, "expert_linears", None)
    if linears is None:
        raise UnshardableLayer(f"its experts ({type(experts).__name__}) are not split into per-expert linears")
    shards = []
    for gate_up, down in zip(linears.gate_up, linears.down, strict=True):
        total = int(down.in_features)
        if total % world_size:
            raise UnshardableLayer(f"its experts have {total} intermediate features, not divisible by {world_size}")
        share = total // world_size
        features = torch.arange(rank * share, (rank + 1) * share)
        shards += [
            LinearShard(gate_up, "outputs", torch.cat([features, total + features])),
            LinearShard(down, "inputs", features, reduced=False),
        ]
    for name in ("shared_expert", "shared_experts"):
        shared = getattr(block, name, None)
        if isinstance(shared, nn.Module):
            shared_down: Any = getattr(shared, "down_proj", None)  # an MLP: mlp_shards checks its layout
            total = int(shared_down.in_features)
            if total % world_size:
                raise UnshardableLayer(f"its {name} has {total} features, not divisible by {world_size}")
            share = total // world_size
            shards += mlp_shards(shared, rank * share, share, total)
    return shards, [experts]


def mlp_shards(mlp: nn.Module, start: int, count: int, total: int) -> list[LinearShard]:
    """The linears of one dense MLP, each with what the rank keeps (intermediate features ``[start, start +
    count)`` of ``total``); raises :class:`UnshardableLayer`."""
    features = torch.arange(start, start + count)
    linears: Any = mlp
    if all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
        return [
            LinearShard(linears.gate_proj, "outputs", features),
            LinearShard(linears.up_proj, "outputs", features),
            LinearShard(linears.down_proj, "inputs", features),
        ]
    if hasattr(mlp, "gate_up_proj") and hasattr(mlp, "down_proj") and isinstance(linears.gate_up_proj, nn.Linear):
        return [
            LinearShard(linears.gate_up_proj, "outputs", torch.cat([features, total + features])),
            LinearShard(linears.down_proj, "inputs", features),
        ]
    if hasattr(mlp, "dense_h_to_4h") and hasattr(mlp, "dense_4h_to_h"):
        return [
            LinearShard(linears.dense_h_to_4h, "outputs", features),
            LinearShard(linears.dense_4h_to_h, "inputs", features),
        ]
    raise UnshardableLayer(
        f"its MLP ({type(mlp).__name__}) has none of the layouts patchbay shards "
        "(gate_proj/up_proj/down_proj, gate_up_proj/down_proj, dense_h_to_4h/dense_4h_to_h)"
    )


def narrow_attention_module(attention: nn.Module, counts: HeadCounts) -> None:
    """Make one attention module's own head bookkeeping the rank's: per-head norm lists keep the rank's heads, and a
    module that splits a fused projection by its config's head counts (Phi-3) reads the rank's counts."""
    module: Any = attention
    for name, start, count in (
        ("q_layernorm", counts.head_start, counts.heads),
        ("k_layernorm", counts.kv_start, counts.kv_heads),
    ):
        per_head = getattr(getattr(attention, name, None), "norms", None)
        if isinstance(per_head, nn.ModuleList):
            getattr(attention, name).norms = nn.ModuleList(list(per_head)[start : start + count])
    expansion = getattr(attention, "latent_expansion", None)
    if expansion is not None:  # MLA: each head's part of the latent expansion
        heads = slice(counts.head_start, counts.head_start + counts.heads)
        for name in ("key_part", "value_part"):
            setattr(expansion, name, nn.Parameter(getattr(expansion, name)[heads].clone(), requires_grad=False))
    if hasattr(attention, "qkv_proj"):
        module.config = copy.copy(module.config)  # this module's own: the decoder's config stays whole
        module.config.num_attention_heads = counts.heads
        module.config.num_key_value_heads = counts.kv_heads
    for name, value in (("num_heads", counts.heads), ("num_key_value_heads", counts.kv_heads)):
        if isinstance(getattr(attention, name, None), int):
            setattr(attention, name, value)


def keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    """Column parallel: keep output features ``rows``."""
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight[rows].clone(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[rows].clone(), requires_grad=False)
    linear.out_features = len(rows)


def keep_columns(linear: nn.Linear, columns: torch.Tensor, *, keep_bias: bool) -> None:
    """Row parallel: keep input features ``columns``; the bias is added once, by the rank that keeps it."""
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight[:, columns].clone(), requires_grad=False)
        if linear.bias is not None and not keep_bias:
            linear.bias = None  # type: ignore[assignment]  # torch's stubs miss that a Linear's bias may be None
    linear.in_features = len(columns)
