"""Tensor parallelism on gloo: ranks as processes, sharded models, equal tokens, failures that end the run.

Multi-process cases are slow (each rank is a Python process that loads
torch and the model); an engine is reused across the cases that can share it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tiny_models import build_tiny_model, transformers_greedy

import patchbay
from patchbay import SamplingParams
from patchbay.contract.settings import ConfigError, load_settings
from patchbay.engine import EngineDeadError
from patchbay.engine.ranks import RankDiedError

PROMPTS = [
    list(range(10, 17)),
    [5, 6, 7, 8] * 10,                          # longer than the step budget: prefilled in chunks
    list(range(10, 17)) + [40, 41, 42, 43, 44],  # shares its first block with the first prompt
]
NUM_TOKENS = 12
TP2 = dict(runtime__tensor_parallel_size=2, scheduler__max_num_batched_tokens=16, cache__block_size=4,
           cache__num_blocks=64, model__max_model_len=128)


def rank_processes() -> list[int]:
    """Pids of live (non-zombie) ``patchbay.worker.rank_worker`` processes on this machine."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"patchbay.worker.rank_worker" in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def wait_until_gone(pids: list[int], limit: float = 30.0) -> list[int]:
    """The pids among ``pids`` still running after waiting up to ``limit`` seconds for them to end."""
    deadline = time.monotonic() + limit
    while True:
        left = [pid for pid in pids if pid in rank_processes()]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def greedy(llm: patchbay.LLM, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0.0)
    return [output.token_ids for output in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def single(tiny_llama: Path) -> patchbay.LLM:
    """The tiny GQA Llama (8 heads, 2 KV heads) in this process alone."""
    return patchbay.LLM(model__path=str(tiny_llama), **{**TP2, "runtime__tensor_parallel_size": 1})


@pytest.fixture(scope="module")
def tp2(tiny_llama: Path) -> Iterator[patchbay.LLM]:
    """The same model over two ranks (4 heads and 1 KV head each)."""
    llm = patchbay.LLM(model__path=str(tiny_llama), **TP2)
    yield llm
    llm.engine.close()


# -- configuration --------------------------------------------------------------------------------


def test_tensor_parallel_size_must_be_positive() -> None:
    with pytest.raises(ConfigError) as caught:
        load_settings(overrides=["runtime.tensor_parallel_size=0"])
    assert caught.value.problems[0].path == "runtime.tensor_parallel_size"


def test_ranks_share_the_cores_unless_runtime_threads_says_otherwise() -> None:
    from patchbay.worker.distributed import rank_threads

    cores = len(os.sched_getaffinity(0))
    assert rank_threads(load_settings()) is None  # one rank: torch's own default
    assert rank_threads(load_settings(overrides=["runtime.tensor_parallel_size=2"])) == max(1, cores // 2)
    assert rank_threads(load_settings(overrides=["runtime.tensor_parallel_size=4096"])) == 1
    assert rank_threads(load_settings(overrides=["runtime.tensor_parallel_size=2", "runtime.threads=3"])) == 3


@pytest.mark.parametrize(("heads", "kv_heads", "ranks", "says"), [
    (8, 2, 3, "8 attention heads, not divisible by 3 ranks"),
    (12, 3, 2, "3 KV heads (and 12 attention heads)"),
    (12, 4, 3, "4 KV heads (and 12 attention heads)"),
])
def test_heads_that_do_not_split_name_the_setting_and_the_counts(heads: int, kv_heads: int, ranks: int,
                                                                  says: str) -> None:
    from transformers import LlamaConfig

    from patchbay.worker.tensor_parallel import shard_layout

    config = LlamaConfig(hidden_size=heads * 16, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=96, architectures=["LlamaForCausalLM"])
    with pytest.raises(ConfigError) as caught:
        shard_layout(config, ranks)
    problem = caught.value.problems[0]
    assert problem.path == "runtime.tensor_parallel_size"
    assert says in problem.message


def test_kv_heads_fewer_than_ranks_are_replicated_to_the_ranks_that_read_them() -> None:
    from transformers import LlamaConfig

    from patchbay.worker.tensor_parallel import shard_layout

    layout = shard_layout(LlamaConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=2,
                                      intermediate_size=96), 4)
    assert (layout.heads_per_rank, layout.kv_heads_per_rank) == (2, 1)
    # Query heads 0-3 read KV head 0, heads 4-7 KV head 1.
    assert [layout.kv_head_range(rank) for rank in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_unsupported_architectures_are_refused_before_any_rank_starts(tiny_llama: Path) -> None:
    from transformers import Qwen3Config

    from patchbay.worker.tensor_parallel import shard_layout

    running = set(rank_processes())
    with pytest.raises(ConfigError, match=r"qwen3\) cannot be sharded"):
        shard_layout(Qwen3Config(num_attention_heads=4, num_key_value_heads=2), 2)
    with pytest.raises(ConfigError) as caught:
        patchbay.LLM(model__path=str(tiny_llama), runtime__tensor_parallel_size=3)
    assert "8 attention heads, not divisible by 3 ranks" in str(caught.value)
    with pytest.raises(ConfigError, match="runtime.distributed_backend"):
        patchbay.LLM(model__path=str(tiny_llama), runtime__tensor_parallel_size=2, runtime__device="cpu",
                     runtime__distributed_backend="nccl")
    assert set(rank_processes()) <= running


@pytest.mark.slow
def test_a_build_that_fails_after_the_ranks_started_leaves_none_behind(tiny_llama: Path) -> None:
    running = set(rank_processes())
    with pytest.raises(ConfigError, match=r"the KV cache \(10000000 blocks of 4\.0 KiB, on each of 2 ranks\)"):
        patchbay.LLM(model__path=str(tiny_llama), runtime__tensor_parallel_size=2, cache__num_blocks=10_000_000)
    assert set(rank_processes()) <= running


# -- the same tokens over two ranks ---------------------------------------------------------------


@pytest.mark.slow
def test_each_rank_holds_its_heads_and_their_kv_cache_only(tp2: patchbay.LLM, single: patchbay.LLM) -> None:
    spec = tp2.engine.model.layer_specs[0]
    assert (spec.num_heads, spec.num_kv_heads) == (4, 1)
    assert [g.spec.num_kv_heads for g in tp2.engine.groups] == [1]
    assert [g.spec.num_kv_heads for g in single.engine.groups] == [2]


@pytest.mark.slow
def test_greedy_tokens_over_two_ranks_equal_one_process_and_transformers(tp2: patchbay.LLM, single: patchbay.LLM,
                                                                         tiny_llama: Path) -> None:
    expected = transformers_greedy(tiny_llama, PROMPTS, NUM_TOKENS)
    assert len(PROMPTS[1]) > TP2["scheduler__max_num_batched_tokens"]  # a chunked prefill
    assert greedy(single) == expected
    assert greedy(tp2) == expected
    # Again, now from the prefix cache: each rank reads its own heads' cached blocks.
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0.0)
    again = tp2.generate(PROMPTS, params)
    assert [output.token_ids for output in again] == expected
    assert all(output.metrics.num_cached_tokens > 0 for output in again)


@pytest.mark.slow
def test_preempted_requests_over_two_ranks_come_back_with_the_same_tokens(tiny_llama: Path) -> None:
    # 15 usable blocks of 4 tokens hold the longest request (52 tokens) but not the three at once (95 tokens): the
    # scheduler preempts, and every rank drops and later rebuilds the preempted request's state from the same
    # scheduler output.
    cramped = {**TP2, "cache__num_blocks": 16, "model__max_model_len": 56}
    llm = patchbay.LLM(model__path=str(tiny_llama), **cramped)
    try:
        assert greedy(llm) == transformers_greedy(tiny_llama, PROMPTS, NUM_TOKENS)
        assert llm.engine.stats.num_preemptions > 0
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_runtime_master_addr_and_port_place_the_store_of_the_ranks_started_here(tiny_llama: Path,
                                                                               single: patchbay.LLM) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    llm = patchbay.LLM(model__path=str(tiny_llama), runtime__master_addr="127.0.0.1", runtime__master_port=port,
                       **TP2)
    try:
        assert llm.engine.ranks is not None
        assert (llm.engine.ranks.setup.store_host, llm.engine.ranks.setup.store_port) == ("127.0.0.1", port)
        assert greedy(llm, PROMPTS[:1]) == greedy(single, PROMPTS[:1])
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_seeded_sampling_over_two_ranks_equals_one_process(tp2: patchbay.LLM, single: patchbay.LLM) -> None:
    params = [SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_p=0.9, seed=7),
              SamplingParams(max_tokens=NUM_TOKENS, temperature=0.8, top_k=20, seed=8, n=2)]
    prompts = PROMPTS[:2]

    def sample(llm: patchbay.LLM) -> list[list[list[int]]]:
        return [[c.token_ids for c in output.completions] for output in llm.generate(prompts, params)]

    assert sample(tp2) == sample(single)


