"""KV-cache events on the wire: a plain ZMQ subscriber, knowing only vLLM's message layout, rebuilds an index that
equals the engine's block pool after a soak of shared-prefix traffic with evictions (issue 54).

The subscriber decodes with a schema-less msgpack decoder: nothing of patchbay's own encoder is trusted.  It
joins before the traffic, and asks the replay endpoint for every batch from sequence 0 at the end, so a batch
the PUB socket sent before the subscription took hold is not lost; the live stream must agree with the replay.
"""

from __future__ import annotations

import os
import random
import socket
import threading

import msgspec
import pytest
import zmq

import patchbay
from patchbay.contract.settings import ConfigError
from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.request import hash_block_tokens

VOCAB = 49152  # tiny_llama's vocabulary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Subscriber:
    """A ZMQ SUB socket in a thread, keeping every (sequence number, decoded payload) it receives."""

    def __init__(self, endpoint: str) -> None:
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.socket.connect(endpoint)
        self.received: list[tuple[int, object]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self.socket.poll(50):
                topic, sequence, payload = self.socket.recv_multipart()
                self.received.append((int.from_bytes(sequence, "big"), msgspec.msgpack.decode(payload)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.socket.close(0)
        self.context.term()


def replay_from(endpoint: str, start: int) -> list[tuple[int, object]]:
    """Ask a replay endpoint for every batch from ``start``: a DEALER sends ``(b"", start)``, the publisher's
    ROUTER streams ``(b"", sequence, payload)`` back and ends with sequence -1."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", start.to_bytes(8, "big")))
    batches = []
    try:
        while True:
            _, sequence, payload = dealer.recv_multipart()
            number = int.from_bytes(sequence, "big", signed=True)
            if number == -1:
                assert payload == b""
                return batches
            batches.append((number, msgspec.msgpack.decode(payload)))
    finally:
        dealer.close(0)
        context.term()


def apply(index: dict[int, dict[bytes, tuple[int, ...]]], batch: object) -> None:
    """Replay one decoded ``KVEventBatch`` (``[ts, events, rank]``, events tagged maps) into ``index``."""
    assert isinstance(batch, list) and len(batch) == 3, batch
    ts, events, rank = batch
    assert isinstance(ts, float) and rank == 0
    for event in events:
        kind = event["type"]
        if kind == "BlockStored":
            assert event["medium"] == "GPU" and event["lora_id"] is None
            group = index.setdefault(event["group_idx"], {})
            size = event["block_size"]
            parent = event["parent_block_hash"]
            for position, block_hash in enumerate(event["block_hashes"]):
                tokens = event["token_ids"][position * size : (position + 1) * size]
                assert block_hash == hash_block_tokens(parent, tokens), "a stored hash that is not its tokens'"
                assert block_hash not in group, "stored twice"
                group[block_hash] = tuple(tokens)
                parent = block_hash
        elif kind == "BlockRemoved":
            group = index.setdefault(event["group_idx"], {})
            for block_hash in event["block_hashes"]:
                assert block_hash in group, "removed a block never stored (a phantom)"
                del group[block_hash]
        else:
            assert kind == "AllBlocksCleared", kind
            index.clear()


SOAK_ROUNDS = int(os.environ.get("PATCHBAY_KV_EVENTS_SOAK_ROUNDS", "12"))
"""Batches of requests in the soak; a longer one on demand (``PATCHBAY_KV_EVENTS_SOAK_ROUNDS=300``, 25 times as
long; the replay keeps ``kv_events.buffer_steps`` batches, enough for that)."""


def test_a_zmq_subscriber_rebuilds_the_block_pool_after_a_soak(tiny_llama):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    llm = patchbay.LLM(
        model__path=str(tiny_llama),
        attention__name="torch_sdpa",
        runtime__threads=2,
        model__max_model_len=64,
        cache__num_blocks=40,
        cache__block_size=4,
        scheduler__max_num_seqs=8,
        kv_events__enable_kv_cache_events=True,
        kv_events__endpoint=endpoint,
        kv_events__replay_endpoint=replay_endpoint,
    )
    subscriber = Subscriber(endpoint)
    try:
        rng = random.Random(54)
        prefixes = [[rng.randrange(VOCAB) for _ in range(rng.choice([8, 12, 17]))] for _ in range(6)]
        for _ in range(SOAK_ROUNDS):
            prompts = [
                [*rng.choice(prefixes), *(rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9)))]
                for _ in range(rng.randint(4, 10))
            ]
            llm.generate(prompts, SamplingParams(max_tokens=rng.randint(1, 8), ignore_eos=True))
        engine = llm.engine
        publisher = engine.kv_event_publisher
        assert publisher is not None
        publisher.flush()
        replayed = replay_from(replay_endpoint, 0)
    finally:
        subscriber.close()

    index: dict[int, dict[bytes, tuple[int, ...]]] = {}
    for expected, (sequence, batch) in enumerate(replayed):
        assert sequence == expected, "the replay skipped a sequence number"
        apply(index, batch)
    assert [set(index.get(g, {})) for g in range(len(engine.kv_cache_manager.pools))] == [
        set(pool.cached_blocks) for pool in engine.kv_cache_manager.pools
    ]
    evicted = sum(1 for _, batch in replayed for event in batch[1] if event["type"] == "BlockRemoved")
    assert evicted > 0, "the soak never evicted a block: the test would not see a missed removal"
    # What the live subscriber got is a gap-free run of the same batches (ZMQ may drop the first ones, sent
    # before the subscription reached the publisher; that is what the replay endpoint is for).
    assert subscriber.received, "the live subscriber got nothing"
    first = subscriber.received[0][0]
    assert [sequence for sequence, _ in subscriber.received] == list(range(first, len(replayed)))
    assert [batch for _, batch in subscriber.received] == [batch for _, batch in replayed[first:]]
    engine.close()


@pytest.mark.parametrize("prefix_caching", [False])
def test_events_without_a_prefix_cache_are_a_config_error(tiny_llama, prefix_caching):
    with pytest.raises(ConfigError, match="kv_events.enable_kv_cache_events"):
        patchbay.LLM(
            model__path=str(tiny_llama),
            cache__prefix_caching=prefix_caching,
            cache__num_blocks=40,
            kv_events__enable_kv_cache_events=True,
            kv_events__endpoint=f"tcp://127.0.0.1:{free_port()}",
        )


def test_the_wire_format_is_vllms_field_for_field():
    """One event of each kind, encoded and decoded without a schema: vLLM's tags, field names and array batch."""
    from patchbay.engine.kv_event_publisher import to_wire
    from patchbay.scheduling.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    events = [
        BlockStored((b"\x01" * 32, b"\x02" * 32), None, tuple(range(8)), 4, "sql", 0),
        BlockRemoved((b"\x01" * 32,), 1),
        AllBlocksCleared(),
    ]
    batch = msgspec.msgpack.decode(
        msgspec.msgpack.encode(to_wire(events, [("full_attention", None), ("sliding_window", 24)], 3, 1.5))
    )
    assert batch[0] == 1.5 and batch[2] == 3
    stored, removed, cleared = batch[1]
    assert stored == {
        "type": "BlockStored",
        "block_hashes": [b"\x01" * 32, b"\x02" * 32],
        "parent_block_hash": None,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": "sql",
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    assert removed == {"type": "BlockRemoved", "block_hashes": [b"\x01" * 32], "medium": "GPU", "group_idx": 1}
    assert cleared == {"type": "AllBlocksCleared"}


def test_replicas_offset_the_port_and_bad_endpoints_are_refused():
    from patchbay.contract.settings import load_settings
    from patchbay.engine import offset_port

    assert offset_port("tcp://127.0.0.1:5557", 0) == "tcp://127.0.0.1:5557"
    assert offset_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_port("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    with pytest.raises(ConfigError, match="kv_events.endpoint"):
        load_settings(None, overrides=["kv_events.endpoint=127.0.0.1:5557"])
