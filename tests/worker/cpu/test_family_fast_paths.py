"""The fused CPU attention, MLP and norms beyond Llama's shape: Qwen3's and Gemma 3's per-head q/k norms, Phi-3's one
q/k/v product and gate/up MLP, Gemma's and Gemma 2's (soft-capped, windowed) attention, Gemma's tanh-GELU MLPs and
1 + weight norms, Qwen3-MoE's attention; each module against its own forward, and the model against transformers."""

from __future__ import annotations

import random

import pytest
import torch

import patchbay
from patchbay.sampling_params import SamplingParams
from patchbay.testing.tiny_models import tiny_checkpoint, transformers_greedy
from patchbay.toolkit import fused_ops
from patchbay.toolkit.forward_context import ForwardContext, LayerBinding, forward_context
from patchbay.toolkit.native_build import build_unavailable
from patchbay.worker.cpu import fused_modules
from patchbay.worker.model.hf_model import register_attention_function

pytestmark = pytest.mark.skipif(build_unavailable() is not None, reason=f"cannot build here: {build_unavailable()}")

FAMILIES = {
    "Qwen3ForCausalLM": ("qk_norm", True),
    "Qwen3MoeForCausalLM": ("qk_norm", False),  # its experts run routed (worker/model/experts.py), not as an MLP
    "Phi3ForCausalLM": ("fused_qkv", True),
    # Gemma's MLPs are tanh-GELU ones, its norms (q/k norms too) scale by 1 + weight.
    "GemmaForCausalLM": ("llama", True),
    "Gemma2ForCausalLM": ("llama", True),  # soft cap and window from the layer's spec
    "Gemma3ForCausalLM": ("qk_norm", True),
}

GEMMA_NORMS = {"GemmaForCausalLM": 2, "Gemma2ForCausalLM": 4, "Gemma3ForCausalLM": 6}
"""Norms a layer: before and after attention and MLP (Gemma 2, 3), Gemma 3's q/k norms."""


class Built:
    def ready(self):
        return fused_ops.load_fused_ops()


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_each_layers_fused_modules_compute_its_own_forward(architecture):
    from transformers import AutoModelForCausalLM

    kind, fused_mlp = FAMILIES[architecture]
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint(architecture), dtype=torch.float32).eval()
    layer = model.model.layers[1]
    attention, mlp = layer.self_attn, layer.mlp
    assert fused_modules.attention_kind(attention) == kind
    hidden = torch.randn(1, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(3, 10)[None]
    # Gemma 3 keeps rotary tables per layer type (local layers rotate by another base).
    layer_types = getattr(model.config, "layer_types", None) if architecture.startswith("Gemma3") else None
    rotary = model.model.rotary_emb(hidden, positions, *([layer_types[1]] if layer_types else []))

    class Dense:
        """Causal attention over the call's own keys (the step is one prompt chunk with nothing cached)."""

        def forward(self, query, key, value, kv_cache, metadata):
            group = query.shape[1] // key.shape[1]
            scores = torch.einsum("qhd,khd->hqk", query, key.repeat_interleave(group, 1)) * attention.scaling
            scores = scores.masked_fill(torch.ones(7, 7, dtype=torch.bool).triu(1), float("-inf"))
            return torch.einsum("hqk,khd->qhd", scores.softmax(-1), value.repeat_interleave(group, 1))

    register_attention_function()
    attention.config._attn_implementation = "patchbay"  # its own forward attends through the binding below too
    binding = {attention.layer_idx: LayerBinding(Dense(), torch.empty(0), 0, "layer")}
    with torch.inference_mode(), forward_context(ForwardContext(binding, [None])):
        fused = fused_modules.FusedRopeAttention(attention, Built(), kind)(hidden, rotary)[0]
        own = type(attention).forward(attention, hidden, rotary, None)[0]
    torch.testing.assert_close(fused, own, rtol=1e-5, atol=1e-5)
    if fused_mlp:
        activation = "silu" if fused_modules.is_phi3_silu_mlp(mlp) else fused_modules.llama_mlp_activation(mlp)
        assert activation is not None
        with torch.inference_mode():
            torch.testing.assert_close(
                fused_modules.FusedGatedMLP(mlp, Built(), activation)(hidden), mlp(hidden), rtol=1e-5, atol=1e-5
            )


@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_greedy_tokens_match_transformers_with_the_family_kernels_on(architecture):
    fused_ops.load_fused_ops()  # built, so every step runs the kernels
    model_dir = tiny_checkpoint(architecture)
    rng = random.Random(2)
    prompts = [[rng.randrange(100, 40_000) for _ in range(n)] for n in (5, 40, 1)]
    llm = patchbay.LLM(model__path=str(model_dir), model__dtype="float32", runtime__fused_ops=True)
    layers = llm.engine.model.model.config.num_hidden_layers
    assert llm.engine.fused_modules.attentions == layers
    if architecture in GEMMA_NORMS:  # every norm and MLP too
        assert llm.engine.fused_modules.mlps == layers
        assert llm.engine.fused_modules.norms == 1 + layers * GEMMA_NORMS[architecture]
    assert llm.engine.fused_modules.layers == 0  # whole C++ layers have no per-head norms nor one q/k/v product
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [o.token_ids for o in outputs] == transformers_greedy(model_dir, prompts, 8)
