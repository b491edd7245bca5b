"""Sharding a loaded Hugging Face model over tensor-parallel ranks, in place.

Megatron-style, on the transformers model itself (no model code is
changed): in every decoder layer ``q_proj``, ``k_proj`` and ``v_proj`` keep
the output rows of this rank's attention heads (KV heads are replicated
when there are fewer than ranks), ``gate_proj`` and ``up_proj`` keep this
rank's slice of the intermediate features, and ``o_proj`` and ``down_proj``
keep the matching input columns; a forward hook on each of those two sums
their partial outputs over the ranks (one all-reduce each, two per layer).
transformers' attention reshapes with ``-1`` heads, so the narrower
projections need nothing else.  Fused layouts (Phi-3's ``qkv_proj`` and
``gate_up_proj``, GPT-NeoX's ``query_key_value``) keep the same rows of each
part (:mod:`patchbay.worker.parallel.layer_shards`); which architectures may be
sharded is what their architecture plugin declares.

The vocabulary is sharded too (:func:`shard_vocab`): each rank keeps rows
``[start, stop)`` of the input embedding and of the LM head, the vocabulary
padded with zero rows to :attr:`VocabShard.rows_per_rank` per rank (a
multiple of 16, for the integer and packed CPU kernels) when it does not
divide.  The embedding looks up the ids of its shard, zeroes the rows of the
others and sums the partial embeddings over the ranks (one all-reduce per
step: it cannot be folded into the first layer's, whose input norm needs the
whole embedding); the LM head computes its slice of the logits and a forward
hook gathers the slices from every rank and cuts the padding off, so every
rank still samples from the same full logits.  A tied LM head (SmolLM2) shares
the embedding's shard, sharded once.  Norms stay replicated.

Sharding runs before the CPU linear paths (fused projections, oneDNN
packing, quantization), which then work on the shards as on any linear.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from patchbay.contract.settings import ConfigError, ConfigProblem
from patchbay.worker.model.hf_model import HFCausalLM
from patchbay.worker.parallel.layer_shards import (
    HeadCounts,
    UnshardableLayer,
    attention_shards,
    keep_columns,
    keep_rows,
    mlp_shards,
    moe_shards,
    narrow_attention_module,
)

KEY = "runtime.tensor_parallel_size"


@dataclass(frozen=True)
class ProjectionSlice:
    """The part of one decoder projection a rank keeps.

    ``keeps="outputs"`` (column parallel: ``q/k/v_proj``, ``gate/up_proj``): output features
    ``[start, stop)``; ``keeps="inputs"`` (row parallel: ``o_proj``, ``down_proj``): input features
    ``[start, stop)``, whose partial outputs are summed over the ranks.
    """

    keeps: Literal["outputs", "inputs"]
    start: int
    stop: int


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

    def head_counts(self, rank: int) -> HeadCounts:
        """This rank's query and KV heads, as the layer planner reads them."""
        head_start, head_stop = self.head_range(rank)
        kv_start, kv_stop = self.kv_head_range(rank)
        return HeadCounts(head_start, head_stop - head_start, kv_start, kv_stop - kv_start, self.head_size)

    def feature_range(self, rank: int) -> tuple[int, int]:
        """This rank's intermediate MLP features, ``[start, stop)``."""
        share = self.intermediate_size // self.world_size
        return rank * share, (rank + 1) * share

    def projection_slices(self, rank: int) -> dict[str, ProjectionSlice]:
        """What ``rank`` keeps of each decoder layer's projections, by the projection's attribute name."""
        head_start, head_stop = self.head_range(rank)
        kv_start, kv_stop = self.kv_head_range(rank)
        size = self.head_size
        heads, kv_heads = (head_start * size, head_stop * size), (kv_start * size, kv_stop * size)
        features = self.feature_range(rank)
        return {
            "q_proj": ProjectionSlice("outputs", *heads),
            "k_proj": ProjectionSlice("outputs", *kv_heads),
            "v_proj": ProjectionSlice("outputs", *kv_heads),
            "o_proj": ProjectionSlice("inputs", *heads),
            "gate_proj": ProjectionSlice("outputs", *features),
            "up_proj": ProjectionSlice("outputs", *features),
            "down_proj": ProjectionSlice("inputs", *features),
        }