@pytest.mark.slow
def test_step_timings_split_the_all_reduces_out_of_the_forward_pass(tp2: patchbay.LLM) -> None:
    tp2.engine.reset_step_timings()
    greedy(tp2, PROMPTS[:1])
    timings = tp2.engine.step_timings()
    assert list(timings)[list(timings).index("forward") + 1] == "all_reduce"
    assert timings["all_reduce"] > 0 and timings["forward"] > 0
    assert tp2.engine.ranks is not None and timings["all_reduce"] == tp2.engine.ranks.group.all_reduce_seconds


@pytest.mark.slow
def test_structured_output_requests_are_refused_over_two_ranks(tp2: patchbay.LLM) -> None:
    from patchbay.interfaces.structured_output import StructuredOutputParams

    params = SamplingParams(max_tokens=4, structured_output=StructuredOutputParams(choice=["yes", "no"]))
    with pytest.raises(ValueError, match="runtime.tensor_parallel_size 2"):
        tp2.generate([PROMPTS[0]], params)


@pytest.mark.slow
@pytest.mark.parametrize("architecture", [
    "mistral-window",      # 4 heads, 1 KV head (replicated on both ranks), a 20-token sliding window
    "qwen2-mixed-window",  # 4 heads, 2 KV heads; q/k/v biases sharded with their rows; two KV-cache groups
])
def test_other_architectures_over_two_ranks_equal_transformers(tmp_path_factory: pytest.TempPathFactory,
                                                                architecture: str) -> None:
    model_dir = build_tiny_model(tmp_path_factory.mktemp(architecture), architecture)
    llm = patchbay.LLM(model__path=str(model_dir), **TP2)
    try:
        assert {(spec.num_heads, spec.num_kv_heads) for spec in llm.engine.model.layer_specs.values()} == {(2, 1)}
        assert greedy(llm) == transformers_greedy(model_dir, PROMPTS, NUM_TOKENS)
    finally:
        llm.engine.close()


