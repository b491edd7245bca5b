"""Pipeline parallelism on gloo: stages as processes, each with its own layers and KV cache, batches in flight on
every stage at once, equal tokens, failures.

Multi-process cases are slow (each stage is a Python process that loads
torch and the model); one two-stage engine is shared by the cases that can.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from test_tensor_parallel import (
    NUM_TOKENS,
    PROMPTS,
    check_structured_batch,
    completions,
    greedy,
    rank_processes,
    structured_batch,
    wait_until_gone,
)
from tiny_models import transformers_greedy

import patchbay
from patchbay import SamplingParams
from patchbay.contract.settings import ConfigError, load_settings
from patchbay.engine import EngineDeadError
from patchbay.engine.ranks import RankDiedError

PP2 = dict(
    runtime__pipeline_parallel_size=2,
    scheduler__max_num_batched_tokens=16,
    cache__block_size=4,
    cache__num_blocks=64,
    model__max_model_len=128,
)
ONE_STAGE = {**PP2, "runtime__pipeline_parallel_size": 1}


def child_ranks() -> set[int]:
    """Pids of this process's live rank processes (other runs on a shared machine have their own)."""
    children = set()
    for pid in rank_processes():
        try:
            ppid = int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue
        if ppid == os.getpid():
            children.add(pid)
    return children


@pytest.fixture(scope="module")
def single(tiny_llama: Path) -> patchbay.LLM:
    """The tiny 4-layer Llama in this process alone."""
    return patchbay.LLM(model__path=str(tiny_llama), **ONE_STAGE)


@pytest.fixture(scope="module")
def pp2(tiny_llama: Path) -> Iterator[patchbay.LLM]:
    """The same model in two stages of two layers each."""
    llm = patchbay.LLM(model__path=str(tiny_llama), **PP2)
    yield llm
    llm.engine.close()


# -- configuration --------------------------------------------------------------------------------


def test_pipeline_parallel_size_must_be_positive() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(overrides=["runtime.pipeline_parallel_size=0"])
    assert caught.value.problems[0].path == "runtime.pipeline_parallel_size"


def test_stages_take_contiguous_layers_the_first_ones_one_more_when_they_do_not_divide() -> None:
    from patchbay.worker.parallel.pipeline_parallel import StageLayout

    assert [list(StageLayout(4, 2).layer_range(s)) for s in range(2)] == [[0, 1], [2, 3]]
    assert [list(StageLayout(30, 4).layer_range(s)) for s in range(4)] == [
        list(range(0, 8)),
        list(range(8, 16)),
        list(range(16, 23)),
        list(range(23, 30)),
    ]
    assert [len(StageLayout(3, 3).layer_range(s)) for s in range(3)] == [1, 1, 1]
    # runtime.pipeline_layer_partition: the last stage, which also computes the logits, may take fewer.
    assert [list(StageLayout(30, 2, (19, 11)).layer_range(s)) for s in range(2)] == [
        list(range(19)),
        list(range(19, 30)),
    ]


def test_a_layer_partition_must_give_every_stage_layers_adding_up_to_the_model_s(tiny_llama: Path) -> None:
    from transformers import AutoConfig

    from patchbay.worker.parallel.pipeline_parallel import stage_layout

    config = AutoConfig.from_pretrained(tiny_llama)
    assert stage_layout(config, 2, [3, 1]).layer_range(1) == range(3, 4)
    with pytest.raises(ConfigError) as caught:
        stage_layout(config, 2, [2, 1])
    assert caught.value.problems[0].path == "runtime.pipeline_layer_partition"
    assert "add up to LlamaForCausalLM's 4 decoder layers" in caught.value.problems[0].message
    with pytest.raises(ConfigError, match="pipeline_layer_partition gives 2 stages' layers"):
        load_settings(overrides=["runtime.pipeline_parallel_size=3", "runtime.pipeline_layer_partition=3,1"])
    assert load_settings(
        overrides=["runtime.pipeline_parallel_size=2", "runtime.pipeline_layer_partition=3,1"]
    ).runtime.pipeline_layer_partition == [3, 1]


