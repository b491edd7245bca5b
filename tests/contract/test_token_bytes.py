"""patchbay.interfaces.token_bytes: each id's exact bytes, checked against the tokenizers' own encodings."""

from __future__ import annotations

import pytest

from patchbay.interfaces import token_bytes
from patchbay.testing.structured_output import bundled_tokenizer

TEXTS = ["café naïve — 日本語 €5", "hello\n\tworld  ", "Zoë's «quote» 🙂"]


def test_byte_level_bpe_pieces_concatenate_to_the_texts_utf8():
    tokenizer = bundled_tokenizer()
    table = token_bytes(tokenizer, len(tokenizer))
    for text in TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(table[i] for i in ids) == text.encode(), text
    # Some tokens hold part of a character: the table keeps the byte, it does not decode it.
    assert any(piece is not None and len(piece) == 1 and piece[0] >= 0x80 for piece in table)


def test_special_tokens_and_padded_ids_spell_nothing():
    tokenizer = bundled_tokenizer()
    table = token_bytes(tokenizer, len(tokenizer) + 40)
    assert len(table) == len(tokenizer) + 40
    assert table[tokenizer.eos_token_id] is None
    assert all(piece is None for piece in table[len(tokenizer) :])


@pytest.fixture(scope="module")
def sentencepiece_tokenizer():
    """A small sentencepiece-style tokenizer (Metaspace, byte fallback), built in memory like Llama 2's."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{byte:02X}>", -10.0) for byte in range(256)]
    pieces += [(piece, -1.0) for piece in ["▁caf", "é", "▁the", "▁", "a", "c", "f", "e", "t", "h", "▁cat", "ë"]]
    model = Tokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    model.normalizer = normalizers.Replace(" ", "▁")
    model.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    model.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_sentencepiece_byte_fallback_and_metaspace(sentencepiece_tokenizer):
    tokenizer = sentencepiece_tokenizer
    table = token_bytes(tokenizer, len(tokenizer) + 3)
    assert table[tokenizer.convert_tokens_to_ids("<0xE2>")] == b"\xe2"
    assert table[tokenizer.convert_tokens_to_ids("▁the")] == b" the"
    for text in ["the café €", "cat—日 ë"]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert any(tokenizer.convert_ids_to_tokens(i).startswith("<0x") for i in ids)  # byte fallback was used
        # The model's output bytes: sentencepiece marks the first word's space too.
        assert b"".join(table[i] for i in ids) == (" " + text).encode(), text
    assert table[:3] == [None, None, None] and table[-3:] == [None, None, None]
