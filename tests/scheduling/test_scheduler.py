"""The scheduler end to end against a fake runner whose "KV cache" stores token ids.

The fake runner writes each computed token's id into its slot and reads a
token's context back through the block table before "predicting" the next
token, so a wrong block table, a wrongly shared block or a lost block
changes the outputs: equal outputs prove the scheduler and the cache kept
every token's KV where the runner expects it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pytest

from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.kv_cache_manager import KVCacheManager
from patchbay.scheduling.kv_cache_spec import KVCacheGroup, KVCacheSpec
from patchbay.scheduling.request import Request
from patchbay.scheduling.scheduler import RequestUpdate, Scheduler
from patchbay.scheduling.scheduler_output import ModelRunnerOutput, SchedulerOutput

BLOCK_SIZE = 4
NextToken = Callable[[list[int]], int]


def weighted_sum_token(context: list[int]) -> int:
    """A deterministic stand-in for a model: depends on every token and its position."""
    return sum((position + 1) * token for position, token in enumerate(context)) % 97


def position_token(context: list[int]) -> int:
    """Predicts ``len(context) % 10``: easy to reason about for stop conditions."""
    return len(context) % 10


@dataclass
class RunnerState:
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[list[int]]


@dataclass
class FakeRunner:
    """Consumes SchedulerOutputs the way a model runner does, with a token-id KV cache."""

    manager: KVCacheManager
    next_token: NextToken = weighted_sum_token
    drafter: Callable[[list[int]], list[int]] | None = None
    states: dict[str, RunnerState] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.kv = [np.full((self.manager.num_blocks, BLOCK_SIZE), -1) for _ in self.manager.groups]

    def execute(self, output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in output.finished_req_ids | output.preempted_req_ids:
            self.states.pop(request_id, None)
        for new in output.scheduled_new_reqs:
            assert new.req_id not in self.states
            self.states[new.req_id] = RunnerState(
                new.all_token_ids, new.num_computed_tokens, [list(ids) for ids in new.block_ids]
            )
        cached = output.scheduled_cached_reqs
        for request_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            state = self.states[request_id]
            assert num_computed == state.num_computed_tokens, request_id
            for table, ids in zip(state.block_ids, new_block_ids or (), strict=False):
                table.extend(ids)

        # Write every scheduled token's KV first, as a layer does, then compute.
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            state = self.states[request_id]
            sequence = state.token_ids + output.scheduled_spec_decode_tokens.get(request_id, [])
            assert state.num_computed_tokens + num_tokens <= len(sequence)
            for position in range(state.num_computed_tokens, state.num_computed_tokens + num_tokens):
                for group_index, kv in enumerate(self.kv):
                    table = state.block_ids[group_index]
                    kv[table[position // BLOCK_SIZE], position % BLOCK_SIZE] = sequence[position]

        sampled_token_ids, draft_token_ids = [], []
        for request_id, num_tokens in output.num_scheduled_tokens.items():
            state = self.states[request_id]
            drafts = output.scheduled_spec_decode_tokens.get(request_id, [])
            end = state.num_computed_tokens + num_tokens
            sampled = []
            if end >= len(state.token_ids):  # not a partial prefill
                for index in range(len(drafts) + 1):
                    token = self.next_token(self._read_context(state, len(state.token_ids) - 1 + index))
                    sampled.append(token)
                    if index < len(drafts) and drafts[index] != token:
                        break  # rejected: the target's token replaces the draft
            num_rejected = len(drafts) + 1 - len(sampled) if drafts and sampled else 0
            state.num_computed_tokens = end - num_rejected
            state.token_ids = state.token_ids + sampled
            sampled_token_ids.append(sampled)
            draft_token_ids.append(self.drafter(state.token_ids) if self.drafter and sampled else [])
        return ModelRunnerOutput(list(output.num_scheduled_tokens), sampled_token_ids, draft_token_ids=draft_token_ids)

    def _read_context(self, state: RunnerState, position: int) -> list[int]:
        """The tokens a model would attend to at ``position``, read back from the cache.

        Tokens ``0..position`` with a full-attention group (sliding-window groups
        must then agree with it), else the last ``window`` tokens.
        """
        full_context, window_contexts = None, []
        for group, table, kv in zip(self.manager.groups, state.block_ids, self.kv, strict=True):
            window = group.spec.sliding_window
            start = 0 if window is None else max(0, position - window + 1)
            values = [int(kv[table[p // BLOCK_SIZE], p % BLOCK_SIZE]) for p in range(start, position + 1)]
            assert -1 not in values, "read a slot that was never written"
            if window is None:
                full_context = values
            else:
                window_contexts.append((start, values))
        if full_context is None:
            return window_contexts[0][1]
        for start, values in window_contexts:
            assert values == full_context[start:], "sliding-window blocks hold wrong tokens"
        return full_context


@dataclass
class RunResult:
    outputs: dict[str, list[int]]
    finish_reasons: dict[str, str]
    steps: list[SchedulerOutput]
    updates: list[RequestUpdate]

    @property
    def preempted(self) -> set[str]:
        return set().union(*(step.preempted_req_ids for step in self.steps))


def run_to_completion(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 2000) -> RunResult:
    """Drive schedule -> execute -> update until every request finished, checking each step's limits."""
    result = RunResult({}, {}, [], [])
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return result
        output = scheduler.schedule()
        check_step(scheduler, output)
        result.steps.append(output)
        for update in scheduler.update_from_output(output, runner.execute(output)):
            result.updates.append(update)
            result.outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finish_reason:
                result.finish_reasons[update.request_id] = update.finish_reason
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def check_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    counts = output.num_scheduled_tokens
    assert all(count > 0 for count in counts.values()), counts
    assert output.total_num_scheduled_tokens == sum(counts.values()) <= scheduler.max_num_batched_tokens
    assert len(counts) <= scheduler.max_num_seqs
    assert not output.preempted_req_ids & set(counts)
    new_ids = [new.req_id for new in output.scheduled_new_reqs]
    assert sorted(new_ids + output.scheduled_cached_reqs.req_ids) == sorted(counts)
    for new in output.scheduled_new_reqs:
        assert new.num_computed_tokens + counts[new.req_id] <= scheduler.max_model_len
    for request_id, num_computed in zip(
        output.scheduled_cached_reqs.req_ids, output.scheduled_cached_reqs.num_computed_tokens, strict=True
    ):
        assert num_computed + counts[request_id] <= scheduler.max_model_len
        drafts = output.scheduled_spec_decode_tokens.get(request_id, [])
        assert len(drafts) <= scheduler.num_speculative_tokens


