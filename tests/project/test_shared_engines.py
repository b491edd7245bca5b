"""The session's shared engines (tests/support/shared_engines.py): keyed by resolved settings, checked on return,
LRU."""

from __future__ import annotations

import pytest
import torch

from patchbay.contract.settings import Settings
from shared_engines import SharedEngines, capacity_from_environment, resolve_settings, settings_key


class FakeEngine:
    """What the cache touches of an engine: its settings, liveness, pending work and close()."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.is_dead = False
        self.pending = False
        self.closed = False

    def has_unfinished_requests(self) -> bool:
        assert not self.is_dead, "a dead engine raises here: the cache must ask is_dead first"
        return self.pending

    def close(self) -> None:
        self.closed = True


class FakeLLM:
    def __init__(self, settings: Settings) -> None:
        self.engine = FakeEngine(settings)


def borrow_once(engines: SharedEngines, **overrides) -> FakeLLM:
    with engines.loans("test") as borrow:
        return borrow(**overrides)


def test_settings_from_the_environment_and_from_keywords_share_a_key(monkeypatch):
    monkeypatch.setenv("PATCHBAY_MODEL__DTYPE", "float32")
    assert settings_key(resolve_settings()) == settings_key(resolve_settings(model__dtype="float32"))
    assert settings_key(resolve_settings(scheduler__max_num_seqs=8)) == settings_key(
        resolve_settings(scheduler__max_num_seqs="8")
    )
    assert settings_key(resolve_settings()) != settings_key(resolve_settings(model__dtype="bfloat16"))
    nested = {"name": "ngram", "num_speculative_tokens": 3}
    assert settings_key(resolve_settings(spec_decode=nested)) == settings_key(
        resolve_settings(spec_decode=dict(reversed(nested.items())))
    )


def test_the_same_settings_get_the_same_engine_and_others_a_new_one():
    engines = SharedEngines(capacity=2, build=FakeLLM)
    first = borrow_once(engines, runtime__threads=2)
    assert borrow_once(engines, runtime__threads=2) is first
    assert borrow_once(engines, runtime__threads=1) is not first
    assert (engines.builds, engines.hits) == (2, 1)


def test_a_loan_reseeds_torch_as_a_new_engine_leaves_it():
    engines = SharedEngines(capacity=1, build=FakeLLM)
    borrow_once(engines, runtime__seed=7)
    torch.rand(5)  # a test drew from the generator
    with engines.loans("test") as borrow:
        borrow(runtime__seed=7)
        drawn = torch.rand(3)
    torch.manual_seed(7)
    assert torch.equal(drawn, torch.rand(3))


def test_the_least_recently_returned_idle_engine_is_closed_before_a_build():
    built = []

    def build(settings: Settings) -> FakeLLM:
        # When an engine is built, only capacity - 1 others are left idle: it finds their memory free.
        assert sum(not llm.engine.closed for llm in built) <= 1
        built.append(FakeLLM(settings))
        return built[-1]

    engines = SharedEngines(capacity=2, build=build)
    one, two = borrow_once(engines, runtime__seed=1), borrow_once(engines, runtime__seed=2)
    borrow_once(engines, runtime__seed=1)  # one is now the most recent
    three = borrow_once(engines, runtime__seed=3)
    assert two.engine.closed and not one.engine.closed and not three.engine.closed
    assert borrow_once(engines, runtime__seed=1) is one
    engines.close()
    assert one.engine.closed and three.engine.closed and len(engines) == 0


def test_an_engine_on_loan_is_never_evicted():
    engines = SharedEngines(capacity=1, build=FakeLLM)
    with engines.loans("module fixture") as borrow:
        held = borrow(runtime__seed=1)
        for seed in (2, 3):
            borrow_once(engines, runtime__seed=seed)
        assert not held.engine.closed
        assert borrow_once(engines, runtime__seed=1) is held
    assert not held.engine.closed and len(engines) == 1


@pytest.mark.parametrize(("breaks", "problem"), [("pending", "unfinished requests"), ("is_dead", "is dead")])
def test_an_engine_left_broken_fails_its_borrower_and_is_not_lent_again(breaks, problem):
    engines = SharedEngines(capacity=2, build=FakeLLM)
    with pytest.raises(AssertionError, match=f"tests/test_x.py::test_y broke a shared engine.*{problem}"):
        with engines.loans("tests/test_x.py::test_y") as borrow:
            broken = borrow(runtime__seed=1)
            setattr(broken.engine, breaks, True)
    assert broken.engine.closed
    assert borrow_once(engines, runtime__seed=1) is not broken


def test_capacity_zero_builds_every_loan_anew(monkeypatch):
    monkeypatch.setenv("PYTEST_PATCHBAY_SHARED_ENGINES", "0")
    engines = SharedEngines(capacity_from_environment(), build=FakeLLM)
    first = borrow_once(engines, runtime__seed=1)
    assert first.engine.closed and borrow_once(engines, runtime__seed=1) is not first


@pytest.mark.parametrize("value", ["two", "-1"])
def test_a_bad_capacity_is_refused_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv("PYTEST_PATCHBAY_SHARED_ENGINES", value)
    with pytest.raises(ValueError, match="PYTEST_PATCHBAY_SHARED_ENGINES"):
        capacity_from_environment()
