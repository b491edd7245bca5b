"""KV store entries are untrusted input: damaged, oversized, forged or non-finite entries and misbehaving
Redis servers are misses that are recomputed and counted, never a crash or a wrong token (issue 14)."""

from __future__ import annotations

import os
import socketserver
import stat
import threading

import pytest
import torch

from patchbay.contract.settings import dump_settings, load_settings
from patchbay.interfaces import KVConnectorConfig
from patchbay.plugins.kv_connectors import _auth
from patchbay.plugins.kv_connectors.redis_connector import RedisConnector, redacted_url
from patchbay.plugins.kv_connectors.shared_storage import SharedStorageConnector
from patchbay.testing.kv_connector import Side, SuiteRequest

PROMPT = [(11 * index) % 97 for index in range(13)]  # 3 full blocks of 4 before the last token
KEY = "a-shared-secret-for-tests"


def make(connector_class, options, *, model_id="tests/tiny", role="both"):
    config = KVConnectorConfig(role=role, block_size=4, model_id=model_id)
    return connector_class(connector_class.Options.model_validate(options), config=config)


def caches(random: bool, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    shape = (2, 16, 4, 2, 8)
    return {
        f"layer{index}": torch.randn(shape, generator=generator) if random else torch.zeros(shape) for index in range(2)
    }


def _produce(options) -> Side:
    producer = Side(make(SharedStorageConnector, options), caches(random=True))
    producer.compute_and_finish(SuiteRequest("a", PROMPT, 4), [5, 2, 9, 7])
    return producer


def _consume(options, damage=None) -> tuple[Side, set[int]]:
    """Ask for PROMPT's blocks into [3, 8, 1]; ``damage(connector, block_hash)`` runs before the load."""
    consumer = Side(make(SharedStorageConnector, options), caches(random=False))
    request = SuiteRequest("b", PROMPT, 4)
    num_tokens, _ = consumer.scheduler.get_num_new_matched_tokens(request, 0)
    consumer.scheduler.update_state_after_alloc(request, [3, 8, 1, 11], num_tokens)
    consumer.step(
        ["b"], before_load=(lambda _: damage(consumer.connector, request.block_hashes[1])) if damage else None
    )
    return consumer, consumer.worker.get_block_ids_with_load_errors()


@pytest.mark.parametrize("how", ["not_an_object", "deeply_nested", "non_finite", "forged"])
def test_a_structurally_damaged_or_forged_entry_is_a_counted_miss(tmp_path, how):
    options = {"path": str(tmp_path / "store"), "auth_key": KEY}
    _produce(options)
    consumer, errors = _consume(options, lambda connector, block_hash: connector.corrupt_entry(block_hash, how))
    assert errors == {8}
    assert consumer.connector.stats["load_errors"] == 1 and consumer.connector.stats["loaded_blocks"] == 2
    assert all(not consumer.caches[name][:, 8].any() for name in consumer.caches)  # never written


def test_an_entry_file_grown_huge_is_refused_by_its_size_without_reading_it(tmp_path):
    options = {"path": str(tmp_path / "store"), "auth_key": KEY}
    _produce(options)

    def grow(connector, block_hash):
        path = connector.open_store().path_of(connector.key(block_hash.hex()))
        with path.open("r+b") as file:
            file.truncate(20 << 30)  # sparse: 20 GB long, no disk used

    _, errors = _consume(options, grow)
    assert errors == {8}


def test_entries_written_without_the_key_are_never_loaded(tmp_path):
    """Another local user who can write the directory but lacks the key: nothing of theirs loads."""
    path = str(tmp_path / "shared")
    _produce({"path": path, "auth_key": "the-attackers-own-secret"})
    consumer, errors = _consume({"path": path, "auth_key": KEY})
    assert consumer.connector.stats["loaded_blocks"] == 0
    assert all(not cache.any() for cache in consumer.caches.values())


def test_a_consumer_with_the_wrong_key_deletes_no_valid_entry(tmp_path):
    """LOSS (issue 30): a shared-storage consumer with the wrong key deleted every valid entry in the store.

    Entries it cannot authenticate are misses: the store keeps them, and a runner with the right key
    still loads every one."""
    options = {"path": str(tmp_path / "shared"), "auth_key": KEY}
    _produce(options)
    stored = {path: path.read_bytes() for path in (tmp_path / "shared").rglob("*.kvb")}
    assert len(stored) == 3
    for role in ("consumer", "both"):
        wrong = make(SharedStorageConnector, {**options, "auth_key": "some-other-secret-of-this-user"}, role=role)
        consumer = Side(wrong, caches(random=False))
        request = SuiteRequest("b", PROMPT, 4)
        consumer.scheduler.update_state_after_alloc(request, [3, 8, 1, 11], 12)  # as if a lookup had said yes
        consumer.step(["b"])
        assert consumer.worker.get_block_ids_with_load_errors() == {3, 8, 1}
        assert wrong.stats["loaded_blocks"] == 0 and wrong.stats["discarded_entries"] == 0
        assert {path: path.read_bytes() for path in (tmp_path / "shared").rglob("*.kvb")} == stored
    right, errors = _consume(options)
    assert errors == set() and right.connector.stats["loaded_blocks"] == 3


def test_an_unsafe_default_store_directory_is_a_one_line_error_naming_it(tmp_path, own_cache_dir, tiny_llama, capsys):
    """Issue 30: an unsafe store directory was refused with a traceback instead of a clear error."""
    from patchbay.entrypoints.cli import main

    store = own_cache_dir / "kv-store"
    store.mkdir()
    store.chmod(0o777)
    config = tmp_path / "job.yaml"
    config.write_text(
        f"model: {{path: '{tiny_llama}'}}\nkv_connector: {{name: shared_storage}}\n"
        "inputs: {chat_template: false, prompts: [hello], sampling: {max_tokens: 2}}\n"
    )
    status = main(["run", str(config)])
    error = capsys.readouterr().err
    assert status == 2
    assert f"the default shared_storage directory {store} has mode" in error and "others may write it" in error
    assert "Traceback" not in error


def test_the_default_key_file_is_per_user_0600_and_shared_by_this_users_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(tmp_path / "cache"))
    options = {"path": str(tmp_path / "store")}
    producer = _produce(options)
    key_file = tmp_path / "cache" / _auth.KEY_FILE_NAME
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    consumer, errors = _consume(options)
    assert errors == set() and consumer.connector.key_bytes == producer.connector.key_bytes
    key_file.chmod(0o644)
    with pytest.raises(PermissionError, match="others may read or write it"):
        make(SharedStorageConnector, options)


