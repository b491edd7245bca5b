"""Reading PEFT adapters: exactly PEFT's weights and scale, and a clear error for each adapter patchbay cannot run."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from lora_adapters import ADAPTER_SPECS, make_peft_adapter, peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from patchbay.contract.settings import ConfigError, LoRASettings, load_settings
from patchbay.contract.registry import default_registry
from patchbay.worker.lora.catalog import AdapterCatalog, UnknownAdapterError
from patchbay.worker.lora.peft_adapter import LoRAAdapterError, base_model_shapes, load_adapter


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {
        name: make_peft_adapter(tiny_llama, folder / name, seed=index, **spec)
        for index, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }


def _load(tiny_llama: Path, name: str, path: Path, max_lora_rank: int = 16):
    num_layers, shapes = base_model_shapes(AutoConfig.from_pretrained(tiny_llama))
    return load_adapter(name, path, num_layers=num_layers, shapes=shapes, max_lora_rank=max_lora_rank)


def _copy(source: Path, destination: Path, **config_changes) -> Path:
    destination.mkdir()
    for item in source.iterdir():
        (destination / item.name).write_bytes(item.read_bytes())
    config = json.loads((destination / "adapter_config.json").read_text())
    config.update(config_changes)
    (destination / "adapter_config.json").write_text(json.dumps(config))
    return destination


@pytest.mark.parametrize("name", list(ADAPTER_SPECS))
def test_merged_weights_give_peft_s_logits(tiny_llama: Path, adapters: dict[str, Path], name: str):
    """W + s·B·A from patchbay's reading, merged into the base model, computes what PEFT's model computes."""
    adapter = _load(tiny_llama, name, adapters[name])
    spec = ADAPTER_SPECS[name]
    expected_scale = spec["lora_alpha"] / (math.sqrt(spec["r"]) if spec.get("use_rslora") else spec["r"])
    assert adapter.rank == spec["r"] and adapter.scaling == pytest.approx(expected_scale)
    assert adapter.target_modules == frozenset(spec["target_modules"])
    assert len(adapter.fingerprint) == 64

    merged = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        for (layer, module), (a, b) in adapter.weights.items():
            block = (
                merged.model.layers[layer].self_attn
                if module.endswith(("q_proj", "k_proj", "v_proj", "o_proj"))
                else merged.model.layers[layer].mlp
            )
            getattr(block, module).weight += adapter.scaling * (b @ a)
    reference = peft_model(tiny_llama, adapters[name])
    tokens = torch.tensor([[1, 17, 400, 9, 33, 250, 7]])
    with torch.no_grad():
        expected = reference(tokens).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()(tokens).logits
        assert (expected - base).abs().max() > 1.0, "the adapter must change the logits, or this test proves nothing"
        torch.testing.assert_close(merged(tokens).logits, expected, atol=1e-4, rtol=1e-4)


def test_a_rank_above_max_lora_rank_is_refused(tiny_llama, adapters):
    with pytest.raises(LoRAAdapterError, match=r"'mlp-r8': rank 8 exceeds lora.max_lora_rank \(4\)"):
        _load(tiny_llama, "mlp-r8", adapters["mlp-r8"], max_lora_rank=4)


def test_an_adapter_for_another_base_model_is_refused(tiny_llama, tmp_path):
    other = tmp_path / "wider"
    config = AutoConfig.from_pretrained(tiny_llama)
    config.hidden_size, config.intermediate_size = 32, 64
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    adapter = make_peft_adapter(other, tmp_path / "for-wider", seed=3, r=2, lora_alpha=4, target_modules=["q_proj"])
    with pytest.raises(
        LoRAAdapterError,
        match=r"'for-wider' was built for another base model: "
        r"layers.0.self_attn.q_proj has lora_A \(2, 32\)",
    ):
        _load(tiny_llama, "for-wider", adapter)


def test_an_adapter_for_a_deeper_model_is_refused(tiny_llama, tmp_path):
    deeper = tmp_path / "deeper"
    config = AutoConfig.from_pretrained(tiny_llama)
    config.num_hidden_layers = 6
    AutoModelForCausalLM.from_config(config).save_pretrained(deeper)
    adapter = make_peft_adapter(deeper, tmp_path / "deep", seed=4, r=2, lora_alpha=4, target_modules=["v_proj"])
    with pytest.raises(
        LoRAAdapterError,
        match=r"'deep' was built for another base model: .*layer 4, but the model "
        r"has 4 layers",
    ):
        _load(tiny_llama, "deep", adapter)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "trained biases"),
        ({"fan_in_fan_out": True}, "fan_in_fan_out"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern"),
        ({"peft_type": "IA3"}, "not LORA"),
        ({"r": 0}, "positive integer r"),
    ],
)
def test_unsupported_features_are_refused_naming_the_adapter(tiny_llama, adapters, tmp_path, change, reason):
    path = _copy(adapters["attn-r4"], tmp_path / "odd", **change)
    with pytest.raises(LoRAAdapterError, match=rf"LoRA adapter 'odd': .*{reason}"):
        _load(tiny_llama, "odd", path)


def test_an_embedding_target_is_refused(tiny_llama, tmp_path):
    adapter = make_peft_adapter(
        tiny_llama, tmp_path / "embed", seed=5, r=2, lora_alpha=4, target_modules=["q_proj", "embed_tokens"]
    )
    with pytest.raises(LoRAAdapterError, match=r"'embed': weight .*embed_tokens.*supported targets: q_proj"):
        _load(tiny_llama, "embed", adapter)


def test_missing_files_are_named(tiny_llama, adapters, tmp_path):
    with pytest.raises(LoRAAdapterError, match=r"'gone': .*/nowhere is not a directory"):
        _load(tiny_llama, "gone", tmp_path / "nowhere")
    no_config = _copy(adapters["attn-r4"], tmp_path / "no-config")
    (no_config / "adapter_config.json").unlink()
    with pytest.raises(LoRAAdapterError, match=r"'no-config': .*adapter_config.json is missing"):
        _load(tiny_llama, "no-config", no_config)
    no_weights = _copy(adapters["attn-r4"], tmp_path / "no-weights")
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(LoRAAdapterError, match=r"'no-weights': .*adapter_model.safetensors is missing"):
        _load(tiny_llama, "no-weights", no_weights)
    broken = _copy(adapters["attn-r4"], tmp_path / "broken")
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(LoRAAdapterError, match=r"'broken': cannot read .*adapter_model.safetensors"):
        _load(tiny_llama, "broken", broken)


def test_a_legacy_bin_state_dict_is_read(tiny_llama, adapters, tmp_path):
    from safetensors.torch import load_file

    legacy = _copy(adapters["attn-r4"], tmp_path / "legacy")
    torch.save(load_file(str(legacy / "adapter_model.safetensors")), legacy / "adapter_model.bin")
    (legacy / "adapter_model.safetensors").unlink()
    loaded, original = _load(tiny_llama, "legacy", legacy), _load(tiny_llama, "attn-r4", adapters["attn-r4"])
    assert loaded.weights.keys() == original.weights.keys()
    for key, (a, b) in loaded.weights.items():
        assert torch.equal(a, original.weights[key][0]) and torch.equal(b, original.weights[key][1])


def _catalog(tiny_llama, adapters, capacity, **extra):
    num_layers, shapes = base_model_shapes(AutoConfig.from_pretrained(tiny_llama))
    return AdapterCatalog(
        adapters=adapters, num_layers=num_layers, shapes=shapes, max_lora_rank=16, capacity=capacity, **extra
    )


def test_the_catalog_keeps_the_most_recently_used_adapters(tiny_llama, adapters):
    catalog = _catalog(tiny_llama, adapters, capacity=2)
    catalog.get("attn-r4")
    catalog.get("mlp-r8")
    catalog.get("attn-r4")
    catalog.get("all-r2-rslora")
    assert catalog.loaded_names == ["attn-r4", "all-r2-rslora"]  # mlp-r8 was the least recently used
    catalog.get("mlp-r8", pinned=["attn-r4"])
    assert catalog.loaded_names == ["attn-r4", "mlp-r8"]


def test_an_unknown_name_lists_the_known_ones(tiny_llama, adapters):
    catalog = _catalog(tiny_llama, adapters, capacity=2)
    with pytest.raises(
        UnknownAdapterError,
        match=r"unknown LoRA adapter 'nope': not in lora.adapters "
        r"\(known: all-r2-rslora, attn-r4, mlp-r8\)",
    ):
        catalog.get("nope")


def test_the_resolver_finds_adapters_the_settings_do_not_list(tiny_llama, adapters):
    section = LoRASettings(resolver={"name": "directory", "options": {"root": str(adapters["mlp-r8"].parent)}})
    num_layers, shapes = base_model_shapes(AutoConfig.from_pretrained(tiny_llama))
    catalog = AdapterCatalog.from_settings(section, default_registry(), num_layers=num_layers, shapes=shapes)
    assert catalog.get("mlp-r8").rank == 8
    assert catalog.known_names() == sorted(ADAPTER_SPECS)
    with pytest.raises(UnknownAdapterError, match="lora_resolver:directory does not know it"):
        catalog.get("nope")


def test_settings_check_the_lora_section(tmp_path):
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be at least max_loras \(2\)"):
        LoRASettings(max_loras=2, max_cpu_loras=1)
    path = tmp_path / "run.yaml"
    path.write_text("lora:\n  kernel: nope\n")
    with pytest.raises(
        ConfigError, match=r"run.yaml: lora.kernel.name: no LoRA kernel named 'nope' is installed; available: torch"
    ):
        load_settings(path, registry=default_registry())
