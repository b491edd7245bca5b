"""Tuning that a busy neighbour cannot spoil (issue 55): the noise check, driven by a faked clock.

A fresh clone's `make run` on a busy machine measured one layer's products 7-10x slower than a quiet run,
chose paths that are slow on the quiet machine, and cached them for good. Here a faked clock plays the busy and
the quiet machine (no real timing is asserted): a noisy measurement is used for its run only and never cached,
and a quiet start afterwards measures again and keeps the quiet choice.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable

import pytest
import yaml

from patchbay.toolkit.cpu import CpuInfo
from patchbay.worker.cpu import tuning, tuning_noise
from patchbay.worker.cpu.tuning import LayerShapes
from patchbay.worker.cpu.tuning_noise import NoiseCheck, ThreadWaits, assess

FLOAT32_ONLY = CpuInfo("AMD EPYC 7B13", frozenset({"avx2", "fma"}))  # float32 paths only: the same cases anywhere
SHAPES = LayerShapes(hidden=64, qkv=(64, 16, 16), intermediate=128, layers=2)
QUIET_REFERENCE = 1e-3


class FakeClock:
    """A clock that times nothing: each case takes ``seconds(path, rows)`` times the machine's ``load`` for that
    path, the reference kernel ``QUIET_REFERENCE`` times ``reference_load`` (per call, in order), and the threads
    waited for a core ``cpu_wait`` of the time."""

    def __init__(
        self,
        load: Callable[[str], float] = lambda path: 1.0,
        reference_load: Callable[[int], float] = lambda call: 1.0,
        cpu_wait: float | None = 0.0,
    ) -> None:
        self.load, self.reference_load, self.wait = load, reference_load, cpu_wait
        self.references: list[float] = []
        self.cases: list[str] = []

    def time(self, case: str, run, budget: float) -> float:  # noqa: ANN001
        path, _, rows = case.rpartition("/")
        self.cases.append(case)
        # Quiet: row-split products twice as fast as torch's at every row count, the other paths as torch's.
        quiet = (0.5 if path == "row_split" else 1.0) * (1e-4 + 1e-6 * int(rows))
        return quiet * self.load(path)

    def reference(self) -> float:
        self.references.append(QUIET_REFERENCE * self.reference_load(len(self.references)))
        return self.references[-1]

    def fastest_reference(self, samples: int) -> float:
        return QUIET_REFERENCE * self.reference_load(len(self.references))

    def reference_times(self) -> list[float]:
        return list(self.references)

    def cpu_wait(self) -> float | None:
        return self.wait if self.references else None


def busy_neighbour() -> FakeClock:
    """A neighbour on one of the two cores: products split over both threads wait for the slow one, the
    reference kernel runs 2.5x slower throughout, the threads wait for a core 40 % of the time."""
    return FakeClock(
        load=lambda path: 6.0 if path == "row_split" else 2.5, reference_load=lambda call: 2.5, cpu_wait=0.4
    )


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """An empty cache (a fresh clone), a float32-only CPU, and the clock each start gets (``machine.clock``)."""

    class Machine:
        clock: FakeClock = FakeClock()

        def new_process(self) -> None:
            """What a later start sees: the cache on disk, none of this process's provisional tunings."""
            tuning._PROVISIONAL.clear()

    here = Machine()
    monkeypatch.setenv("PATCHBAY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tuning, "_PROVISIONAL", {})
    monkeypatch.setattr(tuning.CpuInfo, "read", classmethod(lambda cls, cpuinfo=None: FLOAT32_ONLY))
    monkeypatch.setattr(tuning, "WallClock", lambda threads: here.clock)
    return here


def cached_tunings(tmp_path) -> list[dict]:
    folder = tmp_path / "cache" / "tuning"
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json")) if not p.name.startswith("reference-")]


def test_a_quiet_run_agrees_with_itself_and_is_cached(machine, tmp_path):
    chosen = tuning.tune(SHAPES, threads=2)
    assert not chosen.provisional and chosen.noise.reasons == []
    assert chosen.row_split_max_rows == 256  # the quiet machine's choice
    assert chosen.noise.reference_seconds == QUIET_REFERENCE and chosen.noise.rounds == tuning.TUNING_ROUNDS
    # Every case was timed right after a run of the reference kernel.
    assert len(machine.clock.references) == len(machine.clock.cases) > 0
    assert [entry["row_split_max_rows"] for entry in cached_tunings(tmp_path)] == [256]
    assert tuning.tune(SHAPES, threads=2).cached


def test_a_busy_neighbour_makes_the_tuning_provisional_and_nothing_is_cached(machine, tmp_path):
    machine.clock = busy_neighbour()
    chosen = tuning.tune(SHAPES, threads=2)
    assert chosen.row_split_max_rows == 0  # the neighbour's choice: row-split products lose beside it
    assert chosen.provisional and chosen.noise.reasons == ["its threads waited for a core 40% of the time"]
    assert "PROVISIONAL, measured on a busy machine (its threads waited for a core 40% of the time)" in (
        chosen.describe()
    )
    assert cached_tunings(tmp_path) == []
    calls = len(machine.clock.cases)
    assert tuning.tune(SHAPES, threads=2) is chosen and len(machine.clock.cases) == calls  # this run: kept
    machine.new_process()
    machine.clock = FakeClock()
    again = tuning.tune(SHAPES, threads=2)  # the next start measures again, quietly, and caches
    assert (again.provisional, again.row_split_max_rows) == (False, 256)
    assert [entry["row_split_max_rows"] for entry in cached_tunings(tmp_path)] == [256]


def test_a_burst_while_measuring_shows_in_the_reference_kernel_beside_the_cases(machine, tmp_path):
    # The neighbour came and went: a third of the reference runs, in the middle of each round, ran 3x slower.
    machine.clock = FakeClock(reference_load=lambda call: 3.0 if call % 30 in range(10, 20) else 1.0)
    chosen = tuning.tune(SHAPES, threads=2)
    assert chosen.provisional and chosen.noise.reasons == ["the reference kernel's time varied 3.00x while it measured"]
    assert cached_tunings(tmp_path) == []


def test_a_run_slower_than_this_machine_has_been_is_provisional(machine, tmp_path):
    tuning.tune(SHAPES, threads=2)  # quiet: the machine's reference time is on record
    other_model = LayerShapes(hidden=64, qkv=(64, 16, 16), intermediate=256, layers=2)
    # A steady neighbour the threads' waits do not show (memory traffic, a hypervisor's other guests).
    machine.clock = FakeClock(load=lambda path: 2.0, reference_load=lambda call: 2.0, cpu_wait=None)
    chosen = tuning.tune(other_model, threads=2)
    assert chosen.noise.reference_slowdown == pytest.approx(2.0)
    assert chosen.provisional and chosen.noise.reasons == [
        "the reference kernel ran 2.00x slower than this machine's fastest"
    ]
    assert len(cached_tunings(tmp_path)) == 1  # the first model's only


def test_a_cached_tuning_measured_under_load_the_check_missed_is_measured_again_when_quiet(machine, tmp_path):
    # A clean clone beside a steady neighbour that neither the waits nor any record reveal: it is cached ...
    machine.clock = FakeClock(
        load=lambda path: 6.0 if path == "row_split" else 2.5, reference_load=lambda call: 2.5, cpu_wait=None
    )
    loaded = tuning.tune(SHAPES, threads=2)
    assert (loaded.provisional, loaded.row_split_max_rows) == (False, 0)
    assert cached_tunings(tmp_path)[0]["noise"]["reference_seconds"] == pytest.approx(2.5 * QUIET_REFERENCE)
    # ... and the next start, on the quiet machine, finds the reference kernel 2.5x faster than the tuning saw.
    machine.new_process()
    machine.clock = FakeClock()
    quiet = tuning.tune(SHAPES, threads=2)
    assert (quiet.cached, quiet.row_split_max_rows) == (False, 256)
    assert [entry["row_split_max_rows"] for entry in cached_tunings(tmp_path)] == [256]
    machine.new_process()
    assert tuning.tune(SHAPES, threads=2).cached  # as fast as when it measured: kept


def test_patchbay_tune_beside_a_neighbour_keeps_the_quiet_tuning_cached(machine, tmp_path, tiny_llama, capsys):
    from patchbay.entrypoints.cli import main

    assert main(["tune", "--set", f"model.path={tiny_llama}", "--set", "runtime.threads=2"]) == 0
    assert "noise check: 2 rounds" in capsys.readouterr().out
    quiet = cached_tunings(tmp_path)
    machine.clock = busy_neighbour()
    assert main(["tune", "--set", f"model.path={tiny_llama}", "--set", "runtime.threads=2"]) == 0
    out, err = capsys.readouterr()
    assert "measured on a busy machine, so nothing was cached" in err and "PROVISIONAL" in out
    assert "(cached for this CPU" not in out
    assert cached_tunings(tmp_path) == quiet


def test_make_run_beside_a_neighbour_then_a_quiet_run_ends_with_the_quiet_choice(machine, tmp_path, tiny_llama, capsys):
    """The README's first command on a busy machine, then `patchbay run` on the quiet one (issue 55)."""
    from patchbay.entrypoints.cli import main

    (tmp_path / "job.yaml").write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(tiny_llama), "dtype": "auto", "max_model_len": 64},
                "runtime": {"threads": 2},
                "cache": {"num_blocks": 32},
                "inputs": {"prompts": ["hello"], "sampling": {"max_tokens": 2}},
                "outputs": {"path": str(tmp_path / "results.jsonl"), "progress": False},
            }
        )
    )
    tune_then_run = [["tune", "--if-missing", "--set", f"model.path={tiny_llama}"], ["run", str(tmp_path / "job.yaml")]]

    machine.clock = busy_neighbour()  # `make run` on a fresh clone: make's `patchbay tune --if-missing` ...
    assert main(tune_then_run[0]) == 0
    assert "nothing was cached" in capsys.readouterr().err and cached_tunings(tmp_path) == []
    machine.new_process()  # ... then `patchbay run`, still beside the neighbour
    assert main(tune_then_run[1]) == 0
    printed = "".join(capsys.readouterr())
    assert "row-split up to 0 rows" in printed and "PROVISIONAL, measured on a busy machine" in printed
    assert cached_tunings(tmp_path) == []

    machine.new_process()  # later, on the quiet machine
    machine.clock = FakeClock()
    assert main(tune_then_run[1]) == 0
    printed = "".join(capsys.readouterr())
    assert "row-split up to 256 rows" in printed and "PROVISIONAL" not in printed
    assert [entry["row_split_max_rows"] for entry in cached_tunings(tmp_path)] == [256]
    machine.new_process()
    machine.clock = busy_neighbour()  # and a later busy start keeps the quiet choice
    assert main(tune_then_run[1]) == 0
    assert "row-split up to 256 rows" in "".join(capsys.readouterr())


