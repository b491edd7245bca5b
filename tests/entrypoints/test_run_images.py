"""Images in ``patchbay run`` request lines: ``multi_modal_data`` with paths and ``data:`` URLs, or chat ``messages``
with image parts, giving transformers' greedy tokens; bad images name the line and the part."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import pytest
import yaml
from mm_models import test_image, transformers_greedy_mm

from patchbay.entrypoints import cli

pytestmark = pytest.mark.slow

NUM_TOKENS = 5
IMAGE = test_image(40, 32, seed=5)
OTHER = test_image(32, 32, seed=6)
MARKER = "<|vision_start|><|image_pad|><|vision_end|>"
QUESTION = "Describe it."


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def chat_text(model_dir: Path, num_images: int) -> str:
    from transformers import AutoTokenizer

    content = [{"type": "image"}] * num_images + [{"type": "text", "text": QUESTION}]
    return AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


def write_job(folder: Path, model_dir: Path, lines: list[dict]) -> str:
    (folder / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = {
        "model": {"path": str(model_dir), "max_model_len": 256},
        "cache": {"num_blocks": 128},
        "inputs": {"file": "requests.jsonl", "sampling": {"max_tokens": NUM_TOKENS, "ignore_eos": True}},
        "outputs": {"path": "results.jsonl", "progress": False},
        "multimodal": {"max_images_per_prompt": 2},
    }
    (folder / "job.yaml").write_text(yaml.safe_dump(config))
    return str(folder / "job.yaml")


def test_run_lines_with_images_give_transformers_greedy_tokens(tmp_path, tiny_qwen2_vl, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cat.png").write_bytes(png_bytes(IMAGE))
    two = f"{MARKER}{MARKER}{QUESTION}"
    lines = [
        {"id": "path", "prompt": f"{MARKER}{QUESTION}", "multi_modal_data": {"image": "cat.png"}},
        {"id": "urls", "prompt": two, "multi_modal_data": {"image": [data_url(png_bytes(OTHER)), "cat.png"]}},
        {
            "id": "chat",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url(png_bytes(IMAGE))}},
                        {"type": "text", "text": QUESTION},
                    ],
                }
            ],
        },
        {"id": "text", "prompt": "Only words here."},
    ]
    assert cli.main(["run", write_job(tmp_path, tiny_qwen2_vl, lines)]) == 0, capsys.readouterr().err
    results = {
        record["id"]: record for record in map(json.loads, (tmp_path / "results.jsonl").read_text().splitlines())
    }
    expected = {
        "path": transformers_greedy_mm(tiny_qwen2_vl, f"{MARKER}{QUESTION}", [IMAGE], NUM_TOKENS),
        "urls": transformers_greedy_mm(tiny_qwen2_vl, two, [OTHER, IMAGE], NUM_TOKENS),
        "chat": transformers_greedy_mm(tiny_qwen2_vl, chat_text(tiny_qwen2_vl, 1), [IMAGE], NUM_TOKENS),
        "text": transformers_greedy_mm(tiny_qwen2_vl, "Only words here.", [], NUM_TOKENS),
    }
    assert {key: record["token_ids"] for key, record in results.items()} == expected
    summary = capsys.readouterr().out  # IMAGE three times (a path twice, a data URL once), OTHER once
    assert "encoder cache:       2 images encoded" in summary and "2 served from the cache" in summary


BAD_LINES = [
    (
        {"prompt": MARKER, "multi_modal_data": {"image": data_url(png_bytes(IMAGE)[:60])}},
        "requests.jsonl:2: multi_modal_data.image[0]: request 'requests-2': corrupt or truncated",
    ),
    (
        {"prompt": MARKER, "multi_modal_data": {"image": "missing.png"}},
        "requests.jsonl:2: multi_modal_data.image[0]: request 'requests-2': cannot read image file 'missing.png'",
    ),
    (
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url"}]}]},
        "requests.jsonl:2: <request>: request 'requests-2': messages.0.content.1.image_url: an image_url part needs",
    ),
    (
        {"messages": [{"role": "user", "content": "x"}], "multi_modal_data": {"image": "cat.png"}},
        "requests.jsonl:2: multi_modal_data: goes with 'prompt' or 'prompt_token_ids'",
    ),
    (
        {"prompt": "no marker", "multi_modal_data": {"image": data_url(png_bytes(IMAGE))}},
        "requests.jsonl:2: <request>: request 'requests-2': the prompt has 0 image markers",
    ),
]


@pytest.mark.parametrize(("line", "message"), BAD_LINES)
def test_a_bad_image_line_names_the_line_and_the_part(tmp_path, tiny_qwen2_vl, monkeypatch, capsys, line, message):
    monkeypatch.chdir(tmp_path)
    config = write_job(tmp_path, tiny_qwen2_vl, [{"prompt": "fine"}, line])
    assert cli.main(["run", config]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.jsonl").exists()
