"""KV connectors wired into the engine, on a tiny model, with a connector that lives in this file.

``DictConnector`` keeps blocks in a dict of this process (one store per
``namespace`` option), can load asynchronously (the load completes a given
number of ``get_finished`` calls later), and can fail loads on purpose: a
failed block gets garbage written into it and is reported by
``get_block_ids_with_load_errors``.  It records what the engine called, so
the tests read as the connector contract seen from the outside.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from pydantic import BaseModel, ConfigDict

import patchbay
from patchbay import hookimpl
from patchbay.contract.registry import Registry
from patchbay.contract.settings import ConfigError
from patchbay.interfaces import (
    KVConnector,
    KVConnectorCapabilities,
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    RequestView,
)
from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.request import RequestStatus
from tiny_models import build_tiny_model

BLOCK_SIZE = 16
STORES: dict[str, dict[tuple[str, bytes], dict[str, tuple[torch.Tensor, torch.Tensor]]]] = {}
CONNECTORS: list[DictConnector] = []
"""Every connector created, newest last, so a test can look at what the engine did with it."""


class DictOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str
    async_load: bool = False
    load_delay: int = 1
    """With ``async_load``: the load completes at the ``load_delay``-th ``get_finished`` call after it starts."""
    fail_loads: int = 0
    """The first ``fail_loads`` blocks loaded fail: garbage is written into them and they are reported."""


class DictConnector(KVConnector):
    Options: ClassVar[type[BaseModel]] = DictOptions
    capabilities: ClassVar[KVConnectorCapabilities] = KVConnectorCapabilities(
        devices=("cpu", "cuda"), async_load=True, async_save=True
    )

    def __init__(self, options: Any = None, *, config: Any = None) -> None:
        super().__init__(options, config=config)
        self.calls: list[str] = []
        self.loaded_blocks = 0
        self.saved_blocks = 0
        self.layer_waits = 0
        self.layer_saves = 0
        self.finished_sending: list[str] = []
        CONNECTORS.append(self)

    @property
    def store(self) -> dict:
        return STORES.setdefault(self.options.namespace, {})

    def key(self, block_hash: bytes) -> tuple[str, bytes]:
        return (self.config.model_id, bytes(block_hash))

    def scheduler_side(self) -> DictScheduler:
        return DictScheduler(self)

    def worker_side(self) -> DictWorker:
        return DictWorker(self)


class DictScheduler(KVConnectorScheduler):
    def __init__(self, connector: DictConnector) -> None:
        self.connector = connector
        self.loads: list[tuple[str, tuple[str, bytes], int]] = []
        self.saves: list[tuple[str, tuple[str, bytes], int]] = []

    def _hit_tokens(self, request: RequestView) -> int:
        hits = 0
        for block_hash in request.block_hashes:
            if self.connector.key(block_hash) not in self.connector.store:
                break
            hits += 1
        return min(hits * BLOCK_SIZE, len(request.prompt_token_ids) - 1)

    def get_num_new_matched_tokens(self, request: RequestView, num_computed_tokens: int) -> tuple[int, bool]:
        self.connector.calls.append("get_num_new_matched_tokens")
        found = max(0, self._hit_tokens(request) - num_computed_tokens)
        return found, self.connector.options.async_load and found > 0

    def update_state_after_alloc(
        self, request: RequestView, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        self.connector.calls.append("update_state_after_alloc")
        if num_external_tokens <= 0:
            return
        end = self._hit_tokens(request)
        for index in range((end - num_external_tokens) // BLOCK_SIZE, -(-end // BLOCK_SIZE)):
            self.loads.append((request.request_id, self.connector.key(request.block_hashes[index]), block_ids[index]))

    def build_connector_meta(self, scheduled_request_ids: Sequence[str]) -> KVConnectorMetadata:
        metadata = KVConnectorMetadata({"load": self.loads, "save": self.saves})
        self.loads, self.saves = [], []
        return metadata

    def request_finished(self, request: RequestView, block_ids: Sequence[int]) -> bool:
        self.connector.calls.append("request_finished")
        if self.connector.config.role == "consumer":
            return False
        full = min(len(request.block_hashes), request.num_computed_tokens // BLOCK_SIZE, len(block_ids))
        saves = [
            (request.request_id, self.connector.key(request.block_hashes[i]), block_ids[i])
            for i in range(full)
            if self.connector.key(request.block_hashes[i]) not in self.connector.store
        ]
        self.saves.extend(saves)
        return bool(saves)


class DictWorker(KVConnectorWorker):
    def __init__(self, connector: DictConnector) -> None:
        self.connector = connector
        self.kv_caches: dict[str, torch.Tensor] = {}
        self.split: Any = None
        self.saves: list[tuple[str, tuple[str, bytes], int]] = []
        self.pending_loads: list[list[Any]] = []
        """[countdown, request id, store key, block id] of async loads."""
        self.sent: set[str] = set()
        self.errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], split: Any) -> None:
        self.kv_caches, self.split = dict(kv_caches), split

    def _copy_in(self, store_key: tuple[str, bytes], block_id: int) -> None:
        options = self.connector.options
        for layer_name, kv_cache in self.kv_caches.items():
            key_cache, value_cache = self.split(kv_cache)
            if self.connector.loaded_blocks < options.fail_loads:
                key_cache[block_id].normal_(0, 100)
                value_cache[block_id].normal_(0, 100)
            else:
                keys, values = self.connector.store[store_key][layer_name]
                key_cache[block_id].copy_(keys)
                value_cache[block_id].copy_(values)
        if self.connector.loaded_blocks < options.fail_loads:
            self.errors.add(block_id)
        self.connector.loaded_blocks += 1

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        payload = metadata.payload or {}
        for request_id, store_key, block_id in payload.get("load", []):
            if self.connector.options.async_load:
                self.pending_loads.append([self.connector.options.load_delay, request_id, store_key, block_id])
            else:
                self._copy_in(store_key, block_id)
        self.saves.extend(payload.get("save", []))

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.connector.layer_waits += 1

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attention_metadata: Any) -> None:
        self.connector.layer_saves += 1

    def wait_for_save(self) -> None:
        store = self.connector.store
        for request_id, store_key, block_id in self.saves:
            entry = {}
            for layer_name, kv_cache in self.kv_caches.items():
                key_cache, value_cache = self.split(kv_cache)
                entry[layer_name] = (key_cache[block_id].clone(), value_cache[block_id].clone())
            store[store_key] = entry
            self.connector.saved_blocks += 1
            self.sent.add(request_id)
        self.saves = []

    def get_finished(self, finished_request_ids: set[str]) -> tuple[set[str], set[str]]:
        received: set[str] = set()
        waiting: set[str] = set()
        still_pending = []
        for pending in self.pending_loads:
            pending[0] -= 1
            if pending[0] <= 0:
                self._copy_in(pending[2], pending[3])
                received.add(pending[1])
            else:
                still_pending.append(pending)
                waiting.add(pending[1])
        self.pending_loads = still_pending
        sent, self.sent = self.sent, set()
        self.connector.finished_sending.extend(sent)
        return sent, received - waiting

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self.errors = self.errors, set()
        return errors


class DictConnectorPlugin:
    @hookimpl
    def register_kv_connectors(self, register):
        register("dict_test", DictConnector, description="in-process dict store for the integration tests")


@pytest.fixture(scope="module")
def registry() -> Registry:
    registry = Registry.from_entry_points()
    registry.add_plugin(DictConnectorPlugin(), name="dict-connector-test")
    return registry


def _llm(tiny_llama: Path, registry: Registry, connector: dict | None = None, **overrides: Any) -> patchbay.LLM:
    settings: dict[str, Any] = dict(
        model__path=str(tiny_llama),
        attention__name="torch_sdpa",
        runtime__threads=2,
        cache__block_size=BLOCK_SIZE,
        **overrides,
    )
    if connector is not None:
        settings["kv_connector"] = connector
    return patchbay.LLM(registry=registry, **settings)


def _prompts(count: int, seed: int, prefix_len: int = 70) -> list[list[int]]:
    """Prompts sharing a long prefix, each with its own tail."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1000, 40000) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1000, 40000) for _ in range(rng.randint(3, 20))] for _ in range(count)]


GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_llama, registry):
    """Greedy tokens of the test prompts without a connector."""
    llm = _llm(tiny_llama, registry)
    return {seed: [o.token_ids for o in llm.generate(_prompts(4, seed), GREEDY)] for seed in (1, 2, 3, 4, 5)}


def test_a_second_engine_reuses_the_first_ones_prompt_kv_and_generates_the_same_tokens(tiny_llama, registry, reference):
    prompts = _prompts(4, seed=1)
    first = _llm(tiny_llama, registry, {"name": "dict_test", "options": {"namespace": "reuse"}})
    assert [o.token_ids for o in first.generate(prompts, GREEDY)] == reference[1]
    assert STORES["reuse"], "the first engine saved its prompts' blocks"

    second = _llm(tiny_llama, registry, {"name": "dict_test", "options": {"namespace": "reuse"}})
    outputs = second.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference[1]
    stats = second.engine.scheduler.kv_connector_stats
    # The first prompt loads its shared 64-token prefix; the others find it in the local prefix cache then.
    assert stats.num_loaded_tokens >= 64
    assert stats.num_loaded_tokens + second.engine.kv_cache_manager.prefix_cache_hits >= 4 * 64
    assert stats.num_recomputed_blocks == 0
    connector = second.engine.kv_connector
    assert connector.config.model_id == first.engine.kv_connector.config.model_id != ""
    assert connector.config.block_size == BLOCK_SIZE and connector.config.role == "both"
    # Per layer, each forward pass waits for the layer's load and offers its KV for saving.
    assert connector.layer_waits == connector.layer_saves > 0
    assert connector.layer_waits % 4 == 0  # the tiny model has 4 layers