def reference_output(
    prompt: list[int],
    params: SamplingParams,
    next_token: NextToken,
    max_model_len: int,
    eos_token_id: int | None = None,
) -> list[int]:
    """What a request must produce, computed without any cache."""
    tokens, output = list(prompt), []
    while True:
        token = next_token(tokens)
        tokens.append(token)
        output.append(token)
        if len(output) >= params.min_tokens and (
            (token == eos_token_id and not params.ignore_eos) or token in params.stop_token_ids
        ):
            return output
        if len(output) >= params.max_tokens or len(tokens) >= max_model_len:
            return output


def make_scheduler(
    num_blocks: int = 200,
    *,
    groups: list[KVCacheGroup] | None = None,
    prefix_caching: bool = True,
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 32,
    max_model_len: int = 64,
    chunked_prefill: bool = True,
    num_speculative_tokens: int = 0,
    max_batches_in_flight: int = 1,
    pipelined: bool = False,
) -> Scheduler:
    if groups is None:
        groups = [KVCacheGroup(KVCacheSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8), ["layers.0"])]
    manager = KVCacheManager(groups, num_blocks, prefix_caching)
    return Scheduler(
        manager,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        block_size=BLOCK_SIZE,
        chunked_prefill=chunked_prefill,
        num_speculative_tokens=num_speculative_tokens,
        max_batches_in_flight=max_batches_in_flight,
        pipelined=pipelined,
    )


def make_request(
    request_id: str, prompt: list[int], eos_token_id: int | None = None, arrival_time: float = 0.0, **params
) -> Request:
    return Request(request_id, prompt, SamplingParams(**params), eos_token_id, arrival_time, block_size=BLOCK_SIZE)


def workload() -> list[tuple[str, list[int], SamplingParams]]:
    """Requests of mixed lengths, two pairs sharing a prefix."""
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 97, size=12).tolist()
    prompts = {
        "r0": rng.integers(0, 97, size=5).tolist(),
        "r1": shared + [1, 2, 3],
        "r2": rng.integers(0, 97, size=30).tolist(),
        "r3": shared + [4, 5],
        "r4": rng.integers(0, 97, size=9).tolist(),
        "r5": rng.integers(0, 97, size=17).tolist(),
    }
    max_tokens = {"r0": 20, "r1": 14, "r2": 18, "r3": 25, "r4": 11, "r5": 16}
    return [
        (request_id, prompt, SamplingParams(max_tokens=max_tokens[request_id]))
        for request_id, prompt in prompts.items()
    ]


