"""Building an engine's parts from settings, and checking them against each other before the first step.

In order: the process (threads, allocator, seed), the device, the CPU's
tuning and the dtype; the other ranks (tensor-parallel shards or pipeline
stages) when the run has several; then rank 0's model, the attention backend
and sampler chosen and checked, the KV pool sized and checked against free
memory, the drafter and KV connector checked, and the KV cache manager,
grammars, scheduler and model runner built.  :func:`build_engine_parts`
returns them as :class:`EngineParts`; :class:`patchbay.engine.engine.Engine`
steps them.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from patchbay.contract.registry import Registry
from patchbay.contract.selection import create, require_serves, select_attention_backend
from patchbay.contract.settings import ConfigError, ConfigProblem, Settings, plugin_options
from patchbay.engine.admission import AdmissionLimits, effective_max_logprobs
from patchbay.engine.kv_sizing import KVSizing, memory_in_use, size_kv_pool
from patchbay.engine.memory_check import check_fits, format_bytes
from patchbay.engine.model_identity import weights_fingerprint
from patchbay.engine.ranks import ParallelRanks, check_parallel
from patchbay.engine.structured_output import grammar_compilations
from patchbay.interfaces import (
    AttentionBackend,
    AttentionConfig,
    KVConnector,
    KVConnectorConfig,
    SamplerCapabilities,
    SamplerConfig,
    SamplingMetadata,
    SpecDecodeMetadata,
)
from patchbay.scheduling.kv_cache_manager import KVCacheManager, num_blocks_for_memory
from patchbay.scheduling.kv_cache_spec import KVCacheGroup, cache_dtype, group_layers
from patchbay.scheduling.scheduler import Scheduler
from patchbay.scheduling.structured_output import GrammarCompilations
from patchbay.worker.parallel import distributed
from patchbay.worker.cpu.fused_ops import FusedModules
from patchbay.worker.cpu.heap import set_up_heap
from patchbay.worker.cpu.quantization import rounds_activations_to_int8
from patchbay.worker.lora.manager import LoRAManager
from patchbay.worker.model.hf_model import HFCausalLM, torch_dtype
from patchbay.worker.parallel.kv_transfers import RankTransferReports
from patchbay.worker.memory_profile import PeakUnmeasurable, step_activation_bytes
from patchbay.worker.model.model_loader import resolve_model_dir
from patchbay.worker.model_runner import ModelRunner
from patchbay.worker.parallel.pipeline_parallel import stage_layout
from patchbay.worker.runner_build import (
    check_lora_layout,
    Drafting,
    RunnerSpec,
    attention_parts,
    build_runner,
    drafter_config,
    load_drafter,
    load_rank_model,
    rank_lora,
    rank_shard,
    shards_vocabulary,
)
from patchbay.worker.parallel.tensor_parallel import shard_layout
from patchbay.worker.parallel.torchrun import torchrun_launch
from patchbay.worker.cpu.tuning import LayerShapes, LinearPaths, Tuning, tune

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>", "runtime.device", f"{name!r} is not a device (auto, cpu, cuda, cuda:1, ...): {exc}"
                )
            ]
        ) from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError([ConfigProblem("<run>", "runtime.device", f"{name!r}: patchbay runs on cpu or cuda")])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError([ConfigProblem("<run>", "runtime.device", f"{name!r} requested but CUDA is not available")])
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>", "runtime.device", f"{name!r}: this machine has {torch.cuda.device_count()} CUDA devices"
                )
            ]
        )
    return device


def resolve_dtype(name: str, device: torch.device, tuning: Tuning | None, integer_products: bool = False) -> str:
    """``auto`` is bfloat16 on GPUs; on a CPU, what its tuning measured fastest among its native dtypes, except
    that with ``integer_products`` (every product runs integer tiles that round activations to int8 themselves,
    so their speed does not depend on the dtype) a CPU that computes bfloat16 natively gets bfloat16: the KV
    cache, the attention and the ops between products then read half float32's bytes."""
    if name != "auto":
        return name
    if device.type != "cpu":
        return "bfloat16"
    if tuning is None:
        return "float32"
    if integer_products and "bfloat16" in tuning.native_dtypes:
        return "bfloat16"
    return tuning.dtype


