"""The AMX prefill kernel (``amx_prefill_attention``) against a float64 dense oracle, and torch_sdpa's use of it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from decode_kernels import needs_kernel
from patchbay.plugins.attention import _cpu_kernel, torch_sdpa
from patchbay.testing.attention import AttentionCase, check_attention
from patchbay.toolkit.tiles import load_tile_kernels

pytestmark = needs_kernel


@pytest.fixture(scope="module")
def kernel():
    built = _cpu_kernel.load_kernel()
    if not built.amx_prefill_supported():
        pytest.skip("no AMX bfloat16 tiles here (or the process was not granted them)")
    return built


def _oracle(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context_len: int, scale: float):
    """float64 causal attention: query row i sees keys 0 .. context_len + i; query heads share KV heads in order."""
    q_len, heads, _ = query.shape
    num_keys, kv_heads, _ = keys.shape
    group = heads // kv_heads
    sees = torch.arange(num_keys)[None, :] <= context_len + torch.arange(q_len)[:, None]
    return F.scaled_dot_product_attention(
        query.double().transpose(0, 1),
        keys.double().repeat_interleave(group, 1).transpose(0, 1),
        values.double().repeat_interleave(group, 1).transpose(0, 1),
        attn_mask=sees,
        scale=scale,
    ).transpose(0, 1)


def _torch_error(query, keys, values, context_len, scale, expected) -> tuple[float, float]:
    """torch's own bfloat16 attention's largest and mean error on the same inputs: the bar ours is held to."""
    sees = torch.arange(keys.shape[0])[None, :] <= context_len + torch.arange(query.shape[0])[:, None]
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1)[None],
        keys.transpose(0, 1)[None],
        values.transpose(0, 1)[None],
        attn_mask=sees,
        scale=scale,
        enable_gqa=True,
    )[0].transpose(0, 1)
    error = (attended.double() - expected).abs()
    return error.max().item(), error.mean().item()


@pytest.mark.parametrize(
    "q_len, context_len, heads, kv_heads, spread",
    [
        (1, 0, 3, 1, 1.0),  # one row: a tile of 15 padding rows
        (37, 0, 9, 3, 1.0),  # a fresh prefill, rows and keys not a multiple of 16 or 32
        (300, 33, 6, 2, 4.0),  # after cached tokens, peaked scores
        (64, 700, 9, 3, 8.0),  # many cached keys, sharply peaked
        (257, 1000, 4, 4, 1.0),  # no grouping
    ],
)
@pytest.mark.parametrize("pool_threads", [0, 2])
def test_amx_prefill_attends_like_the_dense_oracle(kernel, q_len, context_len, heads, kv_heads, spread, pool_threads):
    generator = torch.Generator().manual_seed(q_len + context_len)
    num_keys = context_len + q_len
    # Keys drift upwards along the sequence: later blocks keep bringing larger scores (the running maximum moves).
    drift = torch.linspace(0, 2, num_keys)[:, None, None]
    query = (torch.randn(q_len, heads, 64, generator=generator) * spread + 0.5).bfloat16()
    keys = (torch.randn(num_keys, kv_heads, 64, generator=generator) + drift).bfloat16()
    values = torch.randn(num_keys, kv_heads, 64, generator=generator).bfloat16()
    pool = load_tile_kernels().chunk_runner() if pool_threads else 0  # 0: torch's threads
    output = torch.full((q_len, heads, 64), float("nan"), dtype=torch.bfloat16)
    kernel.amx_prefill_attention(query, keys, values, context_len, 0.125, output, pool, pool_threads or 2)
    expected = _oracle(query, keys, values, context_len, 0.125)
    error = (output.double() - expected).abs()
    torch_max, torch_mean = _torch_error(query, keys, values, context_len, 0.125, expected)
    # bfloat16 output and probabilities: within torch's own bfloat16 error, with room for other roundings.
    assert error.max().item() <= 2 * torch_max + 1e-3, (error.max().item(), torch_max)
    assert error.mean().item() <= 1.3 * torch_mean + 1e-5, (error.mean().item(), torch_mean)


def test_strided_inputs_and_an_output_view_are_read_and_written_in_place(kernel):
    """The backend hands the kernel views: query, keys and values split from one fused projection, and the
    output rows of one request in the step's output."""
    generator = torch.Generator().manual_seed(0)
    q_len, heads, kv_heads = 40, 4, 2
    fused = torch.randn(q_len, (heads + 2 * kv_heads) * 64, generator=generator).bfloat16()
    query = fused[:, : heads * 64].view(q_len, heads, 64)
    keys = fused[:, heads * 64 : (heads + kv_heads) * 64].view(q_len, kv_heads, 64)
    values = fused[:, (heads + kv_heads) * 64 :].view(q_len, kv_heads, 64)
    step_output = torch.zeros(q_len + 10, heads, 64, dtype=torch.bfloat16)
    kernel.amx_prefill_attention(query, keys, values, 0, 0.125, step_output[5 : 5 + q_len], 0, 2)
    expected = _oracle(query, keys, values, 0, 0.125)
    torch.testing.assert_close(step_output[5 : 5 + q_len].double(), expected, atol=2e-2, rtol=2e-2)
    assert not step_output[:5].any() and not step_output[5 + q_len :].any()


