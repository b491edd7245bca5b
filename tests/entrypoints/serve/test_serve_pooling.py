"""The pooling routes through a real ``patchbay serve``: the official openai client's embeddings (float and
base64), rerank, score and classify return what the offline API does, with usage, and errors name the input."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from patchbay import LLM
from patchbay.contract.settings import Settings

import pooling_models
from serving import running_server

TEXTS = ["the cat sat on the mat", "paris is the capital of france", "a", "music and sport and a team of people"]
QUERY = "what is the capital of france"
DOCUMENTS = ["the cat sat", "paris is the capital of france", "berlin is in germany"]
ENGINE = {
    "runtime": {"device": "cpu", "threads": 2},
    "model": {"dtype": "float32"},
    "scheduler": {"max_num_seqs": 4, "max_num_batched_tokens": 64},
    "pooling": {"name": "auto"},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("served-pooling-models")


def settings_for(model_dir: Path) -> Settings:
    return Settings.model_validate({**ENGINE, "model": {**ENGINE["model"], "path": str(model_dir)}})


def offline(model_dir: Path) -> LLM:
    return LLM(settings_for(model_dir))


def test_openai_embeddings_float_and_base64_equal_the_offline_vectors(models: Path):
    import openai

    model_dir = pooling_models.embedding_model(models, "bert")
    expected = [output.embedding for output in offline(model_dir).embed(TEXTS)]
    with running_server(settings_for(model_dir)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        floats = client.embeddings.create(model=model_dir.name, input=TEXTS, encoding_format="float")
        # The client asks for base64 unless told otherwise, and decodes it into floats itself.
        decoded = client.embeddings.create(model=model_dir.name, input=TEXTS)
        raw = httpx.post(
            f"{server.url}/v1/embeddings", json={"input": TEXTS[1], "encoding_format": "base64"}, timeout=30
        ).json()
        cut = client.embeddings.create(model=model_dir.name, input=TEXTS[:2], dimensions=8, encoding_format="float")
        ids = client.embeddings.create(model=model_dir.name, input=[[2, 40, 41, 3]], encoding_format="float")
    for response in (floats, decoded):
        assert [item.index for item in response.data] == [0, 1, 2, 3]
        for item, vector in zip(response.data, expected, strict=True):
            assert torch.allclose(torch.tensor(item.embedding), torch.tensor(vector), atol=1e-6)
    assert isinstance(raw["data"][0]["embedding"], str)
    assert (
        floats.usage.prompt_tokens
        == floats.usage.total_tokens
        == sum(len(output.prompt_token_ids) for output in offline(model_dir).embed(TEXTS))
    )
    assert all(len(item.embedding) == 8 for item in cut.data)
    assert abs(torch.tensor(cut.data[0].embedding).norm() - 1) < 1e-5
    assert len(ids.data[0].embedding) == 64 and ids.usage.prompt_tokens == 4


def test_rerank_and_score_equal_the_offline_scores(models: Path):
    model_dir = pooling_models.classifier(models, "bert", 1)
    expected = [output.score for output in offline(model_dir).score(QUERY, DOCUMENTS)]
    with running_server(settings_for(model_dir)) as server:
        jina = httpx.post(
            f"{server.url}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2}, timeout=30
        ).json()
        cohere = httpx.post(
            f"{server.url}/v2/rerank",
            json={"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS], "return_documents": False},
            timeout=30,
        ).json()
        scored = httpx.post(f"{server.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=30).json()
        refused = httpx.post(f"{server.url}/v1/embeddings", json={"input": "hello"}, timeout=30)
    best = sorted(range(len(DOCUMENTS)), key=lambda index: -expected[index])
    assert [result["index"] for result in jina["results"]] == best[:2]
    for result in jina["results"]:
        assert result["relevance_score"] == pytest.approx(expected[result["index"]], abs=1e-6)
        assert result["document"]["text"] == DOCUMENTS[result["index"]]
    assert [result["index"] for result in cohere["results"]] == best
    assert all("document" not in result for result in cohere["results"])
    assert [item["score"] for item in scored["data"]] == pytest.approx(expected, abs=1e-6)
    assert jina["usage"]["total_tokens"] == scored["usage"]["total_tokens"] > 0
    assert refused.status_code == 400 and "serves score" in refused.json()["error"]["message"]


def test_classify_returns_the_offline_probabilities_and_labels(models: Path):
    model_dir = pooling_models.classifier(models, "xlm-roberta", 3)
    expected = [output.probs for output in offline(model_dir).classify(TEXTS)]
    with running_server(settings_for(model_dir)) as server:
        answer = httpx.post(f"{server.url}/classify", json={"input": TEXTS}, timeout=30).json()
    for item, probs in zip(answer["data"], expected, strict=True):
        assert item["probs"] == pytest.approx(probs, abs=1e-6)
        assert item["num_classes"] == 3 and item["label"] == f"LABEL_{max(range(3), key=lambda i: probs[i])}"


def test_an_input_over_the_models_length_is_a_400_naming_it(models: Path):
    model_dir = pooling_models.embedding_model(models, "bert")
    with running_server(settings_for(model_dir)) as server:
        too_long = httpx.post(
            f"{server.url}/v1/embeddings", json={"input": ["short", " ".join(["word"] * 200)]}, timeout=30
        )
        completion = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello"}, timeout=30)
        server.wait_until_idle()
    assert too_long.status_code == 400
    assert (
        "'input 1'" in too_long.json()["error"]["message"]
        and "max_model_len=128" in too_long.json()["error"]["message"]
    )
    assert completion.status_code == 400 and "this engine pools" in completion.json()["error"]["message"]
