"""M-RoPE positions of a Qwen2-VL prompt equal transformers' ``get_rope_index``, rope delta included."""

from __future__ import annotations

from pathlib import Path

import torch

from mm_models import test_image
from patchbay.engine.multimodal_inputs import ImageInputs
from patchbay.worker.multimodal.mrope import MRopePositions


def test_positions_and_delta_equal_transformers_get_rope_index(tiny_qwen2_vl: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer, Qwen2VLForConditionalGeneration

    config = AutoConfig.from_pretrained(tiny_qwen2_vl)
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_vl)
    marker = "<|vision_start|><|image_pad|><|vision_end|>"
    token_ids = tokenizer.encode(f"Two images: {marker} then {marker} and text after")
    images = [test_image(64, 48, 1), test_image(32, 64, 2)]
    expanded, features = ImageInputs(tiny_qwen2_vl, config, "Qwen2VLForConditionalGeneration").process(
        "r", token_ids, images
    )
    ours = MRopePositions(len(expanded), features, config.vision_config.spatial_merge_size)

    model = Qwen2VLForConditionalGeneration.from_pretrained(tiny_qwen2_vl, dtype=torch.float32)
    ids = torch.tensor([expanded])
    grids = torch.cat([feature.data["image_grid_thw"] for feature in features])
    theirs, delta = model.model.get_rope_index(ids, (ids == config.image_token_id).int(), image_grid_thw=grids)
    assert ours.prompt.tolist() == theirs[:, 0].tolist()
    assert ours.delta == int(delta)
    # Past the prompt: index + delta on every axis.
    assert ours.of(len(expanded), len(expanded) + 2).tolist() == [[len(expanded) + ours.delta + i for i in (0, 1)]] * 3
