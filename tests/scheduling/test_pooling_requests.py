"""Pooling requests in the scheduler: they run their prompt (in chunks), sample nothing and finish with the runner's
vector; those whose pooler reads more than the last position never start from a prefix-cache hit."""

from __future__ import annotations

from patchbay.interfaces import PoolingParams
from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.request import PoolingRequest, Request
from patchbay.scheduling.scheduler_output import ModelRunnerOutput, SchedulerOutput

from test_scheduler import BLOCK_SIZE, make_scheduler

PREFIX = list(range(10, 10 + 3 * BLOCK_SIZE))


def pooling_request(request_id: str, prompt: list[int], whole_prompt: bool) -> Request:
    return Request(
        request_id,
        prompt,
        SamplingParams(max_tokens=1),
        block_size=BLOCK_SIZE,
        pooling=PoolingRequest(PoolingParams(), None, whole_prompt),
    )


def pooled_output(output: SchedulerOutput, finished: set[str]) -> ModelRunnerOutput:
    """What a pooling runner answers: no samples, a vector for each request whose prompt finished."""
    ids = list(output.num_scheduled_tokens)
    return ModelRunnerOutput(
        req_ids=ids, sampled_token_ids=[[] for _ in ids], pooled={req_id: [float(len(req_id))] for req_id in finished}
    )


def test_a_pooling_request_runs_its_prompt_in_chunks_then_finishes_with_the_vector():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    scheduler.add_request(pooling_request("p", list(range(10, 50)), whole_prompt=False))
    steps = 0
    while True:
        output = scheduler.schedule()
        steps += 1
        request = scheduler.requests["p"]
        done = request.num_computed_tokens + output.num_scheduled_tokens["p"] >= request.num_tokens
        updates = scheduler.update_from_output(output, pooled_output(output, {"p"} if done else set()))
        if done:
            break
        assert updates == []  # a chunk finishes nothing and samples nothing
    assert steps == 3  # 40 tokens, 16 a step
    (update,) = updates
    assert (update.finish_reason, update.new_token_ids, update.pooled) == ("stop", [], [1.0])
    assert not scheduler.has_unfinished_requests() and scheduler.kv_cache_manager.num_free_blocks == 199


def test_a_finished_prompt_the_runner_pooled_nothing_for_fails_alone():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    scheduler.add_request(pooling_request("p", PREFIX[:5], whole_prompt=False))
    output = scheduler.schedule()
    (update,) = scheduler.update_from_output(output, pooled_output(output, set()))
    assert update.finish_reason == "error" and "pooled nothing" in str(update.stop_reason)


def test_only_last_position_poolers_start_from_a_prefix_cache_hit():
    for whole_prompt, expected_hit in ((False, 2 * BLOCK_SIZE), (True, 0)):
        scheduler = make_scheduler(max_num_batched_tokens=128)
        scheduler.add_request(pooling_request("first", PREFIX, whole_prompt))
        output = scheduler.schedule()
        scheduler.update_from_output(output, pooled_output(output, {"first"}))
        scheduler.add_request(pooling_request("second", PREFIX[: 2 * BLOCK_SIZE] + [1, 2, 3], whole_prompt))
        output = scheduler.schedule()
        assert output.scheduled_new_reqs[0].num_computed_tokens == expected_hit, f"whole_prompt={whole_prompt}"
        assert output.scheduled_new_reqs[0].pooling is not None
