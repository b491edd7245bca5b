"""Building one rank's model and model runner from settings: what rank 0 (the engine) and every other rank share.

Rank 0 checks the settings and chooses (the attention backend, the KV pool
size, the batch sizes); it then builds its runner here from a
:class:`RunnerSpec`, and sends the same spec to the other ranks
(tensor-parallel shards or pipeline stages), which build theirs here too,
so every rank holds the same plugins and sizes over its own part of the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, cast

import torch

from patchbay.contract.registry import Registry
from patchbay.contract.selection import create
from patchbay.contract.settings import ConfigError, ConfigProblem, RuntimeSettings, Settings, plugin_options
from patchbay.interfaces import (
    AttentionBackend,
    Drafter,
    DrafterCapabilities,
    DrafterConfig,
    DrafterContext,
    KVConnector,
    KVConnectorConfig,
    KVConnectorWorker,
    KVShard,
    RejectionSampler,
    WeightFormatConfig,
)
from patchbay.scheduling.kv_cache_spec import KVCacheGroup, KVCacheSpec, cache_dtype, group_layers
from patchbay.scheduling.structured_output import GrammarCompilations
from patchbay.worker.cpu.fused_layer import use_fused_decoder_loops, use_fused_layers
from patchbay.worker.cpu.fused_modules import FusedModules, use_fused_ops
from patchbay.worker.cpu.fused_projections import fuse_shared_input_projections
from patchbay.toolkit.model_files import ModelLoadError
from patchbay.worker.model.architectures import load_architecture
from patchbay.worker.model.checkpoints import checkpoint_in, choose_weight_format
from patchbay.worker.model.experts import split_experts
from patchbay.worker.model.hf_model import HFCausalLM, torch_dtype
from patchbay.worker.model.pooling import HFPoolingModel
from patchbay.worker.pooling import StepPooling
from patchbay.worker.parallel.kv_transfers import RankTransferReports
from patchbay.worker.lora.manager import LoRAManager, install_lora
from patchbay.worker.lora.catalog import base_model_name
from patchbay.worker.model_runner import ModelRunner
from patchbay.worker.cpu.onednn import packing_supported, use_packed_linears
from patchbay.toolkit.tiles import tiles_unavailable
from patchbay.worker.parallel.pipeline_parallel import StageLink, samples_on, split_model, stage_layout
from patchbay.worker.cpu.quantization import (
    INT8_MAX_ROWS,
    Int4TileLayout,
    W8A8TileLayout,
    int4_tiles_unavailable,
    use_w8a8_amx_from,
    w8a8_tiles_unavailable,
    quantize_linears,
)
from patchbay.worker.parallel.tensor_parallel import AllGather, AllReduce, shard_layout, shard_model
from patchbay.worker.cpu.tuning import LinearPaths, Tuning, apply_linear_paths


@dataclass(frozen=True)
class LoadedModel:
    """A rank's model, sharded and with its linears' CPU paths applied."""

    model: HFCausalLM
    quantized_linears: int
    linear_paths: LinearPaths
    fused_modules: FusedModules = FusedModules()


def shards_vocabulary(settings: Settings, registry: Registry) -> bool:
    """Whether tensor-parallel ranks shard the vocabulary (embedding and LM head rows): not when the run's
    drafter copies the target's vocabulary-sized weights (``DrafterCapabilities.reads_vocabulary_weights``)."""
    if settings.spec_decode is None:
        return True
    capabilities = registry.resolve("drafter", settings.spec_decode.name).capabilities
    return not cast(DrafterCapabilities, capabilities).reads_vocabulary_weights  # resolve() checked the kind


