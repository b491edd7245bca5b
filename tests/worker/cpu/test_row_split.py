"""Row-split linears: the same products as torch's own, only on every thread."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import patchbay
from patchbay.contract.settings import ConfigError
from patchbay.sampling_params import SamplingParams
from patchbay.worker.cpu.row_split import RowSplitLinear, use_row_split_linears
from patchbay.worker.cpu.fused_projections import fuse_shared_input_projections
from tiny_models import transformers_greedy


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (1, 3, 48), (2, 5, 48), (300, 48)])
@pytest.mark.parametrize("slices", [2, 4])
def test_row_split_matches_torch_linear(shape, bias, slices):
    torch.manual_seed(0)
    linear = nn.Linear(48, 96, bias=bias)
    inputs = torch.randn(*shape)
    expected = F.linear(inputs, linear.weight, linear.bias)
    got = RowSplitLinear(linear, slices, max_rows=512)(inputs)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_only_eligible_linears_are_split():
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 5), nn.Linear(5, 4).to(torch.bfloat16))
    assert use_row_split_linears(model, threads=1) == 0
    assert use_row_split_linears(model, threads=2) == 1  # 5 outputs do not split in two; bf16 is left alone
    assert isinstance(model[0].forward, RowSplitLinear)
    assert not isinstance(model[1].forward, RowSplitLinear)


def test_greedy_tokens_are_the_same_with_either_kernel_and_match_transformers(tiny_llama):
    prompts = [[5, 9, 11, 3, 7], list(range(20, 53)), [42]]
    tokens = {}
    for kernel in ("torch", "row_split"):
        llm = patchbay.LLM(model__path=str(tiny_llama), runtime__threads=2, runtime__linear_kernel=kernel)
        assert (llm.engine.linear_paths.row_split > 0) == (kernel == "row_split")
        outputs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        tokens[kernel] = [o.token_ids for o in outputs]
    assert tokens["row_split"] == tokens["torch"] == transformers_greedy(tiny_llama, prompts, 12)


def test_row_split_on_bfloat16_is_refused_naming_the_setting(tiny_llama):
    with pytest.raises(ConfigError, match="runtime.linear_kernel"):
        patchbay.LLM(model__path=str(tiny_llama), model__dtype="bfloat16", runtime__linear_kernel="row_split")


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 4), nn.Linear(8, 4)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_fused_projections_give_each_linear_its_own_output(rows):
    torch.manual_seed(0)
    layer = _Attention()
    expected_weights = [m.weight.clone() for m in (layer.q_proj, layer.k_proj, layer.v_proj)]
    inputs, other = torch.randn(rows, 8), torch.randn(rows, 8)
    expected = [F.linear(inputs, m.weight, m.bias) for m in (layer.q_proj, layer.k_proj, layer.v_proj)]
    assert fuse_shared_input_projections(layer) == 1
    for weight, module in zip(expected_weights, (layer.q_proj, layer.k_proj, layer.v_proj), strict=True):
        assert torch.equal(module.weight, weight)
    # Called in any order on one input, each returns its own projection.
    got = {name: getattr(layer, name)(inputs) for name in ("v_proj", "q_proj", "k_proj")}
    for name, want in zip(("q_proj", "k_proj", "v_proj"), expected, strict=True):
        torch.testing.assert_close(got[name], want)
    # A kept output is never handed to a call on another input, nor after the input changed in place.
    layer.q_proj(inputs)
    torch.testing.assert_close(layer.k_proj(other), F.linear(other, *_params(layer.k_proj)))
    layer.q_proj(inputs)
    inputs.mul_(2)
    torch.testing.assert_close(layer.v_proj(inputs), F.linear(inputs, *_params(layer.v_proj)))


def _params(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    return linear.weight, linear.bias


def test_greedy_tokens_are_the_same_with_and_without_fused_projections(tiny_llama, monkeypatch):
    from patchbay.engine import builder

    # Without a machine tuning the fused path runs up to its default row limit, whatever this machine measures.
    monkeypatch.setattr(builder, "machine_tuning", lambda settings, model_dir, device: None)
    prompts = [[5, 9, 11, 3, 7], list(range(20, 60)), [42]]
    tokens = {}
    for fuse in (False, True):
        llm = patchbay.LLM(model__path=str(tiny_llama), runtime__threads=2, runtime__fuse_projections=fuse)
        assert (llm.engine.linear_paths.fused_groups > 0) == fuse
        outputs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        tokens[fuse] = [o.token_ids for o in outputs]
    assert tokens[True] == tokens[False] == transformers_greedy(tiny_llama, prompts, 12)


def test_steps_of_few_tokens_run_on_one_thread_and_the_threads_come_back(tiny_llama):
    torch.set_num_threads(2)
    llm = patchbay.LLM(model__path=str(tiny_llama), runtime__threads=2, runtime__single_thread_max_tokens=4)
    assert llm.engine.single_thread_max_tokens == 4
    model = llm.engine.runner.model
    forward = model.hidden_states
    seen: list[tuple[int, int]] = []

    def recording(input_ids, positions, inputs_embeds=None):
        seen.append((input_ids.shape[0], torch.get_num_threads()))
        return forward(input_ids, positions, inputs_embeds)

    model.hidden_states = recording
    llm.generate([list(range(20, 53)), [5, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert seen[0] == (35, 2)  # both prompts in one step: more than 4 tokens, every thread
    assert {threads for tokens, threads in seen[1:]} == {1} and all(tokens <= 4 for tokens, _ in seen[1:])
    assert torch.get_num_threads() == 2
