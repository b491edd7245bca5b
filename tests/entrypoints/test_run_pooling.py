"""``patchbay run`` on a pooling engine: job lines in, the offline API's vectors out, errors naming the line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from patchbay import LLM
from patchbay.contract.settings import Settings
from patchbay.entrypoints import cli
from patchbay.interfaces import PoolingParams

import pooling_models


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("job-pooling-models")


def write_job(directory: Path, model_dir: Path, lines: list) -> Path:
    (directory / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = {
        "model": {"path": str(model_dir), "dtype": "float32"},
        "runtime": {"threads": 2, "device": "cpu"},
        "pooling": {"name": "auto"},
        "inputs": {"file": "requests.jsonl"},
        "outputs": {"path": str(directory / "results.jsonl"), "progress": False},
    }
    (directory / "job.yaml").write_text(yaml.safe_dump(config))
    return directory / "job.yaml"


def results(directory: Path) -> dict[str, dict]:
    return {record["id"]: record for record in map(json.loads, (directory / "results.jsonl").read_text().splitlines())}


def test_embedding_lines_write_the_offline_embeddings(tmp_path: Path, models: Path, capsys):
    model_dir = pooling_models.embedding_model(models, "bert")
    lines = [
        "the cat sat",
        {"id": "cut", "input": "paris is in france", "dimensions": 8},
        {"prompt_token_ids": [2, 40, 3]},
    ]
    assert cli.main(["run", str(write_job(tmp_path, model_dir, lines))]) == 0
    written = results(tmp_path)
    llm = LLM(Settings.model_validate({"model": {"path": str(model_dir), "dtype": "float32"}, "pooling": {}}))
    (plain,) = llm.embed(["the cat sat"])
    (cut,) = llm.embed(["paris is in france"], PoolingParams(dimensions=8))
    assert written["requests-1"]["embedding"] == pytest.approx(plain.embedding, abs=1e-6)
    assert written["cut"]["embedding"] == pytest.approx(cut.embedding, abs=1e-6)
    assert written["requests-3"]["num_prompt_tokens"] == 3 and len(written["requests-3"]["embedding"]) == 64
    assert "embed with pooler:mean" in capsys.readouterr().out


def test_pair_lines_of_a_cross_encoder_write_its_scores(tmp_path: Path, models: Path):
    model_dir = pooling_models.classifier(models, "bert", 1)
    lines = [{"id": "p", "text_1": "what is the capital of france", "text_2": "paris is the capital of france"}]
    assert cli.main(["run", str(write_job(tmp_path, model_dir, lines))]) == 0
    llm = LLM(Settings.model_validate({"model": {"path": str(model_dir), "dtype": "float32"}, "pooling": {}}))
    (expected,) = llm.score("what is the capital of france", ["paris is the capital of france"])
    assert results(tmp_path)["p"]["score"] == pytest.approx(expected.score, abs=1e-6)


def test_a_line_over_the_models_length_is_refused_naming_file_and_line(tmp_path: Path, models: Path, capsys):
    model_dir = pooling_models.embedding_model(models, "bert")
    job = write_job(tmp_path, model_dir, ["fine", " ".join(["word"] * 200), {"text_1": "a", "text_2": "b"}])
    assert cli.main(["run", str(job)]) != 0
    error = capsys.readouterr().err
    assert "requests.jsonl:2" in error and "max_model_len=128" in error
    assert "requests.jsonl:3" in error and "need a cross-encoder" in error
    assert not (tmp_path / "results.jsonl").exists()
