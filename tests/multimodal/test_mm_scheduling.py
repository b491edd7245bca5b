"""The scheduler's side of images, without a model: the encoder budget, the encoder cache, and block hashes."""

from __future__ import annotations

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
    assert sched.encoder_cache.num_entries == 0  # all 8 placeholders computed: released
    assert sched.schedule().free_encoder_hashes == ["cat"]


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
    second = sched.schedule()  # "a" consumed its image: "dog" fits now
    assert second.num_scheduled_tokens == {"a": 1, "b": 12}
    assert second.scheduled_encoder_inputs == {"b": [0]} and second.free_encoder_hashes == ["cat"]


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
    assert sched.encoder_cache.num_entries == 1
    request = sched.requests["a"]
    sched.running.remove(request)
    sched._preempt(request)
    assert sched.encoder_cache.num_entries == 0
    again = sched.schedule()  # it comes back and encodes its image again
    assert again.scheduled_encoder_inputs == {"a": [0]} and again.free_encoder_hashes == ["cat"]