def run_workload(scheduler: Scheduler, **runner_options) -> RunResult:
    runner = FakeRunner(scheduler.kv_cache_manager, **runner_options)
    for arrival, (request_id, prompt, params) in enumerate(workload()):
        scheduler.add_request(Request(request_id, prompt, params, None, float(arrival), block_size=BLOCK_SIZE))
    result = run_to_completion(scheduler, runner)
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks - 1
    return result


def expected_workload_outputs(max_model_len: int = 64) -> dict[str, list[int]]:
    return {
        request_id: reference_output(prompt, params, weighted_sum_token, max_model_len)
        for request_id, prompt, params in workload()
    }


# -- end to end ------------------------------------------------------------------


def test_large_pool_produces_the_reference_outputs():
    result = run_workload(make_scheduler(num_blocks=1000))
    assert result.outputs == expected_workload_outputs()
    assert not result.preempted


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_preemption_under_a_tiny_pool_never_changes_a_token(prefix_caching):
    large = run_workload(make_scheduler(num_blocks=1000, prefix_caching=prefix_caching))
    # 17 blocks: just enough for one request of max_model_len 64 (16 blocks) plus the null block.
    tiny = run_workload(make_scheduler(num_blocks=17, prefix_caching=prefix_caching))
    assert tiny.preempted, "the pool was meant to force preemptions"
    assert tiny.outputs == large.outputs == expected_workload_outputs()
    # Resumed requests come back as new requests carrying their earlier outputs.
    resumed = [new for step in tiny.steps for new in step.scheduled_new_reqs if new.output_token_ids]
    assert resumed


def test_preemption_takes_the_latest_arrival_first():
    scheduler = make_scheduler(num_blocks=17, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler.kv_cache_manager)
    for index, request_id in enumerate(["early", "middle", "late"]):
        scheduler.add_request(
            make_request(request_id, list(range(index, index + 15)), arrival_time=index, max_tokens=40, ignore_eos=True)
        )
    first_preemption = None
    while scheduler.has_unfinished_requests() and first_preemption is None:
        output = scheduler.schedule()
        first_preemption = output.preempted_req_ids or None
        scheduler.update_from_output(output, runner.execute(output))
    assert first_preemption == {"late"}


def test_chunked_prefill_splits_a_long_prompt_across_steps_next_to_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(scheduler.kv_cache_manager)
    scheduler.add_request(make_request("short-a", [1, 2, 3], max_tokens=12))
    scheduler.add_request(make_request("short-b", [4, 5], max_tokens=12))
    long_prompt = list(range(10, 40))
    scheduler.add_request(make_request("long", long_prompt, max_tokens=5))
    result = run_to_completion(scheduler, runner)

    long_steps = [step for step in result.steps if "long" in step.num_scheduled_tokens]
    prefill_steps = long_steps[: next(i for i, step in enumerate(long_steps) if step.num_scheduled_tokens["long"] == 1)]
    assert len(prefill_steps) >= 4
    assert sum(step.num_scheduled_tokens["long"] for step in prefill_steps) == len(long_prompt)
    mixed = [
        step
        for step in prefill_steps
        if step.num_scheduled_tokens.get("short-a") == 1 and step.num_scheduled_tokens.get("short-b") == 1
    ]
    assert mixed, "prefill chunks should share steps with decodes"
    assert all(step.total_num_scheduled_tokens <= 8 for step in result.steps)
    assert result.outputs["long"] == reference_output(long_prompt, SamplingParams(max_tokens=5), weighted_sum_token, 64)


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    scheduler = make_scheduler(max_num_batched_tokens=10, chunked_prefill=False)
    runner = FakeRunner(scheduler.kv_cache_manager)
    scheduler.add_request(make_request("decoder", [1, 2], max_tokens=6))
    scheduler.add_request(make_request("whole", list(range(10)), max_tokens=3))
    scheduler.add_request(make_request("small", [7, 8, 9], max_tokens=3))
    result = run_to_completion(scheduler, runner)
    whole_counts = [step.num_scheduled_tokens["whole"] for step in result.steps if "whole" in step.num_scheduled_tokens]
    assert whole_counts[0] == 10 and set(whole_counts[1:]) == {1}
    # "small" fits next to the decoder while "whole" cannot: it is admitted first.
    first_step = result.steps[0].num_scheduled_tokens
    assert first_step == {"decoder": 2, "small": 3}