def shard_layout(config: Any, world_size: int) -> ShardLayout:
    """The layout of ``config`` (a transformers config) over ``world_size`` ranks.

    Raises :class:`ConfigError` naming ``runtime.tensor_parallel_size`` and
    the model's counts when the model cannot be split that way.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    num_heads = config.num_attention_heads
    num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
    layout = ShardLayout(
        world_size,
        num_heads,
        num_kv_heads,
        getattr(config, "head_dim", None) or config.hidden_size // num_heads,
        config.intermediate_size,
    )
    problems = []
    if num_heads % world_size:
        problems.append(f"{architecture} has {num_heads} attention heads, not divisible by {world_size} ranks")
    if num_kv_heads % world_size and world_size % num_kv_heads:
        problems.append(
            f"{architecture} has {num_kv_heads} KV heads (and {num_heads} attention heads): the KV "
            f"head count must divide or be divisible by the {world_size} ranks"
        )
    if layout.intermediate_size % world_size:
        problems.append(
            f"{architecture} has an MLP of {layout.intermediate_size} features (intermediate_size), "
            f"not divisible by {world_size} ranks"
        )
    if problems:
        raise ConfigError([ConfigProblem("<run>", KEY, problem) for problem in problems])
    return layout


AllReduce = Callable[[torch.Tensor], None]
"""Sums a tensor over the ranks, in place."""
AllGather = Callable[[torch.Tensor], torch.Tensor]
"""Every rank's tensor (all of one shape), concatenated along the last dimension in rank order."""

VOCAB_ROW_MULTIPLE = 16
"""Each rank's vocabulary rows are padded to a multiple of this: int4 packing needs output rows in multiples of 16."""


@dataclass(frozen=True)
class VocabShard:
    """Which rows of a ``vocab_size``-row embedding or LM head one of ``world_size`` ranks keeps.

    With ``vocab_size`` 1001 over 2 ranks: 512 rows each, rank 0 holds ids 0-511,
    rank 1 ids 512-1000 and 23 zero rows of padding, never produced as tokens.
    """

    vocab_size: int
    world_size: int
    rank: int

    @property
    def rows_per_rank(self) -> int:
        """Rows every rank holds, padding included: the vocabulary's share, rounded up to :data:`VOCAB_ROW_MULTIPLE`."""
        share = -(-self.vocab_size // self.world_size)
        return -(-share // VOCAB_ROW_MULTIPLE) * VOCAB_ROW_MULTIPLE

    @property
    def start(self) -> int:
        """The first token id of this rank's shard."""
        return min(self.rank * self.rows_per_rank, self.vocab_size)

    @property
    def stop(self) -> int:
        """One past the last real token id of this rank's shard (its rows from there to ``rows_per_rank`` are
        padding)."""
        return min(self.start + self.rows_per_rank, self.vocab_size)

    def rows_of(self, weight: torch.Tensor) -> torch.Tensor:
        """This shard's rows of ``weight`` (``[vocab_size, ...]``), zero-padded to ``rows_per_rank`` rows, as a copy."""
        kept = weight[self.start : self.stop]
        padding = self.rows_per_rank - kept.shape[0]
        if padding == 0:
            return kept.clone()
        return torch.cat([kept, kept.new_zeros(padding, *kept.shape[1:])])


def shard_model(
    model: HFCausalLM,
    layout: ShardLayout,
    rank: int,
    all_reduce: AllReduce,
    all_gather: AllGather,
    *,
    shard_vocabulary: bool = True,
) -> None:
    """Keep ``rank``'s shard of every decoder layer and, with ``shard_vocabulary``, of the vocabulary
    (:func:`shard_vocab`) of ``model`` and report per-rank head counts in its layer specs."""
    layers = getattr(model.model.base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(
            [ConfigProblem("<run>", KEY, f"{model.shape.architecture}: its decoder has no `layers` list")]
        )
    reduce_hook = _reducer(all_reduce)
    counts = layout.head_counts(rank)
    for index, layer in enumerate(layers):
        reduced_modules: list[nn.Module] = []
        try:
            attention = _attention_of(layer)
            shards = attention_shards(attention, counts, layout.num_heads, layout.num_kv_heads)
            mlp: Any = layer.mlp  # a dense MLP, or a MoE block with experts
            if hasattr(mlp, "experts"):
                moe, reduced_modules = moe_shards(mlp, rank, layout.world_size)
                shards += moe
            else:
                start, stop = layout.feature_range(rank)
                shards += mlp_shards(mlp, start, stop - start, layout.intermediate_size)
        except UnshardableLayer as exc:
            problem = f"{model.shape.architecture}: decoder layer {index} cannot be sharded: {exc}"
            raise ConfigError([ConfigProblem("<run>", KEY, problem)]) from None
        for shard in shards:
            if shard.keeps == "outputs":
                keep_rows(shard.linear, shard.index)
            else:
                keep_columns(shard.linear, shard.index, keep_bias=rank == 0)
                if shard.reduced:
                    shard.linear.register_forward_hook(reduce_hook)
        for module in reduced_modules:
            module.register_forward_hook(reduce_hook)
        narrow_attention_module(attention, counts)
    model.layer_specs = {
        index: dataclasses.replace(
            spec,
            num_heads=layout.heads_per_rank,
            num_kv_heads=1 if spec.latent else layout.kv_heads_per_rank,  # MLA's one latent row is every head's
        )
        for index, spec in model.layer_specs.items()
    }
    if shard_vocabulary:
        shard_vocab(model, layout.world_size, rank, all_reduce, all_gather)


def shard_vocab(
    model: HFCausalLM, world_size: int, rank: int, all_reduce: AllReduce, all_gather: AllGather
) -> VocabShard:
    """Keep ``rank``'s rows of ``model``'s input embedding and LM head (one shared shard when they are tied).

    The embedding's lookups then give the rows of this shard's ids (zeros for the others) summed over the
    ranks by ``all_reduce``; the LM head's outputs are gathered from the ranks by ``all_gather`` and cut to the
    model's vocabulary, so both still return what the whole vocabulary would.  Returns this rank's shard.
    """
    embedding = model.model.get_input_embeddings()
    lm_head = model.model.get_output_embeddings()
    if not isinstance(embedding, nn.Embedding) or not isinstance(lm_head, nn.Linear):
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    KEY,
                    f"{model.shape.architecture}: only an nn.Embedding input embedding and an nn.Linear LM "
                    f"head can be sharded; found {type(embedding).__name__} and {type(lm_head).__name__}",
                )
            ]
        )
    vocab_size = embedding.num_embeddings
    if lm_head.out_features != vocab_size:
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    KEY,
                    f"{model.shape.architecture}: its LM head has "
                    f"{lm_head.out_features} outputs and its embedding "
                    f"{vocab_size} rows; a sharded vocabulary needs them equal",
                )
            ]
        )
    shard = VocabShard(vocab_size, world_size, rank)
    tied = lm_head.weight is embedding.weight
    with torch.no_grad():
        embedding.weight = nn.Parameter(shard.rows_of(embedding.weight), requires_grad=False)
        if tied:
            lm_head.weight = embedding.weight
        else:
            lm_head.weight = nn.Parameter(shard.rows_of(lm_head.weight), requires_grad=False)
        if lm_head.bias is not None:
            lm_head.bias = nn.Parameter(shard.rows_of(lm_head.bias), requires_grad=False)
    embedding.num_embeddings = lm_head.out_features = shard.rows_per_rank
    embedding.forward = VocabParallelLookup(embedding, shard, all_reduce)  # type: ignore[method-assign]
    lm_head.register_forward_hook(_gatherer(all_gather, vocab_size))
    # torch's stubs take only tensors and modules as a module's attributes; any value is allowed at run time
    embedding.vocab_shard = lm_head.vocab_shard = shard  # type: ignore[assignment]
    return shard


