"""Tensor parallelism on gloo: ranks as processes, sharded models, equal tokens, failures that end the run.

Multi-process cases are slow (each rank is a Python process that loads
torch and the model); an engine is reused across the cases that can share it.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import jsonschema
import pytest
import torch
from tiny_models import build_tiny_model, transformers_greedy

import patchbay
from patchbay import SamplingParams
from patchbay.contract.settings import ConfigError, load_settings
from patchbay.engine import EngineDeadError
from patchbay.engine.outputs import RequestOutput
from patchbay.engine.ranks import RankDiedError
from patchbay.testing.structured_output import bundled_tokenizer

if TYPE_CHECKING:
    from patchbay.worker.model.hf_model import HFCausalLM

PROMPTS = [
    list(range(10, 17)),
    [5, 6, 7, 8] * 10,  # longer than the step budget: prefilled in chunks
    list(range(10, 17)) + [40, 41, 42, 43, 44],  # shares its first block with the first prompt
]
NUM_TOKENS = 12
TP2 = dict(
    runtime__tensor_parallel_size=2,
    scheduler__max_num_batched_tokens=16,
    cache__block_size=4,
    cache__num_blocks=64,
    model__max_model_len=128,
    # Compact JSON: a random model given any whitespace may never close its object.
    structured_output__options={"any_whitespace": False},
)


def rank_processes() -> list[int]:
    """Pids of live (non-zombie) ``patchbay.worker.parallel.rank_worker`` processes this test session started: they
    inherit its ``PYTEST_PATCHBAY_SESSION`` (conftest.py), orphans included, and another session's do not."""
    marker = f"PYTEST_PATCHBAY_SESSION={os.environ['PYTEST_PATCHBAY_SESSION']}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"patchbay.worker.parallel.rank_worker" in cmdline and state != "Z" and marker in environment:
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


def completions(outputs: list[RequestOutput]) -> list[list[list[int]]]:
    """Every completion's tokens, by request."""
    return [[completion.token_ids for completion in output.completions] for output in outputs]


def structured_batch() -> tuple[list[list[int]], list[SamplingParams]]:
    """Choice, regex and JSON-schema constraints, greedy and seeded, among unconstrained requests, and one
    constraint that cannot compile.  The regex's text is in the prompts too, so that ngram drafts find matches."""
    digits = bundled_tokenizer().encode("123-456-789-ab 123-456-", add_special_tokens=False)
    prompts = [PROMPTS[0], PROMPTS[1], digits * 2, PROMPTS[2]]
    constraints = [{"choice": ["yes", "no", "maybe"]}, {"regex": REGEX}, {"json_schema": ORDER}]
    batch: list[tuple[list[int], SamplingParams]] = []
    for index, constraint in enumerate(constraints):
        for prompt in prompts[index : index + 2]:  # the chunked prompt and the drafting one get constraints
            batch.append((prompt, SamplingParams(max_tokens=64, structured_output=constraint)))
            batch.append(
                (
                    prompt,
                    SamplingParams(max_tokens=64, temperature=1.0, seed=10 + index, n=2, structured_output=constraint),
                )
            )
    batch += [
        (prompt, SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0.0))
        for prompt in (PROMPTS[0], digits)
    ]
    batch.append((PROMPTS[2], SamplingParams(max_tokens=8, structured_output={"regex": "(("})))
    return [prompt for prompt, _ in batch], [param for _, param in batch]


REGEX = r"([0-9]{3}-){2}[a-z]{2}"
ORDER = {
    "type": "object",
    "properties": {
        "item": {"enum": ["tea", "coffee", "juice"]},
        "iced": {"type": "boolean"},
        "size": {"enum": [1, 2, 3]},
    },
    "required": ["item", "iced", "size"],
    "additionalProperties": False,
}