def test_blocks_that_fail_to_load_are_recomputed_and_change_no_token(tiny_llama, registry, reference):
    prompts = _prompts(4, seed=2)
    _llm(tiny_llama, registry, {"name": "dict_test", "options": {"namespace": "faults"}}).generate(prompts, GREEDY)

    faulty = _llm(tiny_llama, registry, {"name": "dict_test", "options": {"namespace": "faults", "fail_loads": 3}})
    outputs = faulty.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == reference[2]
    stats = faulty.engine.scheduler.kv_connector_stats
    assert stats.num_recomputed_blocks == 3
    assert stats.num_recomputed_requests >= 1
    assert faulty.engine.kv_connector.loaded_blocks > 3  # the other loads were used


def test_an_async_load_parks_its_request_while_others_keep_running(tiny_llama, registry, reference):
    prompts = _prompts(4, seed=3)
    _llm(tiny_llama, registry, {"name": "dict_test", "options": {"namespace": "async"}}).generate(prompts[:1], GREEDY)

    llm = _llm(
        tiny_llama,
        registry,
        {"name": "dict_test", "options": {"namespace": "async", "async_load": True, "load_delay": 3}},
    )
    engine = llm.engine
    # An unrelated request first, so something runs while the load is pending.
    other = engine.add_request(_prompts(1, seed=99)[0], SamplingParams(max_tokens=12, ignore_eos=True))
    engine.step()
    loading = engine.add_request(prompts[0], GREEDY)
    engine.step()
    request = engine.scheduler.requests[loading]
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    progress = []
    while request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
        engine.step()
        progress.append(engine.scheduler.requests[other].num_output_tokens)
    assert len(progress) >= 2 and progress[0] < progress[-1], "the other request generated while the load waited"
    finished = {}
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step()})
    assert finished[loading].token_ids == reference[3][0]
    assert engine.scheduler.kv_connector_stats.num_loaded_tokens >= 64


def test_an_async_load_with_errors_is_recomputed(tiny_llama, registry, reference):
    prompts = _prompts(4, seed=4)
    _llm(tiny_llama, registry, {"name": "dict_test", "options": {"namespace": "async-faults"}}).generate(
        prompts, GREEDY
    )
    llm = _llm(
        tiny_llama,
        registry,
        {"name": "dict_test", "options": {"namespace": "async-faults", "async_load": True, "fail_loads": 2}},
    )
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == reference[4]
    assert llm.engine.scheduler.kv_connector_stats.num_recomputed_blocks == 2


