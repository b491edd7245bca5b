"""Soak: thousands of short mixed requests (random parameters, some invalid, aborts, preemption, a sampler
that fails for some requests, a KV store with random damage) end with every valid request finished once,
every invalid one refused by name, the block pool empty again and no growth in memory (issue 14).

It prints its figures (requests, rejected, completed, errors, aborts, preemptions, recomputed blocks,
memory) for the record.
"""

from __future__ import annotations

import os
import random
import resource
from collections import Counter

import pytest

import patchbay
from patchbay.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

VOCAB = 49152  # tiny_llama's vocabulary
MAX_MODEL_LEN = 64
FAILING_TEMPERATURE = 0.77
"""Requests at this temperature make the injected sampler raise: they must fail alone."""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _random_request(rng: random.Random, prefixes: list[list[int]]) -> tuple[list[int], dict, bool]:
    """A prompt, raw sampling parameters, and whether the request is valid for this model and run."""
    prompt = [*rng.choice(prefixes), *(rng.randrange(VOCAB) for _ in range(rng.randint(1, 12)))]
    params: dict = {"max_tokens": rng.randint(1, 6)}
    if rng.random() < 0.5:
        params.update(
            temperature=rng.choice([0.7, 1.0, 1.3]),
            seed=rng.randrange(2**32),
            top_k=rng.choice([0, 5]),
            top_p=rng.choice([1.0, 0.9]),
        )
    if rng.random() < 0.1:
        params["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.1:
        params["n"] = 2
    if rng.random() < 0.1:
        params["stop_token_ids"] = [rng.randrange(VOCAB)]
    if rng.random() < 0.03:
        params["temperature"] = FAILING_TEMPERATURE
    invalid = rng.random()
    if invalid < 0.03:
        params["logit_bias"] = {VOCAB + rng.randrange(100): 1.0}
    elif invalid < 0.06:
        prompt = [rng.randrange(VOCAB) for _ in range(MAX_MODEL_LEN + 1)]
    elif invalid < 0.08:
        params["logprobs"] = 21
    elif invalid < 0.10:
        params["allowed_token_ids"] = [VOCAB]
    return prompt, params, invalid >= 0.10


def _failing_sampler(engine):
    base = type(engine.sampler)

    class InjectedFaults(base):
        def sample(self, logits, metadata):
            if (metadata.temperature == FAILING_TEMPERATURE).any():
                raise RuntimeError("injected sampler fault")
            return super().sample(logits, metadata)

    return InjectedFaults(engine.sampler.options)


def _soak(llm, num_requests: int, rng: random.Random, between_batches=None) -> Counter:
    engine = llm.engine
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.choice([8, 16, 24]))] for _ in range(6)]
    counts: Counter = Counter()
    finished: dict[str, object] = {}
    submitted = 0
    rss_after_warmup = None
    while submitted < num_requests:
        batch = []
        for _ in range(min(rng.randint(5, 40), num_requests - submitted)):
            request_id = f"soak-{submitted}"
            submitted += 1
            prompt, raw, valid = _random_request(rng, prefixes)
            try:
                engine.add_request(prompt, SamplingParams(**raw), request_id=request_id)
            except ValueError as exc:
                assert not valid, f"a valid request was refused: {exc}"
                assert f"request {request_id!r}" in str(exc)
                counts["rejected"] += 1
                continue
            assert valid, f"an invalid request was accepted: {raw}"
            batch.append(request_id)
        steps = 0
        while engine.has_unfinished_requests():
            for output in engine.step():
                assert output.request_id not in finished, f"{output.request_id} finished twice"
                finished[output.request_id] = output
                reasons = {c.finish_reason for c in output.completions}
                if "error" in reasons:
                    assert output.sampling_params.temperature == FAILING_TEMPERATURE, output.error
                    assert "InjectedFaults" in output.error or "injected sampler fault" in output.error
                    counts["errors"] += 1
                elif "abort" in reasons:
                    counts["aborted"] += 1
                else:
                    assert reasons <= {"stop", "length"}, reasons
                    counts["completed"] += 1
            steps += 1
            if steps == 2 and batch and rng.random() < 0.5:
                engine.abort(rng.sample(batch, k=min(3, len(batch))))
        assert set(batch) <= set(finished), "a request never finished"
        if between_batches is not None:
            between_batches()
        if rss_after_warmup is None and submitted >= num_requests // 10:
            rss_after_warmup = _rss_bytes()
    engine.step()  # the runner drops the last finished requests at the next step
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks - 1
    assert not engine.scheduler.requests and engine.output_processor.is_empty()
    assert engine.runner.batch.num_reqs == 0
    counts["requests"] = num_requests
    counts["preemptions"] = engine.stats.num_preemptions
    counts["rss_growth_mib"] = (_rss_bytes() - rss_after_warmup) >> 20
    return counts