def check_structured_batch(outputs: list[RequestOutput], params: list[SamplingParams]) -> None:
    """Every constrained completion ended where its constraint may end and satisfies it; the bad one failed alone."""
    *outputs, failed = outputs
    checked = 0
    for output, param in zip(outputs, params, strict=False):
        constraint = param.structured_output
        if constraint is None:
            assert output.finish_reason == "length"
            continue
        for completion in output.completions:
            text = completion.text
            assert completion.finish_reason == "stop", (text, constraint)
            if constraint.choice is not None:
                assert text in constraint.choice
            elif constraint.regex is not None:
                assert re.fullmatch(constraint.regex, text), (text, constraint.regex)
            else:
                jsonschema.validate(json.loads(text), constraint.json_schema)
            checked += 1
    assert checked == 18
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert "cannot compile structured_output.regex" in failed.stop_reason


@pytest.fixture(scope="module")
def single(tiny_llama: Path) -> patchbay.LLM:
    """The tiny GQA Llama (8 heads, 2 KV heads) in this process alone."""
    return patchbay.LLM(model__path=str(tiny_llama), **{**TP2, "runtime__tensor_parallel_size": 1})


@pytest.fixture(scope="module")
def odd_tied(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama with a 1,001-token vocabulary (no rank count divides it) tied to its LM head."""
    return build_tiny_model(tmp_path_factory.mktemp("odd-tied"), "llama-odd-vocab-tied")


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
    from patchbay.worker.parallel.distributed import rank_threads

    cores = len(os.sched_getaffinity(0))
    assert rank_threads(load_settings()) is None  # one rank: torch's own default
    assert rank_threads(load_settings(overrides=["runtime.tensor_parallel_size=2"])) == max(1, cores // 2)
    assert rank_threads(load_settings(overrides=["runtime.tensor_parallel_size=4096"])) == 1
    assert rank_threads(load_settings(overrides=["runtime.tensor_parallel_size=2", "runtime.threads=3"])) == 3


@pytest.mark.parametrize(
    ("heads", "kv_heads", "ranks", "says"),
    [
        (8, 2, 3, "8 attention heads, not divisible by 3 ranks"),
        (12, 3, 2, "3 KV heads (and 12 attention heads)"),
        (12, 4, 3, "4 KV heads (and 12 attention heads)"),
    ],
)
def test_heads_that_do_not_split_name_the_setting_and_the_counts(
    heads: int, kv_heads: int, ranks: int, says: str
) -> None:
    from transformers import LlamaConfig

    from patchbay.worker.parallel.tensor_parallel import shard_layout

    config = LlamaConfig(
        hidden_size=heads * 16,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=96,
        architectures=["LlamaForCausalLM"],
    )
    with pytest.raises(ConfigError) as caught:
        shard_layout(config, ranks)
    problem = caught.value.problems[0]
    assert problem.path == "runtime.tensor_parallel_size"
    assert says in problem.message


def test_kv_heads_fewer_than_ranks_are_replicated_to_the_ranks_that_read_them() -> None:
    from transformers import LlamaConfig

    from patchbay.worker.parallel.tensor_parallel import shard_layout

    layout = shard_layout(
        LlamaConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96), 4
    )
    assert (layout.heads_per_rank, layout.kv_heads_per_rank) == (2, 1)
    # Query heads 0-3 read KV head 0, heads 4-7 KV head 1.
    assert [layout.kv_head_range(rank) for rank in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]


def test_unsupported_architectures_are_refused_before_any_rank_starts(tiny_llama: Path) -> None:
    from patchbay.testing.tiny_models import tiny_checkpoint

    olmo2 = tiny_checkpoint("Olmo2ForCausalLM")  # its architecture plugin does not declare it shards OLMo 2
    running = set(rank_processes())
    with pytest.raises(ConfigError, match=r"Olmo2ForCausalLM cannot be sharded over 2 tensor-parallel ranks"):
        patchbay.LLM(model__path=str(olmo2), runtime__tensor_parallel_size=2)
    with pytest.raises(ConfigError) as caught:
        patchbay.LLM(model__path=str(tiny_llama), runtime__tensor_parallel_size=3)
    assert "8 attention heads, not divisible by 3 ranks" in str(caught.value)
    with pytest.raises(ConfigError, match="runtime.distributed_backend"):
        patchbay.LLM(
            model__path=str(tiny_llama),
            runtime__tensor_parallel_size=2,
            runtime__device="cpu",
            runtime__distributed_backend="nccl",
        )
    assert set(rank_processes()) <= running


def test_a_norm_over_all_heads_is_refused_naming_the_layer() -> None:
    from patchbay.testing.tiny_models import tiny_checkpoint
    from patchbay.worker.parallel.tensor_parallel import shard_layout, shard_model

    model = load_cpu(tiny_checkpoint("Olmo2ForCausalLM"))
    layout = shard_layout(model.model.config, 2)
    with pytest.raises(ConfigError, match=r"decoder layer 0 cannot be sharded: its q_norm normalizes 64 features"):
        shard_model(model, layout, 0, lambda tensor: None, lambda tensor: tensor)


@pytest.mark.slow
def test_a_build_that_fails_after_the_ranks_started_leaves_none_behind(tiny_llama: Path) -> None:
    running = set(rank_processes())
    with pytest.raises(ConfigError, match=r"the KV cache \(10000000 blocks of 4\.0 KiB, on each of 2 ranks\)"):
        patchbay.LLM(model__path=str(tiny_llama), runtime__tensor_parallel_size=2, cache__num_blocks=10_000_000)
    assert set(rank_processes()) <= running


# -- the vocabulary, sharded in this process ------------------------------------------------------


def test_a_vocabulary_that_does_not_divide_is_padded_to_equal_shards_of_whole_16_rows() -> None:
    from patchbay.worker.parallel.tensor_parallel import VocabShard

    shards = [VocabShard(1001, 3, rank) for rank in range(3)]
    assert {shard.rows_per_rank for shard in shards} == {336}  # 334 rounded up to 16s
    assert [(shard.start, shard.stop) for shard in shards] == [(0, 336), (336, 672), (672, 1001)]
    assert VocabShard(49152, 3, 2).rows_per_rank == 16384  # SmolLM2 over three ranks: no padding
    # More ranks than 16-row shards: the last holds padding only.
    assert [(s.start, s.stop) for s in (VocabShard(20, 2, rank) for rank in range(2))] == [(0, 16), (16, 20)]


class RecordedCollectives:
    """Stand-ins for one rank's collectives when the ranks are built one after another in this process: the
    embedding's all-reduce leaves the rank's partial sum, the all-gather records the rank's logits slice."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.gathered: list[torch.Tensor] = []

    def all_reduce(self, tensor: torch.Tensor) -> None:
        pass

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        self.gathered.append(tensor.clone())
        return torch.cat([tensor] * self.world_size, dim=-1)


def load_cpu(model_dir: Path) -> HFCausalLM:
    from patchbay.worker.model.hf_model import HFCausalLM

    return HFCausalLM.load(model_dir, dtype="float32", device=torch.device("cpu"))


@pytest.mark.parametrize(("model_fixture", "world_size"), [("tiny_llama", 2), ("odd_tied", 2), ("odd_tied", 3)])
def test_each_rank_keeps_its_share_of_the_vocabulary_and_the_shares_add_up_to_the_whole(
    request: pytest.FixtureRequest, model_fixture: str, world_size: int
) -> None:
    from patchbay.worker.parallel.tensor_parallel import shard_vocab

    model_dir: Path = request.getfixturevalue(model_fixture)
    whole = load_cpu(model_dir)
    vocab_size, hidden_size = whole.shape.vocab_size, whole.shape.hidden_size
    tied = whole.model.get_output_embeddings().weight is whole.model.get_input_embeddings().weight
    whole_parameters = sum(parameter.numel() for parameter in whole.model.parameters())
    ids = torch.tensor([0, 5, vocab_size // 2, vocab_size // 2 + 1, vocab_size - 1])
    hidden = torch.randn(3, hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected_embeddings = whole.model.get_input_embeddings()(ids)
        expected_logits = whole.logits(hidden)

    embeddings = torch.zeros_like(expected_embeddings)
    collectives = RecordedCollectives(world_size)
    for rank in range(world_size):
        model = load_cpu(model_dir)
        shard = shard_vocab(model, world_size, rank, collectives.all_reduce, collectives.all_gather)
        embedding, lm_head = model.model.get_input_embeddings(), model.model.get_output_embeddings()
        # Memory: 1/T of the rows (and under 16 rows of padding), once for a tied head; the whole rows are gone.
        assert embedding.weight.shape == lm_head.weight.shape == (shard.rows_per_rank, hidden_size)
        assert shard.rows_per_rank - vocab_size / world_size < 16
        assert (lm_head.weight is embedding.weight) == tied
        dropped_rows = (vocab_size - shard.rows_per_rank) * (1 if tied else 2)
        assert (
            sum(parameter.numel() for parameter in model.model.parameters())
            == whole_parameters - dropped_rows * hidden_size
        )
        with torch.inference_mode():
            embeddings += embedding(ids)
            assert model.logits(hidden).shape == (3, vocab_size)  # the padding is cut off
    assert torch.equal(embeddings, expected_embeddings)  # one rank's row, zeros from the others
    gathered = torch.cat(collectives.gathered, dim=-1)
    assert gathered.shape == (3, world_size * shard.rows_per_rank)
    torch.testing.assert_close(gathered[:, :vocab_size], expected_logits, rtol=1e-5, atol=1e-5)
    assert torch.all(gathered[:, vocab_size:] == 0)  # padding rows are zeros, never sampled


@pytest.mark.parametrize("path", ["int8", "int4", "onednn"])
def test_the_lm_head_s_cpu_paths_run_on_its_shard(odd_tied: Path, path: str) -> None:
    """Rank 1 of 2 holds ids 512-1000 and 23 rows of padding: 512 rows, which int4's packing takes (1001 it
    would not)."""
    from patchbay.worker.cpu.onednn import PackedLinear, packing_supported, use_packed_linears
    from patchbay.worker.cpu.quantization import IntegerLinear, quantize_linears
    from patchbay.worker.parallel.tensor_parallel import shard_vocab

    if path == "onednn" and not packing_supported(torch.float32):
        pytest.skip("this torch build or CPU cannot pack float32 weights with oneDNN")
    whole, model = load_cpu(odd_tied), load_cpu(odd_tied)
    collectives = RecordedCollectives(2)
    shard = shard_vocab(model, 2, 1, collectives.all_reduce, collectives.all_gather)
    for each in (whole, model):
        if path == "onednn":
            use_packed_linears(each.model)
        else:
            quantize_linears(each.model, path)
    lm_head_forward = vars(model.model.get_output_embeddings())["forward"]
    assert isinstance(lm_head_forward, PackedLinear if path == "onednn" else IntegerLinear)
    hidden = torch.randn(2, 64, generator=torch.Generator().manual_seed(0))  # few rows: the integer product runs
    with torch.inference_mode():
        model.logits(hidden)
        expected = whole.logits(hidden)[:, shard.start : shard.stop]
    (local,) = collectives.gathered
    assert torch.all(local[:, shard.stop - shard.start :] == 0)
    if path == "int4":  # the whole head (1001 rows) stays float: compare with it loosely
        assert torch.linalg.vector_norm(local[:, :489] - expected) < 0.1 * torch.linalg.vector_norm(expected)
    else:
        torch.testing.assert_close(local[:, :489], expected, rtol=1e-4, atol=1e-4)


def test_an_lm_head_of_another_width_than_the_embedding_names_the_setting_and_both_sizes(odd_tied: Path) -> None:
    from torch import nn

    from patchbay.worker.parallel.tensor_parallel import shard_vocab

    model = load_cpu(odd_tied)
    model.model.set_output_embeddings(nn.Linear(64, 1000, bias=False))
    collectives = RecordedCollectives(2)
    with pytest.raises(ConfigError) as caught:
        shard_vocab(model, 2, 0, collectives.all_reduce, collectives.all_gather)
    assert caught.value.problems[0].path == "runtime.tensor_parallel_size"
    assert "its LM head has 1000 outputs and its embedding 1001 rows" in caught.value.problems[0].message


def test_drafters_that_read_the_whole_lm_head_refuse_a_sharded_one(odd_tied: Path) -> None:
    from patchbay.plugins.spec_decode.heads import target_parts
    from patchbay.worker.parallel.tensor_parallel import shard_vocab

    model = load_cpu(odd_tied)
    target_parts(model.model)
    collectives = RecordedCollectives(2)
    shard_vocab(model, 2, 0, collectives.all_reduce, collectives.all_gather)
    with pytest.raises(
        ValueError,
        match=r"512 of its 1001 vocabulary rows on each of 2 ranks "
        r"\(runtime.tensor_parallel_size\)",
    ):
        target_parts(model.model)


# -- the same tokens over two ranks ---------------------------------------------------------------


@pytest.mark.slow
def test_each_rank_holds_its_heads_and_their_kv_cache_only(tp2: patchbay.LLM, single: patchbay.LLM) -> None:
    spec = tp2.engine.model.layer_specs[0]
    assert (spec.num_heads, spec.num_kv_heads) == (4, 1)
    assert [g.spec.num_kv_heads for g in tp2.engine.groups] == [1]
    assert [g.spec.num_kv_heads for g in single.engine.groups] == [2]
    # ... and half the vocabulary's rows of the embedding and of the (untied) LM head.
    assert tp2.engine.model.model.get_input_embeddings().weight.shape[0] == 49152 // 2
    assert tp2.engine.model.model.get_output_embeddings().out_features == 49152 // 2


@pytest.mark.slow
def test_greedy_tokens_over_two_ranks_equal_one_process_and_transformers(
    tp2: patchbay.LLM, single: patchbay.LLM, tiny_llama: Path
) -> None:
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
def test_runtime_master_addr_and_port_place_the_store_of_the_ranks_started_here(
    tiny_llama: Path, single: patchbay.LLM
) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    llm = patchbay.LLM(model__path=str(tiny_llama), runtime__master_addr="127.0.0.1", runtime__master_port=port, **TP2)
    try:
        assert llm.engine.ranks is not None
        assert (llm.engine.ranks.setup.store_host, llm.engine.ranks.setup.store_port) == ("127.0.0.1", port)
        assert greedy(llm, PROMPTS[:1]) == greedy(single, PROMPTS[:1])
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_seeded_sampling_over_two_ranks_equals_one_process(tp2: patchbay.LLM, single: patchbay.LLM) -> None:
    params = [
        SamplingParams(max_tokens=NUM_TOKENS, temperature=1.0, top_p=0.9, seed=7),
        SamplingParams(max_tokens=NUM_TOKENS, temperature=0.8, top_k=20, seed=8, n=2),
    ]
    prompts = PROMPTS[:2]

    def sample(llm: patchbay.LLM) -> list[list[list[int]]]:
        return [[c.token_ids for c in output.completions] for output in llm.generate(prompts, params)]

    assert sample(tp2) == sample(single)


@pytest.mark.slow
def test_prompt_and_sample_logprobs_over_two_ranks_equal_one_process(tp2: patchbay.LLM, single: patchbay.LLM) -> None:
    """Prompt logprobs score every prompt position through the LM head: each chunk's logits are gathered too."""
    params = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0, logprobs=3, prompt_logprobs=3)

    def scored(llm: patchbay.LLM) -> list[tuple[list[int], list[float]]]:
        (output,) = llm.generate([PROMPTS[1]], params)
        entries = [*output.prompt_logprobs[1:], *output.completions[0].logprobs]
        return [(entry.token_ids, entry.logprobs) for entry in entries]

    sharded, whole = scored(tp2), scored(single)
    assert len(sharded) == len(PROMPTS[1]) - 1 + 3
    assert [ids for ids, _ in sharded] == [ids for ids, _ in whole]
    for (_, sharded_values), (_, whole_values) in zip(sharded, whole, strict=True):
        assert sharded_values == pytest.approx(whole_values, abs=1e-4)


@pytest.mark.slow
def test_step_timings_split_the_all_reduces_out_of_the_forward_pass(tp2: patchbay.LLM) -> None:
    tp2.engine.reset_step_timings()
    greedy(tp2, PROMPTS[:1])
    timings = tp2.engine.step_timings()
    assert list(timings)[list(timings).index("forward") + 1] == "all_reduce"
    assert timings["all_reduce"] > 0 and timings["forward"] > 0
    assert tp2.engine.ranks is not None and timings["all_reduce"] == tp2.engine.ranks.group.all_reduce_seconds


@pytest.mark.slow
def test_structured_output_over_two_ranks_equals_one_process_and_keeps_every_constraint(
    tp2: patchbay.LLM, single: patchbay.LLM
) -> None:
    """Rank 0's matchers fill the bitmasks; both ranks mask alike, so greedy and seeded samples equal one process's."""
    pytest.importorskip("xgrammar")
    prompts, params = structured_batch()
    outputs = tp2.generate(prompts, params)
    assert completions(outputs) == completions(single.generate(prompts, params))
    check_structured_batch(outputs, params)
    # The unconstrained neighbours come out as they do alone.
    free = [index for index, param in enumerate(params) if param.structured_output is None]
    assert [outputs[index].token_ids for index in free] == greedy(tp2, [prompts[index] for index in free])


@pytest.mark.slow
def test_preempted_constrained_requests_over_two_ranks_resume_with_the_same_tokens(
    tiny_llama: Path, single: patchbay.LLM
) -> None:
    """A preempted request comes back as new: rank 0 rebuilds its matcher from the tokens it had generated."""
    pytest.importorskip("xgrammar")
    # 15 usable blocks of 4 tokens: the chunked prompt's regex request (40 + 10 tokens) and the JSON one do not
    # fit together, so the scheduler preempts (as in the unconstrained case above).
    llm = patchbay.LLM(model__path=str(tiny_llama), **{**TP2, "cache__num_blocks": 16, "model__max_model_len": 56})
    try:
        params = [
            SamplingParams(max_tokens=48, structured_output={"json_schema": ORDER}),
            SamplingParams(max_tokens=16, structured_output={"regex": REGEX}),
            SamplingParams(max_tokens=8, structured_output={"choice": ["yes", "no", "maybe"]}),
        ]
        outputs = llm.generate(PROMPTS, params)
        assert llm.engine.stats.num_preemptions > 0
        assert completions(outputs) == completions(single.generate(PROMPTS, params))
        json_output, regex_output, choice_output = (output.text for output in outputs)
        jsonschema.validate(json.loads(json_output), ORDER)
        assert re.fullmatch(REGEX, regex_output) and choice_output in ("yes", "no", "maybe")
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_structured_output_with_speculative_decoding_over_two_ranks_equals_one_process(tiny_llama: Path) -> None:
    """Drafts the grammar refuses are masked out on every rank, and rank 0's matchers roll back what they tried."""
    pytest.importorskip("xgrammar")
    spec_decode = {"name": "ngram", "num_speculative_tokens": 3}
    llm = patchbay.LLM(model__path=str(tiny_llama), spec_decode=spec_decode, **TP2)
    try:
        reference = patchbay.LLM(
            model__path=str(tiny_llama), spec_decode=spec_decode, **{**TP2, "runtime__tensor_parallel_size": 1}
        )
        prompts, params = structured_batch()
        # Seeded drafts' samples depend on the step's token budget, so on when each grammar is ready: compile
        # them beforehand in both, and both schedule alike.
        for engine in (llm.engine, reference.engine):
            for param in params[:-1]:
                if param.structured_output is not None:
                    engine.grammars.submit(param.structured_output).result(timeout=60)
        outputs = llm.generate(prompts, params)
        assert completions(outputs) == completions(reference.generate(prompts, params))
        check_structured_batch(outputs, params)
        assert llm.spec_stats.num_draft_tokens > 0, "the prompts were meant to give ngram matches"
    finally:
        llm.engine.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    "architecture",
    [
        "mistral-window",  # 4 heads, 1 KV head (replicated on both ranks), a 20-token sliding window
        "qwen2-mixed-window",  # 4 heads, 2 KV heads; q/k/v biases sharded with their rows; two KV-cache groups
        "llama-odd-vocab-tied",  # 4 heads, 2 KV heads; 1,001 tokens in 512-row shards, one shared by the tied LM head
    ],
)
def test_other_architectures_over_two_ranks_equal_transformers(
    tmp_path_factory: pytest.TempPathFactory, architecture: str
) -> None:
    model_dir = build_tiny_model(tmp_path_factory.mktemp(architecture), architecture)
    llm = patchbay.LLM(model__path=str(model_dir), **TP2)
    try:
        assert {(spec.num_heads, spec.num_kv_heads) for spec in llm.engine.model.layer_specs.values()} == {(2, 1)}
        vocab_size = llm.engine.model.shape.vocab_size
        # Ids from both ranks' halves of the vocabulary, its last included (not 0: transformers_greedy pads with it).
        prompts = [*PROMPTS, [vocab_size - 1, 3, vocab_size // 2, vocab_size // 2 - 1, 7, vocab_size - 2]]
        assert greedy(llm, prompts) == transformers_greedy(model_dir, prompts, NUM_TOKENS)
    finally:
        llm.engine.close()


# -- failures -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_speculative_decoding_over_two_ranks_then_a_killed_rank_ends_the_run(
    tiny_llama: Path, single: patchbay.LLM
) -> None:
    spec_decode = {"name": "ngram", "num_speculative_tokens": 3}
    llm = patchbay.LLM(model__path=str(tiny_llama), spec_decode=spec_decode, server__api_keys="secret", **TP2)
    try:
        ranks = llm.engine.ranks
        assert ranks is not None
        assert ranks.setup.settings.server.api_keys == [], "the ranks need no server settings, least of all keys"
        reference = patchbay.LLM(
            model__path=str(tiny_llama), spec_decode=spec_decode, **{**TP2, "runtime__tensor_parallel_size": 1}
        )
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
    rank0 = subprocess.Popen(
        [sys.executable, "-c", RANK0_SCRIPT, str(tiny_llama)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PATCHBAY_MODEL__DTYPE": "float32"},
    )
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


@pytest.mark.slow
def test_a_drafter_reading_the_lm_head_keeps_the_vocabulary_whole_and_equals_one_process(tiny_llama: Path) -> None:
    """Medusa copies the target's LM head (DrafterCapabilities.reads_vocabulary_weights): the ranks keep the
    vocabulary whole for it, shard everything else, and its drafts give the tokens of one process."""
    spec_decode = {"name": "medusa", "num_speculative_tokens": 2}
    llm = patchbay.LLM(model__path=str(tiny_llama), spec_decode=spec_decode, **TP2)
    try:
        reference = patchbay.LLM(
            model__path=str(tiny_llama), spec_decode=spec_decode, **{**TP2, "runtime__tensor_parallel_size": 1}
        )
        model = llm.engine.model
        assert model.layer_specs[0].num_heads == 4  # heads sharded over the two ranks ...
        vocab_size = model.shape.vocab_size  # ... the vocabulary not
        assert model.model.get_input_embeddings().weight.shape[0] == vocab_size
        assert model.model.get_output_embeddings().weight.shape[0] == vocab_size
        prompts = [list(range(10, 40)), [7, 8, 9] * 6, [300]]
        params = SamplingParams(max_tokens=12, ignore_eos=True)
        assert completions(llm.generate(prompts, params)) == completions(reference.generate(prompts, params))
        assert llm.spec_stats.num_draft_tokens > 0
    finally:
        llm.engine.close()
