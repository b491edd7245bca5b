"""Image requests through the engine give transformers' own greedy tokens, for LLaVA and Qwen2-VL (M-RoPE).

Every case runs image+text requests batched with text-only ones and compares
each request's greedy tokens with ``generate`` of the same tiny random model
(tests/support/mm_models.py), which expands the image markers on the text and runs
the image through transformers' own forward.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any, ClassVar

import pytest

from mm_models import test_image, transformers_greedy_mm
from patchbay import LLM, SamplingParams, hookimpl
from patchbay.contract.registry import Registry
from patchbay.contract.settings import ConfigError
from patchbay.engine import MultiModalInputError
from patchbay.entrypoints.run_command import summarise
from patchbay.interfaces import DraftBatch, Drafter, DrafterCapabilities, DraftProposals

NUM_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True)
MARKERS = {"qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>", "llava": "<image>"}
CAT, DOG, WIDE = test_image(32, 32, 1), test_image(32, 32, 2), test_image(64, 48, 3)


@pytest.fixture(params=["qwen2_vl", "llava"])
def family(request: pytest.FixtureRequest, tiny_qwen2_vl: Path, tiny_llava: Path) -> tuple[str, Path]:
    return request.param, tiny_qwen2_vl if request.param == "qwen2_vl" else tiny_llava


_REFERENCES: dict[tuple[Path, str, tuple[int, ...], int], list[int]] = {}


def reference(model_dir: Path, prompt: str, images: tuple[Any, ...], num_tokens: int = NUM_TOKENS) -> list[int]:
    """transformers' greedy tokens, computed once per model, prompt, images (the module's image objects) and
    length."""
    key = (model_dir, prompt, tuple(id(image) for image in images), num_tokens)
    if key not in _REFERENCES:
        _REFERENCES[key] = transformers_greedy_mm(model_dir, prompt, list(images), num_tokens)
    return _REFERENCES[key]


def image_prompt(family: str, text: str, images: list[Any]) -> dict[str, Any]:
    """``text`` with ``{}`` where each image goes, as a prompt with its images."""
    return {"prompt": text.format(*[MARKERS[family]] * len(images)), "multi_modal_data": {"image": images}}


def mixed_batch(family: str) -> list[dict[str, Any] | str]:
    """Image requests (one image, two images, an image repeated) between text-only ones."""
    return [
        image_prompt(family, "Describe {} in a few words.", [CAT]),
        "A text-only request between image requests",
        image_prompt(family, "Compare {} with {} please.", [WIDE, DOG]),
        image_prompt(family, "The same image twice: {} and {} again.", [CAT, CAT]),
        "Another text-only one",
    ]


def expected(model_dir: Path, prompts: list[dict[str, Any] | str], num_tokens: int = NUM_TOKENS) -> list[list[int]]:
    return [
        reference(model_dir, prompt, (), num_tokens)
        if isinstance(prompt, str)
        else reference(model_dir, prompt["prompt"], tuple(prompt["multi_modal_data"]["image"]), num_tokens)
        for prompt in prompts
    ]


def greedy_tokens(llm: LLM, prompts: list[Any], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [output.completions[0].token_ids for output in llm.generate(prompts, params)]


def make_llm(model_dir: Path, **overrides: Any) -> LLM:
    settings: dict[str, Any] = dict(
        model__path=str(model_dir), model__max_model_len=256, cache__block_size=8, cache__num_blocks=128
    )
    return LLM(**{**settings, **overrides})


def test_mixed_batch_equals_transformers(family: tuple[str, Path]) -> None:
    name, model_dir = family
    llm = make_llm(model_dir)
    prompts = mixed_batch(name)
    outputs = llm.generate(prompts, GREEDY)
    assert [output.completions[0].token_ids for output in outputs] == expected(model_dir, prompts)
    stats = llm.engine.scheduler.encoder_cache.stats
    # CAT is used three times (one request, twice in another), WIDE and DOG once: 3 encoded, 2 shared.
    assert (stats.misses, stats.hits) == (3, 2)
    report = llm.engine.report()
    assert report.encoder_cache == stats
    assert report.step_timings["encoder"] > 0
    summary = summarise(outputs, 1.0, llm.engine)
    assert re.search(
        r"^encoder cache: +3 images encoded \(\d+ tokens, [\d.]+ s\), 2 served from the cache$", summary, re.M
    )


def test_chunked_prefill_through_images(family: tuple[str, Path]) -> None:
    """Chunks of 5 tokens cut through every image; an encoder budget of one image a step stops chunks too."""
    name, model_dir = family
    one_image = 16  # the largest image of the batch in either family
    llm = make_llm(model_dir, scheduler__max_num_batched_tokens=5, scheduler__max_num_encoder_input_tokens=one_image)
    prompts = mixed_batch(name)
    assert greedy_tokens(llm, prompts) == expected(model_dir, prompts)


def test_preemption_recomputes_image_requests(family: tuple[str, Path]) -> None:
    name, model_dir = family
    # 8 usable blocks of 8 tokens: the batch cannot hold all its requests' prompts and outputs at once.
    llm = make_llm(model_dir, cache__num_blocks=9, model__max_model_len=64, scheduler__max_num_batched_tokens=64)
    prompts = mixed_batch(name)
    assert greedy_tokens(llm, prompts) == expected(model_dir, prompts)
    assert llm.engine.stats.num_preemptions > 0


def test_another_image_never_hits_the_prefix_cache(family: tuple[str, Path]) -> None:
    name, model_dir = family
    llm = make_llm(model_dir)
    manager = llm.engine.kv_cache_manager
    text = "Tell me about this picture: {} and nothing else, please, in detail."
    first, other, same = (image_prompt(name, text, [image]) for image in (CAT, DOG, CAT))
    greedy_tokens(llm, [first])
    hits = manager.prefix_cache_hits
    assert greedy_tokens(llm, [other]) == expected(model_dir, [other])
    # Only the blocks before the image's placeholders are shared.
    prompt_ids = llm.encode(other)[1]
    image_start = prompt_ids.index(llm.engine.image_inputs.image_token_id)
    assert manager.prefix_cache_hits - hits == image_start // 8 * 8
    hits = manager.prefix_cache_hits
    assert greedy_tokens(llm, [same]) == expected(model_dir, [same])
    assert manager.prefix_cache_hits - hits > image_start // 8 * 8  # the image's blocks hit too


def test_ngram_speculation_and_json_schema_on_image_requests(family: tuple[str, Path]) -> None:
    name, model_dir = family
    llm = make_llm(model_dir, spec_decode={"name": "ngram", "num_speculative_tokens": 3})
    # The n-gram drafter proposes once an output token repeats an earlier one, which the random models do rarely:
    # test_drafts_verified_on_image_requests drafts for certain.
    prompts = [*mixed_batch(name), image_prompt(name, "a b a b a b a b {} a b a b", [DOG])]
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert greedy_tokens(llm, prompts, long) == expected(model_dir, prompts, 24)
    # A random model never stops on its own: a schema of bounded length, and no free whitespace.
    schema = {
        "type": "object",
        "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
        "additionalProperties": False,
    }
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_output={"json_schema": schema})
    constrained = make_llm(model_dir, structured_output={"options": {"any_whitespace": False}})
    (output,) = constrained.generate([image_prompt(name, "JSON about {}:", [WIDE])], params)
    answer = json.loads(output.completions[0].text)
    assert isinstance(answer["a"], bool) and answer["b"] in ("x", "y")


class OracleDrafter(Drafter):
    """Proposes transformers' own greedy continuation of each request, wrong from its second draft on."""

    capabilities: ClassVar[DrafterCapabilities] = DrafterCapabilities(devices=("cpu",))
    continuations: ClassVar[dict[str, list[int]]] = {}
    prompt_lengths: ClassVar[dict[str, int]] = {}

    def propose(self, batch: DraftBatch) -> DraftProposals:
        found = []
        for index, (req_id, tokens) in enumerate(zip(batch.req_ids, batch.token_ids, strict=True)):
            done = len(tokens) - self.prompt_lengths[req_id]
            drafts = list(self.continuations[req_id][done : done + batch.num_speculative_tokens])
            if len(drafts) > 1:
                drafts[1] = (drafts[1] + 1) % 1000  # rejected: the step keeps one draft and the correction
            found.append([] if index in batch.skip else drafts)
        return DraftProposals(found)