def test_max_num_seqs_limits_concurrent_requests():
    scheduler = make_scheduler(max_num_seqs=2)
    result = run_workload(scheduler)
    assert max(len(step.num_scheduled_tokens) for step in result.steps) == 2
    assert result.outputs == expected_workload_outputs()


def test_prefix_cache_hit_is_reported_to_the_runner_and_in_metrics():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler.kv_cache_manager)
    shared = list(range(30, 42))  # three full blocks
    scheduler.add_request(make_request("first", shared + [1], max_tokens=2))
    run_to_completion(scheduler, runner)
    scheduler.add_request(make_request("second", shared + [2, 3], max_tokens=2))
    output = scheduler.schedule()
    assert output.scheduled_new_reqs[0].num_computed_tokens == 12
    assert output.num_scheduled_tokens == {"second": 2}
    updates = scheduler.update_from_output(output, runner.execute(output))
    assert updates[0].num_cached_tokens == 12


def test_sliding_window_model_runs_correctly_in_a_tiny_pool():
    spec = KVCacheSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8)
    groups = [
        KVCacheGroup(spec, ["layers.0"]),
        KVCacheGroup(KVCacheSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, sliding_window=8), ["layers.1"]),
    ]
    large = run_workload(make_scheduler(num_blocks=1000, groups=groups))
    tiny = run_workload(make_scheduler(num_blocks=17, groups=groups))
    assert tiny.preempted
    assert tiny.outputs == large.outputs == expected_workload_outputs()


def test_sliding_window_only_model_fits_a_pool_smaller_than_max_model_len():
    window = 8
    groups = [
        KVCacheGroup(
            KVCacheSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, sliding_window=window), ["layers.0"]
        )
    ]

    def windowed_token(context: list[int]) -> int:
        return weighted_sum_token(context[-window:])

    # Budget 32 and window 8: a request holds at most cdiv(8 + 32, 4) + 1 = 11 blocks, not the 16 of 64 tokens.
    scheduler = make_scheduler(num_blocks=12, groups=groups, max_model_len=64, max_num_batched_tokens=32)
    result = run_workload(scheduler, next_token=windowed_token)
    assert result.preempted
    assert result.outputs == {
        request_id: reference_output(prompt, params, windowed_token, 64) for request_id, prompt, params in workload()
    }
    with pytest.raises(ValueError, match="needs 11 blocks"):
        make_scheduler(num_blocks=11, groups=groups, max_model_len=64, max_num_batched_tokens=32)


def test_empty_scheduler_schedules_nothing():
    scheduler = make_scheduler()
    output = scheduler.schedule()
    assert output.is_empty and not output.scheduled_new_reqs and not output.num_scheduled_tokens
    assert not scheduler.has_unfinished_requests()


# -- stop conditions -------------------------------------------------------------


def run_single(
    prompt: list[int], eos_token_id: int | None = None, max_model_len: int = 64, **params
) -> tuple[list[int], str, RequestUpdate]:
    scheduler = make_scheduler(max_model_len=max_model_len)
    scheduler.add_request(make_request("r", prompt, eos_token_id, **params))
    result = run_to_completion(scheduler, FakeRunner(scheduler.kv_cache_manager, position_token))
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks - 1
    return result.outputs["r"], result.finish_reasons["r"], result.updates[-1]


def test_finishes_on_eos():
    # position_token after a 5-token prompt: 5, 6, 7, 8, ...
    output, reason, update = run_single([0] * 5, eos_token_id=8, max_tokens=20)
    assert (output, reason, update.stop_reason) == ([5, 6, 7, 8], "stop", None)


def test_ignore_eos_runs_to_max_tokens():
    output, reason, _ = run_single([0] * 5, eos_token_id=8, max_tokens=6, ignore_eos=True)
    assert (output, reason) == ([5, 6, 7, 8, 9, 0], "length")


def test_eos_before_min_tokens_does_not_stop():
    output, reason, _ = run_single([0] * 5, eos_token_id=6, max_tokens=20, min_tokens=3)
    assert (output, reason) == ([5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6], "stop")


def test_finishes_on_stop_token_ids_with_the_token_as_stop_reason():
    output, reason, update = run_single([0] * 5, max_tokens=20, stop_token_ids=[9, 7])
    assert (output, reason, update.stop_reason) == ([5, 6, 7], "stop", 7)


