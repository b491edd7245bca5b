"""The tiny vision-language test models: they build offline, and their images really steer generation."""

from __future__ import annotations

from pathlib import Path

from mm_models import expanded_prompt_text, test_image, transformers_greedy_mm


def test_placeholder_counts_follow_the_image_size(tiny_qwen2_vl: Path, tiny_llava: Path) -> None:
    small, wide = test_image(32, 32, 0), test_image(64, 48, 0)
    qwen = expanded_prompt_text(tiny_qwen2_vl, "<|image_pad|>x<|image_pad|>", [small, wide])
    assert qwen == "<|image_pad|>" * 4 + "x" + "<|image_pad|>" * 12
    assert expanded_prompt_text(tiny_llava, "<image>", [wide]) == "<image>" * 16


def test_the_image_changes_the_greedy_tokens(tiny_qwen2_vl: Path, tiny_llava: Path) -> None:
    for model_dir, marker in ((tiny_qwen2_vl, "<|vision_start|><|image_pad|><|vision_end|>"), (tiny_llava, "<image>")):
        prompt = f"Look: {marker} what is it?"
        first = transformers_greedy_mm(model_dir, prompt, [test_image(32, 32, 1)], 6)
        second = transformers_greedy_mm(model_dir, prompt, [test_image(32, 32, 2)], 6)
        assert first != second, model_dir
