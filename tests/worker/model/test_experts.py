"""MoE experts split into per-expert linears: transformers' own arithmetic, and every CPU linear path on them."""

from __future__ import annotations

import pytest
import torch

import patchbay
from patchbay.sampling_params import SamplingParams
from patchbay.testing.tiny_models import tiny_checkpoint
from patchbay.worker.model.experts import ExpertLinears, RoutedExperts, split_experts


def _experts(architecture: str):
    """A transformers MoE model's first experts module, the model's own (its eager implementation)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(architecture), dtype=torch.float32)
    model.config._experts_implementation = "eager"
    return model, next(module for module in model.modules() if hasattr(module, "gate_up_proj"))


@pytest.mark.parametrize("architecture", ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM"])
def test_routed_experts_give_transformers_eager_results_bit_for_bit(architecture):
    model, experts = _experts(architecture)
    num_experts, top_k = experts.num_experts, 2
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(13, experts.hidden_dim, generator=generator)
    # Every expert chosen by some token, one by none.
    index = torch.stack([torch.randperm(num_experts - 1, generator=generator)[:top_k] for _ in range(13)])
    weights = torch.softmax(torch.randn(13, top_k, generator=generator), dim=-1)
    with torch.inference_mode():
        expected = experts(hidden, index, weights)
        assert split_experts(model) >= 1
        routed = vars(experts)["forward"]
        assert isinstance(routed, RoutedExperts)
        assert not hasattr(experts, "gate_up_proj")
        linears = experts.expert_linears
        assert isinstance(linears, ExpertLinears) and linears.num_experts == num_experts
        fused = routed.build
        routed.build = None  # torch's activation, as transformers computes it
        exact = experts(hidden, index, weights)
        routed.build = fused
        if fused is not None:
            fused.wait()
        with_kernel = experts(hidden, index, weights)
    torch.testing.assert_close(exact, expected, rtol=0, atol=0)
    # The fused SiLU-and-multiply kernel's exponential rounds within float32's last places.
    torch.testing.assert_close(with_kernel, expected, rtol=1e-5, atol=1e-6)


def test_split_linears_are_views_of_the_loaded_weights():
    model, experts = _experts("MixtralForCausalLM")
    gate_up = experts.gate_up_proj.detach().clone()
    split_experts(model)
    first = experts.expert_linears.gate_up[0].weight
    assert torch.equal(first, gate_up[0])
    assert experts.expert_linears.down[1].weight.shape == (experts.hidden_dim, experts.intermediate_dim)


@pytest.mark.parametrize("scheme, error", [("int8", 0.02), ("int4", 0.25)])
def test_integer_experts_compute_the_float_experts_within_their_rounding(scheme, error):
    from patchbay.worker.cpu.onednn import use_packed_linears
    from patchbay.worker.cpu.quantization import Int4TileLayout, int4_tiles_unavailable, quantize_linears

    if scheme == "int4" and int4_tiles_unavailable() is not None:
        pytest.skip(f"int4 tiles: {int4_tiles_unavailable()}")
    model, experts = _experts("MixtralForCausalLM")
    split_experts(model)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(21, experts.hidden_dim, generator=generator)
    index = torch.stack([torch.randperm(experts.num_experts, generator=generator)[:2] for _ in range(21)])
    weights = torch.softmax(torch.randn(21, 2, generator=generator), dim=-1)
    with torch.inference_mode():
        exact = experts(hidden, index, weights)
        linears = experts.expert_linears
        if scheme == "int8":
            count = quantize_linears(linears, "int8", max_rows=64)
        else:
            count = use_packed_linears(linears, Int4TileLayout(torch.get_num_threads()))
        assert count == 2 * experts.num_experts  # every expert's gate/up and down
        rounded = experts(hidden, index, weights)
    relative = (rounded - exact).norm() / exact.norm()
    assert 0 < relative < error, f"{scheme} experts differ from float ones by {relative:.3f} of their norm"


def test_a_quantized_moe_model_runs_its_experts_on_integer_weights():
    model_dir = tiny_checkpoint("MixtralForCausalLM")
    prompts = [[101, 2020, 3030, 404, 5050, 606]]
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)  # later tokens drift with rounding
    settings = {"model__path": str(model_dir), "model__dtype": "float32", "runtime__threads": 1}
    exact = patchbay.LLM(**settings).generate(prompts, params)[0]
    llm = patchbay.LLM(**settings, model__quantization="int8")
    config = llm.engine.model.model.config
    assert llm.engine.quantized_linears >= 2 * config.num_local_experts * config.num_hidden_layers
    assert llm.generate(prompts, params)[0].token_ids == exact.token_ids