def ranks_on_this_machine(settings: Settings) -> int:
    """The run's ranks whose memory this machine holds: all of them, or torchrun's ``LOCAL_WORLD_SIZE``."""
    launch = torchrun_launch()
    return launch.local_world_size if launch is not None else settings.runtime.world_size


def single_thread_max_tokens(setting: int | str, dtype: str, tuning: Tuning | None) -> int:
    """``runtime.single_thread_max_tokens`` resolved: ``auto`` is the tuning's limit for ``dtype`` (0 without one)."""
    if setting != "auto":
        return int(setting)
    return tuning.single_thread_max_tokens.get(dtype, 0) if tuning is not None else 0


def machine_tuning(settings: Settings, model_dir: Path, device: torch.device) -> Tuning | None:
    """The CPU's measured defaults (cached per machine and model shape) when a setting is left to them."""
    runtime = settings.runtime
    if device.type != "cpu" or not (
        settings.model.dtype == "auto"
        or runtime.linear_kernel == "auto"
        or runtime.fuse_projections
        or runtime.single_thread_max_tokens == "auto"
    ):
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    return tune(LayerShapes.of(getattr(config, "text_config", config)))


def measure_machine_defaults(settings: Settings, fresh: bool = True) -> Tuning:
    """``patchbay tune``: measure this CPU's defaults for the settings' model now, replacing the cached ones
    (``fresh=False``: only where none are cached)."""
    from transformers import AutoConfig

    if settings.runtime.threads is not None:
        torch.set_num_threads(settings.runtime.threads)
    config = AutoConfig.from_pretrained(resolve_model_dir(settings.model.path))
    return tune(LayerShapes.of(getattr(config, "text_config", config)), fresh=fresh)


def pipeline_depth(settings: Settings) -> int:
    """Batches in flight at once: one per pipeline stage; 1 with one stage, or with a KV connector (every rank
    joins its transfer reports with the others' after each batch, so the stages go in lockstep)."""
    return settings.runtime.pipeline_parallel_size if settings.kv_connector is None else 1


@dataclass
class EngineParts:
    """Everything an engine steps, built from settings by :func:`build_engine_parts` and checked to fit together."""

    device: torch.device
    dtype: str
    """``model.dtype`` resolved (``auto``: see :func:`resolve_dtype`)."""
    tuning: Tuning | None
    """The CPU's measured defaults, when a setting is left to them (``None``: none were needed)."""
    heap: str
    """What was done to the allocator (for the run summary)."""
    model_dir: Path
    tokenizer: Any
    ranks: ParallelRanks | None
    """The other ranks: tensor-parallel shards or pipeline stages (``None``: this process runs the whole model)."""
    model: HFCausalLM
    quantized_linears: int
    linear_paths: LinearPaths
    fused_modules: FusedModules
    max_model_len: int
    groups: list[KVCacheGroup]
    backend_name: str
    num_blocks: int
    kv_sizing: KVSizing | None
    """How ``cache.memory: auto`` sized the KV pool (``None``: sized by ``cache.memory`` or ``num_blocks``)."""
    kv_connector: KVConnector | None
    kv_cache_manager: KVCacheManager
    grammars: GrammarCompilations
    scheduler: Scheduler
    runner: ModelRunner
    single_thread_max_tokens: int
    limits: AdmissionLimits
    lora: LoRAManager | None
    """The LoRA adapter slots (``None``: no ``lora:`` section, so requests naming an adapter are refused)."""