def load_rank_model(
    settings: Settings,
    registry: Registry,
    model_dir: Any,
    *,
    dtype: str,
    device: torch.device,
    tuning: Tuning | None,
    rank: int = 0,
    all_reduce: AllReduce | None = None,
    all_gather: AllGather | None = None,
    link: StageLink | None = None,
    shard_vocabulary: bool = True,
) -> LoadedModel:
    """Load the model through its architecture plugin (``model.architecture``), keep ``rank``'s shard when
    ``runtime.tensor_parallel_size`` > 1 and its stage's layers when ``runtime.pipeline_parallel_size`` > 1
    (rank ``r`` is shard ``r % tensor_parallel_size`` of stage ``r // tensor_parallel_size``), then speed up its
    linears.

    ``all_reduce`` sums a tensor over the ranks and ``all_gather`` concatenates
    theirs (both needed when sharded: layers and vocabulary); ``link`` carries
    hidden states between the stages (needed when split).  ``shard_vocabulary``:
    :func:`shards_vocabulary` (else the embedding and LM head stay whole on every rank).
    """
    tensor_size = settings.runtime.tensor_parallel_size
    checkpoint = checkpoint_in(model_dir)
    chosen = choose_weight_format(
        checkpoint,
        settings.model.weight_format,
        registry,
        WeightFormatConfig(device=device.type, dtype=dtype, tensor_parallel_size=tensor_size),
    )
    # A format whose float linears the worker re-quantizes, over a float directory: transformers loads it.
    scheme = (chosen[1].worker_scheme() if chosen is not None else None) or "none"
    weight_format = chosen[1] if chosen is not None and not (scheme != "none" and not checkpoint.is_file) else None
    if settings.pooling is not None:  # pooling models load as transformers' base models, not through the kind
        if weight_format is not None:
            raise ModelLoadError(
                f"{checkpoint.path}: a pooling engine loads float weights through transformers; the "
                f"{chosen[0] if chosen else ''} weight format serves generation only"
            )
        model: HFCausalLM = HFPoolingModel.load(model_dir, dtype=dtype, device=device)
    else:
        model = load_architecture(
            registry,
            settings.model.architecture,
            model_dir,
            dtype=dtype,
            device=device,
            tensor_parallel_size=tensor_size,
            weight_format=weight_format,
            checkpoint=checkpoint,
        )
    if device.type == "cpu" or tensor_size > 1:
        # Experts as per-expert linears before anything else: ranks shard them, CPU linear paths pack or quantize
        # them. A single GPU keeps transformers' grouped products.
        split_experts(model.model)
    if tensor_size > 1 and model.holds_packed_weights:
        # PackedWeight.shard cuts blocks (the kit checks it), but the ranks' sharding slices float weights only.
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    "runtime.tensor_parallel_size",
                    f"packed weights ({chosen[0] if chosen else 'a weight format'}) are not split over tensor-parallel "
                    "ranks yet; run one rank, or load the weights as floats (gguf: options: {dequantize: true})",
                )
            ]
        )
    if tensor_size > 1:
        assert all_reduce is not None and all_gather is not None, "a sharded model needs the ranks' collectives"
        shard_model(
            model,
            shard_layout(model.model.config, tensor_size),
            rank % tensor_size,
            all_reduce,
            all_gather,
            shard_vocabulary=shard_vocabulary,
        )
    num_stages = settings.runtime.pipeline_parallel_size
    if num_stages > 1:
        assert link is not None, "a model split into stages needs the link between them"
        layout = stage_layout(model.model.config, num_stages, settings.runtime.pipeline_layer_partition)
        split_model(model, layout, rank, link, ranks_per_stage=tensor_size)
    runtime = settings.runtime
    if settings.lora is not None:
        check_lora_layout(settings)
        # LoRA adds each target's product after its own linear: no fused q/k/v or gate/up. The fused norms,
        # rotary and SiLU call each projection through its module, which LoRA then wraps; whole fused layers
        # would not, so they stay off.
        runtime = runtime.model_copy(update={"fuse_projections": False})
    quantized, paths = speed_up_linears(model, runtime, scheme, device=device, dtype=dtype, tuning=tuning)
    # After the linears: the fused MLP computes gate/up through the group those paths gave it.
    fused = use_fused_ops(model.model, device=device, dtype=dtype) if runtime.fused_ops else FusedModules()
    if fused.attentions and settings.lora is None:  # then whole layers, where their products are tiled
        fused = dataclasses.replace(fused, layers=use_fused_layers(model.model))
        fused = dataclasses.replace(fused, decoder_loops=use_fused_decoder_loops(model.model))
    return LoadedModel(model, quantized, paths, fused)


