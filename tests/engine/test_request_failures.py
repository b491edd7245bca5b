"""A bad request fails alone: refused by name when added, or finished with ``error`` when a step raises for it.

Each case here once crashed a run, poisoned every later ``generate`` or
silently produced wrong tokens (issue 14).
"""

from __future__ import annotations

import pytest

import patchbay
from patchbay.engine import EngineDeadError
from patchbay.sampling_params import SamplingParams

MAX_MODEL_LEN = 64
PROMPTS = [[11, 12, 13, 14], [21, 22, 23], [31, 32, 33, 34, 35]]


@pytest.fixture(scope="module")
def llm(tiny_llama) -> patchbay.LLM:
    return patchbay.LLM(
        model__path=str(tiny_llama),
        attention__name="torch_sdpa",
        runtime__threads=2,
        model__max_model_len=MAX_MODEL_LEN,
        cache__num_blocks=64,
        cache__block_size=4,
    )


@pytest.fixture(scope="module")
def clean_tokens(llm) -> list[list[int]]:
    """What PROMPTS generate (greedy, 6 tokens) on a healthy engine."""
    return [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))]


def _assert_healthy(llm, clean_tokens) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.num_blocks - 1
    again = llm.generate(PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in again] == clean_tokens


VOCAB = 49152  # tiny_llama's vocabulary


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"logprobs": VOCAB + 5}, "logprobs=49157 exceeds"),
        ({"logprobs": 21}, r"logprobs=21 exceeds .* 20 \(model.max_logprobs"),
        ({"prompt_logprobs": VOCAB + 1}, "prompt_logprobs=49153 exceeds"),
        ({"logit_bias": {VOCAB + 3: 1.0}}, r"logit_bias has token ids outside the vocabulary \(0..49151\): \[49155\]"),
        ({"allowed_token_ids": [5, VOCAB]}, "allowed_token_ids has token ids outside the vocabulary"),
        ({"bad_words_token_ids": [[3], [VOCAB + 1]]}, r"bad_words_token_ids\[1\] has token ids outside"),
        ({"stop_token_ids": [VOCAB * 2]}, "stop_token_ids has token ids outside"),
    ],
)
def test_a_request_out_of_the_models_range_is_refused_by_name_and_the_engine_goes_on(
    llm, clean_tokens, params, message
):
    with pytest.raises(ValueError, match=rf"request 'bad-one': {message}"):
        llm.generate(
            [PROMPTS[0], PROMPTS[1]], [SamplingParams(), SamplingParams(**params)], request_ids=["good-one", "bad-one"]
        )
    _assert_healthy(llm, clean_tokens)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"logit_bias": {-1: 100.0}}, "greater than or equal to 0"),
        ({"allowed_token_ids": [-3]}, "greater than or equal to 0"),
        ({"logit_bias": {5: float("nan")}}, "finite number"),
        ({"logit_bias": {5: float("inf")}}, "finite number"),
        ({"temperature": 1e-40}, "too small to sample with"),
        ({"temperature": float("inf")}, "finite number"),
        ({"temperature": float("nan")}, "finite number"),
        ({"top_k": 2**70}, "less than or equal to 2147483647"),
        ({"seed": 2**64}, "less than or equal to 9223372036854775807"),
        ({"seed": 2**63 - 1, "n": 2}, "exceeds"),
        ({"stop": [""]}, "stop string must not be empty"),
        ({"stop": ""}, "stop string must not be empty"),
        ({"allowed_token_ids": []}, "at least 1 item"),
        ({"bad_words_token_ids": [[]]}, "at least 1 item"),
        ({"allowed_token_ids": [1.0]}, "must be an integer, got float"),
        ({"allowed_token_ids": [2.7]}, "must be an integer, got float"),
        ({"stop_token_ids": [True]}, "must be an integer, got bool"),
        ({"logit_bias": {1.5: 1.0}}, "must be an integer, got float"),
        ({"seed": True}, "expected an integer, got bool"),
        ({"max_tokens": 3.5}, "expected an integer, got float 3.5"),
    ],
)
def test_a_value_that_would_give_silent_wrong_results_is_refused(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params)


def test_json_logit_bias_keys_are_decimal_strings():
    assert SamplingParams.model_validate({"logit_bias": {"42": -5}}).logit_bias == {42: -5.0}


