"""Conformance suite for KV connectors: random caches with exact comparisons, then the real engine.

A connector author's test file::

    from patchbay.testing import KVConnectorSuite

    class TestMyConnector(KVConnectorSuite):
        plugin_name = "my_connector"

The suite drives both roles as the runner does.  A *producer* connector
sees a request scheduled, its prompt computed (the random caches stand in
for the forward pass), then finished; a *second instance* with the same
options, over zeroed caches, is asked for the prefix, allocates blocks and
loads them, and every block of every layer must equal the original bit for
bit -- and every other block must still be zero.  Then the connector runs in
the engine on a tiny model: a run without it, a cold run and a warm run
(a new engine, the same store) must give the same greedy tokens, with
prompts that hit each other's blocks inside one step and a prompt too short
to save anything.

Tensor parallelism: two worker sides configured as ranks 0 and 1 of 2
(:class:`patchbay.interfaces.KVShard`), sharing one store, save different
data for the same blocks, following rank 0's scheduler side as a sharded
run does; each must load back its own data, a worker side of another
sharding must load neither, and an entry one rank lost is that rank's load
error alone.

Every test runs twice: with the connector's default options (as an operator
who writes only ``name:`` gets it) and, for a connector with a ``path``
option, with ``path`` pointed at a fresh temporary directory.  Options for
``patchbay check`` can be given in the ``PATCHBAY_TEST_KV_CONNECTOR_OPTIONS``
environment variable (JSON); they apply to both modes.

Faults need the fault hook, a required part of the connector contract for
the kit: a ``corrupt_entry(block_hash, how)`` method on the connector (or
:meth:`KVConnectorSuite.corrupt_entry` overridden in the suite subclass)
that damages the stored entry of ``block_hash`` as ``how`` (one of
:data:`FAULTS`) says, or raises :class:`NotImplementedError` with the reason
a fault cannot happen to its store (never for ``missing``).  Without the
hook the fault tests fail, saying so.  The
damage happens after the scheduler side planned the load (as if another
process changed the store in between), and the worker must then report the
block as a load error and leave it untouched.
"""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from patchbay.interfaces import KVConnector, KVConnectorConfig, KVConnectorMetadata, KVShard
from patchbay.interfaces.kv_connector import KVConnectorRole
from patchbay.scheduling.request import hash_block_tokens
from patchbay.testing.kinds import KVConnectorBaseSuite
from patchbay.testing.suite import options_env, skip_not_declared

if TYPE_CHECKING:
    import torch

FAULTS = ("missing", "truncated", "corrupted", "other_model", "other_layout", "forged")
"""What :meth:`KVConnectorSuite.corrupt_entry` is asked to do to a stored entry."""

OPTIONS_ENV = options_env("kv_connector")

STORE_MODES = ("defaults", "temp-dir")
"""Every test runs with the connector's default options, and with ``path`` in a temporary directory if it has one."""

ENGINE_STALL_TIMEOUT = 10.0
"""``kv_connector.stall_timeout`` of the engine runs: a connector that holds a request forever fails within it."""

SEED = 20241130


@dataclass
class SuiteRequest:
    """A request as a connector sees it (:class:`patchbay.interfaces.RequestView`)."""

    request_id: str
    prompt_token_ids: list[int]
    block_size: int
    num_computed_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        parent = None
        for start in range(0, len(self.prompt_token_ids) - self.block_size + 1, self.block_size):
            parent = hash_block_tokens(parent, self.prompt_token_ids[start : start + self.block_size])
            self.block_hashes.append(parent)


