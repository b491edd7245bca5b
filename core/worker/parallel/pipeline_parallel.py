"""Splitting a loaded Hugging Face model's decoder layers into pipeline stages, in place.

Stage ``s`` (rank ``s``, or its ``tensor_parallel_size`` ranks) keeps a
contiguous range of decoder layers; every other layer is replaced by a
:class:`PassThroughLayer`, which returns its
input untouched and never calls attention, so the stage's layer specs (and
so its KV cache) cover its own layers only.  Two hooks move the hidden
states between stages, over the run's process group:

* a forward pre-hook on the stage's first layer replaces its input with the
  hidden states stage ``s - 1`` sends (stages after the first);
* a forward hook on its last layer starts sending their output to stage
  ``s + 1`` (stages before the last) and lets the stage go on at once, so
  stage ``s`` can compute the next batch while stage ``s + 1`` computes
  this one.

Every stage runs the model's whole forward pass (embeddings, rotary tables
and the final norm are cheap next to the layers), which keeps the model's
own code unchanged; only the last stage's runner computes logits and
samples, and its first rank sends the step's output to rank 0 (the
engine), which hands the sampled tokens to the other stages with their
next batch.  transformers (5.x) decoder layers take the hidden states as
their first argument and return a tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from patchbay.contract.settings import ConfigError, ConfigProblem
from patchbay.scheduling.kv_cache_spec import group_layers
from patchbay.worker.model.hf_model import HFCausalLM

KEY = "runtime.pipeline_parallel_size"
PARTITION_KEY = "runtime.pipeline_layer_partition"

PIPELINED_MODEL_TYPES = frozenset({"llama", "qwen2", "mistral"})
"""transformers ``model_type`` values whose decoder layers take and return a hidden-states tensor."""


class StageLink(Protocol):
    """What the stages exchange hidden states over (a :class:`~patchbay.worker.parallel.distributed.RankGroup`)."""

    def send(self, tensor: torch.Tensor, to_rank: int) -> None:
        """Start sending ``tensor`` (which the link keeps until sent); returns at once."""

    def recv(self, tensor: torch.Tensor, from_rank: int) -> None:
        """Fill ``tensor`` with what ``from_rank`` sends (waits for it)."""


@dataclass(frozen=True)
class StageLayout:
    """How ``num_layers`` decoder layers split into ``num_stages`` contiguous stages: ``sizes`` layers each, or
    evenly (earlier stages take the extra layers when the count does not divide)."""

    num_layers: int
    num_stages: int
    sizes: tuple[int, ...] | None = None
    """Layers per stage (``runtime.pipeline_layer_partition``); ``None``: an even split."""

    def layer_range(self, stage: int) -> range:
        """The decoder layers stage ``stage`` runs."""
        if self.sizes is not None:
            start = sum(self.sizes[:stage])
            return range(start, start + self.sizes[stage])
        share, extra = divmod(self.num_layers, self.num_stages)
        start = stage * share + min(stage, extra)
        return range(start, start + share + (stage < extra))

    @property
    def last_stage(self) -> int:
        return self.num_stages - 1


def stage_layout(config: Any, num_stages: int, partition: list[int] | None = None) -> StageLayout:
    """The layout of ``config`` (a transformers config) over ``num_stages`` stages, ``partition[s]`` layers to
    stage ``s`` when given.

    Raises :class:`ConfigError` naming ``runtime.pipeline_parallel_size``
    when the model has fewer layers than stages or is not a supported type,
    and ``runtime.pipeline_layer_partition`` when the partition does not
    add up to the model's layers.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    problems = []
    if config.model_type not in PIPELINED_MODEL_TYPES:
        problems.append(
            f"{architecture} ({config.model_type}) cannot be split into stages; pipeline parallelism "
            f"supports {', '.join(sorted(PIPELINED_MODEL_TYPES))} models"
        )
    if config.num_hidden_layers < num_stages:
        problems.append(
            f"{architecture} has {config.num_hidden_layers} decoder layers, fewer than the "
            f"{num_stages} stages (each stage needs at least one)"
        )
    if problems:
        raise ConfigError([ConfigProblem("<run>", KEY, problem) for problem in problems])
    if partition is not None and (
        len(partition) != num_stages or sum(partition) != config.num_hidden_layers or min(partition) < 1
    ):
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    PARTITION_KEY,
                    f"{','.join(map(str, partition))} must give each of the {num_stages} stages at "
                    f"least one layer and add up to {architecture}'s {config.num_hidden_layers} decoder layers",
                )
            ]
        )
    return StageLayout(config.num_hidden_layers, num_stages, tuple(partition) if partition is not None else None)


