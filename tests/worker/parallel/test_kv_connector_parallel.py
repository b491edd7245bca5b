"""KV connectors over several ranks: each rank saves and loads its own shard, and rank 0 joins the ranks' reports.

The engine cases run the tiny GQA Llama (8 heads, 2 KV heads) over two
tensor-parallel ranks with chunked prefill, prefix caching, preemption and
ngram drafts, and compare the greedy tokens with one process without a
connector.  A warm pass forgets the local prefix cache first, so its
prompts come from the connector's store; each rank process is slow to
start, so one engine per connector serves every pass.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_tensor_parallel import NUM_TOKENS

import patchbay
from patchbay import SamplingParams
from patchbay.interfaces import KVConnectorConfig, KVShard
from patchbay.worker.parallel.kv_transfers import TransferReport, TransferReportJoiner

# -- the contract's pieces, without processes ----------------------------------------------------


def test_a_shard_names_its_layout_and_position_and_its_siblings() -> None:
    assert KVShard().is_whole and KVShard().name == ""
    shard = KVShard.of_rank(3, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert (shard.tensor_parallel_rank, shard.pipeline_stage, shard.rank, shard.name) == (1, 1, 3, "tp1of2-pp1of2")
    assert [sibling.rank for sibling in shard.siblings()] == [0, 1, 2, 3]
    assert KVShard(pipeline_stage=1, pipeline_parallel_size=2).name == "pp1of2"
    with pytest.raises(ValueError, match="tensor-parallel rank 2 of 2"):
        KVShard(tensor_parallel_rank=2, tensor_parallel_size=2)


def test_each_shard_has_its_own_model_id_and_a_whole_model_keeps_the_engines() -> None:
    whole = KVConnectorConfig(model_id="tiny-abc-float32-2x1x4x1x16")
    rank1 = whole.with_shard(KVShard(tensor_parallel_rank=1, tensor_parallel_size=2))
    assert whole.model_id == "tiny-abc-float32-2x1x4x1x16"
    assert rank1.model_id == "tiny-abc-float32-2x1x4x1x16@tp1of2"
    assert rank1.with_shard(KVShard(tensor_parallel_size=2)).model_id == "tiny-abc-float32-2x1x4x1x16@tp0of2"
    assert rank1.with_shard(KVShard()) == whole
    # A config built for a shard names it even when its model_id was given without.
    assert KVConnectorConfig(model_id="m", shard=KVShard(pipeline_parallel_size=2)).model_id == "m@pp0of2"


def test_a_transfer_is_finished_once_every_rank_reported_it_and_failed_blocks_are_the_union() -> None:
    joiner = TransferReportJoiner(2)
    step1 = joiner.join([TransferReport({"a", "b"}, {"x"}, {3}), TransferReport({"b"}, set(), {3, 8})])
    assert (step1.finished_sending, step1.finished_recving, step1.invalid_block_ids) == ({"b"}, set(), {3, 8})
    # Rank 1 reports "a" and "x" a step later; a rank repeating itself does not stand in for the other.
    step2 = joiner.join([TransferReport({"c"}, set(), set()), TransferReport({"a"}, {"x"}, set())])
    assert (step2.finished_sending, step2.finished_recving, step2.invalid_block_ids) == ({"a"}, {"x"}, set())
    step3 = joiner.join([TransferReport({"c"}, set(), set()), TransferReport()])
    assert step3.finished_sending == set()
    with pytest.raises(ValueError, match="each of 2 ranks, got 1"):
        joiner.join([TransferReport()])
    report = TransferReport({"r-1"}, {"r-2"}, {4, 1})
    assert TransferReport.decode(report.encode()) == report


# -- the engine over two ranks -------------------------------------------------------------------

FIRST = list(range(10, 17))
LONG = [5, 6, 7, 8] * 10  # longer than the step budget: prefilled in chunks
Workload = tuple[list[list[int]], list[list[int]]]
"""Prompts, and the greedy tokens of each."""
CRAMPED = dict(
    scheduler__max_num_batched_tokens=16,
    cache__block_size=4,
    cache__num_blocks=17,
    model__max_model_len=64,
    spec_decode={"name": "ngram", "num_speculative_tokens": 3},
)
"""16 usable blocks of 4 tokens: each request fits, the three at once do not (the scheduler preempts)."""


def greedy(llm: patchbay.LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0.0)
    return [output.token_ids for output in llm.generate(prompts, params)]


def warm_pass(llm: patchbay.LLM, prompts: list[list[int]]) -> list[list[int]]:
    """The prompts again, with the local prefix cache forgotten: what they reuse comes from the store."""
    llm.engine.kv_cache_manager.reset_prefix_cache()
    return greedy(llm, prompts)


def loaded_tokens(llm: patchbay.LLM) -> int:
    return llm.engine.scheduler.kv_connector_stats.num_loaded_tokens


def recomputed_blocks(llm: patchbay.LLM) -> int:
    return llm.engine.scheduler.kv_connector_stats.num_recomputed_blocks


@pytest.fixture(scope="module")
def workload(tiny_llama: Path) -> Workload:
    """The prompts, and their greedy tokens in one process without a connector.

    The third prompt shares the first one's leading blocks and repeats the
    first one's output, which gives the ngram drafter matches to propose.
    """
    single = patchbay.LLM(model__path=str(tiny_llama), **CRAMPED)
    (generated,) = greedy(single, [FIRST])
    prompts = [FIRST, LONG, FIRST + generated + FIRST + generated[:3]]
    return prompts, greedy(single, prompts)


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-store")


@pytest.fixture(scope="module")
def tp2_shared(tiny_llama: Path, store_dir: Path) -> Iterator[patchbay.LLM]:
    """Two tensor-parallel ranks over one shared_storage directory."""
    llm = patchbay.LLM(
        model__path=str(tiny_llama),
        runtime__tensor_parallel_size=2,
        kv_connector={"name": "shared_storage", "options": {"path": str(store_dir)}, "stall_timeout": 30},
        **CRAMPED,
    )
    yield llm
    llm.engine.close()


def rank_entries(llm: patchbay.LLM, store_dir: Path, rank: int) -> list[Path]:
    """The entry files rank ``rank`` of two wrote (its namespace names its shard)."""
    from patchbay.plugins.kv_connectors._blocks import store_namespace

    connector = llm.engine.kv_connector
    assert connector is not None
    config = connector.config.with_shard(KVShard(tensor_parallel_rank=rank, tensor_parallel_size=2))
    namespace = store_namespace(config.model_id, config.block_size, config.dtype, connector.key_bytes)
    return sorted((store_dir / namespace).rglob("*.kvb"))


@pytest.mark.slow
def test_two_ranks_with_shared_storage_cold_then_warm_equal_one_process(
    tp2_shared: patchbay.LLM, store_dir: Path, workload: Workload
) -> None:
    prompts, expected = workload
    engine = tp2_shared.engine
    assert greedy(tp2_shared, prompts) == expected
    assert engine.stats.num_preemptions > 0 and tp2_shared.spec_stats.num_draft_tokens > 0
    rank0, rank1 = rank_entries(tp2_shared, store_dir, 0), rank_entries(tp2_shared, store_dir, 1)
    assert rank0 and [path.name for path in rank0] == [path.name for path in rank1], (
        "each rank saves every block under its own namespace"
    )
    assert rank0[0].read_bytes() != rank1[0].read_bytes()

    before = loaded_tokens(tp2_shared)
    assert warm_pass(tp2_shared, prompts) == expected
    assert loaded_tokens(tp2_shared) > before, "the warm pass loaded nothing from the store"
    assert recomputed_blocks(tp2_shared) == 0, "a rank failed to load a block the store holds for both"


@pytest.mark.slow
def test_a_block_one_rank_cannot_load_is_recomputed_by_both(
    tp2_shared: patchbay.LLM, store_dir: Path, workload: Workload
) -> None:
    prompts, expected = workload
    assert greedy(tp2_shared, prompts) == expected  # the store holds every block for both ranks (also when run alone)
    # Rank 1's entries go bad behind the engine's back: present, so rank 0 plans their loads; rank 1 cannot load them.
    for path in rank_entries(tp2_shared, store_dir, 1):
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))
    before_loaded, before_recomputed = loaded_tokens(tp2_shared), recomputed_blocks(tp2_shared)
    assert warm_pass(tp2_shared, prompts) == expected
    assert loaded_tokens(tp2_shared) > before_loaded
    assert recomputed_blocks(tp2_shared) > before_recomputed, "rank 1's load errors did not reach the scheduler"
    # Rank 1 dropped the entries it could not load; the next pass saves them again, then loads them all.
    greedy(tp2_shared, prompts)
    before_loaded, before_recomputed = loaded_tokens(tp2_shared), recomputed_blocks(tp2_shared)
    assert warm_pass(tp2_shared, prompts) == expected
    assert loaded_tokens(tp2_shared) > before_loaded and recomputed_blocks(tp2_shared) == before_recomputed


REDIS_URL = os.environ.get("PATCHBAY_TEST_REDIS_URL")


@pytest.mark.slow
@pytest.mark.parametrize(
    "section",
    [
        {"name": "host_offload", "options": {"namespace": "tp2-test"}},  # a store in each rank's process
        pytest.param(
            {"name": "redis", "options": {"url": REDIS_URL, "key_prefix": f"patchbay-tp2:{uuid.uuid4().hex}:"}},
            marks=pytest.mark.skipif(not REDIS_URL, reason="PATCHBAY_TEST_REDIS_URL is not set"),
            id="redis",
        ),
    ],
    ids=lambda section: section["name"],
)
def test_two_ranks_with_other_connectors_each_reload_their_own_heads(
    tiny_llama: Path, workload: Workload, section: dict
) -> None:
    prompts, expected = workload
    llm = patchbay.LLM(model__path=str(tiny_llama), runtime__tensor_parallel_size=2, kv_connector=section, **CRAMPED)
    try:
        assert greedy(llm, prompts) == expected
        before = loaded_tokens(llm)
        assert warm_pass(llm, prompts) == expected
        assert loaded_tokens(llm) > before and recomputed_blocks(llm) == 0
    finally:
        llm.engine.close()


@pytest.mark.slow
def test_two_pipeline_stages_with_shared_storage_equal_one_process(
    tiny_llama: Path, tmp_path: Path, workload: Workload
) -> None:
    from patchbay.plugins.kv_connectors._blocks import read_header

    prompts, expected = workload
    llm = patchbay.LLM(
        model__path=str(tiny_llama),
        runtime__pipeline_parallel_size=2,
        kv_connector={"name": "shared_storage", "options": {"path": str(tmp_path)}},
        **CRAMPED,
    )
    try:
        assert greedy(llm, prompts) == expected
        before = loaded_tokens(llm)
        assert warm_pass(llm, prompts) == expected
        assert loaded_tokens(llm) > before and recomputed_blocks(llm) == 0
        # Each stage saved its own two layers, under a namespace of its own.
        namespaces = [path for path in tmp_path.iterdir() if path.is_dir()]
        assert len(namespaces) == 2
        headers = [read_header(next(namespace.rglob("*.kvb")).read_bytes())[0] for namespace in namespaces]
        assert sorted(header["model_id"].rsplit("@", 1)[1] for header in headers) == ["pp0of2", "pp1of2"]
        assert [header["layout"]["num_layers"] for header in headers] == [2, 2]
    finally:
        llm.engine.close()
