"""The engines the bench runs on a workload: patchbay and its transformers peers (others: :mod:`.peers`).

Every engine gets the same token ids and produces exactly each request's
``max_tokens`` tokens greedily (EOS ignored), so wall time compares like with
like.  Each returns an :class:`EngineRun` with the tokens it produced, which
the bench compares across engines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from patchbay.bench.steps import StepRecord, StepRecorder, peak_blocks
from patchbay.bench.workloads import Workload


@dataclass
class EngineRun:
    engine: str
    seconds: float
    token_ids: list[list[int]]
    step_breakdown: dict[str, float] = field(default_factory=dict)
    """patchbay only: seconds per step phase (see ``Engine.step_timings``)."""
    details: dict[str, Any] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    """patchbay only: each step of the run (:class:`patchbay.bench.steps.StepRecorder`)."""


class PatchbayEngine:
    """``patchbay.LLM`` with settings overrides (``scheduler__max_num_seqs`` style), loaded once."""

    def __init__(self, name: str = "patchbay", **overrides: Any) -> None:
        import patchbay

        self.name = name
        self.llm = patchbay.LLM(**overrides)
        self.llm.generate([[1, 2, 3, 4]], self._params(2))  # warm-up: first-call allocations

    @staticmethod
    def _params(max_tokens: int) -> Any:
        from patchbay.sampling_params import SamplingParams

        return SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    def close(self) -> None:
        """End the engine's other tensor-parallel ranks, if it has any."""
        self.llm.engine.close()

    def kv_cache_bytes(self) -> int:
        """The bytes of the engine's KV pool: its blocks times every layer's page of a block."""
        return self.llm.engine.num_blocks * self.kv_block_bytes()

    def kv_block_bytes(self) -> int:
        """The bytes of one KV block: every layer's page of it."""
        return sum(len(group.layer_names) * group.spec.page_size_bytes for group in self.llm.engine.groups)

    def kv_token_bytes(self) -> float:
        """The bytes one token's K and V take, all layers."""
        block_size = min(group.spec.block_size for group in self.llm.engine.groups)
        return self.kv_block_bytes() / block_size

    def _blocks_to_zero(self, workload: Workload) -> int:
        """How many of the pool's first blocks to zero before the run is timed (rank 0's; other ranks zero theirs
        as they go), as vLLM's pool is at load: never-used blocks are handed out in id order before any freed
        one, so those up to the highest handed out so far, and as many above it as the workload's requests
        hold at most, all at once, with a block per request to spare."""
        engine = self.llm.engine
        block_size = min(group.spec.block_size for group in engine.groups)
        held = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // block_size) + 1 for r in workload.requests)
        return max(engine.scheduler.kv_cache_manager.highest_block_ids) + 1 + held

    def run(self, workload: Workload) -> EngineRun:
        engine = self.llm.engine
        engine.scheduler.max_num_seqs = workload.concurrency  # run-time knob: the bench varies concurrency
        engine.reset_step_timings()
        engine.runner.zero_first_blocks(self._blocks_to_zero(workload))
        drafted_before = self.llm.spec_stats.num_draft_tokens
        with StepRecorder(engine) as steps:
            start = time.perf_counter()
            outputs = self.llm.generate(
                [r.prompt_token_ids for r in workload.requests],
                [self._params(r.max_tokens) for r in workload.requests],
            )
            seconds = time.perf_counter() - start
        ttft = [o.metrics.time_to_first_token for o in outputs if o.metrics.time_to_first_token is not None]
        details: dict[str, Any] = {
            "dtype": engine.dtype,
            "weight_format": engine.settings.model.weight_format.name,
            "kv_cache_dtype": engine.settings.cache.dtype,
            "mean_ttft_s": sum(ttft) / len(ttft) if ttft else None,
            "cached_prompt_tokens": sum(o.metrics.num_cached_tokens for o in outputs),
            "kv_cache_bytes": self.kv_cache_bytes(),
            "kv_used_bytes": peak_blocks(steps.records) * self.kv_block_bytes(),
            "max_model_len": engine.max_model_len,
        }
        if engine.tuning is not None:
            details["tuning"] = engine.tuning.describe()
            details["tuning_provisional"] = engine.tuning.provisional
        if self.llm.spec_stats.num_draft_tokens > drafted_before:
            details["spec"] = self.llm.spec_stats.as_dict()
        return EngineRun(
            self.name, seconds, [list(o.token_ids) for o in outputs], engine.step_timings(), details, steps.records
        )


