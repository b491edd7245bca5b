"""The fused CPU ops: RMS norm, SiLU- and GELU-and-multiply, rotary embeddings and whole Llama-style decoder layers
as C++ kernels, and the samplers' one-pass argmax and random draw over a batch's logits.

The kernels live in ``csrc/fused_ops.cpp`` and build like every toolkit extension
(:mod:`patchbay.toolkit.native_build`); :class:`FusedOpsBuild` builds them in the background while callers use
torch's ops.  :func:`argmax_rows` and :func:`inverse_cdf_rows` are what samplers call; the worker installs the
norm, MLP and rotary kernels into models (``runtime.fused_ops``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from patchbay.toolkit.native_build import CSRC, NATIVE_CFLAGS, BackgroundBuild, NativeExtension, build_at_install

__all__ = ["FUSED_DTYPES", "FusedOpsBuild", "argmax_rows", "inverse_cdf_rows", "load_fused_ops"]

FUSED_DTYPES = (torch.float32, torch.bfloat16)
"""The dtypes the fused ops compute in (inputs of others run torch's own ops)."""

EXTENSION = NativeExtension("patchbay_fused_ops", (CSRC / "fused_ops.cpp",), (*NATIVE_CFLAGS, "-ffp-contract=off"))
"""The kernels (SIMD registers where the CPU has AVX-512 or AVX2, plain loops elsewhere and for row tails),
built with no multiply-add contraction, so each product and sum rounds where transformers' ops round it."""


@functools.cache
def load_fused_ops() -> Any:
    """Build the extension (once per installation and CPU) and import it."""
    return EXTENSION.load()


class FusedOpsBuild(BackgroundBuild):
    """:func:`load_fused_ops` in a background thread, shared by every model of the process."""

    def __init__(self) -> None:
        super().__init__(lambda: load_fused_ops(), "the C++ norm, activation and rotary kernels")


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(dim=-1)`` of a 2-D tensor (a batch's logits): the same indices (the first largest, or the first
    NaN), from patchbay's one-pass kernel where the rows are CPU float32 or bfloat16 and the engine's kernels
    are built (torch's reduction took 2-6 ms on 64 rows of a 49,152-token vocabulary); torch's elsewhere."""
    build = FusedOpsBuild.started()
    ops = build.ready() if build is not None else None
    if ops is None or x.dim() != 2 or x.device.type != "cpu" or x.dtype not in FUSED_DTYPES or x.shape[1] == 0:
        return x.argmax(dim=-1)
    return ops.argmax_rows(x.contiguous())


def inverse_cdf_rows(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of ``weights`` (``[rows, n]``, non-negative, rows need not sum to 1), int64 ``[rows]``:
    the row's first token whose cumulative weight exceeds ``uniform[row]`` (float64 in ``[0, 1)``) times the
    row's total.

    A token of weight 0 is never drawn; where ``u * total`` rounds up to the total, the last token
    of positive weight is; a row of zeros draws its last token.

    The sums are float64.  On the CPU, with the engine's kernels built, one C++ pass over each row (about
    10 us for a 49,152-token vocabulary); elsewhere torch's cumulative sum and search, which allocate the rows'
    float64 sums (~30 ms for 64 such rows on a 2-core CPU).
    """
    build = FusedOpsBuild.started()
    ops = build.ready() if build is not None else None
    if ops is not None and weights.dim() == 2 and weights.device.type == "cpu" and weights.shape[1] > 0:
        return ops.inverse_cdf_rows(weights.to(torch.float32).contiguous(), uniform.to(torch.float64))
    cumulative = weights.to(torch.float64).cumsum(dim=-1)
    total = cumulative[:, -1:]
    target = torch.minimum(uniform.to(cumulative).unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cumulative, target, right=True).squeeze(1).clamp_max_(weights.shape[1] - 1)


def main() -> int:
    """Build the kernels now (the Makefile runs this at install time); exit 0 also where they cannot be built."""
    return build_at_install(load_fused_ops, "the norm, activation and rotary kernels", EXTENSION.build_directory)


if __name__ == "__main__":
    raise SystemExit(main())