def test_finishes_at_max_tokens():
    output, reason, _ = run_single([0] * 5, max_tokens=3)
    assert (output, reason) == ([5, 6, 7], "length")


def test_finishes_at_max_model_len():
    output, reason, _ = run_single([0] * 5, max_model_len=8, max_tokens=20)
    assert (output, reason) == ([5, 6, 7], "length")


def test_prompt_of_exactly_max_model_len_yields_one_token():
    output, reason, _ = run_single([0] * 8, max_model_len=8, max_tokens=20)
    assert (output, reason) == ([8], "length")


def test_finish_requests_for_a_stop_string():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler.kv_cache_manager, position_token)
    scheduler.add_request(make_request("r", [1, 2, 3], max_tokens=20))
    output = scheduler.schedule()
    scheduler.update_from_output(output, runner.execute(output))
    scheduler.finish_requests(["r"], "stop", stop_reason="\n\n")
    assert not scheduler.has_unfinished_requests()
    assert scheduler.schedule().finished_req_ids == {"r"}
    with pytest.raises(ValueError, match="unknown finish reason 'done'"):
        scheduler.finish_requests(["x"], "done")


# -- abort ---------------------------------------------------------------------


def test_abort_running_and_waiting_requests_frees_blocks_and_reports_them():
    scheduler = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(scheduler.kv_cache_manager)
    scheduler.add_request(make_request("running", list(range(9)), max_tokens=20))
    scheduler.add_request(make_request("waiting", list(range(5)), max_tokens=20))
    output = scheduler.schedule()
    assert list(output.num_scheduled_tokens) == ["running"]
    scheduler.update_from_output(output, runner.execute(output))

    scheduler.abort_requests(["running", "waiting", "unknown"])
    assert not scheduler.has_unfinished_requests()
    assert scheduler.get_num_unfinished_requests() == 0
    manager = scheduler.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks - 1
    output = scheduler.schedule()
    assert output.finished_req_ids == {"running", "waiting"}
    assert output.is_empty
    runner.execute(output)
    assert not runner.states
    assert scheduler.schedule().finished_req_ids == set()


def test_abort_between_schedule_and_update_ignores_the_stale_result():
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler.kv_cache_manager)
    scheduler.add_request(make_request("r", [1, 2, 3], max_tokens=20))
    output = scheduler.schedule()
    runner_output = runner.execute(output)
    scheduler.abort_requests(["r"])
    assert scheduler.update_from_output(output, runner_output) == []


# -- speculative decoding ------------------------------------------------------


def half_right_drafter(num_right: int, num_drafts: int = 3) -> Callable[[list[int]], list[int]]:
    """Proposes the true next ``num_right`` tokens, then wrong ones."""

    def propose(token_ids: list[int]) -> list[int]:
        context, drafts = list(token_ids), []
        for index in range(num_drafts):
            token = weighted_sum_token(context)
            drafts.append(token if index < num_right else (token + 1) % 97)
            context.append(token)
        return drafts

    return propose


def test_spec_decode_accounts_for_partially_accepted_drafts():
    scheduler = make_scheduler(num_speculative_tokens=3)
    runner = FakeRunner(scheduler.kv_cache_manager, drafter=half_right_drafter(num_right=1))
    prompt = [5, 6, 7, 8, 9]
    scheduler.add_request(make_request("r", prompt, max_tokens=12))
    result = run_to_completion(scheduler, runner)  # the runner checks num_computed_tokens every step

    verify_steps = [step for step in result.steps if step.scheduled_spec_decode_tokens]
    assert verify_steps
    # 3 drafts verified with 1 accepted: 4 tokens scheduled, 2 sampled (1 draft + 1 correction).
    assert all(step.num_scheduled_tokens["r"] == 4 for step in verify_steps)
    per_step = [len(update.new_token_ids) for update in result.updates]
    assert per_step[0] == 1 and set(per_step[1:-1]) == {2}
    assert result.outputs["r"] == reference_output(prompt, SamplingParams(max_tokens=12), weighted_sum_token, 64)


