"""GPTQ checkpoints whose metadata contradicts their tensors are refused, naming the file, tensor and type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from patchbay.interfaces import Checkpoint
from patchbay.plugins.weight_formats.group_writers import write_gptq
from patchbay.plugins.weight_formats.grouped import GPTQFormat
from patchbay.testing.end_to_end import tiny_model_dir
from patchbay.worker.model.packed_weights import build_empty_model, parameter_slots


def test_a_gptq_group_size_the_scales_do_not_have_is_an_error_naming_file_tensor_and_type(tmp_path: Path) -> None:
    import torch
    from transformers import AutoConfig

    directory = tmp_path / "gptq"
    directory.mkdir()
    config = write_gptq(tiny_model_dir(), directory, group_size=32)
    config["quantization_config"]["group_size"] = 16  # the scales hold groups of 32
    (directory / "config.json").write_text(json.dumps(config))
    slots = parameter_slots(
        build_empty_model(AutoConfig.from_pretrained(directory), dtype=torch.float32, attn_implementation="eager")
    )
    with pytest.raises(ValueError) as raised:
        dict(GPTQFormat().load(Checkpoint(directory, config), slots, dtype="float32"))
    message = str(raised.value)
    assert str(directory) in message and ".scales" in message and "GPTQ int4" in message, message
    assert "16" in message, message
