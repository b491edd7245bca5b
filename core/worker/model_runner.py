"""The model runner: applies each step's schedule to the persistent batch, runs the model, samples.

The behaviour follows vLLM's v1 model runner, device-neutral: input
preparation is vectorised over the step's tokens (no per-token Python
loop), attention metadata is built once per KV-cache group and shared by
the group's layers, logits are computed only at the positions that are
sampled, and samples of partial (chunked) prefills are discarded.  A KV
connector's worker side, when one is configured, loads blocks before the
forward pass (``start_load_kv``), waits and saves per layer inside it, and
reports finished transfers and failed loads after it (with several ranks,
every rank's, joined: :mod:`patchbay.worker.parallel.kv_transfers`).

A runner of a pipeline stage other than the last (``samples=False``) runs
its layers and hands the hidden states on (the model's hooks send them);
it computes no logits and samples nothing: its persistent batch learns the
sampled tokens from the scheduler's ``CachedRequestData.new_token_ids``.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Container, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import torch

from patchbay.interfaces import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    DraftBatch,
    Drafter,
    DraftStep,
    KVConnectorWorker,
    RejectionSampler,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
)
from patchbay.interfaces.drafter import resolve_aux_layers
from patchbay.scheduling.kv_cache_spec import KVCacheGroup
from patchbay.scheduling.scheduler_output import ModelRunnerOutput, SchedulerOutput
from patchbay.scheduling.structured_output import GrammarCompilations
from patchbay.toolkit.forward_context import ForwardContext, LayerBinding, forward_context
from patchbay.toolkit.hidden_states import AuxHiddenStates
from patchbay.worker.model.hf_model import HFCausalLM, torch_dtype
from patchbay.worker.input_batch import InputBatch
from patchbay.worker.parallel.kv_transfers import RankTransferReports, TransferReport
from patchbay.worker.logprobs import Logprobs, PromptLogprobs
from patchbay.worker.lora.manager import LoRAManager
from patchbay.worker.multimodal.step_images import StepImages
from patchbay.worker.pooling import StepPooling
from patchbay.worker.spec_decode import (
    LogitsLayout,
    SpecDecodeStats,
    check_draft_proposals,
    logits_layout,
    may_draft,
    verify,
)
from patchbay.worker.structured_output import ConstrainedDecoding, apply_request_bitmasks


@dataclass
class StepInputs:
    """One step's flattened inputs."""

    rows: np.ndarray
    """Batch rows run this step, in row order."""
    num_scheduled: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    complete: np.ndarray
    """Per row: all of its known tokens are in the cache after this step, so it samples.
    The others run a partial (chunked) prefill, whose sample would be discarded: it is never drawn."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    layout: LogitsLayout
    """Where logits are computed: the last token of each sampling row, and every draft position."""
    drafts: list[list[int]]
    """Draft tokens verified this step, per sampling row."""
    group_metadata: list[Any]
    common_metadata: CommonAttentionMetadata
    """The first KV-cache group's backend-neutral metadata (what drafters with their own attention reuse)."""
    num_rejected: np.ndarray | None = None
    """Per row, drafts rejected this step (set once the samples are recorded)."""


def _consecutive_runs(ids: list[int]) -> list[tuple[int, int]]:
    """Sorted ids as ``[start, stop)`` runs of consecutive values."""
    runs: list[tuple[int, int]] = []
    for block in ids:
        if runs and runs[-1][1] == block:
            runs[-1] = (runs[-1][0], block + 1)
        elif not runs or runs[-1][1] < block:
            runs.append((block, block + 1))
    return runs