def check_lora_layout(settings: Settings) -> None:
    """LoRA runs on one rank or over tensor-parallel shards; its adapters are not split over pipeline stages yet,
    and a shard cannot follow adapters loaded at run time (each rank reads the listed or resolved ones itself)."""
    runtime = settings.runtime
    problems = []
    if runtime.pipeline_parallel_size > 1:
        problems.append(
            ConfigProblem(
                "<run>",
                "runtime.pipeline_parallel_size",
                "LoRA adapters (the lora: section) are not split over pipeline stages; "
                f"runtime.pipeline_parallel_size is {runtime.pipeline_parallel_size}",
            )
        )
    if runtime.tensor_parallel_size > 1 and settings.lora is not None and settings.lora.allow_runtime_updates:
        problems.append(
            ConfigProblem(
                "<run>",
                "lora.allow_runtime_updates",
                "adapters loaded at run time reach rank 0 only; with runtime.tensor_parallel_size "
                f"{runtime.tensor_parallel_size} list them in lora.adapters or let lora.resolver find them",
            )
        )
    if problems:
        raise ConfigError(problems)


def rank_lora(
    model: HFCausalLM, settings: Settings, registry: Registry, *, device: torch.device, dtype: str, rank: int = 0
) -> LoRAManager | None:
    """Wrap ``rank``'s model for the ``lora:`` section (``None`` without one): on a tensor-parallel shard, each
    adapter keeps the shard's part of every projection."""
    if settings.lora is None:
        return None
    tensor_size = settings.runtime.tensor_parallel_size
    slices = (
        shard_layout(model.model.config, tensor_size).projection_slices(rank % tensor_size) if tensor_size > 1 else None
    )
    return install_lora(
        model,
        settings.lora,
        registry,
        device=device,
        dtype=torch_dtype(dtype),
        slices=slices,
        base_model=base_model_name(settings.model.path),
    )


def speed_up_linears(
    model: HFCausalLM,
    runtime: RuntimeSettings,
    quantization: str,
    *,
    device: torch.device,
    dtype: str,
    tuning: Tuning | None,
) -> tuple[int, LinearPaths]:
    """Apply the worker's integer tiles (``scheme``), ``runtime.fuse_projections`` and ``runtime.linear_kernel`` to
    the linears.

    Returns the number of quantized linears and the float paths applied.
    """
    quantized = 0
    if quantization != "none":
        if device.type != "cpu":
            raise ConfigError(
                [
                    ConfigProblem(
                        "<run>", "model.weight_format", f"{quantization} runs on the CPU; this run is on {device}"
                    )
                ]
            )
        reason = w8a8_tiles_unavailable() if quantization == "w8a8" else None
        if reason is not None:
            raise ConfigError(
                [ConfigProblem("<run>", "model.weight_format", f"w8a8 cannot run here: {reason} (use int8 or int4)")]
            )
        # Fused q/k/v and gate/up mean fewer, larger integer products: fuse for every step that runs them.
        if runtime.fuse_projections:
            fuse_shared_input_projections(model.model, max_rows=INT8_MAX_ROWS)
        if quantization == "int4" and int4_tiles_unavailable() is None:
            # int4 tiles run every step (no float copy), and as tiles they let decoder layers run fused.
            quantized = use_packed_linears(model.model, Int4TileLayout(torch.get_num_threads()))
        elif quantization == "w8a8":
            quantized = use_packed_linears(model.model, W8A8TileLayout(torch.get_num_threads()))
            use_w8a8_amx_from(tuning.w8a8_amx_from_rows if tuning is not None else 0)
        else:
            quantized = quantize_linears(model.model, quantization)
    if runtime.linear_kernel == "row_split" and not (device.type == "cpu" and dtype == "float32"):
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    "runtime.linear_kernel",
                    f"row_split runs on CPU float32 weights; this run has {device.type} {dtype} (use auto or torch)",
                )
            ]
        )
    if runtime.linear_kernel == "onednn" and not (device.type == "cpu" and packing_supported(getattr(torch, dtype))):
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    "runtime.linear_kernel",
                    f"onednn packs CPU float32 or bfloat16 weights with a torch built with oneDNN; this run has "
                    f"{device.type} {dtype}{'' if torch.backends.mkldnn.is_available() else ' and no oneDNN'}"
                    " (use auto or torch)",
                )
            ]
        )
    if runtime.linear_kernel == "tiles":
        reason = "it runs on the CPU" if device.type != "cpu" else tiles_unavailable(getattr(torch, dtype))
        if reason is not None:
            raise ConfigError(
                [
                    ConfigProblem(
                        "<run>",
                        "runtime.linear_kernel",
                        f"tiles cannot run this {device.type} {dtype} model: {reason} (use auto, onednn or torch)",
                    )
                ]
            )
    paths = apply_linear_paths(
        model.model,
        linear_kernel=runtime.linear_kernel,
        fuse_projections=runtime.fuse_projections,
        dtype=dtype,
        device=device,
        tuning=tuning,
    )
    return quantized, paths