# -- failures -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_speculative_decoding_over_two_ranks_then_a_killed_rank_ends_the_run(tiny_llama: Path,
                                                                              single: patchbay.LLM) -> None:
    speculative = {"method": "ngram", "num_speculative_tokens": 3}
    llm = patchbay.LLM(model__path=str(tiny_llama), speculative=speculative, server__api_keys="secret", **TP2)
    try:
        ranks = llm.engine.ranks
        assert ranks is not None
        assert ranks.setup.settings.server.api_keys == [], "the ranks need no server settings, least of all keys"
        reference = patchbay.LLM(model__path=str(tiny_llama), speculative=speculative,
                                 **{**TP2, "runtime__tensor_parallel_size": 1})
        # A prompt that repeats itself gives the random model's output an ngram match.
        prompts = [PROMPTS[0] + generated + PROMPTS[0] + generated[:3] for generated in greedy(single, PROMPTS[:1])]
        prompts += PROMPTS
        assert greedy(llm, prompts) == greedy(reference, prompts) == greedy(single, prompts)
        assert llm.spec_stats.num_draft_tokens > 0, "the prompts were meant to give ngram matches"

        worker = ranks.ranks[0].process.pid
        llm.engine.add_request(PROMPTS[1], SamplingParams(max_tokens=NUM_TOKENS))
        llm.engine.step()
        os.kill(worker, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(RankDiedError, match=rf"^tensor-parallel rank 1 \(pid {worker}\) was killed by SIGKILL"):
            llm.engine.step()
        print(f"the killed rank ended the run in {time.monotonic() - started:.3f} s")
        with pytest.raises(EngineDeadError, match="rank 1"):
            llm.engine.step()
        assert worker not in rank_processes()
    finally:
        llm.engine.close()


RANK0_SCRIPT = textwrap.dedent("""
    import sys, time
    import patchbay
    llm = patchbay.LLM(model__path=sys.argv[1], runtime__tensor_parallel_size=2, model__max_model_len=64)
    llm.generate([[1, 2, 3]], patchbay.SamplingParams(max_tokens=2))
    print(" ".join(str(rank.process.pid) for rank in llm.engine.ranks.ranks), flush=True)
    time.sleep(600)
""")


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM])
def test_ranks_exit_when_rank_0_dies(tiny_llama: Path, how: signal.Signals) -> None:
    rank0 = subprocess.Popen([sys.executable, "-c", RANK0_SCRIPT, str(tiny_llama)], stdout=subprocess.PIPE,
                             text=True, env={**os.environ, "PATCHBAY_MODEL__DTYPE": "float32"})
    try:
        assert rank0.stdout is not None
        workers = [int(pid) for pid in rank0.stdout.readline().split()]
        assert len(workers) == 1 and workers[0] in rank_processes()
        rank0.send_signal(how)
        rank0.wait(60)
        assert wait_until_gone(workers) == []
    finally:
        rank0.kill()
        rank0.wait()


@pytest.mark.slow
def test_the_bundled_model_over_three_ranks_writes_what_one_process_writes() -> None:
    """SmolLM2-135M: 9 heads and 3 KV heads, one KV head per rank."""
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0.0)
    sizes = dict(model__max_model_len=128, cache__num_blocks=32)
    single_output = patchbay.LLM(**sizes).generate(prompts, params)
    llm = patchbay.LLM(runtime__tensor_parallel_size=3, **sizes)
    try:
        assert (llm.engine.model.layer_specs[0].num_heads, llm.engine.model.layer_specs[0].num_kv_heads) == (3, 1)
        assert [o.token_ids for o in llm.generate(prompts, params)] == [o.token_ids for o in single_output]
    finally:
        llm.engine.close()