class OraclePlugin:
    @hookimpl
    def register_drafters(self, register: Any) -> None:
        register("oracle", OracleDrafter)


def test_drafts_verified_on_image_requests(family: tuple[str, Path]) -> None:
    """Drafts (one right, then wrong ones) on image requests: verification keeps transformers' tokens."""
    name, model_dir = family
    registry = Registry.from_entry_points()
    registry.add_plugin(OraclePlugin(), name="oracle-test")
    llm = make_llm(model_dir, registry=registry, spec_decode={"name": "oracle", "num_speculative_tokens": 3})
    prompts = mixed_batch(name)
    references = expected(model_dir, prompts)
    engine = llm.engine
    for index, (prompt, continuation) in enumerate(zip(prompts, references, strict=True)):
        text, token_ids = llm.encode(prompt)
        images = prompt.get("multi_modal_data") if isinstance(prompt, dict) else None
        engine.add_request(token_ids, GREEDY, prompt=text, request_id=f"r{index}", multi_modal_data=images)
        OracleDrafter.continuations[f"r{index}"] = continuation
        OracleDrafter.prompt_lengths[f"r{index}"] = engine.scheduler.requests[f"r{index}"].num_prompt_tokens
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((output.request_id, output.completions[0].token_ids) for output in engine.step())
    assert [outputs[f"r{index}"] for index in range(len(prompts))] == references
    assert (
        llm.spec_stats.num_accepted_tokens > 0 and llm.spec_stats.num_draft_tokens > llm.spec_stats.num_accepted_tokens
    )