def build_engine_parts(settings: Settings, registry: Registry) -> EngineParts:
    """Build the run's parts (starting the other ranks when it has several); a :class:`ConfigError` names the
    setting a part cannot serve.  A failure after the ranks started ends them."""
    from transformers import AutoTokenizer

    import patchbay

    if patchbay.OMP_POLICY_TOO_LATE:
        logger.warning(
            "torch was imported before patchbay, so OpenMP threads busy-wait; with another busy "
            "process on the machine steps can be ~10x slower. Import patchbay first or set "
            "OMP_WAIT_POLICY=PASSIVE before starting Python."
        )
    threads = distributed.rank_threads(settings)
    if threads is not None:
        torch.set_num_threads(threads)
    heap = set_up_heap(settings.runtime.cpu_allocator)
    torch.manual_seed(settings.runtime.seed)
    device = resolve_device(settings.runtime.device)
    model_dir = resolve_model_dir(settings.model.path)
    tuning = machine_tuning(settings, model_dir, device)
    integer_products = device.type == "cpu" and rounds_activations_to_int8(settings.model.quantization)
    dtype = resolve_dtype(settings.model.dtype, device, tuning, integer_products)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ranks = _start_ranks(settings, model_dir, device, dtype, tuning)
    try:
        return _RankZeroBuild(
            settings,
            registry,
            device=device,
            dtype=dtype,
            tuning=tuning,
            heap=heap,
            model_dir=model_dir,
            tokenizer=tokenizer,
            ranks=ranks,
        ).build()
    except BaseException:
        if ranks is not None:
            ranks.close()
        raise


def _start_ranks(
    settings: Settings, model_dir: Path, device: torch.device, dtype: str, tuning: Tuning | None
) -> ParallelRanks | None:
    """Check the parallel layout and start the other ranks; ``None`` when this process runs the whole model."""
    if settings.runtime.world_size == 1:
        return None
    from transformers import AutoConfig

    check_parallel(settings, device)
    if settings.lora is not None:
        check_lora_layout(settings)
    config = AutoConfig.from_pretrained(model_dir)
    if settings.runtime.tensor_parallel_size > 1:
        shard_layout(config, settings.runtime.tensor_parallel_size)
    if settings.runtime.pipeline_parallel_size > 1:
        stage_layout(config, settings.runtime.pipeline_parallel_size, settings.runtime.pipeline_layer_partition)
    return ParallelRanks(settings, model_dir, device=device, dtype=dtype, tuning=tuning)


