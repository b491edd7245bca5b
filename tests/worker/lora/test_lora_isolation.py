"""One adapter never changes another request's answer (issue 57, items 1-3).

- An adapter whose product is NaN or overflows (inf) spoils its own rows only: the stacked kernel selects each
  row's own columns instead of multiplying the others by zero (``inf * 0`` is NaN), and a weight that is not
  finite, or beyond the run's dtype, is refused when the adapter is read.
- A slot is matched by the adapter's identity, not its name: a runtime load under a name whose old adapter still
  sits in a slot runs the new weights.
- The identity covers ``adapter_config.json`` as well as the weights: the same weights with another
  ``lora_alpha`` never reuse the old scale's cached KV blocks.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from lora_adapters import ADAPTER_SPECS, make_peft_adapter, peft_greedy
from safetensors.torch import load_file, save_file

import patchbay
from patchbay.contract.settings import Settings
from patchbay.interfaces import NO_ADAPTER
from patchbay.plugins.lora_kernels.torch_kernel import TorchLoRAKernel
from patchbay.sampling_params import SamplingParams
from patchbay.worker.lora.mapping import build_lora_mapping
from patchbay.worker.lora.peft_adapter import LoRAAdapterError, base_model_shapes, load_adapter

NUM_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("isolation-adapters")
    return {
        name: make_peft_adapter(tiny_llama, folder / name, seed=10 + index, **spec)
        for index, (name, spec) in enumerate(ADAPTER_SPECS.items())
    }


@pytest.fixture(scope="module")
def prompt() -> list[int]:
    rng = random.Random(57)
    return [rng.randrange(1, 2000) for _ in range(40)]  # two full blocks of 16 for the prefix cache


def _llm(tiny_llama: Path, lora: dict) -> patchbay.LLM:
    return patchbay.LLM(
        Settings(
            model={"path": str(tiny_llama), "dtype": "float32"},
            runtime={"threads": 2},
            cache={"block_size": 16, "num_blocks": 64},
            lora={"max_lora_rank": 8, **lora},
        )
    )


def _greedy(llm: patchbay.LLM, prompts: list[list[int]], names: list[str | None]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, lora=name) for name in names]
    return [output.token_ids for output in llm.generate(prompts, params)]


# -- item 1: a non-finite adapter ---------------------------------------------------------------------------


def test_the_stacked_kernel_keeps_a_non_finite_slot_to_its_own_rows():
    """Two active slots take the stacked path; slot 1's A holds NaN and slot 2's overflows float32 in x·Aᵀ."""
    generator = torch.Generator().manual_seed(57)
    rows, features, rank, slots = 6, 32, 4, 3
    x = torch.randn(rows, features, generator=generator)
    lora_a = torch.randn(slots, rank, features, generator=generator) / features**0.5
    lora_b = torch.randn(slots, 24, rank, generator=generator) / rank**0.5
    scalings = torch.tensor([2.0, 1.5, 0.5])
    mapping = build_lora_mapping(torch.tensor([0, 1, NO_ADAPTER, 2, 0, 1]))
    base = torch.randn(rows, 24, generator=generator)
    clean = base.clone()
    TorchLoRAKernel().add_lora(clean, x, lora_a, lora_b, scalings, mapping)
    poisoned_a = lora_a.clone()
    poisoned_a[1, 0, 0] = float("nan")
    poisoned_a[2, 0] = torch.finfo(torch.float32).max
    output = base.clone()
    TorchLoRAKernel().add_lora(output, x, poisoned_a, lora_b, scalings, mapping)
    slot_0_and_none = [0, 2, 4]
    assert torch.isfinite(output[slot_0_and_none]).all(), "a NaN or inf slot reached other slots' rows"
    assert torch.equal(output[slot_0_and_none], clean[slot_0_and_none])


def _shapes(tiny_llama: Path):
    from transformers import AutoConfig

    return base_model_shapes(AutoConfig.from_pretrained(tiny_llama))


@pytest.mark.parametrize(
    ("value", "dtype", "reason"),
    [
        (float("nan"), torch.float32, "non-finite value"),
        (float("inf"), torch.float32, "non-finite value"),
        (1e6, torch.float16, "beyond what float16"),
    ],
)
def test_an_adapter_with_weights_that_are_not_finite_in_the_run_s_dtype_is_refused_naming_them(
    tiny_llama, adapters, tmp_path, value, dtype, reason
):
    bad = tmp_path / "bad"
    shutil.copytree(adapters["attn-r4"], bad)
    weights = load_file(bad / "adapter_model.safetensors")
    key = next(key for key in sorted(weights) if "layers.1.self_attn.v_proj.lora_B" in key)
    weights[key][3, 1] = value
    save_file(weights, bad / "adapter_model.safetensors")
    num_layers, shapes = _shapes(tiny_llama)
    with pytest.raises(LoRAAdapterError, match=rf"'bad': layers.1.self_attn.v_proj.lora_B holds .*{reason}"):
        in_dtype = {} if dtype is torch.float32 else {"dtype": dtype}  # float32 is the default
        load_adapter("bad", bad, num_layers=num_layers, shapes=shapes, max_lora_rank=8, **in_dtype)


def test_a_base_request_beside_a_poisoned_adapter_is_exact_and_leaves_no_poisoned_blocks(tiny_llama, adapters, prompt):
    """A slot poisoned in place (as a NaN that slipped past the load would be) while the base model and a good
    adapter share its steps: both stay exact, and the base prompt alone afterwards (a prefix-cache hit) too."""
    llm = _llm(tiny_llama, {"adapters": {"good": str(adapters["attn-r4"]), "bad": str(adapters["mlp-r8"])}})
    other = prompt[::-1]
    want = _greedy(llm, [prompt, other], [None, "good"])
    _greedy(llm, [other], ["bad"])  # puts "bad" in a slot
    manager = llm.engine.lora
    slot = manager.slot_names.index("bad")
    for linear in manager.linears.values():
        if slot in linear.used_slots:
            linear.lora_a[slot, 0, 0] = float("nan")
    got = _greedy(llm, [prompt, other, other], [None, "good", "bad"])
    assert got[:2] == want, "the poisoned adapter changed other requests' tokens"
    assert _greedy(llm, [prompt], [None]) == want[:1], "the base prompt's cached blocks were poisoned"


# -- item 2: slots match the adapter, not its name ---------------------------------------------------------


def test_a_runtime_load_under_a_name_still_in_a_slot_runs_the_new_adapter(tiny_llama, adapters, prompt, tmp_path):
    root = tmp_path / "resolved"
    root.mkdir()
    shutil.copytree(adapters["attn-r4"], root / "a")
    llm = _llm(
        tiny_llama,
        {"resolver": {"name": "directory", "options": {"root": str(root)}}, "max_loras": 2, "max_cpu_loras": 2},
    )
    old = _greedy(llm, [prompt], ["a"])  # the resolver's "a" is now in a slot
    engine = llm.engine
    engine.load_lora_adapter("x", str(adapters["mlp-r8"]))
    engine.load_lora_adapter("y", str(adapters["all-r2-rslora"]))  # the catalog drops "a"; its slot keeps it
    assert "a" in engine.lora.slot_names and "a" not in engine.lora.catalog.loaded_names
    engine.load_lora_adapter("a", str(adapters["mlp-r8"]))
    want = peft_greedy(tiny_llama, adapters["mlp-r8"], [prompt], NUM_TOKENS)
    assert want != old, "the two adapters must answer differently, or this test proves little"
    assert _greedy(llm, [prompt], ["a"]) == want


# -- item 3: the identity covers the config ----------------------------------------------------------------


def _with_alpha(source: Path, target: Path, alpha: int) -> Path:
    shutil.copytree(source, target)
    config = json.loads((target / "adapter_config.json").read_text())
    config["lora_alpha"] = alpha
    (target / "adapter_config.json").write_text(json.dumps(config))
    return target


def test_the_same_weights_with_another_alpha_are_another_adapter(tiny_llama, adapters, prompt, tmp_path):
    low = _with_alpha(adapters["attn-r4"], tmp_path / "low", 8)
    high = _with_alpha(adapters["attn-r4"], tmp_path / "high", 64)
    num_layers, shapes = _shapes(tiny_llama)
    identities = {
        load_adapter(name, path, num_layers=num_layers, shapes=shapes, max_lora_rank=8).fingerprint
        for name, path in (("low", low), ("high", high))
    }
    assert len(identities) == 2
    llm = _llm(tiny_llama, {})
    llm.engine.load_lora_adapter("p", str(low))
    first = _greedy(llm, [prompt], ["p"])
    llm.engine.unload_lora_adapter("p")
    llm.engine.load_lora_adapter("p", str(high))
    want = peft_greedy(tiny_llama, high, [prompt], NUM_TOKENS)
    assert first == peft_greedy(tiny_llama, low, [prompt], NUM_TOKENS) and want != first
    assert _greedy(llm, [prompt], ["p"]) == want, "the old scale's cached blocks answered"