def test_a_prompt_of_exactly_max_model_len_gets_one_token_and_one_more_is_refused(llm, clean_tokens):
    (output,) = llm.generate([list(range(1, MAX_MODEL_LEN + 1))], SamplingParams(max_tokens=5))
    assert output.finish_reason == "length" and len(output.token_ids) == 1
    with pytest.raises(ValueError, match=f"prompt of {MAX_MODEL_LEN + 1} tokens exceeds model.max_model_len"):
        llm.generate([list(range(1, MAX_MODEL_LEN + 2))])
    _assert_healthy(llm, clean_tokens)


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        ({"messages": "hello"}, "'messages' must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, r"messages\[0\].content must be a string"),
        ({"messages": [["user", "hi"]]}, r"messages\[0\] must be an object"),
        ({"prompt_token_ids": [1, 2.5]}, "prompt token ids must be integers"),
        ({"prompt_token_ids": [1, True]}, "prompt token ids must be integers"),
        ({"prompt": 5}, "'prompt' must be a string"),
    ],
)
def test_a_malformed_prompt_is_refused_naming_the_request(llm, clean_tokens, prompt, message):
    with pytest.raises(ValueError, match=rf"request 'x': {message}"):
        llm.generate([PROMPTS[0], prompt], request_ids=["ok", "x"])
    _assert_healthy(llm, clean_tokens)


def _raising_sampler(llm, bad_temperature: float):
    """A sampler plugin (a subclass of the run's) that raises whenever a row has ``bad_temperature``."""
    base = type(llm.engine.sampler)

    class FussySampler(base):
        def sample(self, logits, metadata):
            if (metadata.temperature == bad_temperature).any():
                raise RuntimeError("this sampler cannot take that temperature")
            return super().sample(logits, metadata)

    return FussySampler(llm.engine.sampler.options)


def test_a_plugin_raising_for_one_request_fails_that_request_alone(llm, clean_tokens, monkeypatch, caplog):
    fussy = _raising_sampler(llm, 0.5)
    monkeypatch.setattr(llm.engine, "sampler", fussy)
    monkeypatch.setattr(llm.engine.runner, "sampler", fussy)
    params = [
        SamplingParams(max_tokens=6, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.5),
        SamplingParams(max_tokens=6, ignore_eos=True),
    ]
    outputs = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], params, request_ids=["a", "bad", "c"])
    by_id = {o.request_id: o for o in outputs}
    assert by_id["bad"].finish_reason == "error" and by_id["bad"].token_ids == []
    assert by_id["bad"].error == "sampler:standard raised RuntimeError: this sampler cannot take that temperature"
    assert by_id["bad"].as_dict()["error"] == by_id["bad"].as_dict()["stop_reason"] == by_id["bad"].error
    assert by_id["a"].token_ids == clean_tokens[0] and by_id["c"].token_ids == clean_tokens[1]
    assert "request 'bad' failed" in caplog.text
    monkeypatch.undo()
    _assert_healthy(llm, clean_tokens)


def test_a_plugin_raising_mid_generation_keeps_the_tokens_of_the_others(llm, clean_tokens, monkeypatch):
    engine = llm.engine
    fussy = _raising_sampler(llm, 0.75)
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True), request_id="steady")
    engine.step()  # "steady" is decoding when the bad one arrives
    monkeypatch.setattr(engine.runner, "sampler", fussy)
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=6, temperature=0.75, n=2), request_id="late")
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step())
    assert finished["steady"].token_ids == clean_tokens[0] and finished["steady"].finish_reason == "length"
    assert [c.finish_reason for c in finished["late"].completions] == ["error", "error"]
    monkeypatch.undo()
    _assert_healthy(llm, clean_tokens)


def test_generate_leaves_no_request_behind_when_a_callback_raises(llm, clean_tokens):
    def explode(output):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        llm.generate(
            PROMPTS, SamplingParams(max_tokens=6, ignore_eos=True), request_ids=["p", "q", "r"], on_finished=explode
        )
    _assert_healthy(llm, clean_tokens)
    # The ids are free again.
    assert [o.request_id for o in llm.generate(PROMPTS[:1], request_ids=["p"])] == ["p"]


def test_an_error_in_shared_state_makes_the_engine_dead_for_every_later_call(tiny_llama, monkeypatch):
    llm = patchbay.LLM(
        model__path=str(tiny_llama),
        attention__name="torch_sdpa",
        runtime__threads=2,
        model__max_model_len=MAX_MODEL_LEN,
        cache__num_blocks=32,
    )

    def broken_schedule():
        raise RuntimeError("scheduler state is inconsistent")

    monkeypatch.setattr(llm.engine.scheduler, "schedule", broken_schedule)
    with pytest.raises(EngineDeadError, match="scheduler state is inconsistent"):
        llm.generate(PROMPTS)
    monkeypatch.undo()
    for call in (
        lambda: llm.generate(PROMPTS),
        llm.engine.step,
        llm.engine.has_unfinished_requests,
        lambda: llm.engine.add_request([1, 2], SamplingParams()),
    ):
        with pytest.raises(EngineDeadError, match="create a new engine"):
            call()
