"""The ``int8``, ``w8a8`` and ``int4`` weight formats: a float checkpoint's linears re-quantized as it loads.

They read a float model directory (safetensors without a ``quantization_config``) or a GGUF file, which they
dequantize first (so the bundled model can run them).  ``int4`` and ``w8a8`` quantize each linear to GGUF blocks
as it loads and multiply by the toolkit's block tiles, activations rounded to int8 per 32 inputs as llama.cpp
rounds them: ``int4`` to Q4_1 with each block's scale and minimum searched (:mod:`.quantizers`), ``w8a8`` to
Q8_0; the token table (and the LM head, tied to it or not) goes to Q8_0 in both, as llama.cpp's quantizer keeps
the output layer at 6 bits or more.  With ``products: tiles`` they keep the worker's earlier integer tiles
instead (per output row, or per 32 inputs on the range's ends; docs/design/cpu-fast-paths.md#integer-weights),
as does ``int8``: per output row, for steps of up to 16 rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import Checkpoint, PackedWeight, ParameterSlot, WeightFormat, WeightFormatCapabilities
from patchbay.plugins.weight_formats.block_weight import GGUFBlockWeight
from patchbay.plugins.weight_formats.gguf import GGUFFormat, GGUFOptions
from patchbay.plugins.weight_formats.quantizers import BLOCK, q4_1_blocks, q8_0_blocks
from patchbay.toolkit import block_tiles
from patchbay.toolkit.tiles import note_tiles_in_use

QUANTIZERS = {"Q4_1": q4_1_blocks, "Q8_0": q8_0_blocks}
REQUANTIZING_PRIORITY = -1
"""They read any float checkpoint, so ``model.weight_format: auto`` never picks them: they run when named."""


class RequantizingFormat(WeightFormat):
    """A float checkpoint (or a GGUF file, dequantized) whose linears the worker re-quantizes once loaded."""

    contract_version = "1.1"

    def reads(self, checkpoint: Checkpoint) -> str | None:
        if checkpoint.is_file:
            return GGUFFormat().reads(checkpoint)
        if checkpoint.quantization_method is not None:
            return f"its weights are already quantized ({checkpoint.quantization_method}); it needs float weights"
        if not any(checkpoint.path.glob("*.safetensors")):
            return "it has no safetensors weight files"
        return None

    def model_files(self, checkpoint: Checkpoint, directory: Path) -> None:
        GGUFFormat().model_files(checkpoint, directory)

    def write_checkpoint(self, source: Path, target: Path) -> Checkpoint:
        import json

        return Checkpoint(source, json.loads((source / "config.json").read_text()))

    def load(
        self, checkpoint: Checkpoint, parameters: Mapping[str, ParameterSlot], *, dtype: str
    ) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        if checkpoint.is_file:
            yield from GGUFFormat(GGUFOptions(dequantize=True)).load(checkpoint, parameters, dtype=dtype)
            return
        yield from dense_safetensors(checkpoint.path, parameters, getattr(torch, dtype))


def dense_safetensors(
    directory: Path, parameters: Mapping[str, ParameterSlot], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter from the directory's safetensors files, in ``dtype``; a missing one is an error naming it."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    where: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            where.update(dict.fromkeys(handle.keys(), path))
    for name in parameters:
        holder = where.get(name)
        if holder is None:
            raise ValueError(f"{directory}: no tensor {name} in {', '.join(file.name for file in files)}")
        with safe_open(str(holder), framework="pt") as handle:
            yield name, handle.get_tensor(name).to(dtype)


class Int8Format(RequantizingFormat):
    """int8 weights per output row, for steps of up to 16 rows."""

    contract_version = "1.1"

    def worker_scheme(self) -> str | None:
        return "int8"

    capabilities: ClassVar[WeightFormatCapabilities] = WeightFormatCapabilities(
        devices=("cpu",),
        checkpoint_formats=("safetensors", "gguf"),
        tensor_types=("int8-per-row",),
        priority=REQUANTIZING_PRIORITY,
    )


class BlockRequantizingOptions(BaseModel):
    """Options of ``model: {weight_format: {name: int4 | w8a8, options: {...}}}``."""

    model_config = ConfigDict(extra="forbid")

    products: Literal["blocks", "tiles"] = "blocks"
    """``blocks``: GGUF blocks through the toolkit's block tiles; ``tiles``: the worker's earlier integer tiles
    (one int8 scale per output row, or int4 on each group's range ends), kept to compare with."""


class BlockRequantizingFormat(RequantizingFormat):
    """A float checkpoint's linears quantized to GGUF blocks as they load (:data:`linear_type`; the token table
    and the LM head to Q8_0)."""

    Options = BlockRequantizingOptions
    options: BlockRequantizingOptions
    linear_type: ClassVar[str]
    scheme: ClassVar[str]

    def worker_scheme(self) -> str | None:
        return self.scheme if self.options.products == "tiles" else None

    def load(
        self, checkpoint: Checkpoint, parameters: Mapping[str, ParameterSlot], *, dtype: str
    ) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        tensors = super().load(checkpoint, parameters, dtype=dtype)
        if self.options.products == "tiles":
            yield from tensors
            return
        threads = torch.get_num_threads()
        note_tiles_in_use(threads)
        for name, tensor in tensors:
            slot = parameters[name]
            if slot.role == "other" or not isinstance(tensor, torch.Tensor) or tensor.shape[-1] % BLOCK:
                yield name, tensor
                continue
            block_type = "Q8_0" if slot.role == "embedding" or name.endswith("lm_head.weight") else self.linear_type
            rows, inputs = tensor.shape
            raw = QUANTIZERS[block_type](tensor)
            tiles = block_tiles.pack_gguf(block_type, raw, rows, inputs, name=name, threads=threads)
            yield name, GGUFBlockWeight(tiles, threads)


class W8A8Format(BlockRequantizingFormat):
    """int8 weights (Q8_0 blocks) times activations rounded to int8, every step."""

    contract_version = "1.1"

    linear_type, scheme = "Q8_0", "w8a8"
    capabilities: ClassVar[WeightFormatCapabilities] = WeightFormatCapabilities(
        devices=("cpu",),
        checkpoint_formats=("safetensors", "gguf"),
        tensor_types=("Q8_0", "int8-per-row"),
        shards=True,
        integer_activations=True,
        priority=REQUANTIZING_PRIORITY,
    )


class Int4Format(BlockRequantizingFormat):
    """int4 weights per 32 input features (Q4_1 blocks, scale and minimum searched), every step."""

    contract_version = "1.1"

    linear_type, scheme = "Q4_1", "int4"
    capabilities: ClassVar[WeightFormatCapabilities] = WeightFormatCapabilities(
        devices=("cpu",),
        checkpoint_formats=("safetensors", "gguf"),
        tensor_types=("Q4_1", "Q8_0", "int4-g32-asym"),
        shards=True,
        integer_activations=True,
        priority=REQUANTIZING_PRIORITY,
    )
