"""The scheduler's side of images, without a model: the encoder budget, the encoder cache, and block hashes."""

from __future__ import annotations

import pytest

from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.kv_cache_manager import KVCacheManager
from patchbay.scheduling.kv_cache_spec import KVCacheGroup, KVCacheSpec
from patchbay.scheduling.multimodal import ImageFeature
from patchbay.scheduling.request import Request
from patchbay.scheduling.scheduler import Scheduler
from patchbay.scheduling.scheduler_output import ModelRunnerOutput, SchedulerOutput

BLOCK = 4
IMAGE = 99


def scheduler(budget: int = 64, encoder_budget: int = 100, cache_size: int = 100) -> Scheduler:
    groups = [KVCacheGroup(KVCacheSpec(block_size=BLOCK, num_kv_heads=1, head_size=8), ["layers.0"])]
    return Scheduler(
        KVCacheManager(groups, 64),
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_model_len=128,
        block_size=BLOCK,
        max_num_encoder_input_tokens=encoder_budget,
        encoder_cache_size=cache_size,
    )


def image_request(request_id: str, images: list[tuple[str, int, int]], length: int = 24) -> Request:
    """A prompt of ``length`` tokens with images ``(content hash, offset, placeholder tokens)``."""
    tokens = list(range(1, length + 1))
    features = [ImageFeature(name, offset, size) for name, offset, size in images]
    for feature in features:
        tokens[feature.offset : feature.end] = [IMAGE] * feature.length
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    return Request(request_id, tokens, params, block_size=BLOCK, mm_features=features)


def run(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """Advance the scheduled requests as a runner would (a token for each that completes its prompt)."""
    req_ids = list(output.num_scheduled_tokens)
    sampled = [
        [7] if scheduler.requests[r].num_computed_tokens + n >= scheduler.requests[r].num_tokens else []
        for r, n in output.num_scheduled_tokens.items()
    ]
    scheduler.update_from_output(output, ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled))


def test_an_image_is_encoded_whole_in_the_step_whose_chunk_reaches_it() -> None:
    sched = scheduler(budget=6)
    sched.add_request(image_request("a", [("cat", 4, 8)]))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 6} and first.scheduled_encoder_inputs == {"a": [0]}
    run(sched, first)
    second = sched.schedule()  # tokens 6..12 run through the rest of the image: its output is held
    assert second.num_scheduled_tokens == {"a": 6} and second.scheduled_encoder_inputs == {}
    run(sched, second)
    cache = sched.encoder_cache
    # All 8 placeholders computed: released, but kept until a new image needs the room.
    assert (cache.num_entries, cache.num_entries_in_use) == (1, 0)
    assert sched.schedule().free_encoder_hashes == []


def test_a_chunk_stops_before_an_image_the_encoder_budget_cannot_take() -> None:
    sched = scheduler(encoder_budget=8)
    sched.add_request(image_request("a", [("cat", 2, 8), ("dog", 12, 8)], length=24))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 12}  # up to the second image, which would exceed the budget
    assert first.scheduled_encoder_inputs == {"a": [0]}
    run(sched, first)
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"a": 12} and second.scheduled_encoder_inputs == {"a": [1]}


def test_a_request_waits_while_the_encoder_cache_is_full() -> None:
    sched = scheduler(budget=32, cache_size=8)
    sched.add_request(image_request("a", [("cat", 0, 8)], length=12))
    sched.add_request(image_request("b", [("dog", 0, 8)], length=12))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"a": 12}  # "b" starts on its image: the cache holds "cat", no room
    run(sched, first)
    second = sched.schedule()  # "a" consumed its image: "dog" fits now, evicting the released "cat"
    assert second.num_scheduled_tokens == {"a": 1, "b": 12}
    assert second.scheduled_encoder_inputs == {"b": [0]} and second.free_encoder_hashes == ["cat"]
    assert sched.encoder_cache.stats.evictions == 1


def test_identical_images_share_one_encoding() -> None:
    sched = scheduler()
    sched.add_request(image_request("a", [("cat", 0, 4), ("cat", 8, 4)]))
    sched.add_request(image_request("b", [("cat", 4, 4)]))
    output = sched.schedule()
    assert output.scheduled_encoder_inputs == {"a": [0]}
    stats = sched.encoder_cache.stats
    assert (stats.misses, stats.hits) == (1, 2)


def test_oversized_images_are_refused_naming_the_request() -> None:
    sched = scheduler(encoder_budget=4)
    try:
        sched.add_request(image_request("big", [("cat", 0, 8)]))
    except ValueError as exc:
        assert "'big'" in str(exc) and "max_num_encoder_input_tokens=4" in str(exc)
    else:
        raise AssertionError("an image over the encoder budget was accepted")


def test_block_hashes_carry_the_images_they_overlap() -> None:
    cat = image_request("a", [("cat", 5, 4)])
    dog = image_request("b", [("dog", 5, 4)])
    text = image_request("c", [])
    # Block 0 ([0, 4)) has no image; blocks 1 and 2 hold placeholders 5..8; the chain carries it on.
    assert cat.block_hashes[0] == dog.block_hashes[0]
    assert all(a != b for a, b in zip(cat.block_hashes[1:], dog.block_hashes[1:], strict=True))
    assert cat.block_hashes == image_request("a2", [("cat", 5, 4)]).block_hashes
    assert cat.block_hashes[0] == text.block_hashes[0] and cat.block_hashes[1] != text.block_hashes[1]


