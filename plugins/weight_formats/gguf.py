"""The ``gguf`` weight format: a GGUF file's quantized blocks multiplied as the file holds them.

The file is memory-mapped with the ``gguf`` package; each quantized linear weight (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0
and the k-quants Q2_K to Q6_K) is repacked, bit for bit, into the toolkit's block tiles
(:mod:`patchbay.toolkit.block_tiles`), whose product rounds the activations to int8 per 32 inputs as llama.cpp
does; the token table stays packed too and is looked up row by row, and serves as the LM head where the file
ties them.  F32, F16 and BF16 tensors load as plain tensors in the run's dtype.  The config and tokenizer come
from the file's metadata through transformers' GGUF reader.  With ``dequantize: true`` every weight loads as a
float tensor instead (the float copy transformers would make, for comparisons with it).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict

from patchbay.interfaces import Checkpoint, PackedWeight, ParameterSlot, WeightFormat, WeightFormatCapabilities
from patchbay.plugins.weight_formats.block_weight import GGUFBlockWeight
from patchbay.plugins.weight_formats.gguf_names import (
    NORM_OFFSET_ARCHITECTURES,
    ROW_PERMUTED_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    gguf_name,
    query_key_rows,
)
from patchbay.toolkit import block_tiles
from patchbay.toolkit.tiles import note_tiles_in_use

MAGIC = b"GGUF"
PLAIN_TYPES = ("F32", "F16", "BF16")


class GGUFOptions(BaseModel):
    """Options of ``model: {weight_format: {name: gguf, options: {...}}}``."""

    model_config = ConfigDict(extra="forbid")

    dequantize: bool = False
    """Load every weight as a float tensor in the run's dtype instead of packed (what transformers makes of the
    file; a float copy, several times the file's size)."""
    write_type: str = "Q4_0"
    """The tensor type :meth:`GGUFFormat.write_checkpoint` quantizes to (``Q4_0``, ``Q4_1``, ``Q5_0``,
    ``Q5_1``, ``Q8_0``, ``F16``); the tokenizer is the bundled model's."""


