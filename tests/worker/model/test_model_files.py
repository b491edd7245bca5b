"""The bundled GGUF model converts to a standard Hugging Face checkpoint that tools other than patchbay read."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import load_file

from patchbay.toolkit.model_files import bundled_gguf, convert_gguf


@pytest.mark.slow
def test_the_converted_checkpoint_is_standard_and_holds_the_gguf_embedding():
    import gguf

    path = bundled_gguf()
    directory = convert_gguf(path)
    config = json.loads((directory / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    tensors = load_file(str(directory / "model.safetensors"))
    # Tied weights are saved under the input embedding's name, as save_pretrained does: a tool that reads
    # the safetensors file alone (vLLM) must find the embedding, not only an LM head.
    assert config["tie_word_embeddings"] is True
    assert "model.embed_tokens.weight" in tensors and "lm_head.weight" not in tensors

    # The independent reference: the gguf package's own de-quantisation of the file's embedding table.
    (embedding,) = [tensor for tensor in gguf.GGUFReader(str(path)).tensors if tensor.name == "token_embd.weight"]
    expected = gguf.quants.dequantize(embedding.data, embedding.tensor_type)
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], expected.astype(np.float32))


def test_a_conversion_abandoned_long_ago_is_cleaned_up_and_a_running_one_kept(tmp_path):
    import os
    import time

    from patchbay.toolkit import model_files as model_loader

    old, fresh = tmp_path / ".converting-old", tmp_path / ".converting-now"
    for folder in (old, fresh):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    long_ago = time.time() - model_loader.ABANDONED_AFTER_SECONDS - 60
    os.utime(old, (long_ago, long_ago))
    model_loader._remove_abandoned_conversions(tmp_path)
    assert not old.exists() and fresh.exists()