class TransformersGenerate:
    """transformers ``generate``: static batches of the workload's concurrency, left padding."""

    def __init__(self, model_dir: str, *, prompt_lookup_tokens: int | None = None) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.prompt_lookup_tokens = prompt_lookup_tokens
        if prompt_lookup_tokens:
            self.name = f"transformers generate + prompt lookup {prompt_lookup_tokens} (batch 1)"
        else:
            self.name = "transformers generate"

    def run(self, workload: Workload) -> EngineRun:
        batch_size = 1 if self.prompt_lookup_tokens else workload.concurrency  # assisted generation is batch 1
        requests = workload.requests
        token_ids: list[list[int]] = []
        with torch.inference_mode():
            self._generate(requests[:1], 2)  # warm-up
            start = time.perf_counter()
            for first in range(0, len(requests), batch_size):
                batch = requests[first : first + batch_size]
                longest = max(r.max_tokens for r in batch)
                generated = self._generate(batch, longest)
                token_ids.extend(row[: r.max_tokens] for row, r in zip(generated, batch, strict=True))
            seconds = time.perf_counter() - start
        return EngineRun(self.name, seconds, token_ids, details={"dtype": "float32", "batch_size": batch_size})

    def _generate(self, batch: list[Any], new_tokens: int) -> list[list[int]]:
        width = max(len(r.prompt_token_ids) for r in batch)
        input_ids = torch.tensor([[self.pad] * (width - len(r.prompt_token_ids)) + r.prompt_token_ids for r in batch])
        mask = torch.tensor([[0] * (width - len(r.prompt_token_ids)) + [1] * len(r.prompt_token_ids) for r in batch])
        extra = {"prompt_lookup_num_tokens": self.prompt_lookup_tokens} if self.prompt_lookup_tokens else {}
        output = self.model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=self.pad,
            **extra,
        )
        return output[:, width:].tolist()


class TransformersContinuousBatching:
    """transformers' own continuous batching (``init_continuous_batching``, paged attention), per-request lengths."""

    name = "transformers continuous batching"

    def __init__(self, model_dir: str, max_batch_tokens: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        self.max_batch_tokens = max_batch_tokens

    @staticmethod
    def available() -> str | None:
        """Why this transformers cannot run the peer, or ``None`` when it can."""
        from transformers import GenerationMixin

        if not hasattr(GenerationMixin, "init_continuous_batching"):
            import transformers

            return f"transformers {transformers.__version__} has no continuous batching (init_continuous_batching)"
        return None

    def run(self, workload: Workload) -> EngineRun:
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        generation = GenerationConfig(
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            max_new_tokens=max(r.max_tokens for r in workload.requests),
        )
        # A KV pool for the workload's concurrency at its longest request: left unset, transformers sizes it
        # from the machine's free memory (gigabytes for a tiny model, more than a shared machine can spare).
        longest = max(len(r.prompt_token_ids) + r.max_tokens for r in workload.requests)
        page_size = 256
        batching = ContinuousBatchingConfig(
            max_batch_tokens=self.max_batch_tokens,
            page_size=page_size,
            num_blocks=workload.concurrency * -(-longest // page_size) + 1,
            max_requests_per_batch=workload.concurrency,
        )
        self._serve(workload.requests[:1], generation, batching, warm_up=True)
        start = time.perf_counter()
        token_ids = self._serve(workload.requests, generation, batching)
        seconds = time.perf_counter() - start
        return EngineRun(self.name, seconds, token_ids, details={"dtype": "float32"})

    def _serve(self, requests: list[Any], generation: Any, batching: Any, warm_up: bool = False) -> list[list[int]]:
        manager = self.model.init_continuous_batching(generation_config=generation, continuous_batching_config=batching)
        manager.start()
        try:
            ids = [
                manager.add_request(r.prompt_token_ids, max_new_tokens=2 if warm_up else r.max_tokens) for r in requests
            ]
            finished: dict[str, list[int]] = {}
            while len(finished) < len(ids):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    if result.error is not None:
                        raise RuntimeError(
                            f"transformers continuous batching failed {result.request_id}: {result.error}"
                        )
                    finished[result.request_id] = list(result.generated_tokens)
                elif result is None and not manager.is_running():
                    raise RuntimeError("transformers continuous batching stopped before finishing the workload")
        finally:
            manager.stop(block=True)
        return [finished[request_id] for request_id in ids]
