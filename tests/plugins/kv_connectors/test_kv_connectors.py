"""The built-in KV connectors: the conformance suite on each, plus what only they promise.

Redis tests need a server: ``.ci/run`` starts one on loopback and exports
``PATCHBAY_TEST_REDIS_URL``; without it they skip, saying so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from patchbay.contract.registry import default_registry
from patchbay.interfaces import KVConnectorConfig, KVConnectorMetadata
from patchbay.plugins.kv_connectors._base import StoreUnreachable
from patchbay.plugins.kv_connectors._blocks import (
    BlockDecodeError,
    BlockLayout,
    damage_entry,
    decode_block,
    encode_block,
    store_namespace,
)
from patchbay.plugins.kv_connectors.host_offload import HostOffloadConnector
from patchbay.plugins.kv_connectors.redis_connector import RedisConnector, redacted_url
from patchbay.plugins.kv_connectors.shared_storage import SharedStorageConnector
from patchbay.testing import KVConnectorSuite
from patchbay.testing.kv_connector import Side, SuiteRequest, split_kv_cache

REDIS_URL = os.environ.get("PATCHBAY_TEST_REDIS_URL")
needs_redis = pytest.mark.skipif(
    not REDIS_URL, reason="PATCHBAY_TEST_REDIS_URL is not set (.ci/run starts a redis-server)"
)


def damaged(raw: bytes, how: str, key: bytes = b"test-key-0123456789") -> bytes | None:
    return damage_entry(raw, how, key)


# -- the conformance suite on each connector --------------------------------------------------------


class TestHostOffloadConformance(KVConnectorSuite):
    plugin_name = "host_offload"

    @pytest.fixture
    def connector_options(self):
        return {"namespace": f"test-{uuid.uuid4().hex}", "max_bytes": "64MiB"}

    # corrupt_entry: the connector's own backdoor (HostOffloadConnector.corrupt_entry)


class TestSharedStorageConformance(KVConnectorSuite):
    plugin_name = "shared_storage"

    @pytest.fixture
    def connector_options(self, tmp_path):
        return {"path": str(tmp_path / "store")}

    def corrupt_entry(self, connector, block_hash, how):
        path = connector.open_store().path_of(connector.key(block_hash.hex()))
        replacement = damaged(path.read_bytes(), how, connector.key_bytes)
        if replacement is None:
            path.unlink()
        else:
            path.write_bytes(replacement)


@needs_redis
class TestRedisConformance(KVConnectorSuite):
    plugin_name = "redis"

    @pytest.fixture
    def connector_options(self):
        return {"url": REDIS_URL, "key_prefix": f"patchbay-test:{uuid.uuid4().hex}:", "ttl_s": 600}

    def corrupt_entry(self, connector, block_hash, how):
        store = connector.open_store()
        key = connector.key(block_hash.hex())
        replacement = damaged(store.client.get(store.redis_key(key)), how, connector.key_bytes)
        if replacement is None:
            store.client.delete(store.redis_key(key))
        else:
            store.client.set(store.redis_key(key), replacement)


# -- helpers ------------------------------------------------------------------------------------------


def make(connector_class, options, *, model_id="tests/tiny", role="both", block_size=4):
    config = KVConnectorConfig(role=role, block_size=block_size, model_id=model_id)
    return connector_class(connector_class.Options.model_validate(options), config=config)


def caches(random: bool, seed: int = 0, num_blocks: int = 16, block_size: int = 4):
    generator = torch.Generator().manual_seed(seed)
    shape = (2, num_blocks, block_size, 2, 8)
    return {
        f"layer{index}": torch.randn(shape, generator=generator) if random else torch.zeros(shape) for index in range(2)
    }


PROMPT = [(11 * index) % 97 for index in range(13)]  # 3 full blocks of 4 before the last token


# -- registration and format -------------------------------------------------------------------------


def test_all_three_are_registered_lazily():
    registry = default_registry()
    for name, cls in (
        ("host_offload", HostOffloadConnector),
        ("shared_storage", SharedStorageConnector),
        ("redis", RedisConnector),
    ):
        assert name in registry.names("kv_connector")
        assert registry.get("kv_connector", name).target == f"{cls.__module__}:{cls.__qualname__}"
        assert registry.resolve("kv_connector", name) is cls


def test_encoded_block_round_trips_and_rejects_every_kind_of_damage():
    layout = BlockLayout(num_layers=2, block_size=4, num_kv_heads=2, head_size=8, dtype="float32")
    payload = torch.randn(layout.payload_bytes // 4, generator=torch.Generator().manual_seed(0)).numpy().tobytes()
    key = b"test-key-0123456789"
    entry = encode_block("m", layout, b"\x01" * 32, payload, key=key)

    def decode(data, block_hash=b"\x01" * 32):
        return decode_block(data, model_id="m", layout=layout, block_hash=block_hash, key=key)

    assert bytes(decode(entry)) == payload
    expectations = {
        "truncated": "truncated",
        "corrupted": "authentication code mismatch",
        "other_model": "model",
        "other_layout": "layout",
        "forged": "forged",
        "not_an_object": "JSON list, expected an object",
        "deeply_nested": "RecursionError",
        "non_finite": "NaN or infinite",
    }
    for how, words in expectations.items():
        with pytest.raises(BlockDecodeError, match=words):
            decode(damaged(entry, how, key))
    with pytest.raises(BlockDecodeError, match="expected 0202"):
        decode(entry, b"\x02" * 32)
    with pytest.raises(BlockDecodeError, match="magic"):
        decode(b"garbage-garbage-garbage")
    with pytest.raises(BlockDecodeError, match="more than the"):
        decode(entry + bytes(5000))


def test_the_metadata_payload_survives_json():
    """The payload is plain data, so a future scheduler/worker process split can ship it as JSON."""
    namespace = f"json-{uuid.uuid4().hex}"
    producer = Side(make(HostOffloadConnector, {"namespace": namespace}), caches(random=True))
    producer.compute_and_finish(SuiteRequest("a", PROMPT, 4), [5, 2, 9, 7])
    consumer_connector = make(HostOffloadConnector, {"namespace": namespace})
    scheduler, worker = consumer_connector.scheduler_side(), consumer_connector.worker_side()
    target = caches(random=False)
    worker.register_kv_caches(target, split_kv_cache)
    request = SuiteRequest("b", PROMPT, 4)
    num_tokens, load_async = scheduler.get_num_new_matched_tokens(request, 0)
    assert (num_tokens, load_async) == (12, False)
    scheduler.update_state_after_alloc(request, [3, 8, 1, 11], num_tokens)
    metadata = scheduler.build_connector_meta(["b"])
    assert metadata.payload["load"] == [
        [3, request.block_hashes[0].hex()],
        [8, request.block_hashes[1].hex()],
        [1, request.block_hashes[2].hex()],
    ]
    worker.start_load_kv(KVConnectorMetadata(payload=json.loads(json.dumps(metadata.payload))))
    for name in target:
        assert torch.equal(target[name][:, 8], producer.caches[name][:, 2])
    assert consumer_connector.stats["loaded_blocks"] == 3


def test_blocks_are_saved_as_chunks_complete_not_only_at_the_end(tmp_path):
    side = Side(make(SharedStorageConnector, {"path": str(tmp_path)}), caches(random=True))
    request = SuiteRequest("chunked", PROMPT, 4)
    side.scheduler.update_state_after_alloc(request, [1, 2], 0)
    side.step(["chunked"])  # chunk 1 (6 tokens) being computed: nothing is complete yet
    request.num_computed_tokens = 6
    side.scheduler.update_state_after_alloc(request, [1, 2, 3, 4], 0)
    metadata = side.scheduler.build_connector_meta(["chunked"])
    assert [save[1] for save in metadata.payload["save"]] == [1]  # block 0 complete: saved while running
    side.worker.start_load_kv(metadata)
    side.worker.wait_for_save()
    side.worker.flush()
    assert side.connector.stats["saved_blocks"] == 1
    request.num_computed_tokens = 13
    assert side.scheduler.request_finished(request, [1, 2, 3, 4]) is True  # blocks 1, 2 still to save
    side.wait_sent("chunked", 10)
    assert side.connector.stats["saved_blocks"] == 3


def test_consumer_never_saves_and_producer_never_loads(tmp_path):
    consumer = Side(make(SharedStorageConnector, {"path": str(tmp_path)}, role="consumer"), caches(random=True))
    request = SuiteRequest("c", PROMPT, 4)
    consumer.compute_and_finish(request, [1, 2, 3, 4])
    assert consumer.connector.stats["saved_blocks"] == 0 and not any(tmp_path.rglob("*.kvb"))


# -- host_offload ------------------------------------------------------------------------------------


def test_host_offload_is_a_bounded_lru():
    namespace = f"lru-{uuid.uuid4().hex}"
    side = Side(make(HostOffloadConnector, {"namespace": namespace, "max_blocks": 2}), caches(random=True))
    side.compute_and_finish(SuiteRequest("a", PROMPT, 4), [5, 2, 9, 7])
    store = side.connector.open_store()
    assert len(store.entries) == 2  # 3 saved, the oldest evicted
    request = SuiteRequest("b", PROMPT, 4)
    assert side.scheduler.get_num_new_matched_tokens(request, 0)[0] == 0  # block 0 is gone: no prefix
    assert side.scheduler.get_num_new_matched_tokens(request, 4)[0] == 8  # blocks 1, 2 remain
    one_block = len(next(iter(store.entries.values())))
    bounded = make(HostOffloadConnector, {"namespace": f"bytes-{uuid.uuid4().hex}", "max_bytes": one_block})
    Side(bounded, caches(random=True)).compute_and_finish(SuiteRequest("c", PROMPT, 4), [5, 2, 9, 7])
    assert len(bounded.open_store().entries) == 1 and bounded.open_store().num_bytes <= one_block


def test_host_offload_lookup_does_not_refresh_the_lru():
    namespace = f"peek-{uuid.uuid4().hex}"
    side = Side(make(HostOffloadConnector, {"namespace": namespace}), caches(random=True))
    side.compute_and_finish(SuiteRequest("a", PROMPT, 4), [5, 2, 9, 7])
    order = list(side.connector.open_store().entries)
    side.scheduler.get_num_new_matched_tokens(SuiteRequest("b", PROMPT, 4), 0)
    assert list(side.connector.open_store().entries) == order


def test_another_model_identity_never_matches():
    namespace = f"ident-{uuid.uuid4().hex}"
    Side(make(HostOffloadConnector, {"namespace": namespace}), caches(random=True)).compute_and_finish(
        SuiteRequest("a", PROMPT, 4), [5, 2, 9, 7]
    )
    other = make(HostOffloadConnector, {"namespace": namespace}, model_id="another/model")
    assert other.scheduler_side().get_num_new_matched_tokens(SuiteRequest("b", PROMPT, 4), 0)[0] == 0


# -- shared_storage ----------------------------------------------------------------------------------


def test_shared_storage_files_are_laid_out_by_identity_and_hash_with_no_temporaries(tmp_path):
    side = Side(make(SharedStorageConnector, {"path": str(tmp_path)}), caches(random=True))
    request = SuiteRequest("a", PROMPT, 4)
    side.compute_and_finish(request, [5, 2, 9, 7])
    namespace = store_namespace("tests/tiny", 4, "float32", side.connector.key_bytes)
    expected = {tmp_path / namespace / h.hex()[:2] / f"{h.hex()}.kvb" for h in request.block_hashes}
    assert set(tmp_path.rglob("*.kvb")) == expected
    assert [path for path in tmp_path.rglob("*") if path.is_file() and path.suffix != ".kvb"] == []


SAVE_IN_A_SUBPROCESS = textwrap.dedent("""
    import sys, torch
    from patchbay.interfaces import KVConnectorConfig
    from patchbay.plugins.kv_connectors.shared_storage import SharedStorageConnector
    from patchbay.testing.kv_connector import Side, SuiteRequest

    path, prompt = sys.argv[1], [int(token) for token in sys.argv[2].split(",")]
    generator = torch.Generator().manual_seed(1234)
    caches = {f"layer{index}": torch.randn((2, 16, 4, 2, 8), generator=generator) for index in range(2)}
    config = KVConnectorConfig(role="producer", block_size=4, model_id="tests/tiny")
    connector = SharedStorageConnector(SharedStorageConnector.Options(path=path), config=config)
    Side(connector, caches).compute_and_finish(SuiteRequest("p", prompt, 4), [5, 2, 9, 7])
    print(connector.stats["saved_blocks"])
