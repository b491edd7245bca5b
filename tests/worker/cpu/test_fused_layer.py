"""Whole decoder layers as two C++ calls around the attention (patchbay.worker.cpu.fused_layer)."""

from __future__ import annotations

import pytest
import torch

import patchbay
from patchbay.sampling_params import SamplingParams
from patchbay.worker import runner_build
from patchbay.toolkit import fused_ops
from patchbay.worker.cpu import fused_layer
from patchbay.toolkit.native_build import build_unavailable
from patchbay.toolkit.tiles import (
    chunk_runner,
    load_tile_kernels,
    note_tiles_in_use,
    tile,
    tiled_product_entry,
    tiles_unavailable,
)
from tiny_models import build_tiny_model, transformers_greedy

pytestmark = pytest.mark.skipif(
    build_unavailable() is not None or tiles_unavailable(torch.float32) is not None,
    reason=f"cannot build or tile here: {build_unavailable() or tiles_unavailable(torch.float32)}",
)

PROMPTS = [[5, 9, 11, 3, 7], list(range(20, 90)), [42]]


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory):
    """Qwen2: biases on the q/k/v products, sliding-window layers among full ones."""
    return build_tiny_model(tmp_path_factory.mktemp("qwen2"), "qwen2-mixed-window")


def tiled_llm(model_dir, dtype: str = "float32", **settings) -> patchbay.LLM:
    fused_ops.load_fused_ops()  # built, so every step runs the kernels
    return patchbay.LLM(model__path=str(model_dir), model__dtype=dtype, runtime__linear_kernel="tiles", **settings)


def fused_layer_count(llm: patchbay.LLM) -> int:
    layers = llm.engine.model.model.model.layers
    return sum(isinstance(vars(layer).get("forward"), fused_layer.FusedDecoderLayer) for layer in layers)


@pytest.mark.parametrize("model", ["tiny_llama", "tiny_qwen2"])
def test_greedy_tokens_match_transformers_with_whole_layers_fused(model, request):
    model_dir = request.getfixturevalue(model)
    llm = tiled_llm(model_dir)
    layers = llm.engine.model.model.config.num_hidden_layers
    assert llm.engine.fused_modules.layers == layers == fused_layer_count(llm)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outputs] == transformers_greedy(model_dir, PROMPTS, 12)


def test_bfloat16_logprobs_equal_the_fused_modules_bit_for_bit(tiny_llama, monkeypatch):
    """The two calls run the fused modules' kernels in their order: same tokens, same log-probabilities."""
    if tiles_unavailable(torch.bfloat16) is not None:
        pytest.skip(tiles_unavailable(torch.bfloat16))
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3)
    fused = tiled_llm(tiny_llama, "bfloat16")
    assert fused.engine.fused_modules.layers > 0
    with_layers = fused.generate(PROMPTS, params)
    monkeypatch.setattr(runner_build, "use_fused_layers", lambda model: 0)
    modules_only = tiled_llm(tiny_llama, "bfloat16")
    assert modules_only.engine.fused_modules.layers == fused_layer_count(modules_only) == 0
    without_layers = modules_only.generate(PROMPTS, params)
    for a, b in zip(with_layers, without_layers, strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


def test_layers_with_hooks_or_untiled_products_keep_their_modules(tiny_llama):
    torch_products = patchbay.LLM(model__path=str(tiny_llama), model__dtype="float32", runtime__linear_kernel="torch")
    assert torch_products.engine.fused_modules.attentions > 0
    assert torch_products.engine.fused_modules.layers == fused_layer_count(torch_products) == 0

    # A forward hook on a layer's module (a tensor-parallel rank's all-reduce is one) must keep running.
    llm = tiled_llm(tiny_llama)
    layer = llm.engine.model.model.model.layers[0]
    del layer.forward
    handle = layer.self_attn.o_proj.register_forward_hook(lambda module, args, output: output)
    try:
        assert fused_layer.use_fused_layers(llm.engine.model.model) == 0
    finally:
        handle.remove()
    assert fused_layer.use_fused_layers(llm.engine.model.model) == 1


def test_the_decoder_loop_gives_the_decoders_own_tokens_and_logprobs(tiny_llama, monkeypatch):
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3)
    looped = tiled_llm(tiny_llama)
    assert looped.engine.fused_modules.decoder_loops == 1
    assert isinstance(vars(looped.engine.model.model.model).get("forward"), fused_layer.FusedDecoderLoop)
    with_loop = looped.generate(PROMPTS, params)
    monkeypatch.setattr(runner_build, "use_fused_decoder_loops", lambda model: 0)
    own = tiled_llm(tiny_llama)
    assert own.engine.fused_modules.decoder_loops == 0
    for a, b in zip(with_loop, own.generate(PROMPTS, params), strict=True):
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs


def test_a_decoder_with_an_unfused_layer_keeps_its_forward_and_later_hooks_run(tiny_llama, monkeypatch):
    llm = tiled_llm(tiny_llama)
    decoder = llm.engine.model.model.model
    # A hook registered after the loop took over (a drafter's, on a layer it reads) still runs.
    seen = []
    handle = decoder.layers[1].register_forward_hook(lambda module, args, output: seen.append(output.shape))
    try:
        llm.generate([[5, 9, 11]], SamplingParams(max_tokens=2, ignore_eos=True))
    finally:
        handle.remove()
    assert len(seen) == 2
    del decoder.forward
    layer_forward = vars(decoder.layers[1]).pop("forward")
    assert fused_layer.use_fused_decoder_loops(llm.engine.model.model) == 0
    decoder.layers[1].forward = layer_forward
    assert fused_layer.use_fused_decoder_loops(llm.engine.model.model) == 1

    # Arguments the loop does not take run the decoder's own forward.
    calls = []
    original = type(decoder).forward
    monkeypatch.setattr(
        type(decoder), "forward", lambda self, **kwargs: calls.append(kwargs) or original(self, **kwargs)
    )
    ids = torch.tensor([[5, 9, 11]])
    with pytest.raises(RuntimeError, match="outside a patchbay forward pass"):
        decoder(input_ids=ids, position_ids=torch.arange(3)[None], output_hidden_states=True)
    assert calls and calls[0]["output_hidden_states"] is True


def test_until_the_kernels_are_built_the_layer_runs_its_own_forward(tiny_llama, monkeypatch):
    llm = tiled_llm(tiny_llama)
    calls = []
    for layer in llm.engine.model.model.model.layers:
        fused = vars(layer)["forward"]
        monkeypatch.setattr(fused, "build", NotBuilt())
    original = type(llm.engine.model.model.model.layers[0]).forward
    monkeypatch.setattr(
        type(llm.engine.model.model.model.layers[0]),
        "forward",
        lambda self, *args, **kwargs: calls.append(self) or original(self, *args, **kwargs),
    )
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    assert calls, "the layers' own forward never ran"
    assert [o.token_ids for o in outputs] == transformers_greedy(tiny_llama, PROMPTS, 4)


class NotBuilt:
    def ready(self):
        return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_between_products_give_the_same_bits_on_the_helpers(dtype):
    """At many rows the norms, activations, rotations and adds between a layer's products run on the products'
    helpers: the same bits as the standalone kernels and torch's adds, in the model's order."""
    if tiles_unavailable(dtype) is not None:
        pytest.skip(tiles_unavailable(dtype))
    ops, linear = fused_ops.load_fused_ops(), load_tile_kernels()
    note_tiles_in_use(2)
    helpers, entry = chunk_runner(), tiled_product_entry()
    assert helpers != 0
    generator = torch.Generator().manual_seed(0)
    rows, width, intermediate, heads, kv_heads, head_size = 97, 512, 768, 8, 2, 64  # 97 x 768: the helpers split it

    def weight(out_features: int, in_features: int) -> torch.Tensor:
        return (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(dtype)

    def tiles(w: torch.Tensor) -> torch.Tensor:
        return tile(w, linear.float32_lanes())

    hidden = torch.randn(rows, width, generator=generator).to(dtype)
    attended = torch.randn(rows, heads * head_size, generator=generator).to(dtype)
    norm_weight = (1 + 0.1 * torch.randn(width, generator=generator)).to(dtype)
    o, gate_up, down = weight(width, heads * head_size), weight(2 * intermediate, width), weight(width, intermediate)
    qkv = weight((heads + 2 * kv_heads) * head_size, width)
    angles = torch.randn(rows, head_size, generator=generator)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    q_size, k_size = heads * head_size, kv_heads * head_size

    def multiply(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return linear.tiled_linear(x, tiles(w), None, w.shape[0], 2)

    def normed(x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        ops.rms_norm(x, norm_weight, 1e-5, out)
        return out

    residual = hidden + multiply(attended, o)
    activated = torch.empty(rows, intermediate, dtype=dtype)
    ops.silu_and_mul(multiply(normed(residual), gate_up), activated)
    expected = residual + multiply(activated, down)
    qkv_rows = multiply(normed(hidden), qkv)
    query = torch.empty(rows, heads, head_size, dtype=dtype)
    key = torch.empty(rows, kv_heads, head_size, dtype=dtype)
    ops.rotary(qkv_rows[:, :q_size], qkv_rows[:, q_size : q_size + k_size], cos, sin, query, key)
    for runner in (helpers, 0):
        output = ops.decoder_attention_output_and_mlp(
            entry,
            runner,
            attended,
            hidden,
            tiles(o),
            None,
            norm_weight,
            1e-5,
            tiles(gate_up),
            None,
            intermediate,
            tiles(down),
            None,
            2,
        )
        assert torch.equal(output, expected)
        got_query, got_key, got_value = ops.decoder_attention_inputs(
            entry,
            runner,
            hidden,
            norm_weight,
            1e-5,
            tiles(qkv),
            None,
            q_size,
            k_size,
            k_size,
            cos,
            sin,
            head_size,
            2,
        )
        assert torch.equal(got_query, query) and torch.equal(got_key, key)
        assert torch.equal(got_value.reshape(rows, -1), qkv_rows[:, q_size + k_size :])
