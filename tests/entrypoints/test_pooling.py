"""LLM.embed, LLM.score and LLM.classify against sentence-transformers on the same directories, per model family.

Each family's tiny random model is saved the way sentence-transformers saves it (tests/support/pooling_models.py);
batches mix lengths, and a causal model's prompts run in chunks (a 16-token step budget).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from patchbay import LLM
from patchbay.interfaces import PoolingParams

import pooling_models

TEXTS = [
    "the cat sat on the mat",
    "paris is the capital of france",
    "a",
    "deep learning with neural networks is fast and the data is big, the model is small and the team is new",
    "what is the weather in london today? rain, cloud and sun",
    "music",
]
QUERY = "what is the capital of france"
DOCUMENTS = ["paris is the capital of france", "the cat sat", "berlin is in germany", "a", "rome, italy and spain"]
COSINE = 0.99999

ENGINE = dict(
    runtime__device="cpu",
    runtime__threads=2,
    model__dtype="float32",
    scheduler__max_num_batched_tokens=16,
    scheduler__max_num_seqs=4,
    cache__num_blocks=128,
)
"""float32, and a 16-token budget: a causal model's longer prompts prefill in chunks, several requests a step."""


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pooling-models")


def pooling_llm(model_dir: Path, **settings) -> LLM:
    return LLM(model__path=str(model_dir), **{"pooling": {"name": "auto"}, **ENGINE, **settings})


def assert_close(got: list[list[float]], expected: torch.Tensor, what: str) -> None:
    for index, (vector, reference) in enumerate(zip(got, expected, strict=True)):
        cosine = float(torch.nn.functional.cosine_similarity(torch.tensor(vector), reference.float(), dim=0))
        assert cosine >= COSINE, f"{what}: input {index} has cosine {cosine:.7f} with sentence-transformers"
        assert torch.allclose(torch.tensor(vector), reference.float(), atol=1e-4), f"{what}: input {index}"


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "qwen3"])
def test_embed_equals_sentence_transformers_encode(models: Path, family: str):
    from sentence_transformers import SentenceTransformer

    model_dir = pooling_models.embedding_model(models, family)
    llm = pooling_llm(model_dir)
    outputs = llm.embed(TEXTS)
    expected = SentenceTransformer(str(model_dir), device="cpu").encode(TEXTS, convert_to_tensor=True)
    assert_close([output.embedding for output in outputs], expected, f"{family} embeddings")
    assert all(abs(torch.tensor(output.embedding).norm() - 1) < 1e-5 for output in outputs)  # its Normalize module
    if family == "qwen3":  # causal: the longer prompts ran in chunks of the 16-token budget
        assert max(len(output.prompt_token_ids) for output in outputs) > 16


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "qwen3"])
def test_score_equals_the_cross_encoders_predict(models: Path, family: str):
    from sentence_transformers import CrossEncoder

    model_dir = pooling_models.classifier(models, family, 1)
    outputs = pooling_llm(model_dir).score(QUERY, DOCUMENTS)
    expected = CrossEncoder(str(model_dir), device="cpu").predict([(QUERY, document) for document in DOCUMENTS])
    got = [output.score for output in outputs]
    assert torch.allclose(torch.tensor(got), torch.tensor(expected), atol=1e-5), f"{got} != {expected}"


@pytest.mark.parametrize("family", ["bert", "xlm-roberta", "qwen3"])
def test_classify_equals_the_classifiers_softmax_in_transformers(models: Path, family: str):
    """sentence-transformers' CrossEncoder scores pairs only: single texts are checked against transformers."""
    from transformers import AutoModelForSequenceClassification

    model_dir = pooling_models.classifier(models, family, 3)
    llm = pooling_llm(model_dir)
    outputs = llm.classify(TEXTS)
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.cat([model(**llm.tokenizer(text, return_tensors="pt")).logits.softmax(-1) for text in TEXTS])
    assert_close([output.probs for output in outputs], expected, f"{family} class probabilities")


def test_bert_pairs_carry_their_token_types(models: Path):
    """A BERT cross-encoder's document is segment 1: scored as one segment, the pair would score differently."""
    model_dir = pooling_models.classifier(models, "bert", 1)
    llm = pooling_llm(model_dir)
    (pair,) = llm.score(QUERY, DOCUMENTS[:1])
    encoded = llm.tokenizer(QUERY, DOCUMENTS[0])
    assert 1 in encoded["token_type_ids"]
    (flat,) = llm.pool([list(encoded["input_ids"])])
    assert abs(pair.score - flat.data[0]) > 1e-4


