"""How much memory one step at the largest size the scheduler can build takes beyond the loaded model.

``cache.memory: auto`` gives the KV pool what remains of the memory budget
once the model and a step's activations are counted. The activations are
measured, not estimated: one forward pass of ``num_tokens`` tokens (a
single sequence, the largest prefill chunk a step may hold), the LM head
at ``num_rows`` sampled rows and a softmax over their logits (no KV cache
exists yet: each layer's attention only produces its output, see
:class:`_AttentionOutput`), and the run's sampler over those logits.
The peak is read from the allocator on CUDA and from the kernel's peak
resident-set counter on Linux (reset first through ``/proc/self/clear_refs``,
after freed heap memory is handed back to the kernel).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable
from pathlib import Path

import torch

from patchbay.interfaces import AttentionImpl
from patchbay.worker.cpu.caching_allocator import release_kept_blocks
from patchbay.toolkit.forward_context import ForwardContext, LayerBinding, forward_context
from patchbay.worker.model.hf_model import HFCausalLM

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


class PeakUnmeasurable(RuntimeError):
    """This platform offers no way to read a process's peak memory."""


def step_activation_bytes(
    model: HFCausalLM,
    *,
    num_tokens: int,
    num_rows: int,
    device: torch.device,
    sample: Callable[[torch.Tensor], object] | None = None,
) -> int:
    """Peak bytes one step of ``num_tokens`` tokens and ``num_rows`` sampled rows adds to what is allocated now.

    ``sample`` (the run's sampler, warmed up on the step's logits) runs inside the measure too.
    ``num_rows`` 0: a pooling model's step, which computes no logits.
    """
    num_rows = max(1, min(num_rows, num_tokens)) if num_rows else 0
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    positions = torch.arange(num_tokens, device=device)
    bindings = {
        index: LayerBinding(_AttentionOutput(), torch.empty(0, device=device), 0, spec.layer_name)
        for index, spec in model.layer_specs.items()
    }
    with _PeakMeter(device) as meter:
        with forward_context(ForwardContext(bindings, [None])):
            hidden_states = model.hidden_states(input_ids, positions)
        if num_rows:  # a pooling model samples nothing: no logits
            logits = model.logits(hidden_states[-num_rows:])
            torch.softmax(logits, dim=-1)
            if sample is not None:
                sample(logits)
            del logits
        del hidden_states
    return meter.peak


class _AttentionOutput(AttentionImpl):
    """Stands in for attention: its output tensor, without the arithmetic.

    The backends attend request by request and block by block, so their working memory is small next to
    the step's projections and MLP; computing a dense causal attention over a 2,048-token step would add
    seconds to every start (measured: 6 s on the development machine) for no better figure.
    """

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, metadata: object
    ) -> torch.Tensor:
        # A latent (MLA) layer's output has its value's size, not its query's.
        return query.new_zeros(*query.shape[:-1], value.shape[-1])


class _PeakMeter:
    """Peak memory above the level at entry, while inside the ``with`` block."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0

    def __enter__(self) -> _PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            _return_free_heap_memory()
            try:
                _CLEAR_REFS.write_text("5")  # resets VmHWM, the peak resident set, to the current one
                self._start = _status_bytes("VmRSS")
            except (OSError, ValueError) as exc:
                raise PeakUnmeasurable(f"cannot read this process's peak memory ({exc})") from exc
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = max(0, torch.cuda.max_memory_allocated(self.device) - self._start)
        else:
            self.peak = max(0, _status_bytes("VmHWM") - self._start)


def _return_free_heap_memory() -> None:
    """Hand the pages of freed heap memory back to the kernel (glibc's ``malloc_trim``), where there is glibc.

    Memory an earlier step freed stays resident in the allocator's arenas (and in patchbay's block cache, emptied
    first); a step that reuses it raises no resident-set peak, so without this the meter reads a step's
    activations as nothing.
    """
    release_kept_blocks()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: the peak may then read low


def _status_bytes(field: str) -> int:
    match = re.search(rf"^{field}:\s+(\d+) kB", _STATUS.read_text(), re.MULTILINE)
    if match is None:
        raise ValueError(f"no {field} in {_STATUS}")
    return int(match.group(1)) * 1024