def test_the_same_image_in_sequential_requests_is_encoded_once(family: tuple[str, Path]) -> None:
    name, model_dir = family
    llm = make_llm(model_dir)
    prompts = [image_prompt(name, "First look at {} now.", [CAT]), image_prompt(name, "Then {} again?", [CAT])]
    for prompt in prompts:  # one after the other: the first is done before the second comes
        assert greedy_tokens(llm, [prompt]) == expected(model_dir, [prompt])
    stats = llm.engine.scheduler.encoder_cache.stats
    assert (stats.misses, stats.hits, stats.evictions) == (1, 1, 0)
    assert llm.engine.runner.images.num_encoded == 1


def test_a_soak_of_image_requests_keeps_the_caches_bounded(tiny_qwen2_vl: Path) -> None:
    """300 requests over 12 images (one 12 tokens, the rest 4) in a 24-token encoder cache: hits, evictions,
    the KV pool empty at the end, the runner holding exactly the outputs the scheduler counts."""
    cache_size = 24
    llm = make_llm(
        tiny_qwen2_vl,
        scheduler__max_num_seqs=8,
        scheduler__max_num_batched_tokens=24,
        scheduler__encoder_cache_size=cache_size,
    )
    images = [test_image(32, 32, seed) for seed in range(11)] + [WIDE]
    # Mostly a small working set (hits), now and then an image from the rest (evictions).
    picks = [index % 3 if index % 4 else (index // 4) % 12 for index in range(300)]
    prompts = [image_prompt("qwen2_vl", f"Image {index}: {{}} ok", [images[pick]]) for index, pick in enumerate(picks)]
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert len(outputs) == 300
    engine = llm.engine
    cache = engine.scheduler.encoder_cache
    assert cache.num_entries_in_use == 0 and 0 < cache.num_cached_tokens <= cache_size
    assert len(engine.runner.images.cache) == cache.num_entries
    assert sum(output.shape[0] for output in engine.runner.images.cache.outputs.values()) == cache.num_cached_tokens
    stats = cache.stats
    assert stats.misses + stats.hits == 300  # every image was encoded or shared, once per request
    assert stats.hits > 150 and stats.evictions > 0 and stats.misses == engine.runner.images.num_encoded
    manager = engine.kv_cache_manager
    assert not engine.has_unfinished_requests()
    assert manager.num_free_blocks == manager.num_blocks - 1  # all but the null block
    for index in (0, 1, 2, 4, 44, 299):  # hits, misses, evicted-then-encoded-again, WIDE: transformers' tokens
        prompt = prompts[index]
        assert outputs[index].completions[0].token_ids == reference(
            tiny_qwen2_vl, prompt["prompt"], tuple(prompt["multi_modal_data"]["image"]), 2
        )


def test_bad_image_requests_fail_alone_naming_the_request(tiny_qwen2_vl: Path, tiny_llama: Path) -> None:
    text_only = LLM(model__path=str(tiny_llama), model__max_model_len=128, cache__num_blocks=32)
    with pytest.raises(MultiModalInputError, match="'7'.*takes text only"):
        text_only.generate([{"prompt": "hi", "multi_modal_data": {"image": CAT}}], GREEDY, request_ids=["7"])
    llm = make_llm(tiny_qwen2_vl)
    with pytest.raises(MultiModalInputError, match="'two'.*1 image markers.*2 images"):
        llm.generate(
            [image_prompt("qwen2_vl", "{}", [CAT]) | {"multi_modal_data": {"image": [CAT, DOG]}}],
            GREEDY,
            request_ids=["two"],
        )
    # A path is an image source (patchbay.multimodal.images); a missing file fails naming the request and the part.
    with pytest.raises(ValueError, match=r"'arr'.*multi_modal_data\.image\[0\].*cannot read image file 'cat.png'"):
        llm.generate(
            [{"prompt": MARKERS["qwen2_vl"], "multi_modal_data": {"image": "cat.png"}}], GREEDY, request_ids=["arr"]
        )
    big = make_llm(tiny_qwen2_vl, scheduler__encoder_cache_size=8)
    with pytest.raises(ValueError, match="'huge'.*image 0 takes 12 placeholder tokens.*encoder_cache_size=8"):
        big.generate([image_prompt("qwen2_vl", "{}", [WIDE])], GREEDY, request_ids=["huge"])
    # The engine goes on serving.
    prompts = [image_prompt("qwen2_vl", "Fine: {}", [CAT])]
    assert greedy_tokens(llm, prompts) == expected(tiny_qwen2_vl, prompts)


def test_a_step_failing_for_one_request_replays_image_requests_alone(
    tiny_qwen2_vl: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The replay of a failed step runs each image request alone, with its images and M-RoPE positions."""
    llm = make_llm(tiny_qwen2_vl)
    base = type(llm.engine.sampler)

    class FussySampler(base):  # type: ignore[misc, valid-type]
        def sample(self, logits: Any, metadata: Any) -> Any:
            if (metadata.temperature == 0.5).any():
                raise RuntimeError("this sampler cannot take that temperature")
            return super().sample(logits, metadata)

    fussy = FussySampler(llm.engine.sampler.options)
    monkeypatch.setattr(llm.engine, "sampler", fussy)
    monkeypatch.setattr(llm.engine.runner, "sampler", fussy)
    prompts = mixed_batch("qwen2_vl")
    bad = SamplingParams(max_tokens=NUM_TOKENS, temperature=0.5)
    outputs = llm.generate([*prompts, prompts[0]], [GREEDY] * len(prompts) + [bad])
    assert outputs[-1].finish_reason == "error"
    assert [output.completions[0].token_ids for output in outputs[:-1]] == expected(tiny_qwen2_vl, prompts)
    cache = llm.engine.scheduler.encoder_cache
    assert cache.num_entries_in_use == 0 and len(llm.engine.runner.images.cache) == cache.num_entries


def test_the_encoder_cache_counts_in_automatic_kv_sizing(tiny_qwen2_vl: Path) -> None:
    with pytest.raises(ConfigError, match=r"the encoder cache [\d.]+ GiB \(scheduler.encoder_cache_size\)"):
        LLM(model__path=str(tiny_qwen2_vl), scheduler__encoder_cache_size=10**9)


def test_the_async_engine_takes_images(tiny_llava: Path) -> None:
    from patchbay.contract.settings import load_settings
    from patchbay.engine import AsyncLLM

    prompt = image_prompt("llava", "Async {} here", [WIDE])

    async def scenario() -> list[int]:
        settings = load_settings(None, overrides=[f"model.path={tiny_llava}", "model.max_model_len=256"])
        llm = AsyncLLM(settings)
        try:
            text, token_ids = llm.encode(prompt)
            last = None
            async for delta in llm.generate(
                token_ids, GREEDY, prompt=text, multi_modal_data=prompt["multi_modal_data"]
            ):
                last = delta
            assert last is not None and last.output is not None
            return last.output.completions[0].token_ids
        finally:
            await llm.shutdown()

    assert asyncio.run(scenario()) == expected(tiny_llava, [prompt])[0]


def test_processed_images_are_taken_as_they_are_and_only_for_their_prompt(tiny_llava: Path) -> None:
    llm = make_llm(tiny_llava)
    engine = llm.engine
    prompt = image_prompt("llava", "Processed {} once", [WIDE])
    text, token_ids = llm.encode(prompt)
    processed = engine.process_images("p", token_ids, prompt["multi_modal_data"])
    assert processed.num_prompt_tokens > len(token_ids)
    with pytest.raises(MultiModalInputError, match="'other'.*made for another prompt"):
        engine.add_request(token_ids[1:], GREEDY, request_id="other", multi_modal_data=processed)
    engine.add_request(token_ids, GREEDY, prompt=text, request_id="p", multi_modal_data=processed)
    assert engine.scheduler.requests["p"].num_prompt_tokens == processed.num_prompt_tokens
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    assert outputs[0].completions[0].token_ids == expected(tiny_llava, [prompt])[0]
