"""Writing GPTQ, AWQ and compressed-tensors checkpoints of a float model directory (round to nearest, per group).

These are the layouts AutoGPTQ, AutoAWQ and llm-compressor write (see
:mod:`patchbay.plugins.weight_formats.grouped`), made by plain rounding instead of their calibrated searches:
what the conformance kit and ``patchbay bench`` need to test and time a format on weights they control.  Every
linear weight of the decoder layers is quantized; embeddings, norms and the LM head stay as they were.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from patchbay.plugins.weight_formats.grouped import AWQ_NIBBLES

LAYER_MARK = ".layers."
"""Only linear weights of the decoder layers are quantized (what the three tools quantize by default)."""


def round_groups(
    weight: torch.Tensor, group_size: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(levels 0..15 [out, in], scales float16 [out, groups], zeros [out, groups])`` with
    ``weight ~= scale * (level - zero)`` per group of ``group_size`` inputs."""
    out_features, in_features = weight.shape
    groups = weight.float().view(out_features, in_features // group_size, group_size)
    if symmetric:
        scales = (groups.abs().amax(dim=-1) / 7.5).clamp(min=1e-8).half()
        zeros = torch.full_like(scales, 8, dtype=torch.int16)
    else:
        low, high = groups.amin(dim=-1).clamp(max=0), groups.amax(dim=-1).clamp(min=0)
        scales = ((high - low) / 15).clamp(min=1e-8).half()
        zeros = torch.round(-low / scales.float()).clamp(0, 15).to(torch.int16)
    levels = torch.round(groups / scales.float()[..., None] + zeros[..., None]).clamp(0, 15).to(torch.uint8)
    return levels.view(out_features, in_features), scales, zeros


def pack_along_rows(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """uint8 ``[rows * 8, cols]`` of 4-bit values into int32 ``[rows, cols]`` (value row ``8r + j`` in nibble
    ``order[j]`` of row ``r``)."""
    grouped = values.to(torch.int64).view(-1, 8, values.shape[1])
    packed = torch.zeros(grouped.shape[0], values.shape[1], dtype=torch.int64)
    for j, position in enumerate(order):
        packed |= grouped[:, j, :] << (4 * position)
    return _int32(packed)


def pack_along_columns(values: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """uint8 ``[rows, cols * 8]`` of 4-bit values into int32 ``[rows, cols]`` (value column ``8c + j`` in nibble
    ``order[j]`` of column ``c``)."""
    return pack_along_rows(values.t().contiguous(), order).t().contiguous()


def _int32(values: torch.Tensor) -> torch.Tensor:
    """int64 words of 32 bits as int32 (their top bit as the sign)."""
    return (values & 0xFFFFFFFF).to(torch.int64).where(values < 2**31, values - 2**32).to(torch.int32)


def _float_tensors(source: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def _quantized(name: str, value: torch.Tensor, group_size: int) -> bool:
    return (
        name.endswith(".weight")
        and LAYER_MARK in name
        and value.dim() == 2
        and value.shape[1] % group_size == 0
        and value.shape[0] % 8 == 0
    )


def _finish(source: Path, target: Path, tensors: dict[str, torch.Tensor], quantization: dict[str, object]) -> dict:
    from safetensors.torch import save_file

    save_file({name: value.contiguous() for name, value in tensors.items()}, str(target / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = quantization
    (target / "config.json").write_text(json.dumps(config, indent=1))
    for extra in source.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name != "config.json":
            shutil.copy(extra, target / extra.name)
    return dict(config)


def write_gptq(
    source: Path, target: Path, group_size: int = 32, act_order: bool = False, symmetric: bool = True
) -> dict:
    """``source`` as an AutoGPTQ checkpoint (format ``gptq``: zeros stored minus one) in ``target``; with
    ``act_order``, each layer's inputs are grouped in a shuffled order, as GPTQ's ``desc_act`` does."""
    tensors: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(0)
    for name, value in _float_tensors(source).items():
        if not _quantized(name, value, group_size):
            tensors[name] = value
            continue
        prefix = name.removesuffix(".weight")
        in_features = value.shape[1]
        order = torch.randperm(in_features, generator=generator) if act_order else torch.arange(in_features)
        levels, scales, zeros = round_groups(value[:, order], group_size, symmetric)
        group_of_input = torch.empty(in_features, dtype=torch.int32)
        group_of_input[order] = (torch.arange(in_features) // group_size).to(torch.int32)
        unshuffled = torch.empty_like(levels)
        unshuffled[:, order] = levels
        tensors[f"{prefix}.qweight"] = pack_along_rows(unshuffled.t().contiguous())
        tensors[f"{prefix}.qzeros"] = pack_along_columns((zeros - 1).clamp(0, 15).to(torch.uint8).t().contiguous())
        tensors[f"{prefix}.scales"] = scales.t().contiguous()
        tensors[f"{prefix}.g_idx"] = group_of_input
    quantization = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": act_order,
        "sym": symmetric,
        "checkpoint_format": "gptq",
    }
    return _finish(source, target, tensors, quantization)


def write_awq(source: Path, target: Path, group_size: int = 32) -> dict:
    """``source`` as an AutoAWQ checkpoint (GEMM layout, zero points) in ``target``."""
    tensors: dict[str, torch.Tensor] = {}
    for name, value in _float_tensors(source).items():
        if not _quantized(name, value, group_size):
            tensors[name] = value
            continue
        prefix = name.removesuffix(".weight")
        levels, scales, zeros = round_groups(value, group_size, symmetric=False)
        tensors[f"{prefix}.qweight"] = pack_along_columns(levels.t().contiguous(), AWQ_NIBBLES)
        tensors[f"{prefix}.qzeros"] = pack_along_columns(zeros.to(torch.uint8).t().contiguous(), AWQ_NIBBLES)
        tensors[f"{prefix}.scales"] = scales.t().contiguous()
    quantization = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm"}
    return _finish(source, target, tensors, quantization)


def write_compressed_tensors(source: Path, target: Path, group_size: int = 32, symmetric: bool = True) -> dict:
    """``source`` as an llm-compressor W4A16 checkpoint (``pack-quantized``) in ``target``."""
    tensors: dict[str, torch.Tensor] = {}
    for name, value in _float_tensors(source).items():
        if not _quantized(name, value, group_size):
            tensors[name] = value
            continue
        prefix = name.removesuffix(".weight")
        levels, scales, zeros = round_groups(value, group_size, symmetric)
        tensors[f"{prefix}.weight_packed"] = pack_along_columns(levels)
        tensors[f"{prefix}.weight_scale"] = scales
        tensors[f"{prefix}.weight_shape"] = torch.tensor(list(value.shape), dtype=torch.int64)
        if not symmetric:  # signed zero points plus 8, packed along the outputs as the weights along the inputs
            tensors[f"{prefix}.weight_zero_point"] = pack_along_rows(zeros.to(torch.uint8))
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": symmetric,
        "strategy": "group",
        "group_size": group_size,
    }
    quantization: dict[str, object] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "format": "pack-quantized"}},
        "ignore": ["lm_head"],
        "quantization_status": "compressed",
    }
    return _finish(source, target, tensors, quantization)