def test_spec_decode_update_arithmetic():
    scheduler = make_scheduler(num_speculative_tokens=3)
    request = make_request("r", list(range(8)), max_tokens=20)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput(["r"], [[50]], draft_token_ids=[[51, 52, 53]]))
    assert (request.num_tokens, request.num_computed_tokens, request.spec_token_ids) == (9, 8, [51, 52, 53])

    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"r": 4}
    assert output.scheduled_spec_decode_tokens == {"r": [51, 52, 53]}
    assert output.scheduled_cached_reqs.num_computed_tokens == [8]
    # 51 accepted, 52 rejected and replaced by 60: 53 never counts.
    scheduler.update_from_output(output, ModelRunnerOutput(["r"], [[51, 60]], draft_token_ids=[[61]]))
    assert request.output_token_ids == [50, 51, 60]
    assert (request.num_tokens, request.num_computed_tokens, request.spec_token_ids) == (11, 10, [61])


def test_eos_among_accepted_drafts_truncates_the_rest():
    scheduler = make_scheduler(num_speculative_tokens=3)
    request = make_request("r", list(range(8)), eos_token_id=2, max_tokens=20)
    scheduler.add_request(request)
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput(["r"], [[1]], draft_token_ids=[[2, 3, 4]]))
    output = scheduler.schedule()
    updates = scheduler.update_from_output(output, ModelRunnerOutput(["r"], [[2, 3, 4, 5]]))
    assert (updates[0].new_token_ids, updates[0].finish_reason) == ([2], "stop")
    assert request.output_token_ids == [1, 2]


def test_drafts_are_cut_by_the_token_budget_and_max_model_len():
    scheduler = make_scheduler(num_speculative_tokens=3, max_num_batched_tokens=3, max_model_len=12)
    request = make_request("r", list(range(8)), max_tokens=20)
    scheduler.add_request(request)
    output = scheduler.schedule()  # budget 3: the prompt takes 3 steps
    while request.num_computed_tokens + output.num_scheduled_tokens["r"] < 8:
        scheduler.update_from_output(output, ModelRunnerOutput(["r"], [[]]))
        output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput(["r"], [[1]], draft_token_ids=[[2, 3, 4]]))
    output = scheduler.schedule()
    assert output.scheduled_spec_decode_tokens == {"r": [2, 3]}  # 1 + 2 drafts = budget of 3
    # Draft 2 accepted, 3 rejected and replaced by 9.
    scheduler.update_from_output(output, ModelRunnerOutput(["r"], [[2, 9]], draft_token_ids=[[5, 6, 7]]))
    assert (request.num_tokens, request.num_computed_tokens) == (11, 10)
    output = scheduler.schedule()
    assert output.scheduled_spec_decode_tokens == {"r": [5]}  # positions 10, 11 reach max_model_len 12


def test_spec_decode_with_preemption_in_a_tiny_pool_matches_the_reference():
    large = run_workload(
        make_scheduler(num_blocks=1000, num_speculative_tokens=3), drafter=half_right_drafter(num_right=2)
    )
    tiny = run_workload(
        make_scheduler(num_blocks=17, num_speculative_tokens=3), drafter=half_right_drafter(num_right=2)
    )
    assert tiny.preempted
    assert tiny.outputs == large.outputs == expected_workload_outputs()


# -- rejection of impossible settings and requests ----------------------------


def test_prompt_longer_than_max_model_len_is_rejected_with_its_id_and_lengths():
    scheduler = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match=r"request 'too-long': prompt of 17 tokens exceeds model.max_model_len=16"):
        scheduler.add_request(make_request("too-long", list(range(17))))
    assert not scheduler.has_unfinished_requests()


def test_prompt_over_the_budget_without_chunked_prefill_is_rejected():
    scheduler = make_scheduler(max_num_batched_tokens=8, chunked_prefill=False)
    with pytest.raises(ValueError, match=r"request 'big'.*9 tokens.*max_num_batched_tokens=8.*chunked_prefill"):
        scheduler.add_request(make_request("big", list(range(9))))


def test_duplicate_and_empty_requests_are_rejected():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [1]))
    with pytest.raises(ValueError, match="already scheduled"):
        scheduler.add_request(make_request("r", [1]))
    with pytest.raises(ValueError, match="empty prompt"):
        scheduler.add_request(make_request("empty", []))


def test_pool_that_cannot_hold_one_max_model_len_request_is_rejected():
    with pytest.raises(ValueError) as error:
        make_scheduler(num_blocks=16, max_model_len=64)
    message = str(error.value)
    for needle in ("model.max_model_len=64", "needs 16 blocks", "15 usable blocks", "cache.num_blocks", "cache.memory"):
        assert needle in message