def test_a_finished_requests_blocks_are_held_until_its_save_is_done(tiny_llama, registry):
    llm = _llm(tiny_llama, registry, {"name": "dict_test", "options": {"namespace": "deferred"}})
    engine = llm.engine
    connector = engine.kv_connector
    free_before = engine.kv_cache_manager.num_free_blocks
    request_id = engine.add_request(_prompts(1, seed=6)[0], SamplingParams(max_tokens=2, ignore_eos=True))
    finished = []
    while not finished:
        finished = engine.step()
    assert "request_finished" in connector.calls and request_id not in connector.finished_sending
    assert engine.kv_cache_manager.num_free_blocks < free_before, "held while the save is in flight"
    assert engine.has_unfinished_requests(), "the engine keeps stepping until the save is done"
    engine.step()
    assert request_id in connector.finished_sending and connector.saved_blocks >= 4
    assert engine.kv_cache_manager.num_free_blocks == free_before
    assert not engine.has_unfinished_requests()


def test_a_producer_never_loads_and_a_consumer_never_saves(tiny_llama, registry, reference):
    prompts = _prompts(4, seed=5)
    namespace = {"namespace": "roles"}
    producer = _llm(tiny_llama, registry, {"name": "dict_test", "role": "producer", "options": namespace})
    assert [o.token_ids for o in producer.generate(prompts, GREEDY)] == reference[5]
    assert [o.token_ids for o in producer.generate(prompts, GREEDY)] == reference[5]  # the store is full now
    assert "get_num_new_matched_tokens" not in producer.engine.kv_connector.calls
    assert producer.engine.scheduler.kv_connector_stats.num_loaded_tokens == 0
    assert producer.engine.kv_connector.config.role == "producer"
    saved = dict(STORES["roles"])
    assert saved

    consumer = _llm(tiny_llama, registry, {"name": "dict_test", "role": "consumer", "options": namespace})
    other_prompts = _prompts(2, seed=77)
    consumer.generate(prompts + other_prompts, GREEDY)
    assert consumer.engine.kv_connector.config.role == "consumer"
    assert consumer.engine.scheduler.kv_connector_stats.num_loaded_tokens > 0
    assert consumer.engine.kv_connector.saved_blocks == 0 and STORES["roles"].keys() == saved.keys()


def test_without_a_connector_nothing_calls_one(tiny_llama, registry):
    llm = _llm(tiny_llama, registry)
    assert llm.engine.kv_connector is None and llm.engine.runner.kv_connector is None
    assert llm.engine.scheduler.kv_connector is None


def test_the_run_summary_reports_the_connector(tiny_llama, registry):
    from patchbay.entrypoints.run_command import summarise

    llm = _llm(tiny_llama, registry, {"name": "dict_test", "options": {"namespace": "summary"}})
    prompts = _prompts(2, seed=8)
    llm.generate(prompts, GREEDY)
    outputs = llm.generate(prompts, GREEDY)
    summary = summarise(outputs, 1.0, llm.engine)
    loaded = llm.engine.scheduler.kv_connector_stats.num_loaded_tokens
    assert loaded > 0
    assert f"kv connector:        {loaded} tokens loaded, 0 blocks recomputed after load errors" in summary


@pytest.mark.parametrize(
    "options",
    [{}, {"fail_loads": 2}, {"async_load": True}, {"async_load": True, "fail_loads": 2}],
    ids=["sync", "sync-faults", "async", "async-faults"],
)
def test_loads_survive_preemption_and_chunked_prefill(tiny_llama, registry, options):
    limits = dict(model__max_model_len=128, cache__num_blocks=14, scheduler__max_num_batched_tokens=32)
    prompts = _prompts(5, seed=12)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    expected = [o.token_ids for o in _llm(tiny_llama, registry, **limits).generate(prompts, params)]
    namespace = f"tight-{'-'.join(f'{k}{v}' for k, v in options.items())}"
    _llm(tiny_llama, registry, {"name": "dict_test", "options": {"namespace": namespace}}).generate(prompts, params)

    llm = _llm(tiny_llama, registry, {"name": "dict_test", "options": {"namespace": namespace, **options}}, **limits)
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.scheduler.kv_connector_stats.num_loaded_tokens > 0
    assert llm.engine.kv_cache_manager.num_free_blocks == 13, "every block came back"


