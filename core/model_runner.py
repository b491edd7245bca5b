"""The model runner: applies each step's schedule to the persistent batch, runs the model, samples.

The behaviour follows vLLM's v1 model runner, device-neutral: input
preparation is vectorised over the step's tokens (no per-token Python
loop), attention metadata is built once per KV-cache group and shared by
the group's layers, logits are computed only at the positions that are
sampled, and samples of partial (chunked) prefills are discarded.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from patchbay.forward_context import ForwardContext, LayerBinding, forward_context
from patchbay.hf_model import HFCausalLM, torch_dtype
from patchbay.input_batch import InputBatch
from patchbay.interfaces import (
    AttentionBackend,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
)
from patchbay.kv_cache_spec import KVCacheGroup
from patchbay.scheduler_output import ModelRunnerOutput, SchedulerOutput


@dataclass
class Logprobs:
    """Logprobs of one sampled token: the sampled token first, then the top-``n`` alternatives."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


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
    logits_indices: torch.Tensor
    """Flattened positions of the last token of each sampling row."""
    group_metadata: list[Any]


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
    ) -> None:
        self.model = model
        self.backend = backend
        self.builders = builders
        self.sampler = sampler
        self.groups = groups
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.batch = InputBatch(
            max_num_reqs=max_num_reqs, max_model_len=max_model_len, block_sizes=[g.spec.block_size for g in groups],
            device=device,
        )
        self._prompt_logprobs: dict[str, list[Logprobs | None]] = {}
        self.kv_caches = self._allocate_kv_caches(num_blocks)
        self._bindings = self._bind_layers()
        # Scratch index vector, sliced each step instead of allocated.
        self._arange = np.arange(max(max_num_batched_tokens, max_model_len) + 1, dtype=np.int32)
        self.timings: dict[str, float] = defaultdict(float)
        """Seconds spent per phase since creation: update, prepare, forward, sample, output."""
        self.num_steps = 0

    # -- setup -----------------------------------------------------------------------------

    def _allocate_kv_caches(self, num_blocks: int) -> dict[str, torch.Tensor]:
        caches = {}
        for group in self.groups:
            spec = group.spec
            shape = self.backend.kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
            for layer_name in group.layer_names:
                caches[layer_name] = torch.zeros(shape, dtype=torch_dtype(spec.dtype), device=self.device)
        return caches

    def _bind_layers(self) -> dict[int, LayerBinding]:
        group_of = {name: index for index, group in enumerate(self.groups) for name in group.layer_names}
        return {
            layer_idx: LayerBinding(self.backend.make_impl(spec), self.kv_caches[spec.layer_name], group_of[spec.layer_name])
            for layer_idx, spec in self.model.layer_specs.items()
        }

    # -- one step --------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and return the sampled tokens of every request that ran."""
        clock = time.perf_counter()
        self._update_states(scheduler_output)
        clock = self._lap("update", clock)
        if scheduler_output.is_empty:
            return ModelRunnerOutput(req_ids=[], sampled_token_ids=[])
        step = self._prepare_inputs(scheduler_output)
        clock = self._lap("prepare", clock)
        with forward_context(ForwardContext(self._bindings, step.group_metadata)):
            hidden_states = self.model.hidden_states(step.input_ids, step.positions)
        sample_rows = step.rows[step.complete]
        logits = self.model.logits(hidden_states[step.logits_indices]) if len(sample_rows) else None
        prompt_logprobs = self._collect_prompt_logprobs(step, hidden_states)
        clock = self._lap("forward", clock)
        sampler_output = None
        if logits is not None:
            sampler_output = self.sampler.sample(logits, self._sampling_metadata(sample_rows))
        clock = self._lap("sample", clock)
        output = self._record_samples(step, sampler_output)
        output.prompt_logprobs = prompt_logprobs
        self._lap("output", clock)
        self.num_steps += 1
        return output

    def _lap(self, phase: str, since: float) -> float:
        now = time.perf_counter()
        self.timings[phase] += now - since
        return now

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in scheduler_output.finished_req_ids | scheduler_output.preempted_req_ids:
            batch.remove_request(req_id)
            self._prompt_logprobs.pop(req_id, None)
        for request in scheduler_output.scheduled_new_reqs:
            batch.add_request(request)
            self._prompt_logprobs.pop(request.req_id, None)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = batch.req_id_to_index[req_id]
            batch.num_computed_tokens[row] = num_computed
            if new_block_ids is not None:
                for table, block_ids in zip(batch.block_tables, new_block_ids, strict=True):
                    if block_ids:
                        table.append_to_row(row, block_ids)
        batch.condense()
        self._maybe_reorder(scheduler_output)

    def _maybe_reorder(self, scheduler_output: SchedulerOutput) -> None:
        batch = self.batch
        num_scheduled = [scheduler_output.num_scheduled_tokens.get(batch.req_ids[row] or "", 0)
                         for row in range(batch.num_rows)]
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
            )
            group_metadata.append(builder.build(common))
        complete = seq_lens >= batch.num_tokens[rows]
        return StepInputs(
            rows=rows,
            num_scheduled=num_scheduled,
            seq_lens=seq_lens,
            query_start_loc=query_start_loc,
            complete=complete,
            input_ids=to_device(torch.from_numpy(input_ids.astype(np.int64))),
            positions=to_device(torch.from_numpy(positions.astype(np.int64))),
            logits_indices=to_device(torch.from_numpy((cu_num_scheduled - 1)[complete].astype(np.int64))),
            group_metadata=group_metadata,
        )

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

    def _record_samples(self, step: StepInputs, sampler_output: SamplerOutput | None) -> ModelRunnerOutput:
        batch = self.batch
        req_ids = [batch.req_ids[row] for row in step.rows]
        sampled_lists: list[list[int]] = [[] for _ in step.rows]
        logprobs: list[Any] | None = None
        if sampler_output is not None:
            sampled = sampler_output.sampled_token_ids[:, 0].cpu().numpy()
            batch.append_tokens(step.rows[step.complete], sampled)
            positions = np.flatnonzero(step.complete)
            for position, token in zip(positions, sampled.tolist(), strict=True):
                sampled_lists[position] = [token]
            logprobs = self._logprobs(step, positions, sampler_output)
        batch.num_computed_tokens[step.rows] = step.seq_lens
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled_lists, logprobs=logprobs)

    def _logprobs(self, step: StepInputs, positions: np.ndarray, sampler_output: SamplerOutput) -> list[Any] | None:
        """Per step row, the sampled token's logprobs when its request asked for them (else ``None``)."""
        if sampler_output.logprobs is None:
            return None
        token_ids = sampler_output.logprob_token_ids.cpu().tolist()
        values = sampler_output.logprobs.cpu().tolist()
        ranks = sampler_output.sampled_token_ranks.cpu().tolist()
        found: list[Any] = [None] * len(step.rows)
        for sample_index, position in enumerate(positions):
            wanted = self.batch.sampling_params[step.rows[position]].logprobs
            if wanted is not None:
                found[position] = Logprobs(token_ids[sample_index][: wanted + 1], values[sample_index][: wanted + 1],
                                           ranks[sample_index])
        return found

    def _collect_prompt_logprobs(self, step: StepInputs, hidden_states: torch.Tensor) -> dict[str, Any]:
        """Logprobs of the prompt tokens this step's chunks cover; a request's list is returned once its prompt is done.

        The hidden state at position ``p`` scores prompt token ``p + 1``, so a
        chunk covering positions ``a..b-1`` contributes tokens ``a+1..min(b, P-1)``
        of a ``P``-token prompt (the first prompt token has no logprob: ``None``).
        """
        batch = self.batch
        finished: dict[str, Any] = {}
        for i, row in enumerate(step.rows):
            params = batch.sampling_params[row]
            if params.prompt_logprobs is None:
                continue
            req_id = batch.req_ids[row]
            start = int(step.seq_lens[i] - step.num_scheduled[i])
            end = min(int(step.seq_lens[i]), int(batch.num_prompt_tokens[row]) - 1)
            entries = self._prompt_logprobs.setdefault(req_id, [None] if start == 0 else [])
            first = int(step.query_start_loc[i])
            for chunk in range(start, end, PROMPT_LOGPROBS_CHUNK):
                chunk_end = min(chunk + PROMPT_LOGPROBS_CHUNK, end)
                rows = hidden_states[first + chunk - start : first + chunk_end - start]
                targets = torch.from_numpy(batch.token_ids[row, chunk + 1 : chunk_end + 1].astype(np.int64))
                entries.extend(_score(self.model.logits(rows), targets.to(self.device), params.prompt_logprobs))
            if step.complete[i]:
                finished[req_id] = self._prompt_logprobs.pop(req_id)
        return finished


PROMPT_LOGPROBS_CHUNK = 256
"""Prompt positions scored at once (a chunk of float32 logits is 256 x vocab)."""


def _score(logits: torch.Tensor, targets: torch.Tensor, top_n: int) -> list[Logprobs]:
    """Logprobs of ``targets`` under ``logits`` (one row each), with rank and the top ``top_n`` alternatives."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, targets[:, None])
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    ids = targets[:, None]
    values = chosen
    if top_n:
        top_values, top_ids = logprobs.topk(top_n, dim=-1)
        ids, values = torch.cat([ids, top_ids], dim=-1), torch.cat([chosen, top_values], dim=-1)
    return [Logprobs(i, v, r) for i, v, r in zip(ids.tolist(), values.tolist(), ranks, strict=True)]
