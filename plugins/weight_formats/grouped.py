"""The ``gptq``, ``awq`` and ``compressed-tensors`` weight formats: int4 groups (and compressed-tensors' int8
channels) from safetensors checkpoints, repacked into GGUF blocks without a float copy.

What each checkpoint stores for a linear ``X`` (``K`` inputs, ``N`` outputs, groups of ``G`` inputs):

- GPTQ (AutoGPTQ / GPTQModel): ``X.qweight`` int32 ``[K/8, N]`` (eight levels per word along the inputs, low nibble
  first), ``X.qzeros`` int32 ``[K/G, N/8]`` (along the outputs; the ``gptq`` checkpoint format stores each zero
  minus one, ``gptq_v2`` the zero itself), ``X.scales`` ``[K/G, N]``, ``X.g_idx`` ``[K]`` (each input's group:
  not in input order under act-order);
- AWQ (AutoAWQ's GEMM layout): ``X.qweight`` int32 ``[K, N/8]`` and ``X.qzeros`` ``[K/G, N/8]`` along the outputs
  in AWQ's nibble order (value ``j`` of a word in nibble ``(0, 4, 1, 5, 2, 6, 3, 7)[j]``), ``X.scales`` ``[K/G, N]``;
- compressed-tensors ``pack-quantized`` (llm-compressor's W4A16): ``X.weight_packed`` int32 ``[N, K/8]`` of levels
  plus 8, ``X.weight_scale`` ``[N, K/G]`` and, asymmetric, ``X.weight_zero_point``; ``int-quantized`` (W8A8):
  ``X.weight`` int8 ``[N, K]`` and ``X.weight_scale`` ``[N, 1]``, activations rounded per token (here per 32
  inputs, finer).

Every weight is ``s * (q - z)``: int4 groups become Q4_0 (symmetric) or Q4_1 blocks
(:mod:`patchbay.plugins.weight_formats.int4_groups`), int8 channels Q8_0 blocks with the channel's scale, and all
multiply as the block tiles do.  Tensors the checkpoint keeps in float (embeddings, norms, an unquantized LM head)
load as plain tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from patchbay.interfaces import Checkpoint, PackedWeight, ParameterSlot, WeightFormat, WeightFormatCapabilities
from patchbay.plugins.weight_formats.block_weight import GGUFBlockWeight
from patchbay.plugins.weight_formats.int4_groups import (
    InputOrder,
    Int4Groups,
    unpack_along_columns,
    unpack_along_rows,
)
from patchbay.toolkit import block_tiles
from patchbay.toolkit.tiles import note_tiles_in_use

AWQ_NIBBLES = (0, 4, 1, 5, 2, 6, 3, 7)
"""Where AWQ keeps value ``j`` of a packed word: in nibble ``AWQ_NIBBLES[j]``."""


class SafetensorsIndex:
    """Every tensor of a checkpoint directory's safetensors files, by name, read on demand."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.directory = directory
        self.files: dict[str, Path] = {}
        for path in sorted(directory.glob("*.safetensors")):
            with safe_open(str(path), framework="pt") as handle:
                self.files.update(dict.fromkeys(handle.keys(), path))

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def get(self, name: str) -> torch.Tensor:
        """The tensor ``name``; a missing one is an error naming the directory and the tensor."""
        from safetensors import safe_open

        path = self.files.get(name)
        if path is None:
            raise ValueError(f"{self.directory}: no tensor {name} in its safetensors files")
        with safe_open(str(path), framework="pt") as handle:
            return handle.get_tensor(name)


class GroupedFormat(WeightFormat):
    """What the three formats share: the checkpoint's ``quantization_config``, and plain tensors by name."""

    contract_version = "1.1"
    method: ClassVar[str] = ""
    """``quantization_config.quant_method`` of the checkpoints this format reads."""

    def reads(self, checkpoint: Checkpoint) -> str | None:
        if checkpoint.is_file:
            return "not a model directory"
        if checkpoint.quantization_method != self.method:
            return f"its config.json names no {self.method} quantization_config"
        return self.config_problem(dict(checkpoint.config["quantization_config"]))

    def config_problem(self, config: dict[str, Any]) -> str | None:
        """Why this format cannot run a checkpoint of ``quantization_config`` ``config`` (None: it can)."""
        return None

    def load(
        self, checkpoint: Checkpoint, parameters: Mapping[str, ParameterSlot], *, dtype: str
    ) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        index = SafetensorsIndex(checkpoint.path)
        config = dict(checkpoint.config["quantization_config"])
        threads = torch.get_num_threads()
        note_tiles_in_use(threads)
        for name, slot in parameters.items():
            if name in index:
                yield name, index.get(name).to(getattr(torch, dtype))
                continue
            prefix = name.removesuffix(".weight")
            if slot.role != "linear" or prefix == name:
                raise ValueError(f"{checkpoint.path}: no tensor {name} in its safetensors files")
            yield name, self.packed(index, prefix, slot.shape, config, threads)

    def packed(
        self, index: SafetensorsIndex, prefix: str, shape: tuple[int, ...], config: dict[str, Any], threads: int
    ) -> PackedWeight:
        """The quantized linear ``prefix`` of ``shape`` ``[out, in]``, as block tiles."""
        raise NotImplementedError

    @staticmethod
    def _blocks_weight(groups: Int4Groups, name: str, threads: int, order: InputOrder | None = None) -> GGUFBlockWeight:
        kind, raw = groups.gguf_blocks()
        out_features, in_features = groups.levels.shape
        tiles = block_tiles.pack_gguf(kind, raw, out_features, in_features, name=name, threads=threads)
        return GGUFBlockWeight(tiles, threads, order)


