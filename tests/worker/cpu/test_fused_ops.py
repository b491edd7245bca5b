"""The C++ RMS-norm (Llama's and Gemma's) and gated-activation (SiLU, tanh GELU) kernels: against transformers'
modules, and in the engine."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig
from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm

import patchbay
from patchbay.sampling_params import SamplingParams
from patchbay.toolkit import fused_ops
from patchbay.worker.cpu import fused_modules
from patchbay.worker.cpu.fused_projections import fuse_shared_input_projections
from patchbay.toolkit.native_build import build_unavailable
from patchbay.toolkit.tiles import TileLayout
from patchbay.toolkit.cpu import CpuInfo
from tiny_models import transformers_greedy

pytestmark = pytest.mark.skipif(build_unavailable() is not None, reason=f"cannot build here: {build_unavailable()}")


class Built:
    """A build that is done: the kernels as built for this CPU, or limited to AVX2 (the SIMD path of CPUs
    without AVX-512, built here too where the CPU has both)."""

    def __init__(self, variant: str = "native") -> None:
        self.variant = variant

    def ready(self):
        if self.variant == "native":
            return fused_ops.load_fused_ops()
        if not {"avx2", "fma"} <= CpuInfo.read().flags:
            pytest.skip("this CPU has no AVX2 and FMA")
        return _avx2_ops()


@functools.cache
def _avx2_ops():
    return fused_ops.EXTENSION.without_avx512().load()


VARIANTS = pytest.mark.parametrize("variant", ["native", pytest.param("avx2", marks=pytest.mark.slow)])


class NotBuilt:
    def ready(self):
        return None


NORMS = {
    # Llama's weight multiplies the row rounded to the dtype; Gemma's 1 + weight multiplies it in float32.
    "llama": (LlamaRMSNorm, fused_modules.FusedRMSNorm, 0.5),
    "gemma": (GemmaRMSNorm, fused_modules.FusedGemmaRMSNorm, -0.5),
}


@VARIANTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 576 is past the kernels' threading threshold
@pytest.mark.parametrize("family", sorted(NORMS))
def test_rms_norm_matches_transformers(family, dtype, rows, variant):
    norm_class, fused_class, offset = NORMS[family]
    generator = torch.Generator().manual_seed(0)
    norm = norm_class(580, eps=1e-5).to(dtype)  # 580: whole registers and a tail of plain loops
    with torch.no_grad():
        norm.weight.copy_(torch.rand(580, generator=generator) + offset)
    hidden = (torch.randn(1, rows, 580, generator=generator) * 3).to(dtype)
    expected = norm(hidden)
    assert fused_modules.use_fused_ops(norm, device=torch.device("cpu"), dtype=str(dtype)[6:], build=NotBuilt()) == (
        fused_modules.FusedModules(norms=1)
    )
    norm.forward = fused_class(norm, Built(variant))
    with torch.inference_mode():
        got = norm(hidden)
    assert got.dtype == dtype and got.shape == expected.shape
    if dtype == torch.bfloat16:
        # Rounded at the same two points as transformers; only the float32 sum's order differs.
        mismatched = (got != expected).float().mean().item()
        assert mismatched < 0.01
        torch.testing.assert_close(got, expected, rtol=8e-3, atol=0)
    else:
        torch.testing.assert_close(got, expected, rtol=2e-6, atol=1e-6)


ACTIVATIONS = {
    # hidden_act -> (the kernels' name for it, torch's function)
    "silu": ("silu", F.silu),
    "gelu_pytorch_tanh": ("gelu_tanh", functools.partial(F.gelu, approximate="tanh")),  # Gemma's
}


@VARIANTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("hidden_act", sorted(ACTIVATIONS))
def test_gated_mlp_matches_transformers(hidden_act, dtype, rows, variant):
    activation, function = ACTIVATIONS[hidden_act]
    config = LlamaConfig(hidden_size=64, intermediate_size=1540, num_attention_heads=4, hidden_act=hidden_act)
    torch.manual_seed(0)
    mlp = LlamaMLP(config).to(dtype).eval()
    assert fused_modules.llama_mlp_activation(mlp) == activation
    x = (torch.randn(1, rows, 64) * 4).to(dtype)  # gates far into both tails of the activation
    with torch.inference_mode():
        expected = mlp(x)
        gate_up = torch.cat([mlp.gate_proj(x), mlp.up_proj(x)], dim=-1)
        activated = torch.empty(1, rows, 1540, dtype=dtype)
        getattr(Built(variant).ready(), fused_modules.GATED_ACTIVATIONS[activation])(gate_up, activated)
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        # The kernels' exp (and tanh, near +-1) are within an ulp or two of torch's: at most 1.2e-7 of |gate * up|
        # (where tanh is one float from -1, torch's rounds to -1 and its product to 0).
        torch.testing.assert_close(
            activated,
            function(gate) * up,
            rtol=1e-5 if dtype == torch.float32 else 8e-3,
            atol=max(1e-6, 1.2e-7 * (gate.float() * up.float()).abs().max().item()),
        )
        assert fuse_shared_input_projections(mlp) == 1
        mlp.forward = fused_modules.FusedGatedMLP(mlp, Built(variant), activation)
        assert mlp.forward.group is not None  # the gate/up product is the fused group's
        got = mlp(x)
    torch.testing.assert_close(
        got, expected, rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-5 if dtype == torch.float32 else 2e-2
    )


def test_modules_run_their_own_forward_until_the_kernels_are_built():
    norm = LlamaRMSNorm(32)
    norm.forward = fused_modules.FusedRMSNorm(norm, NotBuilt())
    hidden = torch.randn(3, 32)
    torch.testing.assert_close(norm(hidden), LlamaRMSNorm.forward(norm, hidden), rtol=0, atol=0)


def test_only_modules_computing_the_llama_formulas_are_replaced():
    class ScaledNorm(nn.Module):  # Gemma-style: (1 + weight), another formula under the same attributes
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(8))
            self.variance_epsilon = 1e-6

        def forward(self, hidden_states):
            return hidden_states * (1 + self.weight)

    class GeluMLP(LlamaMLP):
        pass

    def llama_mlp(hidden_act):
        return LlamaMLP(LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, hidden_act=hidden_act))

    config = LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, hidden_act="gelu")
    model = nn.ModuleDict(
        {
            "norm": LlamaRMSNorm(8),
            "scaled": ScaledNorm(),
            "gemma_norm": GemmaRMSNorm(8),
            "silu": llama_mlp("silu"),
            "gelu_tanh": llama_mlp("gelu_pytorch_tanh"),
            "gelu": GeluMLP(config),  # the exact (erf) GELU: no kernel
        }
    )
    counts = fused_modules.use_fused_ops(model, device=torch.device("cpu"), dtype="float32", build=NotBuilt())
    assert counts == fused_modules.FusedModules(norms=2, mlps=2)
    assert isinstance(vars(model["norm"]).get("forward"), fused_modules.FusedRMSNorm)
    assert isinstance(vars(model["gemma_norm"]).get("forward"), fused_modules.FusedGemmaRMSNorm)
    assert [vars(model[name]).get("forward").activation for name in ("silu", "gelu_tanh")] == ["silu", "gelu_tanh"]
    assert "forward" not in vars(model["scaled"]) and "forward" not in vars(model["gelu"])
    # Off the CPU's float32/bfloat16 nothing changes.
    assert (
        fused_modules.use_fused_ops(
            LlamaRMSNorm(8).half(), device=torch.device("cpu"), dtype="float16", build=NotBuilt()
        )
        == fused_modules.FusedModules()
    )


def test_greedy_tokens_match_transformers_with_the_kernels_on(tiny_llama):
    fused_ops.load_fused_ops()  # built, so every step runs the kernels
    prompts = [[5, 9, 11, 3, 7], list(range(20, 90)), [42]]
    llm = patchbay.LLM(model__path=str(tiny_llama), model__dtype="float32", runtime__fused_ops=True)
    config = llm.engine.model.model.config
    tiled = llm.engine.linear_paths.layout == TileLayout.name  # then whole layers fuse (test_fused_layer.py)
    assert llm.engine.fused_modules == fused_modules.FusedModules(
        norms=2 * config.num_hidden_layers + 1,
        mlps=config.num_hidden_layers,
        attentions=config.num_hidden_layers,
        layers=config.num_hidden_layers if tiled else 0,
        decoder_loops=1 if tiled else 0,
    )
    outputs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outputs] == transformers_greedy(tiny_llama, prompts, 12)


@VARIANTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_size", [64, 36])  # 36: halves of 18, past whole registers: the plain loops
def test_rotary_matches_transformers(dtype, head_size, variant):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    generator = torch.Generator().manual_seed(0)
    tokens, q_heads, kv_heads = 5, 6, 2
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_size, generator=generator).to(dtype)
    angles = torch.rand(tokens, head_size // 2, generator=generator) * 40
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().to(dtype)[None], emb.sin().to(dtype)[None]  # [1, tokens, head_size] as transformers has
    query = torch.empty(tokens, q_heads, head_size, dtype=dtype)
    key = torch.empty(tokens, kv_heads, head_size, dtype=dtype)
    q_rows = qkv[:, : q_heads * head_size]
    k_rows = qkv[:, q_heads * head_size : (q_heads + kv_heads) * head_size]  # views with the fused row stride
    Built(variant).ready().rotary(q_rows, k_rows, cos, sin, query, key)
    q = qkv[:, : q_heads * head_size].view(1, tokens, q_heads, head_size).transpose(1, 2)
    k = qkv[:, q_heads * head_size : (q_heads + kv_heads) * head_size].view(1, tokens, kv_heads, head_size)
    expected_q, expected_k = apply_rotary_pos_emb(q, k.transpose(1, 2), cos, sin)
    # The same roundings in the same order: equal, not close.
    assert torch.equal(query, expected_q[0].transpose(0, 1)) and torch.equal(key, expected_k[0].transpose(0, 1))


@VARIANTS
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 15, 16, 1000, 49152])
def test_argmax_rows_matches_torch_with_ties_nans_and_infinities(dtype, width, variant):
    ops = Built(variant).ready()
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(12, width, generator=generator).to(dtype)
    x[1] = x[1].round()  # many ties at the row's largest value: the first wins
    x[2] = float("-inf")
    x[3, width // 2] = float("inf")
    x[4, width - 1] = float("nan")
    x[5, :] = 7.0
    x[6, width // 3] = float("nan")
    x[6, width - 1] = float("inf")  # a NaN wins over anything, wherever it stands
    x[7, width // 2 :] = float("nan")
    x[8, 0] = float("nan")
    x[9] = -x[9].abs() - 1
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))


def test_argmax_rows_runs_torch_until_the_kernels_are_built(monkeypatch):
    x = torch.tensor([[0.0, 3.0, 3.0], [float("nan"), 1.0, 2.0]])
    monkeypatch.setattr(fused_ops.FusedOpsBuild, "started", classmethod(lambda cls: None))
    assert fused_ops.argmax_rows(x).tolist() == [1, 0]
    fused_ops.FusedOpsBuild.shared().wait()
    monkeypatch.undo()
    assert fused_ops.argmax_rows(x).tolist() == [1, 0]
    assert fused_ops.argmax_rows(x.to(torch.float64)).tolist() == [1, 0]


def _torch_inverse_cdf(monkeypatch, weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """:func:`fused_ops.inverse_cdf_rows` through its torch path (cumulative sum and search)."""
    with monkeypatch.context() as patch:
        patch.setattr(fused_ops.FusedOpsBuild, "started", classmethod(lambda cls: None))
        return fused_ops.inverse_cdf_rows(weights, uniform)


def test_inverse_cdf_rows_draws_the_first_token_past_the_target(monkeypatch):
    # Cumulative weights [0, 1, 1, 2]: a target of u * 2 draws the first token whose cumulative weight exceeds it,
    # so the zero-weight tokens 0 and 2 are never drawn, even with the target on a boundary.
    weights = torch.tensor([[0.0, 1.0, 0.0, 1.0]]).expand(5, 4).contiguous()
    uniform = torch.tensor([0.0, 0.25, 0.5, 0.75, 1 - 2**-53], dtype=torch.float64)
    zeros = torch.zeros(2, 4)
    for draw in (fused_ops.load_fused_ops().inverse_cdf_rows, functools.partial(_torch_inverse_cdf, monkeypatch)):
        assert draw(weights, uniform).tolist() == [1, 1, 3, 3, 3]
        assert draw(zeros, uniform[:2]).tolist() == [3, 3]  # a row of zeros: its last token


@VARIANTS
@pytest.mark.parametrize("width", [1, 15, 64, 65, 1000, 49152])
def test_inverse_cdf_rows_matches_torch_across_blocks(monkeypatch, width, variant):
    ops = Built(variant).ready()
    generator = torch.Generator().manual_seed(width)
    # Small integer weights: every cumulative sum is exact in float64, whatever the order of the additions.
    weights = torch.randint(0, 4, (40, width), generator=generator).to(torch.float32)
    weights[:, ::3] = 0.0
    weights[1] = 0.0
    weights[2, :-1] = 0.0
    weights[3, 1:] = 0.0
    uniform = torch.rand(40, dtype=torch.float64, generator=generator)
    uniform[:8] = torch.tensor([0.0, 1 - 2**-53, 0.0, 1 - 2**-53, 0.5, 1 - 2**-53, 0.0, 2**-40], dtype=torch.float64)
    drawn = ops.inverse_cdf_rows(weights, uniform)
    assert torch.equal(drawn, _torch_inverse_cdf(monkeypatch, weights, uniform))
    positive = weights.gather(1, drawn.unsqueeze(1)).squeeze(1) > 0
    assert positive[weights.sum(dim=1) > 0].all()
