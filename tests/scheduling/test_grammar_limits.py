"""Grammars as a denial of service (issue 30): a compile bounded by ``structured_output.compile_timeout``
that fails its requests alone and never blocks the next constraints, and a compiled-grammar cache bounded
by an estimate of its size in bytes, not a count."""

from __future__ import annotations

import threading
from typing import Any, ClassVar

import pytest

from patchbay.interfaces import GrammarMatcher, StructuredOutputBackend, StructuredOutputParams
from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.kv_cache_manager import KVCacheManager
from patchbay.scheduling.kv_cache_spec import KVCacheGroup, KVCacheSpec
from patchbay.scheduling.request import Request
from patchbay.scheduling.scheduler import Scheduler
from patchbay.scheduling.scheduler_output import ModelRunnerOutput
from patchbay.scheduling.structured_output import GrammarCompilations, GrammarCompileTimeout


class _Matcher(GrammarMatcher):
    def accept_tokens(self, token_ids: Any) -> int:
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        pass

    def fill_bitmask(self, bitmask: Any, row: int) -> None:
        bitmask[row] = -1

    def is_accepting(self) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False


class HeldBackend(StructuredOutputBackend):
    """Compiles ``held`` only when the test releases it (a grammar that takes "forever"); the rest at once.

    Each grammar's estimated size is the length of its regex times 100 bytes.
    """

    release: ClassVar[threading.Event] = threading.Event()
    compiled: ClassVar[list[str]] = []

    def compile(self, params: StructuredOutputParams) -> Any:
        # The list and event of the test that started this compile: a runaway compile a test abandoned finishes after
        # its teardown released it, and must not land in the next test's list.
        compiled, release = self.compiled, self.release
        if params.spec.startswith("held"):
            assert release.wait(timeout=30), "the test never released the held compile"
        compiled.append(params.spec)
        return params.spec

    def grammar_size_bytes(self, grammar: Any, params: StructuredOutputParams) -> int:
        return 100 * len(params.spec)

    def matcher(self, grammar: Any) -> GrammarMatcher:
        return _Matcher()


@pytest.fixture
def held():
    HeldBackend.release = threading.Event()
    HeldBackend.compiled = []
    yield HeldBackend
    HeldBackend.release.set()


def _compilations(**kwargs: Any) -> GrammarCompilations:
    return GrammarCompilations(lambda: HeldBackend(tokenizer=None, vocab_size=32, stop_token_ids=[0]), "held", **kwargs)


def test_a_compile_past_compile_timeout_fails_alone_and_frees_the_worker(held):
    """Grammars as a denial of service: a long compile fails at the timeout; the one worker compiles the next."""
    grammars = _compilations(compile_timeout=0.2, max_workers=1)
    slow = grammars.submit(StructuredOutputParams(regex="held"))
    with pytest.raises(GrammarCompileTimeout, match=r"structured_output.compile_timeout=0.2 s"):
        slow.result(timeout=20)
    # The runaway compile still runs; the next constraint does not wait for it.
    assert grammars.submit(StructuredOutputParams(regex="quick")).result(timeout=20) == "quick"
    # The same constraint sent again fails at once, without a second runaway compile.
    again = grammars.submit(StructuredOutputParams(regex="held"))
    assert again.done() and isinstance(again.exception(), GrammarCompileTimeout)
    held.release.set()
    assert grammars.submit(StructuredOutputParams(regex="after")).result(timeout=20) == "after"
    assert grammars.stats.num_timed_out == 1 and grammars.stats.num_compiled == 2
    assert "held" not in [key for _, key in grammars._entries], "the late result was dropped, not cached"


def test_runaway_compiles_are_bounded_so_a_flood_cannot_take_every_core(held):
    """Grammars as a denial of service: past ``max_runaway`` abandoned compiles, new ones queue."""
    grammars = _compilations(compile_timeout=0.1, max_workers=1, max_runaway=1)
    first = grammars.submit(StructuredOutputParams(regex="held-1"))
    with pytest.raises(GrammarCompileTimeout):
        first.result(timeout=20)
    second = grammars.submit(StructuredOutputParams(regex="held-2"))
    with pytest.raises(GrammarCompileTimeout):
        second.result(timeout=20)
    queued = grammars.submit(StructuredOutputParams(regex="quick"))
    # One worker plus one runaway thread are allowed; two runaway threads run already, so "quick" queues
    # until one of them ends.
    assert not queued.done()
    held.release.set()
    assert queued.result(timeout=20) == "quick"