def test_preemption_releases_images() -> None:
    sched = scheduler(budget=4)
    sched.add_request(image_request("a", [("cat", 0, 8)]))
    run(sched, sched.schedule())
    assert sched.encoder_cache.num_entries_in_use == 1
    request = sched.requests["a"]
    sched.running.remove(request)
    sched._preempt(request)
    assert sched.encoder_cache.num_entries_in_use == 0
    again = sched.schedule()  # it comes back and finds its image's output still cached
    assert again.scheduled_encoder_inputs == {} and again.free_encoder_hashes == []
    assert (sched.encoder_cache.stats.misses, sched.encoder_cache.stats.hits) == (1, 1)


def test_without_chunked_prefill_a_prompt_waits_for_all_its_images() -> None:
    groups = [KVCacheGroup(KVCacheSpec(block_size=BLOCK, num_kv_heads=1, head_size=8), ["layers.0"])]
    sched = Scheduler(
        KVCacheManager(groups, 64),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        block_size=BLOCK,
        chunked_prefill=False,
        max_num_encoder_input_tokens=8,
        encoder_cache_size=100,
    )
    sched.add_request(image_request("a", [("cat", 0, 8)], length=12))
    sched.add_request(image_request("b", [("dog", 4, 8)], length=12))
    first = sched.schedule()  # "b" would be cut before its image (the budget went to "cat"): it waits whole
    assert first.num_scheduled_tokens == {"a": 12}
    run(sched, first)
    assert sched.schedule().num_scheduled_tokens == {"a": 1, "b": 12}


def test_without_chunked_prefill_images_over_one_steps_budget_are_refused() -> None:
    groups = [KVCacheGroup(KVCacheSpec(block_size=BLOCK, num_kv_heads=1, head_size=8), ["layers.0"])]
    sched = Scheduler(
        KVCacheManager(groups, 64),
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=128,
        block_size=BLOCK,
        chunked_prefill=False,
        max_num_encoder_input_tokens=8,
    )
    sched.add_request(image_request("same", [("cat", 0, 8), ("cat", 10, 8)], length=20))  # one encoding
    with pytest.raises(ValueError, match="'two'.*16 placeholder tokens.*chunked_prefill is off"):
        sched.add_request(image_request("two", [("cat", 0, 8), ("dog", 10, 8)], length=20))


def finish(sched: Scheduler) -> None:
    """Run every request to its end."""
    while sched.requests:
        run(sched, sched.schedule())


def test_a_released_image_is_a_hit_for_the_next_request() -> None:
    sched = scheduler()
    sched.add_request(image_request("a", [("cat", 2, 8)], length=12))
    finish(sched)
    sched.add_request(image_request("b", [("cat", 4, 8)], length=16))
    output = sched.schedule()
    assert output.num_scheduled_tokens == {"b": 16} and output.scheduled_encoder_inputs == {}
    stats = sched.encoder_cache.stats
    assert (stats.misses, stats.hits, stats.evictions) == (1, 1, 0)


def test_released_images_are_evicted_least_recently_released_first() -> None:
    sched = scheduler(cache_size=16)
    for request_id, name in (("a", "cat"), ("b", "dog")):
        sched.add_request(image_request(request_id, [(name, 0, 8)], length=12))
        finish(sched)
    # Another prompt (no prefix hit) takes "cat" back: "dog" is the older release now.
    sched.add_request(image_request("c", [("cat", 2, 8)], length=12))
    finish(sched)
    sched.add_request(image_request("d", [("owl", 0, 8)], length=12))
    output = sched.schedule()
    assert output.scheduled_encoder_inputs == {"d": [0]} and output.free_encoder_hashes == ["dog"]
    cache = sched.encoder_cache
    assert cache.num_cached_tokens == 16 and cache.num_entries == 2


def test_an_image_taken_back_is_never_evicted_for_another_of_the_same_chunk() -> None:
    sched = scheduler(cache_size=16)
    sched.add_request(image_request("b", [("dog", 0, 8)], length=12))
    finish(sched)
    sched.add_request(image_request("a", [("cat", 0, 8)], length=12))
    finish(sched)  # both released ("dog" first), the cache full
    sched.add_request(image_request("c", [("dog", 1, 8), ("owl", 10, 8)], length=20))
    output = sched.schedule()  # "owl" evicts "cat", never the older "dog", which the same chunk reads
    assert output.num_scheduled_tokens == {"c": 20}
    assert output.scheduled_encoder_inputs == {"c": [1]} and output.free_encoder_hashes == ["cat"]


def test_a_hit_whose_holder_is_preempted_encodes_nothing_uncounted() -> None:
    """A chunk planned to read "a"'s cached image; making KV room for it preempts "a", which releases the image:
    it stays cached, so the step encodes nothing its encoder budget did not count (nor anything at all)."""
    sched = scheduler(budget=4, encoder_budget=8, cache_size=8)
    sched.add_request(image_request("a", [("cat", 0, 8)], length=12))
    run(sched, sched.schedule())  # "a" holds "cat", 4 of its placeholders computed
    holder = sched.requests["a"]
    reader = image_request("b", [("cat", 1, 8)], length=12)
    sched.add_request(reader)
    num_new, plan = sched._plan_encoder_inputs(reader, 0, 12, encoder_budget=0)
    assert (num_new, plan) == (12, [(0, True)])  # a hit needs no encoder budget
    sched.running.remove(holder)
    sched._preempt(holder)  # what _allocate_or_preempt does for "b"'s blocks
    encoder_inputs: dict[str, list[int]] = {}
    assert sched._commit_encoder_inputs(reader, plan, encoder_inputs) == 0 and encoder_inputs == {}
    stats = sched.encoder_cache.stats
    assert (stats.misses, stats.hits) == (1, 1)
    assert sched.encoder_cache.uses("b", 0, reader.mm_features[0])
