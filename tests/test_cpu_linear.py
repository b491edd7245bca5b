"""Row-split linears: the same products as torch's own, only on every thread."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import patchbay
from patchbay.cpu_linear import RowSplitLinear, use_row_split_linears
from patchbay.sampling_params import SamplingParams
from patchbay.settings import ConfigError
from tiny_models import transformers_greedy


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 48), (1, 3, 48), (2, 5, 48), (700, 48)])
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
        assert (llm.engine.row_split_linears > 0) == (kernel == "row_split")
        outputs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        tokens[kernel] = [o.token_ids for o in outputs]
    assert tokens["row_split"] == tokens["torch"] == transformers_greedy(tiny_llama, prompts, 12)


def test_row_split_on_bfloat16_is_refused_naming_the_setting(tiny_llama):
    with pytest.raises(ConfigError, match="runtime.linear_kernel"):
        patchbay.LLM(model__path=str(tiny_llama), model__dtype="bfloat16", runtime__linear_kernel="row_split")