def test_stages_share_the_cores_like_tensor_parallel_ranks() -> None:
    from patchbay.worker.parallel.distributed import rank_threads

    # Batches in flight on every stage: the stages compute at the same time, so they share the cores.
    cores = len(os.sched_getaffinity(0))
    assert rank_threads(load_settings(overrides=["runtime.pipeline_parallel_size=2"])) == max(1, cores // 2)
    assert rank_threads(
        load_settings(overrides=["runtime.pipeline_parallel_size=2", "runtime.tensor_parallel_size=2"])
    ) == max(1, cores // 4)
    assert rank_threads(load_settings(overrides=["runtime.pipeline_parallel_size=2", "runtime.threads=3"])) == 3


def test_more_stages_than_layers_are_refused_before_any_rank_starts(tiny_llama: Path) -> None:
    running = child_ranks()
    with pytest.raises(ConfigError) as caught:
        patchbay.LLM(model__path=str(tiny_llama), runtime__pipeline_parallel_size=5)
    problem = caught.value.problems[0]
    assert problem.path == "runtime.pipeline_parallel_size"
    assert "4 decoder layers, fewer than the 5 stages" in problem.message
    assert child_ranks() <= running


def test_stages_must_each_hold_every_kind_of_attention_layer(tmp_path_factory: pytest.TempPathFactory) -> None:
    """qwen2-mixed-window alternates full and sliding-window layers: a one-layer stage would lack a KV-cache group."""
    from tiny_models import build_tiny_model

    from patchbay.worker.model.hf_model import HFCausalLM
    from patchbay.worker.parallel.pipeline_parallel import split_model, stage_layout

    model_dir = build_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2-mixed-window")
    model = HFCausalLM.load(model_dir, dtype="float32", device=torch.device("cpu"))
    num_layers = model.shape.num_layers
    with pytest.raises(ConfigError) as caught:
        split_model(model, stage_layout(model.model.config, num_layers), 0, link=None)  # type: ignore[arg-type]
    assert caught.value.problems[0].path == "runtime.pipeline_parallel_size"
    assert "stage 0 (layers 0-0) would not hold every kind of attention layer" in caught.value.problems[0].message


def test_hidden_states_of_another_stage_s_layers_cannot_be_captured_for_a_drafter(tiny_llama: Path) -> None:
    from patchbay.toolkit.hidden_states import HiddenStatesError
    from patchbay.worker.model.hf_model import HFCausalLM
    from patchbay.worker.parallel.pipeline_parallel import split_model, stage_layout

    model = HFCausalLM.load(tiny_llama, dtype="float32", device=torch.device("cpu"))
    split_model(model, stage_layout(model.model.config, 2), 0, link=None)  # type: ignore[arg-type]
    model.capture_hidden_states([0, 1]).remove()
    with pytest.raises(HiddenStatesError, match=r"decoder layers \[2, 3\] run on other pipeline stages"):
        model.capture_hidden_states([1, 2, 3])


# -- the same tokens over two stages --------------------------------------------------------------


@pytest.mark.slow
def test_each_stage_holds_its_layers_and_their_kv_cache_only(pp2: patchbay.LLM) -> None:
    from patchbay.worker.parallel.pipeline_parallel import PassThroughLayer

    assert sorted(pp2.engine.model.layer_specs) == [0, 1]
    assert sorted(pp2.engine.runner.kv_caches) == [pp2.engine.model.layer_specs[i].layer_name for i in (0, 1)]
    layers = pp2.engine.model.model.base_model.layers
    assert [isinstance(layer, PassThroughLayer) for layer in layers] == [False, False, True, True]


@pytest.mark.slow
def test_greedy_tokens_over_two_stages_equal_one_process_and_transformers(
    pp2: patchbay.LLM, single: patchbay.LLM, tiny_llama: Path
) -> None:
    expected = transformers_greedy(tiny_llama, PROMPTS, NUM_TOKENS)
    assert len(PROMPTS[1]) > PP2["scheduler__max_num_batched_tokens"]  # a chunked prefill
    assert greedy(single) == expected
    assert greedy(pp2) == expected
    # Again, now from the prefix cache: each stage reads its own layers' cached blocks.
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0.0)
    again = pp2.generate(PROMPTS, params)
    assert [output.token_ids for output in again] == expected
    assert all(output.metrics.num_cached_tokens > 0 for output in again)
    # Overlapped, not lockstep: a second batch started on stage 0 while the first was still in the pipeline.
    assert pp2.engine.stats.max_batches_in_flight == 2
    assert pp2.engine.stats.num_overlapped_batches > 0


@pytest.mark.slow
def test_stage_0_starts_the_next_batch_before_the_last_stage_returns_the_first(
    pp2: patchbay.LLM, single: patchbay.LLM
) -> None:
    engine = pp2.engine
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0.0)
    prompts = [[token + 200 for token in prompt] for prompt in PROMPTS]  # not in the prefix cache yet
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    stats = engine.stats
    steps, overlapped = stats.num_steps, stats.num_overlapped_batches
    # Budget 16: the first batch is prompt 0 and a chunk of prompt 1; the second, prompt 2 (prompt 1 is in flight).
    assert engine.step() == []
    assert stats.num_steps == steps  # the first batch is in the pipeline: no output applied yet
    assert engine.step() == []  # stage 0 runs the second batch, then (the pipeline full) takes the first's output
    assert (stats.num_steps - steps, stats.num_overlapped_batches - overlapped) == (1, 1)
    engine.abort([ids[2]])  # its batch is in flight: the late output is dropped
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((output.request_id, output) for output in engine.step())
    assert finished[ids[2]].finish_reason == "abort"
    assert [finished[request_id].token_ids for request_id in ids[:2]] == greedy(single, prompts[:2])