def test_the_checks_limits():
    assert assess(2, 1.05, [1.0] * 10, 0.02, record=0.95).reasons == []
    assert assess(4, 1.3, [], None, None).reasons == ["its last two rounds differ by 1.30x"]
    spread = assess(2, 1.0, [1.0] * 8 + [1.5, 1.5], None, None)
    assert spread.reference_spread == 1.5 and spread.provisional
    assert not assess(2, 1.0, [1.0] * 19 + [5.0], None, None).provisional  # one hiccup in twenty: not the load
    assert assess(2, 1.0, [1.3], None, record=1.0).reasons == [
        "the reference kernel ran 1.30x slower than this machine's fastest"
    ]
    assert not assess(2, 1.0, [1.2], None, record=1.0).provisional
    assert assess(2, 1.0, [], 0.11, None).reasons == ["its threads waited for a core 11% of the time"]
    assert NoiseCheck.from_dict(None) is None
    assert NoiseCheck.from_dict({"reasons": ["x"], "cpu_wait": 0.5}).provisional


def test_thread_waits_add_up_over_the_threads_seen_both_times():
    assert ThreadWaits.waited({"1": 10, "2": 5, "3": 7}, {"1": 1_000_010, "2": 2_000_005, "4": 9}) == 0.003
    waits = ThreadWaits().snapshot()
    if waits is None:
        pytest.skip("this system reports no per-thread schedstat")
    assert str(threading.get_native_id()) in waits and all(value >= 0 for value in waits.values())


def test_the_wall_clock_runs_its_reference_kernel_and_keeps_each_time():
    clock = tuning_noise.WallClock(threads=2)
    first = clock.reference()
    assert clock.reference_times() == [first] and first > 0
    assert clock.fastest_reference(2) > 0 and clock.reference_times() == [first]  # a recheck is not kept
    wait = clock.cpu_wait()
    assert wait is None or wait >= 0
    assert clock.time("x/1", lambda: None, budget=0.0) >= 0