""")


def test_shared_storage_across_processes(tmp_path):
    """A producer process saves a prompt's blocks; this process (the consumer) loads them bit for bit."""
    result = subprocess.run(
        [sys.executable, "-c", SAVE_IN_A_SUBPROCESS, str(tmp_path), ",".join(map(str, PROMPT))],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "3"
    consumer = Side(make(SharedStorageConnector, {"path": str(tmp_path)}, role="consumer"), caches(random=False))
    request = SuiteRequest("c", PROMPT, 4)
    num_tokens, _ = consumer.scheduler.get_num_new_matched_tokens(request, 0)
    assert num_tokens == 12
    consumer.scheduler.update_state_after_alloc(request, [3, 8, 1, 11], num_tokens)
    consumer.step(["c"])
    assert consumer.worker.get_block_ids_with_load_errors() == set()
    produced = caches(random=True, seed=1234)
    for name in produced:
        for source, target in ((5, 3), (2, 8), (9, 1)):
            assert torch.equal(produced[name][:, source], consumer.caches[name][:, target])
        assert not consumer.caches[name][:, 11].any()


def test_unreadable_directory_entry_is_a_load_error(tmp_path):
    side = Side(make(SharedStorageConnector, {"path": str(tmp_path)}), caches(random=True))
    request = SuiteRequest("a", PROMPT, 4)
    side.compute_and_finish(request, [5, 2, 9, 7])
    consumer = Side(make(SharedStorageConnector, {"path": str(tmp_path)}), caches(random=False))
    consumer.scheduler.update_state_after_alloc(SuiteRequest("b", PROMPT, 4), [3, 8, 1, 11], 12)
    path = consumer.connector.open_store().path_of(consumer.connector.key(request.block_hashes[0].hex()))
    path.unlink()
    path.mkdir()  # reading it fails with an OSError other than "missing"
    consumer.step([])
    assert consumer.worker.get_block_ids_with_load_errors() == {3}
    assert consumer.connector.stats["load_errors"] == 1 and consumer.connector.stats["loaded_blocks"] == 2


# -- redis -------------------------------------------------------------------------------------------

CLOSED_PORT_URL = "redis://:secret@127.0.0.1:1/0"


def test_unreachable_redis_falls_back_to_recompute_and_counts_it(caplog):
    connector = make(RedisConnector, {"url": CLOSED_PORT_URL, "timeout_s": 0.5})
    side = Side(connector, caches(random=True))
    request = SuiteRequest("a", PROMPT, 4)
    assert side.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
    side.compute_and_finish(request, [5, 2, 9, 7])
    side.scheduler.update_state_after_alloc(SuiteRequest("b", PROMPT, 4), [3, 8, 1, 11], 12)
    side.step([])
    assert side.worker.get_block_ids_with_load_errors() == {3, 8, 1}
    stats = connector.stats
    assert stats["unreachable"] >= 2 and stats["load_errors"] == 3 and stats["saved_blocks"] == 0
    warnings = [record for record in caplog.records if "unreachable" in record.getMessage()]
    assert len(warnings) == 1, "an unreachable server is logged once"
    assert "secret" not in warnings[0].getMessage() and "127.0.0.1:1" in warnings[0].getMessage()


def test_unreachable_redis_is_an_error_when_asked():
    connector = make(RedisConnector, {"url": CLOSED_PORT_URL, "timeout_s": 0.5, "on_unreachable": "error"})
    with pytest.raises(StoreUnreachable, match=r"redis server at redis://:\*\*\*@127\.0\.0\.1:1/0 unreachable"):
        connector.scheduler_side().get_num_new_matched_tokens(SuiteRequest("a", PROMPT, 4), 0)


def test_redacted_url():
    assert redacted_url("redis://user:pw@host:6380/1") == "redis://user:***@host:6380/1"
    assert redacted_url("redis://host:6379/0") == "redis://host:6379/0"


@needs_redis
def test_redis_keys_carry_prefix_and_ttl_and_respect_the_size_limit():
    prefix = f"patchbay-test:{uuid.uuid4().hex}:"
    connector = make(RedisConnector, {"url": REDIS_URL, "key_prefix": prefix, "ttl_s": 120})
    side = Side(connector, caches(random=True))
    side.compute_and_finish(SuiteRequest("a", PROMPT, 4), [5, 2, 9, 7])
    client = connector.open_store().client
    keys = sorted(client.scan_iter(match=f"{prefix}*"))
    assert len(keys) == 3
    assert all(0 < client.ttl(key) <= 120 for key in keys)
    assert all(key.decode().startswith(prefix + connector.namespace + "/") for key in keys)
    small = make(RedisConnector, {"url": REDIS_URL, "key_prefix": prefix + "small:", "max_block_bytes": 100})
    Side(small, caches(random=True)).compute_and_finish(SuiteRequest("b", PROMPT, 4), [5, 2, 9, 7])
    assert small.stats["skipped_saves"] == 3 and small.stats["saved_blocks"] == 0
    assert list(client.scan_iter(match=f"{prefix}small:*")) == []
    client.delete(*keys)


def test_matches_are_whole_blocks_before_the_last_prompt_token():
    namespace = f"cap-{uuid.uuid4().hex}"
    side = Side(make(HostOffloadConnector, {"namespace": namespace}), caches(random=True))
    side.compute_and_finish(SuiteRequest("a", PROMPT, 4), [5, 2, 9, 7])
    # 12 tokens, all 3 blocks stored: the last token stays to compute, so 2 whole blocks (8 tokens), not 11.
    assert side.scheduler.get_num_new_matched_tokens(SuiteRequest("b", PROMPT[:12], 4), 0)[0] == 8
    assert side.scheduler.get_num_new_matched_tokens(SuiteRequest("c", PROMPT[:4], 4), 0)[0] == 0
    assert side.scheduler.get_num_new_matched_tokens(SuiteRequest("d", PROMPT, 4), 8)[0] == 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_caches_round_trip_bit_exactly(tmp_path, dtype):
    def half_caches(random):
        return {name: cache.to(dtype) for name, cache in caches(random=random).items()}

    producer = Side(make(SharedStorageConnector, {"path": str(tmp_path)}), half_caches(True))
    producer.compute_and_finish(SuiteRequest("a", PROMPT, 4), [5, 2, 9, 7])
    consumer = Side(make(SharedStorageConnector, {"path": str(tmp_path)}), half_caches(False))
    request = SuiteRequest("b", PROMPT, 4)
    consumer.scheduler.update_state_after_alloc(
        request, [3, 8, 1, 11], consumer.scheduler.get_num_new_matched_tokens(request, 0)[0]
    )
    consumer.step(["b"])
    for name in producer.caches:
        assert torch.equal(producer.caches[name][:, [5, 2, 9]], consumer.caches[name][:, [3, 8, 1]])


def test_a_damaged_entry_is_discarded_and_saved_again_after_recompute(tmp_path):
    options = {"path": str(tmp_path)}
    producer = Side(make(SharedStorageConnector, options), caches(random=True))
    producer.compute_and_finish(SuiteRequest("a", PROMPT, 4), [5, 2, 9, 7])
    consumer = Side(make(SharedStorageConnector, options), caches(random=False))
    request = SuiteRequest("b", PROMPT, 4)
    num_tokens, _ = consumer.scheduler.get_num_new_matched_tokens(request, 0)
    consumer.scheduler.update_state_after_alloc(request, [3, 8, 1, 11], num_tokens)
    consumer.step(["b"], before_load=lambda _: consumer.connector.corrupt_entry(request.block_hashes[1], "corrupted"))
    assert consumer.worker.get_block_ids_with_load_errors() == {8}
    assert consumer.connector.stats["discarded_entries"] == 1
    assert consumer.scheduler.get_num_new_matched_tokens(request, 0)[0] == 4  # the bad entry is gone
    # The runner recomputes block 8 (same tokens, same values) and the step after saves it again.
    for name in consumer.caches:
        consumer.caches[name][:, 8] = producer.caches[name][:, 2]
    request.num_computed_tokens = 13
    consumer.step(["b"])
    consumer.worker.flush()
    assert consumer.connector.stats["saved_blocks"] == 1
    assert consumer.scheduler.get_num_new_matched_tokens(SuiteRequest("c", PROMPT, 4), 0)[0] == 12