@dataclass(frozen=True)
class RunnerSpec:
    """The choices rank 0 made that every rank's runner must share."""

    backend_name: str
    """The attention backend (``attention.name`` resolved when ``auto``)."""
    num_blocks: int
    max_num_reqs: int
    max_model_len: int
    max_num_batched_tokens: int
    single_thread_max_tokens: int = 0
    """Steps of at most this many tokens run on one CPU thread (``runtime.single_thread_max_tokens`` resolved)."""
    kv_connector: KVConnectorConfig | None = None
    """Rank 0's connector config (``None``: no ``kv_connector:``); each rank's worker side gets it for its shard."""


def rank_shard(runtime: RuntimeSettings, rank: int) -> KVShard:
    """The part of the model rank ``rank`` holds.

    Rank 3 with 2 tensor-parallel ranks per stage is shard 1 of stage 1.
    """
    return KVShard.of_rank(
        rank, tensor_parallel_size=runtime.tensor_parallel_size, pipeline_parallel_size=runtime.pipeline_parallel_size
    )


def kv_connector_worker(
    settings: Settings, registry: Registry, config: KVConnectorConfig, rank: int
) -> KVConnectorWorker:
    """Rank ``rank``'s worker side of the ``kv_connector:`` connector (rank 0 checked it serves the run),
    configured with the rank's shard (:meth:`KVConnectorConfig.with_shard`)."""
    section = settings.kv_connector
    assert section is not None, "a worker side needs a kv_connector section"
    # resolve() checks that each class implements its kind's interface.
    connector_class = cast("type[KVConnector]", registry.resolve("kv_connector", section.name))
    options = plugin_options(connector_class, section.options, where="kv_connector.options")
    connector = connector_class(options, config=config.with_shard(rank_shard(settings.runtime, rank)))
    return connector.worker_side()


def drafter_config(
    settings: Settings, model: HFCausalLM, *, device: torch.device, dtype: str, max_model_len: int
) -> DrafterConfig:
    """What the ``spec_decode:`` drafter is asked to serve (and is built with)."""
    assert settings.spec_decode is not None
    return DrafterConfig(
        device=device.type,
        dtype=dtype,
        num_speculative_tokens=settings.spec_decode.num_speculative_tokens,
        max_model_len=max_model_len,
        vocab_size=model.shape.vocab_size,
    )


def attention_parts(
    settings: Settings, registry: Registry, backend_name: str, groups: list[KVCacheGroup], device: torch.device
) -> tuple[AttentionBackend, list[Any]]:
    """The attention backend ``backend_name`` and a metadata builder per KV-cache group, as the settings ask."""
    # resolve() checks that each class implements its kind's interface.
    backend_class = cast("type[AttentionBackend]", registry.resolve("attention", backend_name))
    backend = backend_class(plugin_options(backend_class, settings.attention.options, where="attention.options"))
    chosen_builder = settings.attention.metadata_builder
    builder_name = chosen_builder.name if chosen_builder is not None else backend_class.metadata_builder
    builders = [
        create(
            registry,
            "attention_metadata_builder",
            builder_name,
            chosen_builder.options if chosen_builder is not None else {},
            "attention.metadata_builder.options",
            block_size=g.spec.block_size,
            sliding_window=g.spec.sliding_window,
            device=str(device),
        )
        for g in groups
    ]
    return backend, builders


@dataclass
class Drafting:
    """A loaded drafter and the rejection sampler that verifies its drafts."""

    drafter: Drafter
    verifier: RejectionSampler


