"""Structured output without a model: the constraint field, settings, the conformance suites of both
built-in backends, the bitmask arithmetic, the scheduler's wait for grammars and the runner's matchers."""

from __future__ import annotations

import pickle
import threading
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from patchbay.contract.registry import default_registry
from patchbay.contract.settings import ConfigError, Settings, load_settings
from patchbay.entrypoints.run_command import read_requests
from patchbay.interfaces import GrammarMatcher, StructuredOutputBackend, StructuredOutputParams
from patchbay.sampling_params import SamplingParams
from patchbay.scheduling.kv_cache_manager import KVCacheManager
from patchbay.scheduling.kv_cache_spec import KVCacheGroup, KVCacheSpec
from patchbay.scheduling.request import Request, RequestStatus
from patchbay.scheduling.scheduler import Scheduler
from patchbay.scheduling.scheduler_output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from patchbay.scheduling.structured_output import GrammarCompilations
from patchbay.testing import StructuredOutputSuite
from patchbay.testing.structured_output import allowed_tokens, bundled_tokenizer
from patchbay.worker.structured_output import ConstrainedDecoding, apply_request_bitmasks, apply_token_bitmask
from repo_paths import REPO_ROOT


class TestXGrammarConformance(StructuredOutputSuite):
    plugin_name = "xgrammar"


class TestLLGuidanceConformance(StructuredOutputSuite):
    plugin_name = "llguidance"


# -- the constraint field -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("constraint", "location", "words"),
    [
        ({}, ("structured_output",), "exactly one"),
        ({"regex": "a", "choice": ["a"]}, ("structured_output",), "found: regex, choice"),
        ({"regex": ""}, ("structured_output", "regex"), "at least 1"),
        ({"choice": []}, ("structured_output", "choice"), "at least 1"),
        ({"choice": ["a", ""]}, ("structured_output", "choice"), "non-empty"),
        ({"json_schema": "{not json"}, ("structured_output", "json_schema"), "not valid JSON"),
        ({"json_schema": "[1, 2]"}, ("structured_output", "json_schema"), "is an object"),
        ({"json_object": False}, ("structured_output",), "only true"),
        ({"grammar": "root ::= x", "unknown": 1}, ("structured_output", "unknown"), "Extra inputs"),
    ],
)
def test_a_bad_constraint_is_refused_naming_the_field(constraint, location, words):
    with pytest.raises(ValidationError) as raised:
        SamplingParams(structured_output=constraint)
    (error,) = raised.value.errors()
    assert error["loc"] == location
    assert words in error["msg"]


def test_constraints_have_a_kind_a_cache_key_and_a_field_path():
    by_text = StructuredOutputParams(json_schema='{"type": "object", "required": ["a"]}')
    by_dict = StructuredOutputParams(json_schema={"required": ["a"], "type": "object"})
    assert by_text.key == by_dict.key == ("json_schema", '{"required":["a"],"type":"object"}')
    assert StructuredOutputParams(choice=["x", "y"]).key == ("choice", '["x","y"]')
    assert StructuredOutputParams(json_object=True).field_path == "structured_output.json_object"
    assert SamplingParams(structured_output={"regex": "a+"}).structured_output.kind == "regex"


def test_structured_output_is_not_a_sampler_parameter_and_excludes_ignore_eos():
    params = SamplingParams(structured_output={"regex": "a+"})
    assert "structured_output" not in params.params_used()
    with pytest.raises(ValidationError, match="ignore_eos"):
        SamplingParams(structured_output={"regex": "a+"}, ignore_eos=True)


def test_jsonl_requests_carry_their_own_constraint(tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"prompt": "a", "structured_output": {"choice": ["yes", "no"]}}\n{"prompt": "b"}\n')
    settings = Settings.model_validate({"inputs": {"file": str(requests), "sampling": {"max_tokens": 4}}})
    (_, _, first), (_, _, second) = read_requests(settings, None)
    assert first.structured_output == StructuredOutputParams(choice=["yes", "no"])
    assert second.structured_output is None
    requests.write_text('{"prompt": "a", "structured_output": {"regex": "a", "choice": ["b"]}}\n')
    with pytest.raises(ConfigError) as raised:
        read_requests(settings, None)
    assert "requests.jsonl" in str(raised.value) and "structured_output" in str(raised.value)


# -- settings -------------------------------------------------------------------------------------------