def test_soak_mixed_requests_with_faults_aborts_and_preemption(tiny_llama):
    llm = patchbay.LLM(
        model__path=str(tiny_llama),
        attention__name="torch_sdpa",
        runtime__threads=2,
        model__max_model_len=MAX_MODEL_LEN,
        cache__num_blocks=48,
        cache__block_size=4,
        scheduler__max_num_seqs=24,
    )
    faulty = _failing_sampler(llm.engine)
    llm.engine.sampler = llm.engine.runner.sampler = faulty
    counts = _soak(llm, 1500, random.Random(14))
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
    print(f"\nsoak (no connector): {dict(counts)}, peak RSS {peak_mib} MiB")
    assert counts["rejected"] > 50 and counts["errors"] > 10 and counts["aborted"] > 10
    assert counts["preemptions"] > 0
    assert counts["rss_growth_mib"] < 64


def test_soak_through_a_kv_store_with_random_damage(tiny_llama, tmp_path):
    store = tmp_path / "store"
    options = {"path": str(store), "auth_key": "soak-test-secret-0123"}
    llm = patchbay.LLM(
        model__path=str(tiny_llama),
        attention__name="torch_sdpa",
        runtime__threads=2,
        model__max_model_len=MAX_MODEL_LEN,
        cache__num_blocks=64,
        cache__block_size=4,
        cache__prefix_caching=False,
        kv_connector={"name": "shared_storage", "options": options},
    )
    # A failing step with a connector fails the request at fault alone (issue 30; it made the engine dead).
    llm.engine.sampler = llm.engine.runner.sampler = _failing_sampler(llm.engine)
    rng = random.Random(41)
    damage = Counter()

    def damage_some_entries():
        llm.engine.runner.kv_connector.flush()
        entries = [entry for entry in sorted(store.rglob("*.kvb")) if entry.stat().st_size < 1 << 20]
        for entry in rng.sample(entries, k=min(4, len(entries))):
            how = rng.choice(["flip", "truncate", "grow", "garbage", "delete"])
            data = bytearray(entry.read_bytes())
            if how == "flip":
                data[rng.randrange(len(data))] ^= 0xFF
                entry.write_bytes(bytes(data))
            elif how == "truncate":
                entry.write_bytes(bytes(data[: rng.randrange(len(data))]))
            elif how == "grow":
                with entry.open("r+b") as file:
                    file.truncate(8 << 30)  # sparse
            elif how == "garbage":
                entry.write_bytes(os.urandom(len(data)))
            else:
                entry.unlink()
            damage[how] += 1

    counts = _soak(llm, 500, rng, between_batches=damage_some_entries)
    kv = llm.engine.scheduler.kv_connector_stats
    counts.update(loaded_tokens=kv.num_loaded_tokens, recomputed_blocks=kv.num_recomputed_blocks)
    print(f"\nsoak (shared_storage, damage {dict(damage)}): {dict(counts)}")
    assert counts["loaded_tokens"] > 0 and counts["recomputed_blocks"] > 0
    assert counts["errors"] > 0
    assert counts["rss_growth_mib"] < 64