def load_drafter(
    model: HFCausalLM,
    settings: Settings,
    registry: Registry,
    *,
    backend: AttentionBackend,
    metadata_builder: Any,
    num_blocks: int,
    max_model_len: int,
    device: torch.device,
    dtype: str,
) -> Drafting:
    """The ``spec_decode:`` drafter, loaded over ``model`` for a pool of ``num_blocks``, and its verifier."""
    spec_decode = settings.spec_decode
    assert spec_decode is not None
    drafter_class = cast("type[Drafter]", registry.resolve("drafter", spec_decode.name))
    drafter = drafter_class(
        plugin_options(drafter_class, spec_decode.options, where="spec_decode.options"),
        config=drafter_config(settings, model, device=device, dtype=dtype, max_model_len=max_model_len),
    )
    # A sampler of the verify role (rank 0 checked that it serves the run).
    verifier_choice = spec_decode.rejection_sampler
    verifier_class = cast("type[RejectionSampler]", registry.resolve("sampler", verifier_choice.name))
    drafter.load(
        DrafterContext(
            model=model.model,
            attention_backend=backend,
            metadata_builder=metadata_builder,
            block_size=settings.cache.block_size,
            num_blocks=num_blocks,
            device=device,
            dtype=torch_dtype(dtype),
        )
    )
    verifier_options = plugin_options(
        verifier_class, verifier_choice.options, where="spec_decode.rejection_sampler.options"
    )
    return Drafting(drafter, verifier_class(verifier_options))


def build_runner(
    model: HFCausalLM,
    settings: Settings,
    registry: Registry,
    spec: RunnerSpec,
    *,
    device: torch.device,
    dtype: str,
    kv_connector: KVConnectorWorker | None = None,
    kv_reports: RankTransferReports | None = None,
    grammars: GrammarCompilations | None = None,
    rank: int = 0,
    lora: LoRAManager | None = None,
    drafting: Drafting | None = None,
    pooling: StepPooling | None = None,
) -> ModelRunner:
    """The runner over ``model`` (``rank``'s part of it) with the plugins the settings name (already checked by
    rank 0); only the last pipeline stage's runners sample.

    ``kv_reports``: with several ranks, how the connector's reports are joined with the other ranks'.
    ``drafting``: the drafter :func:`load_drafter` loaded before the pool was sized (its cache is resized to
    the pool here); ``None``: loaded here, for the pool's size, when the settings ask for one.
    ``pooling``: a pooling run's pooler, which the runner calls instead of sampling.
    """
    groups = kv_cache_groups(model, settings.cache.block_size, cache_dtype(settings.cache.dtype, dtype))
    backend, builders = attention_parts(settings, registry, spec.backend_name, groups, device)
    sampler = create(registry, "sampler", settings.sampler.name, settings.sampler.options, "sampler.options")
    spec_decode = settings.spec_decode
    if drafting is not None:
        drafting.drafter.resize_kv_cache(spec.num_blocks)
    elif spec_decode is not None:
        drafting = load_drafter(
            model,
            settings,
            registry,
            backend=backend,
            metadata_builder=builders[0],
            num_blocks=spec.num_blocks,
            max_model_len=spec.max_model_len,
            device=device,
            dtype=dtype,
        )
    drafter = drafting.drafter if drafting is not None else None
    verifier = drafting.verifier if drafting is not None else None
    return ModelRunner(
        model,
        backend=backend,
        builders=builders,
        sampler=sampler,
        groups=groups,
        num_blocks=spec.num_blocks,
        max_num_reqs=spec.max_num_reqs,
        max_model_len=spec.max_model_len,
        max_num_batched_tokens=spec.max_num_batched_tokens,
        device=device,
        eos_token_ids=model.shape.eos_token_ids,
        drafter=drafter,
        drafter_name=f"drafter:{spec_decode.name}" if spec_decode else "",
        sampler_name=f"sampler:{settings.sampler.name}",
        rejection_sampler=verifier,
        num_speculative_tokens=spec_decode.num_speculative_tokens if spec_decode else 0,
        kv_connector=kv_connector,
        kv_reports=kv_reports,
        grammars=grammars,
        single_thread_max_tokens=spec.single_thread_max_tokens,
        samples=samples_on(rank, settings.runtime.pipeline_parallel_size, settings.runtime.tensor_parallel_size),
        lora=lora,
        pooling=pooling,
    )


def kv_cache_groups(model: HFCausalLM, block_size: int, dtype: str) -> list[KVCacheGroup]:
    """The KV-cache groups of ``model``'s layers; an encoder-only model, whose layers keep no cache, gets one group
    of no layers: the scheduler still counts blocks per request, which no memory backs."""
    groups = group_layers(model.kv_cache_specs(block_size, dtype))
    if groups:
        return groups
    spec = next(iter(model.layer_specs.values()))
    return [KVCacheGroup(KVCacheSpec(block_size, spec.num_kv_heads, spec.head_size, dtype))]
