"""compressed-tensors checkpoints read as the compressed-tensors library (through transformers) reads them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from patchbay.interfaces import Checkpoint, PackedWeight
from patchbay.plugins.weight_formats.grouped import CompressedTensorsFormat
from patchbay.testing.end_to_end import tiny_model_dir
from patchbay.worker.model.packed_weights import build_empty_model, parameter_slots


@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero-point"])
def test_our_w4a16_weights_are_what_compressed_tensors_decompresses(tmp_path: Path, symmetric: bool) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, CompressedTensorsConfig

    from patchbay.plugins.weight_formats.group_writers import write_compressed_tensors

    directory = tmp_path / "w4a16"
    directory.mkdir()
    write_compressed_tensors(tiny_model_dir(), directory, symmetric=symmetric)
    # compressed-tensors unpacks and dequantizes every weight as transformers loads the checkpoint.
    reference = AutoModelForCausalLM.from_pretrained(
        directory, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    ).state_dict()
    config = AutoConfig.from_pretrained(directory)
    slots = parameter_slots(build_empty_model(config, dtype=torch.float32, attn_implementation="eager"))
    weight_format = CompressedTensorsFormat()
    checkpoint = Checkpoint(directory, json.loads((directory / "config.json").read_text()))
    packed = 0
    for name, value in weight_format.load(checkpoint, slots, dtype="float32"):
        ours = value.dequantize() if isinstance(value, PackedWeight) else value
        packed += isinstance(value, PackedWeight)
        assert torch.allclose(ours.float(), reference[name].float(), rtol=1e-3, atol=1e-3), (
            f"{name}: our weights differ from compressed-tensors' by {float((ours - reference[name]).abs().max()):.3g}"
        )
    assert packed > 0
