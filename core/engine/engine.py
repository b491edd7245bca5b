"""The engine: adds and aborts requests and steps the parts :mod:`patchbay.engine.builder` built.

One step: the scheduler decides, the runner executes, the scheduler
advances the requests, and the engine's :class:`OutputProcessor` turns the
news into :class:`RequestOutput` updates (detokenising only where stop
strings need it).

With pipeline stages (``runtime.pipeline_parallel_size`` > 1) a step is
vLLM's step with a batch queue: while fewer than one batch per stage is in
flight, the engine schedules another, runs the first stage's layers on it
(whose hidden states go on to the next stage without waiting) and returns;
otherwise (or when nothing new could be scheduled) it waits for the oldest
batch's output from the last stage and applies it, so outputs are applied
in the order the batches were scheduled.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
import weakref
from collections import defaultdict, deque
from typing import Any

from patchbay.contract.registry import PluginError, Registry, registry_for
from patchbay.contract.settings import Settings
from patchbay.engine.admission import check_request
from patchbay.engine.builder import build_engine_parts
from patchbay.engine.kv_event_publisher import kv_event_publisher
from patchbay.engine.parts import pipeline_depth
from patchbay.engine.multimodal_inputs import ImageInputs, MultiModalInputError, ProcessedImages, request_images
from patchbay.engine.output_processor import OutputProcessor
from patchbay.engine.outputs import RequestOutput
from patchbay.engine.ranks import parallel_settings
from patchbay.engine.report import EngineReport, EngineStats
from patchbay.engine.step_failures import EngineDeadError, describe_failure, fail_requests, replay_alone
from patchbay.engine.structured_output import check_constraint
from patchbay.engine.pooling import POOLING_SAMPLING, PoolingRun
from patchbay.interfaces import PoolingParams, Sampler, SamplerConfig
from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.kv_cache_spec import cache_dtype, kv_bytes_per_token
from patchbay.scheduling.multimodal import ImageFeature
from patchbay.scheduling.request import PoolingRequest, Request
from patchbay.scheduling.scheduler_output import ModelRunnerOutput, SchedulerOutput
from patchbay.worker.lora.catalog import AdapterInUseError
from patchbay.worker.lora.manager import LoRAManager
from patchbay.worker.lora.peft_adapter import LoRAAdapterError
from patchbay.worker.cpu.caching_allocator import release_kept_blocks
from patchbay.worker.model_runner import StepStage

logger = logging.getLogger(__name__)


class KVConnectorStalledError(PluginError):
    """Only requests the KV connector holds remain, and none progressed within ``kv_connector.stall_timeout``."""


class Engine:
    """Everything needed to serve requests, built from :class:`Settings`."""

    def __init__(self, settings: Settings, *, registry: Registry | None = None) -> None:
        self.settings = settings
        parts = build_engine_parts(settings, registry or registry_for(settings.plugins))
        self.device = parts.device
        self.dtype = parts.dtype
        self.tuning = parts.tuning
        self.heap = parts.heap
        self.model_dir = parts.model_dir
        self.tokenizer = parts.tokenizer
        self.ranks = parts.ranks
        """The other ranks: tensor-parallel shards or pipeline stages (``None``: this process runs the whole model)."""
        self._close_ranks = weakref.finalize(self, self.ranks.close) if self.ranks is not None else None
        self.model = parts.model
        self.quantized_linears = parts.quantized_linears
        self.linear_paths = parts.linear_paths
        self.fused_modules = parts.fused_modules
        self.max_model_len = parts.max_model_len
        self.groups = parts.groups
        self.backend_name = parts.backend_name
        self.num_blocks = parts.num_blocks
        self.kv_sizing = parts.kv_sizing
        """How ``cache.memory: auto`` sized the KV pool (``None``: sized by ``cache.memory`` or ``num_blocks``)."""
        self.kv_connector = parts.kv_connector
        self.kv_cache_manager = parts.kv_cache_manager
        self.grammars = parts.grammars
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.single_thread_max_tokens = parts.single_thread_max_tokens
        self.limits = parts.limits
        self.lora = parts.lora
        """The LoRA adapter slots (``None``: no ``lora:`` section, so requests naming an adapter are refused)."""
        self.pooling: PoolingRun | None = parts.pooling
        """A pooling engine's task and limits (``None``: the engine generates)."""
        self.sampler: Sampler = self.runner.sampler
        self.spec_stats = self.runner.spec_stats
        self.stats = EngineStats()
        self.output_processor = OutputProcessor(self.tokenizer)
        self._engine_timings: dict[str, float] = defaultdict(float)
        self._grammar_wait_start = 0.0
        """The scheduler's ``grammar_wait_seconds`` at the last reset of the step timings."""
        self._batches: deque[SchedulerOutput] = deque()
        """With pipeline stages: the batches in flight (scheduled, their outputs not back), oldest first."""
        self._dead: str | None = None
        """Why the engine stopped for good (an error that may have corrupted its state); ``None`` while it runs."""
        self._stalled_since: float | None = None
        self._stalled_on: list[str] = []
        """When the steps started doing nothing but wait on the connector (``None``: they are not)."""
        vision = self.model.vision
        self.image_inputs = ImageInputs.for_model(
            self.model_dir, vision.family if vision is not None else None, self.model.shape.architecture
        )
        """A vision-language model's image processing (``None``: the model takes text only)."""
        self.kv_event_publisher = kv_event_publisher(settings, self.groups)
        """Publishes each step's KV-cache events (``None``: ``kv_events.enable_kv_cache_events`` is off)."""
        self._ids = itertools.count()
        eos = self.model.shape.eos_token_ids
        self._eos_token_id = eos[0] if eos else None
        self._extra_eos = list(eos[1:])

    @property
    def pipeline_depth(self) -> int:
        """Batches in flight at once (:func:`patchbay.engine.builder.pipeline_depth`)."""
        return pipeline_depth(self.settings)

    def report(self) -> EngineReport:
        """A snapshot of the engine's counters, step timings and how its parts were built (for run summaries)."""
        return EngineReport(
            stats=copy.copy(self.stats),
            step_timings=self.step_timings(),
            attention_backend=self.backend_name,
            dtype=self.dtype,
            kv_cache_dtype=cache_dtype(self.settings.cache.dtype, self.dtype),
            device=str(self.device),
            heap=self.heap,
            machine_defaults=self.tuning.describe() if self.tuning is not None else None,
            kv_sizing=self.kv_sizing.describe() if self.kv_sizing is not None else None,
            linear_paths=copy.copy(self.linear_paths),
            quantized_linears=self.quantized_linears,
            single_thread_max_tokens=self.single_thread_max_tokens,
            fused_modules=self.fused_modules,
            kv_connector=copy.copy(self.scheduler.kv_connector_stats) if self.kv_connector is not None else None,
            spec_decode=copy.deepcopy(self.spec_stats),
            grammars=copy.deepcopy(self.grammars.stats),
            encoder_cache=copy.copy(self.scheduler.encoder_cache.stats) if self.image_inputs is not None else None,
            architecture=self.model.served_by,
            kv_bytes_per_token=kv_bytes_per_token(self.groups),
        )

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        multi_modal_data: dict[str, Any] | ProcessedImages | None = None,
    ) -> str:
        """Queue a request; returns its id.  Invalid requests raise ``ValueError`` naming the request.

        A request with ``n > 1`` runs as ``n`` sequences (seeded ones with
        seeds ``seed, seed + 1, ...``) and finishes as one output holding all
        ``n`` completions.  ``multi_modal_data`` (``{"image": image or [images]}``)
        gives a vision-language model the images of the prompt's image markers
        (:mod:`patchbay.engine.multimodal_inputs`); bad images raise
        :class:`MultiModalInputError`.  It may instead be what :meth:`process_images`
        made of those images for these ``prompt_token_ids``: the image processor
        then does not run again.
        """
        self._require_alive()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.output_processor.in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        features: list[ImageFeature] = []
        if multi_modal_data is not None:
            prompt_token_ids, features = self._expand_images(request_id, prompt_token_ids, multi_modal_data)
        self.check_request(request_id, prompt_token_ids, sampling_params)
        sampling_params = self._complete_params(sampling_params)
        if sampling_params.n == 1:
            self._add_sequence(request_id, prompt_token_ids, sampling_params, prompt, features=features)
            return request_id
        children = [f"{request_id}#{index}" for index in range(sampling_params.n)]
        self.output_processor.add_group(request_id, children)
        for index, child in enumerate(children):
            seed = None if sampling_params.seed is None else sampling_params.seed + index
            self._add_sequence(
                child,
                prompt_token_ids,
                sampling_params.model_copy(update={"seed": seed}),
                prompt,
                request_id,
                features=features,
            )
        return request_id

    def add_pooling_request(
        self,
        prompt_token_ids: list[int],
        params: PoolingParams | None = None,
        *,
        prompt: str | None = None,
        request_id: str | None = None,
        token_type_ids: list[int] | None = None,
    ) -> str:
        """Queue a request of a pooling engine; returns its id.  Its output's ``pooled`` is the pooler's vector
        (an embedding, class probabilities or a score: the engine's ``pooling.task``).

        ``token_type_ids`` gives each prompt token's segment (a BERT cross-encoder's query and document).
        Invalid requests raise ``ValueError`` naming the request.
        """
        self._require_alive()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if self.output_processor.in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params if params is not None else PoolingParams()
        self.check_pooling_request(request_id, prompt_token_ids, params, token_type_ids)
        assert self.pooling is not None  # checked above
        request = Request(
            request_id,
            prompt_token_ids,
            POOLING_SAMPLING,
            block_size=self.settings.cache.block_size,
            pooling=PoolingRequest(
                params,
                # A model without token-type embeddings (a decoder) takes none: its checked types are all 0.
                tuple(token_type_ids) if token_type_ids is not None and self.pooling.type_vocab_size else None,
                self.pooling.whole_prompt,
            ),
        )
        self.scheduler.add_request(request)
        self.output_processor.add_sequence(request_id, prompt, prompt_token_ids, POOLING_SAMPLING, request.arrival_time)
        self.stats.num_prompt_tokens += len(prompt_token_ids)
        return request_id

    def check_pooling_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        token_type_ids: list[int] | None = None,
    ) -> None:
        """Raise ``ValueError`` naming the request if it cannot be pooled here (the engine generates, the prompt
        is empty or over ``model.max_model_len``, ``dimensions`` or token types the model does not have)."""
        run = self.pooling
        if run is None:
            raise ValueError(
                f"request {request_id!r} asks for a pooled vector, but this engine generates; an engine pools with "
                "a pooling: section in its settings"
            )
        check_request(request_id, prompt_token_ids, POOLING_SAMPLING, self.limits)
        if params.dimensions is not None:
            if run.task != "embed":
                raise ValueError(
                    f"request {request_id!r}: dimensions applies to embeddings; this engine's task is {run.task}"
                )
            if params.dimensions > run.hidden_size:
                raise ValueError(
                    f"request {request_id!r}: dimensions={params.dimensions} exceeds the model's "
                    f"{run.hidden_size} embedding features"
                )
        if token_type_ids is None:
            return
        if len(token_type_ids) != len(prompt_token_ids):
            raise ValueError(
                f"request {request_id!r}: {len(token_type_ids)} token types for a prompt of "
                f"{len(prompt_token_ids)} tokens"
            )
        limit = run.type_vocab_size or 1
        outside = [value for value in token_type_ids if isinstance(value, bool) or not 0 <= value < limit]
        if outside:
            raise ValueError(
                f"request {request_id!r}: token types must be integers in 0..{limit - 1} for this model; "
                f"got {outside[:5]}"
            )

    def process_images(
        self, request_id: str, prompt_token_ids: list[int], multi_modal_data: dict[str, Any]
    ) -> ProcessedImages:
        """Run the image processor on a prompt's images (``{"image": image or [images]}``) and expand its markers.

        Thread-safe (it touches no engine state): a front end may call it off the engine's thread, read the
        expanded length, and pass the result to :meth:`add_request` as ``multi_modal_data``.  Bad images raise
        :class:`MultiModalInputError` naming ``request_id``.
        """
        images = request_images(request_id, multi_modal_data)
        if not images:
            return ProcessedImages(tuple(prompt_token_ids), list(prompt_token_ids), [])
        if self.image_inputs is None:
            raise MultiModalInputError(
                f"request {request_id!r} has images, but this model ({self.model.shape.architecture}) takes text only"
            )
        token_ids, features = self.image_inputs.process(request_id, prompt_token_ids, images)
        return ProcessedImages(tuple(prompt_token_ids), token_ids, features)

    def _expand_images(
        self, request_id: str, prompt_token_ids: list[int], multi_modal_data: dict[str, Any] | ProcessedImages
    ) -> tuple[list[int], list[ImageFeature]]:
        """The prompt with its image markers expanded to placeholders, and its images' features."""
        if not isinstance(multi_modal_data, ProcessedImages):
            multi_modal_data = self.process_images(request_id, prompt_token_ids, multi_modal_data)
        elif multi_modal_data.source_token_ids != tuple(prompt_token_ids):
            raise MultiModalInputError(
                f"request {request_id!r}: its processed images were made for another prompt "
                f"({len(multi_modal_data.source_token_ids)} tokens, not these {len(prompt_token_ids)})"
            )
        elif multi_modal_data.features and self.image_inputs is None:
            raise MultiModalInputError(
                f"request {request_id!r} has images, but this model ({self.model.shape.architecture}) takes text only"
            )
        return list(multi_modal_data.token_ids), list(multi_modal_data.features)

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

    def _add_sequence(
        self,
        sequence_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        request_id: str | None = None,
        *,
        features: list[ImageFeature] | None = None,
    ) -> None:
        request = Request(
            sequence_id,
            prompt_token_ids,
            params,
            eos_token_id=self._eos_token_id,
            block_size=self.settings.cache.block_size,
            cache_salt=self._cache_salt(params),
            mm_features=features or (),
        )
        self.scheduler.add_request(request)
        self.output_processor.add_sequence(
            sequence_id, prompt, prompt_token_ids, params, request.arrival_time, request_id
        )
        self.stats.num_prompt_tokens += len(prompt_token_ids)

    def _cache_salt(self, params: SamplingParams) -> bytes:
        """What enters the first block's hash (prefix cache and KV connector keys): the request's own
        ``cache_salt`` (a tenant's), then its adapter's identity (its weights' fingerprint)."""
        salt = b"" if params.cache_salt is None else b"\0salt:" + params.cache_salt.encode("utf-8", "surrogatepass")
        if params.lora is not None and self.lora is not None:
            salt += self.lora.identity(params.lora)
        return salt

    def check_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise ``ValueError`` naming the request if it cannot run here (vocabulary, lengths, logprobs, sampler).

        :meth:`add_request` calls it; a job can call it for every request
        before adding any, so that no result is written for a job that is invalid.
        """
        if not isinstance(request_id, str):
            raise ValueError(f"a request id must be a string, got {type(request_id).__name__} {request_id!r}")
        if self.pooling is not None:
            raise ValueError(
                f"request {request_id!r} asks to generate, but this engine pools (its settings' pooling: section, "
                f"task {self.pooling.task}); generation needs an engine without it"
            )
        check_request(request_id, prompt_token_ids, params, self.limits)
        self._check_sampling(request_id, params)
        self._check_lora(request_id, params)
        check_constraint(request_id, params, self.grammars)

    def _check_lora(self, request_id: str, params: SamplingParams) -> None:
        if params.lora is None:
            return
        if self.lora is None:
            raise ValueError(
                f"request {request_id!r} uses LoRA adapter {params.lora!r} but this run has no lora: section"
            )
        try:
            self.lora.check(params.lora)
        except LoRAAdapterError as exc:
            raise type(exc)(f"request {request_id!r}: {exc}") from None  # UnknownAdapterError stays one

    def load_lora_adapter(self, name: str, path: str) -> None:
        """Serve the PEFT adapter at ``path`` as ``name`` from now on; ``LoRAAdapterError`` naming it if it cannot
        run (``AdapterExistsError`` if an adapter of that name is loaded)."""
        self._runtime_lora(name).load(name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving adapter ``name``; ``AdapterInUseError`` while unfinished requests use it,
        ``UnknownAdapterError`` if it is not loaded."""
        lora = self._runtime_lora(name)
        users = sorted(
            request_id
            for request_id, request in self.scheduler.requests.items()
            if request.sampling_params.lora == name
        )
        if users:
            raise AdapterInUseError(
                f"LoRA adapter {name!r} is used by {len(users)} unfinished request(s) "
                f"({', '.join(users[:3])}); unload it when they have finished"
            )
        lora.unload(name)

    def _runtime_lora(self, name: str) -> LoRAManager:
        if self.lora is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: this run has no lora: section")
        return self.lora

    def _check_sampling(self, request_id: str, params: SamplingParams) -> None:
        # Prompt logprobs come from the runner, not the sampler.
        config = SamplerConfig(
            device=self.device.type,
            dtype=self.dtype,
            params_used=params.params_used() - {"prompt_logprobs"},
            random_sampling=not params.greedy,
        )
        reasons = self.sampler.validate(config)
        if reasons:
            raise ValueError(
                f"request {request_id!r}: sampler {self.settings.sampler.name!r} cannot serve it: " + "; ".join(reasons)
            )

    def abort(self, request_ids: list[str]) -> None:
        """Stop requests; their outputs finish with reason ``abort`` (returned by the next :meth:`step`)."""
        self._require_alive()
        sequence_ids = self.output_processor.sequence_ids(request_ids)
        self.scheduler.abort_requests(sequence_ids)
        self.output_processor.abort(sequence_ids, time.monotonic())

    def live_outputs(self, request_id: str) -> list[RequestOutput]:
        """The growing outputs of an unfinished request, one per sequence in index order (for streaming).

        A sequence of an ``n > 1`` request that already finished is included
        as finished.  Empty once the request has finished (its output came
        back from :meth:`step`) or for an unknown id.  The objects are the
        engine's own: read them between steps, never change them.
        """
        return self.output_processor.live_outputs(request_id)

    def discard(self, request_ids: list[str]) -> None:
        """Abort requests and forget them: no step returns their outputs, and their ids are free again."""
        self._require_alive()
        sequence_ids = self.output_processor.sequence_ids(request_ids)
        self.scheduler.abort_requests(sequence_ids)
        self.output_processor.discard(request_ids, sequence_ids)

    def has_unfinished_requests(self) -> bool:
        """Whether a :meth:`step` still has work or outputs (aborted requests are returned by the next step)."""
        self._require_alive()
        return self.scheduler.has_unfinished_requests() or bool(self.output_processor.aborted) or bool(self._batches)

    def close(self) -> None:
        """Release what outlives a step: the other tensor-parallel ranks' processes (idempotent; no-op for one rank).

        Ending the ranks also runs when the engine is collected or the interpreter exits.  A call also hands the
        freed blocks patchbay's block cache kept back to the C library (the cache is the process's: another
        engine refills it as it steps).
        """
        if self._close_ranks is not None:
            self._close_ranks()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.publish(self.kv_cache_manager.take_events())
            self.kv_event_publisher.close()
            self.kv_event_publisher = None
        release_kept_blocks()

    @property
    def is_dead(self) -> bool:
        """Whether an earlier error stopped the engine for good (every call then raises :class:`EngineDeadError`)."""
        return self._dead is not None

    def _require_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(
                f"the engine stopped after an error that may have corrupted its state "
                f"({self._dead}); create a new engine"
            )

    def _plugins(self) -> dict[str, list[Any]]:
        """The run's plugin objects by ``KIND:NAME``, to name the one an exception came from."""
        settings = self.settings
        runner = self.runner
        chosen_builder = settings.attention.metadata_builder
        builder_name = chosen_builder.name if chosen_builder is not None else type(runner.backend).metadata_builder
        plugins: dict[str, list[Any]] = {
            f"sampler:{settings.sampler.name}": [self.sampler],
            f"attention:{self.backend_name}": [runner.backend, *(b.impl for b in runner._bindings.values())],
            f"attention_metadata_builder:{builder_name}": list(runner.builders),
        }
        if settings.spec_decode is not None:
            plugins[f"drafter:{settings.spec_decode.name}"] = [runner.drafter]
            plugins[f"sampler:{settings.spec_decode.rejection_sampler.name}"] = [runner.rejection_sampler]
        if settings.kv_connector is not None and self.kv_connector is not None:
            plugins[f"kv_connector:{settings.kv_connector.name}"] = [
                self.kv_connector,
                runner.kv_connector,
                self.scheduler.kv_connector,
            ]
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
            finished = self._pipelined_step() if self.settings.runtime.pipeline_parallel_size > 1 else self._step()
            if self.kv_event_publisher is not None:
                self.kv_event_publisher.publish(self.kv_cache_manager.take_events())
            return finished
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

    def _apply_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, failed: dict[str, str]
    ) -> list[RequestOutput]:
        """Advance the scheduler by one batch's output and turn it into request outputs; the finished ones."""
        ran = time.perf_counter()
        errored = self.output_processor.fail(failed, time.monotonic())
        updates = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.stats.num_steps += 1
        now = time.monotonic()
        if not self.runner.samples:  # the last pipeline stage's runner verified the drafts: count them here
            sampled_by_id = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids, strict=True))
            for sequence_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
                if sampled_by_id.get(sequence_id):
                    self.spec_stats.record(
                        len(drafts), len(sampled_by_id[sequence_id]) - 1, self.scheduler.num_speculative_tokens
                    )
        self.output_processor.record_step_details(scheduler_output, runner_output)
        applied = self.output_processor.apply(updates, runner_output, errored, now)
        self.stats.num_generated_tokens += applied.num_generated_tokens
        for sequence_id, stop in applied.stopped:
            self.scheduler.finish_requests([sequence_id], "stop", stop)
        finished = self.output_processor.finish(applied.finished_ids)
        if self.runner.images is not None and not self.scheduler.has_unfinished_requests():
            # Idle: drop the encoder outputs the last step dropped (a failed request's) now, not at a next step.
            self.runner.images.cache.free(self.scheduler.encoder_cache.take_freed())
        self._engine_timings["finish"] += time.perf_counter() - ran
        self._check_liveness(scheduler_output.is_empty and not finished)
        return finished

    def _replay_failed_step(
        self, scheduler_output: SchedulerOutput, exc: Exception
    ) -> tuple[ModelRunnerOutput, dict[str, str]]:
        """Replay a step whose runner raised request by request; fail (and free) the requests that raise alone.

        With a KV connector the step's loads and saves are settled first and
        the replay neither loads nor saves.  With tensor-parallel ranks, every
        rank replays in step, which needs the failure to have come after the
        step's collectives (in sampling); otherwise, with pipeline stages, or
        with ranks and a connector or drafts, the engine stops.
        """
        send = None
        if self.ranks is not None:
            reason = self._why_ranks_cannot_replay()
            if reason is not None:
                raise self.ranks.failure(exc) or EngineDeadError(
                    f"a step failed with {parallel_settings(self.settings)}, where it cannot be replayed request "
                    f"by request ({reason}): {describe_failure(exc, self._plugins())}"
                ) from exc
            send = self._send_replayed_step
        logger.warning(
            "a step failed (%s); running its %d requests one by one to find the one at fault",
            describe_failure(exc, self._plugins()),
            len(scheduler_output.num_scheduled_tokens),
        )
        isolated = replay_alone(self.runner, self.scheduler, scheduler_output, self._plugins(), send)
        fail_requests(self.scheduler, isolated.errors)
        return isolated.output, isolated.errors

    def _why_ranks_cannot_replay(self) -> str | None:
        """Why the ranks cannot replay the step that just failed on this one (``None``: they can)."""
        settings = self.settings
        if settings.runtime.pipeline_parallel_size > 1:
            return "pipeline stages run different batches at once"
        if self.kv_connector is not None:
            return "the ranks join their KV transfer reports in a collective"
        if settings.spec_decode is not None:
            return "a drafter may run collectives after sampling"
        if self.runner.stage < StepStage.SAMPLING:
            return "it raised before the step's collectives, where the other ranks wait"
        return None

    def _send_replayed_step(self, step: SchedulerOutput) -> None:
        """Hand one step of a replay to the other ranks (rank 0's matchers fill its grammar rows first)."""
        assert self.ranks is not None
        if step.grammar_bitmasks is None:
            self.runner.fill_grammar_bitmasks(step)
        self.ranks.send_step(step)

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
            f"{section.stall_timeout:g} s (kv_connector.stall_timeout) with nothing else to run "
            f"({self.scheduler.connector_holdings()}): a request for which "
            "request_finished returned True must be reported by the worker side's get_finished (finished_sending), "
            "and an async load by get_finished (finished_recving)"
        )

    def step_timings(self) -> dict[str, float]:
        """Seconds spent per phase of a step since the last reset, in step order.

        ``schedule`` (the scheduler), ``compile`` (when a step had nothing to
        run but requests waiting for their grammars: the scheduler's wait on
        the compilations, taken out of ``schedule``), the runner's ``update`` (persistent
        batch), ``prepare`` (inputs and attention metadata), ``encoder`` (a
        vision-language model's image encoding), ``forward`` (the
        model, logits included), ``sample``, ``output`` (recording samples),
        ``draft`` (speculative proposals, when a drafter runs), ``pool`` (a pooling engine's pooler, in place of
        ``sample`` and ``output``), ``structure`` (filling and
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
        compile_wait = self.scheduler.grammar_wait_seconds - self._grammar_wait_start
        timings = {"schedule": self._engine_timings["schedule"] - compile_wait}
        if compile_wait > 0:
            timings["compile"] = compile_wait
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
        self._grammar_wait_start = self.scheduler.grammar_wait_seconds
        self.runner.timings.clear()
        if self.ranks is not None and self.ranks.group is not None:
            self.ranks.group.all_reduce_seconds = 0.0


def _tells_runner(scheduler_output: SchedulerOutput) -> bool:
    """Whether an empty batch still carries news for the runners' persistent batches (rows to drop)."""
    return bool(
        scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids or scheduler_output.reset_req_ids
    )
