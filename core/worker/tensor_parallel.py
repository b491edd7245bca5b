"""Sharding a loaded Hugging Face model over tensor-parallel ranks, in place.

Megatron-style, on the transformers model itself (no model code is
changed): in every decoder layer ``q_proj``, ``k_proj`` and ``v_proj`` keep
the output rows of this rank's attention heads (KV heads are replicated
when there are fewer than ranks), ``gate_proj`` and ``up_proj`` keep this
rank's slice of the intermediate features, and ``o_proj`` and ``down_proj``
keep the matching input columns; a forward hook on each of those two sums
their partial outputs over the ranks (one all-reduce each, two per layer).
transformers' attention reshapes with ``-1`` heads, so the narrower
projections need nothing else.  Embeddings, norms and the LM head stay
replicated, so every rank computes the same full logits.

Sharding runs before the CPU linear paths (fused projections, oneDNN
packing, quantization), which then work on the shards as on any linear.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from patchbay.contract.settings import ConfigError, ConfigProblem
from patchbay.worker.hf_model import HFCausalLM

SHARDABLE_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
"""transformers ``model_type`` values whose decoder layers have the projections sharded here."""

KEY = "runtime.tensor_parallel_size"


@dataclass(frozen=True)
class ShardLayout:
    """How a model's heads and MLP features split over ``world_size`` ranks."""

    world_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int

    @property
    def heads_per_rank(self) -> int:
        """Query heads each rank holds."""
        return self.num_heads // self.world_size

    @property
    def kv_heads_per_rank(self) -> int:
        """KV heads each rank holds: its share, or 1 (replicated) when there are fewer KV heads than ranks."""
        return max(1, self.num_kv_heads // self.world_size)

    def head_range(self, rank: int) -> tuple[int, int]:
        """This rank's query heads, ``[start, stop)``."""
        return rank * self.heads_per_rank, (rank + 1) * self.heads_per_rank

    def kv_head_range(self, rank: int) -> tuple[int, int]:
        """The KV heads this rank's query heads read (``num_heads / num_kv_heads`` queries share one)."""
        if self.num_kv_heads >= self.world_size:
            return rank * self.kv_heads_per_rank, (rank + 1) * self.kv_heads_per_rank
        ranks_per_kv_head = self.world_size // self.num_kv_heads
        return rank // ranks_per_kv_head, rank // ranks_per_kv_head + 1

    def feature_range(self, rank: int) -> tuple[int, int]:
        """This rank's intermediate MLP features, ``[start, stop)``."""
        share = self.intermediate_size // self.world_size
        return rank * share, (rank + 1) * share


def shard_layout(config: Any, world_size: int) -> ShardLayout:
    """The layout of ``config`` (a transformers config) over ``world_size`` ranks.

    Raises :class:`ConfigError` naming ``runtime.tensor_parallel_size`` and
    the model's counts when the model cannot be split that way.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    layout = ShardLayout(world_size, num_heads, num_kv_heads,
                         getattr(config, "head_dim", None) or config.hidden_size // num_heads,
                         config.intermediate_size)
    problems = []
    if config.model_type not in SHARDABLE_MODEL_TYPES:
        problems.append(f"{architecture} ({config.model_type}) cannot be sharded; tensor parallelism supports "
                        f"{', '.join(sorted(SHARDABLE_MODEL_TYPES))} models")
    if num_heads % world_size:
        problems.append(f"{architecture} has {num_heads} attention heads, not divisible by {world_size} ranks")
    if num_kv_heads % world_size and world_size % num_kv_heads:
        problems.append(f"{architecture} has {num_kv_heads} KV heads (and {num_heads} attention heads): the KV "
                        f"head count must divide or be divisible by the {world_size} ranks")
    if layout.intermediate_size % world_size:
        problems.append(f"{architecture} has an MLP of {layout.intermediate_size} features (intermediate_size), "
                        f"not divisible by {world_size} ranks")
    if problems:
        raise ConfigError([ConfigProblem("<run>", KEY, problem) for problem in problems])
    return layout


AllReduce = Callable[[torch.Tensor], None]
"""Sums a tensor over the ranks, in place."""


def shard_model(model: HFCausalLM, layout: ShardLayout, rank: int, all_reduce: AllReduce) -> None:
    """Keep ``rank``'s shard of every decoder layer of ``model`` and report per-rank head counts in its layer specs."""
    layers = getattr(model.model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError([ConfigProblem("<run>", KEY, f"{model.shape.architecture}: its decoder has no `layers` list")])
    head_start, head_stop = (index * layout.head_size for index in layout.head_range(rank))
    kv_start, kv_stop = (index * layout.head_size for index in layout.kv_head_range(rank))
    feature_start, feature_stop = layout.feature_range(rank)
    reduce_hook = _reducer(all_reduce)
    for layer in layers:
        attention, mlp = layer.self_attn, layer.mlp
        _keep_outputs(attention.q_proj, head_start, head_stop)
        _keep_outputs(attention.k_proj, kv_start, kv_stop)
        _keep_outputs(attention.v_proj, kv_start, kv_stop)
        _keep_inputs(attention.o_proj, head_start, head_stop, keep_bias=rank == 0)
        _keep_outputs(mlp.gate_proj, feature_start, feature_stop)
        _keep_outputs(mlp.up_proj, feature_start, feature_stop)
        _keep_inputs(mlp.down_proj, feature_start, feature_stop, keep_bias=rank == 0)
        attention.o_proj.register_forward_hook(reduce_hook)
        mlp.down_proj.register_forward_hook(reduce_hook)
    model.layer_specs = {
        index: dataclasses.replace(spec, num_heads=layout.heads_per_rank, num_kv_heads=layout.kv_heads_per_rank)
        for index, spec in model.layer_specs.items()
    }


def _reducer(all_reduce: AllReduce) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def reduce_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        all_reduce(output)
        return output

    return reduce_output


def _keep_outputs(linear: nn.Linear, start: int, stop: int) -> None:
    """Column parallel: keep output features ``[start, stop)``."""
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight[start:stop].clone(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[start:stop].clone(), requires_grad=False)
    linear.out_features = stop - start


def _keep_inputs(linear: nn.Linear, start: int, stop: int, *, keep_bias: bool) -> None:
    """Row parallel: keep input features ``[start, stop)``; the bias is added once, by the rank that keeps it."""
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight[:, start:stop].clone(), requires_grad=False)
        if linear.bias is not None and not keep_bias:
            linear.bias = None
    linear.in_features = stop - start
