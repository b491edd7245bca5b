"""Incremental detokenization: deltas add up to the full decode, across multi-byte characters and stop strings."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from patchbay.engine import IncrementalDetokenizer, StreamingText
from patchbay.toolkit.model_files import bundled_gguf, convert_gguf

TEXTS = [
    "Hello, world! The capital of France is Paris.",
    "café naïve 日本語のテキスト 🙂🚀 emoji and math ∑∫ mixed",
    "  leading spaces\n\nnew lines\tand tabs",
    "😀😃😄😁😆😅🤣😂",
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(convert_gguf(bundled_gguf()))


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_add_up_to_the_full_decode(tokenizer, text: str, chunk: int):
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add(token_ids[i : i + chunk]) for i in range(0, len(token_ids), chunk)]
    assert "".join(deltas) == tokenizer.decode(token_ids, skip_special_tokens=True) == text
    assert not any("\ufffd" in delta for delta in deltas)


def test_an_emoji_split_over_byte_tokens_comes_out_whole(tokenizer):
    token_ids = tokenizer.encode("🚀", add_special_tokens=False)
    assert len(token_ids) > 1, "the emoji should span several byte tokens for this test to mean anything"
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([token]) for token in token_ids]
    assert deltas[:-1] == [""] * (len(token_ids) - 1) and deltas[-1] == "🚀"


def test_random_token_sequences_never_send_text_the_full_decode_lacks(tokenizer):
    rng = random.Random(0)
    vocab = len(tokenizer)
    for _ in range(30):
        token_ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
        detokenizer = IncrementalDetokenizer(tokenizer)
        for token in token_ids:
            detokenizer.add([token])
        full = tokenizer.decode(token_ids, skip_special_tokens=True)
        # What is left unsent is at most a trailing incomplete character.
        assert full.startswith(detokenizer.text)
        assert set(full[len(detokenizer.text) :]) <= {"\ufffd"}


def test_streamed_text_never_runs_into_a_stop_string_split_across_chunks(tokenizer):
    text = "one two three STOP four five"
    final = text[: text.index("STOP")]  # what the engine's stop check leaves
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    stop_tokens = [t for t in token_ids if "S" in tokenizer.decode([t]) or "TOP" in tokenizer.decode([t])]
    assert stop_tokens and tokenizer.decode(stop_tokens[:1]) != "STOP", "the stop string should span tokens"
    stream = StreamingText(tokenizer, ["STOP", "never"])
    sent = ""
    for end in range(1, len(token_ids) + 1):
        if "STOP" in tokenizer.decode(token_ids[:end]):
            break  # the engine's stop check finishes the request with this token
        sent += stream.add(token_ids[end - 1 : end])
        assert final.startswith(sent), sent
    assert sent and sent != final, "some text should be sent early and some held back"
    sent += stream.finish(final)
    assert sent == final