def test_settings_choose_the_backend_and_validate_its_options(tmp_path):
    assert Settings().structured_output.name == "xgrammar"
    config = tmp_path / "run.yaml"
    config.write_text("structured_output: {name: llguidance, options: {any_whitespace: false}}\n")
    assert load_settings(config, registry=default_registry()).structured_output.options == {"any_whitespace": False}
    config.write_text("structured_output: {name: xgrammar, options: {no_such_option: 1}}\n")
    with pytest.raises(ConfigError) as raised:
        load_settings(config, registry=default_registry())
    assert "structured_output.options.no_such_option" in str(raised.value)
    assert "structured_output:xgrammar" in str(raised.value)
    config.write_text("structured_output: {name: outlines}\n")
    with pytest.raises(ConfigError, match="structured_output.name.*outlines.*available: llguidance, xgrammar"):
        load_settings(config, registry=default_registry())


# -- the bitmask ---------------------------------------------------------------------------------------


def test_apply_token_bitmask_masks_exactly_the_clear_bits_of_the_chosen_rows():
    rng = np.random.default_rng(0)
    vocab_size = 70  # not a multiple of 32: the last word is partly past the vocabulary
    bitmask = rng.integers(-(2**31), 2**31, size=(4, 3), dtype=np.int64).astype(np.int32)
    logits = torch.randn(4, vocab_size)
    masked = logits.clone()
    apply_token_bitmask(masked, bitmask, [0, 2])
    for row in range(4):
        for token in range(vocab_size):
            allowed = bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)
            expected = logits[row, token] if allowed or row in (1, 3) else float("-inf")
            assert masked[row, token] == expected, (row, token)


# -- the scheduler waits for grammars --------------------------------------------------------------------


class _GatedMatcher(GrammarMatcher):
    def accept_tokens(self, token_ids: Sequence[int]) -> int:
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        pass

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        bitmask[row] = -1

    def is_accepting(self) -> bool:
        return True

    def is_terminated(self) -> bool:
        return False


class GatedBackend(StructuredOutputBackend):
    """A backend whose compilations finish when the test opens their gate; the regex ``bad`` fails."""

    gates: ClassVar[dict[str, threading.Event]] = {}

    def compile(self, params: StructuredOutputParams) -> Any:
        self.gates.setdefault(params.spec, threading.Event()).wait(timeout=10)
        if params.spec == "bad":
            raise ValueError("no grammar for you")
        return params.spec

    def matcher(self, grammar: Any) -> GrammarMatcher:
        return _GatedMatcher()