class PassThroughLayer(nn.Module):
    """A decoder layer that runs on another stage: returns its input hidden states untouched."""

    def __init__(self, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states


def split_model(
    model: HFCausalLM, layout: StageLayout, rank: int, link: StageLink, *, ranks_per_stage: int = 1
) -> None:
    """Keep the decoder layers of ``rank``'s stage in ``model``, hook the exchanges with the other stages over
    ``link`` and report only the kept layers in its layer specs.

    With tensor parallelism a stage has ``ranks_per_stage`` ranks (stage
    ``s`` is ranks ``s * ranks_per_stage`` onwards); each exchanges its
    (all-reduced, so identical) hidden states with the rank of the same
    tensor-parallel index in the next stage.
    """
    stage = rank // ranks_per_stage
    decoder = model.model.base_model
    layers = getattr(decoder, "layers", None)
    norm = getattr(decoder, "norm", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) != layout.num_layers or not isinstance(norm, nn.Module):
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    KEY,
                    f"{model.shape.architecture}: its decoder has no `layers` "
                    f"list of {layout.num_layers} layers and final `norm`",
                )
            ]
        )
    _check_same_cache_groups(model, layout)
    kept = layout.layer_range(stage)
    for index in range(layout.num_layers):
        if index not in kept:
            layers[index] = PassThroughLayer(index)
    model.layers_elsewhere = frozenset(index for index in range(layout.num_layers) if index not in kept)
    if stage > 0:
        layers[kept.start].register_forward_pre_hook(_receiver(link, rank - ranks_per_stage), with_kwargs=True)
    if stage < layout.last_stage:
        layers[kept.stop - 1].register_forward_hook(_sender(link, rank + ranks_per_stage))
    model.layer_specs = {index: spec for index, spec in model.layer_specs.items() if index in kept}


def _check_same_cache_groups(model: HFCausalLM, layout: StageLayout) -> None:
    """Every stage must see the model's KV-cache groups (one per distinct layer spec, in the same order): the
    scheduler's block tables, built from rank 0's, carry one table per group to every stage."""

    def group_specs(indices: range) -> list[Any]:
        specs = model.kv_cache_specs(1, "float32")
        names = {model.layer_specs[index].layer_name for index in indices}
        return [group.spec for group in group_layers({name: spec for name, spec in specs.items() if name in names})]

    whole = group_specs(range(layout.num_layers))
    for stage in range(layout.num_stages):
        kept = layout.layer_range(stage)
        if group_specs(kept) != whole:
            raise ConfigError(
                [
                    ConfigProblem(
                        "<run>",
                        KEY,
                        f"{model.shape.architecture}: stage {stage} (layers {kept.start}-{kept.stop - 1}) would "
                        f"not hold every kind of attention layer the model has ({len(whole)} KV-cache groups, "
                        "e.g. full and sliding-window layers); use fewer stages",
                    )
                ]
            )


def _receiver(link: StageLink, from_rank: int) -> Callable[..., tuple[tuple[Any, ...], dict[str, Any]]]:
    def receive(
        module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        if args:
            hidden_states = torch.empty_like(args[0])
            link.recv(hidden_states, from_rank)
            return (hidden_states, *args[1:]), kwargs
        hidden_states = torch.empty_like(kwargs["hidden_states"])
        link.recv(hidden_states, from_rank)
        return args, {**kwargs, "hidden_states": hidden_states}

    return receive


def _sender(link: StageLink, to_rank: int) -> Callable[[nn.Module, Any, torch.Tensor], None]:
    def send(module: nn.Module, args: Any, output: torch.Tensor) -> None:
        # A copy of its own: the send may still be reading it while the next batch runs.
        link.send(output.detach().clone(memory_format=torch.contiguous_format), to_rank)

    return send


def last_stage_rank(num_stages: int, ranks_per_stage: int) -> int:
    """The rank that sends each step's output to rank 0: the last stage's first (tensor-parallel) rank."""
    return (num_stages - 1) * ranks_per_stage


def samples_on(rank: int, num_stages: int, ranks_per_stage: int) -> bool:
    """Whether ``rank``'s runner computes logits and samples: it is in the last stage (or there is one stage)."""
    return rank // ranks_per_stage == num_stages - 1