class GGUFFormat(WeightFormat):
    """GGUF files as llama.cpp and Ollama ship them."""

    contract_version = "1.1"
    Options = GGUFOptions
    options: GGUFOptions
    capabilities: ClassVar[WeightFormatCapabilities] = WeightFormatCapabilities(
        devices=("cpu",),
        dtypes=("float32", "bfloat16"),
        checkpoint_formats=("gguf",),
        tensor_types=(*block_tiles.BLOCK_FORMATS, *PLAIN_TYPES),
        shards=True,
        integer_activations=True,
        priority=100,
    )

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return block_tiles.block_tiles_unavailable()

    def reads(self, checkpoint: Checkpoint) -> str | None:
        path = checkpoint.path
        if not path.is_file():
            return "not a file (a GGUF checkpoint is one .gguf file)"
        with path.open("rb") as file:
            if file.read(4) != MAGIC:
                return f"{path.name} does not start with GGUF's magic bytes"
        return None

    def model_files(self, checkpoint: Checkpoint, directory: Path) -> None:
        from transformers import AutoConfig, AutoTokenizer, GenerationConfig

        path = checkpoint.path
        architecture = _architecture(_reader(path))
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{path}: GGUF architecture {architecture!r} is not one patchbay maps onto transformers' modules "
                f"(supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))})"
            )
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        model_class = _causal_lm_class(config)
        config.architectures = [model_class]
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.save_pretrained(directory)
        GenerationConfig.from_model_config(config).save_pretrained(directory)
        AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(directory)

    def write_checkpoint(self, source: Path, target: Path) -> Checkpoint:
        from patchbay.plugins.weight_formats.gguf_writer import write_llama_gguf
        from patchbay.toolkit.model_files import bundled_gguf

        path = write_llama_gguf(
            source, target / f"{source.name}.{self.options.write_type}.gguf", bundled_gguf(), self.options.write_type
        )
        return Checkpoint(path)

    def load(
        self, checkpoint: Checkpoint, parameters: Mapping[str, ParameterSlot], *, dtype: str
    ) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
        import gguf

        path = checkpoint.path
        reader = _reader(path)
        architecture = _architecture(reader)
        config = _config_beside(path, checkpoint)
        num_layers = int(config["num_hidden_layers"])
        arch = next((key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture), None)
        if arch is None:
            raise ValueError(f"{path}: gguf does not know the architecture {architecture!r}")
        name_map = gguf.get_tensor_name_map(arch, num_layers)
        tensors = {tensor.name: tensor for tensor in reader.tensors}
        torch_dtype = getattr(torch, dtype)
        threads = torch.get_num_threads()
        note_tiles_in_use(threads)
        for hf_name, slot in parameters.items():
            name = gguf_name(hf_name, name_map)
            tensor = tensors.get(name) if name is not None else None
            if tensor is None and hf_name.endswith("lm_head.weight") and "token_embd.weight" in tensors:
                tensor = tensors["token_embd.weight"]  # a file that ties the LM head to the token table
            if tensor is None:
                raise ValueError(f"{path}: no tensor for {hf_name} (looked for {name or 'no GGUF name'})")
            shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
            if shape != slot.shape:
                raise ValueError(f"{path}: {tensor.name} is {list(shape)}; the model's {hf_name} is {list(slot.shape)}")
            rows = None
            if architecture in ROW_PERMUTED_ARCHITECTURES:
                rows = query_key_rows(
                    tensor.name, shape[0], config["num_attention_heads"], config["num_key_value_heads"]
                )
            yield hf_name, self._tensor(tensor, shape, slot, rows, architecture, torch_dtype, threads, path)

    def _tensor(
        self,
        tensor: Any,
        shape: tuple[int, ...],
        slot: ParameterSlot,
        rows: np.ndarray | None,
        architecture: str,
        dtype: torch.dtype,
        threads: int,
        path: Path,
    ) -> torch.Tensor | PackedWeight:
        import gguf

        type_name = tensor.tensor_type.name
        data = tensor.data
        if type_name in PLAIN_TYPES:
            values = np.asarray(data).reshape(shape)
            if type_name == "BF16":
                plain = torch.from_numpy(np.ascontiguousarray(values).view(np.int16)).view(torch.bfloat16)
            else:
                plain = torch.from_numpy(np.array(values))
        elif type_name in block_tiles.BLOCK_FORMATS and not self.options.dequantize and slot.role != "other":
            raw = np.asarray(data).reshape(shape[0], -1)
            if rows is not None:
                raw = raw[rows]
            return GGUFBlockWeight(
                block_tiles.pack_gguf(type_name, raw, shape[0], shape[1], name=tensor.name, threads=threads), threads
            )
        elif type_name in block_tiles.BLOCK_FORMATS:
            plain = torch.from_numpy(gguf.quants.dequantize(np.asarray(data), tensor.tensor_type).reshape(shape))
        else:
            raise ValueError(
                f"{path}: tensor {tensor.name} is {type_name}, which the gguf weight format does not take (it takes "
                f"{', '.join((*block_tiles.BLOCK_FORMATS, *PLAIN_TYPES))})"
            )
        if rows is not None:
            plain = plain[torch.from_numpy(rows)]
        if architecture in NORM_OFFSET_ARCHITECTURES and tensor.name.endswith("norm.weight"):
            plain = plain.float() - 1
        return plain.to(dtype)


def _reader(path: Path) -> Any:
    import gguf

    try:
        return gguf.GGUFReader(path)
    except Exception as exc:  # the reader raises assorted errors for damaged files
        raise ValueError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def _architecture(reader: Any) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError("the GGUF file names no general.architecture")
    return str(field.contents())


def _config_beside(path: Path, checkpoint: Checkpoint) -> Mapping[str, Any]:
    """The config transformers made of the file's metadata (the model directory written for it holds it)."""
    if checkpoint.config:
        return checkpoint.config
    from transformers import AutoConfig

    return dict(AutoConfig.from_pretrained(path.parent, gguf_file=path.name).to_dict())


def _causal_lm_class(config: Any) -> str:
    from transformers import AutoModelForCausalLM

    model_class: Any = AutoModelForCausalLM._model_mapping.get(type(config), None)
    if model_class is None:
        raise ValueError(f"transformers has no causal LM for GGUF model type {config.model_type!r}")
    return str(model_class.__name__)