# -- overlapped batches (pipeline parallelism) --------------------------------------


@dataclass
class PipelinedRun:
    result: RunResult
    max_in_flight: int = 0
    """The most batches scheduled whose outputs were not applied yet."""
    preempted_in_flight: set[str] = field(default_factory=set)
    """Requests preempted while a batch holding them was in flight."""


def run_pipelined(scheduler: Scheduler, runner: FakeRunner, depth: int, max_steps: int = 4000) -> PipelinedRun:
    """Drive the scheduler as the engine does with ``depth`` pipeline stages: schedule while fewer than ``depth``
    batches are in flight, else apply the oldest batch's output.

    The fake runner plays the last stage and runs each batch as soon as it is scheduled (stages take batches in
    order); its output is applied only when the batch leaves the queue.  A mirror of a first stage's
    persistent batch follows the scheduler outputs alone (``new_token_ids``) and must hold the tokens the last
    stage sampled whenever a request runs.
    """
    run = PipelinedRun(RunResult({}, {}, [], []))
    in_flight: deque[tuple[SchedulerOutput, ModelRunnerOutput]] = deque()
    first_stage: dict[str, list[int]] = {}

    def apply(output: SchedulerOutput, runner_output: ModelRunnerOutput) -> None:
        for update in scheduler.update_from_output(output, runner_output):
            run.result.updates.append(update)
            run.result.outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finish_reason:
                run.result.finish_reasons[update.request_id] = update.finish_reason

    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests() and not in_flight:
            return run
        if len(in_flight) < depth:
            flying = {request_id for batch, _ in in_flight for request_id in batch.num_scheduled_tokens}
            output = scheduler.schedule()
            check_step(scheduler, output)
            assert not flying & set(output.num_scheduled_tokens), "a request in flight was scheduled again"
            run.preempted_in_flight |= flying & output.preempted_req_ids
            run.result.steps.append(output)
            for request_id in output.finished_req_ids | output.preempted_req_ids:
                first_stage.pop(request_id, None)
            for new in output.scheduled_new_reqs:
                first_stage[new.req_id] = list(new.all_token_ids)
            cached = output.scheduled_cached_reqs
            for request_id, token_ids in zip(cached.req_ids, cached.new_token_ids, strict=True):
                first_stage[request_id] += token_ids
            for request_id in cached.req_ids:
                assert first_stage[request_id] == runner.states[request_id].token_ids, request_id
            runner_output = runner.execute(output)
            if not output.is_empty:
                in_flight.append((output, runner_output))
                run.max_in_flight = max(run.max_in_flight, len(in_flight))
                if len(in_flight) < depth:
                    continue
            elif not in_flight:
                apply(output, runner_output)
                continue
        apply(*in_flight.popleft())
    raise AssertionError(f"requests still unfinished after {max_steps} steps")


def add_workload(scheduler: Scheduler) -> None:
    for arrival, (request_id, prompt, params) in enumerate(workload()):
        scheduler.add_request(Request(request_id, prompt, params, None, float(arrival), block_size=BLOCK_SIZE))


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_overlapped_batches_produce_the_reference_outputs_with_one_batch_in_flight_per_stage(depth):
    # A budget of 16 tokens spreads the six prompts over several batches, so three stages find three to run.
    # Depth 1: stages in lockstep (a KV connector's), whose first stages still learn the tokens from the scheduler.
    scheduler = make_scheduler(num_blocks=1000, max_num_batched_tokens=16, max_batches_in_flight=depth, pipelined=True)
    add_workload(scheduler)
    run = run_pipelined(scheduler, FakeRunner(scheduler.kv_cache_manager), depth)
    assert run.result.outputs == expected_workload_outputs()
    assert run.max_in_flight == depth
    assert scheduler.num_in_flight == 0
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks - 1


def test_a_prompt_s_next_chunk_waits_for_the_output_of_its_previous_one():
    scheduler = make_scheduler(max_num_batched_tokens=8, max_batches_in_flight=2)
    scheduler.add_request(make_request("long", list(range(20)), max_tokens=2))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"long": 8}
    assert scheduler.schedule().is_empty  # its next chunk needs the first one's output
    scheduler.add_request(make_request("short", [1, 2, 3], max_tokens=2))
    assert scheduler.schedule().num_scheduled_tokens == {"short": 3}  # another request's batch overlaps
    scheduler.update_from_output(first, ModelRunnerOutput(["long"], [[]]))
    assert scheduler.schedule().num_scheduled_tokens == {"long": 8}