class _RankZeroBuild:
    """Rank 0's model, KV cache, plugins, scheduler and runner, built in order (each step reads the earlier ones)."""

    def __init__(
        self,
        settings: Settings,
        registry: Registry,
        *,
        device: torch.device,
        dtype: str,
        tuning: Tuning | None,
        heap: str,
        model_dir: Path,
        tokenizer: Any,
        ranks: ParallelRanks | None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.device = device
        self.dtype = dtype
        self.tuning = tuning
        self.heap = heap
        self.model_dir = model_dir
        self.tokenizer = tokenizer
        self.ranks = ranks
        group = ranks.group if ranks is not None else None
        self.collectives = distributed.PausableCollectives(group) if group is not None else None
        """Rank 0's collectives, paused while it measures a step alone (``cache.memory: auto``)."""
        self.kv_sizing: KVSizing | None = None
        self.drafting: Drafting | None = None
        """The ``speculative:`` drafter, loaded before the pool is sized so that the sizing counts it."""

    def build(self) -> EngineParts:
        settings, registry, collectives = self.settings, self.registry, self.collectives
        self.held_before_load = memory_in_use(self.device)
        loaded = load_rank_model(
            settings,
            self.model_dir,
            dtype=self.dtype,
            device=self.device,
            tuning=self.tuning,
            all_reduce=collectives.all_reduce if collectives else None,
            all_gather=collectives.all_gather if collectives else None,
            link=collectives,
            shard_vocabulary=shards_vocabulary(settings, registry),
        )
        self.model = loaded.model
        if self.model.vision is not None and self.ranks is not None:
            raise ConfigError(
                [
                    ConfigProblem(
                        "<run>",
                        "runtime.tensor_parallel_size",
                        f"{self.model.shape.architecture} is a vision-language model: it runs in one process "
                        "(its vision tower is not sharded or staged yet); use one rank",
                    )
                ]
            )
        self.lora = rank_lora(self.model, settings, registry, device=self.device, dtype=self.dtype)
        shape = self.model.shape
        self.max_model_len = min(settings.model.max_model_len or 1 << 62, shape.max_position_embeddings or 1 << 62)
        if self.max_model_len >= 1 << 62:
            raise ConfigError(
                [
                    ConfigProblem(
                        "<run>",
                        "model.max_model_len",
                        f"{shape.architecture} declares no length limit; set model.max_model_len",
                    )
                ]
            )

        block_size = settings.cache.block_size
        self.groups = group_layers(self.model.kv_cache_specs(block_size, cache_dtype(settings.cache.dtype, self.dtype)))
        backend_name, backend_class = select_attention_backend(
            registry, settings.attention.backend, [self._attention_config(g) for g in self.groups]
        )
        sampler_class = registry.resolve("sampler", settings.sampler.name)
        require_serves(
            sampler_class,
            f"sampler:{settings.sampler.name}",
            "sampler.name",
            [SamplerConfig(device=self.device.type, dtype=self.dtype)],
        )

        self._check_speculative()
        self.drafting = self._load_drafter(backend_name)
        num_blocks = self._num_blocks()
        max_num_reqs, max_step_tokens = self._check_memory(num_blocks)
        num_speculative_tokens = settings.speculative.num_speculative_tokens if settings.speculative else 0
        kv_connector = self._kv_connector(backend_class)
        kv_cache_manager = KVCacheManager(self.groups, num_blocks, settings.cache.prefix_caching)
        grammars = grammar_compilations(
            settings,
            registry,
            device=self.device.type,
            dtype=self.dtype,
            tokenizer=self.tokenizer,
            vocab_size=shape.vocab_size,
            stop_token_ids=shape.eos_token_ids,
        )
        scheduler = Scheduler(
            kv_cache_manager,
            max_num_seqs=settings.scheduler.max_num_seqs,
            max_num_batched_tokens=settings.scheduler.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=block_size,
            chunked_prefill=settings.scheduler.chunked_prefill,
            num_speculative_tokens=num_speculative_tokens,
            kv_connector=kv_connector.scheduler_side() if kv_connector is not None else None,
            kv_connector_role=settings.kv_connector.role if settings.kv_connector is not None else "both",
            grammars=grammars,
            max_batches_in_flight=pipeline_depth(settings),
            pipelined=settings.runtime.pipeline_parallel_size > 1,
            max_loras=settings.lora.max_loras if settings.lora is not None else None,
            max_num_encoder_input_tokens=settings.scheduler.max_num_encoder_input_tokens,
            encoder_cache_size=settings.scheduler.encoder_cache_size,
        )
        spec = RunnerSpec(
            backend_name,
            num_blocks,
            max_num_reqs,
            self.max_model_len,
            max_step_tokens,
            single_thread_max_tokens(settings.runtime.single_thread_max_tokens, self.dtype, self.tuning),
            kv_connector=kv_connector.config if kv_connector is not None else None,
        )
        kv_reports = None
        if kv_connector is not None and self.ranks is not None:
            assert self.ranks.group is not None
            kv_reports = RankTransferReports(self.ranks.group, settings.runtime.world_size)
        runner = build_runner(
            self.model,
            settings,
            registry,
            spec,
            device=self.device,
            dtype=self.dtype,
            kv_connector=kv_connector.worker_side() if kv_connector is not None else None,
            kv_reports=kv_reports,
            grammars=grammars,
            lora=self.lora,
            drafting=self.drafting,
        )
        if self.ranks is not None:
            self.ranks.start_runners(spec)
        torch.manual_seed(settings.runtime.seed)  # every rank's samplers start here alike, whatever loading drew
        logger.info(
            "model %s (%s, %s on %s), attention backend %s, %d KV blocks of %d tokens",
            shape.architecture,
            self.model_dir,
            self.dtype,
            self.device,
            backend_name,
            num_blocks,
            block_size,
        )
        return EngineParts(
            device=self.device,
            dtype=self.dtype,
            tuning=self.tuning,
            heap=self.heap,
            model_dir=self.model_dir,
            tokenizer=self.tokenizer,
            ranks=self.ranks,
            model=self.model,
            quantized_linears=loaded.quantized_linears,
            linear_paths=loaded.linear_paths,
            fused_modules=loaded.fused_modules,
            max_model_len=self.max_model_len,
            groups=self.groups,
            backend_name=backend_name,
            num_blocks=num_blocks,
            kv_sizing=self.kv_sizing,
            kv_connector=kv_connector,
            kv_cache_manager=kv_cache_manager,
            grammars=grammars,
            scheduler=scheduler,
            runner=runner,
            single_thread_max_tokens=spec.single_thread_max_tokens,
            limits=AdmissionLimits(
                shape.vocab_size,
                self.max_model_len,
                effective_max_logprobs(settings.model.max_logprobs, shape.vocab_size),
                max_n=settings.scheduler.max_n,
            ),
            lora=self.lora,
        )

    def _attention_config(self, group: KVCacheGroup) -> AttentionConfig:
        spec = group.spec
        any_layer = next(s for s in self.model.layer_specs.values() if s.layer_name == group.layer_names[0])
        return AttentionConfig(
            device=self.device.type,
            dtype=self.dtype,
            head_size=spec.head_size,
            num_heads=any_layer.num_heads,
            num_kv_heads=spec.num_kv_heads,
            block_size=spec.block_size,
            sliding_window=spec.sliding_window,
            logits_soft_cap=any_layer.logits_soft_cap,
            cache_dtype=spec.dtype if spec.dtype != self.dtype else None,
        )

    def _check_speculative(self) -> None:
        """Check that the drafter and rejection sampler of ``speculative:`` serve this run (the runner builds them)."""
        spec = self.settings.speculative
        if spec is None:
            return
        config = drafter_config(
            self.settings, self.model, device=self.device, dtype=self.dtype, max_model_len=self.max_model_len
        )
        require_serves(
            self.registry.resolve("drafter", spec.method), f"drafter:{spec.method}", "speculative.method", [config]
        )
        require_serves(
            self.registry.resolve("sampler", spec.rejection_sampler),
            f"sampler:{spec.rejection_sampler}",
            "speculative.rejection_sampler",
            [SamplerConfig(device=self.device.type, dtype=self.dtype, role="verify")],
        )

    def _kv_connector(self, backend: type[AttentionBackend]) -> KVConnector | None:
        """The connector of ``kv_connector:``, checked against the run; ``None`` without that section."""
        section = self.settings.kv_connector
        if section is None:
            return None
        if len(self.groups) != 1:
            raise ConfigError(
                [
                    ConfigProblem(
                        "<run>",
                        "kv_connector",
                        f"KV connectors support models with one KV-cache group; this model has {len(self.groups)} "
                        f"(layers with different sliding windows or shapes); remove the kv_connector section",
                    )
                ]
            )
        # Rank 0's shard: its scheduler side answers for every rank, its worker side saves and loads rank 0's part.
        config = KVConnectorConfig(
            device=self.device.type,
            dtype=self.dtype,
            role=section.role,
            block_size=self.settings.cache.block_size,
            model_id=self._model_id(backend),
            shard=rank_shard(self.settings.runtime, 0),
        )
        connector_class = self.registry.resolve("kv_connector", section.name)
        require_serves(connector_class, f"kv_connector:{section.name}", "kv_connector.name", [config])
        options = plugin_options(connector_class, section.options, where="kv_connector.options")
        return connector_class(options, config=config)  # type: ignore[call-arg,return-value]

    def _model_id(self, backend: type[AttentionBackend]) -> str:
        """What KV blocks depend on: model (directory name, config and weights), dtype and block layout.

        e.g. ``SmolLM2-135M-3f2a9c1d0e4b5a67-float32-2x1x16x3x64`` (the hash covers
        config.json and a fingerprint of the weight files; the layout is the backend's
        cache shape of one block: keys/values, block, tokens, KV heads, head size).
        """
        config_bytes = (
            (self.model_dir / "config.json").read_bytes()
            if (self.model_dir / "config.json").exists()
            else str(self.model_dir).encode()
        )
        identity = hashlib.sha256(config_bytes)
        identity.update(weights_fingerprint(self.model_dir).encode())
        spec = self.groups[0].spec
        layout = "x".join(str(d) for d in backend.kv_cache_shape(1, spec.block_size, spec.num_kv_heads, spec.row_size))
        return f"{self.model_dir.name}-{identity.hexdigest()[:16]}-{spec.dtype}-{layout}"

    def _load_drafter(self, backend_name: str) -> Drafting | None:
        """The ``speculative:`` drafter, loaded now, over a provisional pool of one block: what it loads is then
        held when the pool is sized; its cache is resized to the pool when the runner is built."""
        if self.settings.speculative is None:
            return None
        backend, builders = attention_parts(self.settings, self.registry, backend_name, self.groups, self.device)
        return load_drafter(
            self.model,
            self.settings,
            self.registry,
            backend=backend,
            metadata_builder=builders[0],
            num_blocks=1,
            max_model_len=self.max_model_len,
            device=self.device,
            dtype=self.dtype,
        )

    @property
    def _num_speculative_tokens(self) -> int:
        return self.settings.speculative.num_speculative_tokens if self.settings.speculative is not None else 0

    def _warm_up_samplers(self, logits: torch.Tensor) -> None:
        """Sample ``logits`` with the run's sampler, and verify drafts over them with its rejection sampler, the
        costliest way each serves (random rows with top-k and top-p: a full sort per row), so that the step's
        measured peak holds their working memory."""
        settings = self.settings
        sampler = create(self.registry, "sampler", settings.sampler.name, settings.sampler.options, "sampler.options")
        sampler.sample(logits, _costliest_sampling(type(sampler).capabilities, logits.shape[0], logits.device))
        if self.drafting is None:
            return
        # Requests of k drafts and a bonus row each: [d, d, ..., d, bonus] per request.
        per_request = 1 + self._num_speculative_tokens
        num_requests = logits.shape[0] // per_request
        if num_requests == 0:
            return
        device = logits.device
        rows = torch.arange(num_requests * per_request, device=device).view(num_requests, per_request)
        num_drafts = [per_request - 1] * num_requests
        target = rows[:, :-1].reshape(-1)
        verifier = self.drafting.verifier
        verifier.verify(
            SpecDecodeMetadata(
                draft_token_ids=torch.zeros(len(target), dtype=torch.long, device=device),
                num_draft_tokens=num_drafts,
                cu_num_draft_tokens=torch.cumsum(torch.tensor(num_drafts, device=device), 0),
                target_logits_indices=target,
                bonus_logits_indices=rows[:, -1],
                logits_indices=rows.reshape(-1),
            ),
            None,
            logits[target],
            torch.zeros(num_requests, 1, dtype=torch.long, device=device),
            _costliest_sampling(type(verifier).capabilities, num_requests, device),
        )

    @property
    def drafter_bytes_per_block(self) -> int:
        """What the drafter's own KV cache adds per block of the pool (0 without one)."""
        return self.drafting.drafter.kv_cache_bytes_per_block() if self.drafting is not None else 0

    def _num_blocks(self) -> int:
        cache = self.settings.cache
        if cache.num_blocks is not None:
            return cache.num_blocks
        if cache.memory != "auto":
            return num_blocks_for_memory(self.groups, int(cache.memory))
        scheduler = self.settings.scheduler
        step_tokens = min(scheduler.max_num_batched_tokens, self.max_model_len)
        try:
            # The other ranks are not stepping: rank 0 measures its shard (or stage) alone.
            with self.collectives.paused() if self.collectives else contextlib.nullcontext():
                activations = step_activation_bytes(
                    self.model,
                    num_tokens=step_tokens,
                    num_rows=scheduler.max_num_seqs * (1 + self._num_speculative_tokens),  # a logits row per draft
                    device=self.device,
                    sample=self._warm_up_samplers,
                )
        except PeakUnmeasurable as exc:
            raise ConfigError(
                [
                    ConfigProblem(
                        "<run>",
                        "cache.memory",
                        f"auto measures a step's peak memory, and {exc}; "
                        "give cache.memory (e.g. 2GiB) or cache.num_blocks",
                    )
                ]
            ) from exc
        self.kv_sizing = size_kv_pool(
            self.settings,
            self.groups,
            device=self.device,
            max_model_len=self.max_model_len,
            activation_bytes=activations,
            step_tokens=step_tokens,
            held_before_load=self.held_before_load,
            ranks=ranks_on_this_machine(self.settings),
            encoder_cache_bytes=self._encoder_cache_bytes(),
            drafter_bytes_per_block=self.drafter_bytes_per_block,
        )
        logger.info("KV cache (cache.memory auto): %s", self.kv_sizing.describe())
        return self.kv_sizing.num_blocks

    def _check_memory(self, num_blocks: int) -> tuple[int, int]:
        """Check the KV pool and the batch buffers fit in free memory; the runner's row and step-token sizes.

        The buffers are sized by what the run can use, not by the raw
        settings: every running request holds at least one block and every
        scheduled token a slot, so ``max_num_seqs`` beyond the pool's blocks
        and a token budget beyond its slots would only be memory never touched.
        """
        settings = self.settings
        # Every rank allocates its own cache and batch; on the CPU they all share this machine's memory.
        host_ranks = settings.runtime.world_size
        device_ranks = host_ranks if self.device.type == "cpu" else 1
        each = f", on each of {host_ranks} ranks" if host_ranks > 1 else ""
        usable_blocks = max(1, num_blocks - 1)  # block 0 is the null block
        max_num_reqs = min(settings.scheduler.max_num_seqs, usable_blocks)
        max_step_tokens = min(settings.scheduler.max_num_batched_tokens, usable_blocks * settings.cache.block_size)
        bytes_per_block = sum(len(group.layer_names) * group.spec.page_size_bytes for group in self.groups)
        kv_key = "cache.num_blocks" if settings.cache.num_blocks is not None else "cache.memory"
        drafter = self.drafter_bytes_per_block
        kv = (
            kv_key,
            f"the KV cache ({num_blocks} blocks of {format_bytes(bytes_per_block)}"
            + (f", and {format_bytes(drafter)} each in the drafter's own cache" if drafter else "")
            + f"{each})",
            device_ranks * num_blocks * (bytes_per_block + drafter),
        )
        blocks_per_row = -(-self.max_model_len // settings.cache.block_size) * len(self.groups)
        row_bytes = 4 * ((self.max_model_len + 1) + blocks_per_row)  # int32 token ids and block tables
        batch = (
            "scheduler.max_num_seqs",
            f"the persistent batch ({max_num_reqs} rows of {self.max_model_len} tokens{each})",
            host_ranks * max_num_reqs * row_bytes,
        )
        needs = [kv]
        if self.model.vision is not None:
            needs.append(
                (
                    "scheduler.encoder_cache_size",
                    f"the encoder cache ({settings.scheduler.encoder_cache_size} image tokens)",
                    self._encoder_cache_bytes(),
                )
            )
        if self.device.type == "cpu":
            check_fits([*needs, batch], self.device)
        else:
            check_fits(needs, self.device)
            check_fits([batch], torch.device("cpu"))
        return max_num_reqs, max_step_tokens

    def _encoder_cache_bytes(self) -> int:
        """The encoder cache full (``scheduler.encoder_cache_size`` rows of the hidden size); 0 for a text model."""
        if self.model.vision is None:
            return 0
        element = torch.tensor([], dtype=torch_dtype(self.dtype)).element_size()
        return self.settings.scheduler.encoder_cache_size * self.model.shape.hidden_size * element


def _costliest_sampling(capabilities: SamplerCapabilities, rows: int, device: torch.device) -> SamplingMetadata:
    """Sampling metadata of ``rows`` rows that a sampler of ``capabilities`` serves at its most expensive: random
    rows with top-k and top-p where it supports them, greedy rows otherwise."""
    random = capabilities.supports_random

    def column(value: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device=device)

    used = capabilities.supported_params
    return SamplingMetadata(
        temperature=column(1.0 if random else 0.0, torch.float32),
        all_greedy=not random,
        all_random=random,
        top_k=column(50, torch.int64) if random and "top_k" in used else None,
        top_p=column(0.9, torch.float32) if random and "top_p" in used else None,
    )
