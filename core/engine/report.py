"""What an engine reports about its run: counters over its life, and a typed snapshot for run summaries."""

from __future__ import annotations

from dataclasses import dataclass

from patchbay.scheduling.encoder_cache_manager import EncoderCacheStats
from patchbay.scheduling.scheduler import KVConnectorStats
from patchbay.scheduling.structured_output import CompileStats
from patchbay.worker.cpu.fused_modules import FusedModules
from patchbay.worker.spec_decode import SpecDecodeStats
from patchbay.worker.cpu.tuning import LinearPaths


@dataclass
class EngineStats:
    """Counters over the engine's life."""

    num_steps: int = 0
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    max_batches_in_flight: int = 0
    """With pipeline stages: the most batches scheduled at once whose outputs were not back (1: lockstep)."""
    num_overlapped_batches: int = 0
    """With pipeline stages: batches whose first stage ran while an earlier batch's output was not back."""


@dataclass(frozen=True)
class EngineReport:
    """A snapshot of an engine (``Engine.report()``): its counters, where step time went, and how it was built.

    What ``patchbay run`` prints at the end of a job; every field is there
    for every engine (``None`` where the run has no such part).
    """

    stats: EngineStats
    step_timings: dict[str, float]
    """Seconds per step phase since the last reset, in step order (``Engine.step_timings``)."""
    attention_backend: str
    """The attention backend running (``attention.name`` resolved)."""
    dtype: str
    kv_cache_dtype: str
    """The KV cache's dtype: the model's, or ``int8`` (``cache.dtype``)."""
    device: str
    heap: str
    """Where torch's CPU tensors come from and what was done to glibc's thresholds."""
    machine_defaults: str | None
    """The CPU's measured defaults the run used, described (``None``: no setting was left to them)."""
    kv_sizing: str | None
    """How ``cache.memory: auto`` sized the KV pool, described (``None``: sized by the settings)."""
    linear_paths: LinearPaths
    """How many linears (or projection groups) each CPU path took."""
    quantized_linears: int
    single_thread_max_tokens: int
    """Steps of at most this many tokens run on one CPU thread."""
    fused_modules: FusedModules
    kv_connector: KVConnectorStats | None
    """What the KV connector did (``None``: the run has no ``kv_connector:``)."""
    spec_decode: SpecDecodeStats
    """Drafted and accepted tokens (all zero without ``spec_decode:``)."""
    grammars: CompileStats
    """Grammar compilations: how many, how long, failed, past ``structured_output.compile_timeout``."""
    architecture: str = ""
    """The architecture plugin that built the model (``model.architecture`` resolved)."""
    kv_bytes_per_token: int = 0
    """Bytes one token takes in every layer's KV cache on this rank (an MLA model's latent rows count once)."""
    encoder_cache: EncoderCacheStats | None = None
    """Images encoded and shared through the encoder cache (``None``: the model takes text only); the encoder's
    time is the ``encoder`` phase of :attr:`step_timings`."""