def test_the_grammar_cache_is_bounded_by_estimated_bytes_not_a_count(held):
    """Grammars as a denial of service: grammars are evicted by their estimated size, least recent first."""
    grammars = _compilations(cache_bytes=1000)
    for spec in ("aaaa", "bbbb", "cccc"):  # 400 bytes each: the third evicts the first
        grammars.submit(StructuredOutputParams(regex=spec)).result(timeout=20)
    assert grammars.stats.num_evicted == 1 and grammars.stats.cached_bytes == 800
    grammars.submit(StructuredOutputParams(regex="bbbb")).result(timeout=20)  # a hit, now most recent
    assert grammars.stats.num_cache_hits == 1
    grammars.submit(StructuredOutputParams(regex="aaaa")).result(timeout=20)  # compiled again, evicts cccc
    assert HeldBackend.compiled == ["aaaa", "bbbb", "cccc", "aaaa"]
    grammars.submit(StructuredOutputParams(regex="bbbb")).result(timeout=20)
    assert HeldBackend.compiled[-1] == "aaaa", "bbbb stayed cached"
    # One grammar larger than the whole bound serves its request but is not kept.
    big = "x" * 20
    assert grammars.submit(StructuredOutputParams(regex=big)).result(timeout=20) == big
    assert grammars.stats.cached_bytes <= 1000


def test_a_request_whose_compile_times_out_fails_alone_with_the_setting_named(held):
    """Grammars as a denial of service: in the scheduler, the timed-out request fails; the others finish."""
    manager = KVCacheManager(
        [KVCacheGroup(KVCacheSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float32"), ["layer.0"])],
        num_blocks=64,
        enable_prefix_caching=False,
    )
    scheduler = Scheduler(
        manager,
        max_num_seqs=8,
        max_num_batched_tokens=64,
        max_model_len=64,
        block_size=4,
        grammars=_compilations(compile_timeout=0.2),
    )
    add = scheduler.add_request
    add(Request("slow", [1, 2], SamplingParams(max_tokens=2, structured_output={"regex": "held"}), block_size=4))
    add(Request("quick", [1, 2], SamplingParams(max_tokens=2, structured_output={"regex": "ok"}), block_size=4))
    add(Request("free", [1, 2], SamplingParams(max_tokens=2), block_size=4))
    finished = {}
    for _ in range(200):
        output = scheduler.schedule()
        ids = list(output.num_scheduled_tokens)
        updates = scheduler.update_from_output(output, ModelRunnerOutput(ids, [[7] for _ in ids]))
        finished.update({u.request_id: (u.finish_reason, u.stop_reason) for u in updates if u.finish_reason})
        if not scheduler.has_unfinished_requests():
            break
    assert finished["quick"] == ("length", None) and finished["free"] == ("length", None)
    reason, message = finished["slow"]
    assert reason == "error"
    assert message.startswith("structured_output backend 'held' cannot compile structured_output.regex: ")
    assert "structured_output.compile_timeout=0.2 s" in message


def test_a_long_compile_is_its_own_step_phase_with_a_warning_in_the_run_summary(tiny_llama, monkeypatch):
    """Grammars as a denial of service: a 20 s compile showed as "schedule 98 %", with no warning."""
    import patchbay
    from patchbay.entrypoints import run_command
    from patchbay.scheduling import structured_output

    monkeypatch.setattr(structured_output, "SLOW_COMPILE_SECONDS", 0.0)  # every compile counts as long here
    llm = patchbay.LLM(
        model__path=str(tiny_llama),
        attention__name="torch_sdpa",
        runtime__threads=1,
        cache__num_blocks=64,
        model__max_model_len=64,
    )
    (output,) = llm.generate(
        [[5, 6, 7]], patchbay.SamplingParams(max_tokens=2, temperature=0, structured_output={"choice": ["a", "b"]})
    )
    assert output.finish_reason in ("stop", "length")
    timings = llm.engine.step_timings()
    assert list(timings)[:2] == ["schedule", "compile"] and timings["compile"] > 0
    summary = run_command.summarise([output], 1.0, llm.engine)
    assert "compile " in next(line for line in summary.splitlines() if line.startswith("step time:"))
    grammars = next(line for line in summary.splitlines() if line.startswith("grammars:"))
    assert grammars.startswith("grammars:            1 compiled (longest ")
    assert "0 past structured_output.compile_timeout" in grammars
    assert any(line.startswith("warning:") and "grammar compile(s)" in line for line in summary.splitlines())


def test_constraints_that_fail_to_compile_are_not_kept(held):
    """Grammars as a denial of service: distinct failing constraints must not pile up in the cache."""

    class Refusing(HeldBackend):
        def compile(self, params: StructuredOutputParams) -> Any:
            raise ValueError(f"no grammar for {params.spec}")

    grammars = GrammarCompilations(lambda: Refusing(tokenizer=None, vocab_size=32, stop_token_ids=[0]), "refusing")
    for index in range(20):
        with pytest.raises(ValueError, match=f"no grammar for bad-{index}"):
            grammars.submit(StructuredOutputParams(regex=f"bad-{index}")).result(timeout=20)
    assert grammars.stats.num_failed == 20 and len(grammars._entries) == 0
