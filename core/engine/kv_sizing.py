"""``cache.memory: auto``: the KV pool gets what remains of the memory budget after the model and a step.

The budget is ``cache.memory_utilization`` of the device's memory (on the
CPU, the machine's, or its cgroup's limit). From it come off what this
engine's model added to the process (each tensor-parallel rank holding as
much) and the peak activations of the largest step, measured by running it
(:mod:`patchbay.worker.memory_profile`). What the process held before the
engine began loading (another engine, an embedder's own data) is not this
engine's to count against its budget; it is still not free, and the pool
never exceeds what is free right now, nor what ``scheduler.max_num_seqs``
requests of ``max_model_len`` tokens could ever fill.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence

import torch

from patchbay.contract.settings import ConfigError, ConfigProblem, Settings
from patchbay.engine.memory_check import available_memory, format_bytes
from patchbay.scheduling.kv_cache_spec import KVCacheGroup

DEFAULT_UTILIZATION = {"cuda": 0.9, "cpu": 0.5}
"""``cache.memory_utilization`` when unset: a GPU is the run's own; a CPU's memory is shared with the machine."""


@dataclass(frozen=True)
class KVSizing:
    """How ``cache.memory: auto`` sized the pool, per rank, and why."""

    num_blocks: int
    tokens: int
    kv_bytes: int
    """The pool's bytes, with what a drafter's own KV cache adds per block."""
    budget: int
    """``cache.memory_utilization`` of the device's memory, for every rank together."""
    model_bytes: int
    """What each rank's model added to the process before the KV pool (weights, buffers, adapters, drafter)."""
    activation_bytes: int
    """Peak activations of the largest step, measured."""
    step_tokens: int
    ranks: int
    limited_by: str
    """``budget``, ``free memory`` or ``max_num_seqs x max_model_len``."""

    def describe(self) -> str:
        """One line for the log and the run summary."""
        per_rank = " per rank" if self.ranks > 1 else ""
        return (
            f"{self.num_blocks} blocks ({self.tokens} tokens, {format_bytes(self.kv_bytes)}){per_rank}, "
            f"limited by {self.limited_by}: budget {format_bytes(self.budget)}, model {format_bytes(self.model_bytes)}"
            f"{per_rank}, activations {format_bytes(self.activation_bytes)} at a {self.step_tokens}-token step"
        )


def size_kv_pool(
    settings: Settings,
    groups: Sequence[KVCacheGroup],
    *,
    device: torch.device,
    max_model_len: int,
    activation_bytes: int,
    step_tokens: int,
    held_before_load: int,
    ranks: int = 1,
    encoder_cache_bytes: int = 0,
    drafter_bytes_per_block: int = 0,
) -> KVSizing:
    """The pool's block count (per group, null block included) for ``cache.memory: auto``.

    ``held_before_load`` is :func:`memory_in_use` taken before the engine
    loaded its model: what the model (and a drafter loaded with it) holds is
    the growth since.  ``encoder_cache_bytes``: a vision-language model's
    encoder cache, full, reserved beside the step.  ``drafter_bytes_per_block``:
    what a drafter's own KV cache adds to each block of the pool.
    """
    cache = settings.cache
    utilization = cache.memory_utilization or DEFAULT_UTILIZATION.get(device.type, DEFAULT_UTILIZATION["cpu"])
    total = device_memory(device)
    if total is None:
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    "cache.memory",
                    f"auto cannot tell how much {device.type} memory "
                    "this machine has; give cache.memory (e.g. 2GiB) or cache.num_blocks",
                )
            ]
        )
    budget = int(utilization * total)
    held = max(0, memory_in_use(device) - held_before_load)
    beside = activation_bytes + encoder_cache_bytes
    room = budget - ranks * (held + beside)
    limited_by = "budget"
    free = available_memory(device)
    if free is not None and free - ranks * beside < room:
        room, limited_by = free - ranks * beside, "free memory"
    bytes_per_block = sum(len(group.layer_names) * group.spec.page_size_bytes for group in groups)
    block_size = groups[0].spec.block_size
    num_blocks = max(0, room // ranks) // (bytes_per_block + drafter_bytes_per_block)
    useful = settings.scheduler.max_num_seqs * -(-max_model_len // block_size) + 1  # + the null block
    if num_blocks > useful:
        num_blocks, limited_by = useful, "max_num_seqs x max_model_len"
    if num_blocks < 2:
        raise ConfigError(
            [
                ConfigProblem(
                    "<run>",
                    "cache.memory_utilization",
                    f"cache.memory auto leaves no room for the KV cache: {utilization:g} of {format_bytes(total)} is "
                    f"{format_bytes(budget)}, the loaded model holds {format_bytes(held)}"
                    f"{' per rank' if ranks > 1 else ''} and a "
                    f"{step_tokens}-token step {format_bytes(activation_bytes)} more"
                    + (
                        f", the encoder cache {format_bytes(encoder_cache_bytes)} (scheduler.encoder_cache_size)"
                        if encoder_cache_bytes
                        else ""
                    )
                    + (f", and {format_bytes(free)} is free" if free is not None else "")
                    + "; raise cache.memory_utilization, lower scheduler.max_num_batched_tokens, or give cache.memory",
                )
            ]
        )
    return KVSizing(
        num_blocks,
        (num_blocks - 1) * block_size,
        num_blocks * (bytes_per_block + drafter_bytes_per_block),
        budget,
        held,
        activation_bytes,
        step_tokens,
        ranks,
        limited_by,
    )


def device_memory(device: torch.device) -> int | None:
    """All of ``device``'s memory: the GPU's, or the machine's (capped by this process's cgroup limit)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    total = _meminfo_bytes("MemTotal")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            total = int(limit) if total is None else min(total, int(limit))
    except (OSError, ValueError):
        pass
    return total


def memory_in_use(device: torch.device) -> int:
    """What this process holds on ``device``: the allocator's bytes on a GPU, the resident set on the CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    try:
        match = re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.MULTILINE)
    except OSError:
        match = None
    return int(match.group(1)) * 1024 if match else 0


def _meminfo_bytes(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None