def test_score_on_an_embedding_model_is_the_cosine_of_the_embeddings(models: Path):
    from sentence_transformers import SentenceTransformer

    model_dir = pooling_models.embedding_model(models, "bert")
    outputs = pooling_llm(model_dir).score(QUERY, DOCUMENTS)
    model = SentenceTransformer(str(model_dir), device="cpu")
    expected = model.similarity(model.encode([QUERY]), model.encode(DOCUMENTS))[0]
    assert torch.allclose(torch.tensor([output.score for output in outputs]), expected, atol=1e-5)


def test_dimensions_cut_before_normalizing_and_normalize_can_be_turned_off(models: Path):
    from sentence_transformers import SentenceTransformer

    model_dir = pooling_models.embedding_model(models, "bert")
    llm = pooling_llm(model_dir)
    model = SentenceTransformer(str(model_dir), device="cpu")
    cut = llm.embed(TEXTS, PoolingParams(dimensions=16))
    expected = model.encode(TEXTS, convert_to_tensor=True, truncate_dim=16, normalize_embeddings=True)
    assert_close([output.embedding for output in cut], expected, "dimensions=16")
    raw = llm.embed(TEXTS[:2], PoolingParams(normalize=False))
    assert any(abs(torch.tensor(output.embedding).norm() - 1) > 1e-3 for output in raw)


def test_a_last_token_decoder_reuses_cached_prefixes_with_the_same_vectors(models: Path):
    model_dir = pooling_models.embedding_model(models, "qwen3")
    llm = pooling_llm(model_dir)
    prefix = TEXTS[3]
    first = llm.embed([prefix + " one", prefix + " two"])
    assert llm.engine.kv_cache_manager.prefix_cache_hits > 0, "the second prompt's shared blocks were not reused"
    alone = pooling_llm(model_dir, cache__prefix_caching=False).embed([prefix + " two"])
    assert_close([first[1].embedding], torch.tensor([alone[0].embedding]), "a prefix-cache hit")


def test_mean_pooling_on_a_decoder_computes_the_whole_prompt(models: Path):
    """A pooler reading every position never starts from a prefix-cache hit: the vectors stay exact."""
    model_dir = pooling_models.embedding_model(models, "qwen3")
    llm = pooling_llm(model_dir, pooling={"name": "mean"})
    prefix = TEXTS[3]
    outputs = llm.embed([prefix + " one", prefix + " two"])
    assert llm.engine.kv_cache_manager.prefix_cache_hits == 0
    alone = pooling_llm(model_dir, pooling={"name": "mean"}).embed([prefix + " two"])
    assert_close([outputs[1].embedding], torch.tensor([alone[0].embedding]), "mean over a shared prefix")


def test_an_input_over_the_models_length_is_refused_naming_it(models: Path):
    llm = pooling_llm(pooling_models.embedding_model(models, "bert"))
    with pytest.raises(ValueError, match=r"input 1.*exceeds model.max_model_len=128"):
        llm.embed(["short", " ".join(["word"] * 200)])
    assert not llm.engine.has_unfinished_requests()


def test_generation_and_pooling_are_refused_on_the_other_kind_of_engine(models: Path):
    llm = pooling_llm(pooling_models.embedding_model(models, "bert"))
    with pytest.raises(ValueError, match="this engine pools"):
        llm.generate(["hello"])
    with pytest.raises(ValueError, match="serves embed"):
        llm.classify(["hello"])
    with pytest.raises(ValueError, match="exceeds the model's 64 embedding features"):
        llm.embed(["hello"], PoolingParams(dimensions=65))


def test_auto_without_sentence_transformers_files_or_a_head_says_what_to_do(tmp_path: Path, models: Path):
    import shutil

    from patchbay.contract.settings import ConfigError

    source = pooling_models.embedding_model(models, "bert")
    bare = tmp_path / "bare"
    shutil.copytree(source, bare)
    (bare / "modules.json").unlink()
    with pytest.raises(ConfigError, match="name a pooler"):
        pooling_llm(bare)
    named = pooling_llm(bare, pooling={"name": "cls"})
    assert named.engine.pooling is not None and named.engine.pooling.pooler_name == "cls"


def test_a_sentence_transformers_module_patchbay_does_not_run_is_named(tmp_path: Path, models: Path):
    import json
    import shutil

    from patchbay.contract.settings import ConfigError

    model_dir = tmp_path / "dense"
    shutil.copytree(pooling_models.embedding_model(models, "bert"), model_dir)
    modules = json.loads((model_dir / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (model_dir / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ConfigError, match="sentence_transformers.models.Dense is not run by patchbay"):
        pooling_llm(model_dir)
