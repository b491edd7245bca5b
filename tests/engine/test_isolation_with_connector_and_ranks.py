"""A failing request fails alone with a KV connector and with tensor-parallel ranks too (issue 30).

Finding: a step that raised made the engine dead (``EngineDeadError``)
whenever a KV connector or several ranks were configured, instead of
replaying the step request by request as it does otherwise.  Here a sampler
plugin raises for one request in the middle of a run: only that request
fails, every other one ends with the tokens of a fault-free run, the pool
is back to empty, and (connector) what the store kept loads into another
engine and gives the same tokens, so no block was saved that was never
computed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import patchbay
from patchbay.sampling_params import SamplingParams

PROMPTS = [list(range(100, 111)), list(range(200, 209)), list(range(300, 313))]
PARAMS = [
    SamplingParams(max_tokens=10, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=10, ignore_eos=True),
]
BAD_TEMPERATURE = 0.5


def _raising_sampler(engine):
    """The run's sampler, raising whenever a row asks for :data:`BAD_TEMPERATURE` (after drawing the others)."""
    base = type(engine.sampler)

    class FussySampler(base):
        def sample(self, logits, metadata):
            output = super().sample(logits, metadata)
            if (metadata.temperature == BAD_TEMPERATURE).any():
                raise RuntimeError("this sampler cannot take that temperature")
            return output

    return FussySampler(engine.sampler.options)


def _run_with_a_failure(llm: patchbay.LLM, monkeypatch: pytest.MonkeyPatch) -> dict[str, patchbay.RequestOutput]:
    """PROMPTS decoding, then a request the sampler raises for joins them; every request's output by id."""
    engine = llm.engine
    ids = [
        engine.add_request(prompt, params, request_id=f"good-{index}")
        for index, (prompt, params) in enumerate(zip(PROMPTS, PARAMS, strict=True))
    ]
    finished = {}
    for _ in range(3):  # the good ones are decoding (and their prompt blocks saved) when the bad one arrives
        finished.update((o.request_id, o) for o in engine.step())
    fussy = _raising_sampler(engine)
    monkeypatch.setattr(engine, "sampler", fussy)  # the engine names the plugin an exception came from by it
    monkeypatch.setattr(engine.runner, "sampler", fussy)
    engine.add_request([7, 8, 9, 10, 11], SamplingParams(max_tokens=6, temperature=BAD_TEMPERATURE), request_id="bad")
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step())
    monkeypatch.undo()
    assert set(finished) == {*ids, "bad"}
    return finished


def _check(finished: dict[str, patchbay.RequestOutput], clean: list[list[int]], llm: patchbay.LLM) -> None:
    bad = finished["bad"]
    assert bad.finish_reason == "error" and bad.token_ids == []
    assert bad.error == "sampler:standard raised RuntimeError: this sampler cannot take that temperature"
    assert [finished[f"good-{i}"].token_ids for i in range(len(PROMPTS))] == clean
    assert all(finished[f"good-{i}"].finish_reason == "length" for i in range(len(PROMPTS)))
    engine = llm.engine
    assert not engine.is_dead and not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks - 1, "every block came back"
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == clean, "the engine goes on as before"


def test_a_failing_request_fails_alone_with_a_kv_connector(tiny_llama, tmp_path, monkeypatch):
    def llm(store: Path) -> patchbay.LLM:
        return patchbay.LLM(
            model__path=str(tiny_llama),
            attention__name="torch_sdpa",
            runtime__threads=2,
            model__max_model_len=64,
            cache__num_blocks=64,
            cache__block_size=4,
            kv_connector={"name": "shared_storage", "options": {"path": str(store)}},
        )

    clean = [o.token_ids for o in llm(tmp_path / "clean").generate(PROMPTS, PARAMS)]
    faulty = llm(tmp_path / "store")
    _check(_run_with_a_failure(faulty, monkeypatch), clean, faulty)
    assert list((tmp_path / "store").rglob("*.kvb")), "the good requests' blocks were saved"

    reader = llm(tmp_path / "store")
    assert [o.token_ids for o in reader.generate(PROMPTS, PARAMS)] == clean
    assert reader.engine.scheduler.kv_connector_stats.num_loaded_tokens > 0


@pytest.mark.slow
def test_a_failing_request_fails_alone_with_three_tensor_parallel_ranks(tmp_path_factory, monkeypatch):
    from tiny_models import build_tiny_model

    model_dir = build_tiny_model(tmp_path_factory.mktemp("tp3"), "llama-tp3")
    llm = patchbay.LLM(
        model__path=str(model_dir),
        runtime__tensor_parallel_size=3,
        model__max_model_len=64,
        cache__num_blocks=64,
        cache__block_size=4,
    )
    try:
        clean = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
        _check(_run_with_a_failure(llm, monkeypatch), clean, llm)
    finally:
        llm.engine.close()