def _unwritten(shape: tuple[int, ...], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Memory for a KV-cache tensor whose blocks are zeroed as they are first used (its bytes are stale)."""
    return torch.empty(shape, dtype=dtype, device=device)


class StepStage(IntEnum):
    """How far the runner's current (or last) step got: where a failed step stopped, for its replay."""

    STARTED = 0
    LOADING = 1
    """The KV connector's loads of the step have started."""
    FORWARD_DONE = 2
    """The forward pass ran, and the connector's saves of the step are handed over."""
    SAMPLING = 3
    """Logits computed: every collective of the step (tensor-parallel gathers) is done."""
    REPORTED = 4
    """The connector's transfer reports are in the step's output."""


class ModelRunner:
    """Executes scheduler steps on one device."""

    def __init__(
        self,
        model: HFCausalLM,
        *,
        backend: AttentionBackend,
        builders: list[AttentionMetadataBuilder],
        sampler: Sampler,
        groups: list[KVCacheGroup],
        num_blocks: int,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device,
        eos_token_ids: tuple[int, ...] = (),
        drafter: Drafter | None = None,
        drafter_name: str = "",
        sampler_name: str = "",
        rejection_sampler: RejectionSampler | None = None,
        num_speculative_tokens: int = 0,
        kv_connector: KVConnectorWorker | None = None,
        kv_reports: RankTransferReports | None = None,
        grammars: GrammarCompilations | None = None,
        single_thread_max_tokens: int = 0,
        samples: bool = True,
        lora: LoRAManager | None = None,
        pooling: StepPooling | None = None,
    ) -> None:
        self.model = model
        self.pooling = pooling
        """A pooling runner's pooler and kept hidden states (``None``: the runner samples)."""
        self.causal: bool = getattr(model, "causal", True)
        """Whether the model attends causally; an encoder-only one keeps no KV cache and runs prompts whole."""
        self.samples = samples
        self.lora = lora
        """The LoRA adapter slots (``None``: a run without a ``lora:`` section)."""
        """Whether this runner computes logits and samples (``False``: a pipeline stage before the last)."""
        self.single_thread_max_tokens = single_thread_max_tokens
        """Steps of at most this many tokens run on one thread: a sleeping OpenMP thread's wake-up, paid once
        per parallel product, costs more than a second core gains on a few-row product (measured by the
        machine's tuning, :mod:`patchbay.worker.cpu.tuning`)."""
        self.backend = backend
        self.builders = builders
        self.sampler = sampler
        self.groups = groups
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.drafter = drafter
        self.drafter_name = drafter_name or (
            f"drafter {type(drafter).__module__}.{type(drafter).__qualname__}" if drafter is not None else ""
        )
        """How errors about the drafter's proposals name it (``drafter:NAME`` when the engine built it)."""
        self.aux_hidden_states = self._aux_capture(model, drafter)
        """Captures the target layers the (loaded) drafter reads, during the forward pass; ``None``: none."""
        self.rejection_sampler = rejection_sampler
        self.num_speculative_tokens = num_speculative_tokens
        self.spec_stats = SpecDecodeStats()
        self.batch = InputBatch(
            max_num_reqs=max_num_reqs,
            max_model_len=max_model_len,
            block_sizes=[g.spec.block_size for g in groups],
            device=device,
        )
        self.prompt_logprobs = PromptLogprobs(model, self.batch)
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        self._bindings = self._bind_layers()
        self.kv_connector = kv_connector
        self.stage = StepStage.STARTED
        """How far the current step got (read when it raised)."""
        self.kv_reports = kv_reports
        """With several ranks: joins this rank's connector reports with the other ranks' after each step."""
        if kv_connector is not None:
            kv_connector.register_kv_caches(self.kv_caches, split=backend.split_kv_cache)
        # Scratch index vector, sliced each step instead of allocated.
        self._arange = np.arange(max(max_num_batched_tokens, max_model_len) + 1, dtype=np.int32)
        self.timings: dict[str, float] = defaultdict(float)
        """Seconds spent per phase since creation: update, prepare, encoder (images), forward, pool (a pooling
        runner's pooler), structure, sample, output."""
        self.num_steps = 0
        sampler_name = sampler_name or f"sampler {type(sampler).__module__}.{type(sampler).__qualname__}"
        self.constrained = ConstrainedDecoding(grammars, sampler_name) if grammars is not None else None
        """Grammar matchers of the constrained requests (``None``: the run has no grammar backend)."""
        self.images = StepImages(model.vision) if model.vision is not None else None
        """The running requests' images and the encoder cache (``None``: the model takes text only)."""

    # -- setup -----------------------------------------------------------------------------

    def _allocate_kv_caches(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """One cache tensor per layer. On the CPU they are left unwritten and each block is zeroed when first
        handed out (:meth:`_zero_new_blocks`): zeroing a pool of many GiB up front costs seconds of page
        faults at every start, and memory the run may never need."""
        lazy = self.device.type == "cpu"
        allocate = _unwritten if lazy else torch.zeros
        caches = {}
        for group in self.groups:
            spec = group.spec
            if spec.latent:  # MLA: one row per token, keys and values in it
                shape = self.backend.latent_kv_cache_shape(num_blocks, spec.block_size, spec.row_size)
            else:
                shape = self.backend.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.row_size)
            for layer_name in group.layer_names:
                caches[layer_name] = allocate(shape, dtype=torch_dtype(spec.dtype), device=self.device)
        # Blocks read before any step writes them must hold zeros, not stale bytes that may be NaN: masked
        # attention multiplies their weights of zero by them. Block 0 (the null block) pads every block table.
        # Each KV-cache group hands out its own blocks, so each keeps its own record.
        self._unzeroed = [np.ones(num_blocks, dtype=bool) for _ in self.groups] if lazy else None
        self._checked_below = [1] * len(self.groups)
        """Per group, every block below this id is zeroed (those the scheduler reported allocated)."""
        if lazy:
            for group_index in range(len(self.groups)):
                self._zero_blocks(caches, group_index, [0])
        return caches

    def _zero_allocated_blocks(self, highest: tuple[int, ...]) -> None:
        """Zero the blocks up to each group's ``highest`` allocated id not zeroed yet (CPU pools only): a
        request waiting on a KV connector's load holds blocks no block table shows yet."""
        if self._unzeroed is None:
            return
        for group, top in enumerate(highest):
            start = self._checked_below[group]
            if top < start:
                continue  # no block allocated since the last step: nothing to scan on the step's path
            fresh = start + np.flatnonzero(self._unzeroed[group][start : top + 1])
            if len(fresh):
                self._zero_blocks(self.kv_caches, group, fresh.tolist())
            self._checked_below[group] = top + 1

    def zero_first_blocks(self, count: int) -> int:
        """Zero now the pool's blocks ``1 .. count - 1`` that no step zeroed yet, in every KV-cache group (CPU
        pools only; elsewhere the pool is zeroed at start); returns how many blocks that was.

        A CPU pool is left unwritten and each block zeroed when first handed out, so the first write to each
        of its pages is a page fault the step pays: under a hypervisor whose memory another process had just
        given back, those faults took 20-28 % of a step of 32 requests.  Never-used blocks are handed out in id
        order before any freed one, so a caller who knows how many blocks a run will take (``patchbay bench``,
        before it times a workload, as vLLM's pool is zeroed at load) can take that cost out of the run.
        """
        if self._unzeroed is None:
            return 0
        zeroed = 0
        for group, unzeroed in enumerate(self._unzeroed):
            fresh = 1 + np.flatnonzero(unzeroed[1 : max(1, min(count, len(unzeroed)))])
            if len(fresh):
                self._zero_blocks(self.kv_caches, group, fresh.tolist())
                zeroed += len(fresh)
        return zeroed

    def _zero_new_blocks(self, group: int, block_ids: list[int]) -> None:
        """Zero the blocks among group ``group``'s ``block_ids`` that no step was given before (CPU pools only)."""
        if self._unzeroed is None or not block_ids:
            return
        ids = np.asarray(block_ids, dtype=np.int64)
        fresh = ids[self._unzeroed[group][ids]]
        if len(fresh):
            self._zero_blocks(self.kv_caches, group, fresh.tolist())

    def _zero_blocks(self, caches: dict[str, torch.Tensor], group: int, block_ids: list[int]) -> None:
        assert self._unzeroed is not None
        # One call over every layer's runs of consecutive blocks, not an index_fill_ per layer and part (two
        # fresh blocks of SmolLM2's 30 layers: 0.28 ms against 0.52).
        runs = _consecutive_runs(sorted(block_ids))
        latent = self.groups[group].spec.latent  # a latent cache is one tensor of blocks, no key/value halves
        parts = [
            part[start:stop]
            for layer_name in self.groups[group].layer_names
            for part in ((caches[layer_name],) if latent else self.backend.split_kv_cache(caches[layer_name]))
            for start, stop in runs
        ]
        if parts:  # an encoder-only model's group has no layers: its blocks are only counted
            torch._foreach_zero_(parts)
        self._unzeroed[group][block_ids] = False

    def _bind_layers(self) -> dict[int, LayerBinding]:
        group_of = {name: index for index, group in enumerate(self.groups) for name in group.layer_names}
        # An encoder-only model's layers keep no cache: an empty tensor, and the (layerless) group 0's metadata.
        no_cache = torch.empty(0, device=self.device)
        return {
            layer_idx: LayerBinding(
                self.backend.make_impl(spec),
                self.kv_caches.get(spec.layer_name, no_cache),
                group_of.get(spec.layer_name, 0),
                spec.layer_name,
            )
            for layer_idx, spec in self.model.layer_specs.items()
        }

    # -- one step --------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return the sampled tokens of every request that ran."""
        threads = torch.get_num_threads()
        if threads < 2 or not 0 < scheduler_output.total_num_scheduled_tokens <= self.single_thread_max_tokens:
            return self._execute(scheduler_output)
        torch.set_num_threads(1)
        try:
            return self._execute(scheduler_output)
        finally:
            torch.set_num_threads(threads)

    def _execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return the sampled tokens of every request that ran."""
        self.stage = StepStage.STARTED
        clock = time.perf_counter()
        self._zero_allocated_blocks(scheduler_output.highest_block_ids)
        self._update_states(scheduler_output)
        clock = self._lap("update", clock)
        connector = self.kv_connector
        if scheduler_output.is_empty:
            if self.images is not None:
                self.images.cache.free(scheduler_output.free_encoder_hashes)
            output = ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
            if connector is not None:  # async transfers go on, and are reported, while nothing runs
                connector.start_load_kv(scheduler_output.kv_connector_metadata)
                connector.wait_for_save()
                self._report_transfers(scheduler_output, output)
            return output
        step = self._prepare_inputs(scheduler_output)
        clock = self._lap("prepare", clock)
        positions, inputs_embeds = step.positions, None
        if self.images is not None:
            self.images.encode(scheduler_output.free_encoder_hashes, scheduler_output.scheduled_encoder_inputs)
            clock = self._lap("encoder", clock)
            positions, inputs_embeds = self._image_inputs(step)
            clock = self._lap("prepare", clock)
        if connector is not None:
            connector.start_load_kv(scheduler_output.kv_connector_metadata)
            self.stage = StepStage.LOADING
        if self.lora is not None:
            self.lora.begin_step([self.batch.sampling_params[row].lora for row in step.rows], step.num_scheduled)
        try:
            with forward_context(ForwardContext(self._bindings, step.group_metadata, connector)):
                if self.pooling is not None:
                    hidden_states = self._pooling_forward(step)
                else:
                    hidden_states = self.model.hidden_states(step.input_ids, positions, inputs_embeds)
        finally:
            if self.lora is not None:
                self.lora.end_step()
        if connector is not None:
            connector.wait_for_save()
        self.stage = StepStage.FORWARD_DONE
        if not self.samples:
            # An earlier pipeline stage: its hidden states are on their way to the next stage (the hooks sent them).
            self.batch.num_computed_tokens[step.rows] = step.seq_lens
            output = ModelRunnerOutput(
                req_ids=[self.batch.req_ids[row] for row in step.rows], sampled_token_ids=[[] for _ in step.rows]
            )
            if connector is not None:  # every rank joins the transfer reports, after every step
                self._report_transfers(scheduler_output, output)
            self._lap("forward", clock)
            self.num_steps += 1
            return output
        if self.pooling is not None:
            return self._pool(step, hidden_states, self._lap("forward", clock))
        sample_rows = step.rows[step.complete]
        logits = None
        if len(sample_rows):
            logits = self.model.logits(hidden_states[torch.from_numpy(step.layout.logits_indices).to(self.device)])
        prompt_logprobs = self.prompt_logprobs.collect(
            step.rows, step.seq_lens, step.num_scheduled, step.query_start_loc, step.complete, hidden_states
        )
        clock = self._lap("forward", clock)
        self.stage = StepStage.SAMPLING  # no collective from here to the output (a drafter's aside)
        constrained = self.constrained if self.constrained is not None and self.constrained.matchers else None
        sample_req_ids = [self.batch.req_ids[row] for row in sample_rows]
        shipped = scheduler_output.grammar_bitmasks
        if shipped and logits is not None:  # several ranks: every rank applies rank 0's rows alike
            layout = step.layout
            apply_request_bitmasks(logits, shipped, sample_req_ids, layout.bonus_indices - layout.num_drafts)
            clock = self._lap("structure", clock)
        elif constrained is not None and logits is not None and shipped is None:
            layout = step.layout
            constrained.mask(logits, sample_req_ids, step.drafts, layout.bonus_indices - layout.num_drafts)
            clock = self._lap("structure", clock)
        new_tokens: list[list[int]] = []
        sampler_output = None
        if logits is not None:
            metadata = self._sampling_metadata(sample_rows)
            if step.layout.has_drafts:
                bonus_logits = logits[torch.from_numpy(step.layout.bonus_indices).to(self.device)]
                sampler_output = self.sampler.sample(bonus_logits, metadata)
                assert self.rejection_sampler is not None  # a run that drafts has one
                new_tokens = verify(
                    self.rejection_sampler,
                    step.layout,
                    logits,
                    step.drafts,
                    sampler_output.sampled_token_ids,
                    metadata,
                    self.model.shape.vocab_size,
                )
            else:
                sampler_output = self.sampler.sample(logits, metadata)
                new_tokens = [[token] for token in sampler_output.sampled_token_ids[:, 0].tolist()]
        clock = self._lap("sample", clock)
        if constrained is not None:
            constrained.advance(sample_req_ids, new_tokens)
            clock = self._lap("structure", clock)
        output = self._record_samples(step, new_tokens, sampler_output)
        if self.constrained is not None:
            output.failed = self.constrained.take_failed()
        output.prompt_logprobs = prompt_logprobs
        if connector is not None:
            self._report_transfers(scheduler_output, output)
        self.stage = StepStage.REPORTED
        clock = self._lap("output", clock)
        if self.drafter is not None and len(sample_rows):
            output.draft_token_ids = self._propose_drafts(step, hidden_states, new_tokens)
            self._lap("draft", clock)
        self.num_steps += 1
        return output

    def _pooling_forward(self, step: StepInputs) -> torch.Tensor:
        """A pooling model's forward pass, with each token's type (a BERT pair's segments) where requests have them."""
        assert self.pooling is not None
        req_ids = [self.batch.req_ids[row] or "" for row in step.rows]
        types = self.pooling.token_type_ids(req_ids, step.num_scheduled, step.positions.cpu().numpy())
        if types is None:
            return self.model.hidden_states(step.input_ids, step.positions)
        model: Any = self.model  # a pooling model (HFPoolingModel) takes token types
        return model.hidden_states(step.input_ids, step.positions, token_type_ids=self._to_device(types))

    def _pool(self, step: StepInputs, hidden_states: torch.Tensor, clock: float) -> ModelRunnerOutput:
        """A pooling step's end: the pooler's vectors of the requests whose prompt finished; nothing is sampled."""
        assert self.pooling is not None
        batch = self.batch
        req_ids = [batch.req_ids[row] or "" for row in step.rows]
        pooled = self.pooling.pool(
            req_ids, step.seq_lens, step.num_scheduled, step.query_start_loc, step.complete, hidden_states
        )
        batch.num_computed_tokens[step.rows] = step.seq_lens
        self.stage = StepStage.REPORTED
        self._lap("pool", clock)
        self.num_steps += 1
        return ModelRunnerOutput(req_ids=list(req_ids), sampled_token_ids=[[] for _ in step.rows], pooled=pooled)

    @contextmanager
    def connector_paused(self) -> Iterator[None]:
        """Steps run inside neither load nor save through the KV connector (a failed step's replay: its loads
        are in place and its saves handed over already)."""
        connector, self.kv_connector = self.kv_connector, None
        try:
            yield
        finally:
            self.kv_connector = connector

    def settle_connector(self, scheduler_output: SchedulerOutput, stage: StepStage) -> None:
        """Before a step that raised at ``stage`` is replayed: do what it left undone of its KV connector work
        up to the forward pass. Its loads start, and are waited for (the replay reads those blocks); its saves
        (of blocks earlier steps computed, still intact) are handed over: a save barrier before the replay
        writes anything."""
        connector = self.kv_connector
        if connector is None:
            return
        if stage < StepStage.LOADING:
            connector.start_load_kv(scheduler_output.kv_connector_metadata)
        if stage < StepStage.FORWARD_DONE:
            for binding in self._bindings.values():
                connector.wait_for_layer_load(binding.layer_name)
            connector.wait_for_save()

    def report_connector(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput, stage: StepStage) -> None:
        """After a step that raised at ``stage`` was replayed: put its KV transfer reports in ``output``, unless
        it got them before it raised."""
        if self.kv_connector is not None and stage < StepStage.REPORTED:
            self._report_transfers(scheduler_output, output)

    def fill_grammar_bitmasks(self, scheduler_output: SchedulerOutput) -> None:
        """Rank 0, before it hands a step to the other ranks: fill the step's structured-output bitmask rows.

        Applies the step's request changes to the matchers first (the step's
        own update then leaves them alone), and puts the rows of every
        constrained request that samples in the step into
        ``scheduler_output.grammar_bitmasks`` (empty when none does), for all
        ranks to apply alike.  Runs without ranks only in tests: one process
        fills its rows inside the step instead.
        """
        constrained = self.constrained
        if constrained is None:
            scheduler_output.grammar_bitmasks = {}
            return
        clock = time.perf_counter()
        constrained.update(
            scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids | scheduler_output.reset_req_ids,
            scheduler_output.scheduled_new_reqs,
        )
        cached = scheduler_output.scheduled_cached_reqs
        if not self.samples and cached.new_token_ids:
            # A first pipeline stage samples nothing: its matchers accept the tokens the last stage sampled.
            constrained.advance(cached.req_ids, cached.new_token_ids)
        scheduler_output.grammar_bitmasks = (
            constrained.fill_step(
                self._sampling_req_ids(scheduler_output, constrained.matchers),
                scheduler_output.scheduled_spec_decode_tokens,
            )
            if constrained.matchers
            else {}
        )
        self._lap("structure", clock)

    def _sampling_req_ids(self, scheduler_output: SchedulerOutput, among: Container[str]) -> list[str]:
        """The requests among ``among`` that sample in the step: all their known tokens are in the cache after it.

        Read before the step updates the batch (the test of ``StepInputs.complete``): a new request
        knows its tokens; one already in the batch has the batch's count.
        """
        scheduled = scheduler_output.num_scheduled_tokens
        sampling = [
            request.req_id
            for request in scheduler_output.scheduled_new_reqs
            if request.req_id in among
            and request.num_computed_tokens + scheduled.get(request.req_id, 0)
            >= len(request.prompt_token_ids) + len(request.output_token_ids)
        ]
        cached = scheduler_output.scheduled_cached_reqs
        index = self.batch.req_id_to_index
        # A stage that samples nothing learns the sampled tokens with the step (new_token_ids), not yet applied.
        unseen = (
            [len(tokens) for tokens in cached.new_token_ids]
            if not self.samples and cached.new_token_ids
            else [0] * len(cached.req_ids)
        )
        for req_id, num_computed, num_unseen in zip(cached.req_ids, cached.num_computed_tokens, unseen, strict=True):
            if (
                req_id in among
                and num_computed + scheduled[req_id] >= self.batch.num_tokens[index[req_id]] + num_unseen
            ):
                sampling.append(req_id)
        return sampling

    def _report_transfers(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """Put the connector's finished transfers and failed loads into ``output`` (every rank's, with several)."""
        assert self.kv_connector is not None
        sending, recving = self.kv_connector.get_finished(set(scheduler_output.finished_req_ids))
        report = TransferReport(set(sending), set(recving), set(self.kv_connector.get_block_ids_with_load_errors()))
        if self.kv_reports is not None:
            report = self.kv_reports.exchange(report)
        output.finished_sending, output.finished_recving = report.finished_sending, report.finished_recving
        output.invalid_block_ids = report.invalid_block_ids

    def _lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.timings[phase] += now - since
        return now

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.batch
        dropped = (
            scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids | scheduler_output.reset_req_ids
        )
        # A request rolled back for recompute discards what it sampled last step: its stream draws that again.
        batch.sampling.rewind(scheduler_output.reset_req_ids)
        if scheduler_output.drops_failed_step:
            batch.sampling.rewind_default()
        batch.sampling.begin_step(self.device)
        for req_id in dropped:
            batch.remove_request(req_id)
            self.prompt_logprobs.forget(req_id)
            if self.pooling is not None:
                self.pooling.remove_request(req_id)
            if self.images is not None:
                self.images.remove_request(req_id)
        for req_id in scheduler_output.finished_req_ids:
            batch.forget_request(req_id)
        for request in scheduler_output.scheduled_new_reqs:
            for group, block_ids in enumerate(request.block_ids):
                self._zero_new_blocks(group, block_ids)
            batch.add_request(request)
            self.prompt_logprobs.forget(request.req_id)
            if self.pooling is not None:
                self.pooling.add_request(request.req_id, request.pooling)
            if self.images is not None:
                self.images.add_request(request.req_id, len(request.prompt_token_ids), request.mm_features)
        if self.constrained is not None and scheduler_output.grammar_bitmasks is None:
            self.constrained.update(dropped, scheduler_output.scheduled_new_reqs)  # ranks: fill_grammar_bitmasks did
        cached = scheduler_output.scheduled_cached_reqs
        if cached.new_token_ids and not self.samples:
            # 2 tokens known, [7, 9] sampled since: token_ids[row, 2:4] = [7, 9], num_tokens[row] = 4
            for req_id, token_ids in zip(cached.req_ids, cached.new_token_ids, strict=True):
                row = batch.req_id_to_index[req_id]
                start = batch.num_tokens[row]
                batch.token_ids[row, start : start + len(token_ids)] = token_ids
                batch.num_tokens[row] = start + len(token_ids)
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = batch.req_id_to_index[req_id]
            batch.num_computed_tokens[row] = num_computed
            if new_block_ids is not None:
                for group, (table, block_ids) in enumerate(zip(batch.block_tables, new_block_ids, strict=True)):
                    if block_ids:
                        self._zero_new_blocks(group, block_ids)
                        table.append_to_row(row, block_ids)
        batch.condense()
        self._maybe_reorder(scheduler_output)

    def _maybe_reorder(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.batch
        num_scheduled = [
            scheduler_output.num_scheduled_tokens.get(batch.req_ids[row] or "", 0) for row in range(batch.num_rows)
        ]
        order = self.builders[0].reorder_batch(num_scheduled)
        if order is not None:
            batch.reorder(order)

    def _prepare_inputs(self, scheduler_output: SchedulerOutput) -> StepInputs:
        batch = self.batch
        index = batch.req_id_to_index
        rows = np.fromiter((index[req_id] for req_id in scheduler_output.num_scheduled_tokens), dtype=np.int64)
        order = np.argsort(rows)
        rows = rows[order]
        num_scheduled = np.fromiter(scheduler_output.num_scheduled_tokens.values(), dtype=np.int32)[order]
        total = int(num_scheduled.sum())
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        drafts_by_row = [spec_tokens.get(batch.req_ids[row], []) for row in rows] if spec_tokens else []
        for row, drafts in zip(rows, drafts_by_row, strict=False):
            # Drafts sit after the known tokens for the gather below; they count as known only once accepted.
            batch.token_ids[row, batch.num_tokens[row] : batch.num_tokens[row] + len(drafts)] = drafts
        cu_num_scheduled = np.cumsum(num_scheduled, dtype=np.int32)

        # Request (position in `rows`) of every token: [2, 5, 3] -> [0, 0, 1, 1, 1, 1, 1, 2, 2, 2]
        token_request = np.repeat(np.arange(len(rows)), num_scheduled)
        token_rows = rows[token_request]
        # Offset of every token inside its request's chunk: [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]
        offsets = self._arange[:total] - np.repeat(cu_num_scheduled - num_scheduled, num_scheduled)
        num_computed = batch.num_computed_tokens[rows]
        positions = num_computed[token_request] + offsets
        input_ids = batch.token_ids[token_rows, positions]
        seq_lens = num_computed + num_scheduled
        query_start_loc = np.zeros(len(rows) + 1, dtype=np.int32)
        query_start_loc[1:] = cu_num_scheduled

        to_device = self._to_device
        query_start_loc_cpu = torch.from_numpy(query_start_loc)
        seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        group_metadata = []
        commons = []
        for table, builder in zip(batch.block_tables, self.builders, strict=True):
            max_blocks = int(-(-seq_lens.max() // table.block_size))
            common = CommonAttentionMetadata(
                query_start_loc=to_device(query_start_loc_cpu),
                query_start_loc_cpu=query_start_loc_cpu,
                seq_lens=to_device(seq_lens_cpu),
                seq_lens_cpu=seq_lens_cpu,
                num_computed_tokens_cpu=torch.from_numpy(num_computed.astype(np.int32)),
                block_table=to_device(torch.from_numpy(table.table[rows, :max_blocks])),
                slot_mapping=to_device(torch.from_numpy(table.slot_mapping(token_rows, positions))),
                num_reqs=len(rows),
                num_actual_tokens=total,
                max_query_len=int(num_scheduled.max()),
                max_seq_len=int(seq_lens.max()),
                block_size=table.block_size,
                causal=self.causal,
            )
            group_metadata.append(builder.build(common))
            commons.append(common)
        complete = seq_lens >= batch.num_tokens[rows]
        num_drafts = (
            np.array([len(d) for d in drafts_by_row], dtype=np.int64)
            if drafts_by_row
            else np.zeros(len(rows), dtype=np.int64)
        )
        return StepInputs(
            rows=rows,
            num_scheduled=num_scheduled,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            complete=complete,
            input_ids=to_device(torch.from_numpy(input_ids.astype(np.int64))),
            positions=to_device(torch.from_numpy(positions.astype(np.int64))),
            layout=logits_layout(cu_num_scheduled, num_drafts, complete),
            drafts=[d for d, done in zip(drafts_by_row, complete, strict=True) if done] if drafts_by_row else [],
            group_metadata=group_metadata,
            common_metadata=commons[0],
        )

    def _image_inputs(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The step's positions (M-RoPE ones for a Qwen2-VL) and its input embeddings with image rows merged
        (``None``: no chunk reaches an image)."""
        assert self.images is not None
        req_ids = [self.batch.req_ids[row] or "" for row in step.rows]
        starts = step.seq_lens - step.num_scheduled
        flat = step.positions.cpu().numpy()
        positions = self.images.positions(req_ids, starts, step.num_scheduled, flat)
        embeds = self.images.inputs_embeds(self.model.embed, step.input_ids, req_ids, starts, step.num_scheduled)
        return self._to_device(torch.from_numpy(np.ascontiguousarray(positions))), embeds

    def _to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return tensor
        return tensor.to(self.device, non_blocking=True)

    def _sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        batch = self.batch
        return batch.sampling.metadata(
            rows,
            [batch.req_ids[row] for row in rows],
            [batch.sampling_params[row] for row in rows],
            output_token_ids=lambda: batch.output_token_ids(rows),
            prompt_token_ids=lambda: batch.prompt_token_ids(rows, pad=self.model.shape.vocab_size),
            vocab_size=self.model.shape.vocab_size,
            eos_token_ids=self.eos_token_ids,
            device=self.device,
        )

    def _record_samples(
        self, step: StepInputs, new_tokens: list[list[int]], sampler_output: SamplerOutput | None
    ) -> ModelRunnerOutput:
        batch = self.batch
        req_ids = [batch.req_ids[row] for row in step.rows]
        sampled_lists: list[list[int]] = [[] for _ in step.rows]
        positions = np.flatnonzero(step.complete)
        num_rejected = np.zeros(len(step.rows), dtype=np.int32)
        if step.layout.has_drafts:
            for position, tokens, drafted in zip(positions, new_tokens, step.layout.num_drafts.tolist(), strict=True):
                row = step.rows[position]
                start = batch.num_tokens[row]
                batch.token_ids[row, start : start + len(tokens)] = tokens
                batch.num_tokens[row] = start + len(tokens)
                sampled_lists[position] = tokens
                num_rejected[position] = drafted + 1 - len(tokens)
                if drafted:
                    self.spec_stats.record(drafted, len(tokens) - 1, self.num_speculative_tokens)
        elif len(positions):
            batch.append_tokens(step.rows[positions], np.array([tokens[0] for tokens in new_tokens]))
            for position, tokens in zip(positions, new_tokens, strict=True):
                sampled_lists[position] = tokens
        batch.num_computed_tokens[step.rows] = step.seq_lens - num_rejected
        step.num_rejected = num_rejected
        logprobs = self._logprobs(step, positions, sampler_output) if sampler_output is not None else None
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_lists, logprobs=logprobs)

    @staticmethod
    def _aux_capture(model: HFCausalLM, drafter: Drafter | None) -> AuxHiddenStates | None:
        """Hooks on the decoder layers the drafter reads (asked after its ``load``); ``None`` when it reads none."""
        layers = drafter.aux_hidden_state_layers() if drafter is not None else ()
        if not layers:
            return None
        return model.capture_hidden_states(
            resolve_aux_layers(layers, model.shape.num_layers, drafter=type(drafter).__name__)
        )

    def _propose_drafts(
        self, step: StepInputs, hidden_states: torch.Tensor, new_tokens: list[list[int]]
    ) -> list[list[int]]:
        """Ask the drafter for the next step's drafts, for the step's requests in step order.

        Every request of the step is in the batch (so it lines up with the
        step a drafter with its own attention replays); those still
        prefilling, near ``max_model_len`` or whose sampling cannot be
        verified are in ``skip``.
        """
        batch = self.batch
        drafter = self.drafter
        assert drafter is not None and step.num_rejected is not None
        rows = step.rows
        sampled: list[list[int]] = [[] for _ in rows]
        for position, tokens in zip(np.flatnonzero(step.complete), new_tokens, strict=True):
            sampled[position] = tokens
        skip = {
            i
            for i, row in enumerate(rows)
            if not step.complete[i]
            or not may_draft(batch.sampling_params[row])
            or batch.num_tokens[row] + 1 >= batch.max_model_len
        }
        capabilities = drafter.capabilities
        # The hidden state behind each request's last token: its chunk's last position minus the rejected drafts.
        ends = step.query_start_loc[1:] - 1 - step.num_rejected
        draft_batch = DraftBatch(
            req_ids=[batch.req_ids[row] for row in rows],
            token_ids=[batch.token_ids[row, : batch.num_tokens[row]] for row in rows],
            num_speculative_tokens=self.num_speculative_tokens,
            max_model_len=batch.max_model_len,
            sampled_token_ids=sampled,
            hidden_states=hidden_states[torch.from_numpy(ends).to(self.device)]
            if capabilities.needs_hidden_states
            else None,
            skip=skip,
        )
        if capabilities.needs_attention_metadata or self.aux_hidden_states is not None:
            draft_batch.step = DraftStep(
                token_ids=step.input_ids,
                positions=step.positions,
                hidden_states=hidden_states,
                query_start_loc=step.query_start_loc,
                num_rejected=step.num_rejected,
                attention_metadata=step.common_metadata,
                aux_hidden_states=self.aux_hidden_states.latest() if self.aux_hidden_states is not None else None,
            )
        proposals = drafter.propose(draft_batch).draft_token_ids
        # Checked here, where they arrive: a bad id would otherwise fail the next step inside torch, unnamed.
        return check_draft_proposals(
            self.drafter_name,
            proposals,
            draft_batch.req_ids,
            [int(batch.num_tokens[row]) for row in rows],
            skip,
            vocab_size=self.model.shape.vocab_size,
            max_drafts=self.num_speculative_tokens,
            max_model_len=batch.max_model_len,
        )

    def _logprobs(self, step: StepInputs, positions: np.ndarray, sampler_output: SamplerOutput) -> list[Any] | None:
        """Per step row, the sampled token's logprobs when its request asked for them (else ``None``)."""
        if sampler_output.logprobs is None:
            return None
        # A sampler that returns logprobs returns their token ids and the sampled tokens' ranks with them.
        assert sampler_output.logprob_token_ids is not None and sampler_output.sampled_token_ranks is not None
        token_ids = sampler_output.logprob_token_ids.cpu().tolist()
        values = sampler_output.logprobs.cpu().tolist()
        ranks = sampler_output.sampled_token_ranks.cpu().tolist()
        found: list[Any] = [None] * len(step.rows)
        for sample_index, position in enumerate(positions):
            wanted = self.batch.sampling_params[step.rows[position]].logprobs
            if wanted is not None:
                found[position] = Logprobs(
                    token_ids[sample_index][: wanted + 1], values[sample_index][: wanted + 1], ranks[sample_index]
                )
        return found
