"""Rank 0's build: its part of the model, the plugins chosen and checked against it, the KV pool sized and
checked against free memory, then the KV cache manager, grammars, scheduler and model runner, step by step
(:meth:`RankZeroBuild.build`)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
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
from patchbay.engine.parts import EngineParts, pipeline_depth, ranks_on_this_machine, single_thread_max_tokens
from patchbay.engine.pooling import PoolingRun, check_pooling_settings, choose_pooler, max_seq_length
from patchbay.engine.ranks import ParallelRanks
from patchbay.engine.structured_output import grammar_compilations
from patchbay.interfaces import (
    AttentionBackend,
    AttentionConfig,
    KVConnector,
    KVConnectorConfig,
    Pooler,
    PoolerConfig,
    SamplerCapabilities,
    SamplerConfig,
    SamplingMetadata,
    SpecDecodeMetadata,
)
from patchbay.scheduling.kv_cache_manager import KVCacheManager, num_blocks_for_memory
from patchbay.scheduling.kv_cache_spec import KVCacheGroup, cache_dtype, kv_bytes_per_token
from patchbay.scheduling.scheduler import Scheduler
from patchbay.scheduling.structured_output import GrammarCompilations
from patchbay.worker.cpu.tuning import Tuning
from patchbay.worker.memory_profile import PeakUnmeasurable, step_activation_bytes
from patchbay.worker.model.hf_model import torch_dtype
from patchbay.worker.model.pooling import HFPoolingModel
from patchbay.worker.model_runner import ModelRunner
from patchbay.worker.parallel import distributed
from patchbay.worker.parallel.kv_transfers import RankTransferReports
from patchbay.worker.pooling import StepPooling
from patchbay.worker.runner_build import (
    Drafting,
    LoadedModel,
    RunnerSpec,
    attention_parts,
    build_runner,
    drafter_config,
    kv_cache_groups,
    load_drafter,
    load_rank_model,
    rank_lora,
    rank_shard,
    shards_vocabulary,
)

logger = logging.getLogger(__name__)


class RankZeroBuild:
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
        """The ``spec_decode:`` drafter, loaded before the pool is sized so that the sizing counts it."""
        self.pooling: StepPooling | None = None
        """A pooling run's pooler, called by the runner instead of a sampler (``None``: the run generates)."""
        self.pooling_run: PoolingRun | None = None

    def build(self) -> EngineParts:
        """Every part, step by step: each step reads what the earlier ones left on ``self``."""
        check_pooling_settings(self.settings)
        loaded = self.load_model()
        backend_name, backend_class = self.choose_attention_backend_and_sampler()
        self.choose_pooler()
        self._check_spec_decode()
        self.drafting = self._load_drafter(backend_name)
        num_blocks = self._num_blocks()
        max_num_reqs, max_step_tokens = self._check_memory(num_blocks)
        kv_connector = self._kv_connector(backend_class)
        # An encoder-only model keeps no cache: nothing to share between prompts.
        kv_cache_manager = KVCacheManager(
            self.groups,
            num_blocks,
            self.settings.cache.prefix_caching and self.causal,
            enable_kv_events=self.settings.kv_events.enable_kv_cache_events,
        )
        grammars = grammar_compilations(
            self.settings,
            self.registry,
            device=self.device.type,
            dtype=self.dtype,
            tokenizer=self.tokenizer,
            vocab_size=self.model.shape.vocab_size,
            stop_token_ids=self.model.shape.eos_token_ids,
        )
        scheduler = self.build_scheduler(kv_cache_manager, kv_connector, grammars)
        spec = RunnerSpec(
            backend_name,
            num_blocks,
            max_num_reqs,
            self.max_model_len,
            max_step_tokens,
            single_thread_max_tokens(self.settings.runtime.single_thread_max_tokens, self.dtype, self.tuning),
            kv_connector=kv_connector.config if kv_connector is not None else None,
        )
        runner = self.build_runner(spec, kv_connector, grammars)
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
                self.model.shape.vocab_size,
                self.max_model_len,
                effective_max_logprobs(self.settings.model.max_logprobs, self.model.shape.vocab_size),
                max_n=self.settings.scheduler.max_n,
            ),
            lora=self.lora,
            pooling=self.pooling_run,
        )

    @property
    def causal(self) -> bool:
        """Whether the model attends causally (every generating model does; an encoder-only one keeps no KV cache)."""
        return getattr(self.model, "causal", True)

    def choose_pooler(self) -> None:
        """A pooling run's pooler (``pooling.name``, or ``auto`` read from the model's files), checked against the
        model and built; nothing for a generating run."""
        if self.settings.pooling is None:
            return
        model = self.model
        assert isinstance(model, HFPoolingModel), "a pooling run loads its model to pool"
        choice = choose_pooler(self.settings, self.model_dir, model.shape.architecture, model.num_labels)
        pooler_class = self.registry.resolve("pooler", choice.name)
        task = pooler_class.capabilities.tasks[0]  # type: ignore[attr-defined]  # resolve() checked the kind
        config = PoolerConfig(
            device=self.device.type,
            dtype=self.dtype,
            task=task,
            hidden_size=model.shape.hidden_size,
            causal=model.causal,
            num_labels=model.num_labels,
        )
        require_serves(pooler_class, f"pooler:{choice.name}", "pooling.name", [config])
        pooler = create(self.registry, "pooler", choice.name, choice.options, "pooling.options", config=config)
        assert isinstance(pooler, Pooler)
        self.pooling = StepPooling(pooler, model.head, f"pooler:{choice.name}")
        self.pooling_run = PoolingRun(
            task=task,
            pooler_name=choice.name,
            hidden_size=model.shape.hidden_size,
            whole_prompt=pooler.positions != "last",
            type_vocab_size=model.type_vocab_size,
        )
        logger.info("pooling with pooler:%s for %s (from %s)", choice.name, task, choice.source)

    def load_model(self) -> LoadedModel:
        """Rank 0's part of the model with its linears' paths, its LoRA slots, ``max_model_len`` and the KV-cache
        groups of its layers."""
        settings, collectives = self.settings, self.collectives
        self.held_before_load = memory_in_use(self.device)
        loaded = load_rank_model(
            settings,
            self.registry,
            self.model_dir,
            dtype=self.dtype,
            device=self.device,
            tuning=self.tuning,
            all_reduce=collectives.all_reduce if collectives else None,
            all_gather=collectives.all_gather if collectives else None,
            link=collectives,
            shard_vocabulary=shards_vocabulary(settings, self.registry),
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
        self.lora = rank_lora(self.model, settings, self.registry, device=self.device, dtype=self.dtype)
        shape = self.model.shape
        self.max_model_len = min(
            settings.model.max_model_len or 1 << 62, self._position_limit() or 1 << 62, self._pooling_limit()
        )
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
        self.groups = kv_cache_groups(
            self.model, settings.cache.block_size, cache_dtype(settings.cache.dtype, self.dtype)
        )
        return loaded

    def _position_limit(self) -> int | None:
        """The longest prompt the model's position embeddings number: ``max_position_embeddings``, less the
        offset RoBERTa-style models start from (an XLM-R's 514 positions hold 512 tokens)."""
        limit = self.model.shape.max_position_embeddings
        return limit - getattr(self.model, "position_offset", 0) if limit is not None else None

    def _pooling_limit(self) -> int:
        """A pooling model's sentence-transformers ``max_seq_length`` (no limit for generation, or without one)."""
        limit = max_seq_length(self.model_dir) if self.settings.pooling is not None else None
        return limit or 1 << 62

    def choose_attention_backend_and_sampler(self) -> tuple[str, type[AttentionBackend]]:
        """The attention backend (``auto`` resolved by capability) and the sampler, each checked against the run."""
        settings, registry = self.settings, self.registry
        backend_name, backend_class = select_attention_backend(
            registry, settings.attention.name, self._attention_configs()
        )
        require_serves(
            registry.resolve("sampler", settings.sampler.name),
            f"sampler:{settings.sampler.name}",
            "sampler.name",
            [SamplerConfig(device=self.device.type, dtype=self.dtype)],
        )
        return backend_name, backend_class

    def build_scheduler(
        self, kv_cache_manager: KVCacheManager, kv_connector: KVConnector | None, grammars: GrammarCompilations
    ) -> Scheduler:
        """The scheduler over the pool, with the connector's scheduler side and the grammar service."""
        settings = self.settings
        return Scheduler(
            kv_cache_manager,
            max_num_seqs=settings.scheduler.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=settings.cache.block_size,
            # An encoder-only model attends each prompt whole: never in chunks.
            chunked_prefill=settings.scheduler.chunked_prefill and self.causal,
            num_speculative_tokens=self._num_speculative_tokens,
            kv_connector=kv_connector.scheduler_side() if kv_connector is not None else None,
            kv_connector_role=settings.kv_connector.role if settings.kv_connector is not None else "both",
            grammars=grammars,
            max_batches_in_flight=pipeline_depth(settings),
            pipelined=settings.runtime.pipeline_parallel_size > 1,
            max_loras=settings.lora.max_loras if settings.lora is not None else None,
            max_num_encoder_input_tokens=settings.scheduler.max_num_encoder_input_tokens,
            encoder_cache_size=settings.scheduler.encoder_cache_size,
        )

    @property
    def max_num_batched_tokens(self) -> int:
        """The step's token budget: ``scheduler.max_num_batched_tokens``, raised for an encoder-only model to its
        longest prompt (which runs whole in one step)."""
        budget = self.settings.scheduler.max_num_batched_tokens
        return budget if self.causal else max(budget, self.max_model_len)

    def build_runner(
        self, spec: RunnerSpec, kv_connector: KVConnector | None, grammars: GrammarCompilations
    ) -> ModelRunner:
        """Rank 0's runner, then the other ranks' from the same spec; every rank's samplers seeded alike."""
        settings = self.settings
        kv_reports = None
        if kv_connector is not None and self.ranks is not None:
            assert self.ranks.group is not None
            kv_reports = RankTransferReports(self.ranks.group, settings.runtime.world_size)
        runner = build_runner(
            self.model,
            settings,
            self.registry,
            spec,
            device=self.device,
            dtype=self.dtype,
            kv_connector=kv_connector.worker_side() if kv_connector is not None else None,
            kv_reports=kv_reports,
            grammars=grammars,
            lora=self.lora,
            drafting=self.drafting,
            pooling=self.pooling,
        )
        if self.ranks is not None:
            self.ranks.start_runners(spec)
        torch.manual_seed(settings.runtime.seed)  # every rank's samplers start here alike, whatever loading drew
        logger.info(
            "model %s (%s, %s on %s, architecture plugin %s), attention backend %s, %d KV blocks of %d tokens "
            "(%d KV bytes per token)",
            self.model.shape.architecture,
            self.model_dir,
            self.dtype,
            self.device,
            self.model.served_by,
            spec.backend_name,
            spec.num_blocks,
            settings.cache.block_size,
            kv_bytes_per_token(self.groups),
        )
        return runner

    def _attention_configs(self) -> list[AttentionConfig]:
        """What the backend must serve: each KV-cache group's layers, or an encoder-only model's cacheless ones."""
        if self.causal:
            return [self._attention_config(group) for group in self.groups]
        spec = next(iter(self.model.layer_specs.values()))
        return [
            AttentionConfig(
                device=self.device.type,
                dtype=self.dtype,
                head_size=spec.head_size,
                num_heads=spec.num_heads,
                num_kv_heads=spec.num_kv_heads,
                block_size=self.settings.cache.block_size,
                logits_soft_cap=spec.logits_soft_cap,
                encoder_only=True,
            )
        ]

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
            value_size=any_layer.value_size,
        )

    def _check_spec_decode(self) -> None:
        """Check that the drafter and rejection sampler of ``spec_decode:`` serve this run (the runner builds them)."""
        spec = self.settings.spec_decode
        if spec is None:
            return
        config = drafter_config(
            self.settings, self.model, device=self.device, dtype=self.dtype, max_model_len=self.max_model_len
        )
        require_serves(
            self.registry.resolve("drafter", spec.name), f"drafter:{spec.name}", "spec_decode.name", [config]
        )
        require_serves(
            self.registry.resolve("sampler", spec.rejection_sampler.name),
            f"sampler:{spec.rejection_sampler.name}",
            "spec_decode.rejection_sampler.name",
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
        if self.groups[0].spec.latent:
            raise ConfigError(
                [
                    ConfigProblem(
                        "<run>",
                        "kv_connector",
                        f"{self.model.shape.architecture} caches MLA latent rows (one per token, no key and value "
                        "halves), which KV connectors do not carry yet; remove the kv_connector section",
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
        """The ``spec_decode:`` drafter, loaded now, over a provisional pool of one block: what it loads is then
        held when the pool is sized; its cache is resized to the pool when the runner is built."""
        if self.settings.spec_decode is None:
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
        return self.settings.spec_decode.num_speculative_tokens if self.settings.spec_decode is not None else 0

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
        if not any(group.layer_names for group in self.groups):
            # An encoder-only model: blocks are only counted (no memory backs them), enough for every seat.
            return 1 + self.settings.scheduler.max_num_seqs * -(-self.max_model_len // cache.block_size)
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
                    # A logits row per draft; a pooling model computes none.
                    num_rows=0
                    if self.pooling is not None
                    else scheduler.max_num_seqs * (1 + self._num_speculative_tokens),
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
        max_step_tokens = min(self.max_num_batched_tokens, usable_blocks * settings.cache.block_size)
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
