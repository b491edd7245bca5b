"""Tiny random pooling models, built offline and saved the way sentence-transformers saves and loads them.

Each family the pooling engine runs: a BERT (WordPiece tokenizer with token types), an XLM-R (positions from its
padding index + 1, RoBERTa's classification head, no token types) and a Qwen3 decoder (last-token pooling, the
bundled model's tokenizer).  An embedding model is saved by sentence-transformers itself (``modules.json``, its
``Pooling`` config, ``Normalize``), a cross-encoder or classifier as a ``*ForSequenceClassification`` checkpoint,
which sentence-transformers' ``CrossEncoder`` loads.
"""

from __future__ import annotations

import functools
import string
from pathlib import Path
from typing import Any

import torch

WORDS = (
    "the a an of to in is was for on that with as by at from it this be are or which his her their they we you "
    "he she not have has had but all one two three new first last about more other some what when who how where "
    "paris france capital city river seine berlin germany london england rome italy madrid spain europe country "
    "cat dog bird fish animal pet sky blue green red color weather rain sun cloud day night time year people "
    "world life water food house school book music movie game team player sport ball play run walk talk read "
    "write learn teach question answer query document search result relevant score rank model vector embedding "
    "sentence word token language machine learning deep network neural computer science data fast slow big small"
).split()


def _vocabulary() -> list[str]:
    letters = list(string.ascii_lowercase + string.digits + string.punctuation)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *letters, *(f"##{c}" for c in letters), *WORDS]
    return list(dict.fromkeys(tokens))  # "a" is a letter and a word: one id


def wordpiece_tokenizer(directory: Path, token_types: bool = True) -> Any:
    """A BERT WordPiece tokenizer of a few hundred English words; ``token_types`` off: it returns none (as XLM-R's)."""
    from transformers import BertTokenizerFast

    vocab = {token: index for index, token in enumerate(_vocabulary())}
    names = ["input_ids", "token_type_ids", "attention_mask"] if token_types else ["input_ids", "attention_mask"]
    tokenizer = BertTokenizerFast(vocab=vocab, do_lower_case=True, model_input_names=names)
    assert len(tokenizer) == len(vocab), f"the tokenizer took {len(tokenizer)} of the {len(vocab)} tokens"
    return tokenizer


def bundled_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from patchbay.toolkit.model_files import bundled_gguf, convert_gguf

    tokenizer = AutoTokenizer.from_pretrained(convert_gguf(bundled_gguf()))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    # sentence-transformers 6 reads texts as chat messages when the tokenizer has a chat template; embedding
    # models' tokenizers take plain text.
    tokenizer.chat_template = None
    return tokenizer


FAMILIES: dict[str, dict[str, Any]] = {
    "bert": dict(config="BertConfig", pooling="mean", shape=dict(intermediate_size=128, type_vocab_size=2)),
    "xlm-roberta": dict(
        config="XLMRobertaConfig",
        pooling="cls",
        shape=dict(intermediate_size=128, type_vocab_size=1, max_position_embeddings=130),
    ),
    "qwen3": dict(
        config="Qwen3Config",
        pooling="lasttoken",
        shape=dict(intermediate_size=128, num_key_value_heads=2, head_dim=64, max_position_embeddings=512),
    ),
}
"""Each family's config class, its sentence-transformers pooling mode and its shape beyond the common one."""


def _config(family: str, tokenizer: Any, **extra: Any) -> Any:
    import transformers

    spec = FAMILIES[family]
    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,
    )
    if family == "qwen3":
        common.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    return getattr(transformers, spec["config"])(**{**common, **spec["shape"], **extra})


def _tokenizer(family: str, directory: Path) -> Any:
    if family == "qwen3":
        return bundled_tokenizer()
    return wordpiece_tokenizer(directory / "tokenizer-source", token_types=family == "bert")


def build_embedding_model(directory: Path, family: str, normalize: bool = True, **shape: Any) -> Path:
    """A random ``family`` model saved by sentence-transformers with its family's pooling (and ``Normalize``);
    ``shape`` overrides config values (``hidden_size``, ``num_hidden_layers``, ...)."""
    from sentence_transformers import SentenceTransformer, models
    from transformers import AutoModel

    raw = directory.parent / f"{directory.name}-transformer"
    tokenizer = _tokenizer(family, raw)
    torch.manual_seed(0)
    model = AutoModel.from_config(_config(family, tokenizer, **shape), dtype=torch.float32)
    model.save_pretrained(raw)
    tokenizer.save_pretrained(raw)
    transformer = models.Transformer(str(raw), max_seq_length=128)
    dimension = getattr(transformer, "get_embedding_dimension", None) or transformer.get_word_embedding_dimension
    pooling = models.Pooling(dimension(), pooling_mode=FAMILIES[family]["pooling"])
    modules = [transformer, pooling, *([models.Normalize()] if normalize else [])]
    SentenceTransformer(modules=modules, device="cpu").save(str(directory))
    return directory


def build_classifier(directory: Path, family: str, num_labels: int, **shape: Any) -> Path:
    """A random ``family`` ``*ForSequenceClassification`` model (a cross-encoder with one label), with its tokenizer;
    ``shape`` overrides config values."""
    from transformers import AutoModelForSequenceClassification

    tokenizer = _tokenizer(family, directory)
    torch.manual_seed(1)
    model = AutoModelForSequenceClassification.from_config(
        _config(family, tokenizer, num_labels=num_labels, **shape), dtype=torch.float32
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@functools.cache
def embedding_model(root: Path, family: str) -> Path:
    """:func:`build_embedding_model` once per test session under ``root``."""
    return build_embedding_model(root / f"{family}-embedding", family)


@functools.cache
def classifier(root: Path, family: str, num_labels: int) -> Path:
    """:func:`build_classifier` once per test session under ``root``."""
    return build_classifier(root / f"{family}-classifier{num_labels}", family, num_labels)
