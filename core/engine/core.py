"""The engine: builds the model, KV cache, scheduler and runner from settings, and steps them.

One step: the scheduler decides, the runner executes, the scheduler
advances the requests, and the engine turns the news into
:class:`RequestOutput` updates (detokenising only where stop strings need it).

With pipeline stages (``runtime.pipeline_parallel_size`` > 1) a step is
vLLM's step with a batch queue: while fewer than one batch per stage is in
flight, the engine schedules another, runs the first stage's layers on it
(whose hidden states go on to the next stage without waiting) and returns;
otherwise (or when nothing new could be scheduled) it waits for the oldest
batch's output from the last stage and applies it, so outputs are applied
in the order the batches were scheduled.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import time
import weakref
from collections import defaultdict, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from patchbay.contract.registry import PluginError, Registry, registry_for
from patchbay.contract.selection import require_serves, select_attention_backend
from patchbay.contract.settings import ConfigError, ConfigProblem, Settings, plugin_options
from patchbay.engine.admission import AdmissionLimits, check_request, effective_max_logprobs
from patchbay.engine.outputs import RequestMetrics, RequestOutput, find_stop_string, merge_completions
from patchbay.engine.structured_output import check_constraint, grammar_compilations
from patchbay.interfaces import (
    AttentionConfig,
    KVConnector,
    KVConnectorConfig,
    Sampler,
    SamplerConfig,
)
from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.kv_cache_manager import KVCacheManager, num_blocks_for_memory
from patchbay.scheduling.kv_cache_spec import KVCacheGroup, group_layers
from patchbay.scheduling.request import Request
from patchbay.engine.model_identity import weights_fingerprint
from patchbay.engine.kv_sizing import KVSizing, size_kv_pool
from patchbay.engine.memory_check import check_fits, format_bytes
from patchbay.engine.ranks import TensorParallelRanks, check_tensor_parallel, parallel_settings
from patchbay.engine.step_failures import EngineDeadError, describe_failure, fail_requests, replay_alone
from patchbay.scheduling.scheduler import Scheduler
from patchbay.scheduling.scheduler_output import ModelRunnerOutput, SchedulerOutput
from patchbay.worker.parallel import distributed
from patchbay.worker.parallel.kv_transfers import RankTransferReports
from patchbay.worker.cpu.heap import keep_freed_memory
from patchbay.worker.memory_profile import PeakUnmeasurable, step_activation_bytes
from patchbay.worker.model.model_loader import resolve_model_dir
from patchbay.worker.parallel.torchrun import torchrun_launch
from patchbay.worker.parallel.pipeline_parallel import stage_layout
from patchbay.worker.runner_build import (
    RunnerSpec,
    build_runner,
    drafter_config,
    load_rank_model,
    rank_shard,
    shards_vocabulary,
)
from patchbay.worker.parallel.tensor_parallel import shard_layout
from patchbay.worker.cpu.tuning import LayerShapes, Tuning, tune

logger = logging.getLogger(__name__)

"""KV pool budget when neither cache.num_blocks nor cache.memory is set."""


def resolve_device(name: str) -> torch.device:
    """``auto`` is CUDA when available, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError([ConfigProblem("<run>", "runtime.device",
                                         f"{name!r} is not a device (auto, cpu, cuda, cuda:1, ...): {exc}")]) from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError([ConfigProblem("<run>", "runtime.device", f"{name!r}: patchbay runs on cpu or cuda")])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError([ConfigProblem("<run>", "runtime.device", f"{name!r} requested but CUDA is not available")])
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError([ConfigProblem("<run>", "runtime.device",
                                         f"{name!r}: this machine has {torch.cuda.device_count()} CUDA devices")])
    return device


def resolve_dtype(name: str, device: torch.device, tuning: Tuning | None) -> str:
    """``auto`` is what the CPU's tuning measured fastest among its native dtypes, and bfloat16 on GPUs."""
    if name != "auto":
        return name
    if device.type == "cpu":
        return tuning.dtype if tuning is not None else "float32"
    return "bfloat16"


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
    if device.type != "cpu" or not (settings.model.dtype == "auto" or runtime.linear_kernel == "auto"
                                     or runtime.fuse_projections or runtime.single_thread_max_tokens == "auto"):
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


class KVConnectorStalledError(PluginError):
    """Only requests the KV connector holds remain, and none progressed within ``kv_connector.stall_timeout``."""


@dataclass
class EngineStats:
    """Counters over the engine's life."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    max_batches_in_flight: int = 0
    """With pipeline stages: the most batches scheduled at once whose outputs were not back (1: lockstep)."""
    num_overlapped_batches: int = 0
    """With pipeline stages: batches whose first stage ran while an earlier batch's output was not back."""