def _scheduler(grammars: GrammarCompilations | None) -> Scheduler:
    manager = KVCacheManager(
        [KVCacheGroup(KVCacheSpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float32"), ["layer.0"])],
        num_blocks=64,
        enable_prefix_caching=False,
    )
    return Scheduler(
        manager, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, block_size=4, grammars=grammars
    )


def _step(scheduler: Scheduler, token: int = 7):
    output = scheduler.schedule()
    ids = list(output.num_scheduled_tokens)
    return output, scheduler.update_from_output(output, ModelRunnerOutput(ids, [[token] for _ in ids]))


def test_a_constrained_request_waits_for_its_grammar_while_others_run():
    GatedBackend.gates.clear()
    grammars = GrammarCompilations(lambda: GatedBackend(tokenizer=None, vocab_size=32, stop_token_ids=[0]), "gated")
    scheduler = _scheduler(grammars)
    params = SamplingParams(max_tokens=2, structured_output={"regex": "slow"})
    scheduler.add_request(Request("constrained", [1, 2, 3], params, block_size=4))
    scheduler.add_request(Request("free", [1, 2, 3], SamplingParams(max_tokens=2), block_size=4))
    assert scheduler.requests["constrained"].status == RequestStatus.WAITING_FOR_GRAMMAR
    output, _ = _step(scheduler)
    assert list(output.num_scheduled_tokens) == ["free"]
    GatedBackend.gates["slow"].set()
    scheduler.requests["constrained"].grammar_future.result(timeout=10)
    output, _ = _step(scheduler)
    assert set(output.num_scheduled_tokens) == {"free", "constrained"}
    (new,) = output.scheduled_new_reqs
    assert new.req_id == "constrained" and new.grammar == "slow"


def test_a_constraint_that_cannot_compile_fails_that_request_alone():
    GatedBackend.gates.clear()
    GatedBackend.gates["bad"] = threading.Event()
    GatedBackend.gates["bad"].set()
    grammars = GrammarCompilations(lambda: GatedBackend(tokenizer=None, vocab_size=32, stop_token_ids=[0]), "gated")
    scheduler = _scheduler(grammars)
    scheduler.add_request(Request("bad", [1, 2], SamplingParams(structured_output={"regex": "bad"}), block_size=4))
    scheduler.add_request(Request("free", [1, 2], SamplingParams(max_tokens=3), block_size=4))
    finished = {}
    for _ in range(10):
        _, updates = _step(scheduler)
        finished.update({u.request_id: (u.finish_reason, u.stop_reason) for u in updates if u.finish_reason})
        if not scheduler.has_unfinished_requests():
            break
    reason, message = finished["bad"]
    assert reason == "error"
    assert message == ("structured_output backend 'gated' cannot compile structured_output.regex: no grammar for you")
    assert finished["free"] == ("length", None)


def test_requests_with_one_constraint_share_one_compilation():
    GatedBackend.gates.clear()
    GatedBackend.gates["same"] = threading.Event()
    GatedBackend.gates["same"].set()
    grammars = GrammarCompilations(lambda: GatedBackend(tokenizer=None, vocab_size=32, stop_token_ids=[0]), "gated")
    first = grammars.submit(StructuredOutputParams(regex="same"))
    assert grammars.submit(StructuredOutputParams(regex="same")) is first
    first.result(timeout=10)
    assert grammars.stats.num_compiled == 1 and grammars.stats.num_cache_hits == 1


def test_a_scheduler_without_grammars_refuses_constrained_requests():
    with pytest.raises(ValueError, match="'r' sets structured_output"):
        _scheduler(None).add_request(Request("r", [1], SamplingParams(structured_output={"regex": "a"}), block_size=4))


# -- the runner's matchers ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def xgrammar_compilations() -> GrammarCompilations:
    tokenizer = bundled_tokenizer()
    backend_class = default_registry().resolve("structured_output", "xgrammar")
    return GrammarCompilations(
        lambda: backend_class(tokenizer=tokenizer, vocab_size=len(tokenizer), stop_token_ids=[tokenizer.eos_token_id]),
        "xgrammar",
    )


def _allowed_rows(logits: torch.Tensor) -> list[set[int]]:
    return [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in logits]


def test_draft_rows_are_masked_in_turn_and_the_matcher_rolled_back(xgrammar_compilations):
    grammars = xgrammar_compilations
    encode = bundled_tokenizer().encode
    params = StructuredOutputParams(regex="[0-9]{3}-[a-z]{2}")
    grammar = grammars.submit(params).result(timeout=30)
    constrained = ConstrainedDecoding(grammars)
    one, two, dash, x = (encode(text)[0] for text in ("1", "2", "-", "x"))
    constrained.add("digits", grammar, [one], params.field_path)
    vocab_size = grammars.backend.vocab_size
    # Rows: "digits" drafts [2, x, 2] (x is refused) + bonus, then an unconstrained request's row.
    logits = torch.zeros(5 + 1, vocab_size)
    constrained.mask(logits, ["digits", "free"], [[two, x, two], []], np.array([0, 5]))
    fresh = grammars.backend.matcher(grammar)
    fresh.accept_tokens([one])
    expected = []
    for token in (two, x):
        bitmask = np.zeros((1, grammars.backend.bitmask_width), dtype=np.int32)
        fresh.fill_bitmask(bitmask, 0)
        expected.append(set(allowed_tokens(bitmask, 0, vocab_size).tolist()))
        fresh.accept_tokens([token])
    rows = _allowed_rows(logits)
    assert rows[0] == expected[0] and rows[1] == expected[1]
    assert x not in rows[1] and dash not in rows[0]
    assert rows[2] == rows[3] == rows[5] == set(range(vocab_size)), "rows after a refused draft, and free rows, stay"
    # The drafts were rolled back: the matcher still stands after "1", and accepts the real tokens.
    constrained.advance(["digits", "free"], [[two, two], [x]])
    assert constrained.take_failed() == {}
    constrained.advance(["digits"], [[x]])
    (message,) = constrained.take_failed().values()
    assert message.startswith("structured_output backend 'xgrammar' (structured_output.regex) rejected token")
    assert "digits" not in constrained.matchers


def test_rows_filled_for_the_other_ranks_mask_as_the_runner_s_own_rows_do(xgrammar_compilations):
    """Over several ranks rank 0 fills rows per request before the step; applied, they equal one process's mask."""
    grammars = xgrammar_compilations
    encode = bundled_tokenizer().encode
    params = StructuredOutputParams(regex="[0-9]{3}-[a-z]{2}")
    grammar = grammars.submit(params).result(timeout=30)
    one, two, x = (encode(text)[0] for text in ("1", "2", "x"))
    in_step, ahead = ConstrainedDecoding(grammars), ConstrainedDecoding(grammars)
    for constrained in (in_step, ahead):
        constrained.add("digits", grammar, [one], params.field_path)
        constrained.add("fresh", grammar, [], params.field_path)
    vocab_size = grammars.backend.vocab_size
    # Rows: "free" (unconstrained), then "digits" with drafts [2, x, 2] (x is refused) + bonus, then "fresh".
    req_ids, drafts, first_rows = ["free", "digits", "fresh"], [[], [two, x, two], []], np.array([0, 1, 5])
    expected = torch.randn(6, vocab_size)
    shipped = expected.clone()
    in_step.mask(expected, req_ids, drafts, first_rows)
    filled = ahead.fill_step(req_ids, {"digits": [two, x, two]})
    assert sorted(filled) == ["digits", "fresh"]
    assert filled["digits"].shape == (2, grammars.backend.bitmask_width), "no rows after the refused draft"
    apply_request_bitmasks(shipped, filled, req_ids, first_rows)
    assert torch.equal(shipped, expected)
    # Filling rolled the drafts back, as masking does: both accept the same real tokens.
    for constrained in (in_step, ahead):
        constrained.advance(["digits"], [[two, two]])
        assert constrained.take_failed() == {}


def test_the_step_the_other_ranks_get_carries_no_grammar_and_leaves_rank_0_s_intact():
    unpicklable = threading.Lock()  # as a backend's compiled grammar may be
    constrained = NewRequestData(
        "c", [1, 2], [], SamplingParams(structured_output={"regex": "a"}), ([1],), 0, grammar=unpicklable
    )
    free = NewRequestData("f", [3], [], SamplingParams(), ([2],), 0)
    step = SchedulerOutput(
        [constrained, free],
        CachedRequestData(),
        {"c": 2, "f": 1},
        3,
        grammar_bitmasks={"c": np.ones((1, 2), dtype=np.int32)},
    )
    sent = pickle.loads(pickle.dumps(step.without_grammars()))
    assert [request.grammar for request in sent.scheduled_new_reqs] == [None, None]
    assert sent.scheduled_new_reqs[1] == free and sent.num_scheduled_tokens == step.num_scheduled_tokens
    assert np.array_equal(sent.grammar_bitmasks["c"], step.grammar_bitmasks["c"])
    assert step.scheduled_new_reqs[0].grammar is unpicklable, "rank 0's own step keeps its grammars"
    plain = SchedulerOutput([free], CachedRequestData(), {"f": 1}, 1)
    assert plain.without_grammars() is plain, "no copy when no request has a grammar"


def test_a_resumed_request_gets_a_rebuilt_matcher(xgrammar_compilations):
    grammars = xgrammar_compilations
    encode = bundled_tokenizer().encode
    params = StructuredOutputParams(choice=["alpha", "beta"])
    grammar = grammars.submit(params).result(timeout=30)
    constrained = ConstrainedDecoding(grammars)
    generated = encode("al")
    constrained.add("r", grammar, generated, params.field_path)
    first = torch.zeros(1, grammars.backend.vocab_size)
    constrained.mask(first, ["r"], [], np.array([0]))
    constrained.remove("r")  # preempted
    constrained.add("r", grammar, generated, params.field_path)  # back as new, with its outputs
    again = torch.zeros(1, grammars.backend.vocab_size)
    constrained.mask(again, ["r"], [], np.array([0]))
    assert torch.equal(first, again)
    assert encode("pha")[0] in _allowed_rows(again)[0]
    constrained.add("wrong", grammar, encode("gamma"), params.field_path)
    assert "rebuilding its matcher" in constrained.take_failed()["wrong"]


def test_a_request_the_runner_reports_failed_finishes_as_error_and_the_rest_go_on():
    scheduler = _scheduler(
        GrammarCompilations(lambda: GatedBackend(tokenizer=None, vocab_size=32, stop_token_ids=[0]), "gated")
    )
    for request_id in ("broken", "fine"):
        scheduler.add_request(Request(request_id, [1, 2], SamplingParams(max_tokens=3), block_size=4))
    output = scheduler.schedule()
    runner_output = ModelRunnerOutput(["broken", "fine"], [[5], [5]], failed={"broken": "backend says no"})
    updates = {u.request_id: u for u in scheduler.update_from_output(output, runner_output)}
    assert (updates["broken"].finish_reason, updates["broken"].stop_reason) == ("error", "backend says no")
    assert updates["broken"].new_token_ids == [] and updates["fine"].new_token_ids == [5]
    assert list(scheduler.requests) == ["fine"]
    assert "broken" in scheduler.schedule().finished_req_ids


def test_the_example_job_validates():

    example = REPO_ROOT / "examples" / "structured_output.yaml"
    settings = load_settings(example, registry=default_registry())
    kinds = [params.structured_output.kind for _, _, params in read_requests(settings, str(example))]
    assert kinds == ["json_schema", "regex", "choice", "grammar"]
