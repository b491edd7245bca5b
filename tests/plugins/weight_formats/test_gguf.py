"""The ``gguf`` weight format: the bundled Q4_1 file runs as shipped, exactly as transformers reads it, and every
damaged or foreign file gets an error naming the file, the tensor and its type."""

from __future__ import annotations


import numpy as np
import pytest
import torch

import patchbay
from patchbay.interfaces import Checkpoint, PackedWeight
from patchbay.sampling_params import SamplingParams
from patchbay.testing import WeightFormatSuite
from patchbay.toolkit.model_files import bundled_gguf
from patchbay.worker.model.packed_weights import build_empty_model, parameter_slots


class TestGGUFConformance(WeightFormatSuite):
    """The kit on files the gguf writer makes: Q8_0, since gguf-py's round-to-nearest Q4_0 of every tensor, token
    table included, costs the 135M model 32 % of its perplexity (llama.cpp's files keep the table at 6 bits or
    more); the bundled file's Q4_1 blocks are checked against transformers below."""

    plugin_name = "gguf"

    @pytest.fixture
    def format_options(self) -> dict[str, object]:
        return {"write_type": "Q8_0"}


@pytest.fixture(scope="module")
def bundled_tensors() -> dict[str, torch.Tensor | PackedWeight]:
    """Every tensor of the bundled file as the gguf format loads it (float32 run)."""
    from transformers import AutoConfig

    from patchbay.plugins.weight_formats.gguf import GGUFFormat
    from patchbay.worker.model.checkpoints import checkpoint_in, written_model_dir

    path = bundled_gguf()
    model_dir = written_model_dir(Checkpoint(path), GGUFFormat())
    model = build_empty_model(AutoConfig.from_pretrained(model_dir), dtype=torch.float32, attn_implementation="eager")
    return dict(GGUFFormat().load(checkpoint_in(model_dir), parameter_slots(model), dtype="float32"))


@pytest.fixture(scope="module")
def transformers_state() -> dict[str, torch.Tensor]:
    """The bundled file as transformers' own GGUF reader dequantizes it: the independent reference."""
    from transformers import AutoModelForCausalLM

    path = bundled_gguf()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def test_every_tensor_of_the_bundled_file_is_what_transformers_reads(bundled_tensors, transformers_state):
    packed = 0
    for name, value in bundled_tensors.items():
        expected = transformers_state[name]
        got = value.dequantize() if isinstance(value, PackedWeight) else value
        packed += isinstance(value, PackedWeight)
        assert torch.equal(got, expected), f"{name} differs from transformers' dequantized tensor"
    # 30 layers x 7 projections in Q4_1, and the tied token table in Q8_0, all kept packed.
    assert packed == 30 * 7 + 1
    assert bundled_tensors["model.embed_tokens.weight"].tensor_type == "Q8_0"


def test_the_packed_model_takes_about_the_file_s_bytes(bundled_tensors):
    packed_bytes = sum(value.nbytes for value in bundled_tensors.values() if isinstance(value, PackedWeight))
    file_bytes = bundled_gguf().stat().st_size
    assert 0.9 * file_bytes <= packed_bytes <= 1.05 * file_bytes, (packed_bytes, file_bytes)


@pytest.fixture(scope="module")
def native_llm():
    # Named: under auto the suite reads GGUF files as floats (tests/conftest.py).
    return patchbay.LLM(
        runtime__threads=2, model__dtype="float32", model__max_model_len=512, model__weight_format="gguf"
    )


def test_the_bundled_model_runs_packed_with_no_float_weight(native_llm):
    model = native_llm.engine.model.model
    linear = model.model.layers[0].self_attn.q_proj
    assert linear.weight.device.type == "meta", "a packed linear keeps no float weight"
    assert model.model.embed_tokens.weight.device.type == "meta"
    text = native_llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))[0].text
    assert "Paris" in text


def test_greedy_tokens_do_not_depend_on_the_batch(native_llm):
    prompts = ["Tell me about the sea.", "Write a haiku about autumn leaves.", "What is 17 times 3?"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = [native_llm.generate([prompt], params)[0].token_ids for prompt in prompts]
    together = [output.token_ids for output in native_llm.generate(prompts, params)]
    assert together == alone


# -- damaged and foreign files ------------------------------------------------------------------------------


def test_a_file_that_is_not_gguf_is_refused_naming_it(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 100)
    with pytest.raises(Exception, match=r"model\.gguf: no installed weight format reads this file"):
        patchbay.LLM(model__path=str(path))


def test_a_truncated_file_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "truncated.gguf"
    with bundled_gguf().open("rb") as source:
        path.write_bytes(source.read(bundled_gguf().stat().st_size // 2))
    with pytest.raises(Exception, match="truncated.gguf"):
        patchbay.LLM(model__path=str(path), runtime__threads=1)


def test_a_tensor_type_the_format_does_not_take_is_an_error_naming_tensor_and_type(tmp_path):
    import gguf

    from patchbay.plugins.weight_formats.gguf import GGUFFormat

    reader = gguf.GGUFReader(bundled_gguf())
    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, field.contents())
        else:
            writer.add_key_value(key, field.contents(), field.types[0])
    for tensor in reader.tensors:
        data = np.asarray(tensor.data)
        if tensor.name == "blk.0.attn_q.weight":  # the same bytes, labelled IQ4_NL (18-byte blocks of 32, as Q4_0)
            q40 = gguf.quants.quantize(gguf.quants.dequantize(data, tensor.tensor_type), gguf.GGMLQuantizationType.Q4_0)
            writer.add_tensor(tensor.name, q40, raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)  # its shape in bytes
        else:
            writer.add_tensor(tensor.name, data, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert GGUFFormat().reads(Checkpoint(path)) is None
    with pytest.raises(Exception, match=r"iq\.gguf.*blk\.0\.attn_q\.weight is IQ4_NL"):
        patchbay.LLM(model__path=str(path), runtime__threads=1, model__weight_format="gguf")


def test_the_float_copy_is_an_explicit_option_that_equals_transformers(transformers_state):
    llm = patchbay.LLM(
        runtime__threads=2,
        model__dtype="float32",
        model__weight_format={"name": "gguf", "options": {"dequantize": True}},
        runtime__linear_kernel="torch",
    )
    layer = llm.engine.model.model.model.layers[3].mlp.down_proj
    assert torch.equal(layer.weight.detach(), transformers_state["model.layers.3.mlp.down_proj.weight"])


def test_a_named_format_that_cannot_read_the_checkpoint_says_why(tiny_llama):
    with pytest.raises(Exception, match=r"weight_format:gguf cannot read .*not a file"):
        patchbay.LLM(model__path=str(tiny_llama), model__weight_format="gguf")


def test_the_bundled_model_s_directory_links_the_file_and_holds_no_weights():
    from patchbay.plugins.weight_formats.gguf import GGUFFormat
    from patchbay.worker.model.checkpoints import written_model_dir

    directory = written_model_dir(Checkpoint(bundled_gguf()), GGUFFormat())
    assert (directory / "weights.gguf").resolve() == bundled_gguf().resolve()
    assert not list(directory.glob("*.safetensors"))
    assert {"config.json", "generation_config.json", "tokenizer.json"} <= {p.name for p in directory.iterdir()}
