"""Structured output on the bundled SmolLM2: every constrained output parses and validates.

One batch mixes JSON schemas (nested objects, arrays, enums, bounded numbers,
strings with patterns), regexes and choices, each greedy and seeded, with
unconstrained requests, a request cut off by ``max_tokens`` and one whose
constraint cannot compile.  It runs on three engines: chunked prefill
(xgrammar), ngram speculative decoding with forced preemption (xgrammar), and
llguidance.  Outputs are judged by ``json`` + ``jsonschema``, ``re`` and
membership, never by the backend that produced them.  The engines run in
float32, where greedy outputs do not depend on the batch around them, so
exact comparisons between runs hold.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

import patchbay
from patchbay.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,9}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "height", "pets"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "item": {"enum": ["tea", "coffee", "juice"]},
        "size": {
            "type": "object",
            "properties": {"ml": {"type": "integer", "minimum": 100, "maximum": 999}, "iced": {"type": "boolean"}},
            "required": ["ml", "iced"],
            "additionalProperties": False,
        },
        "price": {"type": "integer", "minimum": 1, "maximum": 20},
    },
    "required": ["item", "size", "price"],
    "additionalProperties": False,
}
CONSTRAINTS = [
    ("Describe a person as JSON.", {"json_schema": PERSON}),
    ("Order a drink, as JSON.", {"json_schema": ORDER}),
    ('Reply with exactly this JSON: {"ok": true}', {"json_object": True}),
    ("What is the phone number of the bakery?", {"regex": r"\(\d{3}\) \d{3}-\d{4}"}),
    ("When did the war end? Give a date.", {"regex": r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"}),
    ("Name two colours.", {"regex": r"(red|green|blue)( and (red|green|blue))?"}),
    ("Is the sky green?", {"choice": ["yes", "no"]}),
    ("Which city is the capital of France?", {"choice": ["Paris", "London", "Berlin", "Madrid"]}),
]
UNCONSTRAINED = ["Write a haiku about rain.", "List three fruits."]
MAX_TOKENS = 120


def _message(text: str) -> dict:
    return {"messages": [{"role": "user", "content": text}]}


def _is_valid(text: str, constraint: dict) -> bool:
    if "json_schema" in constraint or "json_object" in constraint:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        schema = constraint.get("json_schema", {"type": "object"})
        return jsonschema.Draft202012Validator(schema).is_valid(value)
    if "regex" in constraint:
        return re.fullmatch(constraint["regex"], text) is not None
    return text in constraint["choice"]


def _batch() -> tuple[list[dict], list[SamplingParams]]:
    """Every constraint greedy and seeded, the unconstrained requests, one cut short, one that cannot compile."""
    prompts, params = [], []
    for index, (text, constraint) in enumerate(CONSTRAINTS):
        prompts += [_message(text), _message(text)]
        params += [
            SamplingParams(max_tokens=MAX_TOKENS, structured_output=constraint),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, seed=100 + index, structured_output=constraint),
        ]
    for text in UNCONSTRAINED:
        prompts.append(_message(text))
        params.append(SamplingParams(max_tokens=12))
    prompts.append(_message(CONSTRAINTS[0][0]))
    params.append(SamplingParams(max_tokens=6, structured_output=CONSTRAINTS[0][1]))
    prompts.append(_message("Anything."))
    params.append(SamplingParams(max_tokens=8, structured_output={"regex": "(("}))
    return prompts, params


def _check_batch(outputs, params, *, seeded_cut_at: int | None = None) -> None:
    """Every constrained output stops and validates.

    ``seeded_cut_at`` (a ``max_model_len``): a seeded request may instead be
    cut at its token limit or that length (its draw decides how long it goes on).
    """
    constrained = [
        (o, p)
        for o, p in zip(outputs, params, strict=True)
        if p.structured_output is not None and p.max_tokens == MAX_TOKENS
    ]
    assert len(constrained) == 2 * len(CONSTRAINTS)
    for output, param in constrained:
        constraint = param.structured_output.model_dump(exclude_none=True)
        if seeded_cut_at and param.seed is not None and output.finish_reason == "length":
            length = len(output.prompt_token_ids) + len(output.token_ids)
            assert len(output.token_ids) == MAX_TOKENS or length == seeded_cut_at, (output.text, constraint)
            continue
        assert output.finish_reason == "stop", (output.text, constraint)
        assert _is_valid(output.text, constraint), f"{output.text!r} does not satisfy {constraint}"
    cut, failed = outputs[-2], outputs[-1]
    assert cut.finish_reason == "length" and len(cut.token_ids) == 6
    assert not _is_valid(cut.text, CONSTRAINTS[0][1])
    assert outputs[0].token_ids[:6] == cut.token_ids, "the cut request is the greedy one's prefix"
    assert failed.finish_reason == "error" and failed.token_ids == []
    assert failed.stop_reason.startswith("structured_output backend ")
    assert "cannot compile structured_output.regex" in failed.stop_reason


@pytest.fixture(scope="module")
def chunked(shared_engines, request):
    """xgrammar with a small step budget: the batch's prompts are prefilled in chunks.

    Also the seconds the batch's steps spent on grammars (the engine is shared: earlier loans' time counts too).
    """
    with shared_engines.loans(request.node.nodeid) as borrow:
        llm = borrow(runtime__threads=2, model__dtype="float32", scheduler__max_num_batched_tokens=64)
        prompts, params = _batch()
        structure_before = llm.engine.step_timings().get("structure", 0.0)
        outputs = llm.generate(prompts, params)
        yield llm, outputs, params, llm.engine.step_timings()["structure"] - structure_before


def test_every_constrained_output_validates_under_chunked_prefill(chunked):
    _, outputs, params, structure_seconds = chunked
    _check_batch(outputs, params)
    assert structure_seconds > 0


def test_unconstrained_requests_are_untouched_by_constrained_neighbours(chunked):
    llm, outputs, params, _ = chunked
    first = 2 * len(CONSTRAINTS)
    alone = llm.generate([_message(text) for text in UNCONSTRAINED], SamplingParams(max_tokens=12))
    assert [o.token_ids for o in alone] == [o.token_ids for o in outputs[first : first + len(UNCONSTRAINED)]]


def test_a_seeded_constrained_request_is_reproducible_alone(chunked):
    llm, outputs, params, _ = chunked
    index = 2 * 5 + 1  # the seeded "colours" regex
    (alone,) = llm.generate([_message(CONSTRAINTS[5][0])], [params[index]])
    assert alone.token_ids == outputs[index].token_ids


def test_speculative_decoding_with_preemption_keeps_outputs_exact(chunked):
    """ngram drafts are masked position by position; greedy outputs equal the non-speculative run's."""
    _, reference, _, _ = chunked
    max_model_len = 160
    llm = patchbay.LLM(
        runtime__threads=2,
        model__dtype="float32",
        model__max_model_len=max_model_len,
        cache__num_blocks=20,
        spec_decode__name="ngram",
        spec_decode__num_speculative_tokens=3,
    )
    prompts, params = _batch()
    outputs = llm.generate(prompts, params)
    # Seeded requests: which drafts a step verified decides which numbers the rejection sampler drew, and that
    # depends on the pool, so their samples differ from the other runs' and need not close within the limit.
    _check_batch(outputs, params, seeded_cut_at=max_model_len)
    assert llm.engine.stats.num_preemptions > 0, "the KV pool was meant to force preemptions"
    assert llm.spec_stats.num_draft_tokens > 0
    greedy = range(0, 2 * len(CONSTRAINTS), 2)
    assert [outputs[i].token_ids for i in greedy] == [reference[i].token_ids for i in greedy]


def test_llguidance_outputs_validate_too():
    llm = patchbay.LLM(runtime__threads=2, model__dtype="float32", structured_output__name="llguidance")
    picked = [CONSTRAINTS[0], CONSTRAINTS[3], CONSTRAINTS[7]]
    outputs = llm.generate(
        [_message(text) for text, _ in picked],
        [SamplingParams(max_tokens=MAX_TOKENS, structured_output=c) for _, c in picked],
    )
    for output, (_, constraint) in zip(outputs, picked, strict=True):
        assert output.finish_reason == "stop" and _is_valid(output.text, constraint), (output.text, constraint)