@pytest.mark.parametrize("depth", [2, 3])
def test_requests_preempted_in_flight_come_back_with_the_same_tokens(depth):
    # 17 blocks hold one max_model_len request: running requests are preempted, some while their batch is in flight
    # (with three stages, the step after a preemption may come before that batch's output).
    scheduler = make_scheduler(num_blocks=17, max_num_batched_tokens=16, max_batches_in_flight=depth)
    add_workload(scheduler)
    run = run_pipelined(scheduler, FakeRunner(scheduler.kv_cache_manager), depth)
    assert run.preempted_in_flight, "the pool was meant to preempt a request whose batch is in flight"
    assert run.result.outputs == expected_workload_outputs()
    assert scheduler.kv_cache_manager.num_free_blocks == scheduler.kv_cache_manager.num_blocks - 1


def test_an_aborted_request_s_late_output_never_reaches_a_new_request_with_its_id():
    scheduler = make_scheduler(max_batches_in_flight=2)
    runner = FakeRunner(scheduler.kv_cache_manager)
    scheduler.add_request(make_request("r", [5, 6, 7], max_tokens=3))
    stale = scheduler.schedule()
    stale_output = runner.execute(stale)
    scheduler.abort_requests(["r"])
    scheduler.add_request(make_request("r", [9, 8, 7, 6], max_tokens=3))
    waiting = scheduler.schedule()
    assert waiting.is_empty and waiting.finished_req_ids == {"r"}  # the new "r" waits for the old one's batch
    runner.execute(waiting)  # empty, but it tells the runners to drop the old "r"
    assert scheduler.update_from_output(stale, stale_output) == []
    run = run_pipelined(scheduler, runner, depth=2)
    assert run.result.outputs == {
        "r": reference_output([9, 8, 7, 6], SamplingParams(max_tokens=3), weighted_sum_token, 64)
    }


def test_a_request_preempted_in_flight_is_admitted_again_only_once_its_late_output_is_dropped():
    scheduler = make_scheduler(num_blocks=17, max_batches_in_flight=3)  # 16 usable blocks of 4 tokens, a budget of 32
    runner = FakeRunner(scheduler.kv_cache_manager)
    scheduler.add_request(make_request("a", list(range(32)), max_tokens=4))
    first = scheduler.schedule()
    first_output = runner.execute(first)
    scheduler.add_request(make_request("x", list(range(50, 82)), arrival_time=1.0, max_tokens=4))
    second = scheduler.schedule()
    assert second.num_scheduled_tokens == {"x": 32}  # "a" is in flight; "x" takes the last 8 blocks
    second_output = runner.execute(second)
    scheduler.update_from_output(first, first_output)
    third = scheduler.schedule()  # "a" needs a ninth block for its next token: "x", in flight, is preempted
    assert third.preempted_req_ids == {"x"} and third.num_scheduled_tokens == {"a": 1}
    third_output = runner.execute(third)
    scheduler.abort_requests(["a"])  # the pool is free again: only its late output holds "x" back
    fourth = scheduler.schedule()
    assert fourth.is_empty and fourth.finished_req_ids == {"a"}
    runner.execute(fourth)
    assert scheduler.update_from_output(second, second_output) == []  # the late output of a preempted request
    assert scheduler.update_from_output(third, third_output) == []  # and of an aborted one
    result = run_to_completion(scheduler, runner)
    assert result.outputs["x"] == reference_output(
        list(range(50, 82)), SamplingParams(max_tokens=4), weighted_sum_token, 64
    )


def test_each_overlapped_batch_takes_its_share_of_the_requests_so_the_next_finds_some_not_in_flight():
    scheduler = make_scheduler(max_batches_in_flight=2)
    prompts = {f"r{index}": [index + 1, index + 2] for index in range(16)}
    for request_id, prompt in prompts.items():
        scheduler.add_request(make_request(request_id, prompt, max_tokens=6))
    run = run_pipelined(scheduler, FakeRunner(scheduler.kv_cache_manager), depth=2)
    # 16 requests of 6 steps each (one prefill, five decodes) in two groups of 8 taking turns, not one batch of 16.
    assert [len(step.num_scheduled_tokens) for step in run.result.steps if not step.is_empty] == [8] * 12
    assert run.result.outputs == {
        request_id: reference_output(prompt, SamplingParams(max_tokens=6), weighted_sum_token, 64)
        for request_id, prompt in prompts.items()
    }
