"""Engines built once per session and lent to the tests that only read them.

A test that generates and compares its outputs does not need an engine of
its own: ``shared_llm(**overrides)`` (a fixture in conftest.py) lends one
built from the same settings for the whole session.  The key is the
resolved :class:`Settings`, dumped canonically, so ``model__dtype="float32"``
and the suite's ``PATCHBAY_MODEL__DTYPE=float32`` share one engine.

Borrow only to read.  A test builds its own engine when it

- aborts, kills or poisons it (abort, a killed rank, injected plugin failures,
  ``EngineDeadError``), or leaves requests in it;
- changes it or what it was built from: plugins, a registry of its own,
  hooks on the model, monkeypatched build functions (``machine_tuning``,
  ``device_memory`` ...), settings objects edited after the build;
- inspects what earlier requests would disturb: a pool small enough to
  preempt, block counts, ``stats``/``spec_stats``/step timings taken as
  absolute numbers (differences across its own calls are fine);
- samples without a seed and checks the exact tokens (each loan reseeds
  torch like a fresh engine does, but the draws still follow the earlier
  requests of the same test).

What a loan guarantees: the engine is alive with no unfinished request
(checked when the loan ends: a test that breaks this fails, and the engine
is closed rather than lent again), and torch's generator is reseeded with
``runtime.seed`` as a new engine's build leaves it.  What it does not: the
prefix cache remembers earlier prompts (tokens are the same, timings and hit
counts are not) and counters accumulate.

Memory: every idle engine is kept in a least-recently-used list of
``capacity`` (``PYTEST_PATCHBAY_SHARED_ENGINES``, default 1; 0 builds a new
engine for every loan).  One idle engine is what a module fixture already
holds while its module's tests build their own, so the default does not
raise the suite's peak; 2 keeps both SmolLM2 engines the suite shares (about
0.6 GiB more while a third is built).  Before a build the oldest idle engines beyond
``capacity - 1`` are closed and dropped, so the new one is sized (``cache.memory:
auto``) and built with that memory free; an engine on loan is never evicted.
A shared engine's resident memory grows with the tokens of all its loans, not
one test's: a CPU pool is zeroed block by block as first handed out, and freed
blocks queue behind the untouched ones (a SmolLM2 float32 token is ~46 KiB
of KV; ``cache.memory: auto`` reserves up to ~10 GiB, touched on use).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

import torch

import patchbay
from patchbay.contract.registry import registry_for
from patchbay.contract.settings import Settings, load_settings

CAPACITY_VARIABLE = "PYTEST_PATCHBAY_SHARED_ENGINES"
DEFAULT_CAPACITY = 1


def resolve_settings(**overrides: Any) -> Settings:
    """The settings ``patchbay.LLM(**overrides)`` would build from: defaults, the environment, then ``overrides``."""
    assignments = [
        f"{key.replace('__', '.')}={value if isinstance(value, str) else json.dumps(value)}"
        for key, value in overrides.items()
    ]
    return load_settings(None, overrides=assignments, registry=registry_for)


def settings_key(settings: Settings) -> str:
    """A canonical dump of ``settings``: equal for settings that build the same engine, whatever their source."""
    return json.dumps(settings.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))


def capacity_from_environment() -> int:
    """How many idle engines the session keeps (``PYTEST_PATCHBAY_SHARED_ENGINES``)."""
    value = os.environ.get(CAPACITY_VARIABLE, str(DEFAULT_CAPACITY))
    try:
        capacity = int(value)
    except ValueError:
        raise ValueError(f"{CAPACITY_VARIABLE}={value!r}: expected a count of engines (0 turns sharing off)") from None
    if capacity < 0:
        raise ValueError(f"{CAPACITY_VARIABLE}={value!r}: expected a count of engines (0 turns sharing off)")
    return capacity


class SharedEngines:
    """The session's engines by settings: lent out, checked when returned, the idle ones kept LRU."""

    def __init__(self, capacity: int, build: Callable[[Settings], Any] = patchbay.LLM) -> None:
        self.capacity = capacity
        self._build = build
        self._idle: OrderedDict[str, Any] = OrderedDict()
        """Engines no loan holds, least recently returned first."""
        self._lent: dict[str, tuple[Any, int]] = {}
        """Engines on loan: the engine and how many loans hold it."""
        self.builds = 0
        self.hits = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._idle) + len(self._lent)

    @contextlib.contextmanager
    def loans(self, owner: str) -> Iterator[Callable[..., Any]]:
        """``borrow(**overrides)`` lends an engine until the block ends; each is then checked and returned.

        ``owner`` (a test or fixture name) is named in the error when a borrower leaves an engine
        dead or with unfinished requests; that engine is closed, never lent again.
        """
        borrowed: list[str] = []

        def borrow(**overrides: Any) -> Any:
            settings = resolve_settings(**overrides)
            key = settings_key(settings)
            llm = self._lend(key, settings)
            borrowed.append(key)
            return llm

        try:
            yield borrow
        finally:
            evictions = self.evictions
            problems = [problem for key in borrowed if (problem := self._give_back(key)) is not None]
            borrowed.clear()
            if self.evictions > evictions:
                gc.collect()  # a closed engine's reference cycles hold its weights and pool until collected
            if problems:
                raise AssertionError(
                    f"{owner} broke a shared engine (build your own to do that): " + "; ".join(problems)
                )

    def close(self) -> None:
        """Close every idle engine (engines on loan are their borrowers' to finish)."""
        while self._idle:
            self._evict_oldest()
        gc.collect()

    # -- lending --------------------------------------------------------------------------

    def _lend(self, key: str, settings: Settings) -> Any:
        if key in self._lent:
            llm, count = self._lent[key]
            self._lent[key] = (llm, count + 1)
            self.hits += 1
        elif key in self._idle:
            llm = self._idle.pop(key)
            self._lent[key] = (llm, 1)
            self.hits += 1
        else:
            # Make room first: the new engine sizes its pool from the memory it finds free.
            if self._idle and len(self._idle) >= max(self.capacity, 1):
                while self._idle and len(self._idle) >= max(self.capacity, 1):
                    self._evict_oldest()
                gc.collect()
            llm = self._build(settings)
            self.builds += 1
            self._lent[key] = (llm, 1)
        torch.manual_seed(settings.runtime.seed)  # as a fresh engine's build leaves it
        return llm

    def _give_back(self, key: str) -> str | None:
        """Return one loan; what is wrong with the engine, if anything (it is then closed, not kept)."""
        llm, count = self._lent[key]
        if count > 1:
            self._lent[key] = (llm, count - 1)
            return None
        del self._lent[key]
        if llm.engine.is_dead:
            problem: str | None = "it is dead"
        elif llm.engine.has_unfinished_requests():
            problem = "it still has unfinished requests"
        else:
            problem = None
        if problem is not None or self.capacity == 0:
            llm.engine.close()
            self.evictions += 1
            return None if problem is None else f"the engine of {_describe(llm.engine.settings)}: {problem}"
        self._idle[key] = llm
        while len(self._idle) > self.capacity:
            self._evict_oldest()
        return None

    def _evict_oldest(self) -> None:
        """Close the least recently returned idle engine and drop it (the caller collects the garbage)."""
        _, llm = self._idle.popitem(last=False)
        llm.engine.close()
        self.evictions += 1


def _describe(settings: Settings) -> str:
    return f"model {str(settings.model.path)!r} ({settings.model.dtype})"