@pytest.mark.slow
def test_three_stages_keep_three_batches_in_flight_and_equal_one_process(
    tiny_llama: Path, single: patchbay.LLM
) -> None:
    """Layers 0, 1-2 and 3 (a partition of its own): the middle stage receives and sends, the last one returns
    the outputs to rank 0."""
    llm = patchbay.LLM(
        model__path=str(tiny_llama),
        **{**PP2, "runtime__pipeline_parallel_size": 3, "runtime__pipeline_layer_partition": [1, 2, 1]},
    )
    try:
        assert sorted(llm.engine.model.layer_specs) == [0]
        assert greedy(llm) == greedy(single)
        assert llm.engine.stats.max_batches_in_flight == 3  # three requests: a batch of one each, on every stage
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_n_gram_drafts_verified_on_the_last_stage_leave_the_tokens_unchanged(
    tiny_llama: Path, single: patchbay.LLM
) -> None:
    """A request's drafts come with its output, and it is scheduled again only then: overlap leaves them whole."""
    # A prompt that repeats itself gives the random model's output an ngram match.
    prompts = [PROMPTS[0] + generated + PROMPTS[0] + generated[:3] for generated in greedy(single, PROMPTS[:1])]
    prompts += PROMPTS
    llm = patchbay.LLM(model__path=str(tiny_llama), spec_decode={"name": "ngram", "num_speculative_tokens": 3}, **PP2)
    try:
        assert greedy(llm, prompts) == greedy(single, prompts)
        assert llm.engine.stats.num_overlapped_batches > 0
        # The last stage verified the drafts; rank 0 counts them from its outputs.
        assert llm.engine.spec_stats.num_draft_tokens > 0
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_requests_preempted_over_two_stages_come_back_with_the_same_tokens(tiny_llama: Path) -> None:
    # 15 usable blocks of 4 tokens hold the longest request (52 tokens) but not the three at once (95 tokens):
    # requests are preempted, some while their batch is on the second stage.
    llm = patchbay.LLM(model__path=str(tiny_llama), **{**PP2, "cache__num_blocks": 16, "model__max_model_len": 56})
    try:
        assert greedy(llm) == transformers_greedy(tiny_llama, PROMPTS, NUM_TOKENS)
        assert llm.engine.stats.num_preemptions > 0
        assert llm.engine.stats.num_overlapped_batches > 0
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_seeded_sampling_over_two_stages_equals_one_process(pp2: patchbay.LLM, single: patchbay.LLM) -> None:
    # Batches differ with overlap (a request in flight sits a batch out): seeded requests draw the same anyway.
    params = [
        SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_p=0.9, seed=7),
        SamplingParams(max_tokens=NUM_TOKENS, temperature=0.8, top_k=20, seed=8, n=2),
        SamplingParams(max_tokens=NUM_TOKENS, temperature=1.2, min_p=0.05, seed=9, logprobs=2),
    ]
    prompts = PROMPTS

    def sample(llm: patchbay.LLM) -> list[list[list[int]]]:
        return [[c.token_ids for c in output.completions] for output in llm.generate(prompts, params)]

    assert sample(pp2) == sample(single)


