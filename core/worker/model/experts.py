"""Mixture-of-experts layers as one linear per expert, each routed token multiplied only by the experts it chose.

transformers keeps a MoE layer's experts as two 3-D parameters (``gate_up_proj`` ``[experts, 2 x intermediate,
hidden]``, ``down_proj`` ``[experts, hidden, intermediate]``) and multiplies them through its experts interface.
:func:`split_experts` turns each experts module's parameters into per-expert ``nn.Linear`` views
(:class:`ExpertLinears`, no copy) and gives the module a :class:`RoutedExperts` forward: the router's choices are
grouped by expert (one sort), and each expert that got tokens runs its fused gate/up product over just those rows,
the gated activation, its down product, scales the rows by their routing weights and adds them into place.

As linears, the experts take every CPU path patchbay's linears take (packed tiles in bfloat16, int8 and int4
weights: ``model.quantization``), and tensor-parallel ranks shard each expert's intermediate features
(:mod:`patchbay.worker.parallel.layer_shards`).  Per expert the arithmetic is transformers' eager loop's, experts
in ascending order, so float32 results are its own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from patchbay.toolkit.fused_ops import FUSED_DTYPES, FusedOpsBuild


class ExpertLinears(nn.Module):
    """A MoE layer's experts as linears: expert ``e``'s fused gate/up (``[gate | up]`` rows) and its down product."""

    def __init__(self, gate_up: list[nn.Linear], down: list[nn.Linear]) -> None:
        super().__init__()
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)

    @property
    def num_experts(self) -> int:
        """How many experts the layer has."""
        return len(self.gate_up)


def _linear_of(weight: torch.Tensor) -> nn.Linear:
    """An ``nn.Linear`` whose weight is ``weight`` itself (a view of the experts' 3-D parameter)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def splittable(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module this file knows: gated, 3-D ``gate_up_proj`` and
    ``down_proj`` in ``[out, in]`` order, no biases, no norm after each expert."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.dim() == down.dim() == 3
        and getattr(module, "has_gate", True)
        and not getattr(module, "has_bias", False)
        and not getattr(module, "is_transposed", False)
        and not getattr(module, "has_post_expert_norm", False)
        and gate_up.shape[0] == down.shape[0]
        and gate_up.shape[1] == 2 * down.shape[2]
    )


def split_experts(model: nn.Module) -> int:
    """Give every experts module of ``model`` per-expert linears and a :class:`RoutedExperts` forward; say how
    many modules."""
    count = 0
    module: Any  # a transformers experts module, read by its attribute names
    for module in list(model.modules()):
        if not splittable(module) or "forward" in vars(module):
            continue
        gate_up, down = module.gate_up_proj.detach(), module.down_proj.detach()
        linears = ExpertLinears(
            [_linear_of(gate_up[e]) for e in range(gate_up.shape[0])],
            [_linear_of(down[e]) for e in range(down.shape[0])],
        )
        del module.gate_up_proj, module.down_proj  # the linears' views hold the storage now
        module.expert_linears = linears
        module.forward = RoutedExperts(module, linears)
        count += 1
    return count


class RoutedExperts:
    """The ``forward`` of one experts module split by :func:`split_experts`: ``(hidden [tokens, hidden],
    top_k_index [tokens, k], top_k_weights [tokens, k])`` to the weighted sum of each token's experts."""

    def __init__(self, module: Any, linears: ExpertLinears) -> None:
        self.module = module
        self.linears = linears
        act = getattr(module, "act_fn", None)
        self.silu = type(act).__name__ in ("SiLU", "SiLUActivation") and type(module)._apply_gate.__name__ == (
            "_default_apply_gate"
        )
        self.build = FusedOpsBuild.shared() if self.silu else None

    def _gated(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The expert's activation of its gate times its up features (the fused SiLU-and-multiply kernel where
        it applies, else the module's own ``_apply_gate``)."""
        ops = self.build.ready() if self.build is not None else None
        if ops is not None and gate_up.device.type == "cpu" and gate_up.dtype in FUSED_DTYPES:
            gate_up = gate_up.contiguous()
            out = torch.empty(*gate_up.shape[:-1], gate_up.shape[-1] // 2, dtype=gate_up.dtype)
            ops.silu_and_mul(gate_up, out)
            return out
        return self.module._apply_gate(gate_up)

    def __call__(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        num_experts = self.linears.num_experts
        num_tokens = top_k_index.shape[0]
        # The (choice, token) pairs, choice-major as transformers' loop takes them, grouped by expert: tokens
        # [0, 1] choosing experts [[2, 0], [2, 1]] are pairs [2, 2, 0, 1] (first choices, then second ones);
        # order [2, 3, 0, 1] (expert 0's, 1's, then 2's two), counts [1, 1, 2].  Within an expert the rows keep
        # transformers' order, so its products round alike.
        chosen = top_k_index.t().reshape(-1)
        order = torch.argsort(chosen, stable=True)
        counts = torch.bincount(chosen, minlength=num_experts).tolist()
        tokens = order % num_tokens
        weights = top_k_weights.t().reshape(-1)[order]
        output = torch.zeros_like(hidden_states)
        start = 0
        for expert, count in enumerate(counts[:num_experts]):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            states = hidden_states.index_select(0, rows)
            down = self.linears.down[expert](self._gated(self.linears.gate_up[expert](states)))
            output.index_add_(0, rows, (down * weights[start : start + count, None]).to(output.dtype))
            start += count
        return output