def _int4_problem(config: dict[str, Any], method: str) -> str | None:
    bits = config.get("bits", config.get("w_bit"))
    if bits != 4:
        return f"{method} checkpoints of {bits} bits are not supported (4 bits are)"
    group = config.get("group_size", config.get("q_group_size", -1))
    if group != -1 and (not isinstance(group, int) or group <= 0 or group % 32):
        return f"{method} group size {group} is not a multiple of 32"
    return None


def _check_groups(where: str, scales: torch.Tensor, groups: int, group_size: int, in_features: int) -> None:
    if groups * group_size != in_features:
        raise ValueError(
            f"{where}: {scales.shape[0]} groups of scales for {in_features} inputs, but the config's group size is "
            f"{group_size} (int4 groups)"
        )


class GPTQFormat(GroupedFormat):
    """GPTQ checkpoints (AutoGPTQ, GPTQModel): int4 groups, act-order included."""

    contract_version = "1.1"

    method = "gptq"
    capabilities: ClassVar[WeightFormatCapabilities] = WeightFormatCapabilities(
        devices=("cpu",),
        dtypes=("float32", "bfloat16"),
        checkpoint_formats=("gptq",),
        tensor_types=("Q4_0", "Q4_1"),
        shards=True,
        integer_activations=True,
        priority=90,
    )

    def config_problem(self, config: dict[str, Any]) -> str | None:
        return _int4_problem(config, "GPTQ")

    def write_checkpoint(self, source: Path, target: Path) -> Checkpoint:
        from patchbay.plugins.weight_formats.group_writers import write_gptq

        return Checkpoint(target, write_gptq(source, target, act_order=False, symmetric=False))

    def packed(
        self, index: SafetensorsIndex, prefix: str, shape: tuple[int, ...], config: dict[str, Any], threads: int
    ) -> PackedWeight:
        out_features, in_features = shape
        where = f"{index.directory}: {prefix}.qweight (GPTQ int4)"
        levels = unpack_along_rows(index.get(f"{prefix}.qweight")).t()  # [N, K]
        if tuple(levels.shape) != (out_features, in_features):
            raise ValueError(f"{where} holds {list(levels.shape)} levels; the model's weight is {list(shape)}")
        scales = index.get(f"{prefix}.scales").t().to(torch.float16)  # [N, groups]
        zeros = unpack_along_columns(index.get(f"{prefix}.qzeros")).t()[:out_features].to(torch.int16)
        if config.get("checkpoint_format", "gptq") != "gptq_v2":
            zeros = zeros + 1  # AutoGPTQ's format stores each zero minus one
        groups = scales.shape[1]
        group_size = config.get("group_size", -1)
        group_size = in_features if group_size == -1 else group_size
        _check_groups(f"{index.directory}: {prefix}.scales (GPTQ int4)", scales.t(), groups, group_size, in_features)
        group_of_input = (
            index.get(f"{prefix}.g_idx") if f"{prefix}.g_idx" in index else torch.arange(in_features) // group_size
        )
        order = InputOrder(group_of_input)
        levels = order.columns(levels)
        zeros_or_none = None if bool((zeros == 8).all()) else zeros
        return self._blocks_weight(Int4Groups(levels, scales, zeros_or_none), prefix, threads, order)


class AWQFormat(GroupedFormat):
    """AWQ checkpoints (AutoAWQ's GEMM layout): int4 groups with zero points."""

    contract_version = "1.1"

    method = "awq"
    capabilities: ClassVar[WeightFormatCapabilities] = WeightFormatCapabilities(
        devices=("cpu",),
        dtypes=("float32", "bfloat16"),
        checkpoint_formats=("awq",),
        tensor_types=("Q4_0", "Q4_1"),
        shards=True,
        integer_activations=True,
        priority=90,
    )

    def config_problem(self, config: dict[str, Any]) -> str | None:
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            return f"AWQ's {version} layout is not supported (the GEMM layout is)"
        return _int4_problem(config, "AWQ")

    def write_checkpoint(self, source: Path, target: Path) -> Checkpoint:
        from patchbay.plugins.weight_formats.group_writers import write_awq

        return Checkpoint(target, write_awq(source, target))

    def packed(
        self, index: SafetensorsIndex, prefix: str, shape: tuple[int, ...], config: dict[str, Any], threads: int
    ) -> PackedWeight:
        out_features, in_features = shape
        levels = unpack_along_columns(index.get(f"{prefix}.qweight"), AWQ_NIBBLES).t().contiguous()  # [N, K]
        if tuple(levels.shape) != (out_features, in_features):
            raise ValueError(
                f"{index.directory}: {prefix}.qweight (AWQ int4) holds {list(levels.shape)} levels; the model's "
                f"weight is {list(shape)}"
            )
        scales = index.get(f"{prefix}.scales").t().to(torch.float16)
        zeros = unpack_along_columns(index.get(f"{prefix}.qzeros"), AWQ_NIBBLES).t().to(torch.int16)
        group_size = config.get("group_size", config.get("q_group_size", -1))
        group_size = in_features if group_size == -1 else group_size
        _check_groups(
            f"{index.directory}: {prefix}.scales (AWQ int4)", scales.t(), scales.shape[1], group_size, in_features
        )
        return self._blocks_weight(Int4Groups(levels, scales, zeros), prefix, threads)