def test_the_default_store_is_a_private_directory_under_the_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(tmp_path / "cache"))
    connector = make(SharedStorageConnector, {})
    store = connector.open_store()
    assert store.root == tmp_path / "cache" / "kv-store"
    assert stat.S_IMODE(store.root.stat().st_mode) == 0o700
    store.root.chmod(0o777)  # as if someone else had pre-created it for everyone
    with pytest.raises(PermissionError, match="others may write it"):
        connector.open_store()


@pytest.mark.skipif(os.geteuid() != 0, reason="creating a directory owned by another uid needs root")
def test_a_default_store_directory_owned_by_another_user_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "kv-store").mkdir(parents=True, mode=0o700)
    os.chown(tmp_path / "cache" / "kv-store", 12345, 12345)
    with pytest.raises(PermissionError, match="belongs to uid 12345, not to this user"):
        make(SharedStorageConnector, {}).open_store()


def test_entry_files_follow_the_umask_so_a_consumer_of_another_uid_can_read_them(tmp_path):
    _produce({"path": str(tmp_path / "store"), "auth_key": KEY})
    modes = {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "store").rglob("*.kvb")}
    umask = os.umask(0)
    os.umask(umask)
    assert modes == {0o666 & ~umask}


# -- Redis servers that misbehave ------------------------------------------------------------------


