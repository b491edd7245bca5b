"""Image parts of chat messages: placed where they were for the template, collected in order, errors naming the part."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from patchbay.contract.settings import MultimodalSettings
from patchbay.entrypoints.chat import ChatRequestError
from patchbay.entrypoints.chat_images import load_chat_images, refuse_images_for_text_model, split_image_parts
from patchbay.multimodal.images import ImageInputError


def png(color: tuple[int, int, int], size: tuple[int, int] = (4, 3)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_images_stay_where_they_were_and_come_out_in_prompt_order():
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "First "},
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "low"}},
                {"type": "text", "text": " then "},
                {"type": "image", "image": b"raw"},
            ],
        },
        {"role": "assistant", "content": [{"type": "text", "text": "Seen"}, {"type": "text", "text": " both."}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": "data:image/png;base64,BBBB"}]},
    ]
    placed, images = split_image_parts(messages)
    assert placed[0] == messages[0]
    assert placed[1]["content"] == [
        {"type": "text", "text": "First "},
        {"type": "image"},
        {"type": "text", "text": " then "},
        {"type": "image"},
    ]
    assert placed[2]["content"] == "Seen both."  # a content list without images is text, as text templates take it
    assert placed[3]["content"] == [{"type": "image"}]
    assert [(i.source, i.where, i.is_url) for i in images] == [
        ("data:image/png;base64,AAAA", "messages.1.content.1.image_url", True),
        (b"raw", "messages.1.content.3.image", False),
        ("data:image/png;base64,BBBB", "messages.3.content.0.image_url", True),
    ]
    assert messages[1]["content"][1]["type"] == "image_url"  # the caller's messages are left as they were


@pytest.mark.parametrize(
    ("part", "param", "message"),
    [
        ({"type": "input_audio", "input_audio": {}}, "messages.0.content.1", "got 'input_audio'"),
        ({"type": "image_url"}, "messages.0.content.1.image_url", '{"url"'),
        ({"type": "image_url", "image_url": {"url": 5}}, "messages.0.content.1.image_url", '{"url"'),
        ({"type": "text", "text": 5}, "messages.0.content.1.text", "must be a string"),
        ("just text", "messages.0.content.1", "got 'str'"),
    ],
)
def test_a_malformed_part_names_itself(part, param, message):
    with pytest.raises(ChatRequestError) as caught:
        split_image_parts([{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    assert caught.value.param == param
    assert message in str(caught.value)


def test_a_text_only_model_refuses_naming_the_first_image_part():
    _, images = split_image_parts(
        [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "u"}}]}]
    )
    with pytest.raises(ChatRequestError) as caught:
        refuse_images_for_text_model(images, "tiny")
    assert caught.value.param == "messages.0.content.1"
    assert "tiny is a text-only model" in str(caught.value)
    refuse_images_for_text_model([], "tiny")  # no images: nothing to refuse


def test_loading_decodes_every_source_and_names_the_bad_one():
    red, green = png((255, 0, 0)), png((0, 255, 0))
    content = [
        {"type": "image_url", "image_url": {"url": data_url(red)}},
        {"type": "image", "image": np.zeros((3, 4, 3), np.uint8)},
        {"type": "image", "image": green},
    ]
    _, images = split_image_parts([{"role": "user", "content": content}])
    loaded = load_chat_images(images, MultimodalSettings())
    assert [image.getpixel((0, 0)) for image in loaded] == [(255, 0, 0), (0, 0, 0), (0, 255, 0)]

    content[2] = {"type": "image_url", "image_url": {"url": data_url(green[:30])}}
    _, images = split_image_parts([{"role": "user", "content": content}])
    with pytest.raises(ImageInputError, match=r"^messages\.0\.content\.2\.image_url: ") as caught:
        load_chat_images(images, MultimodalSettings())
    assert caught.value.where == "messages.0.content.2.image_url"


def test_too_many_images_are_refused_before_any_is_decoded():
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,not-even-base64"}}] * 3
    _, images = split_image_parts([{"role": "user", "content": content}])
    with pytest.raises(ImageInputError, match=r"^messages: 3 images; at most 2"):
        load_chat_images(images, MultimodalSettings(max_images_per_prompt=2))


def test_a_remote_url_is_refused_naming_the_part():
    content = [{"type": "text", "text": "x"}, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    _, images = split_image_parts([{"role": "user", "content": content}])
    with pytest.raises(ImageInputError, match=r"^messages\.0\.content\.1\.image_url: remote image URLs are not"):
        load_chat_images(images, MultimodalSettings())
