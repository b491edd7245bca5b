"""Tiny random-weight vision-language models for tests, saved with their processors, built offline in seconds.

Two families: a Qwen2-VL (M-RoPE positions, a patch-merging vision tower, ``<|image_pad|>`` placeholders
framed by ``<|vision_start|>``/``<|vision_end|>``) and a LLaVA (a CLIP vision tower, a Llama text model, an
``<image>`` placeholder). Both reuse the bundled model's tokenizer with the family's special tokens added, and
carry a chat template that places images where the message's ``{"type": "image"}`` parts are.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from patchbay.toolkit.model_files import bundled_gguf, convert_gguf

QWEN2_VL_SPECIAL_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
LLAVA_IMAGE_TOKEN = "<image>"

CHAT_TEMPLATE_WITH_IMAGES = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' or part['type'] == 'image_url' %}{{ IMAGE }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML with image parts; ``IMAGE`` is replaced by each family's image marker text."""


def _tokenizer_with(tokens: tuple[str, ...]) -> Any:
    """The bundled model's tokenizer with ``tokens`` added as special tokens (appended to its vocabulary)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(convert_gguf(bundled_gguf()))
    tokenizer.add_special_tokens({"additional_special_tokens": list(tokens)})
    return tokenizer


def _text_settings(tokenizer: Any) -> dict[str, Any]:
    """The text model's shape shared by both families: 4 layers, 64 wide, grouped-query attention."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
        "initializer_range": 0.2,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
    }


def _save(model_class: Any, config: Any, processor: Any, directory: Path) -> Path:
    """Initialise ``model_class`` from ``config`` with seed 0 in float32 and save it with ``processor``.

    ``processor`` is anything with ``save_pretrained`` (a processor or a tokenizer).
    """
    torch.manual_seed(0)
    model = model_class._from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    processor.save_pretrained(directory)
    return directory


def build_tiny_qwen2_vl(directory: Path) -> Path:
    """Save a tiny random Qwen2-VL (M-RoPE) with its ``Qwen2VLProcessor`` to ``directory``.

    8-pixel patches merged 2x2: a 32x32 image becomes 4 placeholder tokens, a 64x48 one 12; images are
    resized to at most 64x64 pixels (16 tokens). Saved as tokenizer (chat template included) and image
    processor, not as a ``Qwen2VLProcessor``: that class insists on a video processor, which needs torchvision,
    absent here (and videos are no input patchbay takes).
    """
    from transformers import (
        Qwen2VLConfig,
        Qwen2VLForConditionalGeneration,
        Qwen2VLImageProcessorPil,
    )

    tokenizer = _tokenizer_with(QWEN2_VL_SPECIAL_TOKENS)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in QWEN2_VL_SPECIAL_TOKENS}
    text = _text_settings(tokenizer)
    head_dim = text["hidden_size"] // text["num_attention_heads"]
    config = Qwen2VLConfig(
        text_config={
            **text,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        },
        vision_config={
            "depth": 2,
            "embed_dim": 32,
            "hidden_size": text["hidden_size"],
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 8,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "initializer_range": 0.2,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    assert sum(config.text_config.rope_parameters["mrope_section"]) == head_dim // 2
    pixels = {"min_pixels": 16 * 16, "max_pixels": 64 * 64, "patch_size": 8, "merge_size": 2, "temporal_patch_size": 2}
    tokenizer.chat_template = CHAT_TEMPLATE_WITH_IMAGES.replace(
        "IMAGE", "'<|vision_start|><|image_pad|><|vision_end|>'"
    )
    _save(Qwen2VLForConditionalGeneration, config, tokenizer, directory)
    Qwen2VLImageProcessorPil(**pixels).save_pretrained(directory)
    return directory


def build_tiny_llava(directory: Path) -> Path:
    """Save a tiny random LLaVA (CLIP vision tower, Llama text model) with its ``LlavaProcessor`` to ``directory``.

    Images are resized and cropped to 32x32 and cut into 8-pixel patches: 16 ``<image>`` tokens each.
    """
    from transformers import (
        CLIPImageProcessorPil,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
    )

    tokenizer = _tokenizer_with((LLAVA_IMAGE_TOKEN,))
    tokenizer.chat_template = CHAT_TEMPLATE_WITH_IMAGES.replace("IMAGE", f"'{LLAVA_IMAGE_TOKEN}'")
    image_size, patch_size = 32, 8
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=image_size,
        patch_size=patch_size,
        projection_dim=32,
        initializer_range=0.2,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=LlamaConfig(**_text_settings(tokenizer)),
        image_token_index=tokenizer.convert_tokens_to_ids(LLAVA_IMAGE_TOKEN),
        image_seq_length=(image_size // patch_size) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
    )
    processor = LlavaProcessor(
        image_processor=CLIPImageProcessorPil(
            size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
        ),
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=tokenizer.chat_template,
    )
    return _save(LlavaForConditionalGeneration, config, processor, directory)


def test_image(width: int, height: int, seed: int) -> Any:
    """A reproducible random RGB ``PIL.Image`` of ``width`` x ``height`` pixels."""
    from PIL import Image

    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), mode="RGB")


test_image.__test__ = False  # type: ignore[attr-defined]  # a helper, not a pytest test


def expanded_prompt_text(model_dir: Path, prompt: str, images: list[Any]) -> str:
    """``prompt`` with each image marker repeated as often as the model's processor would, done on the text.

    The string-level expansion the Hugging Face processors do, written independently of patchbay's
    token-level one so the tests compare two derivations.
    """
    from transformers import AutoConfig, AutoImageProcessor

    config = AutoConfig.from_pretrained(model_dir)
    if not images:
        return prompt
    if config.model_type == "qwen2_vl":
        marker = "<|image_pad|>"
        grids = AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt")["image_grid_thw"]
        merge = config.vision_config.spatial_merge_size
        counts = [int(grid.prod()) // merge**2 for grid in grids]
    else:
        marker = LLAVA_IMAGE_TOKEN
        counts = [config.image_seq_length] * len(images)
    pieces = prompt.split(marker)
    assert len(pieces) == len(images) + 1, "one marker per image"
    return pieces[0] + "".join(marker * count + piece for count, piece in zip(counts, pieces[1:], strict=True))


def transformers_greedy_mm(model_dir: Path, prompt: str, images: list[Any], num_tokens: int) -> list[int]:
    """What transformers' own ``generate`` produces for ``prompt`` with ``images``, greedily, ``num_tokens`` long.

    As patchbay's ``ignore_eos``: the end-of-sequence token may be chosen and generation goes on past it.
    """
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    ids = tokenizer(expanded_prompt_text(model_dir, prompt, images), return_tensors="pt")["input_ids"]
    inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if images:
        inputs.update(AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt"))
        if model.config.model_type == "qwen2_vl":  # what Qwen2-VL's processor adds: where M-RoPE's image grids go
            inputs["mm_token_type_ids"] = (ids == model.config.image_token_id).int()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=num_tokens, do_sample=False, pad_token_id=0)
    return out[0, ids.shape[1] :].tolist()