def test_inputs_the_kernel_does_not_take_are_refused_by_name(kernel):
    query = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    keys = torch.zeros(4, 1, 64, dtype=torch.bfloat16)
    output = torch.empty_like(query)
    with pytest.raises(RuntimeError, match="amx_prefill_attention: bfloat16 CPU tensors"):
        kernel.amx_prefill_attention(query.float(), keys, keys, 0, 0.1, output, 0, 1)
    with pytest.raises(RuntimeError, match="amx_prefill_attention: bfloat16 CPU tensors"):
        kernel.amx_prefill_attention(torch.zeros(4, 2, 128, dtype=torch.bfloat16), keys, keys, 0, 0.1, output, 0, 1)
    with pytest.raises(RuntimeError, match="amx_prefill_attention: 4 keys for 2 cached and 4 new tokens"):
        kernel.amx_prefill_attention(query, keys, keys, 2, 0.1, output, 0, 1)
    with pytest.raises(RuntimeError, match="amx_prefill_attention: a positive scale expected, got -0.1"):
        kernel.amx_prefill_attention(query, keys, keys, 0, -0.1, output, 0, 1)


def _long_bfloat16_case(cache_dtype: str | None) -> AttentionCase:
    return AttentionCase(
        num_computed=(0, 300),
        num_new=(torch_sdpa.KERNEL_MAX_QUERY_LEN + 9, torch_sdpa.KERNEL_MAX_QUERY_LEN + 40),
        dtype="bfloat16",
        num_heads=6,
        num_kv_heads=2,
        cache_dtype=cache_dtype,
    )


@pytest.mark.parametrize("cache_dtype", [None, "int8"])
def test_torch_sdpa_attends_long_bfloat16_chunks_through_amx(kernel, cache_dtype, monkeypatch):
    calls: list[int] = []
    original = torch_sdpa.TorchSDPAImpl._amx_prefill_kernel

    def spy(self, *args):
        found = original(self, *args)
        calls.append(found is not None)
        return found

    monkeypatch.setattr(torch_sdpa.TorchSDPAImpl, "_amx_prefill_kernel", spy)
    options = torch_sdpa.TorchSDPABackend.Options(decode_kernel="paged_cpp")
    check_attention(torch_sdpa.TorchSDPABackend, torch_sdpa.TorchSDPAMetadataBuilder, _long_bfloat16_case(cache_dtype),
                    options=options)  # fmt: skip
    assert calls and all(calls)  # a fresh chunk and one after cached tokens, both through the kernel


@pytest.mark.parametrize("why", ["prefill_kernel sdpa", "no AMX"])
def test_long_chunks_stay_on_sdpa_where_the_option_or_the_cpu_says_so(why, monkeypatch):
    built = _cpu_kernel.load_kernel()
    used = []
    monkeypatch.setattr(built, "amx_prefill_attention", lambda *args: used.append(args))
    if why == "no AMX":  # a CPU without AMX tiles, faked
        monkeypatch.setattr(built, "amx_prefill_supported", lambda: False)
    choice = "sdpa" if why == "prefill_kernel sdpa" else "auto"
    options = torch_sdpa.TorchSDPABackend.Options(decode_kernel="paged_cpp", prefill_kernel=choice)
    check_attention(torch_sdpa.TorchSDPABackend, torch_sdpa.TorchSDPAMetadataBuilder, _long_bfloat16_case(None),
                    options=options)  # fmt: skip
    assert not used