@pytest.mark.slow
def test_structured_output_over_two_stages_equals_one_process_with_llguidance(tiny_llama: Path) -> None:
    """The last stage masks with the rows rank 0 filled, its matchers fed the tokens that came back with the batches."""
    pytest.importorskip("llguidance")
    grammar = {"structured_output__name": "llguidance", "structured_output__options": {"any_whitespace": False}}
    # A pool that holds every request: a preempted seeded request restarts its generator when it resumes (in one
    # process too), so its tokens depend on when it was preempted, and overlapped batches, which admit requests
    # while others are in flight, preempt at other times than one process.
    roomy = {"cache__num_blocks": 400}
    llm = patchbay.LLM(model__path=str(tiny_llama), **{**PP2, **roomy}, **grammar)
    try:
        reference = patchbay.LLM(model__path=str(tiny_llama), **{**ONE_STAGE, **roomy}, **grammar)
        prompts, params = structured_batch()
        outputs = llm.generate(prompts, params)
        assert completions(outputs) == completions(reference.generate(prompts, params))
        check_structured_batch(outputs, params)
        assert llm.engine.stats.num_preemptions == 0 and llm.engine.stats.num_overlapped_batches > 0
    finally:
        llm.engine.close()


# -- tensor-parallel stages, and failures -----------------------------------------------------------


@pytest.mark.slow
def test_two_stages_of_two_tensor_parallel_ranks_equal_transformers_until_a_killed_rank_ends_the_run(
    tiny_llama: Path,
) -> None:
    """TP 2 x PP 2: ranks 0-1 run layers 0-1 with 4 heads and half the vocabulary each, ranks 2-3 layers 2-3; then
    rank 2 is killed."""
    running = child_ranks()
    llm = patchbay.LLM(model__path=str(tiny_llama), **{**PP2, "runtime__tensor_parallel_size": 2})
    try:
        assert sorted(llm.engine.model.layer_specs) == [0, 1]
        assert {(s.num_heads, s.num_kv_heads) for s in llm.engine.model.layer_specs.values()} == {(4, 1)}
        assert llm.engine.model.model.get_input_embeddings().weight.shape[0] == 49152 // 2  # the stage's shard
        assert greedy(llm) == transformers_greedy(tiny_llama, PROMPTS, NUM_TOKENS)
        assert llm.engine.stats.max_batches_in_flight == 2

        ranks = llm.engine.ranks
        assert ranks is not None
        workers = [rank.process.pid for rank in ranks.ranks]
        llm.engine.add_request(PROMPTS[1], SamplingParams(max_tokens=NUM_TOKENS))
        llm.engine.step()
        os.kill(workers[1], signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(
            RankDiedError,
            match=rf"^pipeline stage 1, tensor-parallel rank 0 \(rank 2, pid "
            rf"{workers[1]}\) was killed by SIGKILL",
        ):
            llm.engine.step()
        print(f"the killed rank ended the run in {time.monotonic() - started:.3f} s")
        with pytest.raises(EngineDeadError, match="stage 1"):
            llm.engine.step()
        assert wait_until_gone(workers) == []
    finally:
        llm.engine.close()
    assert child_ranks() <= running
