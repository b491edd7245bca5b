"""GPTQ checkpoints: act-order loads what the checkpoint stands for; metadata that contradicts the tensors is
refused, naming the file, tensor and type."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from patchbay.interfaces import Checkpoint
from patchbay.plugins.weight_formats.group_writers import write_gptq
from patchbay.plugins.weight_formats.grouped import GPTQFormat
from patchbay.testing.end_to_end import tiny_model_dir
from patchbay.worker.model.packed_weights import build_empty_model, parameter_slots


def test_a_gptq_group_size_the_scales_do_not_have_is_an_error_naming_file_tensor_and_type(tmp_path: Path) -> None:
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


def _gptq_reference(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor:
    """The float weight ``[out, in]`` a GPTQ linear stands for, read straight from AutoGPTQ's layout:
    ``w[k, n] = scales[g_idx[k], n] * (q[k, n] - (stored_zero[g_idx[k], n] + 1))``."""
    qweight, qzeros = tensors[f"{prefix}.qweight"].to(torch.int64), tensors[f"{prefix}.qzeros"].to(torch.int64)
    scales, g_idx = tensors[f"{prefix}.scales"].float(), tensors[f"{prefix}.g_idx"].long()
    levels = torch.stack([(qweight >> (4 * j)) & 15 for j in range(8)], dim=1).reshape(-1, qweight.shape[1])
    zeros = torch.stack([(qzeros >> (4 * j)) & 15 for j in range(8)], dim=2).reshape(qzeros.shape[0], -1) + 1
    return (scales[g_idx] * (levels - zeros[g_idx]).float()).t()


def test_act_order_loads_the_weights_the_checkpoint_stands_for(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoConfig

    directory = tmp_path / "gptq-act-order"
    directory.mkdir()
    config = write_gptq(tiny_model_dir(), directory, group_size=32, act_order=True, symmetric=False)
    tensors = load_file(str(directory / "model.safetensors"))
    slots = parameter_slots(
        build_empty_model(AutoConfig.from_pretrained(directory), dtype=torch.float32, attn_implementation="eager")
    )
    loaded = dict(GPTQFormat().load(Checkpoint(directory, config), slots, dtype="float32"))
    checked = 0
    for name, value in loaded.items():
        prefix = name.removesuffix(".weight")
        if f"{prefix}.g_idx" not in tensors:
            continue
        g_idx = tensors[f"{prefix}.g_idx"].long()
        assert not torch.equal(g_idx, torch.arange(len(g_idx)) // 32), f"{prefix}: groups in input order"
        expected = _gptq_reference(tensors, prefix)
        got = value.dequantize()
        assert (got - expected).norm() <= 1e-3 * expected.norm(), prefix
        inputs = torch.randn(5, expected.shape[1], generator=torch.Generator().manual_seed(checked))
        product, oracle = value.product(inputs, None), inputs @ expected.t()
        assert (product - oracle).norm() <= 3e-2 * oracle.norm(), prefix
        checked += 1
    assert checked >= 4
