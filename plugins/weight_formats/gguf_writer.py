"""Writing a float Llama-family model directory as a GGUF file, with the ``gguf`` package's writer and quantizer.

The metadata is what llama.cpp's converter writes for the ``llama`` architecture (sizes, heads, rotary base,
norm epsilon, vocabulary size) and the tokenizer's ``tokenizer.ggml.*`` fields copied from a GGUF file of the same
tokenizer; tensors are named by gguf-py's table, the query and key rows permuted as llama.cpp's converter
permutes them, norms kept in float32, and every other weight quantized to ``tensor_type`` by
``gguf.quants.quantize`` (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; gguf-py cannot quantize the k-quants: llama.cpp's
quantizer makes those from a file this writes).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from patchbay.plugins.weight_formats.gguf_names import query_key_rows

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "F32")
"""Tensor types this writer makes."""


def write_llama_gguf(source: Path, target: Path, tokenizer_gguf: Path, tensor_type: str = "Q4_0") -> Path:
    """``source`` (a float Llama directory whose tokenizer is ``tokenizer_gguf``'s) as the GGUF file ``target``;
    tensors ``tensor_type`` where their input size divides into blocks, float32 otherwise."""
    import gguf
    from safetensors import safe_open

    if tensor_type not in QUANTIZABLE:
        raise ValueError(f"the GGUF writer makes {', '.join(QUANTIZABLE)}, not {tensor_type}")
    config = json.loads((source / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"{source}: the GGUF writer writes Llama models, not {config.get('model_type')!r}")
    layers = int(config["num_hidden_layers"])
    heads, kv_heads = (
        int(config["num_attention_heads"]),
        int(config.get("num_key_value_heads") or config["num_attention_heads"]),
    )
    hidden = int(config["hidden_size"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    writer = gguf.GGUFWriter(str(target), "llama")
    writer.add_name(source.name)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(float(_rope_theta(config)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-5)))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _copy_tokenizer(writer, tokenizer_gguf)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, layers)
    tied = bool(config.get("tie_word_embeddings"))
    for path in sorted(source.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:  # "np" cannot read bfloat16
            for hf_name in handle.keys():
                if tied and hf_name == "lm_head.weight":
                    continue
                base, _, suffix = hf_name.rpartition(".")
                mapped = name_map.get_name(base)
                if mapped is None:
                    raise ValueError(f"{path}: no GGUF name for {hf_name}")
                name = f"{mapped}.{suffix}"
                values = handle.get_tensor(hf_name).float().numpy()
                rows = query_key_rows(name, values.shape[0], heads, kv_heads)
                if rows is not None:  # llama.cpp's converter's permutation: transformers' row r at file row rows[r]
                    permuted = np.empty_like(values)
                    permuted[rows] = values
                    values = permuted
                _add_tensor(writer, name, values, tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def _rope_theta(config: dict[str, Any]) -> float:
    parameters = config.get("rope_parameters") or {}
    return float(config.get("rope_theta") or parameters.get("rope_theta") or 10000.0)


def _add_tensor(writer: Any, name: str, values: np.ndarray, tensor_type: str) -> None:
    import gguf

    if values.ndim == 1 or tensor_type == "F32":
        writer.add_tensor(name, values.astype(np.float32))
        return
    if tensor_type == "F16":
        writer.add_tensor(name, values.astype(np.float16))
        return
    qtype = getattr(gguf.GGMLQuantizationType, tensor_type)
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if values.shape[-1] % block:
        writer.add_tensor(name, values.astype(np.float32))
        return
    writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)  # its shape in bytes


def _copy_tokenizer(writer: Any, tokenizer_gguf: Path) -> None:
    """Every ``tokenizer.*`` field of ``tokenizer_gguf`` (vocabulary, merges, special tokens, chat template)."""
    import gguf

    reader = gguf.GGUFReader(tokenizer_gguf)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value_type = field.types[0]
        if value_type == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), value_type)
