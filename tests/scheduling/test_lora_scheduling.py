"""The scheduler keeps the running requests within lora.max_loras adapters; block hashes carry the adapter."""

from __future__ import annotations

from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.kv_cache_manager import KVCacheManager
from patchbay.scheduling.kv_cache_spec import KVCacheGroup, KVCacheSpec
from patchbay.scheduling.request import Request
from patchbay.scheduling.scheduler import Scheduler
from patchbay.scheduling.scheduler_output import ModelRunnerOutput

BLOCK_SIZE = 4


def _scheduler(max_loras: int) -> Scheduler:
    groups = [KVCacheGroup(KVCacheSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8), ["layers.0"])]
    return Scheduler(
        KVCacheManager(groups, 200, True),
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=64,
        block_size=BLOCK_SIZE,
        max_loras=max_loras,
    )


def _request(request_id: str, lora: str | None, max_tokens: int = 3) -> Request:
    return Request(
        request_id,
        [1, 2, 3, 4, 5],
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, lora=lora),
        block_size=BLOCK_SIZE,
    )


def test_a_step_never_runs_more_than_max_loras_adapters():
    scheduler = _scheduler(max_loras=2)
    adapters = {"a": "x", "b": "y", "c": "z", "d": "x", "e": None, "f": "z"}
    for request_id, lora in adapters.items():
        scheduler.add_request(_request(request_id, lora, max_tokens=2 if lora == "x" else 4))
    seen_running: list[set[str]] = []
    for _ in range(30):
        output = scheduler.schedule()
        if output.is_empty and not scheduler.running and not scheduler.waiting:
            break
        running = {r.sampling_params.lora for r in scheduler.running} - {None}
        assert len(running) <= 2, running
        seen_running.append(running)
        ids = list(output.num_scheduled_tokens)
        scheduler.update_from_output(output, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[7] for _ in ids]))
    assert not scheduler.running and not scheduler.waiting, "every request finished"
    assert {"x", "y"} in seen_running and any("z" in running for running in seen_running)
    # The base request never waited on adapters: it ran in the first step.
    assert seen_running[0] == {"x", "y"}


def test_the_same_prompt_hashes_apart_per_adapter():
    base, first, second, again = (_request(i, lora) for i, lora in (("0", None), ("1", "x"), ("2", "y"), ("3", "x")))
    assert len({base.block_hashes[0], first.block_hashes[0], second.block_hashes[0]}) == 3
    assert first.block_hashes == again.block_hashes