class Side:
    """Both roles of one connector instance over its own paged caches (what one runner process holds)."""

    def __init__(self, connector: KVConnector, caches: dict[str, torch.Tensor]) -> None:
        self.connector = connector
        self.scheduler = connector.scheduler_side()
        self.worker = connector.worker_side()
        self.caches = caches
        self.worker.register_kv_caches(caches, split_kv_cache)

    def step(self, scheduled: Sequence[str], before_load: Callable[[KVConnectorMetadata], None] | None = None) -> None:
        """One engine step: build the message, load, (forward pass), save."""
        metadata = self.scheduler.build_connector_meta(list(scheduled))
        if before_load is not None:
            before_load(metadata)
        self.worker.start_load_kv(metadata)
        for layer_name in self.caches:
            self.worker.wait_for_layer_load(layer_name)
        self.worker.wait_for_save()

    def compute_and_finish(self, request: SuiteRequest, block_ids: list[int], timeout_s: float = 30.0) -> None:
        """Schedule ``request`` whole, "compute" it, run a decode step, finish it and wait for its saves."""
        num_external, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
        self.scheduler.update_state_after_alloc(request, block_ids, num_external)
        self.step([request.request_id])
        request.num_computed_tokens = len(request.prompt_token_ids)
        self.step([request.request_id])  # a decode step
        held = self.scheduler.request_finished(request, block_ids)
        self.step([])
        if held:
            self.wait_sent(request.request_id, timeout_s)
        flush = getattr(self.worker, "flush", None)
        if callable(flush):
            flush()

    def wait_sent(self, request_id: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sent, _ = self.worker.get_finished(set())
            if request_id in sent:
                return
            self.step([])
            time.sleep(0.01)
        pytest.fail(
            f"request_finished held {request_id!r}'s blocks but get_finished never reported it "
            f"as sent within {timeout_s} s"
        )


class RankedSides:
    """The ranks of one sharded run: rank 0's scheduler side plans, every rank's worker side runs each step.

    Each worker gets its own copy of the step's metadata (as each rank
    unpickles its own); a transfer is finished once every rank reported it.
    """

    def __init__(self, sides: list[Side]) -> None:
        self.sides = sides
        self.scheduler = sides[0].scheduler

    def step(self, scheduled: Sequence[str], before_load: Callable[[KVConnectorMetadata], None] | None = None) -> None:
        """One engine step on every rank: rank 0 builds the message, each rank loads, (forward pass), saves."""
        metadata = self.scheduler.build_connector_meta(list(scheduled))
        if before_load is not None:
            before_load(metadata)
        for side in self.sides:
            worker = side.worker
            worker.start_load_kv(copy.deepcopy(metadata))
            for layer_name in side.caches:
                worker.wait_for_layer_load(layer_name)
            worker.wait_for_save()

    def compute_and_finish(self, request: SuiteRequest, block_ids: list[int], timeout_s: float = 30.0) -> None:
        """As :meth:`Side.compute_and_finish`, on every rank at once."""
        num_external, _ = self.scheduler.get_num_new_matched_tokens(request, 0)
        self.scheduler.update_state_after_alloc(request, block_ids, num_external)
        self.step([request.request_id])
        request.num_computed_tokens = len(request.prompt_token_ids)
        self.step([request.request_id])
        held = self.scheduler.request_finished(request, block_ids)
        self.step([])
        if held:
            self.wait_sent(request.request_id, timeout_s)
        for side in self.sides:
            flush = getattr(side.worker, "flush", None)
            if callable(flush):
                flush()

    def wait_sent(self, request_id: str, timeout_s: float) -> None:
        """Step until every rank's worker side has reported ``request_id`` as sent."""
        waiting = set(range(len(self.sides)))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for rank in sorted(waiting):
                if request_id in self.sides[rank].worker.get_finished(set())[0]:
                    waiting.discard(rank)
            if not waiting:
                return
            self.step([])
            time.sleep(0.01)
        pytest.fail(
            f"request_finished held {request_id!r}'s blocks but the worker sides of ranks {sorted(waiting)} "
            f"never reported it as sent within {timeout_s} s (with several ranks, each must)"
        )


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The suite's cache layout: ``[2, num_blocks, block_size, kv_heads, head_size]``."""
    return kv_cache[0], kv_cache[1]


class KVConnectorSuite(KVConnectorBaseSuite):
    """Round trips, partial prefixes, lookup purity, async completion and faults, on 2-layer random caches."""

    num_layers: ClassVar[int] = 2
    block_size: ClassVar[int] = 4
    num_kv_heads: ClassVar[int] = 2
    head_size: ClassVar[int] = 8
    num_blocks: ClassVar[int] = 16
    run_end_to_end: ClassVar[bool] = True
    """Run the engine tests (tiny model, a few seconds each); ``False`` skips them (and fails them in strict mode)."""

    # -- fixtures and hooks an implementer may override --------------------------------------

    def pytest_generate_tests(self, metafunc: pytest.Metafunc) -> None:
        if "store_mode" in metafunc.fixturenames:
            metafunc.parametrize("store_mode", STORE_MODES)

    @pytest.fixture
    def connector_options(self, plugin_class: type[KVConnector], tmp_path, store_mode: str) -> dict[str, Any]:
        """Options (a YAML section as a dict) every connector instance of a test gets, per :data:`STORE_MODES`."""
        options = self.given_options() or {}
        if store_mode == "temp-dir":
            if "path" not in plugin_class.Options.model_fields:
                skip_not_declared("the connector has no 'path' option: its defaults are its only store")
            options["path"] = str(tmp_path / "kv-store")
        return options

    @pytest.fixture
    def model_id(self) -> str:
        """A fresh model identity per test, so entries of earlier tests (or runs) are never found."""
        return f"conformance-{uuid.uuid4().hex}"

    @pytest.fixture
    def make_side(self, available: type[KVConnector], connector_options: dict[str, Any], model_id: str):
        """``make_side(role, random=False, shard=None)``: a new connector instance (same options) with both roles,
        over zeroed (or seeded random) caches, as the worker side of ``shard`` (default: the whole model)."""
        import torch

        def make(role: KVConnectorRole = "both", *, random: bool = False, shard: KVShard | None = None) -> Side:
            if role not in available.capabilities.roles:
                skip_not_declared(f"role {role!r} not supported")
            options = available.Options.model_validate(connector_options)
            shard = shard if shard is not None else KVShard()
            config = KVConnectorConfig(
                device="cpu", dtype="float32", role=role, block_size=self.block_size, model_id=model_id
            ).with_shard(shard)
            shape = (2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_size)
            generator = torch.Generator().manual_seed(SEED + shard.rank)  # each rank's heads hold other values
            caches = {
                f"model.layers.{layer}.self_attn": (
                    torch.randn(shape, generator=generator) if random else torch.zeros(shape)
                )
                for layer in range(self.num_layers)
            }
            return Side(available(options, config=config), caches)

        return make

    def corrupt_entry(self, connector: KVConnector, block_hash: bytes, how: str) -> None:
        """The backdoor: damage the stored entry of ``block_hash`` as ``how`` (one of :data:`FAULTS`) says.

        ``missing``: delete it; ``truncated``: keep its first half; ``corrupted``:
        flip a byte of its KV data; ``other_model`` / ``other_layout``: replace
        it by an otherwise valid entry of another model identity / block layout;
        ``forged``: replace it by a well-formed entry of the same model, layout
        and block whose KV data differs, written by someone without the store's
        key (authenticated, if at all, with another key).
        Override in a subclass.  The default calls the connector's own
        ``corrupt_entry(block_hash, how)`` (what ``patchbay check`` uses) and
        fails the test when there is none.  The hook may raise
        :class:`NotImplementedError` with a reason for a fault its store
        cannot suffer (an in-process store of tensors cannot be truncated),
        never for ``missing``.
        """
        backdoor = getattr(connector, "corrupt_entry", None)
        if not callable(backdoor):
            pytest.fail(
                f"{type(connector).__name__} has no fault hook: the kit needs a corrupt_entry(block_hash, how) "
                "method on the connector (or KVConnectorSuite.corrupt_entry overridden in your suite) to check "
                "that damaged entries are load errors; see docs/plugin-guide.md, 'The KV-connector fault hook'"
            )
        try:
            backdoor(block_hash, how)
        except NotImplementedError as exc:
            if how == "missing":
                pytest.fail(
                    f"{type(connector).__name__}.corrupt_entry does not implement 'missing' ({exc}); "
                    "every store can lose an entry, so every connector must handle and simulate that"
                )
            capabilities = type(connector).capabilities
            if how == "forged" and (capabilities.cross_process or capabilities.cross_machine):
                pytest.fail(
                    f"{type(connector).__name__}.corrupt_entry does not implement 'forged' ({exc}), but its store "
                    "is shared across processes or machines, so others can write it: entries must be "
                    "authenticated (patchbay.interfaces.sign_entry / verify_entry) and the hook must forge one"
                )
            skip_not_declared(f"{type(connector).__name__} declares {how!r} entries impossible in its store: {exc}")

    # -- helpers ----------------------------------------------------------------------------------

    def prompt(self, num_tokens: int, offset: int = 0) -> list[int]:
        return [(7 * index + 3 + offset) % 1000 for index in range(num_tokens)]

    def produce(self, make_side, prompt: list[int], block_ids: list[int]) -> Side:
        """A producer process: computes and finishes one request, saving its prompt blocks."""
        producer = make_side("both", random=True)
        producer.compute_and_finish(SuiteRequest("produced", prompt, self.block_size), block_ids)
        stats = getattr(producer.connector, "stats", None)
        if isinstance(stats, dict) and stats.get("unreachable"):
            pytest.skip(f"the store is unreachable with these options (stats: {stats})")
        return producer

    def assert_blocks_equal(self, source: Side, source_ids: list[int], target: Side, target_ids: list[int]) -> None:
        import torch

        for layer_name in source.caches:
            for part, source_cache, target_cache in zip(
                ("keys", "values"),
                split_kv_cache(source.caches[layer_name]),
                split_kv_cache(target.caches[layer_name]),
                strict=True,
            ):
                for source_id, target_id in zip(source_ids, target_ids, strict=True):
                    assert torch.equal(source_cache[source_id], target_cache[target_id]), (
                        f"{layer_name} {part}: block {target_id} differs from the saved block {source_id}"
                    )

    def assert_untouched(self, side: Side, block_ids: Sequence[int], what: str) -> None:
        for layer_name, kv_cache in side.caches.items():
            for block_id in block_ids:
                assert not kv_cache[:, block_id].any(), f"{layer_name}: block {block_id} was written ({what})"

    # -- round trips ------------------------------------------------------------------------------

    def test_save_then_load_is_bit_exact(self, make_side) -> None:
        prompt = self.prompt(3 * self.block_size + 1)  # 3 full blocks before the last token
        producer = self.produce(make_side, prompt, [5, 2, 9, 7])
        consumer = make_side("both")
        request = SuiteRequest("consumed", list(prompt), self.block_size)
        num_tokens, _ = consumer.scheduler.get_num_new_matched_tokens(request, 0)
        assert num_tokens == 3 * self.block_size, f"expected the 3 saved blocks ({3 * self.block_size} tokens)"
        target_ids = [3, 8, 1, 11]
        consumer.scheduler.update_state_after_alloc(request, target_ids, num_tokens)
        consumer.step([request.request_id])
        assert consumer.worker.get_block_ids_with_load_errors() == set()
        self.assert_blocks_equal(producer, [5, 2, 9], consumer, target_ids[:3])
        others = sorted(set(range(self.num_blocks)) - set(target_ids[:3]))
        self.assert_untouched(consumer, others, "no load was planned for it")

    def test_partial_prefix_match(self, make_side) -> None:
        prompt = self.prompt(3 * self.block_size + 1)
        producer = self.produce(make_side, prompt, [5, 2, 9, 7])
        consumer = make_side("both")
        # Shares the first two blocks, then diverges.
        diverging = prompt[: 2 * self.block_size] + self.prompt(2 * self.block_size + 1, offset=500)
        request = SuiteRequest("diverging", diverging, self.block_size)
        assert consumer.scheduler.get_num_new_matched_tokens(request, 0)[0] == 2 * self.block_size
        # The first block is already local (prefix cache): only the second is new.
        request.num_computed_tokens = 0
        assert consumer.scheduler.get_num_new_matched_tokens(request, self.block_size)[0] == self.block_size
        target_ids = [4, 6, 10, 12, 13]
        consumer.scheduler.update_state_after_alloc(request, target_ids, self.block_size)
        consumer.step([request.request_id])
        assert consumer.worker.get_block_ids_with_load_errors() == set()
        self.assert_blocks_equal(producer, [2], consumer, [6])
        self.assert_untouched(
            consumer, [block for block in range(self.num_blocks) if block != 6], "outside the new part of the match"
        )

    def test_lookup_has_no_side_effects_and_keeps_the_last_token(self, make_side) -> None:
        prompt = self.prompt(3 * self.block_size + 1)
        self.produce(make_side, prompt, [5, 2, 9, 7])
        consumer = make_side("both")
        # A prompt of exactly 3 blocks: its last token is never loaded, so at most 3 blocks minus 1 token.
        exact = SuiteRequest("exact", prompt[: 3 * self.block_size], self.block_size)
        answers = {consumer.scheduler.get_num_new_matched_tokens(exact, 0)[0] for _ in range(3)}
        assert len(answers) == 1, f"repeated lookups disagree: {answers}"
        (answer,) = answers
        assert 2 * self.block_size <= answer <= 3 * self.block_size - 1, (
            f"expected the whole blocks before the last prompt token, got {answer} tokens"
        )
        short = SuiteRequest("short", prompt[: self.block_size], self.block_size)
        assert consumer.scheduler.get_num_new_matched_tokens(short, 0)[0] < self.block_size, (
            "a one-block prompt must compute its last token"
        )
        # Asked but never allocated: nothing is loaded.
        consumer.step(["exact", "short"])
        assert consumer.worker.get_block_ids_with_load_errors() == set()
        self.assert_untouched(consumer, range(self.num_blocks), "lookups alone must not load")

    def test_finished_saves_are_reported(self, make_side) -> None:
        side = make_side("both", random=True)
        request = SuiteRequest("finishing", self.prompt(2 * self.block_size + 1), self.block_size)
        side.scheduler.update_state_after_alloc(request, [1, 2, 3], 0)
        side.step([request.request_id])
        request.num_computed_tokens = len(request.prompt_token_ids)
        held = side.scheduler.request_finished(request, [1, 2, 3])
        assert isinstance(held, bool)
        side.step([])
        if held:
            side.wait_sent(request.request_id, 30.0)
        else:
            assert request.request_id not in side.worker.get_finished({request.request_id})[0]

    def test_request_with_nothing_to_save_is_released(self, make_side) -> None:
        """A prompt shorter than a block has no full block.

        If ``request_finished`` holds it, the worker must report it.
        """
        side = make_side("both", random=True)
        request = SuiteRequest("too-short", self.prompt(self.block_size - 1), self.block_size)
        side.scheduler.update_state_after_alloc(request, [4], 0)
        side.step([request.request_id])
        request.num_computed_tokens = len(request.prompt_token_ids)
        side.step([request.request_id])  # a decode step
        if side.scheduler.request_finished(request, [4]):
            side.step([])
            side.wait_sent(request.request_id, 5.0)

    def test_producer_does_not_load(self, make_side) -> None:
        prompt = self.prompt(3 * self.block_size + 1)
        self.produce(make_side, prompt, [5, 2, 9, 7])
        producer = make_side("producer")
        request = SuiteRequest("producer-only", list(prompt), self.block_size)
        assert producer.scheduler.get_num_new_matched_tokens(request, 0) == (0, False)

    def test_consumer_never_writes_the_store(self, make_side) -> None:
        """A ``consumer`` only reads: the requests it computes and finishes leave the store as it was."""
        consumer = make_side("consumer", random=True)
        prompt = self.prompt(3 * self.block_size + 1, offset=500)
        consumer.compute_and_finish(SuiteRequest("consumed", list(prompt), self.block_size), [5, 2, 9, 7])
        reader = make_side("both")
        found, _ = reader.scheduler.get_num_new_matched_tokens(SuiteRequest("probe", list(prompt), self.block_size), 0)
        assert found == 0, (
            f"a consumer wrote the store: {found} tokens of a request it computed can now be loaded "
            "(kv_connector.role consumer must only read)"
        )

    # -- faults ----------------------------------------------------------------------------------

    @pytest.mark.parametrize("how", FAULTS)
    def test_damaged_entry_is_a_load_error(self, make_side, how: str) -> None:
        prompt = self.prompt(3 * self.block_size + 1)
        producer = self.produce(make_side, prompt, [5, 2, 9, 7])
        consumer = make_side("both")
        request = SuiteRequest("damaged", list(prompt), self.block_size)
        num_tokens, _ = consumer.scheduler.get_num_new_matched_tokens(request, 0)
        assert num_tokens == 3 * self.block_size
        target_ids = [3, 8, 1, 11]
        consumer.scheduler.update_state_after_alloc(request, target_ids, num_tokens)
        # The store changes after the scheduler planned the load (another process, eviction, a bad disk).
        consumer.step(
            [request.request_id],
            before_load=lambda _: self.corrupt_entry(consumer.connector, request.block_hashes[1], how),
        )
        errors = consumer.worker.get_block_ids_with_load_errors()
        hint = (
            " (an entry written without the store's key must never load: authenticate entries with "
            "patchbay.interfaces.sign_entry and verify_entry)"
            if how == "forged"
            else ""
        )
        assert 8 in errors, f"the {how} entry of block 8 was not reported as a load error (got {errors}){hint}"
        assert errors <= {3, 8, 1}, f"load errors for blocks that were not loaded: {errors}"
        self.assert_untouched(consumer, [8], f"its entry was {how}")
        self.assert_blocks_equal(producer, [5], consumer, [3])
        for source_id, target_id in ((9, 1),):
            if target_id not in errors:
                self.assert_blocks_equal(producer, [source_id], consumer, [target_id])
            else:
                self.assert_untouched(consumer, [target_id], "reported as a load error")
        stats = getattr(consumer.worker, "stats", None)
        if isinstance(stats, dict):
            assert stats.get("load_errors", 0) >= 1, f"stats do not count the load error: {stats}"

    # -- tensor parallelism --------------------------------------------------------------------------

    def ranks(self, make_side, *, random: bool = False, size: int = 2) -> RankedSides:
        """The ``size`` tensor-parallel ranks of one run, sharing the store."""
        return RankedSides(
            [
                make_side("both", random=random, shard=KVShard(tensor_parallel_rank=rank, tensor_parallel_size=size))
                for rank in range(size)
            ]
        )

    def produce_sharded(self, make_side, prompt: list[int], block_ids: list[int]) -> RankedSides:
        """Two ranks compute and finish one request, each saving its own heads' (different) data."""
        producers = self.ranks(make_side, random=True)
        producers.compute_and_finish(SuiteRequest("produced", prompt, self.block_size), block_ids)
        stats = getattr(producers.sides[0].connector, "stats", None)
        if isinstance(stats, dict) and stats.get("unreachable"):
            pytest.skip(f"the store is unreachable with these options (stats: {stats})")
        return producers

    def test_tensor_parallel_ranks_each_load_their_own_heads(self, make_side) -> None:
        import torch

        prompt = self.prompt(3 * self.block_size + 1)
        producers = self.produce_sharded(make_side, prompt, [5, 2, 9, 7])
        first_layer = next(iter(producers.sides[0].caches))
        assert not torch.equal(
            producers.sides[0].caches[first_layer][:, 5], producers.sides[1].caches[first_layer][:, 5]
        )
        consumers = self.ranks(make_side)
        request = SuiteRequest("consumed", list(prompt), self.block_size)
        num_tokens, _ = consumers.scheduler.get_num_new_matched_tokens(request, 0)
        assert num_tokens == 3 * self.block_size, (
            f"rank 0's scheduler side found {num_tokens} tokens; expected the 3 blocks both ranks saved"
        )
        target_ids = [3, 8, 1, 11]
        consumers.scheduler.update_state_after_alloc(request, target_ids, num_tokens)
        consumers.step([request.request_id])
        others = sorted(set(range(self.num_blocks)) - set(target_ids[:3]))
        for rank, (producer, consumer) in enumerate(zip(producers.sides, consumers.sides, strict=True)):
            errors = consumer.worker.get_block_ids_with_load_errors()
            assert errors == set(), f"rank {rank} reported load errors {errors}"
            try:
                self.assert_blocks_equal(producer, [5, 2, 9], consumer, target_ids[:3])
            except AssertionError as exc:
                raise AssertionError(f"rank {rank} did not load back its own heads' data: {exc}") from None
            self.assert_untouched(consumer, others, "no load was planned for it")

    def test_entries_of_another_sharding_are_never_loaded(self, make_side) -> None:
        prompt = self.prompt(3 * self.block_size + 1)
        self.produce_sharded(make_side, prompt, [5, 2, 9, 7])
        request = SuiteRequest("resharded", list(prompt), self.block_size)
        # The whole model in one process: the store holds two ranks' halves of each block, none of it its own.
        whole = make_side("both")
        assert whole.scheduler.get_num_new_matched_tokens(request, 0)[0] == 0, (
            "a one-process run found blocks that only a tensor-parallel run saved"
        )
        # Rank 0 of 2 plans the load; a worker side of another sharding runs it: it must not load the ranks' data.
        planner = self.ranks(make_side)
        num_tokens, _ = planner.scheduler.get_num_new_matched_tokens(request, 0)
        assert num_tokens == 3 * self.block_size
        target_ids = [3, 8, 1, 11]
        planner.scheduler.update_state_after_alloc(request, target_ids, num_tokens)
        metadata = planner.scheduler.build_connector_meta([request.request_id])
        for shard in (KVShard(), KVShard(tensor_parallel_rank=1, tensor_parallel_size=4)):
            other = make_side("both", shard=shard)
            other.worker.start_load_kv(copy.deepcopy(metadata))
            for layer_name in other.caches:
                other.worker.wait_for_layer_load(layer_name)
            other.worker.wait_for_save()
            errors = other.worker.get_block_ids_with_load_errors()
            assert errors == set(target_ids[:3]), (
                f"a worker side of shard {shard.name or 'whole model'} was sent another sharding's loads: expected "
                f"load errors for blocks {target_ids[:3]}, got {errors}"
            )
            self.assert_untouched(other, range(self.num_blocks), "its entries are another sharding's")

    def test_an_entry_one_rank_lost_is_that_ranks_load_error(self, make_side) -> None:
        prompt = self.prompt(3 * self.block_size + 1)
        producers = self.produce_sharded(make_side, prompt, [5, 2, 9, 7])
        consumers = self.ranks(make_side)
        request = SuiteRequest("half-lost", list(prompt), self.block_size)
        num_tokens, _ = consumers.scheduler.get_num_new_matched_tokens(request, 0)
        assert num_tokens == 3 * self.block_size
        target_ids = [3, 8, 1, 11]
        consumers.scheduler.update_state_after_alloc(request, target_ids, num_tokens)
        # After the plan, rank 1's entry of the second block goes (eviction, another process).
        consumers.step(
            [request.request_id],
            before_load=lambda _: self.corrupt_entry(consumers.sides[1].connector, request.block_hashes[1], "missing"),
        )
        rank0, rank1 = consumers.sides
        assert rank0.worker.get_block_ids_with_load_errors() == set(), "rank 0's entries were all there"
        self.assert_blocks_equal(producers.sides[0], [5, 2, 9], rank0, target_ids[:3])
        errors = rank1.worker.get_block_ids_with_load_errors()
        assert 8 in errors and errors <= {3, 8, 1}, f"rank 1 lost block 8's entry: expected it among {errors}"
        self.assert_untouched(rank1, [8], "rank 1's entry was missing")

    # -- the real engine ---------------------------------------------------------------------------

    def _engine_runs(
        self, available: type[KVConnector], patchbay_registry: Any, roles: set[str], needed: str
    ) -> tuple[Any, list[list[int]]]:
        """Skip unless the engine runs can be made with ``roles``; else a fresh shared-prefix workload and the
        greedy tokens of a run without connector."""
        from patchbay.testing import end_to_end

        if not self.run_end_to_end:
            pytest.skip(f"{type(self).__name__}.run_end_to_end is False")
        if not self.plugin_name:
            skip_not_declared("the engine selects the connector by its registered name; set plugin_name")
        if not roles <= set(available.capabilities.roles):
            skip_not_declared(needed)
        reason = end_to_end.unavailable_reason(patchbay_registry)
        if reason:
            pytest.skip(reason)
        workload = end_to_end.shared_prefix_workload(seed=uuid.uuid4().int % (1 << 30))
        expected, _ = end_to_end.run_greedy(patchbay_registry, workload, {})
        return workload, expected

    def _run_with_connector(
        self, patchbay_registry: Any, workload: Any, expected: list[list[int]], section: dict[str, Any], what: str
    ) -> Any:
        """One engine run with the connector ``section``: its greedy tokens must be ``expected``; the engine."""
        from patchbay.testing import end_to_end

        got, engine = end_to_end.run_greedy(patchbay_registry, workload, {"kv_connector": section})
        stats = getattr(engine.kv_connector, "stats", None)
        if isinstance(stats, dict) and stats.get("unreachable"):
            pytest.skip(f"the store is unreachable with these options (stats: {stats})")
        end_to_end.assert_same_tokens(expected, got, f"{what} run with KV connector {self.plugin_name!r}")
        return engine

    def test_engine_cold_then_warm_runs_keep_greedy_output(
        self, available: type[KVConnector], patchbay_registry, connector_options: dict[str, Any]
    ) -> None:
        """No connector, a cold store, then a warm one (a new engine): the same greedy tokens, and the warm run loads.

        In the first step prompts 1 and 2 hit prompt 0's prefix blocks, which
        are computed in that very step; prompt 3 is shorter than a block, so
        there is nothing to save for it.  A connector that holds a request and
        never reports it done fails the run (``kv_connector.stall_timeout``).
        """
        workload, expected = self._engine_runs(
            available, patchbay_registry, {"both"}, "the cold/warm engine runs need role 'both'"
        )
        section = {"name": self.plugin_name, "options": connector_options, "stall_timeout": ENGINE_STALL_TIMEOUT}
        self._run_with_connector(patchbay_registry, workload, expected, section, "cold")
        warm = self._run_with_connector(patchbay_registry, workload, expected, section, "warm")
        assert warm.scheduler.kv_connector_stats.num_loaded_tokens > 0, (
            "the warm run loaded nothing from the store the cold run filled"
        )

    def test_engine_producer_then_consumer_keep_greedy_output(
        self, available: type[KVConnector], patchbay_registry, connector_options: dict[str, Any]
    ) -> None:
        """A producer run saves, a consumer run (a new engine) loads: both give the greedy tokens of no connector."""
        workload, expected = self._engine_runs(
            available,
            patchbay_registry,
            {"producer", "consumer"},
            "the producer/consumer pair needs roles 'producer' and 'consumer'",
        )
        for role in ("producer", "consumer"):
            section = {
                "name": self.plugin_name,
                "role": role,
                "options": connector_options,
                "stall_timeout": ENGINE_STALL_TIMEOUT,
            }
            engine = self._run_with_connector(patchbay_registry, workload, expected, section, role)
        assert engine.scheduler.kv_connector_stats.num_loaded_tokens > 0, (
            "the consumer loaded nothing from the store the producer filled"
        )