class _FakeRedis(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True


def _complete_commands(buffer: bytes) -> tuple[int, bytes]:
    """How many whole RESP commands (arrays of bulk strings) ``buffer`` starts with, and the bytes after them."""
    count = 0
    while buffer.startswith(b"*"):
        end = buffer.find(b"\r\n")
        if end < 0:
            break
        at, parts = end + 2, int(buffer[1:end])
        for _ in range(parts):
            size_end = buffer.find(b"\r\n", at)
            if size_end < 0 or not buffer.startswith(b"$", at):
                return count, buffer
            at = size_end + 2 + int(buffer[at + 1 : size_end]) + 2
            if at > len(buffer):
                return count, buffer
        count, buffer = count + 1, buffer[at:]
    return count, buffer


def _server(answer: bytes | None) -> tuple[_FakeRedis, str]:
    """A TCP server answering every request with ``answer`` (``None``: accept, read, never answer): once per
    RESP command (a client may send several in one packet, as redis-py 8 does on connecting), else once per
    read."""

    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.settimeout(5)
            pending = b""
            try:
                while data := self.request.recv(65536):
                    if answer is None:
                        continue
                    commands, pending = _complete_commands(pending + data)
                    if not commands and not pending.startswith(b"*"):
                        commands, pending = 1, b""  # not RESP: one answer per read
                    self.request.sendall(answer * commands)
            except OSError:
                pass

    server = _FakeRedis(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"redis://127.0.0.1:{server.server_address[1]}/0"


@pytest.mark.parametrize(
    "answer",
    [
        b"-ERR unknown command\r\n",
        b"-WRONGTYPE Operation against a key holding the wrong kind of value\r\n",
        b"HTTP/1.1 400 Bad Request\r\n\r\n",
        b"-OOM command not allowed when used memory > 'maxmemory'\r\n",
    ],
)
def test_a_redis_answering_errors_or_not_speaking_redis_gives_misses_and_counted_dropped_saves(answer, caplog):
    server, url = _server(answer)
    try:
        producer = Side(make(RedisConnector, {"url": url, "auth_key": KEY, "timeout_s": 1}), caches(random=True))
        producer.compute_and_finish(SuiteRequest("a", PROMPT, 4), [5, 2, 9, 7])
        stats = producer.connector.stats
        assert stats["dropped_saves"] >= 3 and stats["saved_blocks"] == 0
        consumer = Side(make(RedisConnector, {"url": url, "auth_key": KEY, "timeout_s": 1}), caches(random=False))
        request = SuiteRequest("b", PROMPT, 4)
        assert consumer.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)
        assert consumer.connector.stats["store_errors"] >= 1
        consumer.scheduler.update_state_after_alloc(request, [3, 8, 1, 11], 12)  # as if a lookup had said yes
        consumer.step(["b"])
        assert consumer.worker.get_block_ids_with_load_errors() == {3, 8, 1}
        assert "could not be saved" in caplog.text or "not saved" in caplog.text
    finally:
        server.shutdown()
        server.server_close()


def test_a_redis_that_never_answers_opens_the_breaker_after_a_few_timeouts():
    server, url = _server(None)
    try:
        connector = make(RedisConnector, {"url": url, "auth_key": KEY, "timeout_s": 0.2, "breaker_failures": 2})
        scheduler = connector.scheduler_side()
        for index in range(20):
            assert scheduler.get_num_new_matched_tokens(SuiteRequest(f"r{index}", PROMPT, 4), 0) == (0, False)
        assert scheduler.store.num_skipped_calls == 18  # two timeouts, then the breaker answered at once
        assert connector.stats["unreachable"] == 20
    finally:
        server.shutdown()
        server.server_close()


def test_a_redis_password_is_never_shown():
    assert redacted_url("redis://h:6379/0?password=s3cret&db=1") == "redis://h:6379/0?password=***&db=1"
    assert redacted_url("redis://user:s3cret@h:6379/0") == "redis://user:***@h:6379/0"
    settings = load_settings(
        overrides=[
            "kv_connector.name=redis",
            "kv_connector.options.url=redis://u:s3cret@h:1/0?password=s3cret",
            f"kv_connector.options.auth_key={KEY}",
        ]
    )
    shown = dump_settings(settings)
    assert "s3cret" not in shown and KEY not in shown and "redis://u:***@h:1/0?password=***" in shown


def test_two_checkpoints_with_one_config_have_different_identities(tiny_llama, tmp_path):
    """A model retrained (or fine-tuned) in place keeps its config.json; its KV entries must not be reused."""
    import shutil

    from safetensors.torch import load_file, save_file

    from patchbay.engine.model_identity import weights_fingerprint

    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama, copy)
    assert weights_fingerprint(copy) == weights_fingerprint(tiny_llama)  # a copy shares entries
    for weights in copy.glob("*.safetensors"):
        tensors = load_file(weights)
        save_file({name: tensor + 1e-3 for name, tensor in tensors.items()}, weights, metadata={"format": "pt"})
    assert (copy / "config.json").read_bytes() == (tiny_llama / "config.json").read_bytes()
    assert weights_fingerprint(copy) != weights_fingerprint(tiny_llama)


def _unsampled_offset(size: int, start: int) -> int:
    """A byte offset past ``start`` that the old sampled fingerprint never read (edges and 64 evenly spaced pieces)."""
    read = [(0, 64 << 10), (max(0, size - (64 << 10)), size)]
    read += [(size * (index + 1) // 65, size * (index + 1) // 65 + (4 << 10)) for index in range(64)]
    for offset in range(start, size):
        if not any(begin <= offset < end for begin, end in read):
            return offset
    raise AssertionError("every byte was sampled")


def test_weights_that_differ_in_one_tensor_byte_have_different_identities(tiny_llama, tmp_path, monkeypatch):
    """Issue 30: the weights fingerprint sampled tensors, so entries written for weights that differ in one
    tensor it missed still loaded.  Every byte counts, also after the digest memo has seen the file."""
    import json
    import shutil
    import struct

    from patchbay.engine.model_identity import MEMO_FILE_NAME, weights_fingerprint

    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "copy"
    shutil.copytree(tiny_llama, copy)
    original = weights_fingerprint(copy)
    assert (tmp_path / "cache" / MEMO_FILE_NAME).is_file()  # remembered: the next start does not rehash
    weights = next(copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    assert json.loads(data[8:header_end])  # the offset below is tensor data, not the header
    offset = _unsampled_offset(len(data), header_end)
    times = weights.stat()
    data[offset] ^= 0x01  # one bit of one tensor
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(times.st_atime_ns, times.st_mtime_ns))  # the same size and modification time
    assert weights_fingerprint(copy) != original
    data[offset] ^= 0x01
    weights.write_bytes(bytes(data))
    assert weights_fingerprint(copy) == original == weights_fingerprint(tiny_llama)


def test_an_unwritable_fingerprint_memo_never_fails_a_start(tiny_llama, tmp_path, monkeypatch):
    """Issue 30 (LOSS, full cache disk): a memo that cannot be saved costs a rehash, not the run."""
    from patchbay.engine import model_identity

    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(tmp_path / "cache"))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_identity.tempfile, "mkstemp", disk_full)
    assert model_identity.weights_fingerprint(tiny_llama) == model_identity.weights_fingerprint(tiny_llama)
    assert not (tmp_path / "cache" / model_identity.MEMO_FILE_NAME).exists()
