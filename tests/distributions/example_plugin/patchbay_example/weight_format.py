"""A toy 4-bit weight format: every linear weight as levels 0..15 per group of 32 inputs, with a scale and minimum.

A checkpoint of this format is a model directory whose ``config.json`` says ``quantization_config:
{quant_method: example_int4}`` and whose ``int4.safetensors`` holds, for each linear weight ``NAME``,
``NAME.levels`` (uint8, one level a byte: a toy keeps it simple), ``NAME.scales`` and ``NAME.minimums``
(float32, one per row and group); every other tensor is kept in float32 under its own name.  Products dequantize
and multiply in torch: slow, and correct.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import ClassVar

import torch

from patchbay.interfaces import Checkpoint, PackedWeight, ParameterSlot, WeightFormat, WeightFormatCapabilities

GROUP = 32
LEVELS = 15
METHOD = "example_int4"
FILE = "int4.safetensors"


class Int4Weight(PackedWeight):
    """Levels 0..15 per group of 32 inputs: ``w = level * scale + minimum``."""

    def __init__(self, levels: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> None:
        self.levels, self.scales, self.minimums = levels, scales, minimums
        self.out_features, self.in_features = levels.shape
        self.tensor_type = "int4-g32"

    def dequantize(self) -> torch.Tensor:
        grouped = self.levels.view(self.out_features, -1, GROUP).float()
        return (grouped * self.scales[..., None] + self.minimums[..., None]).view(self.out_features, self.in_features)

    def product(self, inputs: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        output = inputs.float() @ self.dequantize().T
        if bias is not None:
            output = output + bias.float()
        return output.to(inputs.dtype)

    def shard(self, dim: int, index: int, count: int) -> PackedWeight:
        if dim == 0:
            size = self.out_features // count
            part = slice(index * size, (index + 1) * size)
            return Int4Weight(self.levels[part], self.scales[part], self.minimums[part])
        size = self.in_features // count
        if size % GROUP:
            raise ValueError(f"int4 groups hold {GROUP} inputs; {size} inputs per part cut a group")
        groups = slice(index * size // GROUP, (index + 1) * size // GROUP)
        return Int4Weight(
            self.levels[:, index * size : (index + 1) * size], self.scales[:, groups], self.minimums[:, groups]
        )


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` as levels, scales and minimums: each group's range cut into 15 steps."""
    grouped = weight.float().view(weight.shape[0], -1, GROUP)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scales = ((high - low) / LEVELS).clamp(min=1e-12)
    levels = torch.round((grouped - low[..., None]) / scales[..., None]).clamp(0, LEVELS).to(torch.uint8)
    return levels.view(weight.shape), scales, low


class ExampleInt4Format(WeightFormat):
    """A toy 4-bit format (an example plugin)."""

    contract_version = "1.1"
    capabilities: ClassVar[WeightFormatCapabilities] = WeightFormatCapabilities(
        devices=("cpu",),
        dtypes=("float32", "bfloat16"),
        checkpoint_formats=(METHOD,),
        tensor_types=("int4-g32",),
        shards=True,
    )

    def reads(self, checkpoint: Checkpoint) -> str | None:
        if checkpoint.quantization_method != METHOD:
            return f"its config.json names no {METHOD} quantization_config"
        if not (checkpoint.path / FILE).is_file():
            return f"it has no {FILE}"
        return None

    def write_checkpoint(self, source: Path, target: Path) -> Checkpoint:
        from safetensors import safe_open
        from safetensors.torch import save_file

        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(source / "model.safetensors"), framework="pt") as handle:
            for name in handle.keys():
                value = handle.get_tensor(name)
                if value.dim() == 2 and value.shape[1] % GROUP == 0 and not name.endswith("embed_tokens.weight"):
                    levels, scales, minimums = quantize(value)
                    tensors.update({f"{name}.levels": levels, f"{name}.scales": scales, f"{name}.minimums": minimums})
                else:
                    tensors[name] = value.float().contiguous()
        save_file(tensors, str(target / FILE))
        config = json.loads((source / "config.json").read_text())
        config["quantization_config"] = {"quant_method": METHOD}
        (target / "config.json").write_text(json.dumps(config))
        for extra in source.iterdir():
            if extra.name.startswith("tokenizer") or extra.name in (
                "generation_config.json",
                "special_tokens_map.json",
            ):
                shutil.copy(extra, target / extra.name)
        return Checkpoint(target, config)

    def load(
        self, checkpoint: Checkpoint, parameters: Mapping[str, ParameterSlot], *, dtype: str
    ) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        from safetensors import safe_open

        with safe_open(str(checkpoint.path / FILE), framework="pt") as handle:
            names = set(handle.keys())
            for name in parameters:
                if f"{name}.levels" in names:
                    yield (
                        name,
                        Int4Weight(
                            handle.get_tensor(f"{name}.levels"),
                            handle.get_tensor(f"{name}.scales"),
                            handle.get_tensor(f"{name}.minimums"),
                        ),
                    )
                elif name in names:
                    yield name, handle.get_tensor(name).to(getattr(torch, dtype))
                else:
                    raise ValueError(f"{checkpoint.path / FILE}: no tensor {name}")