class CompressedTensorsFormat(GroupedFormat):
    """compressed-tensors checkpoints (llm-compressor): ``pack-quantized`` int4 groups and ``int-quantized`` int8."""

    contract_version = "1.1"

    method = "compressed-tensors"
    capabilities: ClassVar[WeightFormatCapabilities] = WeightFormatCapabilities(
        devices=("cpu",),
        dtypes=("float32", "bfloat16"),
        checkpoint_formats=("compressed-tensors",),
        tensor_types=("Q4_0", "Q4_1", "Q8_0"),
        shards=True,
        integer_activations=True,
        priority=90,
    )

    def config_problem(self, config: dict[str, Any]) -> str | None:
        formats = {str(config.get("format"))}
        for group in (config.get("config_groups") or {}).values():
            formats.add(str(group.get("format", config.get("format"))))
            weights = group.get("weights") or {}
            if weights.get("type", "int") != "int":
                return f"compressed-tensors {weights.get('type')} weights are not supported (int weights are)"
            if weights.get("num_bits") not in (4, 8):
                return f"compressed-tensors weights of {weights.get('num_bits')} bits are not supported (4 and 8 are)"
        unsupported = formats - {"pack-quantized", "int-quantized", "None"}
        if unsupported:
            return f"compressed-tensors format {', '.join(sorted(unsupported))} is not supported"
        return None

    def write_checkpoint(self, source: Path, target: Path) -> Checkpoint:
        from patchbay.plugins.weight_formats.group_writers import write_compressed_tensors

        return Checkpoint(target, write_compressed_tensors(source, target, symmetric=False))

    def packed(
        self, index: SafetensorsIndex, prefix: str, shape: tuple[int, ...], config: dict[str, Any], threads: int
    ) -> PackedWeight:
        out_features, in_features = shape
        if f"{prefix}.weight_packed" in index:
            levels = unpack_along_columns(index.get(f"{prefix}.weight_packed"))[:, :in_features].contiguous()
            scales = index.get(f"{prefix}.weight_scale").to(torch.float16)  # [N, groups]
            group_size = in_features // scales.shape[1]
            _check_groups(
                f"{index.directory}: {prefix}.weight_scale (compressed-tensors int4)",
                scales,
                scales.shape[1],
                group_size,
                in_features,
            )
            zeros = None
            if f"{prefix}.weight_zero_point" in index:
                stored = index.get(f"{prefix}.weight_zero_point")
                if stored.dtype == torch.int32:  # packed along the outputs, 8 per word, each stored plus 8
                    zeros = unpack_along_rows(stored)[:out_features].to(torch.int16)
                else:  # one signed int8 per output and group
                    zeros = stored.to(torch.int16) + 8
            return self._blocks_weight(Int4Groups(levels, scales, zeros), prefix, threads)
        if f"{prefix}.weight_scale" in index and index.get(f"{prefix}.weight_scale").numel() == out_features:
            return self._int8_channels(index, prefix, shape, threads)
        raise ValueError(
            f"{index.directory}: no quantized tensors for {prefix} (weight_packed, or weight with weight_scale)"
        )

    def _int8_channels(
        self, index: SafetensorsIndex, prefix: str, shape: tuple[int, ...], threads: int
    ) -> PackedWeight:
        out_features, in_features = shape
        if in_features % 32:
            raise ValueError(f"{index.directory}: {prefix}.weight (int8): {in_features} inputs are no multiple of 32")
        levels = index.get(f"{prefix}.weight").to(torch.int8).reshape(-1, 32)
        scales = index.get(f"{prefix}.weight_scale").to(torch.float16).reshape(-1, 1)
        scales = scales.repeat_interleave(in_features // 32, dim=0)
        blocks = torch.cat([scales.view(torch.uint8), levels.view(torch.uint8)], dim=1).reshape(out_features, -1)
        tiles = block_tiles.pack_gguf(
            "Q8_0", np.ascontiguousarray(blocks.numpy()), out_features, in_features, name=prefix, threads=threads
        )
        return GGUFBlockWeight(tiles, threads)
