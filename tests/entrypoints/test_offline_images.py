"""Images through the offline API: ``LLM.generate``'s ``multi_modal_data`` from every source kind, ``LLM.chat``'s image
parts, and bad images refused naming the request and the part."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from mm_models import test_image, transformers_greedy_mm

import patchbay
from patchbay import SamplingParams
from patchbay.entrypoints.chat import ChatRequestError

pytestmark = pytest.mark.slow

NUM_TOKENS = 6
IMAGE = test_image(40, 32, seed=5)
QUESTION = "Describe it."
GREEDY = SamplingParams(max_tokens=NUM_TOKENS, temperature=0, ignore_eos=True)


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def rendered(model_dir, num_images: int) -> str:
    from transformers import AutoTokenizer

    content = [{"type": "image"}] * num_images + [{"type": "text", "text": QUESTION}]
    return AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl) -> patchbay.LLM:
    return patchbay.LLM(model__path=str(tiny_qwen2_vl), cache__num_blocks=128, multimodal__max_images_per_prompt=2)


def test_every_source_kind_gives_transformers_greedy_tokens(llm, tiny_qwen2_vl, tmp_path):
    prompt = rendered(tiny_qwen2_vl, 1)
    expected = transformers_greedy_mm(tiny_qwen2_vl, prompt, [IMAGE], NUM_TOKENS)
    path = tmp_path / "image.png"
    path.write_bytes(png_bytes(IMAGE))
    sources = [
        IMAGE,
        [IMAGE],
        png_bytes(IMAGE),
        np.asarray(IMAGE),
        str(path),
        path,
        "data:image/png;base64," + base64.b64encode(png_bytes(IMAGE)).decode(),
        IMAGE.convert("RGBA"),  # opaque: the same pixels once laid over white
    ]
    outputs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": source}} for source in sources], GREEDY)
    for source, output in zip(sources, outputs, strict=True):
        assert output.token_ids == expected, type(source).__name__


def test_chat_places_image_parts_with_the_template_and_answers_as_generate_does(llm, tiny_qwen2_vl):
    (expected,) = llm.generate({"prompt": rendered(tiny_qwen2_vl, 1), "multi_modal_data": {"image": IMAGE}}, GREEDY)
    assert expected.token_ids == transformers_greedy_mm(tiny_qwen2_vl, rendered(tiny_qwen2_vl, 1), [IMAGE], NUM_TOKENS)
    url = "data:image/png;base64," + base64.b64encode(png_bytes(IMAGE)).decode()
    for part in ({"type": "image_url", "image_url": {"url": url}}, {"type": "image", "image": IMAGE}):
        answer = llm.chat([{"role": "user", "content": [part, {"type": "text", "text": QUESTION}]}], GREEDY)
        assert answer.content == expected.text


def test_bad_images_name_the_request_and_the_part(llm):
    prompt = rendered_prompt_with_markers(2)
    with pytest.raises(ValueError, match=r"^request 0: multi_modal_data\.image: 3 images; at most 2"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"image": [IMAGE] * 3}}, GREEDY)
    truncated = png_bytes(IMAGE)[:60]
    with pytest.raises(ValueError, match=r"^request 'mine': multi_modal_data\.image\[1\]: corrupt or truncated"):
        llm.generate(
            {"prompt": prompt, "multi_modal_data": {"image": [IMAGE, truncated]}}, GREEDY, request_ids=["mine"]
        )
    with pytest.raises(ValueError, match=r"^request 0: multi_modal_data\.audio: only 'image'"):
        llm.generate({"prompt": prompt, "multi_modal_data": {"audio": b""}}, GREEDY)
    assert not llm.engine.has_unfinished_requests()


def rendered_prompt_with_markers(count: int) -> str:
    return "".join("<|vision_start|><|image_pad|><|vision_end|>" for _ in range(count)) + QUESTION


def test_a_text_only_model_refuses_chat_images_naming_the_part(tiny_llama):
    llm = patchbay.LLM(model__path=str(tiny_llama), cache__num_blocks=64, model__max_model_len=512)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image", "image": IMAGE}]}]
    with pytest.raises(ChatRequestError) as caught:
        llm.chat(messages, GREEDY)
    assert caught.value.param == "messages.0.content.1"
    assert "text-only model" in str(caught.value)