class Engine:
    """Everything needed to serve requests, built from :class:`Settings`."""

    def __init__(self, settings: Settings, *, registry: Registry | None = None) -> None:
        from transformers import AutoTokenizer

        self.settings = settings
        registry = registry or registry_for(settings.plugins)
        import patchbay

        if patchbay.OMP_POLICY_TOO_LATE:
            logger.warning("torch was imported before patchbay, so OpenMP threads busy-wait; with another busy "
                           "process on the machine steps can be ~10x slower. Import patchbay first or set "
                           "OMP_WAIT_POLICY=PASSIVE before starting Python.")
        threads = distributed.rank_threads(settings)
        if threads is not None:
            torch.set_num_threads(threads)
        self.heap = keep_freed_memory()
        torch.manual_seed(settings.runtime.seed)
        self.device = resolve_device(settings.runtime.device)
        model_dir = resolve_model_dir(settings.model.path)
        self.model_dir = model_dir
        self.tuning = machine_tuning(settings, model_dir, self.device)
        self.dtype = resolve_dtype(settings.model.dtype, self.device, self.tuning)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.ranks: TensorParallelRanks | None = None
        self.kv_sizing: KVSizing | None = None
        """How ``cache.memory: auto`` sized the KV pool (``None``: sized by ``cache.memory`` or ``num_blocks``)."""
        """The other ranks: tensor-parallel shards or pipeline stages (``None``: this process runs the whole model)."""
        if settings.runtime.world_size > 1:
            from transformers import AutoConfig

            check_tensor_parallel(settings, self.device)
            config = AutoConfig.from_pretrained(model_dir)
            if settings.runtime.tensor_parallel_size > 1:
                shard_layout(config, settings.runtime.tensor_parallel_size)
            if settings.runtime.pipeline_parallel_size > 1:
                stage_layout(config, settings.runtime.pipeline_parallel_size, settings.runtime.pipeline_layer_partition)
            self.ranks = TensorParallelRanks(settings, model_dir, device=self.device, dtype=self.dtype,
                                             tuning=self.tuning)
        self._close_ranks = weakref.finalize(self, self.ranks.close) if self.ranks is not None else None
        try:
            self._build(settings, registry, model_dir)
        except BaseException:
            self.close()
            raise

    def _build(self, settings: Settings, registry: Registry, model_dir: Path) -> None:
        """Everything after the device, dtype and ranks: model, KV cache, plugins, scheduler, runner."""
        group = self.ranks.group if self.ranks is not None else None
        self._collectives = distributed.PausableCollectives(group) if group is not None else None
        """Rank 0's collectives, paused while it measures a step alone (``cache.memory: auto``)."""
        collectives = self._collectives
        loaded = load_rank_model(settings, model_dir, dtype=self.dtype, device=self.device, tuning=self.tuning,
                                 all_reduce=collectives.all_reduce if collectives else None,
                                 all_gather=collectives.all_gather if collectives else None, link=collectives,
                                 shard_vocabulary=shards_vocabulary(settings, registry))
        self.model = loaded.model
        self.quantized_linears = loaded.quantized_linears
        self.linear_paths = loaded.linear_paths
        self.fused_modules = loaded.fused_modules
        shape = self.model.shape
        self.max_model_len = min(
            settings.model.max_model_len or 1 << 62, shape.max_position_embeddings or 1 << 62
        )
        if self.max_model_len >= 1 << 62:
            raise ConfigError([ConfigProblem("<run>", "model.max_model_len",
                                             f"{shape.architecture} declares no length limit; set model.max_model_len")])

        block_size = settings.cache.block_size
        self.groups = group_layers(self.model.kv_cache_specs(block_size, self.dtype))
        self.backend_name, backend_class = select_attention_backend(
            registry, settings.attention.backend, [self._attention_config(g) for g in self.groups]
        )
        sampler_class = registry.resolve("sampler", settings.sampler.name)
        require_serves(sampler_class, f"sampler:{settings.sampler.name}", "sampler.name",
                       [SamplerConfig(device=self.device.type, dtype=self.dtype)])

        num_blocks = self._num_blocks()
        max_num_reqs, max_step_tokens = self._check_memory(num_blocks)
        self._check_speculative(registry)
        num_speculative_tokens = settings.speculative.num_speculative_tokens if settings.speculative else 0
        self.kv_connector = self._kv_connector(registry, backend_class)
        self.kv_cache_manager = KVCacheManager(self.groups, num_blocks, settings.cache.prefix_caching)
        self.grammars = grammar_compilations(settings, registry, device=self.device.type, dtype=self.dtype,
                                             tokenizer=self.tokenizer, vocab_size=shape.vocab_size,
                                             stop_token_ids=shape.eos_token_ids)
        self.scheduler = Scheduler(
            self.kv_cache_manager,
            max_num_seqs=settings.scheduler.max_num_seqs,
            max_num_batched_tokens=settings.scheduler.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            block_size=block_size,
            chunked_prefill=settings.scheduler.chunked_prefill,
            num_speculative_tokens=num_speculative_tokens,
            kv_connector=self.kv_connector.scheduler_side() if self.kv_connector is not None else None,
            kv_connector_role=settings.kv_connector.role if settings.kv_connector is not None else "both",
            grammars=self.grammars,
            max_batches_in_flight=self.pipeline_depth,
            pipelined=settings.runtime.pipeline_parallel_size > 1,
        )
        spec = RunnerSpec(self.backend_name, num_blocks, max_num_reqs, self.max_model_len, max_step_tokens,
                          single_thread_max_tokens(settings.runtime.single_thread_max_tokens, self.dtype, self.tuning),
                          kv_connector=self.kv_connector.config if self.kv_connector is not None else None)
        self.single_thread_max_tokens = spec.single_thread_max_tokens
        kv_reports = None
        if self.kv_connector is not None and self.ranks is not None:
            assert self.ranks.group is not None
            kv_reports = RankTransferReports(self.ranks.group, settings.runtime.world_size)
        self.runner = build_runner(
            self.model, settings, registry, spec, device=self.device, dtype=self.dtype,
            kv_connector=self.kv_connector.worker_side() if self.kv_connector is not None else None,
            kv_reports=kv_reports, grammars=self.grammars,
        )
        self.sampler: Sampler = self.runner.sampler
        if self.ranks is not None:
            self.ranks.start_runners(spec)
        torch.manual_seed(settings.runtime.seed)  # every rank's samplers start here alike, whatever loading drew
        self.spec_stats = self.runner.spec_stats
        self.num_blocks = num_blocks
        self.stats = EngineStats()
        self._engine_timings: dict[str, float] = defaultdict(float)
        self._outputs: dict[str, RequestOutput] = {}
        """Unfinished sequences by id (a request with n > 1 has n of them)."""
        self._groups: dict[str, tuple[list[str], dict[str, RequestOutput]]] = {}
        """Requests with n > 1: their sequence ids and the sequences finished so far."""
        self._group_of: dict[str, str] = {}
        self._aborted: list[str] = []
        self._batches: deque[SchedulerOutput] = deque()
        """With pipeline stages: the batches in flight (scheduled, their outputs not back), oldest first."""
        self._dead: str | None = None
        """Why the engine stopped for good (an error that may have corrupted its state); ``None`` while it runs."""
        self.limits = AdmissionLimits(shape.vocab_size, self.max_model_len,
                                      effective_max_logprobs(settings.model.max_logprobs, shape.vocab_size))
        self._stalled_since: float | None = None
        self._stalled_on: list[str] = []
        """When the steps started doing nothing but wait on the connector (``None``: they are not)."""
        self._ids = itertools.count()
        eos = shape.eos_token_ids
        self._eos_token_id = eos[0] if eos else None
        self._extra_eos = list(eos[1:])
        logger.info("model %s (%s, %s on %s), attention backend %s, %d KV blocks of %d tokens",
                    shape.architecture, model_dir, self.dtype, self.device, self.backend_name, num_blocks, block_size)

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
        )

    def _check_speculative(self, registry: Registry) -> None:
        """Check that the drafter and rejection sampler of ``speculative:`` serve this run (the runner builds them)."""
        spec = self.settings.speculative
        if spec is None:
            return
        config = drafter_config(self.settings, self.model, device=self.device, dtype=self.dtype,
                                max_model_len=self.max_model_len)
        require_serves(registry.resolve("drafter", spec.method), f"drafter:{spec.method}", "speculative.method",
                       [config])
        require_serves(registry.resolve("sampler", spec.rejection_sampler), f"sampler:{spec.rejection_sampler}",
                       "speculative.rejection_sampler",
                       [SamplerConfig(device=self.device.type, dtype=self.dtype, role="verify")])

    @property
    def pipeline_depth(self) -> int:
        """Batches in flight at once: one per pipeline stage; 1 with one stage, or with a KV connector (every rank
        joins its transfer reports with the others' after each batch, so the stages go in lockstep)."""
        return self.settings.runtime.pipeline_parallel_size if self.settings.kv_connector is None else 1

    def _kv_connector(self, registry: Registry, backend: type) -> KVConnector | None:
        """The connector of ``kv_connector:``, checked against the run; ``None`` without that section."""
        section = self.settings.kv_connector
        if section is None:
            return None
        if len(self.groups) != 1:
            raise ConfigError([ConfigProblem(
                "<run>", "kv_connector",
                f"KV connectors support models with one KV-cache group; this model has {len(self.groups)} "
                f"(layers with different sliding windows or shapes); remove the kv_connector section",
            )])
        # Rank 0's shard: its scheduler side answers for every rank, its worker side saves and loads rank 0's part.
        config = KVConnectorConfig(device=self.device.type, dtype=self.dtype, role=section.role,
                                   block_size=self.settings.cache.block_size, model_id=self._model_id(backend),
                                   shard=rank_shard(self.settings.runtime, 0))
        connector_class = registry.resolve("kv_connector", section.name)
        require_serves(connector_class, f"kv_connector:{section.name}", "kv_connector.name", [config])
        options = plugin_options(connector_class, section.options, where="kv_connector.options")
        return connector_class(options, config=config)  # type: ignore[call-arg,return-value]

    def _model_id(self, backend: type) -> str:
        """What KV blocks depend on: model (directory name, config and weights), dtype and block layout.

        e.g. ``SmolLM2-135M-3f2a9c1d0e4b5a67-float32-2x1x16x3x64`` (the hash covers
        config.json and a fingerprint of the weight files; the layout is the backend's
        cache shape of one block: keys/values, block, tokens, KV heads, head size).
        """
        config_bytes = (self.model_dir / "config.json").read_bytes() if (self.model_dir / "config.json").exists() \
            else str(self.model_dir).encode()
        identity = hashlib.sha256(config_bytes)
        identity.update(weights_fingerprint(self.model_dir).encode())
        spec = self.groups[0].spec
        layout = "x".join(str(d) for d in backend.kv_cache_shape(1, spec.block_size, spec.num_kv_heads, spec.head_size))
        return f"{self.model_dir.name}-{identity.hexdigest()[:16]}-{self.dtype}-{layout}"

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
            with self._collectives.paused() if self._collectives else contextlib.nullcontext():
                activations = step_activation_bytes(self.model, num_tokens=step_tokens,
                                                    num_rows=scheduler.max_num_seqs, device=self.device)
        except PeakUnmeasurable as exc:
            raise ConfigError([ConfigProblem("<run>", "cache.memory", f"auto measures a step's peak memory, and {exc}; "
                                             "give cache.memory (e.g. 2GiB) or cache.num_blocks")]) from exc
        self.kv_sizing = size_kv_pool(self.settings, self.groups, device=self.device, max_model_len=self.max_model_len,
                                      activation_bytes=activations, step_tokens=step_tokens,
                                      ranks=ranks_on_this_machine(self.settings))
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
        kv = (kv_key, f"the KV cache ({num_blocks} blocks of {format_bytes(bytes_per_block)}{each})",
              device_ranks * num_blocks * bytes_per_block)
        blocks_per_row = -(-self.max_model_len // settings.cache.block_size) * len(self.groups)
        row_bytes = 4 * ((self.max_model_len + 1) + blocks_per_row)  # int32 token ids and block tables
        batch = ("scheduler.max_num_seqs",
                 f"the persistent batch ({max_num_reqs} rows of {self.max_model_len} tokens{each})",
                 host_ranks * max_num_reqs * row_bytes)
        if self.device.type == "cpu":
            check_fits([kv, batch], self.device)
        else:
            check_fits([kv], self.device)
            check_fits([batch], torch.device("cpu"))
        return max_num_reqs, max_step_tokens

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; returns its id.  Invalid requests raise ``ValueError`` naming the request.

        A request with ``n > 1`` runs as ``n`` sequences (seeded ones with
        seeds ``seed, seed + 1, ...``) and finishes as one output holding all
        ``n`` completions.
        """
        self._require_alive()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._outputs or request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.check_request(request_id, prompt_token_ids, sampling_params)
        sampling_params = self._complete_params(sampling_params)
        if sampling_params.n == 1:
            self._add_sequence(request_id, prompt_token_ids, sampling_params, prompt)
            return request_id
        children = [f"{request_id}#{index}" for index in range(sampling_params.n)]
        self._groups[request_id] = (children, {})
        for index, child in enumerate(children):
            seed = None if sampling_params.seed is None else sampling_params.seed + index
            self._add_sequence(child, prompt_token_ids, sampling_params.model_copy(update={"seed": seed}), prompt)
            self._group_of[child] = request_id
        return request_id

    def _complete_params(self, params: SamplingParams) -> SamplingParams:
        """Fill what the engine knows and the request cannot: extra EOS ids, bad words as token ids."""
        update: dict = {}
        if self._extra_eos and not params.ignore_eos:
            update["stop_token_ids"] = [*params.stop_token_ids, *self._extra_eos]
        if params.bad_words:
            sequences = list(params.bad_words_token_ids or [])
            for word in params.bad_words:
                # A word may be tokenized differently at the start of the text and after a space.
                for variant in (word, " " + word.lstrip()):
                    ids = self.tokenizer.encode(variant, add_special_tokens=False)
                    if ids and ids not in sequences:
                        sequences.append(ids)
            update["bad_words_token_ids"] = sequences
        return params.model_copy(update=update) if update else params

    def _add_sequence(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                      prompt: str | None) -> None:
        request = Request(request_id, prompt_token_ids, params, eos_token_id=self._eos_token_id,
                          block_size=self.settings.cache.block_size)
        self.scheduler.add_request(request)
        self._outputs[request_id] = RequestOutput(
            request_id, prompt, list(prompt_token_ids), params, metrics=RequestMetrics(request.arrival_time)
        )
        self.stats.num_prompt_tokens += len(prompt_token_ids)

    def check_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the request if it cannot run here (vocabulary, lengths, logprobs, sampler).

        :meth:`add_request` calls it; a job can call it for every request
        before adding any, so that no result is written for a job that is invalid.
        """
        if not isinstance(request_id, str):
            raise ValueError(f"a request id must be a string, got {type(request_id).__name__} {request_id!r}")
        check_request(request_id, prompt_token_ids, params, self.limits)
        self._check_sampling(request_id, params)
        check_constraint(request_id, params, self.grammars)

    def _check_sampling(self, request_id: str, params: SamplingParams) -> None:
        # Prompt logprobs come from the runner, not the sampler.
        config = SamplerConfig(device=self.device.type, dtype=self.dtype,
                               params_used=params.params_used() - {"prompt_logprobs"}, random_sampling=not params.greedy)
        reasons = self.sampler.validate(config)
        if reasons:
            raise ValueError(f"request {request_id!r}: sampler {self.settings.sampler.name!r} cannot serve it: "
                             + "; ".join(reasons))

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests; their outputs finish with reason ``abort`` (returned by the next :meth:`step`)."""
        self._require_alive()
        sequence_ids = [child for request_id in request_ids
                        for child in (self._groups[request_id][0] if request_id in self._groups else [request_id])]
        self.scheduler.abort_requests(sequence_ids)
        now = time.monotonic()
        for sequence_id in sequence_ids:
            output = self._outputs.get(sequence_id)
            if output is not None and not output.finished:
                output.finish_reason = "abort"
                output.metrics.finish_time = now
                self._aborted.append(sequence_id)

    def live_outputs(self, request_id: str) -> list[RequestOutput]:
        """The growing outputs of an unfinished request, one per sequence in index order (for streaming).

        A sequence of an ``n > 1`` request that already finished is included
        as finished.  Empty once the request has finished (its output came
        back from :meth:`step`) or for an unknown id.  The objects are the
        engine's own: read them between steps, never change them.
        """
        if request_id in self._groups:
            children, done = self._groups[request_id]
            return [done[child] if child in done else self._outputs[child] for child in children]
        output = self._outputs.get(request_id)
        return [] if output is None else [output]

    def discard(self, request_ids: list[str]) -> None:
        """Abort requests and forget them: no step returns their outputs, and their ids are free again."""
        self._require_alive()
        sequence_ids = [child for request_id in request_ids
                        for child in (self._groups[request_id][0] if request_id in self._groups else [request_id])]
        self.scheduler.abort_requests(sequence_ids)
        for sequence_id in sequence_ids:
            self._outputs.pop(sequence_id, None)
            self._group_of.pop(sequence_id, None)
        for request_id in request_ids:
            self._groups.pop(request_id, None)
        dropped = set(sequence_ids)
        self._aborted = [sequence_id for sequence_id in self._aborted if sequence_id not in dropped]

    def has_unfinished_requests(self) -> bool:
        """Whether a :meth:`step` still has work or outputs (aborted requests are returned by the next step)."""
        self._require_alive()
        return self.scheduler.has_unfinished_requests() or bool(self._aborted) or bool(self._batches)

    def close(self) -> None:
        """Release what outlives a step: the other tensor-parallel ranks' processes (idempotent; no-op for one rank).

        Also runs when the engine is collected or the interpreter exits.
        """
        if self._close_ranks is not None:
            self._close_ranks()

    @property
    def is_dead(self) -> bool:
        """Whether an earlier error stopped the engine for good (every call then raises :class:`EngineDeadError`)."""
        return self._dead is not None

    def _require_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(f"the engine stopped after an error that may have corrupted its state "
                                  f"({self._dead}); create a new engine")

    def _plugins(self) -> dict[str, list[Any]]:
        """The run's plugin objects by ``KIND:NAME``, to name the one an exception came from."""
        settings = self.settings
        runner = self.runner
        plugins: dict[str, list[Any]] = {
            f"sampler:{settings.sampler.name}": [self.sampler],
            f"attention:{self.backend_name}": [runner.backend, *(b.impl for b in runner._bindings.values())],
            f"attention_metadata_builder:{settings.attention.metadata_builder or type(runner.backend).metadata_builder}":
                list(runner.builders),
        }
        if settings.speculative is not None:
            plugins[f"drafter:{settings.speculative.method}"] = [runner.drafter]
            plugins[f"sampler:{settings.speculative.rejection_sampler}"] = [runner.rejection_sampler]
        if settings.kv_connector is not None and self.kv_connector is not None:
            plugins[f"kv_connector:{settings.kv_connector.name}"] = [self.kv_connector, runner.kv_connector,
                                                                      self.scheduler.kv_connector]
        return plugins

    # -- stepping --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one step; return the requests that finished in it.

        A request whose work raises in the step finishes alone with
        ``finish_reason="error"`` (its ``error`` says what raised, naming the
        plugin); an error that may have corrupted the engine's state makes
        this and every later call raise :class:`EngineDeadError`.
        """
        self._require_alive()
        try:
            return self._pipelined_step() if self.settings.runtime.pipeline_parallel_size > 1 else self._step()
        except BaseException as exc:
            self._dead = describe_failure(exc, self._plugins()) if not isinstance(exc, EngineDeadError) else str(exc)
            logger.error("engine stopped: %s", self._dead)
            self.close()
            if isinstance(exc, Exception) and not isinstance(exc, EngineDeadError):
                raise EngineDeadError(f"the engine stopped: {self._dead}") from exc
            raise

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        self.stats.num_preemptions += len(scheduler_output.preempted_req_ids)
        scheduled = time.perf_counter()
        self._engine_timings["schedule"] += scheduled - started
        failed: dict[str, str] = {}
        if self.ranks is not None:
            # Rank 0's matchers fill the step's grammar bitmasks; they travel with the step to every rank.
            self.runner.fill_grammar_bitmasks(scheduler_output)
            self.ranks.send_step(scheduler_output)  # raises RankDiedError once a rank has ended
        try:
            runner_output = self.runner.execute_model(scheduler_output)
        except Exception as exc:
            runner_output, failed = self._replay_failed_step(scheduler_output, exc)
        return self._apply_output(scheduler_output, runner_output, failed)

    def _pipelined_step(self) -> list[RequestOutput]:
        """One step with pipeline stages: schedule another batch and start it, or apply the oldest one's output.

        Returns without outputs after starting a batch while fewer than
        ``pipeline_parallel_size`` are in flight: the next call schedules
        the next batch (from requests not in flight) while this one is in
        the later stages.
        """
        assert self.ranks is not None
        depth = self.pipeline_depth
        if len(self._batches) < depth:
            started = time.perf_counter()
            scheduler_output = self.scheduler.schedule()
            self.stats.num_preemptions += len(scheduler_output.preempted_req_ids)
            self._engine_timings["schedule"] += time.perf_counter() - started
            own_output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
            if not scheduler_output.is_empty or _tells_runner(scheduler_output) or not self._batches:
                # Rank 0's matchers fill the step's grammar bitmasks; they travel with the step to every rank.
                self.runner.fill_grammar_bitmasks(scheduler_output)
                self.ranks.send_step(scheduler_output)  # raises RankDiedError once a rank has ended
                try:
                    # The first stage's layers; nothing sampled here.  An empty step's output still holds the
                    # ranks' joined KV transfer reports, when a connector runs.
                    own_output = self.runner.execute_model(scheduler_output)
                except Exception as exc:
                    self._replay_failed_step(scheduler_output, exc)  # raises: steps are not replayed with ranks
            if not scheduler_output.is_empty:
                if self._batches:
                    self.stats.num_overlapped_batches += 1
                self._batches.append(scheduler_output)
                self.stats.max_batches_in_flight = max(self.stats.max_batches_in_flight, len(self._batches))
                if len(self._batches) < depth:
                    return []
            elif not self._batches:
                return self._apply_output(scheduler_output, own_output, {})
        # The pipeline is full, or every running request is in flight: take the oldest batch's output.
        scheduler_output = self._batches.popleft()
        waited = time.perf_counter()
        runner_output = self.ranks.receive_output()
        self._engine_timings["wait"] += time.perf_counter() - waited
        if self.runner.constrained is not None:  # rank 0's matchers accept the samples: theirs are the failures
            runner_output.failed.update(self.runner.constrained.take_failed())
        return self._apply_output(scheduler_output, runner_output, {})

    def _apply_output(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
                      failed: dict[str, str]) -> list[RequestOutput]:
        """Advance the scheduler by one batch's output and turn it into request outputs; the finished ones."""
        ran = time.perf_counter()
        now = time.monotonic()
        errored = []
        for request_id, message in failed.items():
            logger.warning("request %r failed: %s", self._group_of.get(request_id, request_id), message)
            output = self._outputs[request_id]
            output.finish_reason, output.stop_reason, output.error = "error", message, message
            output.metrics.finish_time = now
            errored.append(request_id)
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.stats.num_steps += 1
        now = time.monotonic()
        logprobs_by_id = dict(zip(runner_output.req_ids, runner_output.logprobs or [], strict=False))
        sampled_by_id = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True))
        verified_elsewhere = not self.runner.samples  # the last pipeline stage's runner counted them, not ours
        for request_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            if verified_elsewhere and sampled_by_id.get(request_id):
                self.spec_stats.record(len(drafts), len(sampled_by_id[request_id]) - 1,
                                       self.scheduler.num_speculative_tokens)
            output = self._outputs.get(request_id)
            if output is not None and sampled_by_id.get(request_id):
                output.metrics.num_draft_tokens += len(drafts)
                output.metrics.num_accepted_tokens += len(sampled_by_id[request_id]) - 1
        for request_id, prompt_logprobs in runner_output.prompt_logprobs.items():
            output = self._outputs.get(request_id)
            if output is not None and output.prompt_logprobs is None:  # a preempted request computes them again
                output.prompt_logprobs = prompt_logprobs
        finished_ids = self._aborted + errored
        self._aborted = []
        stopped: list[tuple[str, str]] = []
        for update in updates:
            output = self._outputs[update.request_id]
            if update.new_token_ids:
                if output.metrics.first_token_time is None:
                    output.metrics.first_token_time = now
                    output.metrics.num_cached_tokens = max(update.num_cached_tokens, 0)
                output.metrics.token_times.extend([now] * len(update.new_token_ids))
                output.token_ids.extend(update.new_token_ids)
                self.stats.num_generated_tokens += len(update.new_token_ids)
                if output.sampling_params.logprobs is not None:
                    output.logprobs = (output.logprobs or []) + [logprobs_by_id.get(update.request_id)]
            if update.finish_reason is None and output.sampling_params.stop:
                stop = self._stop_string(output, len(update.new_token_ids))
                if stop is not None:
                    stopped.append((update.request_id, stop))
                    update.finish_reason, update.stop_reason = "stop", stop
            if update.finish_reason is not None:
                output.finish_reason = update.finish_reason
                output.stop_reason = update.stop_reason
                output.metrics.finish_time = now
                finished_ids.append(update.request_id)
        for request_id, stop in stopped:
            self.scheduler.finish_requests([request_id], "stop", stop)
        finished = [result for sequence_id in finished_ids if (result := self._finish(sequence_id)) is not None]
        self._engine_timings["finish"] += time.perf_counter() - ran
        self._check_liveness(scheduler_output.is_empty and not finished)
        return finished

    def _replay_failed_step(self, scheduler_output: SchedulerOutput,
                            exc: Exception) -> tuple[ModelRunnerOutput, dict[str, str]]:
        """Replay a step whose runner raised request by request; fail (and free) the requests that raise alone."""
        if self.ranks is not None:
            # Every rank would have to replay in step; a failed rank or collective cannot be replayed at all.
            raise self.ranks.failure(exc) or EngineDeadError(
                f"a step failed with {parallel_settings(self.settings)}, where "
                f"steps are not replayed request by request: {describe_failure(exc, self._plugins())}") from exc
        if self.kv_connector is not None:
            # The step's loads and saves cannot be replayed per request without re-saving blocks not yet computed.
            raise EngineDeadError(f"the runner failed in a step with a KV connector: "
                                  f"{describe_failure(exc, self._plugins())}") from exc
        logger.warning("a step failed (%s); running its %d requests one by one to find the one at fault",
                       describe_failure(exc, self._plugins()), len(scheduler_output.num_scheduled_tokens))
        isolated = replay_alone(self.runner, self.scheduler, scheduler_output, self._plugins())
        fail_requests(self.scheduler, isolated.errors)
        return isolated.output, isolated.errors

    def _check_liveness(self, idle: bool) -> None:
        """Fail the run when steps only wait on the KV connector and nothing moved for ``stall_timeout`` seconds.

        A connector that holds a finished request (``request_finished``
        returned True) and never reports it in ``get_finished`` would keep
        the engine stepping forever.  Outputs finished before are already
        returned, so the caller has written them.
        """
        waiting_on = self.scheduler.connector_waits() if idle and self.kv_connector is not None else []
        now = time.monotonic()
        # Progress: a step ran or finished something, or the connector released one of the requests it held.
        if not waiting_on or self._stalled_since is None or waiting_on != self._stalled_on:
            self._stalled_since = now if waiting_on else None
            self._stalled_on = waiting_on
            return
        section = self.settings.kv_connector
        assert section is not None
        if now - self._stalled_since < section.stall_timeout:
            time.sleep(0.001)  # nothing to compute: do not spin a core while the connector works
            return
        # Outputs returned by earlier steps are written; requests not yet finished are named here.
        held = ", ".join(repr(request_id) for request_id in waiting_on[:10])
        more = f" and {len(waiting_on) - 10} more" if len(waiting_on) > 10 else ""
        raise KVConnectorStalledError(
            f"KV connector {section.name!r} holds requests {held}{more} and reported none of them done in "
            f"{section.stall_timeout:g} s (kv_connector.stall_timeout) with nothing else to run: a request for which "
            "request_finished returned True must be reported by the worker side's get_finished (finished_sending), "
            "and an async load by get_finished (finished_recving)")

    def step_timings(self) -> dict[str, float]:
        """Seconds spent per phase of a step since the last reset, in step order.

        ``schedule`` (the scheduler), the runner's ``update`` (persistent
        batch), ``prepare`` (inputs and attention metadata), ``forward`` (the
        model, logits included), ``sample``, ``output`` (recording samples),
        ``draft`` (speculative proposals, when a drafter runs), ``structure`` (filling and
        applying grammar bitmasks and advancing matchers, when constrained requests run), then
        ``finish`` (the scheduler's update from the output, stop checks and
        request outputs).  With tensor parallelism, ``all_reduce`` follows
        ``forward``: rank 0's time in the forward pass's all-reduces (and the
        LM head's all-gather of the vocabulary's logits), taken out of ``forward``.
        With pipeline stages the runner's phases are the first stage's (it
        samples nothing), and ``wait`` comes before ``finish``: rank 0's time
        waiting for the last stage's outputs (the pipeline's bubbles as rank 0
        sees them).
        """
        timings = {"schedule": self._engine_timings["schedule"]}
        for phase, seconds in self.runner.timings.items():
            if phase == "forward" and self.ranks is not None and self.ranks.group is not None:
                all_reduce = self.ranks.group.all_reduce_seconds
                timings.update(forward=seconds - all_reduce, all_reduce=all_reduce)
            else:
                timings[phase] = seconds
        if self.settings.runtime.pipeline_parallel_size > 1:
            timings["wait"] = self._engine_timings["wait"]
        timings["finish"] = self._engine_timings["finish"]
        return timings

    def reset_step_timings(self) -> None:
        """Start :meth:`step_timings` from zero (after a warm-up, say)."""
        self._engine_timings.clear()
        self.runner.timings.clear()
        if self.ranks is not None and self.ranks.group is not None:
            self.ranks.group.all_reduce_seconds = 0.0

    def _finish(self, sequence_id: str) -> RequestOutput | None:
        """Retire a finished sequence; the request's output once all its sequences are done."""
        output = self._outputs.pop(sequence_id)
        if not output.text:
            output.text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        request_id = self._group_of.pop(sequence_id, None)
        if request_id is None:
            output.completions = [output.completion()]
            return output
        children, done = self._groups[request_id]
        done[sequence_id] = output
        if len(done) < len(children):
            return None
        del self._groups[request_id]
        return merge_completions(request_id, [done[child] for child in children])

    def _stop_string(self, output: RequestOutput, num_new_tokens: int) -> str | None:
        text = self.tokenizer.decode(output.token_ids, skip_special_tokens=True)
        tail_text = self.tokenizer.decode(output.token_ids[-num_new_tokens:], skip_special_tokens=True)
        found = find_stop_string(text, output.sampling_params.stop, len(tail_text) + 1)
        if found is None:
            return None
        stop, index = found
        output.text = text[:index]
        return stop


def _tells_runner(scheduler_output: SchedulerOutput) -> bool:
    """Whether an empty batch still carries news for the runners' persistent batches (rows to drop)."""
    return bool(scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids
                or scheduler_output.reset_req_ids)
