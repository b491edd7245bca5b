"""Images through ``patchbay serve``'s chat completions, driven by the official ``openai`` client and raw HTTP.

A tiny random Qwen2-VL answers ``image_url`` parts with the greedy tokens transformers' own ``generate`` gives
on the same image and chat-rendered text; ``usage`` counts the image's placeholder tokens; each bad image is a 400
in OpenAI's shape naming the part while a concurrent good request succeeds; a text-only model refuses images.
"""

from __future__ import annotations

import asyncio
import threading
import base64
import io
from pathlib import Path

import httpx
import openai
import pytest
from mm_models import expanded_prompt_text, test_image, transformers_greedy_mm
from serving import RunningServer, running_server

from patchbay.contract.settings import load_settings

pytestmark = pytest.mark.slow

MAX_IMAGES = 2
NUM_TOKENS = 8
MAX_PIXELS = 16_000
IMAGE = test_image(40, 32, seed=3)
OTHER_IMAGE = test_image(32, 48, seed=4)
QUESTION = "What is in this picture?"


def png_bytes(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # lossless: the server decodes the very pixels transformers is given
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def user_message(*images, text: str = QUESTION) -> dict:
    return {
        "role": "user",
        "content": [*(image_part(data_url(png_bytes(i))) for i in images), {"type": "text", "text": text}],
    }


def settings_for(model_dir: Path, *extra: str):
    return load_settings(
        None,
        overrides=[
            f"model.path={model_dir}",
            "cache.num_blocks=128",
            "scheduler.max_num_seqs=8",
            f"multimodal.max_images_per_prompt={MAX_IMAGES}",
            "server.served_model_name=tiny-vl",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    """The folder ``file://`` URLs may read from, holding ``cat.png`` (:data:`IMAGE`)."""
    folder = tmp_path_factory.mktemp("media")
    (folder / "cat.png").write_bytes(png_bytes(IMAGE))
    return folder


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, media) -> RunningServer:
    settings = settings_for(
        tiny_qwen2_vl, f"multimodal.max_image_pixels={MAX_PIXELS}", f"multimodal.allowed_local_media_path={media}"
    )
    with running_server(settings) as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def rendered_prompt(model_dir: Path, num_images: int, text: str = QUESTION) -> str:
    """The chat template's text for one user message holding ``num_images`` images then ``text``, rendered by
    transformers' tokenizer itself."""
    from transformers import AutoTokenizer

    content = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
    )


def reference(model_dir: Path, images: list, text: str = QUESTION) -> tuple[list[str], int]:
    """transformers' greedy tokens (each as the server's logprobs spell it) and the expanded prompt's length."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = rendered_prompt(model_dir, len(images), text)
    token_ids = transformers_greedy_mm(model_dir, prompt, images, NUM_TOKENS)
    prompt_tokens = len(tokenizer(expanded_prompt_text(model_dir, prompt, images))["input_ids"])
    return [tokenizer.decode([token]) for token in token_ids], prompt_tokens


def ask(client: openai.OpenAI, messages: list[dict], **fields):
    return client.chat.completions.create(
        model="tiny-vl",
        messages=messages,
        max_tokens=NUM_TOKENS,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
        **fields,
    )


def test_an_image_url_part_gives_transformers_greedy_tokens_and_counts_image_tokens(server, client, tiny_qwen2_vl):
    from transformers import AutoTokenizer

    expected, prompt_tokens = reference(tiny_qwen2_vl, [IMAGE])
    response = ask(client, [user_message(IMAGE)])
    assert [entry.token for entry in response.choices[0].logprobs.content] == expected
    assert response.usage.prompt_tokens == prompt_tokens
    unexpanded = len(AutoTokenizer.from_pretrained(tiny_qwen2_vl)(rendered_prompt(tiny_qwen2_vl, 1))["input_ids"])
    assert prompt_tokens > unexpanded  # the image's placeholder tokens are counted, not just its one marker
    assert response.usage.completion_tokens == NUM_TOKENS


def test_the_image_processor_runs_once_per_image_of_a_request(server, client, tiny_qwen2_vl, monkeypatch):
    """The server processes the images to count their tokens before admission; the engine takes that result."""
    image_inputs = server.llm.engine.image_inputs
    calls = []
    real_processor = image_inputs.processor

    def counting_processor(*args, **kwargs):
        calls.append(1)
        return real_processor(*args, **kwargs)

    monkeypatch.setattr(image_inputs, "processor", counting_processor)
    expected, prompt_tokens = reference(tiny_qwen2_vl, [IMAGE, OTHER_IMAGE])
    response = ask(client, [user_message(IMAGE, OTHER_IMAGE)])
    assert len(calls) == 2  # one call per image: before, the engine ran them again after the server
    assert [entry.token for entry in response.choices[0].logprobs.content] == expected
    assert response.usage.prompt_tokens == prompt_tokens


def test_two_images_in_one_message_and_the_same_text_with_another_image(server, client, tiny_qwen2_vl):
    expected, prompt_tokens = reference(tiny_qwen2_vl, [IMAGE, OTHER_IMAGE])
    response = ask(client, [user_message(IMAGE, OTHER_IMAGE)])
    assert [entry.token for entry in response.choices[0].logprobs.content] == expected
    assert response.usage.prompt_tokens == prompt_tokens
    other, _ = reference(tiny_qwen2_vl, [OTHER_IMAGE])
    response = ask(client, [user_message(OTHER_IMAGE)])
    assert [entry.token for entry in response.choices[0].logprobs.content] == other
    assert other != reference(tiny_qwen2_vl, [IMAGE])[0]  # the image steers the answer: the comparison can fail


def test_a_streamed_image_request_gives_the_same_text_and_usage(server, client, tiny_qwen2_vl):
    expected, prompt_tokens = reference(tiny_qwen2_vl, [IMAGE])
    stream = ask(client, [user_message(IMAGE)], stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == "".join(expected)
    assert usage is not None and usage.prompt_tokens == prompt_tokens


def _truncated_png() -> bytes:
    data = png_bytes(test_image(64, 64, seed=9))
    return data[: len(data) // 2]


BAD_REQUESTS = [
    (
        "corrupt",
        [{"role": "user", "content": [{"type": "text", "text": "x"}, image_part(data_url(_truncated_png()))]}],
        "messages.0.content.1.image_url",
        "corrupt or truncated PNG image",
    ),
    (
        "too many",
        [user_message(IMAGE, IMAGE, IMAGE)],
        "messages",
        f"3 images; at most {MAX_IMAGES}",
    ),
    (
        "pdf",
        [{"role": "user", "content": [image_part(data_url(b"%PDF-1.7\n%%EOF\n", "image/png"))]}],
        "messages.0.content.0.image_url",
        "the data is a PDF document",
    ),
    (
        "remote",
        [{"role": "user", "content": [image_part("https://example.com/cat.png")]}],
        "messages.0.content.0.image_url",
        "remote image URLs are not fetched",
    ),
    (
        "file outside",
        [{"role": "user", "content": [image_part("file:///etc/passwd")]}],
        "messages.0.content.0.image_url",
        "is outside multimodal.allowed_local_media_path",
    ),
    (
        "not a part",
        [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": ""}}]}],
        "messages.0.content.0",
        "got 'input_audio'",
    ),
    (
        "pixels",
        [{"role": "user", "content": [image_part(data_url(png_bytes(test_image(5000, 4, seed=1))))]}],
        "messages.0.content.0.image_url",
        f"the limit is {MAX_PIXELS}",
    ),
]


def assert_openai_error(response: httpx.Response, param: str, message: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert message in error["message"] and error["message"].startswith(param)


def test_each_bad_image_is_a_400_naming_the_part_while_a_good_request_succeeds(server, tiny_qwen2_vl):
    expected, _ = reference(tiny_qwen2_vl, [IMAGE])
    good = {
        "messages": [user_message(IMAGE)],
        "max_tokens": NUM_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "ignore_eos": True,
    }

    async def scenario() -> tuple[httpx.Response, list[httpx.Response]]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            good_call = asyncio.ensure_future(http.post("/v1/chat/completions", json=good))
            bad_calls = [
                http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4})
                for _, messages, _, _ in BAD_REQUESTS
            ]
            bad = await asyncio.gather(*bad_calls)
            return await good_call, list(bad)

    good_response, bad_responses = asyncio.run(scenario())
    for (_, _, param, message), response in zip(BAD_REQUESTS, bad_responses, strict=True):
        assert_openai_error(response, param, message)
    assert good_response.status_code == 200, good_response.text
    tokens = [entry["token"] for entry in good_response.json()["choices"][0]["logprobs"]["content"]]
    assert tokens == expected
    server.wait_until_idle()


def test_the_openai_client_sees_a_bad_image_as_bad_request(client):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(client, [user_message(IMAGE, IMAGE, IMAGE)])
    assert caught.value.status_code == 400
    assert caught.value.body["param"] == "messages"


def test_a_text_only_model_refuses_an_image_naming_the_part_while_text_requests_run(tiny_llama):
    settings = load_settings(None, overrides=[f"model.path={tiny_llama}", "server.served_model_name=tiny-text"])
    with running_server(settings) as text_server:

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            async with httpx.AsyncClient(base_url=text_server.url, timeout=120) as http:
                text_call = http.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 6, "ignore_eos": True},
                )
                image_call = http.post(
                    "/v1/chat/completions", json={"messages": [user_message(IMAGE)], "max_tokens": 6}
                )
                return tuple(await asyncio.gather(text_call, image_call))

        text_response, image_response = asyncio.run(scenario())
        assert text_response.status_code == 200, text_response.text
        assert text_response.json()["usage"]["completion_tokens"] == 6
        assert_openai_error(image_response, "messages.0.content.0", "tiny-text is a text-only model")
        text_server.wait_until_idle()


def test_a_file_url_under_the_allowed_folder_is_served(client, media, tiny_qwen2_vl):
    expected, _ = reference(tiny_qwen2_vl, [IMAGE])
    message = {
        "role": "user",
        "content": [image_part((media / "cat.png").as_uri()), {"type": "text", "text": QUESTION}],
    }
    response = ask(client, [message])
    assert [entry.token for entry in response.choices[0].logprobs.content] == expected
    escape = (media / "link.png").as_uri()
    (media / "link.png").symlink_to(media.parent)  # a link out of the folder
    with pytest.raises(openai.BadRequestError, match="outside multimodal.allowed_local_media_path"):
        ask(client, [{"role": "user", "content": [image_part(escape)]}])


def test_image_tokens_count_against_the_context(server, client, tiny_qwen2_vl):
    _, prompt_tokens = reference(tiny_qwen2_vl, [IMAGE])
    limit = server.llm.max_model_len
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny-vl", messages=[user_message(IMAGE)], max_tokens=limit - prompt_tokens + 1
        )
    error = caught.value.body
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    assert f"{prompt_tokens} prompt tokens" in error["message"]
    response = client.chat.completions.create(
        model="tiny-vl", messages=[user_message(IMAGE)], max_tokens=1, extra_body={"ignore_eos": True}
    )
    assert response.usage.prompt_tokens == prompt_tokens


def test_tokenize_refuses_image_parts_naming_them(server):
    response = httpx.post(f"{server.url}/tokenize", json={"messages": [user_message(IMAGE)]}, timeout=60)
    assert_openai_error(response, "messages.0.content", "/tokenize takes text parts only")


def test_an_image_being_decoded_does_not_stall_health(server, monkeypatch):
    """Images are decoded in a worker thread, as prompts are tokenized: the event loop keeps answering."""
    import patchbay.entrypoints.serve.images as app_module

    decoding, release = threading.Event(), threading.Event()
    real_load = app_module.decode_encoded

    def slow_load(image, **limits):
        decoding.set()
        release.wait(30)  # stands for a large image's decoding
        return real_load(image, **limits)

    monkeypatch.setattr(app_module, "decode_encoded", slow_load)
    body = {"messages": [user_message(IMAGE)], "max_tokens": 2}
    responses = []
    worker = threading.Thread(
        target=lambda: responses.append(httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60))
    )
    worker.start()
    try:
        assert decoding.wait(30)
        with httpx.Client(base_url=server.url, timeout=10) as other:
            assert other.get("/health").status_code == 200  # times out when the loop is busy decoding
    finally:
        release.set()
        worker.join(60)
    assert responses and responses[0].status_code == 200, responses


def test_a_llava_model_answers_image_url_parts_as_transformers_does(tiny_llava):
    """The other family (plain positions, a fixed count of ``<image>`` placeholders) through the same route."""
    expected, prompt_tokens = reference(tiny_llava, [IMAGE])
    with running_server(settings_for(tiny_llava, "server.served_model_name=tiny-vl")) as llava:
        client = openai.OpenAI(base_url=f"{llava.url}/v1", api_key="unused", max_retries=0, timeout=120)
        response = ask(client, [user_message(IMAGE)])
        assert [entry.token for entry in response.choices[0].logprobs.content] == expected
        assert response.usage.prompt_tokens == prompt_tokens
        llava.wait_until_idle()


def input_image_message(*images, text: str = QUESTION) -> dict:
    """A Responses API user message: ``input_image`` parts (data URLs) then the question."""
    parts = [{"type": "input_image", "image_url": data_url(png_bytes(image))} for image in images]
    return {"role": "user", "content": [*parts, {"type": "input_text", "text": text}]}


def test_the_responses_api_takes_input_image_parts(server, client, tiny_qwen2_vl):
    expected, prompt_tokens = reference(tiny_qwen2_vl, [IMAGE, OTHER_IMAGE])
    response = client.responses.create(
        model="tiny-vl",
        input=[input_image_message(IMAGE, OTHER_IMAGE)],
        max_output_tokens=NUM_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert response.output_text == "".join(expected)
    assert response.usage.input_tokens == prompt_tokens
    # A follow-up turn renders the stored conversation, its images included.
    follow_up = client.responses.create(
        model="tiny-vl",
        previous_response_id=response.id,
        input="And now?",
        max_output_tokens=2,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert follow_up.usage.input_tokens > prompt_tokens


RESPONSES_BAD_REQUESTS = [
    (
        [
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "x"},
                    {"type": "input_image", "image_url": data_url(_truncated_png())},
                ],
            }
        ],
        "input.0.content.1.image_url",
        "corrupt or truncated PNG image",
    ),
    ([input_image_message(IMAGE, IMAGE, IMAGE)], "input", f"3 images; at most {MAX_IMAGES}"),
    (
        [{"role": "user", "content": [{"type": "input_image", "file_id": "file-123"}]}],
        "input.0.content.0.file_id",
        "uploaded files are not supported",
    ),
    (
        [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/cat.png"}]}],
        "input.0.content.0.image_url",
        "remote image URLs are not fetched",
    ),
    (
        [{"role": "user", "content": [{"type": "input_image"}, {"type": "input_file", "file_id": "f"}]}],
        "input.0.content.0.image_url",
        "an input_image part needs",
    ),
]


@pytest.mark.parametrize(("items", "param", "message"), RESPONSES_BAD_REQUESTS)
def test_a_bad_input_image_is_a_400_naming_the_part(server, items, param, message):
    response = httpx.post(f"{server.url}/v1/responses", json={"input": items, "max_output_tokens": 2}, timeout=60)
    assert_openai_error(response, param, message)


def test_a_text_only_model_refuses_input_image_parts(tiny_llama):
    with running_server(settings_for(tiny_llama)) as text_only:
        response = httpx.post(f"{text_only.url}/v1/responses", json={"input": [input_image_message(IMAGE)]}, timeout=60)
        assert_openai_error(response, "input.0.content.0", "is a text-only model")