def test_a_model_with_several_kv_cache_groups_refuses_a_connector(tmp_path, registry):
    model_dir = build_tiny_model(tmp_path, "qwen2-mixed-window")
    with pytest.raises(ConfigError, match="one KV-cache group; this model has 2"):
        patchbay.LLM(
            model__path=str(model_dir),
            attention__name="reference",
            registry=registry,
            kv_connector={"name": "dict_test", "options": {"namespace": "groups"}},
        )


def test_a_stalled_connector_in_a_tight_pool_is_named_with_the_blocks_it_holds(tiny_llama, registry, monkeypatch):
    """Finding (issue 30): the run ended with "cannot schedule request … 2 free blocks", not naming the connector
    that held the other blocks."""
    connector = {"name": "dict_test", "options": {"namespace": "stalled"}, "stall_timeout": 0.2}
    llm = _llm(tiny_llama, registry, connector, cache__num_blocks=6, model__max_model_len=64)
    engine = llm.engine
    # The connector saves the first request's blocks when it finishes, and never reports the save done.
    monkeypatch.setattr(engine.runner.kv_connector, "get_finished", lambda finished_request_ids: (set(), set()))
    engine.add_request(_prompts(1, seed=21, prefix_len=40)[0][:40], SamplingParams(max_tokens=8), request_id="held")
    engine.add_request(list(range(1000, 1060)), SamplingParams(max_tokens=2), request_id="starved")
    with pytest.raises(Exception) as raised:  # noqa: PT011 - the engine wraps it; the text is what matters
        for _ in range(10_000):
            engine.step()
    message = str(raised.value)
    assert "KV connector 'dict_test' holds requests 'held'" in message, message
    assert "they hold 3 blocks of the pool ('held': 3)" in message, message
    assert "request 'starved' (60 tokens) cannot be scheduled with the 2 free blocks of 16 tokens left" in message


@pytest.mark.parametrize("options", [{"fail_loads": 2}, {"async_load": True, "fail_loads": 2}], ids=["sync", "async"])
def test_a_seeded_request_recomputed_after_a_failed_load_keeps_its_stream(tiny_llama, registry, options):
    """Finding (issue 30): a request rolled back to recompute blocks that failed to load drew its next numbers
    from where its discarded sample left its generator, so its seeded tokens changed."""
    prompts = _prompts(3, seed=31)
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=40 + i, ignore_eos=True) for i in range(3)]
    expected = [o.token_ids for o in _llm(tiny_llama, registry).generate(prompts, params)]
    namespace = f"seeded-recompute-{'-'.join(f'{k}{v}' for k, v in options.items())}"
    _llm(tiny_llama, registry, {"name": "dict_test", "options": {"namespace": namespace}}).generate(prompts, params)

    llm = _llm(tiny_llama, registry, {"name": "dict_test", "options": {"namespace": namespace, **options}})
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.scheduler.kv_connector_stats.num_recomputed_requests > 0


def test_int8_caches_save_and_load_their_rows_and_share_no_entry_with_float_caches(tiny_llama, registry):
    prompts = _prompts(4, seed=6)
    alone = [o.token_ids for o in _llm(tiny_llama, registry, cache__dtype="int8").generate(prompts, GREEDY)]
    connector = {"name": "dict_test", "options": {"namespace": "int8"}}
    first = _llm(tiny_llama, registry, connector, cache__dtype="int8")
    assert [o.token_ids for o in first.generate(prompts, GREEDY)] == alone

    second = _llm(tiny_llama, registry, connector, cache__dtype="int8")
    assert [o.token_ids for o in second.generate(prompts, GREEDY)] == alone
    assert second.engine.scheduler.kv_connector_stats.num_loaded_tokens >= 64
    # A float32 engine keys its entries by another model id: it never loads int8 rows into its cache.
    floats = _llm(tiny_llama, registry, connector)
    assert floats.engine.kv_connector.config.model_id != second.engine.kv_connector.config.model_id
    assert "-int8-" in second.engine.kv_connector.config.model_id
    floats.generate(prompts, GREEDY)
    assert floats.engine.scheduler.kv_connector_stats.num_loaded_tokens == 0