class VocabParallelLookup:
    """The forward of an ``nn.Embedding`` that holds one :class:`VocabShard`: whole-vocabulary embeddings.

    Ids ``[3, 700]`` with rank 0 holding 0-511 and rank 1 512-1000: rank 0 looks up local rows ``[3, 0]`` and
    zeroes the second, rank 1 looks up ``[0, 188]`` and zeroes the first; the all-reduce adds the two.  The lookup
    is the embedding class's own ``forward``, so a subclass's scaling (Gemma's ``sqrt(hidden_size)``) applies.
    """

    def __init__(self, embedding: nn.Embedding, shard: VocabShard, all_reduce: AllReduce) -> None:
        self.embedding = embedding
        self.shard = shard
        self.all_reduce = all_reduce

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        local_ids = input - self.shard.start
        elsewhere = (local_ids < 0) | (local_ids >= self.shard.stop - self.shard.start)
        rows = type(self.embedding).forward(self.embedding, local_ids.masked_fill(elsewhere, 0))
        rows = rows.masked_fill(elsewhere.unsqueeze(-1), 0.0)
        self.all_reduce(rows)
        return rows


def _gatherer(all_gather: AllGather, vocab_size: int) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def gather_logits(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        logits = all_gather(output.contiguous())
        return logits if logits.shape[-1] == vocab_size else logits[..., :vocab_size].contiguous()

    return gather_logits


def _attention_of(layer: nn.Module) -> nn.Module:
    """A decoder layer's attention module (``self_attn``, or GPT-NeoX's ``attention``)."""
    for name in ("self_attn", "attention"):
        module = getattr(layer, name, None)
        if isinstance(module, nn.Module):
            return module
    raise UnshardableLayer(f"{type(layer).__name__} has no self_attn (nor attention) module")


def _reducer(all_reduce: AllReduce) -> Callable[[nn.Module, Any, torch.Tensor], torch.Tensor]:
    def reduce_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        all_reduce(output)
        return output

    return reduce_output
