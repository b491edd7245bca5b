"""The model's cost (FLOPs and bytes per token) and the ceilings the machine puts on it.

Two ceilings frame every figure the bench prints:

- **bandwidth** (batch-1 decode): each generated token reads every weight once
  (the lm head included) plus the request's KV cache, so a decode step cannot
  take less than those bytes divided by the measured read bandwidth;
- **compute** (many requests): a workload needs the FLOPs of every token it
  runs through the model, the lm head only where a token is sampled (patchbay
  computes logits only there), and causal attention over each token's
  context; at the measured GEMM rate that is the least time it can take.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from patchbay.bench.machine import MachineLimits
from patchbay.bench.workloads import Workload
from patchbay.worker.cpu.quantization import INT4_GROUP_SIZE, int4_tiles_unavailable

FLOAT_BITS = {"float32": 32, "bfloat16": 16, "float16": 16}


def bits_per_weight(dtype: str, quantization: str | None = None) -> float:
    """Bits a decode step reads per weight stored as ``dtype`` (``float32``, ``bfloat16``, ``float16``) or, with
    ``quantization`` ``int8`` / ``w8a8`` / ``int4``, as patchbay's integers: int8 and w8a8 with one scale per
    output row (counted as nothing), int4 with a scale and a minimum per group of :data:`INT4_GROUP_SIZE`
    weights: float16 in int4 tiles, of ``dtype`` in torch's int4 kernel where the tiles cannot run."""
    if dtype not in FLOAT_BITS:
        raise ValueError(f"bench roofline: no bit width for dtype {dtype!r} (known: {', '.join(FLOAT_BITS)})")
    if quantization in (None, "none"):
        return float(FLOAT_BITS[dtype])
    if quantization in ("int8", "w8a8"):
        return 8.0
    if quantization == "int4":
        scale_bits = 16 if int4_tiles_unavailable() is None else FLOAT_BITS[dtype]
        return 4.0 + 2 * scale_bits / INT4_GROUP_SIZE
    raise ValueError(f"bench roofline: no bit width for quantization {quantization!r} (known: int8, w8a8, int4)")


if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class ModelCost:
    linear_params: int
    """Weights of the decoder's linear layers (attention projections, MLP), read once per step."""
    lm_head_params: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    bytes_per_param: int

    @classmethod
    def of(cls, model: PreTrainedModel) -> ModelCost:
        """Count a transformers causal LM's parameters by role."""
        head = model.get_output_embeddings()
        linear = sum(
            module.weight.numel() for module in model.modules() if isinstance(module, nn.Linear) and module is not head
        )
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            linear,
            head.weight.numel(),
            config.num_hidden_layers,
            heads,
            getattr(config, "num_key_value_heads", None) or heads,
            head_dim,
            head.weight.element_size(),
        )

    def attention_flops(self, context: int) -> float:
        """FLOPs of one token's attention over ``context`` positions (scores and weighted sum), all layers."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * context

    def request_flops(self, prompt_tokens: int, generated_tokens: int) -> float:
        """FLOPs to prefill a prompt and generate ``generated_tokens`` (the last one is never fed back)."""
        fed = prompt_tokens + max(generated_tokens - 1, 0)
        # Causal attention: token i (0-based) attends to i + 1 positions.
        attention = self.attention_flops(1) * fed * (fed + 1) / 2
        return 2.0 * self.linear_params * fed + 2.0 * self.lm_head_params * generated_tokens + attention

    def workload_flops(self, workload: Workload, reused_prompt_tokens: int = 0) -> float:
        """All requests' FLOPs, less what a prefix cache spares for ``reused_prompt_tokens``.

        Reused tokens are each request's first ones (spread evenly over the
        requests): neither their linear layers nor their own attention run.
        """
        total = sum(self.request_flops(len(r.prompt_token_ids), r.max_tokens) for r in workload.requests)
        per_request = reused_prompt_tokens / len(workload.requests)
        spared_attention = self.attention_flops(1) * per_request * (per_request + 1) / 2 * len(workload.requests)
        return total - 2.0 * self.linear_params * reused_prompt_tokens - spared_attention

    def decode_bytes(self, context: int, weight_bytes: float | None = None) -> float:
        """Bytes one batch-1 decode step must read: all weights (``weight_bytes``, default the loaded model's) and
        the request's K and V (at the loaded model's element size)."""
        kv = 2 * self.num_layers * self.num_kv_heads * self.head_dim * context * self.bytes_per_param
        return float((self.weight_bytes() if weight_bytes is None else weight_bytes) + kv)

    def weight_bytes(self, bits: float | None = None) -> float:
        """Bytes of the weights one decode step reads (every linear and the lm head) at ``bits`` per weight
        (default: the loaded model's element size)."""
        per_weight = bits / 8 if bits is not None else self.bytes_per_param
        return (self.linear_params + self.lm_head_params) * per_weight

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Roofline:
    cost: ModelCost
    machine: MachineLimits

    def decode_ms_floor(self, context: int, weight_bytes: float | None = None) -> float:
        """Least batch-1 decode time per token at ``context`` tokens, from the read bandwidth, for weights of
        ``weight_bytes`` (default: the loaded model's; an engine's integer weights read fewer)."""
        return self.cost.decode_bytes(context, weight_bytes) / (self.machine.read_bandwidth_gb_s * 1e9) * 1e3

    def stream_fraction(self, weight_bytes: float, seconds_per_token: float) -> float:
        """Share of the measured STREAM bandwidth a decode reading ``weight_bytes`` per token in
        ``seconds_per_token`` uses: weight bytes per token / bandwidth / seconds per token (1.0: at the roofline)."""
        return weight_bytes / (self.machine.stream_bandwidth_gb_s * 1e9) / seconds_per_token

    def compute_seconds_floor(self, workload: Workload, reused_prompt_tokens: int = 0) -> float:
        """Least time the workload's FLOPs take at the measured GEMM rate (see :meth:`ModelCost.workload_flops`)."""
        return self.cost.workload_flops(workload, reused_prompt_tokens) / (self.machine.gemm_gflop_s * 1e9)

    def describe(self) -> list[str]:
        cost, machine = self.cost, self.machine
        per_token = 2.0 * cost.linear_params
        return [
            f"machine: {machine.description}; {machine.threads} threads",
            f"measured: read bandwidth {machine.read_bandwidth_gb_s:.1f} GB/s, STREAM copy "
            f"{machine.copy_bandwidth_gb_s:.1f} GB/s, triad {machine.triad_bandwidth_gb_s:.1f} GB/s, float32 GEMM "
            f"{machine.gemm_gflop_s:.1f} GFLOP/s",
            f"model: {cost.linear_params / 1e6:.1f}M linear + {cost.lm_head_params / 1e6:.1f}M lm-head parameters, "
            f"{per_token / 1e6:.0f} MFLOP per token (+{2 * cost.lm_head_params / 1e6:.0f} where sampled)",
            f"ceilings: batch-1 decode {self.decode_ms_floor(128):.1f} ms/token (bandwidth), "
            f"{machine.gemm_gflop_s * 1e9 / per_token:.0f} tokens/s through the model (compute, short contexts)",
        ]
