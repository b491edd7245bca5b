"""Loading a run's model through its architecture plugin (``model.architecture``), and checking what it declares.

The plugin gets a :class:`~patchbay.interfaces.ModelSource` whose ``load_transformers`` is the generic path's
loader (:func:`patchbay.worker.model.hf_model.load_transformers_model`): the one place weights are read from
disk.  What it returns is checked (a module shaped as the runner calls it, one spec per attention layer, each
consistent) and wrapped as the runner's :class:`~patchbay.worker.model.hf_model.HFCausalLM`.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from patchbay.contract.registry import Registry
from patchbay.contract.selection import select_architecture
from patchbay.contract.settings import ConfigError, ConfigProblem, PluginChoice, plugin_options
from patchbay.interfaces import (
    ArchitectureConfig,
    ArchitectureModel,
    AttentionLayerSpec,
    Checkpoint,
    ModelSource,
    WeightFormat,
)
from patchbay.toolkit.model_files import ModelLoadError
from patchbay.toolkit.transformers_layers import architecture_name
from patchbay.worker.model.hf_model import HFCausalLM, load_transformers_model


def read_config(model_dir: Path) -> Any:
    """The model's transformers config."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def architecture_config(config: Any, *, device: torch.device, dtype: str, tensor_parallel_size: int = 1) -> Any:
    """What the run asks of an architecture plugin for the model of ``config``."""
    return ArchitectureConfig(
        device=device.type,
        dtype=dtype,
        architecture=architecture_name(config),
        tensor_parallel_size=tensor_parallel_size,
    )


def load_architecture(
    registry: Registry,
    choice: PluginChoice,
    model_dir: Path,
    *,
    dtype: str,
    device: torch.device,
    tensor_parallel_size: int = 1,
    weight_format: WeightFormat | None = None,
    checkpoint: Checkpoint | None = None,
) -> HFCausalLM:
    """The model of ``model_dir`` as the architecture plugin ``choice`` (``auto``: chosen by the model's
    ``architectures`` name) builds it, checked and wrapped for the runner; its ``load_transformers`` reads the
    weights through ``weight_format`` (from ``checkpoint``) where the run has one.

    A plugin that cannot serve the model raises :class:`~patchbay.contract.settings.ConfigError` naming
    ``model.architecture`` and its reasons; what the plugin returns is checked by :func:`check_loaded`.
    """
    if choice.name == "auto" and choice.options:
        raise ConfigError(
            [ConfigProblem("<run>", "model.architecture.options", "options need a named plugin, not auto")]
        )
    config = read_config(model_dir)
    wanted = architecture_config(config, device=device, dtype=dtype, tensor_parallel_size=tensor_parallel_size)
    name, plugin_class = select_architecture(registry, choice.name, wanted)
    options = plugin_options(plugin_class, choice.options, where="model.architecture.options")
    plugin = plugin_class(options)
    source = ModelSource(
        model_dir=model_dir,
        config=config,
        architecture=wanted.architecture,
        dtype=dtype,
        device=str(device),
        load_transformers=functools.partial(
            _load_transformers,
            model_dir,
            config,
            wanted.architecture,
            dtype=dtype,
            device=device,
            weight_format=weight_format,
            checkpoint=checkpoint,
        ),
    )
    built = plugin.load(source)
    check_loaded(built, f"architecture:{name}", wanted.architecture)
    model = HFCausalLM.from_module(built.module, built.layer_specs, model_dir, wanted.architecture)
    model.served_by = name
    model.logits_scale = float(built.logits_scale)
    return model


def _load_transformers(
    model_dir: Path,
    config: Any,
    architecture: str,
    *,
    dtype: str,
    device: torch.device,
    weight_format: WeightFormat | None,
    checkpoint: Checkpoint | None,
    attention: str = "patchbay",
) -> Any:
    return load_transformers_model(
        model_dir,
        config,
        architecture,
        dtype=dtype,
        device=device,
        attention=attention,
        weight_format=weight_format,
        checkpoint=checkpoint,
    )


def check_loaded(built: Any, plugin: str, architecture: str) -> None:
    """Raise :class:`ModelLoadError` naming ``plugin`` when what its ``load`` returned is not a model the runner
    can call: not an :class:`ArchitectureModel`, a module without the decoder, embeddings and config, no layer
    specs, or a spec that contradicts itself."""
    where = f"{plugin} loading {architecture}"
    if not isinstance(built, ArchitectureModel):
        raise ModelLoadError(f"{where}: load() returned {type(built).__name__}, not an ArchitectureModel")
    module = built.module
    missing = [
        name
        for name in ("base_model", "get_input_embeddings", "get_output_embeddings", "config")
        if getattr(module, name, None) is None
    ]
    if not isinstance(module, torch.nn.Module) or missing:
        raise ModelLoadError(
            f"{where}: the module must be a torch.nn.Module with {', '.join(missing) or 'base_model'} "
            "(shaped as a transformers causal LM)"
        )
    if not built.layer_specs:
        raise ModelLoadError(f"{where}: it declared no attention layers (layer_specs is empty)")
    names: set[str] = set()
    for index, spec in built.layer_specs.items():
        problem = _spec_problem(spec)
        if problem is None and spec.layer_name in names:
            problem = f"its layer name {spec.layer_name!r} is declared twice"
        if problem is not None:
            raise ModelLoadError(f"{where}: attention layer {index}: {problem}")
        names.add(spec.layer_name)


def _spec_problem(spec: Any) -> str | None:
    if not isinstance(spec, AttentionLayerSpec):
        return f"its spec is a {type(spec).__name__}, not an AttentionLayerSpec"
    if not spec.layer_name:
        return "its spec has no layer_name"
    if min(spec.num_heads, spec.num_kv_heads, spec.head_size) < 1 or spec.num_heads % spec.num_kv_heads:
        return (
            f"{spec.num_heads} query heads over {spec.num_kv_heads} KV heads of {spec.head_size} features: "
            "the query heads must be a multiple of the KV heads"
        )
    if spec.value_size is not None and (spec.num_kv_heads != 1 or not 0 < spec.value_size <= spec.head_size):
        return (
            f"a latent (MLA) layer caches one row per token: num_kv_heads 1 and 0 < value_size <= head_size, "
            f"not {spec.num_kv_heads} KV heads with value_size {spec.value_size} of {spec.head_size}"
        )
    return None
